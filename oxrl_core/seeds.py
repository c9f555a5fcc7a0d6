"""Every seed a run derives from ``train.seed``, by one rule: `stream_seed`.

A run draws random numbers in several streams, each with its own seeds: the rollouts of each RL step (and, within
a step, each shard of the batch, each model turn of an episode, each dynamic-sampling refill round), the sampled
mode of the held-out evaluation, online DPO's self-play rejected responses, the RL update's mini-batch shuffle and
the batch plans' shuffles. A seed is a pure function of the run's seed and its coordinates in the stream, never of
when or where it is drawn, so a resumed run, or one with another world size, draws the same numbers.

The rule is linear: the seed a stream starts from, times the stream's scale, plus its offset, plus each coordinate
times its stride (`STREAMS`). So a site that already holds a sampling seed (a step's, or a refill round's, or the
evaluation's) moves it along a shard or a turn by adding just that coordinate (``stream=None``), and gets the seed
it would get from every coordinate at once.

**Ranges in which distinct coordinates give distinct seeds** (within one run; ``tests/test_seeds.py`` checks them
exhaustively on a reduced grid with the boundary values, and that they are tight):

- ``rollout``: seed·1 000 003 + step + 7 919·shard + 104 729·turn + 2³²·round is distinct for step < 7 919,
  shard < 13, turn < 41 010 and any refill round. The strides are the digits of a mixed radix: a = step +
  7 919·shard gives back (step, shard) as its quotient and remainder by 7 919 and is at most 7 918 + 7 919·12 =
  102 946 < 104 729; b = a + 104 729·turn gives back (a, turn) the same way and is at most 102 946 + 104 729·41 009
  = 4 294 934 507 < 2³²; b + 2³²·round gives back (b, round). Beyond the box seeds repeat: step t + 7 919 of
  shard k samples with the seed of step t, shard k + 1, and with 14 or more shards, shard 13 of step t + 1 782
  with that of step t, turn 1. Those are other steps' prompts under other weights: the draws are shared, the
  samples are not repeated. (Today's rule, kept bit for bit: a run's seeds must not change under it.)
- ``eval``: the run's seed itself, moved like a rollout seed: distinct for shard < 13 and turn < 41 010.
- ``rejected``: seed·1 000 003 + 131·step + micro-batch: distinct for fewer than 131 micro-batches a step.
- ``minibatches``: seed·7 919 + step, and ``plan``: plan seed·1 000 003 + epoch: distinct for every step / epoch.
- ``refill_plan``: the run's seed + 2³¹, the dynamic-sampling refill plan's own plan seed (its epochs' seeds are
  2³¹·1 000 003 away from the main plan's, beyond any epoch).

Different streams seed different generators (the rollout backend's sampler, Python's ``random`` for plans, a
torch generator for the mini-batch shuffle) and are not kept apart from one another: with ``train.seed`` = 0 the
step-t rollout seed and the step-t shuffle seed are both t.
"""

from __future__ import annotations

#: how a sampling seed moves within a step: per shard of the batch, per model turn, per dynamic-sampling refill round
MOVES: dict[str, int] = {"shard": 7_919, "turn": 104_729, "round": 1 << 32}

#: each stream: (the scale of the seed it starts from, an offset, each coordinate's stride)
STREAMS: dict[str, tuple[int, int, dict[str, int]]] = {
    "rollout": (1_000_003, 0, {"step": 1, **MOVES}),  # an RL step's samples
    "eval": (1, 0, dict(MOVES)),  # the held-out evaluation's sampled mode
    "rejected": (1_000_003, 0, {"step": 131, "micro_batch": 1}),  # online DPO's self-play rejected responses
    "minibatches": (7_919, 0, {"step": 1}),  # the RL update's shuffle of the batch into mini-batches
    "plan": (1_000_003, 0, {"epoch": 1}),  # a batch plan's shuffle of the rows, per pass over them
    "refill_plan": (1, 1 << 31, {}),  # the seed of the dynamic-sampling refill prompts' own plan
}


def stream_seed(
    seed: int,
    stream: str | None = None,
    *,
    step: int = 0,
    epoch: int = 0,
    shard: int = 0,
    turn: int = 0,
    round: int = 0,
    micro_batch: int = 0,
) -> int:
    """The seed at the given coordinates of ``stream``, starting from ``seed`` (``train.seed``; for ``plan``, the
    plan's own seed). ``stream=None``: ``seed`` already is a sampling seed (a ``rollout`` or ``eval`` one) and is
    moved along the given `MOVES` only, which is what a site gets that holds a step's seed but not the step.

    A coordinate the stream does not have is refused (a nonzero one would silently give another stream's seed)."""
    scale, offset, strides = (1, 0, MOVES) if stream is None else STREAMS[stream]
    coordinates = {"step": step, "epoch": epoch, "shard": shard, "turn": turn, "round": round}
    coordinates["micro_batch"] = micro_batch
    foreign = [name for name, value in coordinates.items() if value and name not in strides]
    if foreign:
        raise ValueError(f"the {stream or 'sampling'} seed stream has no {', '.join(foreign)} coordinate")
    return seed * scale + offset + sum(value * strides[name] for name, value in coordinates.items() if value)
