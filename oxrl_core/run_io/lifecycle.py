"""The life of a run: one lock per run directory, when a checkpoint is saved, and how a run stops.

Three things every loop shares, kept in one place:

- **The run lock** (`RunLock`). Two `oxrl run` with the same ``--output-dir`` would interleave their
  metrics and checkpoints, so the driver process takes an exclusive ``flock`` on ``<run>/.oxrl.lock``
  for the run's whole life. The operating system drops a ``flock`` when its process ends, however it
  ends (``kill -9`` included), so a lock file left behind by a dead run locks nothing and needs no
  clean-up; the file stays (deleting it would let two processes lock two different files). It holds
  the owner's pid, host, start time and command, so a refused run can say who holds the directory.
  Ranks of a data-parallel run never take it: the driver holds it for them.

- **The save policy** (`Checkpointer`). A checkpoint is written every ``train.save_every`` steps or
  every ``train.save_minutes`` minutes, whichever comes first, and at once when a stop is requested;
  the newest ``train.save_total_limit`` are kept. The last step is never a checkpoint: it is ``final/``.
  Each checkpoint carries the run's ``config.yaml``, so ``--resume`` knows what it continues even if
  the run directory's copy is lost.

- **Stopping** (`handle_signals`). The first Ctrl-C (SIGINT) or SIGTERM during the loop only asks for a
  stop: the step in progress finishes, a checkpoint is saved, and the run ends with `Interrupted`
  (exit status 130 / 143 and the command that resumes it). Before the first step there is nothing to
  save and the run ends at once; a second signal always ends it at once (`StopNow`). Nothing is
  corrupted by stopping at once: checkpoints are written to a temp directory and renamed into place.

Only the standard library is imported at module level: the CLI imports this module before torch.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from oxrl_core.atomic import write_text_atomic
from oxrl_core.config import dump_yaml
from oxrl_core.engines import distributed
from oxrl_core.errors import OxrlError
from oxrl_core.observability.health import ERROR_LOG
from oxrl_core.redact import redact

LOCK_FILE = ".oxrl.lock"
#: a data-parallel run: the driver writes this file to ask the ranks to stop (rank 0 reads it each step)
STOP_FILE = ".oxrl-stop"
#: the run's resolved configuration, in the run directory and in every checkpoint
CONFIG_FILE = "config.yaml"
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


# ---------------------------------------------------------------- the run lock


class RunLock:
    """An exclusive, process-lifetime lock on a run directory (``with RunLock(run_dir): ...``)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def in_use(self) -> str | None:
        """Who holds the lock now (None if nobody): tested without writing anything."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe_holder(fd)
        except OSError:
            return None
        finally:
            os.close(fd)  # (closing also drops a lock this test took)
        return None

    def refuse_if_in_use(self) -> None:
        holder = self.in_use()
        if holder:
            raise _in_use_error(self.path.parent, holder)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OxrlError(
                f"cannot create the run lock {self.path}: {exc.strerror}; choose an --output-dir you can write to"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise _in_use_error(self.path.parent, holder) from None
        except OSError as exc:  # a file system without locks (some network mounts): run, but say so
            print(
                f"note: cannot lock {self.path} ({exc.strerror}); nothing stops a second run from using "
                f"{self.path.parent} at the same time",
                file=sys.stderr,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder_record()).encode() + b"\n", 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _in_use_error(run_dir: Path, holder: str) -> OxrlError:
    return OxrlError(
        f"{run_dir} is in use by another oxrl run ({holder}); wait for it to finish or stop it, "
        f"or choose another --output-dir"
    )


def _holder_record() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": _command_line(),
    }


def _command_line() -> str:
    """``oxrl run ...`` for the CLI; the script and its arguments for the Python API (e.g. ``train.py --lr 1e-5``)."""
    argv = sys.argv or ["python"]
    return shlex.join([Path(argv[0]).name or "python", *argv[1:]])[:300]


def _describe_holder(fd: int) -> str:
    """'pid 123 on host, started ..., `oxrl run ...`' from the lock file (best effort: it may be mid-write)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "a process that is still starting"
    text = f"pid {info['pid']} on {info.get('host', '?')}, started {info.get('started', '?')}, {info.get('command', '')}".rstrip(
        ", "
    )
    if info.get("host") == socket.gethostname() and not _alive(int(info["pid"])):
        text += "; that process has exited but a child it started still holds the lock"
    return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- stopping


