"""Running an untrusted Python program (a model's completion) so that it cannot harm the trainer.

`Sandbox.run(code, tests=..., stdin=...)` runs one program once and returns a `RunResult`. Each run
gets a fresh temporary directory (``<temp_dir>/oxrl-sandbox-*``, removed afterwards, timeouts
included) and a new process, ``python -I -S -B -X utf8 sandbox_runner.py`` (isolated mode: no
PYTHON* variables, no site-packages, no user site, no bytecode written), with a clean environment
(``PATH=/usr/bin:/bin``, ``HOME`` = ``TMPDIR`` = the program's working directory, ``LANG=C.UTF-8``,
``MALLOC_ARENA_MAX=2``; none of the trainer's variables), stdin from a file, stdout/stderr to files. The runner
(`oxrl_rewards.sandbox_runner`) sets the limits and isolation up before any untrusted code runs.
Defence in depth, every layer on its own:

1. Limits (setrlimit, soft = hard so they cannot be raised): CPU seconds (``RLIMIT_CPU``),
   address space (``RLIMIT_AS``: a 10 GB allocation is a MemoryError), file size
   (``RLIMIT_FSIZE``: stdout, stderr and every file written are capped at ``output_bytes``, so
   printing 100 MB neither hangs nor fills the disk), open files, no core dumps, and
   ``RLIMIT_NPROC`` (processes + threads) where it counts this sandbox only (modes ``root`` and
   ``userns``). The wall-clock limit is the parent's: at ``wall_s`` the process group is killed.
2. Processes: a new session (``start_new_session``); on timeout, and after every run, the parent
   kills the whole process group (``killpg``, while the runner is still unreaped so the group id
   cannot have been reused). The runner gets SIGKILL if the trainer dies (PR_SET_PDEATHSIG).
3. Namespaces (``namespaces: auto`` probes them once per process and falls back cleanly):
   - mode ``root`` (the trainer runs as root): new mount, network, pid and IPC namespaces; the
     program is PID 1 of its pid namespace, so when it exits or is killed (it also gets SIGKILL
     when its runner dies: PR_SET_PDEATHSIG) the kernel kills every process in it — a child that
     called ``setsid()`` included. It runs chrooted in a minimal root on a size-limited tmpfs
     (read-only /usr, /bin, /lib*, the stdlib; /dev/null, zero, random, urandom; its own /proc,
     which shows only its own processes; an empty /tmp and /sandbox, its working directory), under
     a uid/gid of its own (one per concurrent run, from a random block above 2^31, no groups, no
     capabilities) with PR_SET_NO_NEW_PRIVS. So: no network (not even loopback), none of the
     trainer's files (the repository, /root, ~/.ssh are not in its root; what is there is read-
     only or not its own), no other process's /proc/<pid>/environ, no signals to other processes,
     and disk use bounded by ``scratch_mb``.
   - mode ``userns`` (not root, unprivileged user namespaces available): new user, mount, network,
     pid and IPC namespaces, its own /proc, all capabilities dropped, NO_NEW_PRIVS. No network, no
     surviving processes, no other process's /proc — but it keeps the trainer's uid, so files are
     protected only by the Python guard.
   - mode ``none``: layers 1, 2 and 4; a root trainer's capabilities are dropped (uid 0 stays).
   Every mode sets PR_SET_NO_NEW_PRIVS: no setuid binary can raise privileges again.
4. The Python guard (``python_guard``, default on): an audit hook (PEP 578) installed before the
   program runs refuses process creation (fork, exec, spawn, posix_spawn, system, subprocess,
   ``_posixsubprocess``), signals to other processes, sockets (an unconnected AF_UNIX socketpair
   aside), ctypes, ``resource.setrlimit``, gc's object walks, links, chdir, writes outside the
   working directory, and reads outside it, the stdlib (site-packages excluded) and a few /dev
   files — so /proc/*/environ, the repository or ~/.ssh cannot be read.

How a result is read: the runner executes the program as ``__main__``, then each test statement
in its namespace, and appends one line per test to a results file, prefixed with a random nonce
the program never sees in its files or environment. A test passes only when its line says so: a
program that calls ``exit(0)``/``os._exit(0)`` before the tests, prints "passed", or rebinds
builtins gains nothing. Tests that reported before a timeout still count.

Honest limits:
- The guard is an in-process check in CPython: a program that corrupts interpreter memory (a
  crafted ``marshal`` payload, an interpreter bug) can disable it; that is why layers 1-3 exist.
  It also refuses some harmless things (``import ctypes``, ``os.chdir``, ``os.fork``).
- The nonce protects against cheap reward hacks, not against a program that walks the runner's
  frames (``sys._getframe``) to find it, nor against objects whose ``__eq__`` always returns
  True: the sandbox protects the machine, it cannot make any test suite unhackable.
- Without namespaces (mode ``none``) and with the guard off, a child that calls ``setsid()``
  escapes the process-group kill, and the program has the trainer's uid and file access.
- A root trainer where namespaces fail (a container without CAP_SYS_ADMIN, a masked /proc) runs
  programs as uid 0 without capabilities, with layers 1, 2 and 4 only (root's own files are then
  the guard's job); ``namespaces: on`` refuses to start instead.
- Without namespaces, disk use is bounded per file (``RLIMIT_FSIZE``), not in total, and
  ``os.mkfifo``/``os.mknod`` (no audit event) can make nodes wherever the trainer's uid may write.
- Memory is bounded per process (``RLIMIT_AS``), not per run; the number of processes is bounded
  only in modes ``root`` and ``userns`` (elsewhere the guard refuses to fork). Mode ``userns``
  needs Linux >= 5.14, where RLIMIT_NPROC counts per user namespace (before, its probe fails).
- Programs get the standard library only (no site-packages), and Linux only.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger("oxrl.rewards")

RUNNER = Path(__file__).with_name("sandbox_runner.py")
PREFIX = "oxrl-sandbox-"
EXIT_SANDBOX = 3  # the runner could not set the sandbox up (sandbox_runner.EXIT_SANDBOX)
Mode = Literal["root", "userns", "none"]
LAYERS = {"root": "namespaces,uid,chroot", "userns": "namespaces,userns,no-capabilities", "none": "process"}


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): setup, or a required isolation is missing."""


