"""How a run went, read from its metrics: the warnings the end-of-run table and `oxrl report` show.

`check_run(records, summary, max_steps)` looks at a run's per-step records (metrics.jsonl's lines, or
the loop's own list) and its summary (held-out metrics before / after) and returns `Finding`s, worst
first. Each check is one small function below; none needs torch. A check that lacks its metric (an SFT
run has no reward) finds nothing.

    error    the run is broken: non-finite values, a run that stopped early, a reward that never varies
    warning  worth a look: entropy collapse, a growing trainer–rollout logprob gap, reward errors or
             timeouts, most completions cut at the length limit, weights left unchanged (learning rate 0 at
             every step), no held-out improvement
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = [
    "HEADLINE",
    "Finding",
    "check_run",
    "is_async",
    "is_finite",
    "pipeline_text",
    "print_summary",
    "series",
    "summary_rows",
    "versions",
]

#: held-out metrics that say whether training helped: (metric, higher is better)
HEADLINE = (
    ("eval/accuracy", True),
    ("eval/rewards/accuracies", True),
    ("eval/reward", True),
    ("eval/reward_sampled", True),
    ("eval/loss", False),
)


#: a failed run's traceback, kept in its run directory (the terminal shows only the one-line message)
ERROR_LOG = "error.log"


def error_superseded(run_dir: Path) -> bool:
    """Whether the run finished after the failure its ``error.log`` holds: ``summary.json`` (written when a
    run ends) is newer, e.g. a start that failed and a ``--resume`` that then went through. Such an error is
    history, not the run's failure; `oxrl report` decides the same way with this function."""
    log, summary = Path(run_dir) / ERROR_LOG, Path(run_dir) / "summary.json"
    try:
        return log.is_file() and summary.is_file() and summary.stat().st_mtime > log.stat().st_mtime
    except OSError:  # removed between the two looks
        return False


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning"
    code: str  # a stable name, e.g. "reward_constant"
    message: str