class _SignalEnd:
    """An end caused by a signal: its message, and the exit status a shell expects (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int, message: str):
        super().__init__(signum, message)  # (the arguments also make it picklable: Ray carries it from a rank)
        self.signum, self.message = signum, message

    def __str__(self) -> str:
        return self.message

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 128 + self.signum)


class Interrupted(_SignalEnd, Exception):
    """The run stopped on a signal at a safe point; the message says what was saved and how to resume."""


class StopNow(_SignalEnd, BaseException):
    """A signal that ends the run at once (before the first step, or the second signal). A BaseException,
    like KeyboardInterrupt, so no ``except Exception`` on the way up turns it into another error; not a
    KeyboardInterrupt, so the CLI framework does not swallow it either."""


class _StopState:
    """What the signal handler knows: the first signal, the phase of the run, who to tell."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, run_dir: Path | None = None) -> None:
        self.signum: int | None = None
        self.phase = "setup"  # setup -> loop -> finish
        self.run_dir = run_dir
        self.step = 0  # the newest completed step
        self.on_stop: list = []  # callables(signum): e.g. the launcher tells the ranks


STATE = _StopState()


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _resume_hint() -> str:
    return f"resume with: oxrl run --resume -o {STATE.run_dir}" if STATE.run_dir else ""


def _handler(signum, frame) -> None:
    if STATE.signum is None and STATE.phase in ("loop", "finish"):
        STATE.signum = signum
        what = (
            "the step in progress finishes and a checkpoint is saved"
            if STATE.phase == "loop"
            else "final/ is being saved"
        )
        # os.write: a signal handler must not re-enter a buffered stream that the main code may be writing
        os.write(2, f"\n{signal_name(signum)}: stopping once {what} (press Ctrl-C again to stop at once)\n".encode())
        for callback in list(STATE.on_stop):
            callback(signum)
        return
    if STATE.phase == "setup":
        raise StopNow(
            signum,
            f"interrupted before the first step ({signal_name(signum)}); nothing to save. "
            "Run the same command again to start over",
        )
    where = (
        f"during step {STATE.step + 1}"
        if STATE.phase == "loop"
        else "while final/ was being saved (it is not published)"
    )
    raise StopNow(
        signum,
        f"stopped at once ({signal_name(signum)} again) {where}; the newest complete checkpoint "
        f"is kept (a half-written one is discarded). {_resume_hint()}".rstrip(),
    )


def stop_at_once(signum, frame) -> None:
    """The CLI's handler outside a run's loop (`oxrl eval`, loading a run...): end now, with the right status."""
    raise StopNow(signum, f"interrupted ({signal_name(signum)})")


@contextlib.contextmanager
def handle_signals(handler=_handler):
    """SIGINT and SIGTERM go to `handler` inside the block (only the main thread can take signals; elsewhere
    this does nothing). The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ---------------------------------------------------------------- the save policy


class Checkpointer:
    """One loop's checkpoints: `after_step` saves when `train.save_every` / `train.save_minutes` is due or a
    stop was requested, and raises `Interrupted` after the save in the latter case.

    ``extra(tmp_dir)`` adds the loop's own files (a critic, a self-play reference) to each checkpoint.
    In a data-parallel run every rank calls `after_step` (the save is collective); the minutes and the stop
    request are rank 0's, shared with one small all-reduce per step so every rank decides alike.
    """

    def __init__(self, run_dir: Path, cfg, model, tokenizer, engine, extra=None):
        self.run_dir = Path(run_dir)
        self.save_steps, self.save_minutes = cfg.train.save_every, cfg.train.save_minutes
        self.keep, self.max_steps = cfg.train.save_total_limit, cfg.train.max_steps
        self.config_yaml = dump_yaml(cfg)
        self.model, self.tokenizer, self.engine, self.extra = model, tokenizer, engine, extra
        self.last_save = time.monotonic()

    def describe(self) -> str:
        """For the start-up line: when checkpoints are written, and where."""
        every = []
        if self.save_steps:
            every.append(f"{self.save_steps} steps" if self.save_steps > 1 else "step")
        if self.save_minutes:
            every.append(f"{self.save_minutes:g} min")
        kept = f", newest {self.keep} kept" if self.keep else ""
        where = self.run_dir / "checkpoints"
        if not every:
            return f"checkpoints only on Ctrl-C/SIGTERM → {where} (train.save_every and train.save_minutes are 0)"
        return f"checkpoints every {' or '.join(every)} → {where}{kept}"

    def start(self, step: int) -> None:
        """The loop begins (after `step` steps done): from here a signal asks for a stop instead of ending at once."""
        STATE.phase, STATE.step = "loop", step
        self.last_save = time.monotonic()

    def after_step(self, step: int, state: dict) -> Path | None:
        """Call once per optimiser step, after its metrics are logged; `state` is the loop's resume state."""
        STATE.step = step
        if step >= self.max_steps:
            STATE.phase = "finish"  # final/ comes next; a stop requested now is answered after it
            return None
        stop, minutes_due = self._shared_flags()
        saved = None
        if stop or minutes_due or (self.save_steps and step % self.save_steps == 0):
            saved = self.save(step, state)
            if not stop and STATE.signum and _single_process():
                stop = STATE.signum  # the signal came during this save: stop on it, the checkpoint is fresh
        if stop:
            raise Interrupted(
                stop,
                f"interrupted at step {step}; checkpoint {saved.name} saved; "
                f"resume with: oxrl run --resume -o {self.run_dir}",
            )
        return saved

    def save(self, step: int, state: dict) -> Path:
        from oxrl_core.run_io.checkpoint import (
            save_checkpoint,  # lazy: torch; trainer imports this module before any run
        )

        def files(tmp: Path) -> None:
            (tmp / CONFIG_FILE).write_text(self.config_yaml)
            if self.extra is not None:
                self.extra(tmp)

        path = save_checkpoint(
            self.run_dir, step, self.model, self.tokenizer, self.engine, state, keep=self.keep, extra=files
        )
        self.last_save = time.monotonic()
        return path

    def _shared_flags(self) -> tuple[int, bool]:
        """(the stop request's signal number or 0, whether save_minutes has passed), as rank 0 sees them."""
        stop = STATE.signum or 0
        minutes_due = bool(self.save_minutes) and time.monotonic() - self.last_save >= 60 * self.save_minutes
        if distributed.world_size() > 1:
            if distributed.is_main() and not stop:
                stop = _read_stop_file(self.run_dir)
            stop, minutes = distributed.all_reduce_sum(
                [float(stop if distributed.is_main() else 0), float(minutes_due and distributed.is_main())]
            )
            stop, minutes_due = int(stop), minutes > 0
        return stop, minutes_due


