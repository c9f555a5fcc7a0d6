"""`reasoning`: format and correctness in one score (the DeepSeek-R1 style reward).

``score = format_weight * format + correctness_weight * correct`` where
- ``format`` is the `format` reward: 1 when the completion is exactly
  ``<think>…</think><answer>…</answer>`` (whitespace allowed around them), else 0;
- ``correct`` is the `math` reward (math-verify equivalence with ``example["answer"]``) applied
  to the content of the last ``<answer>…</answer>``; 0 when there is no ``<answer>`` block.

Defaults 0.1 and 0.9, so a well-formed correct completion scores 1.0, a correct answer in a
malformed completion 0.9, a well-formed wrong one 0.1, anything else 0.0. Needs ``answer``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from oxrl_core import Reward, StrictModel, answer_tag, math_equivalent
from oxrl_rewards._common import field
from oxrl_rewards.tag_format import follows_format


class ReasoningReward(Reward):
    name = "reasoning"
    timeout_s = 30.0

    class Config(StrictModel):
        format_weight: float = Field(0.1, ge=0.0)
        """Weight of the format term (1 when the tags are right)."""
        correctness_weight: float = Field(0.9, ge=0.0)
        """Weight of the correctness term (1 when the <answer> content is right)."""

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        scores = []
        for completion, example in zip(completions, examples, strict=True):
            gold = field(example, "answer", self.name)
            tagged = answer_tag(completion)
            correct = tagged is not None and math_equivalent(tagged, gold)
            fmt = follows_format(completion)
            scores.append(self.config.format_weight * float(fmt) + self.config.correctness_weight * float(correct))
        return scores