@dataclass(frozen=True)
class Limits:
    """Per run of one program."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 1 << 20
    max_processes: int = 32
    max_open_files: int = 64
    scratch_mb: int = 64


@dataclass
class RunResult:
    """What one run did. ``status``: ok | error | syntax_error | timeout | memory | output_limit
    (`oxrl_rewards.code_exec` adds skipped and sandbox_error for runs that did not happen)."""

    status: str
    exit_code: int | None
    #: tests mode: the outcome of each test that reported, in order (a timeout cuts it short)
    tests: list[bool] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""


class _UidPool:
    """One uid per concurrent run (mode ``root``): RLIMIT_NPROC then counts that run's processes only,
    and no run can signal or read another's. A random block per trainer process keeps two trainers
    on one machine apart."""

    def __init__(self) -> None:
        self.base = 2**31 + secrets.randbelow(2**20) * 1024
        self.free: list[int] = []
        self.next = 0
        self.lock = threading.Lock()

    def acquire(self) -> int:
        with self.lock:
            if self.free:
                return self.free.pop()
            self.next += 1
            return self.base + self.next

    def release(self, uid: int) -> None:
        with self.lock:
            self.free.append(uid)


_UIDS = _UidPool()
_PROBES: dict[tuple[str, str], str | None] = {}  # (mode, temp_dir) -> None when it works, else why not
_PROBE_LOCK = threading.Lock()


class Sandbox:
    """Runs programs under `Limits` with the best isolation available (see the module docstring)."""

    def __init__(
        self,
        limits: Limits = Limits(),
        namespaces: Literal["auto", "on", "off"] = "auto",
        python_guard: bool = True,
        temp_dir: str | None = None,
        mode: Mode | None = None,
    ):
        self.limits = limits
        self.python_guard = python_guard
        self.temp_dir = temp_dir or tempfile.gettempdir()
        if not Path(self.temp_dir).is_dir():
            raise SandboxError(f"temp_dir {self.temp_dir!r} is not a directory")
        self.mode: Mode = mode or choose_mode(namespaces, self.temp_dir)

    @property
    def isolation(self) -> str:
        """The layers in use, e.g. ``namespaces,uid,chroot,guard``."""
        no_caps = ",no-capabilities" if self.mode == "none" and os.geteuid() == 0 else ""
        return LAYERS[self.mode] + no_caps + (",guard" if self.python_guard else "")

    def run(self, code: str, tests: list[str] | None = None, stdin: str = "") -> RunResult:
        """Run ``code`` once: with ``tests`` (statements run after it), or on ``stdin`` (io mode)."""
        uid = _UIDS.acquire() if self.mode == "root" else None
        workdir = tempfile.mkdtemp(prefix=PREFIX, dir=self.temp_dir)
        try:
            return self._run_in(workdir, code, tests, stdin, uid)
        finally:
            _remove_tree(workdir)
            if uid is not None:
                _UIDS.release(uid)

    def _run_in(self, workdir: str, code: str, tests: list[str] | None, stdin: str, uid: int | None) -> RunResult:
        work = Path(workdir)
        (work / "main.py").write_text(code, encoding="utf-8", errors="surrogatepass")
        (work / "stdin.txt").write_text(stdin, encoding="utf-8")
        if self.mode == "root":
            (work / "root").mkdir()  # the mount point of the new root
        home = "/sandbox" if self.mode == "root" else workdir
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": home,
            "TMPDIR": home,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "MALLOC_ARENA_MAX": "2",  # glibc's per-thread arenas would eat RLIMIT_AS in address space alone
        }
        nonce = secrets.token_hex(16)
        files = {
            name: os.open(work / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            for name in ("stdout.txt", "stderr.txt", "result.txt")
        }
        try:
            spec = {
                "nonce": nonce,
                "mode": self.mode,
                "guard": self.python_guard,
                "tests": tests,
                "workdir": workdir,
                "uid": uid,
                "result_fd": files["result.txt"],
                "limits": self.limits.__dict__,
                "parent": os.getpid(),
            }
            (work / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
            with open(work / "stdin.txt", "rb") as stdin_file:
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", "-B", "-X", "utf8", str(RUNNER), workdir],
                        cwd=workdir,
                        env=env,
                        stdin=stdin_file,
                        stdout=files["stdout.txt"],
                        stderr=files["stderr.txt"],
                        pass_fds=(files["result.txt"],),
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise SandboxError(f"could not start the sandbox runner: {exc}") from exc
        finally:
            for fd in files.values():
                os.close(fd)
        timed_out = _wait_then_kill_group(proc, self.limits.wall_s)
        return self._result(work, nonce, tests, proc.returncode, timed_out)

    def _result(self, work: Path, nonce: str, tests: list[str] | None, returncode: int, timed_out: bool) -> RunResult:
        # The runner's lines: "<nonce> ready", "<nonce> test <i> <1|0> <exception name or ->",
        # "<nonce> raised <name>", "<nonce> syntax", "<nonce> done", "<nonce> sandbox <why>".
        text = _read(work / "result.txt", self.limits.output_bytes)
        lines = [line[len(nonce) + 1 :].partition(" ") for line in text.splitlines() if line.startswith(nonce + " ")]
        said = {kind for kind, _, _ in lines}
        for kind, _, info in lines:
            if kind == "sandbox":
                raise SandboxError(f"the sandbox could not be set up: {info}")
        if returncode == EXIT_SANDBOX and "ready" not in said:  # it failed before the program started
            raise SandboxError(f"the sandbox runner failed: {_read(work / 'stderr.txt', 500, tail=True)}")
        reports = [info.split(" ", 2) for kind, _, info in lines if kind == "test"]
        outcomes = [words[1] == "1" for words in reports if len(words) == 3]
        failures = {words[2] for words in reports if len(words) == 3} | {
            info for kind, _, info in lines if kind == "raised"
        }
        signum = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
        capped = any((work / name).stat().st_size >= self.limits.output_bytes for name in ("stdout.txt", "stderr.txt"))
        if timed_out or signum in (signal.SIGXCPU, signal.SIGKILL):
            status = "timeout"
        elif signum == signal.SIGXFSZ or capped:
            status = "output_limit"
        elif "MemoryError" in failures:
            status = "memory"
        elif "syntax" in said:
            status = "syntax_error"
        elif returncode != 0 or (tests is not None and "done" not in said):
            status = "error"
        else:
            status = "ok"
        return RunResult(
            status=status,
            exit_code=returncode,
            tests=outcomes[: len(tests)] if tests is not None else [],
            stdout=_read(work / "stdout.txt", self.limits.output_bytes),
            stderr=_read(work / "stderr.txt", 2000, tail=True),
        )


def _wait_then_kill_group(proc: subprocess.Popen, wall_s: float) -> bool:
    """Wait up to ``wall_s`` for the runner, then SIGKILL its process group; True when it timed out.

    The group is killed before the runner is reaped (a pidfd tells us it exited), so its id cannot
    have been reused by then; anything the program left in the group dies with it."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: reap first, then kill what is left
        try:
            proc.wait(timeout=wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _killpg(proc.pid)
        proc.wait()
        return timed_out
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        timed_out = not poller.poll(max(wall_s, 0.0) * 1000)
    finally:
        os.close(pidfd)
    _killpg(proc.pid)
    proc.wait()
    return timed_out


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, limit: int = 1 << 16, tail: bool = False) -> str:
    """The first (or, with ``tail``, the last) ``limit`` bytes of a file, as text."""
    try:
        with open(path, "rb") as handle:
            if tail:
                handle.seek(max(os.fstat(handle.fileno()).st_size - limit, 0))
            data = handle.read(limit)
    except FileNotFoundError:
        return ""
    return data.decode("utf-8", errors="replace")