def _single_process() -> bool:
    return distributed.world_size() == 1


def request_stop_of_ranks(run_dir: Path):
    """A callback for `STATE.on_stop` in a data-parallel driver: the ranks learn of the signal through a file."""

    def write(signum: int) -> None:
        with contextlib.suppress(OSError):
            (Path(run_dir) / STOP_FILE).write_text(str(int(signum)))

    return write


def _read_stop_file(run_dir: Path) -> int:
    try:
        return int((run_dir / STOP_FILE).read_text().strip() or signal.SIGINT)
    except (OSError, ValueError):
        return 0


def finished(result):
    """After the loop returned: a stop requested while final/ was saved is reported now (the run is complete)."""
    signum = STATE.signum
    STATE.phase = "setup"
    if signum:
        raise Interrupted(
            signum, f"interrupted after the last step ({result.steps}); final/ was saved and the run is complete"
        )
    return result


# ---------------------------------------------------------------- the error log

#: the error log's first line, which `oxrl bug-report` reads
ERROR_LOG_HEADER = "oxrl run failed"


@contextlib.contextmanager
def error_log(run_dir: Path):
    """Keep the traceback of a run that fails in ``<run>/error.log``, written atomically (a newer failure
    replaces it). The terminal still shows only the one-line message of an `OxrlError`; `oxrl bug-report`
    puts the traceback into an issue. A stop that was asked for (Ctrl-C, SIGTERM) is not a failure."""
    try:
        yield
    except (Interrupted, StopNow, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        if distributed.is_main():
            with contextlib.suppress(OSError):
                write_text_atomic(Path(run_dir) / ERROR_LOG, describe_failure(exc))
        raise


def describe_failure(exc: BaseException) -> str:
    """When and where the run failed, the error's one line, and the whole traceback — with the exceptions that
    ``raise ... from None`` hides on the terminal (the error a loader or a plugin raised first). Credentials
    (a password in a URL given with ``--set``, tokens) are redacted as in a bug report."""
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    parts = [
        f"{ERROR_LOG_HEADER} at {when} (pid {os.getpid()} on {socket.gethostname()})\n",
        f"command: {_command_line()}\n",
        f"error: {type(exc).__name__}: {exc}\n\n",
        *traceback.format_exception(exc),
    ]
    seen, hidden = {id(exc)}, exc.__context__ if exc.__suppress_context__ else None
    while hidden is not None and id(hidden) not in seen:
        seen.add(id(hidden))
        parts += ["\nraised while handling (hidden on the terminal):\n\n", *traceback.format_exception(hidden)]
        hidden = hidden.__context__ if hidden.__suppress_context__ else None
    return redact("".join(parts))
