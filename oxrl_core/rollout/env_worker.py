"""Each episode's environment in a worker process of its own, killed when a call runs past its time limit.

Why processes: Python cannot kill a thread. An environment call that busy-loops on a thread is "timed out" but
keeps spinning for the rest of the run, one more thread per timed-out episode, each taking the GIL and a core
from the trainer. A process can be killed: the call counts as a timeout and nothing of it is left running.

How, and what an episode costs:

- one *host* process per trainer process (``python -m oxrl_core.rollout.env_worker``, in a session of its own, started
  on first use): it imports the environment's module once, builds one instance of it (so that per-process work —
  imports, the python environment's sandbox probe — is done once, and a constructor that fails is reported
  once), freezes its objects for the garbage collector, and then forks one worker per episode on request. A fork
  of this small single-threaded process costs about a millisecond; the trainer (torch, CUDA, its threads) is
  never forked.
- a *worker* builds one episode's instance (the environment's class and config, with the run's tool parser and a
  fresh ``stats`` counter) and answers its calls (``reset``, ``tools``, ``step``, ``reward``) over a socket pair
  whose other end the trainer holds; it is closed when its episode is over. It runs in a process group of its own,
  so that a kill takes the processes the environment started with it.
- `call_all` sends the calls of every live episode of a turn, at most one per CPU at a time, each limited to the
  environment's ``timeout_s`` from when it was sent. A worker past its limit is killed (SIGKILL; its pid is gone
  when `EnvWorker.kill` returns); one that dies is an error.

What crosses the process boundary is pickled: the environment's config and the tool parser once per run, and every
call's arguments (rows, messages) and result. A result that cannot be pickled is an error naming the call ("return
plain data"). The environment class must be importable: defined in a module or a file (``env.name=file.py:Class``),
not in ``__main__``. State outside the instance (module or class variables) is each episode's own copy, as the host
had it after building its instance: episodes share nothing, whatever order they run in.

Clean-up: when the trainer's end of the host's socket closes (the trainer exits, crashes or is killed), the host
kills every worker's process group and exits; a worker whose host dies is killed by the kernel (Linux
``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, deque
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Environment, ToolEnvironment

#: seconds the host may take to import an environment's module and build its first instance (beyond timeout_s)
LOAD_S = 120.0
#: file descriptors passed to the host in one message (the kernel takes at most 253)
SPAWN_BATCH = 200
#: a killed worker's pid is gone within this many seconds (the host reaps it at once)
KILL_WAIT_S = 2.0


class Malformed(TypeError):
    """An environment call returned something the loop cannot use (its message names the call and the value)."""


def describe_failure(call: str, exc: BaseException) -> str:
    """What an environment's failed call says in the log, the metrics and a stop message: the call, the
    exception and where it was raised, e.g. ``step() raised RuntimeError: boom (broken_env.py:9)``."""
    if isinstance(exc, Malformed):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{call}() raised {type(exc).__name__}: {exc}{where}"


def timed_out(call: str, limit_s: float) -> str:
    return f"{call}() ran past the environment's timeout_s={limit_s:g} s"


def class_tools(env_cls: type) -> list[dict] | None:
    """The tool schemas of an environment whose ``tools()`` is the interface's own, which depends on its class
    alone: computed once, in the trainer (which has transformers loaded), rather than in every episode's worker.
    None when the environment defines its own ``tools()`` (each episode's instance is asked)."""
    if env_cls.tools is Environment.tools:
        return []
    if env_cls.tools is ToolEnvironment.tools:
        # the schemas read the methods' signatures and docstrings only: an instance that was never built will do
        return ToolEnvironment.tools(object.__new__(env_cls))
    return None


# ----------------------------------------------------------------------------- the trainer's side


class EnvWorker:
    """The trainer's handle on one episode's environment: its worker process, the instance's ``timeout_s`` and
    ``scores_final_answer``, and its `Environment.stats` as of the last call (the loop's ``env/...`` counts)."""

    def __init__(self, conn: Connection, pid: int, env_cls: type):
        self.conn, self.pid = conn, pid
        self.timeout_s = float(env_cls.timeout_s)  # the class's, until the worker reports its instance's
        self.scores_final_answer = bool(env_cls.scores_final_answer)
        self.stats: Counter = Counter()
        self.alive = True
        self.started: tuple[str, Any] = ("ok", None)  # how building the instance went (`spawn`)

    def send(self, method: str, args: tuple) -> None:
        self.conn.send((method, args))

    def receive(self, method: str) -> tuple[str, Any]:
        """The reply to ``method``: ``("ok", value)`` or ``("error", text)``; a worker that died is an error."""
        try:
            kind, value, stats = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            return "error", f"{method}(): the environment's worker process died (pid {self.pid})"
        except Exception as exc:  # noqa: BLE001 - an answer the trainer cannot unpickle is that episode's error
            self.kill()
            return "error", f"{method}(): its answer could not be read ({type(exc).__name__}: {exc})"
        self.stats = Counter(stats)
        return kind, value

    def kill(self) -> None:
        """SIGKILL the worker and what it started (its process group); returns when its pid is gone."""
        if not self.alive:
            return
        self.alive = False
        self.conn.close()
        for kill in (os.killpg, os.kill):  # its group; itself too, should it not have made its group yet
            try:
                kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:  # the host reaps it as soon as it is dead
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.001)

    def close(self) -> None:
        """End the worker (its episode is over): it exits when it reads the request or sees the socket close."""
        if not self.alive:
            return
        self.alive = False
        try:
            self.send("close", ())
        except OSError:
            pass
        self.conn.close()