def versions() -> dict[str, str]:
    """What a run ran on (summary.json's ``environment``; `oxrl report` shows it): read without importing torch."""
    out = {"python": platform.python_version()}
    for dist in ("oxrl", "torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def is_finite(value) -> bool:
    """metrics.jsonl writes a non-finite float as the string 'nan' / 'inf' / '-inf'."""
    if isinstance(value, str):
        return value.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isfinite(value)
    return True


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` over the records that have it; a non-finite value is NaN."""
    out = []
    for r in records:
        if key not in r or isinstance(r[key], bool):
            continue
        value = r[key]
        if isinstance(value, str):
            value = math.nan if not is_finite(value) else _float(value)
        if isinstance(value, (int, float)):
            out.append((int(r.get("step", len(out) + 1)), float(value)))
    return out


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def is_async(records: list[dict]) -> bool:
    """Whether the run's rollouts were asynchronous (rollout.max_staleness >= 1): only such a run logs
    ``policy/staleness_max``."""
    return bool(series(records, "policy/staleness_max"))


def trained_stale(records: list[dict]) -> bool:
    """Whether a step trained on samples of an older policy version (``policy/staleness_max`` > 0)."""
    return any(math.isfinite(v) and v > 0 for _, v in series(records, "policy/staleness_max"))


def _one(record: dict, key: str, missing: float) -> float:
    """``record[key]`` as a float (NaN if not finite), ``missing`` if absent."""
    found = series([record], key)
    return found[0][1] if found else missing


#: the phases of an RL step whose sum `pipeline_text` compares with the wall-clock (perf/step_s): generation and
#: scoring, the trainer's reward phase, training. The weight sync (perf/sync_s) is timed inside the train phase
#: (loops/rl.py: ``clock("sync")`` within ``clock("train")``), so perf/train_s holds it: adding it would count it twice
PHASES = ("perf/gen_in_step_s", "perf/reward_s", "perf/train_s")
#: the most the phases of an asynchronous step can add up to, over its wall-clock: two activities overlap (the
#: worker's generation and scoring, the trainer's reward phase and training), each inside the step
ASYNC_BOUND = 2.0


def pipeline_text(records: list[dict]) -> str:
    """An asynchronous RL run's speedup over its phases run one after the other: Σ(generation and scoring inside
    the step + reward + training with its weight sync seconds: `PHASES`) / Σ wall-clock seconds of the steps, the
    trainer's idle share (Σ waiting for a batch / Σ step), and the staleness (mean, max); "" for a synchronous run
    (its phases run in turn: the ratio is 1 by construction, less the step's bookkeeping) or one that logged no
    phases. Only generation inside a step counts (``perf/gen_in_step_s``; batches made during start-up or between
    steps would otherwise inflate it), so the ratio is at most `ASYNC_BOUND`; a run logged before that key existed
    counts ``perf/gen_s`` up to its step's time. A step with a non-finite or missing time is left out (a missing
    reward phase counts 0)."""
    if not is_async(records):
        return ""
    phases = wall = wait = 0.0
    counted = 0
    for r in records:
        step, waited = _one(r, "perf/step_s", math.nan), _one(r, "perf/gen_wait_s", 0.0)
        in_step = _one(r, "perf/gen_in_step_s", math.nan)
        if not math.isfinite(in_step):  # an older run: its whole generation time, within the step's own
            in_step = min(_one(r, "perf/gen_s", math.nan), step)
        parts = [in_step, *(_one(r, key, 0.0) for key in PHASES[1:])]
        if not all(math.isfinite(v) for v in (*parts, step, waited)) or step <= 0:
            continue
        phases, wall, wait, counted = phases + sum(parts), wall + step, wait + waited, counted + 1
    if not counted:
        return ""
    mean = [v for _, v in series(records, "policy/staleness_mean") if math.isfinite(v)]
    most = max((v for _, v in series(records, "policy/staleness_max") if math.isfinite(v)), default=math.nan)
    return (
        f"{phases / wall:.2f}× speedup over its phases run in turn (at most {ASYNC_BOUND:g}×; phases {phases:.1f} s, "
        f"wall {wall:.1f} s; "
        f"trainer idle {wait / wall:.0%}); staleness mean {_mean(mean):.2f}, max {most:g} policy updates"
    )


# ---------------------------------------------------------------------------------------------- checks


def _stopped(records, summary, max_steps, error) -> list[Finding]:
    if summary is not None or max_steps is None:
        return []
    last = max((int(r.get("step", 0)) for r in records), default=0)
    if error and ("not finite" in error or "non-finite" in error):
        return [Finding("error", "non_finite_stop", f"stopped by a non-finite value after step {last}: {error}")]
    if error:
        return [Finding("error", "stopped", f"the run failed after step {last} of {max_steps}: {error}")]
    return [
        Finding(
            "warning",
            "stopped",
            f"the run has not finished: step {last} of {max_steps} and no summary.json (still running, or it was "
            "interrupted or killed)",
        )
    ]


def _non_finite(records, summary, max_steps, error) -> list[Finding]:
    bad: dict[str, int] = {}  # metric -> first step where it is not finite
    for r in records:
        for key, value in r.items():
            if not is_finite(value) and key not in bad:
                bad[key] = int(r.get("step", 0))
    for when in ("eval_before", "eval_after"):
        for key, value in ((summary or {}).get(when) or {}).items():
            if not is_finite(value) and key not in bad:
                bad[key] = -1
    if not bad:
        return []
    where = ", ".join(f"{k} (step {s})" if s >= 0 else f"{k} (held-out)" for k, s in list(bad.items())[:6])
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    return [Finding("error", "non_finite", f"non-finite values (NaN/inf): {where}{more}")]


def _reward_constant(records, summary, max_steps, error) -> list[Finding]:
    means, stds = series(records, "reward/mean"), dict(series(records, "reward/std"))
    if not means or any(not math.isfinite(v) for _, v in means):
        return []
    # the trailing stretch of steps over which every sample scored the same value
    value, since = means[-1][1], None
    for step, mean in reversed(means):
        if abs(mean - value) > 1e-9 or abs(stds.get(step, 0.0)) > 1e-9:
            break
        since = step
    if since is None:
        return []
    stretch = sum(1 for s, _ in means if s >= since)
    if stretch == len(means):
        return [
            Finding(
                "error",
                "reward_constant",
                f"reward constant at {value:.3f} over all {len(means)} steps: every sample scored the same, so "
                "every advantage is 0 and nothing is learned (check the reward, the prompt format, "
                "rollout.max_new_tokens)",
            )
        ]
    if stretch >= max(5, len(means) // 2):
        return [
            Finding(
                "warning",
                "reward_constant",
                f"reward constant at {value:.3f} since step {since} ({stretch} steps): every sample scores the same",
            )
        ]
    return []


def _entropy_collapse(records, summary, max_steps, error) -> list[Finding]:
    values = [v for _, v in series(records, "entropy") if math.isfinite(v)]
    if len(values) < 4:
        return []
    k = max(1, len(values) // 10)
    first, last = _mean(values[:k]), _mean(values[-k:])
    if first > 0.05 and last < 0.1 * first:
        return [
            Finding(
                "warning",
                "entropy_collapse",
                f"entropy collapsed from {first:.3f} to {last:.3f} nats/token: the policy has stopped exploring "
                "(lower train.lr, raise rollout.temperature, or add a KL / entropy term)",
            )
        ]
    return []


def _logprob_gap_growing(records, summary, max_steps, error) -> list[Finding]:
    # asynchronous rollouts (rollout.max_staleness >= 1): the trainer's logprobs are the current policy's, the
    # samples' those of a version up to k updates older, so the gap also holds the policy's own updates since then
    # (it grows as the policy moves, by design, and the importance weights correct for it): not a drift to warn
    # about. Such a run is skipped; its off-policy metrics (offpolicy/kl_k3, offpolicy/ess) are in the report.
    if trained_stale(records):
        return []
    values = [v for _, v in series(records, "rollout/logprob_diff") if math.isfinite(v)]
    if len(values) < 6:
        return []
    third = len(values) // 3
    first, last = _mean(values[:third]), _mean(values[-third:])
    if last > 1e-3 and last > 2 * first:
        return [
            Finding(
                "warning",
                "logprob_gap_growing",
                f"trainer–rollout logprob gap growing: rollout/logprob_diff {first:.2g} → {last:.2g} (first third → "
                "last third of the run); the samples drift from the policy being trained (rollout.tis_cap corrects "
                "for it, a precision mismatch causes it)",
            )
        ]
    return []


def _reward_failures(records, summary, max_steps, error) -> list[Finding]:
    out = []
    for prefix, what in (("reward", "reward"), ("env", "environment")):
        errors = sum(v for _, v in series(records, f"{prefix}/errors") if math.isfinite(v))
        timeouts = sum(v for _, v in series(records, f"{prefix}/timeouts") if math.isfinite(v))
        if errors or timeouts:
            unit = "rows" if prefix == "reward" else "episodes"
            # the environment's first failure, as its step logged it (env/first_error: text)
            first = next(
                (r[f"{prefix}/first_error"] for r in records if isinstance(r.get(f"{prefix}/first_error"), str)), ""
            )
            out.append(
                Finding(
                    "warning",
                    f"{prefix}_failures",
                    f"{what} errors in {errors:.0f} {unit} and timeouts in {timeouts:.0f} {unit} over the run "
                    f"(scored 0){'; first on ' + first if first else ''}",
                )
            )
    return out


def _clipped(records, summary, max_steps, error) -> list[Finding]:
    values = [v for _, v in series(records, "response/clipped") if math.isfinite(v)]
    if not values:
        return []
    last = _mean(values[-max(1, len(values) // 10) :])
    if last > 0.5 and series(records, "env/cut_by_max_tokens"):
        return _episodes_cut(records, last)
    if last > 0.5:
        return [
            Finding(
                "warning",
                "clipped",
                f"{last:.0%} of completions cut at rollout.max_new_tokens at the end of the run: they are scored "
                "unfinished (raise rollout.max_new_tokens)",
            )
        ]
    return []


def _episodes_cut(records, clipped: float) -> list[Finding]:
    """Multi-turn episodes (env.name) ending cut: by their token budget (env.max_tokens) or with a model turn cut
    at rollout.max_new_tokens; the message names the setting of each share (raising the other does nothing)."""
    cuts = []
    for key, setting, what in (
        ("env/cut_by_max_tokens", "env.max_tokens", "the episode's token budget"),
        ("env/cut_by_max_new_tokens", "rollout.max_new_tokens", "one model turn's limit"),
    ):
        values = [v for _, v in series(records, key) if math.isfinite(v)]
        share = _mean(values[-max(1, len(values) // 10) :]) if values else 0.0
        if share > 0:
            cuts.append((share, setting, what))
    cuts.sort(reverse=True)
    if not cuts:
        return []
    where = ", ".join(f"{share:.0%} at {setting} ({what})" for share, setting, what in cuts)
    raise_ = " / ".join(setting for _, setting, _ in cuts)
    return [
        Finding(
            "warning",
            "clipped",
            f"{clipped:.0%} of episodes ended cut at the end of the run: {where}; they are scored unfinished "
            f"(raise {raise_})",
        )
    ]


def _no_held_out_gain(records, summary, max_steps, error) -> list[Finding]:
    before, after = (summary or {}).get("eval_before") or {}, (summary or {}).get("eval_after") or {}
    compared = [
        (key, before[key], after[key], higher)
        for key, higher in HEADLINE
        if key in before and key in after and is_finite(before[key]) and is_finite(after[key])
    ]
    if not compared:
        return []
    if any((a > b) if higher else (a < b) for _, b, a, higher in compared):
        return []
    what = ", ".join(f"{k} {b:.3f} → {a:.3f}" for k, b, a, _ in compared)
    return [Finding("warning", "no_held_out_gain", f"no held-out improvement: {what}")]


#: the smallest fall of a held-out share that is a regression, whatever the number of rows
MIN_FALL = 0.02


def _held_out_fell(records, summary, max_steps, error) -> list[Finding]:
    """The first headline held-out metric present (`HEADLINE` order) got worse by more than its noise, whatever
    else rose: a share p over n held-out rows by more than max(`MIN_FALL`, 2·√(p(1−p)/n)) (two standard errors
    of the binomial share at its value before; n unknown: `MIN_FALL`), ``eval/loss`` by more than
    max(`MIN_FALL`, 2 % of its value before)."""
    before, after = (summary or {}).get("eval_before") or {}, (summary or {}).get("eval_after") or {}
    first = next((key for key, _ in HEADLINE if key in before and key in after), None)
    if first is None or not (is_finite(before[first]) and is_finite(after[first])):
        return []
    was, now = float(before[first]), float(after[first])
    if first == "eval/loss":
        bound, fall, what = max(MIN_FALL, 0.02 * abs(was)), now - was, "rose"
        noise = f"more than max({MIN_FALL:g}, 2% of {was:.3f})"
    else:
        n = int((summary or {}).get("eval_rows") or 0)
        p = min(max(was, 0.0), 1.0)
        bound = max(MIN_FALL, 2 * math.sqrt(p * (1 - p) / n)) if n else MIN_FALL
        fall, what = was - now, "fell"
        noise = f"more than its noise {bound:.3f} over {n} held-out rows" if n else f"more than {MIN_FALL:g}"
    if fall <= bound:
        return []
    return [
        Finding(
            "warning",
            "held_out_fell",
            f"held-out {first.removeprefix('eval/')} {what}: {was:.3f} → {now:.3f}, {noise} (whatever else rose)",
        )
    ]


def _weights_unchanged(records, summary, max_steps, error) -> list[Finding]:
    """Every step at learning rate 0 (a warm-up as long as the run): AdamW's update and weight decay are both
    scaled by it, so the weights come out bit-identical to the start, however the loss moved."""
    rates = series(records, "lr")
    if not rates or any(rate != 0 for _, rate in rates):
        return []
    return [
        Finding(
            "warning",
            "weights_unchanged",
            f"the learning rate was 0 at all {len(rates)} steps: the weights did not change, final/ holds the "
            "weights the run started from (a warm-up as long as the run does this: lower train.warmup_steps)",
        )
    ]


CHECKS = (
    _stopped,
    _non_finite,
    _reward_constant,
    _entropy_collapse,
    _logprob_gap_growing,
    _reward_failures,
    _clipped,
    _weights_unchanged,
    _no_held_out_gain,
    _held_out_fell,
)


def check_run(
    records: list[dict], summary: dict | None, max_steps: int | None = None, error: str = ""
) -> list[Finding]:
    """Every check's findings, errors first. ``summary`` is None for a run that wrote no summary.json
    (then ``max_steps`` says how far it should have gone, and ``error`` is the error it failed with, if known)."""
    findings = [f for check in CHECKS for f in check(records, summary, max_steps, error)]
    return sorted(findings, key=lambda f: f.level != "error")


# ---------------------------------------------------------------------------------------------- the end of a run


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def _value(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) and is_finite(value) else str(value)


def summary_rows(
    records: list[dict], summary: dict, findings: list[Finding], held_out, run_dir, final_dir
) -> list[tuple[str, str, str]]:
    """The end-of-run table as (label, text, style) rows: steps, time, final loss / reward, held-out
    before → after (each ``held_out`` (metric, label); None = every held-out metric), the findings, the
    report command and the model. ``style`` is a rich style ("" = plain)."""
    last = records[-1] if records else {}
    rows = [("steps", f"{last.get('step', summary['steps'])} of {summary['steps']}", "")]
    rows.append(("time", _duration(summary["train_seconds"]), ""))
    if "loss" in last:
        loss = f"{last['loss']:.4g}" if is_finite(last["loss"]) else str(last["loss"])
        rows.append(("final loss", loss, "" if is_finite(last["loss"]) else "bold red"))
    if "reward/mean" in last:
        first = next(r["reward/mean"] for r in records if "reward/mean" in r)
        rows.append(("reward", f"{_value(first)} at the first step → {_value(last['reward/mean'])} at the last", ""))
    if pipeline := pipeline_text(records):  # asynchronous rollouts: what overlapping bought
        rows.append(("async rollouts", pipeline, ""))
    before, after = summary["eval_before"], summary["eval_after"]
    pairs = [(k, "held-out " + k.removeprefix("eval/")) for k in after] if held_out is None else held_out
    for key, label in pairs:
        if key in after:
            rows.append((label, f"{_value(before.get(key, math.nan))} before → {_value(after[key])} after", ""))
    for finding in findings:
        style = "bold red" if finding.level == "error" else "yellow"
        rows.append((finding.level, finding.message, style))
    if not findings:
        rows.append(("warnings", "none: nothing in the metrics looks wrong", "green"))
    rows.append(("report", f"oxrl report {run_dir}", ""))
    rows.append(("model", str(final_dir), ""))
    return rows


def print_summary(console, title: str, rows: list[tuple[str, str, str]]) -> None:
    """The rows as a two-column rich table (colour on a terminal, plain text elsewhere)."""
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, text, style in rows:
        table.add_row(Text(label), Text(text), style=style or None)  # Text: a path's "[...]" is not markup
    if not console.is_terminal:  # a log file or a pipe: wide enough that a path or a warning stays on one line
        console = Console(file=console.file, width=max(console.width, 160), no_color=True)
    console.print(table, highlight=False)
