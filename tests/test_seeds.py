"""`oxrl_core.seeds.stream_seed`, the one rule every random stream's seed comes from: it gives exactly the integers
each site computed with its own formula before the rule was one function (a run's seeds must not change), and
within the ranges its docstring states distinct coordinates give distinct seeds (and just outside them they don't,
so the stated ranges are the true ones)."""

from __future__ import annotations

import itertools
import sys

import pytest

from oxrl_core.seeds import stream_seed

SEEDS = (0, 1, 42, 2**32 - 1)  # train.seed: 0 <= seed < 2^32
STEPS = (0, 1, 2, 7_918, 7_919, 10_000, 1_000_003)
SHARDS = (0, 1, 12, 13, 64)
TURNS = (0, 1, 3, 41_009)
ROUNDS = (0, 1, 4)


def test_each_site_gets_the_integer_its_own_formula_gave():
    """The formulas below are the sites' own, as they were written before `stream_seed`: a rollout step's seed
    (rl.batch.step_sampling), a refill round's (rl.dynamic_sampling), a shard's (rl.batch.seeded_shards,
    rl.episodes.play_shards) and a turn's (rl.episodes.turn_request) moved from the seed they hold, online DPO's
    rejected responses (loops.preference), the RL mini-batch shuffle (loops.rl), the batch plans (data.batching)
    and the refill plan's seed (loops.rl_setup)."""
    for seed, step in itertools.product(SEEDS, STEPS):
        step_seed = seed * 1_000_003 + step
        assert stream_seed(seed, "rollout", step=step) == step_seed
        assert stream_seed(seed, "minibatches", step=step) == seed * 7919 + step
        assert stream_seed(seed, "plan", epoch=step) == seed * 1_000_003 + step
        for k in (0, 1, 7, 130):
            assert stream_seed(seed, "rejected", step=step, micro_batch=k) == seed * 1_000_003 + step * 131 + k
        for round, shard, turn in itertools.product(ROUNDS, SHARDS, TURNS):
            held = step_seed + (1 << 32) * round if round else step_seed  # a refill round's sampling, or the step's
            if round:
                assert stream_seed(seed, "rollout", step=step, round=round) == held
            shard_seed = stream_seed(held, shard=shard)
            assert shard_seed == held + 7_919 * shard
            assert stream_seed(shard_seed, turn=turn) == shard_seed + 104_729 * turn
            # moving a held seed equals deriving it from every coordinate at once: the sites may do either
            every = stream_seed(seed, "rollout", step=step, round=round, shard=shard, turn=turn)
            assert stream_seed(shard_seed, turn=turn) == every
    for seed in SEEDS:
        assert stream_seed(seed, "eval") == seed  # the held-out evaluation samples with the run's seed
        refill_plan = stream_seed(seed, "refill_plan")
        assert refill_plan == seed + (1 << 31)
        assert stream_seed(refill_plan, "plan", epoch=3) == (seed + (1 << 31)) * 1_000_003 + 3


def test_rollout_seeds_are_distinct_within_the_stated_ranges():
    """Every (step, shard) with step < 7 919 and shard < 13, exhaustively, with the first and the last turns
    below 41 010 and several refill rounds: one seed each. A run's seeds all share train.seed's term, so a
    collision between two coordinates is one at any train.seed; it is checked at 0 and at the largest."""
    steps, shards = range(7_919), range(13)
    moves = [(turn, round) for turn in (0, 1, 2, 41_008, 41_009) for round in (0, 1, 2)]
    for seed in (0, 2**32 - 1):
        seen = set()
        for turn, round in moves:
            base = stream_seed(seed, "rollout", turn=turn, round=round)
            for shard in shards:
                at = stream_seed(base, shard=shard)
                seen.update(at + step for step in steps)  # + step: the step's stride is 1
        assert len(seen) == len(moves) * len(shards) * len(steps)
        # the shortcut above is the rule itself
        assert stream_seed(seed, "rollout", step=5, shard=3, turn=41_009, round=2) in seen


def test_just_outside_the_stated_ranges_rollout_seeds_repeat():
    """The ranges are tight: one step, shard or turn past them meets another coordinate's seed (the collisions
    `oxrl_core.seeds` names), so a changed stride shows up here as well as in the range test."""
    rollout = lambda **at: stream_seed(42, "rollout", **at)
    assert rollout(step=7_919 + 5, shard=2) == rollout(step=5, shard=3)
    assert rollout(step=10 + 1_782, shard=13) == rollout(step=10, turn=1)
    assert rollout(step=7_918, shard=12, turn=41_010) == rollout(step=669, shard=9, round=1)


def test_the_other_streams_are_distinct_over_a_run():
    """Online DPO's rejected responses over 2 000 steps of up to 131 micro-batches, the mini-batch shuffle and the
    batch plans over 10 000 steps / epochs, and the refill plan's epochs apart from the main plan's."""
    for seed in (0, 42):
        rejected = {stream_seed(seed, "rejected", step=s, micro_batch=k) for s in range(2_000) for k in range(131)}
        assert len(rejected) == 2_000 * 131
        assert len({stream_seed(seed, "minibatches", step=s) for s in range(10_000)}) == 10_000
        plans = [seed, stream_seed(seed, "refill_plan")]
        epochs = {stream_seed(plan, "plan", epoch=e) for plan in plans for e in range(10_000)}
        assert len(epochs) == 2 * 10_000
    assert stream_seed(42, "rejected", micro_batch=131) == stream_seed(42, "rejected", step=1)  # the bound


def test_a_coordinate_the_stream_does_not_have_is_refused():
    with pytest.raises(ValueError, match="the minibatches seed stream has no shard coordinate"):
        stream_seed(1, "minibatches", step=2, shard=1)
    with pytest.raises(ValueError, match="the sampling seed stream has no step coordinate"):
        stream_seed(1, step=2)  # a held sampling seed moves by shard, turn, round only
    assert stream_seed(1, "minibatches", step=2, shard=0) == 7_921  # a zero coordinate is no coordinate


def test_the_seeds_module_imports_nothing_heavy():
    """A leaf: the config, the data plans and the CLI's light paths may import it without torch."""
    import subprocess

    code = "import sys, oxrl_core.seeds; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
