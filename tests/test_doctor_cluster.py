"""`oxrl doctor` and a Ray cluster: given an address (`--ray-address`, else $RAY_ADDRESS) it lists the cluster's
alive nodes (full node id, host, CPUs, GPUs, the head) and a summary; it never starts a cluster, and an address
where nothing answers is one not-ok row, not a traceback or a hang.

An unreachable cluster is a not-ok row ("unreachable") and the command still exits 0, as a missing package or a
plugin that fails to load does: the doctor's answer is its table (tests/test_plugins.py checks exit 0 with a
broken plugin)."""

from __future__ import annotations

import socket
import time

import pytest
from conftest import oxrl

from oxrl_core.commands import doctor


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def two_nodes():
    """A head with 1 CPU and a second node with 2, on this machine (Ray's own test helper)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def test_doctor_lists_the_nodes_of_a_cluster(two_nodes, tmp_path):
    head, [worker] = two_nodes.head_node, list(two_nodes.worker_nodes)
    # the option wins over $RAY_ADDRESS (which points nowhere here)
    proc = oxrl("doctor", "--ray-address", two_nodes.address, env={"RAY_ADDRESS": "127.0.0.1:1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    [head_line] = [line for line in lines if head.node_id in line]  # the whole id on one line: it can be pasted
    [worker_line] = [line for line in lines if worker.node_id in line]
    assert "ray node (head)" in head_line and "1 CPU," in head_line and "0 GPUs" in head_line, head_line
    assert "ray node " in worker_line and "(head)" not in worker_line and "2 CPUs" in worker_line, worker_line
    assert f"2 nodes, 3 CPUs, 0 GPUs at {two_nodes.address} (from --ray-address)" in flat(proc.stdout), proc.stdout


def test_doctor_says_when_nothing_answers(tmp_path):
    """$RAY_ADDRESS names a port where nothing listens: one red row, at once."""
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = oxrl("doctor", env={"RAY_ADDRESS": f"127.0.0.1:{port}"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = flat(proc.stdout + proc.stderr)
    assert "Traceback" not in text
    assert f"ray cluster │ unreachable │ nothing answers at 127.0.0.1:{port} (from" in text, text
    assert "RAY_ADDRESS): Connection refused" in text, text


def test_a_silent_address_is_bounded_in_time(monkeypatch):
    """Something listens but never speaks Ray (a wrong port): Ray would retry for minutes; the doctor gives up."""
    monkeypatch.setattr(doctor, "CONNECT_TIMEOUT_S", 3.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        [row] = doctor.cluster_rows(f"127.0.0.1:{s.getsockname()[1]}")
    assert row[:2] == ("ray cluster", False)
    assert "no answer from a Ray cluster at 127.0.0.1:" in row[2] and "within 3 s" in row[2], row


def test_without_an_address_it_only_says_so(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    [row] = doctor.cluster_rows(None)
    assert row[:2] == ("ray cluster", True) and "set RAY_ADDRESS or pass --ray-address" in row[2]


def test_bug_report_never_joins_a_cluster(monkeypatch):
    """`oxrl bug-report` pastes the doctor's table without the cluster rows: it connects to nothing."""
    from oxrl_core.commands.bug_report import bug_report

    monkeypatch.setattr(doctor, "cluster_rows", lambda *a: pytest.fail("bug-report asked the cluster"))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    report = bug_report(None)
    assert "| ray |" in report and "ray cluster" not in report


# ----------------------------------------------------------------------------- a run probes its cluster first (issue 43)

RL_ACTORS = ["run", "--alg", "sgrpo", "--set", "rollout.actors=1", "--set", "train.max_steps=1"]


def free_port() -> int:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_refused_before_loading(proc, *expected: str) -> None:
    text = flat(proc.stdout + proc.stderr)
    assert proc.returncode == 2, text
    assert "Traceback" not in text and "loading" not in text, text  # nothing loaded: no model, no warm start
    for part in expected:
        assert part in text, (part, text)


def test_a_run_joining_a_closed_port_is_refused_at_once_naming_the_field(tmp_path):
    port = free_port()
    started = time.monotonic()
    proc = oxrl(*RL_ACTORS, "--set", f"engine.ray_address=127.0.0.1:{port}", "-o", str(tmp_path / "r"),
                env={"RAY_ADDRESS": ""}, cwd=tmp_path)  # fmt: skip
    assert_refused_before_loading(
        proc, f"engine.ray_address='127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} (from engine.ray_address)"
    )
    assert time.monotonic() - started < 30 and not (tmp_path / "r").exists()


def test_a_run_joining_a_silent_port_is_bounded_by_engine_timeout(tmp_path):
    """Something listens but never speaks Ray (an HTTP server's port): the join is given min(engine.timeout_s, 60 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        started = time.monotonic()
        proc = oxrl(*RL_ACTORS, "--set", "engine.timeout_s=3", "-o", str(tmp_path / "r"),
                    env={"RAY_ADDRESS": address}, cwd=tmp_path)  # fmt: skip
    assert_refused_before_loading(
        proc, f"RAY_ADDRESS='{address}': no answer from a Ray cluster at {address} (from RAY_ADDRESS) within 3 s"
    )
    assert time.monotonic() - started < 40


def test_an_unknown_node_in_actor_placement_is_refused_before_loading_with_one_process(tmp_path, two_nodes):
    head, [worker] = two_nodes.head_node, list(two_nodes.worker_nodes)
    sets = ["--set", "rollout.actor_placement=deadbeef", "-o", str(tmp_path / "r")]
    joined = oxrl(*RL_ACTORS, *sets, env={"RAY_ADDRESS": two_nodes.address}, cwd=tmp_path)
    assert_refused_before_loading(
        joined, "rollout.actor_placement: 'deadbeef' is not an alive node of the Ray cluster", head.node_id,
        worker.node_id,
    )  # fmt: skip
    local = oxrl(*RL_ACTORS, *sets, env={"RAY_ADDRESS": ""}, cwd=tmp_path)
    assert_refused_before_loading(local, "rollout.actor_placement='deadbeef' names a Ray node", "new local Ray cluster")
    # a node of the cluster passes the check (the run itself is test_rollout_actors')
    from oxrl_core.config import load_run_config
    from oxrl_core.engines.ray_cluster import check_cluster

    cfg = load_run_config(None, ["engine.ray_address=" + two_nodes.address, "rollout.actors=1",
                                 f"rollout.actor_placement={worker.node_id[:10]}"], algorithm="sgrpo")  # fmt: skip
    check_cluster(cfg.engine, cfg.rollout, uses_rollout_actors=True)


def test_doctor_local_is_not_a_cluster_to_inspect(monkeypatch):
    """`--ray-address local` would start a new cluster (seconds, in the probe's child); the doctor says what it
    means, at once, and starts nothing (no child process is run)."""
    monkeypatch.setattr(doctor, "probe_nodes", lambda *a: pytest.fail("the doctor probed (started) a cluster"))
    started = time.monotonic()
    [row] = doctor.cluster_rows("local")
    assert row[:2] == ("ray cluster", True) and "'local' means a new Ray cluster" in row[2], row
    assert "local (from --ray-address)" in row[2] and time.monotonic() - started < 1
