"""`numeric`: one number of the completion equals the gold answer within a tolerance.

Scores 1.0 when ``|prediction - answer| <= tolerance`` (absolute, from the Config), else 0.0.
The prediction is the ``pick`` (``"last"`` by default, or ``"first"``) number in the content of
the last ``<answer>…</answer>`` when the completion has one, else in the whole completion;
none found scores 0.0. Numbers may carry a sign, thousands commas, ``$`` and a decimal part.
``example["answer"]`` is required and must itself be one number (else an error naming it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from oxrl_core import Reward, StrictModel, answer_tag, numbers, to_number
from oxrl_rewards._common import field


class NumericReward(Reward):
    name = "numeric"
    timeout_s = 5.0

    class Config(StrictModel):
        tolerance: float = Field(1e-6, ge=0.0)
        """Largest absolute difference still counted as equal."""
        pick: Literal["first", "last"] = "last"
        """Which number of the completion is its answer."""

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        scores = []
        for completion, example in zip(completions, examples, strict=True):
            answer = field(example, "answer", self.name)
            gold = to_number(answer)
            if gold is None:
                raise ValueError(f"reward 'numeric': the field 'answer' is not a number: {answer!r}")
            tagged = answer_tag(completion)
            found = numbers(tagged if tagged is not None else completion)
            if not found:
                scores.append(0.0)
                continue
            prediction = found[0] if self.config.pick == "first" else found[-1]
            scores.append(float(abs(prediction - gold) <= self.config.tolerance))
        return scores
