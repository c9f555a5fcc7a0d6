"""Helpers shared by the rewards: reading a required field, the <answer> tag, numbers in text."""

from __future__ import annotations

import re


class MissingFieldError(ValueError):
    """An example lacks a field the reward needs (score_batch scores the row 0 and counts it)."""


def field(example: dict, name: str, reward: str) -> str:
    """``example[name]`` as a string, or a MissingFieldError naming the reward and the field."""
    if not isinstance(example, dict) or example.get(name) is None:
        have = sorted(example) if isinstance(example, dict) else type(example).__name__
        raise MissingFieldError(f"reward '{reward}' needs the field '{name}' in every example; this one has {have}")
    return str(example[name])


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_tag(completion: str) -> str | None:
    """The content of the last ``<answer>…</answer>`` in the completion, or None."""
    found = _ANSWER.findall(completion)
    return found[-1] if found else None


# An optional sign, an optional $, digits with optional thousands commas, an optional decimal part.
NUMBER = re.compile(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\.\d+")


def to_number(text: str) -> float | None:
    """``"$1,234.50"`` -> 1234.5; ``"72.0"`` -> 72.0; None when ``text`` is not one number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def numbers(text: str) -> list[float]:
    """Every number in ``text``, in order (commas, $ and a trailing ".0" handled by `to_number`)."""
    return [n for n in (to_number(m.group()) for m in NUMBER.finditer(text)) if n is not None]