def _parallel() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def call_all(calls: list[tuple[EnvWorker, str, tuple]], parallel: int = 0) -> list[tuple[str, Any]]:
    """``worker.method(*args)`` for each call, in the workers' processes, at most ``parallel`` (default: one per
    CPU) at a time, so that calls do not slow each other into timeouts; one outcome per call, in order:
    ``("ok", value)``, ``("error", text)`` or ``("timeout", text)`` (the worker is then killed). Each call's
    limit is its worker's ``timeout_s`` from when it was sent."""
    outcomes: list[tuple[str, Any] | None] = [None] * len(calls)
    pending = deque(range(len(calls)))
    flight: dict[Connection, tuple[int, float]] = {}
    limit = parallel or _parallel()
    while pending or flight:
        while pending and len(flight) < limit:
            i = pending.popleft()
            worker, method, args = calls[i]
            if not worker.alive:
                outcomes[i] = ("error", f"{method}(): the environment's worker process is not running")
                continue
            try:
                worker.send(method, args)
            except (OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
                outcomes[i] = ("error", f"{method}(): its arguments could not be sent to the environment's worker "
                               f"process ({type(exc).__name__}: {exc})")  # fmt: skip
                worker.kill()
                continue
            flight[worker.conn] = (i, time.monotonic() + worker.timeout_s)
        if not flight:
            continue
        ready = wait(list(flight), max(0.0, min(d for _, d in flight.values()) - time.monotonic()))
        for conn in ready:
            i, _ = flight.pop(conn)
            worker, method, _ = calls[i]
            outcomes[i] = worker.receive(method)
        now = time.monotonic()
        for conn, (i, deadline) in list(flight.items()):
            if now >= deadline:
                del flight[conn]
                worker, method, _ = calls[i]
                worker.kill()
                outcomes[i] = ("timeout", timed_out(method, worker.timeout_s))
    return outcomes  # type: ignore[return-value]


def spawn(env_cls: type, config: Any, parser: Any, count: int) -> list[EnvWorker]:
    """``count`` workers, each with its own instance of ``env_cls(config)`` (``tool_parser`` set, fresh ``stats``);
    how building each went is in its ``started`` (a constructor that raised or hung is that episode's failure)."""
    return _host().spawn(env_cls, config, parser, count)


class _Host:
    """The trainer's end of the host process: loads environment classes and asks for workers."""

    def __init__(self):
        parent, child = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "oxrl_core.rollout.env_worker", str(child.fileno())],
            pass_fds=[child.fileno()],
            start_new_session=True,  # no terminal signals; its workers are killed by it or by the trainer
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.sock = parent  # the fds of new workers go this way (SCM_RIGHTS) ...
        self.conn = Connection(os.dup(parent.fileno()))  # ... and every message this way
        self.owner = os.getpid()
        self.loaded: dict[bytes, int] = {}
        self.lock = threading.Lock()
        self.conn.send(("init", list(sys.path)))

    def usable(self) -> bool:
        return self.owner == os.getpid() and self.process.poll() is None

    def request(self, message: tuple, limit_s: float, what: str) -> Any:
        self.conn.send(message)
        if not self.conn.poll(limit_s):
            self.process.kill()
            raise OxrlError(f"{what}: the environment host process did not answer within {limit_s:g} s")
        return self.request_reply(what)

    def template(self, env_cls: type, config: Any, parser: Any) -> int:
        """The host's id of (class, config, parser), loaded there once."""
        modules = [_module_ref(cls) for cls in (env_cls, type(config), type(parser))]
        state = pickle.dumps((config, parser))
        key = pickle.dumps((modules, env_cls.__module__, env_cls.__qualname__, state))
        if key not in self.loaded:
            what = f"environment '{getattr(env_cls, 'name', env_cls.__qualname__)}'"
            limit_s = LOAD_S + float(env_cls.timeout_s)
            message = ("load", len(self.loaded), modules, env_cls.__module__, env_cls.__qualname__, state)
            self.loaded[key] = self.request(message, limit_s, what)
        return self.loaded[key]

    def spawn(self, env_cls: type, config: Any, parser: Any, count: int) -> list[EnvWorker]:
        with self.lock:
            key = self.template(env_cls, config, parser)
            _fd_room(count)
            workers = []
            for start in range(0, count, SPAWN_BATCH):
                pairs = [socket.socketpair() for _ in range(min(SPAWN_BATCH, count - start))]
                self.conn.send(("spawn", key, len(pairs)))
                socket.send_fds(self.sock, [b"F"], [theirs.fileno() for _, theirs in pairs])
                for _, theirs in pairs:
                    theirs.close()
                pids = self.request_reply("spawn")
                workers += [EnvWorker(Connection(ours.detach()), pid, env_cls) for (ours, _), pid in zip(pairs, pids)]
        # each worker first says how building its instance went: ("ok", (timeout_s, scores_final_answer)) or why not
        # (the instances are built at once, as the workers start: so are their answers read)
        hellos = call_all([(w, "hello", ()) for w in workers], parallel=len(workers))
        for worker, (kind, value) in zip(workers, hellos):
            if kind == "ok":
                worker.timeout_s, worker.scores_final_answer = value
            else:
                worker.started = (kind, value.replace("hello()", "the environment's constructor"))
                worker.kill()
        return workers

    def request_reply(self, what: str) -> Any:
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            raise OxrlError(f"{what}: the environment host process died (exit status {self.process.wait()})") from None
        if kind != "ok":
            raise OxrlError(f"{what}: {value}")
        return value


