"""The test suite's `oxrl` runs, started from a warm process instead of a cold interpreter.

A cold `oxrl run` spends about 7 s of a one-step run importing torch, transformers and the loops; the suite makes
hundreds of such calls. Each pytest worker keeps one multiprocessing *forkserver* that has imported them once
(`PRELOAD`, nothing executed: no thread pool, no model); every call forks a fresh child from it that takes the call's
argv, environment, working directory and output files, runs the real console entry point (`oxrl_core.cli.main`,
signal handling and exit codes included) and exits with its status after the interpreter's exit handlers. The
child is a new process like a cold one: nothing of one call survives into the next.

What a fork cannot give is a variable read once at import time (the Hugging Face hub's, torch's thread counts,
rich's terminal settings): a call whose environment changes one of those (`IMPORT_TIME` prefixes) runs in a real
subprocess, as does a call that names vLLM (its engine starts processes of its own). `OXRL_TEST_COLD=1` runs every
call in a real subprocess."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# what an `oxrl run` imports (installed modules: the forkserver starts with the interpreter's own path)
PRELOAD = [
    "oxrl_core.cli",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "oxrl_core.trainer",
    "oxrl_core.loops.supervised",
    "oxrl_core.loops.preference",
    "oxrl_core.loops.rl",
]
IMPORT_TIME = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP",
    "CUDA",
    "PYTHON",
    "VLLM",
    "DS_",
    "ACCELERATE",
    "COLUMNS",
    "LINES",
    "NO_COLOR",
    "FORCE_COLOR",
    "TERM",
    "LD_",
)

_context = None
_server_env: dict[str, str] | None = None
_lock = threading.Lock()


def _forkserver():
    global _context, _server_env
    with _lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _server_env = dict(os.environ)
            _context = context
    return _context


def warm_call_possible(args: list[str], env: dict[str, str]) -> bool:
    """False where a fork of the warm process would not behave like a cold `oxrl`."""
    if os.environ.get("OXRL_TEST_COLD") == "1" or any("vllm" in a.lower() for a in args):
        return False
    base = _server_env if _server_env is not None else dict(os.environ)
    changed = {k for k in set(base) | set(env) if base.get(k) != env.get(k)}
    return not any(k.upper().startswith(IMPORT_TIME) for k in changed)


def _child(argv: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    """In the forked child: become the `oxrl` process the call asked for, run it, exit with its status."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = argv
    code: int = 0
    try:
        from oxrl_core import cli

        cli.main()
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 -- what a cold interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed stream: nothing left to write
                pass
        os._exit(code)


def run(
    exe: str, args: list[str], env: dict[str, str], cwd: Path | None, timeout: float
) -> subprocess.CompletedProcess:
    """`subprocess.run([exe, *args], capture_output=True, text=True)`, forked from the warm process."""
    context = _forkserver()
    with tempfile.TemporaryDirectory(prefix="oxrl-call-") as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        argv = [exe, *args]
        process = context.Process(
            target=_child, args=(argv, env, str(cwd or os.getcwd()), out_path, err_path), daemon=False
        )
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        out = Path(out_path).read_text(errors="replace") if os.path.exists(out_path) else ""
        err = Path(err_path).read_text(errors="replace") if os.path.exists(err_path) else ""
        return subprocess.CompletedProcess(argv, process.exitcode, out, err)
