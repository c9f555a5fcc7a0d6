"""`arith`: the reward of the core's built-in arithmetic task.

Scores 1.0 when ``oxrl_core.first_integer_equals(completion, example["answer"])`` (the task's own check) — the first
integer in the completion equals the gold ``answer`` — else 0.0. Needs ``answer``.
"""

from __future__ import annotations

from typing import Any

from oxrl_core import Reward, first_integer_equals
from oxrl_rewards._common import field


class ArithReward(Reward):
    name = "arith"
    timeout_s = 5.0

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        return [
            float(first_integer_equals(c, field(ex, "answer", self.name)))
            for c, ex in zip(completions, examples, strict=True)
        ]
