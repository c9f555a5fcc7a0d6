"""Shared fixtures: a hermetic oxRL cache, tiny model directories, small data files, a CLI runner."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cli_zygote
import pytest
import warm_starts

ROOT = Path(__file__).resolve().parents[1]

# The suite runs in parallel workers (pytest-xdist, `-n auto` in pyproject.toml). Each worker, and every process
# it starts, gets its share of the cores: OpenMP threads that outnumber the cores wait for each other and run many
# times slower. Set before torch is imported (it reads them once).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


if WORKERS > 1:
    _all = _cores()
    _share = max(1, len(_all) // WORKERS)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_share))
    # vLLM on the CPU binds its threads to cores ("auto": all of them), where they would spin against the other
    # workers: each worker's engines get its own cores instead
    _index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % (len(_all) // _share or 1)
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, _all[_index * _share : (_index + 1) * _share]))
    )


def pytest_collection_modifyitems(session, config, items) -> None:
    """Files with the most end-to-end (slow) tests first: with one file per worker at a time (`--dist loadfile`),
    the longest files start early and the short ones fill the gaps at the end."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's own order is kept


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most one per 4 GiB of memory (a worker may run two ranks and a Ray
    cluster) and at most 8."""
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = 8.0
    return max(1, min(len(_cores()), int(memory_gib // 4), 8))


@pytest.fixture(scope="session", autouse=True)
def oxrl_cache(tmp_path_factory):
    """Every test (and every `oxrl` subprocess) uses a cache for the built-in tiny model that is private to this
    test session and shared by its workers (entries are written to a temp name and renamed: workers that build
    the same one at once both succeed). The warm starts the built-in tasks begin from are copied in from
    ``fixtures/warm_starts/`` (`warm_starts.py`: trained at test time, they would differ from machine to machine)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = root / "oxrl-cache"
    cache.mkdir(exist_ok=True)
    os.environ["OXRL_CACHE"] = str(cache)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warm_starts.install(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama (hidden 64, 2 layers, head_dim 64) with the character tokenizer."""
    from oxrl_core.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny", hidden_size=64, num_layers=2, seed=0)


@pytest.fixture(scope="session")
def teacher_model_dir(tmp_path_factory) -> Path:
    """A second, differently initialised tiny model with the same vocabulary (a KD teacher)."""
    from oxrl_core.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "teacher", hidden_size=128, num_layers=2, seed=7)


@pytest.fixture(scope="session")
def arch_model(tmp_path_factory):
    """`arch_model(family, seed=0) -> Path`: the family's tiny model directory (tests/archs.py), built once per session."""
    from archs import build_arch

    root = tmp_path_factory.mktemp("archs")
    built: dict[tuple[str, int], Path] = {}

    def get(family: str, seed: int = 0) -> Path:
        if (family, seed) not in built:
            built[(family, seed)] = build_arch(family, root / f"{family}-s{seed}", seed=seed)
        return built[(family, seed)]

    return get


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def sft_jsonl(tmp_path) -> Path:
    rows = [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(6) for b in range(6)]
    return write_jsonl(tmp_path / "sft.jsonl", rows)


@pytest.fixture
def text_jsonl(tmp_path) -> Path:
    rows = [{"text": f"The sum of {a} and {b} is {a + b}."} for a in range(8) for b in range(4)]
    return write_jsonl(tmp_path / "text.jsonl", rows)


# ----------------------------------------------------------------------------- one Ray head per worker

#: this worker's Ray head once started: {"proc": the `ray start` process, "address": ..., "temp_dir": ...}
_RAY_HEAD: dict = {}
#: `rollout.actors=M` (M >= 1) or `engine.world_size=N` (N > 1) on the command line: the run uses Ray
_RAY_ARG = re.compile(r"rollout\.actors=([1-9]\d*)|engine\.world_size=([2-9]|\d\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_head_address() -> str:
    """The address of this worker's own Ray head, started the first time a test needs Ray and killed at the end of
    the session (`pytest_unconfigure`). Runs join it through RAY_ADDRESS (`engine.ray_address` empty) instead of
    each starting a local cluster of its own (gcs, raylet, agents: ~7 CPU-seconds and seconds of wall time a run).
    Its CPUs are this machine's, what a local cluster counts, so each actor's share of threads is unchanged."""
    if _RAY_HEAD:
        return _RAY_HEAD["address"]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    temp_dir = tempfile.mkdtemp(prefix=f"oxrl-ray-{worker}-", dir="/tmp")  # short: Ray's sockets live under it
    port = _free_port()
    log = Path(temp_dir, "head.log")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",  # as a local cluster: drivers join without a token
        # what the launcher sets before it starts a local cluster (its processes inherit them)
        "RAY_DISABLE_WORKER_LOG_PREFIX": "1",
        "RAY_COLOR_PREFIX": "0",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    }
    cmd = [
        shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray",
        "start", "--head", "--block", f"--port={port}", f"--num-cpus={os.cpu_count()}",
        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _RAY_HEAD.update(proc=proc, address=f"127.0.0.1:{port}", temp_dir=temp_dir)
    deadline = time.time() + 120
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            _stop_ray_head()
            raise RuntimeError(f"the test Ray head did not start: {log.read_text() if log.exists() else ''}")
        time.sleep(0.1)
    return _RAY_HEAD["address"]


def _stop_ray_head() -> None:
    """The head's whole process group: SIGTERM (Ray's own clean-up), then SIGKILL for whatever is left."""
    if not _RAY_HEAD:
        return
    proc = _RAY_HEAD["proc"]
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    shutil.rmtree(_RAY_HEAD["temp_dir"], ignore_errors=True)
    _RAY_HEAD.clear()


def pytest_unconfigure(config) -> None:
    _stop_ray_head()


@pytest.fixture(scope="session")
def ray_address() -> str:
    """This worker's Ray head (`ray_head_address`), for tests that start `oxrl` themselves: pass it as RAY_ADDRESS."""
    return ray_head_address()


def oxrl(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600, cold: bool = False
) -> subprocess.CompletedProcess:
    """Run the real `oxrl` console entry point; returns the completed process (text output). The process is
    forked from a warm one that has imported torch and transformers (`cli_zygote`); `cold=True` starts a fresh
    interpreter instead (for what only a cold start shows: import times, what `--help` imports).

    A run whose arguments ask for Ray (`rollout.actors`, `engine.world_size` > 1), and once it runs any later
    one (a `--resume` reads them from its run directory), joins this worker's Ray head (`ray_head_address`)
    unless ``env`` sets RAY_ADDRESS itself (``""``: a local cluster of its own)."""
    full_env = {**os.environ, **(env or {})}
    if "RAY_ADDRESS" not in (env or {}) and (_RAY_HEAD or any(_RAY_ARG.fullmatch(a) for a in args)):
        full_env["RAY_ADDRESS"] = ray_head_address()
    exe = Path(sys.executable).with_name("oxrl")
    if cold or not cli_zygote.warm_call_possible(list(args), full_env):
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "oxrl_core.cli"]
        return subprocess.run(cmd + list(args), cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return cli_zygote.run(str(exe), list(args), full_env, cwd, timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def layered_venv(path: Path) -> str:
    """A throw-away virtual environment at ``path`` layered on the one running the tests; its python.

    Its own site-packages come first (what a test installs goes there, never into the shared environment),
    then this interpreter's site directories with their ``.pth`` files (oxrl, the editable plugins, pip,
    setuptools). They are named explicitly rather than through ``--system-site-packages``, which inside a
    virtualenv would expose the base interpreter's packages instead of the virtualenv's."""
    import site

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    outer = [p for p in [*site.getsitepackages(), *user] if os.path.isdir(p)]
    Path(purelib, "_outer_environment.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
    return str(python)
