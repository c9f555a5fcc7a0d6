"""Calling a Reward safely: a per-call time limit, and failures that score 0 instead of crashing.

`score_batch` is what a loop calls. Every failure of the reward becomes a score of 0 for the
rows it affects and is counted, so one bad example, a hanging verifier or a buggy plugin can
never stop a run:

- the call raises                  -> each row is retried alone (one shared extra ``timeout_s``),
                                      so only the rows that still raise score 0  (reward/errors)
- the call runs past ``timeout_s`` -> every row of the call scores 0           (reward/timeouts)
- a result of the wrong length     -> every row scores 0                       (reward/errors)
- a value that is not a finite number (NaN, inf, None, "x") -> that row scores 0 (reward/errors)

The reward runs on a daemon worker thread whose result arrives through a
`concurrent.futures.Future`; at the limit we stop waiting. Python cannot kill a thread, so a
reward stuck in pure Python keeps that thread busy in the background (a daemon thread, so it
never blocks interpreter exit); rewards that can hang for good should bound their own work too.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

log = logging.getLogger("oxrl.rewards")


class _Timeout(Exception):
    pass


def _call(reward, prompts: list, completions: list[str], examples: list[dict], limit_s: float) -> Any:
    """``reward.score(...)`` on a worker thread; raises `_Timeout` after ``limit_s`` seconds."""
    future: Future = Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(reward.score(prompts, completions, examples))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)

    threading.Thread(target=work, name=f"reward-{getattr(reward, 'name', '?')}", daemon=True).start()
    try:
        return future.result(timeout=max(limit_s, 0.0))
    except FutureTimeout:
        raise _Timeout from None


def _finite(value: Any) -> float | None:
    if isinstance(value, (str, bytes)) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def score_batch(reward, prompts: list, completions: list[str], examples: list[dict]) -> tuple[list[float], dict[str, float]]:
    """Score a batch with ``reward`` under its ``timeout_s``; never raises for reward failures.

    Returns one float per completion and ``reward/mean``, ``reward/std`` (population std over
    all rows, failed rows included as 0), ``reward/errors`` and ``reward/timeouts`` (row counts).
    """
    n = len(completions)
    if len(prompts) != n or len(examples) != n:  # the caller's bug, not the reward's
        raise ValueError(f"score_batch: {len(prompts)} prompts, {n} completions, {len(examples)} examples")
    name = getattr(reward, "name", type(reward).__name__)
    limit_s = float(getattr(reward, "timeout_s", 30.0))

    try:
        result = _call(reward, prompts, completions, examples, limit_s)
    except _Timeout:
        log.warning("reward '%s' timed out after %.3gs on %d rows; they score 0", name, limit_s, n)
        return _summary([0.0] * n, errors=0, timeouts=n)
    except Exception as exc:  # noqa: BLE001 - retried row by row, so one bad row costs only itself
        log.warning("reward '%s' raised %s: %s; retrying row by row", name, type(exc).__name__, exc)
        return _summary(*_row_by_row(reward, name, prompts, completions, examples, limit_s))

    values = _as_list(result)
    if values is None or len(values) != n:
        got = len(values) if values is not None else type(result).__name__
        log.warning("reward '%s' returned %s values for %d rows; they score 0", name, got, n)
        return _summary([0.0] * n, errors=n, timeouts=0)
    scores, errors = [], 0
    for i, value in enumerate(values):
        number = _finite(value)
        if number is None:
            log.warning("reward '%s' returned %r for row %d; it scores 0", name, value, i)
            errors += 1
        scores.append(0.0 if number is None else number)
    return _summary(scores, errors=errors, timeouts=0)


def _row_by_row(reward, name: str, prompts, completions, examples, limit_s: float) -> tuple[list[float], int, int]:
    """Score each row alone, all within one more ``limit_s``: (scores, errors, timeouts)."""
    deadline = time.monotonic() + limit_s
    n = len(completions)
    scores, errors = [], 0
    for i in range(n):
        try:
            row = slice(i, i + 1)
            values = _as_list(_call(reward, prompts[row], completions[row], examples[row], deadline - time.monotonic()))
            number = _finite(values[0]) if values is not None and len(values) == 1 else None
            if number is None:
                raise ValueError(f"returned {values!r} for one row")
        except _Timeout:
            log.warning("reward '%s' timed out on row %d; it and the %d rows after it score 0", name, i, n - i - 1)
            return scores + [0.0] * (n - i), errors, n - i
        except Exception as exc:  # noqa: BLE001 - counted, never raised
            log.warning("reward '%s' failed on row %d: %s: %s; it scores 0", name, i, type(exc).__name__, exc)
            errors += 1
            number = 0.0
        scores.append(number)
    return scores, errors, 0


def _as_list(result: Any) -> list | None:
    if isinstance(result, (str, bytes, dict)) or result is None:
        return None
    try:
        return list(result)
    except TypeError:
        return None


def _summary(scores: list[float], errors: int, timeouts: int) -> tuple[list[float], dict[str, float]]:
    n = len(scores)
    mean = sum(scores) / n if n else 0.0
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / n) if n else 0.0
    return scores, {"reward/mean": mean, "reward/std": std, "reward/errors": float(errors), "reward/timeouts": float(timeouts)}


# ----------------------------------------------------------------------------- building the run's reward


class DatasetCheck:
    """The reward used when none is configured: 1.0 when the dataset plugin's ``verify`` accepts the completion."""

    timeout_s = 30.0

    def __init__(self, dataset):
        self.dataset = dataset
        self.name = f"{dataset.name}.verify"

    def score(self, prompts: list, completions: list[str], examples: list[dict]) -> list[float]:
        return [float(bool(self.dataset.verify(c, ex))) for c, ex in zip(completions, examples, strict=True)]


def build_reward(config, registry, default_name: str = "", dataset=None, source: str = "config"):
    """The reward of a run: ``reward.name``, else the algorithm's default, else the dataset's own check.

    ``reward.*`` keys other than ``name``/``timeout_s`` are validated by the reward's ``Config``.
    """
    from oxrl_core.config import validate_reward_section
    from oxrl_core.errors import OxrlError, PluginError
    from oxrl_core.interfaces import Reward

    name = config.reward.name or default_name
    if not name:
        from oxrl_core.evaluation import can_verify  # imports torch: only when the dataset checks answers

        if can_verify(dataset):
            if config.reward.model_extra:
                raise OxrlError(f"reward.{next(iter(config.reward.model_extra))}: options need a reward.name")
            reward = DatasetCheck(dataset)
            if config.reward.timeout_s:
                reward.timeout_s = config.reward.timeout_s
            return reward
        raise OxrlError(
            "no reward: set reward.name (see `oxrl plugins` for installed rewards), or train on a dataset "
            "plugin that can check answers (e.g. data.train=arith)"
        )
    cls = registry.load("reward", name)
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise PluginError(f"reward '{name}': {cls!r} is not an oxrl_core.Reward subclass")
    options = validate_reward_section(config, cls.Config, source)
    try:
        reward = cls(options)
    except OxrlError:
        raise
    except Exception as exc:  # noqa: BLE001 - a reward that cannot start is a config/plugin problem
        raise OxrlError(f"reward '{name}' could not start: {type(exc).__name__}: {exc}") from None
    if config.reward.timeout_s:
        reward.timeout_s = config.reward.timeout_s
    return reward
