"""`oxrl score`: score a file of completions with a reward, before (or without) a run.

Rows come from a JSONL, JSON or Parquet file (`oxrl_core.data.sources.load_source`). Every row needs a
string ``completion`` plus whatever fields the reward reads (``answer``, ``tests``, ...); its
``prompt`` (default ``""``) and the whole row are passed as in training. The reward is built as a
run builds it: ``reward.name`` is ``--reward`` and each ``--set key=value`` is a ``reward.key``
option, validated by the reward's ``Config`` (``timeout_s`` is the per-call limit, as in a run).

Scoring goes through the same safety net as training (`oxrl_core.scoring.rewards.score_batch`), in
chunks of `CHUNK` rows so a slow chunk costs only itself: a call that raises is retried row by
row, one that runs past ``timeout_s`` scores its rows 0, and a non-finite value scores its row 0;
each such row is counted and gets an ``error``.

Output, one JSON object per row in file order: ``row`` (its row number: the line number for
JSONL), ``score``, the reward's `Reward.score_details` (for ``code``: passed, total, status,
isolation, stderr) and, for a row that failed, ``error``; to ``--output`` or stdout. A one-line
summary (rows, mean score, errors, timeouts) goes to the console (stderr).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from oxrl_core.config import RunConfig, apply_overrides
from oxrl_core.data.sources import load_source, path_kind
from oxrl_core.errors import OxrlError
from oxrl_core.plugins import registry
from oxrl_core.schema import format_validation_error
from oxrl_core.scoring.rewards import Failures, build_reward, score_batch

#: rows per `score_batch` call
CHUNK = 256


def score_file(reward: str, data: Path, output: Path | None, overrides: list[str], console=None) -> dict[str, Any]:
    """Score every row of ``data`` with ``reward``; write the rows and return the summary."""
    rows, origin = read_rows(Path(data))
    scorer = build(reward, overrides)

    failures = Failures(scorer.name)  # summarised once for the file, not a line per row or chunk
    totals = {"rows": 0, "score_sum": 0.0, "errors": 0, "timeouts": 0, "failures": failures}
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    sink = open(output, "w", encoding="utf-8") if output is not None else sys.stdout
    try:
        for start in range(0, len(rows), CHUNK):
            chunk = rows[start : start + CHUNK]
            for row, result in zip(chunk, score_chunk(scorer, chunk, totals)):
                sink.write(json.dumps({"row": row["_row"], **result}) + "\n")
            sink.flush()
    finally:
        if output is not None:
            sink.close()
    if failures.failed:
        import logging

        logging.getLogger("oxrl.rewards").warning("%s", failures.describe())
    n = totals["rows"]
    summary = {
        "rows": n,
        "mean": totals["score_sum"] / n if n else 0.0,
        "errors": totals["errors"],
        "timeouts": totals["timeouts"],
    }
    if console is not None:
        where = f" -> {output}" if output is not None else ""
        console.print(
            f"scored {n} rows of {origin} with reward '{scorer.name}': mean {summary['mean']:.4f}, "
            f"errors {summary['errors']}, timeouts {summary['timeouts']}{where}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    return summary


def read_rows(path: Path) -> tuple[list[dict], str]:
    """The rows of a data file, each with a string ``completion`` (else an error naming file, row and field)."""
    if path_kind(str(path), "--data") != "file":
        raise OxrlError(f"{path}: file not found (--data takes a JSONL, JSON or Parquet file)")
    source = load_source(str(path), "train", field="--data")
    for row in source.rows:
        completion = row.get("completion")
        if not isinstance(completion, str):
            problem = "missing" if completion is None else f"expected a string, got {type(completion).__name__}"
            raise OxrlError(f"{source.origin}: row {row.get('_row', '?')}: field 'completion': {problem}")
    return source.rows, source.origin


def build(reward: str, overrides: list[str]):
    """The reward ``reward`` with ``--set`` options, validated exactly as a run's ``reward:`` section."""
    from pydantic import ValidationError

    options = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        key = key.strip().removeprefix("reward.")
        if not sep or not key:
            raise OxrlError(f"--set {item!r}: expected KEY=VALUE, e.g. --set workers=4")
        if key == "name":
            raise OxrlError(f"--set {item!r}: the reward is chosen with --reward")
        options.append(f"reward.{key}={item.partition('=')[2]}")
    raw = apply_overrides({"reward": {"name": reward}}, options)
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise format_validation_error(exc, RunConfig, "--set") from None
    return build_reward(config, registry(), source="--set")


class _Recorder:
    """What `score_batch` calls in place of the reward: it calls `score_details` and keeps each row's
    details (by the row's identity: a row-by-row retry passes the same dicts) and each failure."""

    def __init__(self, reward):
        self.reward, self.name, self.timeout_s = reward, reward.name, reward.timeout_s
        self.details: dict[int, dict] = {}
        self.failures: dict[int, str] = {}

    def score(self, prompts: list, completions: list[str], examples: list[dict]) -> list:
        try:
            details = self.reward.score_details(prompts, completions, examples)
        except Exception as exc:
            if len(examples) == 1:
                self.failures[id(examples[0])] = f"{type(exc).__name__}: {exc}"
            raise
        details = list(details)
        for example, detail in zip(examples, details):
            if isinstance(detail, dict):
                self.details[id(example)] = detail
        return [detail.get("score") if isinstance(detail, dict) else detail for detail in details]


def score_chunk(reward, rows: list[dict], totals: dict) -> list[dict]:
    """``{"score", ...details, ["error"]}`` per row, through `score_batch`; adds to ``totals``."""
    recorder = _Recorder(reward)
    prompts = [row.get("prompt", "") for row in rows]
    scores, metrics = score_batch(recorder, prompts, [row["completion"] for row in rows], rows, totals.get("failures"))
    timeouts = int(metrics["reward/timeouts"])  # score_batch's timeouts are always the last rows
    results = []
    for k, (row, score) in enumerate(zip(rows, scores)):
        detail = dict(recorder.details.get(id(row), {}))
        raw = detail.pop("score", None)
        if k >= len(rows) - timeouts:
            result = {"score": score, "error": f"timeout (the call ran past {reward.timeout_s:g}s)"}
        elif id(row) in recorder.failures:
            result = {"score": score, **detail, "error": recorder.failures[id(row)]}
        elif not _same(raw, score):
            result = {"score": score, **detail, "error": detail.get("error") or f"the reward returned {raw!r}"}
        else:
            result = {"score": score, **detail}
        results.append(result)
    totals["rows"] += len(rows)
    totals["score_sum"] += sum(scores)
    totals["errors"] += int(metrics["reward/errors"])
    totals["timeouts"] += timeouts
    return results


def _same(raw: Any, score: float) -> bool:
    """Whether the reward's own value is the score `score_batch` kept (a finite number, unchanged)."""
    if isinstance(raw, (str, bytes)) or raw is None:
        return False
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and value == score
