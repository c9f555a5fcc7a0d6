"""`gsm8k`: the GSM8K final number.

Scores 1.0 when the completion's answer equals the gold answer as a number, else 0.0.

- gold: the text after the last ``####`` in ``example["answer"]`` (GSM8K's format,
  ``"…reasoning…\\n#### 1,234"``), or the whole field when it has no ``####``; it must be a
  number (else an error naming the field).
- completion: the first number after its last ``####`` when it has one, else the last number
  anywhere in it; none found scores 0.0.
- comparison: numeric after dropping thousands commas, ``$`` and a trailing ``.`` — so
  ``1,234`` = ``1234`` = ``$1234.00`` and ``72.0`` = ``72`` (absolute tolerance 1e-6).
"""

from __future__ import annotations

from typing import Any

from oxrl_core import Reward, numbers_equal, to_number
from oxrl_rewards._common import field


def gold_number(answer: str) -> float:
    value = to_number(answer.split("####")[-1])
    if value is None:
        raise ValueError(f"reward 'gsm8k': the field 'answer' is not a number after '####': {answer!r}")
    return value


class GSM8KReward(Reward):
    name = "gsm8k"
    timeout_s = 5.0

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        scores = []
        for completion, example in zip(completions, examples, strict=True):
            gold = gold_number(field(example, "answer", self.name))
            scores.append(float(numbers_equal(completion, gold)))
        return scores