def _remove_tree(path: str) -> None:
    """Remove a run's directory even if the program made parts of it read-only."""

    def fix(function, target, _exc_info) -> None:
        os.chmod(os.path.dirname(target), 0o700)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, 0o700)
            shutil.rmtree(target, ignore_errors=True)
        else:
            os.unlink(target)

    shutil.rmtree(path, onerror=fix)


# ----------------------------------------------------------------------------- choosing the isolation


def choose_mode(namespaces: str, temp_dir: str) -> Mode:
    """``off`` -> ``none``; ``on`` -> the namespace mode for this user, or SandboxError; ``auto`` -> that
    mode when its probe run works here, else ``none`` (with a warning saying why)."""
    if namespaces == "off":
        return "none"
    mode: Mode = "root" if os.geteuid() == 0 else "userns"
    why = probe(mode, temp_dir)
    if why is None:
        return mode
    if namespaces == "on":
        raise SandboxError(f"namespaces=on, but the '{mode}' namespace sandbox does not work here: {why}")
    user = "as root, " if mode == "root" else ""
    log.warning(
        "code sandbox: namespaces unavailable (%s); programs run %swith process limits and the Python guard only",
        why,
        user,
    )
    return "none"


def probe(mode: Mode, temp_dir: str) -> str | None:
    """Run a trivial program in ``mode`` once per process: None when it works, else the reason."""
    key = (mode, temp_dir)
    with _PROBE_LOCK:
        if key not in _PROBES:
            try:
                result = Sandbox(Limits(wall_s=30.0), temp_dir=temp_dir, mode=mode).run(
                    "x = 1", tests=["assert x == 1"]
                )
                ok = result.status == "ok" and result.tests == [True]
                _PROBES[key] = None if ok else f"probe run: {result.status}: {result.stderr[-300:]}"
            except SandboxError as exc:
                _PROBES[key] = str(exc)
        return _PROBES[key]
