"""Multi-node runs on a Ray cluster whose nodes all live on this host (`ray.cluster_utils.Cluster`), through the
real CLI: each run joins it through RAY_ADDRESS, as a run on a real cluster does.

The cluster has a head without CPUs (the `oxrl` drivers connect to it, as to a real cluster's head: it holds no
rank, so any node that does can be removed) and worker nodes reshaped per test (`Nodes.shape`). Invariances:
training ranks on two nodes follow the single-process trajectory (SFT, DPO: ZeRO-3 over gloo, as on one node);
SGRPO with both ranks on one node and the rollout actor on another (``rollout.actor_placement``: a node id) draws
the single-process samples and every weight sync to the other node is verified; ``ranks.json`` says where each
rank ran (node, local rank, threads = the node's CPUs ÷ its ranks) and ``rollout_actors.json`` where each actor
did. A layout the cluster cannot hold is refused (exit 2, no traceback): at once when its totals are too small,
after ``engine.timeout_s`` when its CPUs are held by someone else, at start for an unknown node id. A node lost
mid-run stops the run naming the rank and its node; ``--resume`` on the mended cluster equals the uninterrupted
run. Tolerances as in tests/test_deepspeed.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import _free_port, read_metrics, write_jsonl
from test_deepspeed import (
    DP2,
    _assert_close_weights,
    _assert_same_trajectory,
    _ok,
    _sft,
    _sgrpo,
    _weights,
    make_work,
    oxrl,
    resume_to_the_end,
    sft_args,
    sgrpo_args,
    start_oxrl,
    stopped_resumably,
    wait_for,
)
from test_preference import _pairs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("ray") is None,
        reason="needs deepspeed and ray (pip install 'oxrl[deepspeed,ray]')",
    ),
]


class Nodes:
    """A Ray cluster on this host: a head without CPUs and worker nodes of the CPU counts `shape` asks for.

    Its files live in a temp dir of its own, and it does not record itself as "the current cluster" of this
    machine (`ray.cluster_utils.Cluster` would, in /tmp/ray, where other Ray users on the host look)."""

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="oxrl-mn-", dir="/tmp")  # short: Ray's sockets live under it
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "temp_dir": self.temp_dir,
                    "include_dashboard": False,
                    # fixed by default (52365): another cluster on this machine may hold it (Cluster picks the
                    # other nodes' ports free)
                    "dashboard_agent_listen_port": _free_port(),
                },
            )
        self.workers: dict[str, tuple[int, object]] = {}  # node id -> (CPUs, Ray's node)

    @property
    def env(self) -> dict:
        return {"RAY_ADDRESS": self.cluster.address}

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def shape(self, *cpus: int) -> list[str]:
        """Worker nodes with these CPU counts (kept where they exist, else added; others removed); their ids in
        the order asked."""
        free = dict(self.workers)
        ids = []
        for count in cpus:
            match = next((node_id for node_id, (c, _) in free.items() if c == count), None)
            if match is None:
                node = self.cluster.add_node(num_cpus=count, temp_dir=self.temp_dir)
                match = node.node_id
                self.workers[match] = (count, node)
            else:
                del free[match]
            ids.append(match)
        for node_id in free:
            self.remove(node_id)
        self.cluster.wait_for_nodes(timeout=90)  # a node killed without notice is dead after health checks
        return ids

    def remove(self, node_id: str, graceful: bool = True) -> None:
        self.cluster.remove_node(self.workers.pop(node_id)[1], allow_graceful=graceful)

    def shutdown(self) -> None:
        import ray

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ray._common.utils, "reset_ray_address", lambda *args, **kwargs: None)
            self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes():
    cluster = Nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = make_work(tmp_path_factory.mktemp("multinode"))
    write_jsonl(root / "pairs.jsonl", _pairs())
    return root


@pytest.fixture(scope="module")
def single_sft(work, tiny_model_dir) -> Path:
    """The one-process run every SFT run here follows."""
    return _sft(work, "single-sft", tiny_model_dir)


@pytest.fixture(scope="module")
def two_node_sft(work, tiny_model_dir, nodes) -> Path:
    """The SFT run on two ranks, one on each of two 1-CPU nodes: the uninterrupted run a resumed one equals."""
    nodes.shape(1, 1)
    return _sft(work, "two-node-sft", tiny_model_dir, *DP2, env=nodes.env)


def _ranks(run: Path) -> list[dict]:
    return json.loads((run / "ranks.json").read_text())


def _refused(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


# ----------------------------------------------------------------------------- where ranks and actors run


def test_zero3_sft_with_a_rank_on_each_of_two_nodes_follows_one_process(nodes, single_sft, two_node_sft):
    _assert_same_trajectory(single_sft, two_node_sft, keys=("loss", "grad_norm", "perf/tokens"))
    _assert_close_weights(_weights(single_sft / "final"), _weights(two_node_sft / "final"))
    ranks = _ranks(two_node_sft)
    assert [r["rank"] for r in ranks] == [0, 1]
    # one rank on each worker node (the head has no CPU), each alone there: local rank 0 of 1, the node's one CPU
    assert len({r["node_id"] for r in ranks}) == 2 and nodes.head_id not in {r["node_id"] for r in ranks}
    assert [r["node_rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["local_rank"], r["local_world_size"], r["threads"]) == (0, 1, 1), r


def test_dpo_with_a_rank_on_each_of_two_nodes_follows_one_process(work, tiny_model_dir, nodes):
    nodes.shape(1, 1)
    common = [
        "run",
        "--alg",
        "dpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={work / 'pairs.jsonl'}",
    ]
    common += ["--set", "train.max_steps=3", "--set", "train.batch_size=4", "--set", "train.lr=1e-3"]
    common += ["--set", "alg.beta=0.5"]
    single, dp = work / "single-dpo", work / "two-node-dpo"
    _ok(oxrl(*common, "-o", str(single), cwd=work))
    _ok(oxrl(*common, *DP2, "-o", str(dp), cwd=work, env=nodes.env))
    _assert_same_trajectory(single, dp, keys=("loss", "rewards/margins", "logps/chosen", "logps/rejected"))
    assert len({r["node_id"] for r in _ranks(dp)}) == 2
    _assert_close_weights(_weights(single / "final"), _weights(dp / "final"))


# ----------------------------------------------------------------------------- layouts the cluster cannot hold


def test_more_ranks_than_the_clusters_cpus_are_refused_at_once(work, tiny_model_dir, nodes):
    nodes.shape(1, 1)
    started = time.monotonic()
    args = sft_args(work, tiny_model_dir, *DP2, "--set", "engine.world_size=4", "-o", str(work / "four-ranks"))
    stderr = _refused(oxrl(*args, cwd=work, env=nodes.env))
    assert time.monotonic() - started < 60  # not after engine.timeout_s=120
    assert "engine.world_size=4 CPU ranks need 4 CPUs (one each) but the Ray cluster has 2" in stderr


def test_ranks_on_a_busy_cluster_are_refused_after_the_timeout_naming_each_node(work, tiny_model_dir, nodes):
    """The cluster has the CPUs, but another job holds them all: refused after engine.timeout_s, not a hang."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    ids = nodes.shape(1, 1)
    ray.init(address=nodes.cluster.address, include_dashboard=False, logging_level="ERROR")
    try:
        held = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD")
        assert held.wait(60)
        started = time.monotonic()
        args = sft_args(work, tiny_model_dir, *DP2, "--set", "engine.timeout_s=5", "-o", str(work / "busy"))
        stderr = _refused(oxrl(*args, cwd=work, env=nodes.env))
        took = time.monotonic() - started
        remove_placement_group(held)
    finally:
        ray.shutdown()
    assert 5 <= took < 60, took
    assert "within engine.timeout_s=5" in stderr and "asked for 2 bundles of 1 CPU" in stderr, stderr
    for node_id in ids:  # each node with what it has free and in all
        assert f"node {node_id[:8]} " in stderr and "0 of 1 CPUs free" in stderr, (node_id, stderr)


