"""`rollout.actors: M`: the rollout backend in Ray actors of its own (N training actors and M rollout
actors; ``docs/architecture.md``). Same samples as the in-process backend with the same `engine.rollout_shards`;
every sync verified on every actor; a dying actor stops the run clearly and keeps the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import oxrl, read_metrics

from oxrl_core.engines.distributed import resolve_ray_address
from oxrl_core.errors import OxrlError

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

COMMON = [
    "--set",
    "train.max_steps=3",
    "--set",
    "train.batch_size=4",
    "--set",
    "rollout.n=4",
    "--set",
    "rollout.max_new_tokens=8",
    "--set",
    "engine.rollout_shards=2",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.lr=1e-2",
    "--set",
    "train.lr_scheduler=constant",
    "-q",
]
ENV = {"OMP_NUM_THREADS": "1"}

DYING = """
import os
from oxrl_core.rollout.hf import HFRolloutBackend


class DiesAtVersion2(HFRolloutBackend):
    name = "dies"

    def generate(self, prompt_token_ids, sampling):
        if self.policy_version >= 2:
            os._exit(3)  # the actor's process dies (as from an out-of-memory kill)
        return super().generate(prompt_token_ids, sampling)
"""


def _run(tmp_path, tiny_model_dir, name: str, *sets: str):
    run = tmp_path / name
    proc = oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={tiny_model_dir}",
        *COMMON,
        *sets,
        "-o",
        str(run),
        cwd=tmp_path,
        env=ENV,
    )
    return run, proc


def _same_steps(a, b, loss_atol: float = 1e-5) -> None:
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [1, 2, 3]
    for x, y in zip(ma, mb):
        assert x["reward/mean"] == y["reward/mean"] and x["response/length"] == y["response/length"]
        assert x["loss"] == pytest.approx(y["loss"], abs=loss_atol) and x["grad_norm"] == pytest.approx(
            y["grad_norm"], abs=1e-4
        )


@pytest.mark.slow
def test_two_rollout_actors_draw_the_in_process_samples_and_every_sync_is_verified(tmp_path, tiny_model_dir):
    local, proc = _run(tmp_path, tiny_model_dir, "local")
    assert proc.returncode == 0, proc.stderr
    actors, proc = _run(tmp_path, tiny_model_dir, "actors", "--set", "rollout.actors=2")
    assert proc.returncode == 0, proc.stderr
    _same_steps(local, actors)
    for m in read_metrics(actors):
        assert m["sync/probe_logprob_diff"] < 1e-5 and m["rollout/logprob_diff"] < 1e-4
        assert m["policy/version"] == m["step"] - 1  # strictly on-policy: the actors moved with every sync
    assert (actors / "final" / "config.json").is_file()


@pytest.mark.slow
def test_vllm_in_two_rollout_actors_draws_the_in_process_vllm_samples(tmp_path, tiny_model_dir):
    pytest.importorskip("vllm")
    local, proc = _run(tmp_path, tiny_model_dir, "vllm-local", "--set", "rollout.backend=vllm")
    assert proc.returncode == 0, proc.stderr
    actors, proc = _run(
        tmp_path, tiny_model_dir, "vllm-actors", "--set", "rollout.backend=vllm", "--set", "rollout.actors=2"
    )
    assert proc.returncode == 0, proc.stderr
    assert "RolloutWorker" not in proc.stderr  # the engines' logs stay out of the run's output
    _same_steps(local, actors)
    assert all(m["sync/probe_logprob_diff"] < 1e-4 for m in read_metrics(actors))


@pytest.mark.slow
def test_two_training_ranks_and_one_rollout_actor_follow_the_single_process_run(tmp_path, tiny_model_dir):
    pytest.importorskip("deepspeed")
    local, proc = _run(tmp_path, tiny_model_dir, "local")
    assert proc.returncode == 0, proc.stderr
    both, proc = _run(
        tmp_path,
        tiny_model_dir,
        "ranks",
        "--set",
        "rollout.actors=1",
        "--set",
        "engine.name=deepspeed",
        "--set",
        "engine.zero_stage=3",
        "--set",
        "engine.world_size=2",
        "--set",
        "engine.timeout_s=120",
    )
    assert proc.returncode == 0, proc.stderr
    _same_steps(local, both)


@pytest.mark.slow
def test_a_dying_rollout_actor_stops_the_run_clearly_and_keeps_the_checkpoint(tmp_path, tiny_model_dir):
    (tmp_path / "dying.py").write_text(DYING)
    run, proc = _run(
        tmp_path,
        tiny_model_dir,
        "dies",
        "--set",
        "rollout.actors=1",
        "--set",
        f"rollout.backend={tmp_path / 'dying.py'}:DiesAtVersion2",
        "--set",
        "train.save_every=1",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "rollout actors" in proc.stderr and "could not generate" in proc.stderr
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    assert (run / "checkpoints" / "step-2" / "trainer_state.json").is_file()


def test_an_empty_engine_ray_address_means_RAY_ADDRESS_else_a_new_local_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_ray_address("") == ("local", "")  # not ray.init()'s default: a cluster on this machine
    assert resolve_ray_address("auto") == ("auto", "engine.ray_address")
    monkeypatch.setenv("RAY_ADDRESS", " ")
    assert resolve_ray_address("") == ("local", "")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert resolve_ray_address("") == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert resolve_ray_address("auto") == ("auto", "engine.ray_address")  # the config wins


def test_an_unreachable_RAY_ADDRESS_is_named_in_the_error(monkeypatch):
    import ray

    from oxrl_core.rollout.actors import RolloutActors

    def unreachable(address, **kwargs):
        assert kwargs["runtime_env"]["env_vars"]["OXRL_PROBE"] == "1"  # the actors' environment, as for a local one
        raise ConnectionError(f"Failed to connect to Ray cluster at {address}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", unreachable)
    monkeypatch.setenv("OXRL_PROBE", "1")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(OxrlError, match=r"could not join the Ray cluster at RAY_ADDRESS='127.0.0.1:1': Connection"):
        RolloutActors.start(1, "hf", "model", None, 10.0)
    with pytest.raises(OxrlError, match=r"at engine.ray_address='127.0.0.1:2'"):
        RolloutActors.start(1, "hf", "model", None, 10.0, "127.0.0.1:2")


def test_join_ray_keeps_oxrls_signal_handlers_and_says_what_failed(monkeypatch):
    """The launcher's and the rollout actors' one way into Ray: Ray replacing the SIGTERM handler (its core
    worker aborts on SIGTERM) is undone, so a run still saves a checkpoint; a failure names the address."""
    import signal

    import ray

    from oxrl_core.engines.ray_cluster import join_ray

    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what Ray's core worker does to the handler

    def oxrls(signum, frame):
        pass

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", init)
    previous = signal.signal(signal.SIGTERM, oxrls)
    try:
        join_ray("127.0.0.1:3", log_to_driver=True)
        assert signal.getsignal(signal.SIGTERM) is oxrls
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (seen["address"], seen["log_to_driver"], seen["include_dashboard"]) == ("127.0.0.1:3", True, False)

    def refused(**kwargs):
        raise ConnectionError("refused")

    monkeypatch.setattr(ray, "init", refused)
    with pytest.raises(OxrlError, match=r"^could not start a local Ray cluster: ConnectionError: refused$"):
        join_ray("", log_to_driver=True)  # the launcher's message: no setting before it


@pytest.mark.slow
def test_a_run_joins_the_cluster_at_RAY_ADDRESS_and_leaves_it_running(tmp_path, tiny_model_dir, ray_address):
    from conftest import _RAY_HEAD

    logs = Path(_RAY_HEAD["temp_dir"], "session_latest", "logs")
    drivers = set(logs.glob("python-core-driver-*"))
    run, proc = _run(tmp_path, tiny_model_dir, "joined", "--set", "rollout.actors=1", "--set", "train.max_steps=1")
    assert proc.returncode == 0, proc.stderr
    assert [m["step"] for m in read_metrics(run)] == [1]
    assert set(logs.glob("python-core-driver-*")) - drivers  # this run's driver connected to the head
    assert _RAY_HEAD["proc"].poll() is None  # which keeps running for the next run
