"""`math`: final-answer equivalence, checked by Hugging Face's `math-verify`.

Scores 1.0 when the completion's final answer is mathematically equal to the gold ``answer``
(``math_verify.verify(parse(gold), parse(completion))``: ``\\frac{1}{2}`` = ``0.5`` = ``1/2``,
``x^2+1`` = ``1+x^2``, …), else 0.0 — also 0.0 when no answer can be extracted from either.

- gold: ``example["answer"]`` (required); in GSM8K format (``… #### 72``) only the part after
  ``####`` counts. Plain LaTeX without ``$`` is accepted (``\\frac{1}{2}``).
- completion: when it contains ``\\boxed{…}``, only the *last* boxed expression counts; otherwise
  math-verify's own extraction (answer anchors such as "the final answer is", then any
  expression) decides.

math-verify times itself out with ``signal.alarm``, which only works on the main thread; off the
main thread (inside `oxrl_core.scoring.rewards.score_batch`, which enforces ``timeout_s`` itself) its
timeouts are switched off, as its documentation asks.
"""

from __future__ import annotations

import threading
from typing import Any

from oxrl_core.interfaces import Reward
from oxrl_rewards._common import field


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def parse_gold(gold: str) -> list:
    from math_verify import parse

    gold = gold.split("####")[-1].strip()
    attempts = [gold] if ("$" in gold or "\\boxed" in gold) else [f"${gold}$", gold]
    for text in attempts:
        parsed = parse(text, parsing_timeout=_timeout())
        if parsed:
            return parsed
    return []


def parse_completion(completion: str) -> list:
    from math_verify import parse

    last_boxed = max(completion.rfind("\\boxed"), completion.rfind("\\fbox"))
    text = completion[last_boxed:] if last_boxed >= 0 else completion
    return parse(text, parsing_timeout=_timeout())


def is_equivalent(completion: str, gold: str) -> bool:
    """Whether the completion's final answer equals ``gold`` according to math-verify."""
    from math_verify import verify

    gold_parsed, answer_parsed = parse_gold(gold), parse_completion(completion)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=_timeout()))


class MathReward(Reward):
    name = "math"
    timeout_s = 30.0

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        return [
            float(is_equivalent(c, field(ex, "answer", self.name))) for c, ex in zip(completions, examples, strict=True)
        ]
