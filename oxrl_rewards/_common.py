"""Helpers shared by the rewards: reading a required field (final answers in text: `oxrl_core.answers`)."""

from __future__ import annotations


class MissingFieldError(ValueError):
    """An example lacks a field the reward needs (score_batch scores the row 0 and counts it)."""


def field(example: dict, name: str, reward: str) -> str:
    """``example[name]`` as a string, or a MissingFieldError naming the reward and the field."""
    if not isinstance(example, dict) or example.get(name) is None:
        have = sorted(example) if isinstance(example, dict) else type(example).__name__
        raise MissingFieldError(f"reward '{reward}' needs the field '{name}' in every example; this one has {have}")
    return str(example[name])
