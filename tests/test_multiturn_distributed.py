"""Multi-turn episodes beyond one process: in rollout actors (`rollout.actors`) and on DeepSpeed ranks
(`engine.world_size`). The rollout batch is cut into `engine.rollout_shards` seeded shards of whole prompts
as single-turn rollouts are, so the same shards give the same episodes, rewards and losses in one process,
in two rollout actors (the environment on rank 0, each turn's shards generated in parallel) and on two
ZeRO-3 ranks (each rank plays its shards with its own environments, the episodes gathered)."""

from __future__ import annotations

import pytest
from conftest import oxrl, read_metrics, write_jsonl
from test_multiturn_e2e import ALWAYS_CALLS  # a tool parser that makes every episode multi-turn

from oxrl_core.models.tiny import warm_start_dir

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

KEYS = ("reward/mean", "reward/std", "env/turns", "env/tool_calls", "env/episode_tokens", "env/truncated")


@pytest.fixture(scope="module")
def multiturn(tmp_path_factory):
    """``run(name, *sets) -> run dir``: 3 SGRPO steps on the calculator, 2 rollout shards of 2 prompts × 4 episodes."""
    root = tmp_path_factory.mktemp("multiturn-dist")
    (root / "always_calls.py").write_text(ALWAYS_CALLS)
    rows = write_jsonl(
        root / "q.jsonl",
        [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(2, 9)],
    )
    sets = {
        "model.name": warm_start_dir(), "data.train": rows, "train.eval_every": 0, "env.name": "calculator",
        "env.tool_parser": f"{root / 'always_calls.py'}:AlwaysCalls", "env.max_turns": 3, "env.max_tokens": 48,
        "train.batch_size": 4, "rollout.n": 4, "rollout.max_new_tokens": 8, "train.lr": 1e-3, "reward.name": "arith",
        "train.max_steps": 3, "engine.rollout_shards": 2, "train.lr_scheduler": "constant",
    }  # fmt: skip
    common = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]

    def run(name: str, *more: str):
        out = oxrl(
            "run",
            "--alg",
            "sgrpo",
            *common,
            *more,
            "-o",
            str(root / name),
            "-q",
            cwd=root,
            env={"OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Traceback" not in out.stderr
        return read_metrics(root / name)

    run.local = run("local")
    return run


def _same(a: list[dict], b: list[dict]) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in KEYS:
            assert x[key] == pytest.approx(y[key], abs=1e-9), key  # the same episodes
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5) and x["grad_norm"] == pytest.approx(
            y["grad_norm"], abs=1e-4
        )
        assert y["rollout/logprob_diff"] < 1e-4 and y["policy/version"] == y["step"] - 1


@pytest.mark.slow
def test_multi_turn_episodes_in_two_rollout_actors_equal_the_in_process_episodes(multiturn):
    local = multiturn.local
    assert all(m["env/tool_calls"] > 0 and m["env/turns"] > 1 for m in local)  # real multi-turn episodes
    _same(local, multiturn("actors", "--set", "rollout.actors=2"))


@pytest.mark.slow
def test_multi_turn_episodes_on_two_zero3_ranks_equal_the_single_process_run(multiturn):
    pytest.importorskip("deepspeed")
    ranks = multiturn(
        "ranks", "--set", "engine.name=deepspeed", "--set", "engine.zero_stage=3", "--set", "engine.world_size=2",
        "--set", "engine.timeout_s=120",
    )  # fmt: skip
    _same(multiturn.local, ranks)


@pytest.mark.slow
def test_multi_turn_episodes_with_asynchronous_rollouts_on_two_zero3_ranks_keep_the_schedule(multiturn):
    """rollout.max_staleness=1 with one rollout actor and two ZeRO-3 ranks: rank 0's worker plays and scores the
    episodes ahead and every rank receives them; step 1 (version 0 either way) equals the synchronous run, and
    every later step trains on version max(0, step - 2)."""
    pytest.importorskip("deepspeed")
    both = multiturn(
        "async-ranks", "--set", "rollout.actors=1", "--set", "rollout.max_staleness=1", "--set", "engine.name=deepspeed",
        "--set", "engine.zero_stage=3", "--set", "engine.world_size=2", "--set", "engine.timeout_s=120",
    )  # fmt: skip
    local = multiturn.local
    for key in KEYS:
        assert both[0][key] == pytest.approx(local[0][key], abs=1e-9), key
    assert both[0]["loss"] == pytest.approx(local[0]["loss"], abs=1e-5)
    assert [m["policy/version"] for m in both] == [0, 0, 1]
    assert [m["policy/staleness_max"] for m in both] == [0, 1, 1]
    assert all(m["env/turns"] > 1 and m["tis/weight_mean"] > 0 for m in both)
