"""DAPO's dynamic sampling (``rollout.dynamic_sampling``, `oxrl_core.rl.dynamic_sampling`): which groups a step
keeps, by hand; when refill rounds stop and what they take (a pure function of seed, step and round); the config's
refusals; end to end through the CLI: the sampling/* metrics single-turn and multi-turn, the limit (one message, the
run goes on), and asynchronous rollouts (the refill rounds inside the pipeline's job, the in-flight batch filtered)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from conftest import oxrl, read_metrics

from oxrl_core.config import RolloutConfig
from oxrl_core.data.batching import BatchPlan
from oxrl_core.interfaces import Completion
from oxrl_core.rl.batch import step_sampling
from oxrl_core.rl.dynamic_sampling import (
    DynamicSampling,
    Selection,
    groups_of,
    has_signal,
    select_groups,
)
from oxrl_core.rl.sources import INFLIGHT_FILE, decode
from oxrl_core.rl.strategies import Scored, join_groups
from oxrl_core.seeds import MOVES

# ----------------------------------------------------------------------------- the selection, by hand


def test_groups_with_equal_rewards_are_dropped_and_the_order_is_kept():
    assert has_signal([0.0, 1.0]) and has_signal([0.5, 0.5, 0.25]) and not has_signal([1.0, 1.0, 1.0])
    assert groups_of([1, 0, 1, 1, 0, 0], 2) == [[1, 0], [1, 1], [0, 0]]
    rounds = [
        [[1, 0], [1, 1], [0, 0], [0, 1]],  # the scheduled prompts: groups 0 and 3 differ
        [[0.5, 0.5], [0, 1], [2, 3], [1, 0]],  # refill round 1: groups 1, 2, 3 differ
    ]
    # scheduled first, then the refill round's, cut to batch_size = 4: (1, 3) is left out
    assert select_groups(rounds, 4) == Selection([(0, 0), (0, 3), (1, 1), (1, 2)], kept=4, short=False)
    # enough in the scheduled round alone: no refill group
    assert select_groups(rounds[:1], 2) == Selection([(0, 0), (0, 3)], kept=2, short=False)


def test_a_short_batch_is_filled_with_dropped_groups_in_play_order_and_flagged():
    rounds = [[[1, 0], [1, 1], [0, 0]], [[2, 2], [3, 3], [0, 1]]]  # 2 groups differ: (0, 0) and (1, 2)
    assert select_groups(rounds, 3) == Selection([(0, 0), (0, 1), (1, 2)], kept=2, short=True)
    assert select_groups(rounds, 4) == Selection([(0, 0), (0, 1), (0, 2), (1, 2)], kept=2, short=True)
    # nothing differs and no refill round: the scheduled batch as it was
    assert select_groups([[[1, 1], [0, 0]]], 2) == Selection([(0, 0), (0, 1)], kept=0, short=True)


def _scored(picks: list[int], scores: list[float], n: int) -> tuple[list[int], Scored]:
    """A round of len(picks) prompts: prompt i's ids are [i]; completion j's token is 100·prompt + j."""
    prompts = [[i] for i in picks for _ in range(n)]
    completions = [Completion([100 * i + j], [-1.0], "stop", 0) for i in picks for j in range(n)]
    media = [{"pixel_inputs": {"p": i}} if i == 4 else {} for i in picks for _ in range(n)]  # prompt 4 has an image
    return picks, Scored(prompts, completions, scores, {"reward/mean": sum(scores) / len(scores)}, media)


def test_the_picked_groups_are_joined_in_order_with_their_prompts_samples_and_scores():
    rounds = [_scored([7, 8], [1, 0, 1, 1], 2), _scored([3, 4], [0, 0, 1, 0], 2)]
    joined = join_groups(rounds, Selection([(0, 0), (1, 1)], 2, False), 2, {"sampling/rounds": 1.0})
    assert joined.picks == [7, 4] and joined.prompts == [[7], [7], [4], [4]]
    assert [c.token_ids[0] for c in joined.completions] == [700, 701, 400, 401]
    assert joined.scores == [1, 0, 1, 0] and joined.metrics == {"sampling/rounds": 1.0}
    assert joined.media == [{}, {}, {"pixel_inputs": {"p": 4}}, {"pixel_inputs": {"p": 4}}]  # with their samples


# ----------------------------------------------------------------------------- the rounds


def _dynamic(max_rounds: int, batch_size: int = 2, seed: int = 5) -> DynamicSampling:
    ro = RolloutConfig(n=2, dynamic_sampling=True, max_sampling_rounds=max_rounds)
    return DynamicSampling(ro, BatchPlan([3] * 20, batch_size, seed + 1, group_by_length=False), seed, batch_size)


def test_refill_rounds_stop_once_the_batch_is_full_or_at_the_limit_and_warn_once(caplog):
    # each round's scores by round number: round 0 one group differs, round 1 none, round 2 two
    by_round = {0: [1, 0, 1, 1], 1: [0, 0, 1, 1], 2: [0, 1, 1, 0]}
    played: list[int] = []

    def play(picks, sampling):
        r = (sampling.seed - step_sampling(dyn.ro, 5, 3).seed) // MOVES["round"]  # which refill round
        played.append(r)
        return by_round[r]

    dyn = _dynamic(max_rounds=4)
    rounds, selection = dyn.rounds(3, by_round[0], play, lambda scores: scores)
    assert played == [1, 2] and len(rounds) == 3  # full after round 2: rounds 3 and 4 not played
    assert selection == Selection([(0, 0), (2, 0)], kept=2, short=False)
    assert dyn.metrics(selection, 2) == {
        "sampling/groups_kept": 2.0, "sampling/rounds": 2.0, "sampling/groups_generated": 6.0, "sampling/short": 0.0
    }  # fmt: skip

    played.clear()
    dyn = _dynamic(max_rounds=1)
    with caplog.at_level(logging.WARNING, logger="oxrl.sampling"):
        _, selection = dyn.rounds(3, by_round[0], play, lambda scores: scores)
        dyn.rounds(4, [1, 1, 1, 1], lambda picks, sampling: [0, 0, 0, 0], lambda scores: scores)
    assert played == [1] and selection == Selection([(0, 0), (0, 1)], kept=1, short=True)
    assert dyn.metrics(selection, 1)["sampling/short"] == 1.0
    (message,) = [r.getMessage() for r in caplog.records]  # step 4 was short too: said once
    assert "step 3: dynamic sampling kept 1 of train.batch_size=2" in message
    assert "after 1 refill round(s) (rollout.max_sampling_rounds=1)" in message and "Raise" in message


def test_refill_prompts_and_seeds_are_a_pure_function_of_seed_step_and_round():
    a, b = _dynamic(max_rounds=3), _dynamic(max_rounds=3)
    picks = {(s, r): a.refill(s, r)[0] for s in range(1, 5) for r in range(1, 4)}
    # another instance (a resumed run), asked in another order: the same picks
    assert {(s, r): b.refill(s, r)[0] for s in reversed(range(1, 5)) for r in range(1, 4)} == picks
    # refill round r of step s is micro-batch (s-1)·R + (r-1) of the refill plan: consecutive, never reused
    plan = BatchPlan([3] * 20, 2, 6, group_by_length=False)
    assert all(picks[(s, r)] == plan.micro_batch((s - 1) * 3 + r - 1) for s, r in picks)
    seeds = {a.refill(s, r)[1].seed for s in range(1, 5) for r in range(1, 4)}
    step_seeds = {step_sampling(a.ro, 5, s).seed for s in range(1, 10_000)}
    assert len(seeds) == 12 and not seeds & step_seeds  # every round its own seed, none a step's
    assert _dynamic(3, seed=6).refill(2, 1)[1].seed != a.refill(2, 1)[1].seed


# ----------------------------------------------------------------------------- config


def test_the_config_refuses_dynamic_sampling_with_groups_of_one_naming_the_fields(tmp_path):
    assert RolloutConfig().dynamic_sampling is False and RolloutConfig().max_sampling_rounds == 4
    with pytest.raises(ValueError, match=r"rollout\.dynamic_sampling needs rollout\.n >= 2, got n=1"):
        RolloutConfig(n=1, dynamic_sampling=True)
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        RolloutConfig(dynamic_sampling=True, max_sampling_rounds=0)
    RolloutConfig(n=1)  # a group of one is fine without dynamic sampling
    sets = ["--set", "rollout.n=1", "--set", "rollout.dynamic_sampling=true"]
    proc = oxrl("run", "--alg", "sgrpo", *sets, "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "rollout.dynamic_sampling needs rollout.n >= 2" in proc.stderr


@pytest.mark.parametrize(
    ("alg", "why"),
    [
        ("rft", "it fine-tunes on every sample that reaches the reward threshold, so an all-correct group is training"),
        ("ppo", "its advantages come from a learned critic (GAE)"),
        ("reinforce_pp", "its baseline is the whole batch's mean return"),
    ],
)
def test_dynamic_sampling_is_refused_for_algorithms_whose_signal_is_not_group_relative(tmp_path, alg, why):
    """Before anything loads: exit 2, one message with the reason, no run directory."""
    proc = oxrl("run", "--alg", alg, "--set", "rollout.dynamic_sampling=true", "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"rollout.dynamic_sampling: '{alg}' cannot use it" in proc.stderr and why in proc.stderr, proc.stderr
    assert "set rollout.dynamic_sampling=false" in proc.stderr and not (tmp_path / "r").exists()


def test_the_group_relative_algorithms_are_the_ones_dynamic_sampling_serves():
    from oxrl_core import plugins

    registry = plugins.registry()
    relative = {n for n in registry.names("algorithm") if getattr(registry.load_checked("algorithm", n), "loop", "") == "rl"
                and registry.load_checked("algorithm", n).group_relative}  # fmt: skip
    assert relative >= {"sgrpo", "cispo", "gspo", "rloo", "reinforce_pp_baseline", "rlhf", "rlaif", "online_dpo"}
    assert not relative & {"rft", "ppo", "reinforce_pp"}


# ----------------------------------------------------------------------------- end to end (the real CLI)

REWARDS = """
from oxrl_core.interfaces import Environment, Reward