def test_rollout_actors_on_an_unknown_node_are_refused_naming_the_clusters_nodes(work, tiny_model_dir, nodes):
    ids = nodes.shape(1, 1)
    unknown = "deadbeef" * 7  # a well-formed Ray node id (56 hex digits) of no node here
    args = sgrpo_args(work, tiny_model_dir, "--set", "rollout.actors=1", "--set", f"rollout.actor_placement={unknown}")
    started = time.time()  # two ranks: the launcher refuses it before placing them or loading anything
    stderr = _refused(oxrl(*args, *DP2, "-o", str(work / "unknown-node"), cwd=work, env=nodes.env))
    assert not (work / "unknown-node" / "ranks.json").exists() and time.time() - started < 30
    assert "rollout.actor_placement" in stderr and unknown in stderr
    for node_id in [nodes.head_id, *ids]:
        assert node_id in stderr, (node_id, stderr)


class _Where:
    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def test_gpu_bundles_give_each_rank_its_nodes_gpus_in_local_rank_order(work, tiny_model_dir, nodes, two_node_sft):
    """Ray lets a node declare GPUs it does not have, which runs the placement of a cluster with GPUs here: each rank
    takes a GPU bundle and runs with its node's training GPUs visible in local-rank order (so cuda:LOCAL_RANK is its
    own), and rollout actors take a GPU each in a placement group of their own, on the node asked for or spread.
    Torch sees no CUDA, so the ranks still train on the CPU and follow the two-node run."""
    import ray

    nodes.shape()  # only the GPU nodes below
    gpu2 = nodes.cluster.add_node(num_cpus=2, num_gpus=2, temp_dir=nodes.temp_dir)
    gpu1 = nodes.cluster.add_node(num_cpus=1, num_gpus=1, temp_dir=nodes.temp_dir)
    try:
        nodes.cluster.wait_for_nodes(timeout=90)
        run = _sft(work, "gpu-bundles", tiny_model_dir, *DP2, "--set", "engine.device=auto", env=nodes.env)
        _assert_same_trajectory(two_node_sft, run, keys=("loss", "grad_norm"))
        ranks = _ranks(run)
        assert [(r["node_id"], r["local_rank"], r["threads"]) for r in ranks] == [
            (gpu2.node_id, 0, 1),
            (gpu2.node_id, 1, 1),
        ]  # PACK: both GPUs of one node
        own = [r["gpus"][0] for r in ranks]
        assert sorted(own) == ["0", "1"] and all(r["visible_devices"] == ",".join(own) for r in ranks), ranks
        from oxrl_core.rollout.actors import RolloutActors

        ray.init(address=nodes.cluster.address, include_dashboard=False, logging_level="ERROR")
        try:
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
            where = ray.remote(_Where)
            for placement, count, expected in (  # spread first: a removed group frees its GPUs a moment later
                ("spread", 2, None),
                (gpu1.node_id, 1, [gpu1.node_id]),
                ("pack", 2, [gpu2.node_id, gpu2.node_id]),
            ):
                proxy = RolloutActors([], "hf", 60.0, owns_ray=False)
                try:
                    placed = proxy._placed(ray, count, placement)
                    assert proxy.group is not None and [t for _, t in placed] == [0] * count
                    actors = [where.options(**options).remote() for options, _ in placed]
                    got = ray.get([a.node.remote() for a in actors], timeout=60)
                    for a in actors:
                        ray.kill(a)
                finally:
                    proxy.close()  # removes the actors' placement group
                if expected is None:  # spread: one GPU on each node
                    assert sorted(got) == sorted([gpu1.node_id, gpu2.node_id]), (placement, got)
                else:
                    assert got == expected, (placement, got)
        finally:
            ray.shutdown()
    finally:
        for node in (gpu1, gpu2):
            nodes.cluster.remove_node(node)


