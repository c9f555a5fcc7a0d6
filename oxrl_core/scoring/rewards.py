"""Calling a Reward safely: a per-call time limit, and failures that score 0 instead of crashing.

`score_batch` is what a loop calls. Every failure of the reward becomes a score of 0 for the
rows it affects and is counted, so one bad example, a hanging verifier or a buggy plugin can
never stop a run:

- the call raises                  -> each row is retried alone (one shared extra ``timeout_s``),
                                      so only the rows that still raise score 0  (reward/errors)
- the call runs past ``timeout_s`` -> every row of the call scores 0           (reward/timeouts)
- a result of the wrong length     -> every row scores 0                       (reward/errors)
- a value that is not a finite number (NaN, inf, None, "x") -> that row scores 0 (reward/errors)

Failures are summarised, never logged row by row (a reward with a typo'd field fails on every
sample: a thousand lines a step would bury everything else): `Failures` counts them and
keeps the first (its row, prompt and exception), one line per call or per step says so, and
``reward/error_share`` is the failed share of the rows. `RewardWatch` stops a run whose share
stays above ``rollout.max_reward_error_share`` for ``rollout.reward_error_steps`` steps in a row:
all-zero rewards train nothing, and a run that "finishes" on them wastes its whole budget.

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
from dataclasses import dataclass, field
from typing import Any, Literal

from oxrl_core.config import reward_options
from oxrl_core.data.sources import can_verify
from oxrl_core.errors import OxrlError

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


def row_number(examples: list, i: int) -> int:
    """The number a message gives the i-th row of a batch: its 1-based row in its data file (``_row``, what
    `oxrl score` writes and editors show as the line), else its 1-based place in the batch; never 0-based."""
    row = examples[i] if i < len(examples) else None
    number = row.get("_row") if isinstance(row, dict) else None
    return number if isinstance(number, int) else i + 1


def prompt_snippet(prompt: Any, width: int = 60) -> str:
    """A prompt as a message quotes it: its text (a chat prompt's last message), cut to ``width``."""
    if isinstance(prompt, list) and prompt:
        last = prompt[-1]
        prompt = last.get("content", last) if isinstance(last, dict) else last
    text = " ".join(str(prompt).split())
    return repr(text if len(text) <= width else text[: width - 1] + "…")


@dataclass
class Failures:
    """The failures of a reward over some samples (a call, a step, a file) or of an environment over some episodes
    (a step), summarised for one line — one record for both, so a step's two watches, its metrics and an
    asynchronous checkpoint's in-flight batches treat them alike.

    Counts the samples that raised or returned a non-number / something malformed (``errors``) and those that
    timed out (``timeouts``), and keeps the first failure whole: its row (1-based, see `row_number`), a snippet of
    its prompt and the exception, which is what a user needs to find a typo'd field.
    """

    #: the reward's or the environment's name
    name: str
    #: what failed; the messages name it, and count a reward's "samples" and an environment's "episodes"
    of: Literal["reward", "environment"] = "reward"
    #: the samples scored, or the episodes played (an episode is one sample)
    samples: int = 0
    errors: int = 0
    timeouts: int = 0
    first_error: str = ""
    first_row: int | None = None
    first_prompt: str = ""
    #: whether the first failure kept is a timeout (a later error replaces it: see `note`)
    first_timed_out: bool = False
    #: the first few failed rows' numbers, for a reward's summary line
    failed_rows: list[int] = field(default_factory=list)

    SHOWN_ROWS = 5

    @property
    def failed(self) -> int:
        return self.errors + self.timeouts

    @property
    def share(self) -> float:
        """The failed share of the samples (``reward/error_share``, ``env/error_share``); 0 for none."""
        return self.failed / self.samples if self.samples else 0.0

    def note(self, row: int, prompt: Any, error: str, timed_out: bool = False) -> None:
        """Remember one failed row (the counts are kept by the caller). The first failure is kept, except that an
        error replaces a first failure noted as ``timed_out``: an exception's text says more about what to fix.
        An environment marks its timeouts so; a reward notes its own as plain failures, so its message names its
        first failure in row order."""
        if self.first_row is None or (self.first_timed_out and not timed_out):
            self.first_row, self.first_prompt, self.first_error = row, prompt_snippet(prompt), error
            self.first_timed_out = timed_out
        if len(self.failed_rows) < self.SHOWN_ROWS and row not in self.failed_rows:  # a prompt's n samples: one row
            self.failed_rows.append(row)

    def merge(self, other: Failures) -> Failures:
        """Add ``other``'s samples and failures (another call, or another rank's share of a step); its first
        failure replaces this one's as in `note`."""
        self.samples += other.samples
        self.errors += other.errors
        self.timeouts += other.timeouts
        if other.first_row is not None and (
            self.first_row is None or (self.first_timed_out and not other.first_timed_out)
        ):
            self.first_row, self.first_prompt, self.first_error = other.first_row, other.first_prompt, other.first_error
            self.first_timed_out = other.first_timed_out
        for row in other.failed_rows:
            if len(self.failed_rows) < self.SHOWN_ROWS and row not in self.failed_rows:
                self.failed_rows.append(row)
        return self

    def first(self) -> str:
        """The first failure: ``row 3 (prompt '...'): KeyError: 'answr'``."""
        return f"row {self.first_row} (prompt {self.first_prompt}): {self.first_error}"

    def describe(self) -> str:
        """One line for all of them (empty when nothing failed); a reward's names its first few failed rows."""
        if not self.failed:
            return ""
        reward = self.of == "reward"
        raised = "raised or returned a non-number" if reward else "raised or returned something malformed"
        kinds = (
            f"{self.errors} {raised}, {self.timeouts} timed out"
            if self.errors and self.timeouts
            else ("timed out" if self.timeouts else raised)
        )
        if reward:
            more = ", …" if self.failed > len(self.failed_rows) else ""
            kinds += "; rows " + ", ".join(map(str, self.failed_rows)) + more
        return (
            f"{self.of} '{self.name}' failed on row {self.first_row}: {self.first_error} (prompt {self.first_prompt}); "
            f"{self.failed} of {self.samples} {'samples' if reward else 'episodes'} failed ({self.share:.0%}, {kinds}) "
            "and score 0"
        )


def score_batch(
    reward, prompts: list, completions: list[str], examples: list[dict], failures: Failures | None = None
) -> tuple[list[float], dict[str, float]]:
    """Score a batch with ``reward`` under its ``timeout_s``; never raises for reward failures.

    Returns one float per completion and ``reward/mean``, ``reward/std`` (population std over
    all rows, failed rows included as 0), ``reward/errors`` and ``reward/timeouts`` (row counts)
    and ``reward/error_share`` (their share of the rows). The failures are added to ``failures``
    when given (the caller reports them, e.g. once per step); otherwise one line is logged here.
    """
    n = len(completions)
    if len(prompts) != n or len(examples) != n:  # the caller's bug, not the reward's
        raise ValueError(f"score_batch: {len(prompts)} prompts, {n} completions, {len(examples)} examples")
    name = getattr(reward, "name", type(reward).__name__)
    seen = Failures(name, samples=n)
    scores = _score(reward, prompts, completions, examples, seen)
    if failures is not None:
        failures.merge(seen)
    elif seen.failed:
        log.warning("%s", seen.describe())
    return _summary(scores, errors=seen.errors, timeouts=seen.timeouts)


def _score(reward, prompts: list, completions: list[str], examples: list[dict], seen: Failures) -> list[float]:
    """The scores, every failure counted and noted in ``seen``."""
    n = len(completions)
    limit_s = float(getattr(reward, "timeout_s", 30.0))
    try:
        result = _call(reward, prompts, completions, examples, limit_s)
    except _Timeout:
        seen.timeouts = n
        for i in range(n):
            seen.note(row_number(examples, i), prompts[i], f"timed out (the call on {n} rows ran past {limit_s:g}s)")
        return [0.0] * n
    except Exception:  # noqa: BLE001 - retried row by row, so one bad row costs only itself
        return _row_by_row(reward, prompts, completions, examples, limit_s, seen)

    values = _as_list(result)
    if values is None or len(values) != n:
        got = len(values) if values is not None else type(result).__name__
        seen.errors = n
        for i in range(n):
            seen.note(row_number(examples, i), prompts[i], f"returned {got} values for {n} rows")
        return [0.0] * n
    scores = []
    for i, value in enumerate(values):
        number = _finite(value)
        if number is None:
            seen.errors += 1
            seen.note(row_number(examples, i), prompts[i], f"returned {value!r}, not a finite number")
        scores.append(0.0 if number is None else number)
    return scores


def _row_by_row(reward, prompts, completions, examples, limit_s: float, seen: Failures) -> list[float]:
    """Score each row alone, all within one more ``limit_s``; failures go to ``seen``."""
    deadline = time.monotonic() + limit_s
    n = len(completions)
    scores: list[float] = []
    for i in range(n):
        try:
            row = slice(i, i + 1)
            values = _as_list(_call(reward, prompts[row], completions[row], examples[row], deadline - time.monotonic()))
            number = _finite(values[0]) if values is not None and len(values) == 1 else None
            if number is None:
                raise ValueError(f"returned {values!r} for one row")
        except _Timeout:
            seen.timeouts += n - i
            for k in range(i, n):
                seen.note(
                    row_number(examples, k), prompts[k], f"timed out (rows retried one by one ran past {limit_s:g}s)"
                )
            return scores + [0.0] * (n - i)
        except Exception as exc:  # noqa: BLE001 - counted, never raised
            seen.errors += 1
            seen.note(row_number(examples, i), prompts[i], f"{type(exc).__name__}: {exc}")
            number = 0.0
        scores.append(number)
    return scores


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
    return scores, {
        "reward/mean": mean,
        "reward/std": std,
        "reward/errors": float(errors),
        "reward/timeouts": float(timeouts),
        "reward/error_share": (errors + timeouts) / n if n else 0.0,
    }


class RewardWatch:
    """Stops a run whose reward keeps failing: a failed share of the rows above ``max_share`` for
    ``steps`` steps in a row (``rollout.max_reward_error_share``, ``rollout.reward_error_steps``).

    Each step's failures make one warning line. A run on rewards that are mostly 0 because the
    reward raises learns nothing, so it stops before it trains on them — naming the reward, the
    exception, a sample row and the newest complete checkpoint — rather than reporting "done".
    ``steps = 0`` or ``max_share = 1`` (a share never exceeds 1) never stops.
    """

    def __init__(self, max_share: float, steps: int):
        self.max_share, self.steps, self.streak = max_share, steps, 0

    def after_scoring(self, step: int, failures: Failures, run_dir) -> None:
        if failures.failed:
            log.warning("step %d: %s", step, failures.describe())
        if not self.steps or failures.share <= self.max_share:
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.steps:
            raise self.stop(step, failures, run_dir)

    def stop(self, step: int, failures: Failures, run_dir):
        # lazy: checkpoint imports torch; rewards stays torch-free for `oxrl score` and the reward plugins
        from oxrl_core.run_io.checkpoint import latest_checkpoint

        last = latest_checkpoint(run_dir) if run_dir is not None else None
        streak = "this step" if self.steps == 1 else f"each of the last {self.steps} steps"
        keep = (
            f"last complete checkpoint: {last}; after the fix resume with: oxrl run --resume -o {run_dir}"
            if last
            else ("no checkpoint was saved yet")
        )
        return OxrlError(self.message(step, failures, streak, keep))

    def message(self, step: int, failures: Failures, streak: str, keep: str) -> str:
        """What the stop says: the step, who failed how often against which option, the first failure, ``keep``
        (what was saved) and the way on."""
        return (
            f"step {step}: reward '{failures.name}' failed on {failures.failed} of {failures.samples} samples "
            f"({failures.share:.0%}) — over rollout.max_reward_error_share={self.max_share:g} in {streak}; "
            f"first failure on {failures.first()}. The run stops before training on zero rewards ({keep}). "
            f"Fix the reward or the data field it reads (check with: oxrl score --reward {failures.name} --data FILE), "
            f"or set rollout.max_reward_error_share=1 to train on anyway"
        )


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
    name = config.reward.name or default_name
    if not name:
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
    reward = registry.build("reward", name, reward_options(config), field="reward", source=source)
    if config.reward.timeout_s:
        reward.timeout_s = config.reward.timeout_s
    return reward