class Parity(Reward):
    name = "parity"

    def score(self, prompts, completions, examples):
        return [float(len(c) % 2) for c in completions]


class Constant(Reward):
    name = "constant"

    def score(self, prompts, completions, examples):
        return [1.0] * len(completions)


class Coin(Environment):
    name = "coin"

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        return [{"role": "user", "content": "again"}], float(len(messages[-1]["content"]) % 2), turns == 2
"""

BATCH = 4
COMMON = ["--set", f"train.batch_size={BATCH}", "--set", "rollout.max_new_tokens=6", "--set", "train.eval_every=0"]
DYNAMIC = ["--set", "rollout.dynamic_sampling=true"]
ENV = {"OMP_NUM_THREADS": "1"}


def _run(tmp_path, model, name: str, *sets: str, steps: int = 3):
    (tmp_path / "plug.py").write_text(REWARDS)
    run = tmp_path / name
    args = ["run", "--alg", "sgrpo", "--set", f"model.name={model}", "--set", f"train.max_steps={steps}", *COMMON]
    proc = oxrl(*args, *sets, "-q", "-o", str(run), cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return read_metrics(run), proc


def _consistent(metrics: list[dict], max_rounds: int) -> None:
    for m in metrics:
        kept, rounds, short = m["sampling/groups_kept"], m["sampling/rounds"], m["sampling/short"]
        assert 0 <= kept <= BATCH and 0 <= rounds <= max_rounds and short in (0.0, 1.0), m
        assert m["sampling/groups_generated"] == BATCH * (rounds + 1)
        assert (short == 1.0) == (kept < BATCH)  # short: fewer than batch_size groups that differ
        assert short == 0.0 or rounds == max_rounds  # short only once every round allowed was played


@pytest.mark.slow
def test_single_turn_dynamic_sampling_reports_consistent_metrics_and_keeps_the_scheduled_rewards(
    tmp_path, tiny_model_dir
):
    reward = ["--set", f"reward.name={tmp_path / 'plug.py'}:Parity", "--set", "rollout.n=2"]
    plain, _ = _run(tmp_path, tiny_model_dir, "plain", *reward, steps=1)
    metrics, _ = _run(tmp_path, tiny_model_dir, "dynamic", *reward, *DYNAMIC, "--set", "rollout.max_sampling_rounds=3")
    _consistent(metrics, 3)
    assert sum(m["sampling/groups_kept"] for m in metrics) > 0  # the parity of a length differs within groups
    assert "sampling/rounds" not in plain[0]  # off: no sampling/* metrics
    # reward/* describe the scheduled prompts, sampled as without dynamic sampling: step 1 is the same batch
    assert metrics[0]["reward/mean"] == plain[0]["reward/mean"]
    # the batch trained at step 1 (rollouts.jsonl keeps its rewards): batch_size groups, each with differing rewards
    first = json.loads((tmp_path / "dynamic" / "rollouts.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and len(first["rewards"]) == 2 * BATCH
    assert metrics[0]["sampling/short"] == 0.0 and metrics[0]["sampling/rounds"] >= 1  # (this seed: 1 refill round)
    assert all(has_signal(g) for g in groups_of(first["rewards"], 2)), first["rewards"]


@pytest.mark.slow
def test_at_the_limit_the_batch_is_filled_one_message_says_so_and_the_run_goes_on(tmp_path, tiny_model_dir):
    sets = ["--set", f"reward.name={tmp_path / 'plug.py'}:Constant", "--set", "rollout.max_sampling_rounds=1"]
    metrics, proc = _run(tmp_path, tiny_model_dir, "limit", *sets, "--set", "rollout.n=2", *DYNAMIC)
    assert [m["sampling/short"] for m in metrics] == [1.0, 1.0, 1.0]
    assert [m["sampling/groups_kept"] for m in metrics] == [0.0, 0.0, 0.0]
    assert [m["sampling/rounds"] for m in metrics] == [1.0, 1.0, 1.0] and metrics[0]["reward/mean"] == 1.0
    lines = [line for line in proc.stderr.splitlines() if "dynamic sampling kept" in line]
    assert lines == [line for line in lines if line.startswith("step 1: dynamic sampling kept 0 of train.batch_size=4")]
    assert len(lines) == 1 and "rollout.max_sampling_rounds=1" in lines[0]


@pytest.mark.slow
def test_multi_turn_episodes_are_filtered_too(tmp_path, tiny_model_dir):
    env = ["--set", f"env.name={tmp_path / 'plug.py'}:Coin", "--set", "env.max_tokens=64", "--set", "rollout.n=4"]
    metrics, _ = _run(tmp_path, tiny_model_dir, "episodes", *env, *DYNAMIC, "--set", "rollout.max_sampling_rounds=2")
    _consistent(metrics, 2)
    assert all("env/turns" in m for m in metrics) and sum(m["sampling/rounds"] for m in metrics) > 0  # refills ran


@pytest.mark.slow
def test_asynchronous_rollouts_refill_inside_the_pipeline_and_keep_the_filtered_batch_in_flight(
    tmp_path, tiny_model_dir
):
    sets = ["--set", f"reward.name={tmp_path / 'plug.py'}:Parity", "--set", "rollout.n=2", "--set", "rollout.actors=1",
            "--set", "rollout.max_staleness=1", "--set", "train.save_every=1", "--set", "rollout.max_sampling_rounds=2"]  # fmt: skip
    metrics, _ = _run(tmp_path, tiny_model_dir, "async", *sets, *DYNAMIC)
    _consistent(metrics, 2)
    assert [m["policy/version"] for m in metrics] == [0, 0, 1]  # the schedule holds with the refill rounds
    saved = torch.load(tmp_path / "async" / "checkpoints" / "step-1" / INFLIGHT_FILE, weights_only=True)
    (batch,) = saved["batches"]  # step 2's, generated and filtered by the worker
    picks, prompt_ids, completions, scores, batch_metrics, _ = decode(batch["payload"])
    assert len(picks) == len(prompt_ids) == BATCH and len(completions) == len(scores) == 2 * BATCH
    assert batch_metrics["sampling/groups_kept"] == metrics[1]["sampling/groups_kept"]
    kept = sum(has_signal(g) for g in groups_of(scores, 2))
    assert kept == batch_metrics["sampling/groups_kept"]


def test_asynchronous_multi_turn_dynamic_sampling_is_refused_at_the_start(tmp_path):
    sets = ["--set", "env.name=calculator", "--set", "rollout.actors=1", "--set", "rollout.max_staleness=1", *DYNAMIC]
    proc = oxrl("run", "--alg", "sgrpo", *sets, "-o", str(tmp_path / "r"), cwd=tmp_path, env={"RAY_ADDRESS": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "rollout.dynamic_sampling with rollout.max_staleness=1 and env.name=calculator" in proc.stderr
    assert "single-turn completions only" in proc.stderr


@pytest.mark.slow
def test_a_resumed_run_replays_the_refill_rounds_exactly(tmp_path, tiny_model_dir):
    """The refill prompts and seeds depend on (seed, step, round) only: resumed after step 2 = uninterrupted."""
    sets = ["--set", f"reward.name={tmp_path / 'plug.py'}:Parity", "--set", "rollout.n=2", *DYNAMIC,
            "--set", "rollout.max_sampling_rounds=3", "--set", "train.save_every=2"]  # fmt: skip
    full, _ = _run(tmp_path, tiny_model_dir, "full", *sets, steps=4)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    for name in ("final", "summary.json"):  # as if killed after the step-2 checkpoint
        path = part / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    proc = oxrl("run", "--resume", "-q", "-o", str(part), cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = read_metrics(part)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4] and sum(m["sampling/rounds"] for m in full[2:]) > 0
    for key in ("sampling/rounds", "sampling/groups_kept", "reward/mean", "response/length"):
        assert [m[key] for m in resumed] == [m[key] for m in full], key
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in full], abs=1e-6)