# ----------------------------------------------------------------------------- a node lost mid-run


def _lose_the_node_of_rank_1(work: Path, model: Path, nodes: Nodes, name: str, graceful: bool) -> tuple[str, Path]:
    """The run of `two_node_sft` with a checkpoint every step; once the first is written, rank 1's node leaves the
    cluster (``graceful``: its raylet shuts down and tells the cluster, else it is killed as by a power loss).
    Rank 0 is held (SIGSTOP) while the node is removed, so the run cannot finish first. Checks the message names
    rank 1, its node and that the node left; returns (the driver's stderr, the checkpoint to resume from)."""
    from oxrl_core.run_io.checkpoint import latest_checkpoint

    nodes.shape(1, 1)
    run = work / name
    args = sft_args(work, model, *DP2, "--set", "train.save_every=1", "-o", str(run))
    driver = start_oxrl(args, work, nodes.env)
    try:
        wait_for(driver, lambda: latest_checkpoint(run) is not None)
        first, second = _ranks(run)
        os.kill(first["pid"], signal.SIGSTOP)
        try:
            nodes.remove(second["node_id"], graceful=graceful)
        finally:
            os.kill(first["pid"], signal.SIGCONT)
    except BaseException:
        driver.kill()
        driver.communicate()
        raise
    stderr, last = stopped_resumably(driver, run, since=time.time())
    assert f"rank 1 (pid {second['pid']} on node {second['node_id'][:8]}" in stderr, stderr
    assert "left the Ray cluster" in stderr, stderr
    return stderr, last


