"""The README's "Running on a cluster" recipe, on this machine: its two `ray start` lines (read from the README, so
the two cannot drift apart) start a head and a second node, one CPU each; `oxrl doctor --ray-address` lists both,
and a two-rank DeepSpeed run joins them with `engine.ray_address` and puts one rank on each node (ranks.json).

The test owns the two nodes: each `ray start` gets `--block` and its own process group, and is stopped by killing
that group (SIGTERM, then SIGKILL) — never `ray stop`, which stops every Ray cluster on the machine."""

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

import pytest
from conftest import ROOT, _free_port, oxrl, write_jsonl

SECTION = "### Running on a cluster"

#: flags both nodes get on top of the README's lines: the test owns the process (`--block`), one CPU each (so the
#: two ranks cannot share a node), a temp dir of its own (Ray's sockets and logs; removed at the end), and none of
#: the dashboard or usage reporting
COMMON_FLAGS = ["--block", "--num-cpus=1", "--disable-usage-stats"]
#: what a head needs on a machine where other Ray clusters run (the test suite's workers start their own): the
#: Ray client server's port (10001 by default) and the dashboard agent's HTTP port (52365 by default)
HEAD_FLAGS = ["--include-dashboard=false", "--ray-client-server-port={free}", "--dashboard-agent-listen-port={free}"]
#: what a second node on the head's own machine needs (found by trying, Ray 2.60): only the dashboard agent's HTTP
#: port has a fixed default (52365) and clashes; the node manager, object manager, the agents' gRPC, runtime-env and
#: metrics ports, and the workers' ports are picked free by Ray on each node
WORKER_FLAGS = ["--dashboard-agent-listen-port={free}"]


def recipe() -> tuple[str, str]:
    """The section's `ray start` lines: (the head's, the other machines')."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    head, worker = [line.strip() for line in block.splitlines() if line.strip().startswith("ray start")]
    assert "--head" in head and "--port=6379" in head, head
    assert "--address=<head-ip>:6379" in worker, worker
    return head, worker


def _argv(line: str, port: int, extra: list[str], temp_dir: str) -> list[str]:
    """The README's line with this machine's address and a free port for 6379, and the test's flags."""
    words = line.replace("<head-ip>", "127.0.0.1").replace("6379", str(port)).split()
    assert words[:2] == ["ray", "start"], line
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    flags = [flag.format(free=_free_port()) for flag in [*COMMON_FLAGS, *extra]]
    return [ray, *words[1:], *flags, f"--temp-dir={temp_dir}"]


def _start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_started(proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.time() + 120
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the {what} did not start: {' '.join(proc.args)}\n{log.read_text()}")
        time.sleep(0.1)


def _wait_listening(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.time() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the head's GCS never listened on {port}:\n{log.read_text()}") from None
            time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Each node's whole process group: SIGTERM (Ray's own clean-up), then SIGKILL for whatever is left."""
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def two_node_cluster():
    """The README's head and second node on this machine, one CPU each: yields the head's address."""
    head_line, worker_line = recipe()
    port = _free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",  # drivers join without a token, as they join a local cluster
        "RAY_DISABLE_WORKER_LOG_PREFIX": "1",
        "RAY_COLOR_PREFIX": "0",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    }
    # short: Ray's sockets live under it
    dirs = [tempfile.mkdtemp(prefix=f"oxrl-recipe-{name}-", dir="/tmp") for name in ("head", "node")]
    procs: list[subprocess.Popen] = []
    try:
        logs = [Path(d, "start.log") for d in dirs]
        procs.append(_start(_argv(head_line, port, HEAD_FLAGS, dirs[0]), logs[0], env))
        _wait_listening(procs[0], port, logs[0])  # the second node needs only the head's GCS: start it at once
        procs.append(_start(_argv(worker_line, port, WORKER_FLAGS, dirs[1]), logs[1], env))
        for proc, log, what in zip(procs, logs, ("head", "second node")):
            _wait_started(proc, log, what)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(procs)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_the_readme_recipe_runs_two_ranks_on_two_nodes(two_node_cluster, tmp_path, tiny_model_dir):
    address = two_node_cluster
    data = write_jsonl(
        tmp_path / "sft.jsonl",
        [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(4) for b in range(4)],
    )
    run = tmp_path / "run"
    sets = [
        f"model.name={tiny_model_dir}",
        f"data.train={data}",
        "train.max_steps=2",
        "train.batch_size=4",
        "engine.name=deepspeed",
        "engine.world_size=2",
        "engine.timeout_s=120",
        f"engine.ray_address={address}",  # and RAY_ADDRESS empty: the README's way, not the suite's shared head
    ]
    argv = ["run", "--alg", "sft", *[a for s in sets for a in ("--set", s)], "-o", str(run)]
    doctor = oxrl("doctor", "--ray-address", address, env={"RAY_ADDRESS": ""}, cwd=tmp_path)
    training = oxrl(*argv, env={"RAY_ADDRESS": ""}, cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr
    table = " ".join(doctor.stdout.split())
    assert f"2 nodes, 2 CPUs, 0 GPUs at {address} (from --ray-address)" in table, doctor.stdout
    listed = re.findall(r"ray node (?:\(head\) )?│ ok │ ([0-9a-f]{56}): .*?, 1 CPU, 0 GPUs", table)
    assert len(set(listed)) == 2, doctor.stdout

    assert training.returncode == 0, training.stderr[-3000:]
    ranks = json.loads((run / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    # one CPU per node and one per rank: the two ranks ran on the two nodes that `oxrl doctor` listed
    assert len({r["node_id"] for r in ranks}) == 2 and {r["node_id"] for r in ranks} == set(listed), (ranks, listed)
    # each alone on its node: local rank 0 of 1, the nodes numbered in rank order, that node's one CPU as threads
    assert [(r["local_rank"], r["local_world_size"], r["node_rank"], r["threads"]) for r in ranks] == [
        (0, 1, 0, 1),
        (0, 1, 1, 1),
    ], ranks