_HOST: _Host | None = None
_HOST_LOCK = threading.Lock()


def _host() -> _Host:
    global _HOST
    with _HOST_LOCK:
        if _HOST is None or not _HOST.usable():
            _HOST = _Host()
        return _HOST


def _module_ref(cls: type) -> tuple[str, str | None]:
    """How the host imports ``cls``'s module: by name, or from its file for a user file imported by path
    (`oxrl_core.user_code`: its module name is not importable elsewhere)."""
    name = cls.__module__
    module = sys.modules.get(name)
    if name == "__main__":
        raise OxrlError(
            f"environment class {cls.__qualname__} is defined in __main__, which its worker processes cannot import: "
            "define it in a module or a file (env.name=file.py:Class)"
        )
    if name.startswith("oxrl_user_") and module is not None and getattr(module, "__file__", None):
        return name, module.__file__
    return name, None


def _fd_room(count: int) -> None:
    """Room for ``count`` more sockets (one per live episode) under the open-file limit, raised up to the hard
    limit when needed; an error naming the limit when even that is too low."""
    try:
        import resource  # POSIX

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 256
    except (ImportError, OSError):
        return
    need = used + count + 64
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise OxrlError(
            f"env: {count} episodes at once need {count} more open files (one socket each) but the open-file "
            f"limit is {hard} (ulimit -n); lower train.batch_size × rollout.n or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(hard, 2 * need), hard))


# ----------------------------------------------------------------------------- the host process


def _import(name: str, file: str | None):
    if file is None:
        return importlib.import_module(name)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # under the trainer's name, so that pickles of its objects resolve
    spec.loader.exec_module(module)
    return module


def _build(env_cls: type, config: Any, parser: Any) -> Any:
    """An instance as an episode gets it: ``env_cls(config)``, then the two attributes the `Environment` interface
    declares for the loop to set: its `~Environment.tool_parser` (the run's) and a fresh `~Environment.stats`."""
    env = env_cls(config)
    env.tool_parser, env.stats = parser, Counter()
    return env


def _load(modules, module_name: str, qualname: str, state: bytes) -> tuple:
    for name, file in modules:
        _import(name, file)
    env_cls: Any = sys.modules[module_name]
    for part in qualname.split("."):
        env_cls = getattr(env_cls, part)
    config, parser = pickle.loads(state)
    env = _build(env_cls, config, parser)  # the first instance: per-process work done once, before any worker forks
    if env_cls.tools not in (Environment.tools, ToolEnvironment.tools):
        env.tools()  # its own tools(): what it imports on first use (transformers for schemas, ...) imported once, here
    return env_cls, config, parser


class _Reaper:
    """Reaps the host's workers as soon as they exit (so a killed worker's pid is gone at once), and only them:
    the environment's own child processes in the host (a probe while loading) are left to their owners."""

    def __init__(self):
        self.pids: set[int] = set()
        signal.signal(signal.SIGCHLD, self.reap)

    def reap(self, *_) -> None:
        for pid in list(self.pids):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.pids.discard(pid)

    def kill_all(self) -> None:
        for pid in list(self.pids):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _prctl():
    """libc's prctl, looked up once in the host (a worker must not pay for importing ctypes); None if absent."""
    try:
        import ctypes  # the host only

        return ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None


def _die_with_parent(prctl) -> None:
    """Linux: the kernel kills this process when its parent (the host) dies."""
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker(conn: Connection, template: tuple) -> None:
    """One episode's environment: build it, say how that went, answer calls until closed."""
    env_cls, config, parser = template
    try:
        env = _build(env_cls, config, parser)
        failure = ""
    except BaseException as exc:  # noqa: BLE001 - the episode's failure, reported to the trainer
        env, failure = None, describe_failure("hello", exc)
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        if method == "close":
            return
        stats = dict(env.stats) if env is not None else {}
        if env is None:
            reply = ("error", failure, stats)
        elif method == "hello":
            reply = ("ok", (float(env.timeout_s), bool(env.scores_final_answer)), stats)
        else:
            try:
                reply = ("ok", getattr(env, method)(*args), dict(env.stats))
            except BaseException as exc:  # noqa: BLE001 - SystemExit too: the episode's failure, never the worker's
                reply = ("error", describe_failure(method, exc), dict(env.stats))
        try:
            payload = pickle.dumps(reply)
        except Exception as exc:  # noqa: BLE001 - what the environment returned cannot cross to the trainer
            payload = pickle.dumps(
                (
                    "error",
                    f"{method}() returned an object that cannot be sent from the environment's worker process "
                    f"({type(exc).__name__}: {exc}); return plain data (str, numbers, lists, dicts)",
                    stats,
                )
            )
        conn.send_bytes(payload)


def _fork_workers(template: tuple, fds: list[int], keep: list[int], reaper: _Reaper, prctl) -> list[int]:
    pids = []
    for fd in fds:
        pid = os.fork()
        if pid == 0:  # the worker
            try:
                os.setpgid(0, 0)  # a group of its own: a kill takes what it started too
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own subprocesses are waited for as usual
                _die_with_parent(prctl)
                for other in fds + keep:
                    if other != fd:
                        os.close(other)
                _worker(Connection(fd), template)
            finally:
                os._exit(0)
        reaper.pids.add(pid)
        pids.append(pid)
    for fd in fds:
        os.close(fd)
    reaper.reap()  # one that exited before it was known
    return pids


def main(fd: int) -> None:
    """The host: load environment classes, fork workers, until the trainer's end closes."""
    conn = Connection(fd)
    sock = socket.socket(fileno=os.dup(fd))
    reaper = _Reaper()
    prctl = _prctl()
    templates: dict[int, tuple] = {}
    try:
        _, path = conn.recv()  # ("init", the trainer's sys.path): its modules import here as there
        sys.path[:] = path
        while True:
            message = conn.recv()
            if message[0] == "load":
                _, key, modules, module_name, qualname, state = message
                try:
                    templates[key] = _load(modules, module_name, qualname, state)
                    gc.freeze()  # the workers share these pages with the host; a collection would copy them
                    conn.send(("ok", key))
                except BaseException as exc:  # noqa: BLE001 - told to the trainer, which names the environment
                    why = describe_failure("load", exc).replace(
                        "load() raised", "could not be loaded in its host process:"
                    )
                    conn.send(("error", why))
            elif message[0] == "spawn":
                _, key, count = message
                _, fds, _, _ = socket.recv_fds(sock, 1, count)
                conn.send(("ok", _fork_workers(templates[key], fds, [fd, sock.fileno()], reaper, prctl)))
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        reaper.kill_all()
        os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