def test_a_lost_node_stops_the_run_naming_its_rank_and_resume_equals_the_uninterrupted_run(
    work, tiny_model_dir, nodes, two_node_sft
):
    _, last = _lose_the_node_of_rank_1(work, tiny_model_dir, nodes, "lost-node", graceful=True)
    # the cluster mended (a new 1-CPU node): --resume finishes the run, equal to the uninterrupted one
    nodes.shape(1, 1)
    resume_to_the_end(work, work / "lost-node", last, steps=4, env=nodes.env)
    _assert_same_trajectory(two_node_sft, work / "lost-node", keys=("loss", "grad_norm"))
    _assert_close_weights(_weights(two_node_sft / "final"), _weights(work / "lost-node" / "final"))


# ----------------------------------------------------------------------------- rollout actors on another node


def test_sgrpo_ranks_on_one_node_sync_a_rollout_actor_on_another(work, tiny_model_dir, nodes):
    """Both ranks on a 2-CPU node (PACK), the rollout actor named onto a 1-CPU node: the single-process samples,
    and every sync of the weights to the other node passes the probe."""
    other, both = nodes.shape(1, 2)
    two_steps = ("--set", "train.max_steps=2")  # one sync to the other node after the first
    single = _sgrpo(work, "single-sgrpo", tiny_model_dir, *two_steps)
    run = _sgrpo(
        work,
        "sgrpo-actor-elsewhere",
        tiny_model_dir,
        *two_steps,
        *DP2,
        "--set",
        "rollout.actors=1",
        "--set",
        f"rollout.actor_placement={other}",
        env=nodes.env,
    )
    _assert_same_trajectory(single, run, keys=("reward/mean", "reward/std", "response/length"), atol=0)
    _assert_same_trajectory(single, run, keys=("loss", "grad_norm"))
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # verified sync: the actor scores the probe as the trainer does, after every sync
        assert m["sync/probe_logprob_diff"] < 1e-5 and m["policy/version"] == m["step"] - 1, m
    ranks = _ranks(run)
    assert [(r["node_id"], r["local_rank"], r["local_world_size"]) for r in ranks] == [(both, 0, 2), (both, 1, 2)]
    assert [r["node_rank"] for r in ranks] == [0, 0]
    assert [r["threads"] for r in ranks] == [1, 1]  # the node's 2 CPUs ÷ its 2 ranks
    actors = json.loads((run / "rollout_actors.json").read_text())
    assert [(a["actor"], a["node_id"], a["threads"]) for a in actors] == [(0, other, 1)]


# ----------------------------------------------------------------------------- last: the cluster needs time after it


def test_a_node_killed_without_notice_is_named_as_lost(work, tiny_model_dir, nodes):
    """As a power loss: rank 1's raylet is killed, not shut down. Last in the module: the cluster marks the node
    dead only after its health checks (~30 s), and reshaping waits for that."""
    _lose_the_node_of_rank_1(work, tiny_model_dir, nodes, "killed-node", graceful=False)
