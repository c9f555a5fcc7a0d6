"""`exact_match`: normalised string equality with the gold answer.

Scores 1.0 when ``normalise(prediction) == normalise(example["answer"])``, else 0.0, where
the prediction is the content of the last ``<answer>…</answer>`` when the completion has one,
else the whole completion, and ``normalise`` strips surrounding whitespace, collapses inner
whitespace runs to one space, drops one trailing ``.`` and (unless ``case_sensitive``)
case-folds. Needs ``answer``.
"""

from __future__ import annotations

import re
from typing import Any

from oxrl_core import Reward, StrictModel, answer_tag
from oxrl_rewards._common import field


def normalise(text: str, case_sensitive: bool = False) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    text = text[:-1].rstrip() if text.endswith(".") else text
    return text if case_sensitive else text.casefold()


class ExactMatchReward(Reward):
    name = "exact_match"
    timeout_s = 5.0

    class Config(StrictModel):
        case_sensitive: bool = False
        """Compare with case (default: case-folded)."""

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        scores = []
        for completion, example in zip(completions, examples, strict=True):
            gold = field(example, "answer", self.name)
            tagged = answer_tag(completion)
            prediction = tagged if tagged is not None else completion
            cs = self.config.case_sensitive
            scores.append(float(normalise(prediction, cs) == normalise(gold, cs)))
        return scores
