"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", §3.2),
``rollout.dynamic_sampling``: a prompt group (its ``rollout.n`` samples) whose rewards are all equal has zero variance,
so every group-relative advantage in it is 0 and it teaches nothing; such groups are dropped and more prompts are
played until the step has ``train.batch_size`` groups whose rewards differ.

A step plays its scheduled prompts as always (round 0). While fewer than ``train.batch_size`` of the groups played so
far have distinct rewards and fewer than ``rollout.max_sampling_rounds`` refill rounds were played, it plays and scores
a refill round of ``train.batch_size`` more prompts. The trained batch is the groups with distinct rewards in play
order (the scheduled ones first, then each round's), cut to ``train.batch_size`` (`select_groups`). When the last
round leaves it short, it is filled up with equal-reward groups in play order (their advantage is exactly 0 for a
group-relative method, so the batch keeps its shape), ``sampling/short`` is 1 and one message says so (the first
time in a run).

Refill prompts and seeds are a pure function of (train.seed, step, round), so a resumed run replays them exactly
and the data position stays one integer: refill round r of step s takes micro-batch (s − 1)·R + (r − 1) of a second
`BatchPlan` over the same prompts (R = ``rollout.max_sampling_rounds``), shuffled with its own seed, and samples with
the step's seed moved to round r (`oxrl_core.seeds.stream_seed`, which keeps every round's seeds apart from every
step's, shard's and turn's).

The strategy does the rounds (`rl.strategies.RolloutStrategy.rollout`, and with asynchronous rollouts
``produce_step`` inside the pipeline's job, at the scheduled policy version); this module is the pure part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from oxrl_core.engines.distributed import is_main
from oxrl_core.interfaces import SamplingParams
from oxrl_core.rl.batch import step_sampling
from oxrl_core.seeds import stream_seed

log = logging.getLogger("oxrl.sampling")

Round = TypeVar("Round")


def has_signal(scores: list[float]) -> bool:
    """Whether a group's rewards are not all equal (non-zero variance: its group-relative advantages are not all 0)."""
    return max(scores) != min(scores)


def groups_of(scores: list[float], n: int) -> list[list[float]]:
    """A round's scores (B = P·n, the samples of a prompt contiguous) as P groups of n."""
    return [scores[g * n : (g + 1) * n] for g in range(len(scores) // n)]


@dataclass
class Selection:
    """Which groups a step trains on (`select_groups`)."""

    picked: list[tuple[int, int]]  # (round, group within the round) of each group of the batch, in play order
    kept: int  # of them, groups whose rewards differ
    short: bool  # fewer than batch_size groups with differing rewards: filled up with equal-reward groups


def select_groups(rounds: list[list[list[float]]], batch_size: int) -> Selection:
    """The groups to train on, from each round's group scores (``rounds[r][g]``: the n rewards of group g of round r;
    round 0 is the step's scheduled prompts): the groups whose rewards differ, in play order, cut to ``batch_size``;
    when there are fewer, the batch is filled up with the first equal-reward groups and marked short (still in play
    order: with no refill round a short batch is the scheduled batch as it was)."""
    order = [(r, g) for r, groups in enumerate(rounds) for g in range(len(groups))]
    signal = [(r, g) for r, g in order if has_signal(rounds[r][g])]
    if len(signal) >= batch_size:
        return Selection(signal[:batch_size], batch_size, False)
    fill = [(r, g) for r, g in order if not has_signal(rounds[r][g])][: batch_size - len(signal)]
    return Selection(sorted(signal + fill), len(signal), True)


class DynamicSampling:
    """A run's refill rounds: which prompts and seeds (`refill`), when to stop (`rounds`), the step's metrics and the
    message when a step stays short."""

    def __init__(self, ro, refill_plan, seed: int, batch_size: int):
        self.ro, self.plan, self.seed, self.batch_size = ro, refill_plan, seed, batch_size
        self.n, self.max_rounds = ro.n, ro.max_sampling_rounds
        self.warned = False  # the message at the limit: once a run

    def refill(self, step: int, round: int) -> tuple[list[int], SamplingParams]:
        """Refill round ``round`` (1-based) of ``step``: its prompts (train.batch_size of them) and sampling."""
        picks = self.plan.micro_batch((step - 1) * self.max_rounds + (round - 1))
        sampling = step_sampling(self.ro, self.seed, step)
        return picks, replace(sampling, seed=stream_seed(self.seed, "rollout", step=step, round=round))

    def rounds(
        self, step: int, scheduled: Round, play: Callable[[list[int], SamplingParams], Round],
        scores_of: Callable[[Round], list[float]],
    ) -> tuple[list[Round], Selection]:  # fmt: skip
        """The step's rounds (``scheduled`` first, then ``play(picks, sampling)`` of each refill round played) and the
        selection of its batch. ``scores_of(round)`` is a round's scores (B,)."""
        played = [scheduled]
        while True:
            selection = select_groups([groups_of(scores_of(p), self.n) for p in played], self.batch_size)
            if not selection.short or len(played) - 1 == self.max_rounds:
                break
            played.append(play(*self.refill(step, len(played))))
        if selection.short:
            self.warn(step, selection, len(played) - 1)
        return played, selection

    def metrics(self, selection: Selection, rounds: int) -> dict[str, float]:
        """``sampling/*`` of a step that played ``rounds`` refill rounds."""
        return {
            "sampling/groups_kept": float(selection.kept),  # groups with differing rewards in the trained batch
            "sampling/rounds": float(rounds),  # refill rounds played
            "sampling/groups_generated": float(self.batch_size * (rounds + 1)),
            "sampling/short": float(selection.short),
        }

    def warn(self, step: int, selection: Selection, rounds: int) -> None:
        if self.warned:
            return
        self.warned = True
        if not is_main():  # every rank selects the same groups; one says so
            return
        log.warning(
            "step %d: dynamic sampling kept %d of train.batch_size=%d groups with differing rewards after %d refill "
            "round(s) (rollout.max_sampling_rounds=%d); the batch is filled up with equal-reward groups (no group signal) "
            "and the run goes on (sampling/short = 1 marks such steps; this message is not repeated). Raise "
            "rollout.max_sampling_rounds, or use prompts the policy solves sometimes but not always (too easy or "
            "too hard prompts give every sample the same reward).",
            step, selection.kept, self.batch_size, rounds, self.max_rounds,
        )  # fmt: skip
