"""`format`: does the completion follow ``<think>…</think><answer>…</answer>``?

Scores 1.0 when the whole completion is exactly one ``<think>…</think>`` block followed by one
``<answer>…</answer>`` block, with only whitespace before, between and after them, and no
further ``<think>``/``</think>``/``<answer>``/``</answer>`` tag inside either block; else 0.0.
The blocks may be empty and may span lines. Needs no example field.
"""

from __future__ import annotations

import re
from typing import Any

from oxrl_core import Reward

_BODY = r"(?:(?!</?think>|</?answer>).)*"  # any text that contains none of the four tags
FORMAT = re.compile(rf"\s*<think>{_BODY}</think>\s*<answer>{_BODY}</answer>\s*", re.DOTALL)


def follows_format(completion: str) -> bool:
    return FORMAT.fullmatch(completion) is not None


class FormatReward(Reward):
    name = "format"
    timeout_s = 5.0

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        return [float(follows_format(c)) for c in completions]
