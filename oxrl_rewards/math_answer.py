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
timeouts are switched off, as its documentation asks. The parsing is `oxrl_core.math_equivalent`, the
same as the datasets' ``verify`` uses.
"""

from __future__ import annotations

from typing import Any

from oxrl_core import Reward, math_equivalent
from oxrl_rewards._common import field


class MathReward(Reward):
    name = "math"
    timeout_s = 30.0

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        return [
            float(math_equivalent(c, field(ex, "answer", self.name)))
            for c, ex in zip(completions, examples, strict=True)
        ]
