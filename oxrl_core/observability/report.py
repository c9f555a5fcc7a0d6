"""`oxrl report RUN_DIR [RUN_DIR ...] -o report.html`: one self-contained HTML file about one or more runs.

Read from each run directory: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line a step;
a torn line skipped), ``summary.json`` (held-out before / after, versions; absent when the run stopped
early) and, for RL runs, ``rollouts.jsonl`` (a sample of rollouts, `rollout_log`). Written:

- the config and environment of each run, and the warnings `health.check_run` finds in its metrics;
- the curves of its algorithm family, drawn here as inline SVG (no plotting library, no script, no
  network): loss, reward mean ± std and its distribution over time, KL, entropy, response length and
  share clipped, trainer–rollout logprob gap, grad norm, lr, tokens/s, MFU, every held-out metric at
  every evaluation; then every other logged metric. Two or more runs overlay their curves;
- for RL runs, the rollout viewer: the logged steps' prompts and completions with their rewards and
  advantages, each completion's tokens coloured by a per-token quantity picked in a select box (a small
  inline script reads the samples from an inline JSON block).

Nothing in the file points outside it: it opens from disk, offline.

Every file of a run directory is treated as hostile (a tampered or damaged run directory, a name chosen by
anyone): every value read from it reaches the page escaped (`_esc`; in the viewer's JSON block `<`, `>`, `&`
are escaped, `_json_for_script`; the viewer's script puts data into the page as text only), and the page's
Content-Security-Policy (`CSP`) runs no script but the viewer's own, identified by its hash. A file of the
wrong shape (a step that is not a number, a config that is a list, a summary that is not an object) is a
note in the report ("Damaged files"), never a crash; an error.log that the run outlived (it finished
later, e.g. after ``--resume``) is shown as an earlier failure, as `oxrl bug-report` decides.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from oxrl_core.atomic import write_text_atomic
from oxrl_core.errors import OxrlError
from oxrl_core.observability.health import HEADLINE, Finding, check_run, error_superseded, is_finite, series
from oxrl_core.observability.health import versions as current_versions
from oxrl_core.redact import redact, secret_values

__all__ = ["RunData", "load_run", "render_report", "write_report"]

#: the most rollout steps the viewer embeds (evenly spaced, first and last kept): the report's size is bounded
MAX_VIEWER_STEPS = 20

#: colours of the series (one per run when several runs overlay, else one per metric)
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")


# ---------------------------------------------------------------------------------------------- reading a run


@dataclass
class RunData:
    path: Path
    name: str
    config: dict
    records: list[dict]
    summary: dict | None
    rollouts: list[dict] = field(default_factory=list)
    error_log: str = ""  # error.log: the traceback of a run that failed (lifecycle.error_log writes it)
    #: the run finished after the failure error.log holds (`health.error_superseded`): history, not its failure
    error_superseded: bool = False
    #: what was damaged in the run directory and how the report read around it (shown at the top of the run)
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> str:
        """The one-line error a failed run stopped with (error.log's ``error:`` line), or ''."""
        if self.error_superseded:
            return ""
        for line in self.error_log.splitlines():
            if line.startswith("error: "):
                return line.removeprefix("error: ").split(": ", 1)[-1].strip()
        return ""

    @property
    def family(self) -> str:
        keys = {k for r in self.records for k in r}
        if "reward/mean" in keys:
            return "rl"
        if any(k.startswith(("rewards/", "logps/")) for k in keys):
            return "preference"
        return "supervised"

    def section(self, name: str) -> dict:
        """A section of the config (``train``, ``rollout``, ...); {} when it is absent or not a mapping (the
        damage is in `notes`)."""
        value = self.config.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def max_steps(self) -> int | None:
        steps = self.section("train").get("max_steps")
        return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


# ---------------------------------------------------------------------------------------------- reading, defensively
# Every file of a run directory may be damaged (a disk that filled, a hand edit, a tool that wrote a wrong
# shape): what cannot be read is left out of the report with a note naming the file, the line and the field,
# and the rest is shown. Nothing read here is trusted to be of the type oxRL writes.

#: the config sections the report reads; any other shape than a mapping is a note
SECTIONS = ("model", "train", "data", "rollout", "reward")
#: a value beyond this is drawn as not finite: no axis could span it (the float range ends at 1.8e308)
HUGE = 1e300
#: the most notes one file gets (the rest are counted)
MAX_NOTES = 5


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _step(value) -> int | None:
    """A record's step: a whole number (an int, or an integral float) within range; None otherwise."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**15:
        return value
    return None


def _clip(value):
    """A metric value the charts can draw: an int beyond the float range (JSON allows 1e400 written as an
    int) becomes ±inf, a float beyond ±`HUGE` likewise; anything else is kept as it is."""
    if _is_number(value) and value == value and abs(value) > HUGE:  # (value == value: not NaN; an int has none)
        return math.inf if value > 0 else -math.inf
    return value


def _describe(value) -> str:
    """A value as a note quotes it: its JSON form, short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Notes:
    """The notes of one run: per file, the first `MAX_NOTES` problems and how many more there were."""

    def __init__(self):
        self.by_file: dict[str, list[str]] = {}

    def add(self, file: str, problem: str) -> None:
        self.by_file.setdefault(file, []).append(problem)

    def lines(self) -> list[str]:
        out = []
        for file, problems in self.by_file.items():
            shown = "; ".join(problems[:MAX_NOTES])
            more = f" (and {len(problems) - MAX_NOTES} more)" if len(problems) > MAX_NOTES else ""
            out.append(f"{file}: {shown}{more}")
        return out


def _read_text(path: Path, notes: _Notes) -> str | None:
    """A file's text (undecodable bytes replaced); None when it is absent or cannot be read (a note)."""
    if not path.exists():
        return None
    try:
        return path.read_text(errors="replace")
    except OSError as exc:
        notes.add(path.name, f"cannot be read ({exc.strerror or exc}); left out")
        return None


def _read_jsonl(path: Path, notes: _Notes) -> list[dict]:
    """Every line that is a JSON object with a whole-number ``step``; any other line is skipped with a note
    (a torn last line too: the run was killed in the middle of an append). Values beyond the float range
    are read as ±inf (`_clip`)."""
    text = _read_text(path, notes)
    out = []
    for number, line in enumerate((text or "").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            notes.add(path.name, f"line {number} is not JSON (a write cut short?); skipped")
            continue
        if not isinstance(record, dict):
            notes.add(path.name, f"line {number} is a JSON {type(record).__name__}, not an object; skipped")
            continue
        step = _step(record.get("step"))
        if step is None:
            what = "has no step" if "step" not in record else f"has step {_describe(record['step'])}"
            notes.add(path.name, f"line {number} {what}, not a whole number; skipped")
            continue
        out.append({**{k: _clip(v) for k, v in record.items()}, "step": step})
    return out


def _read_config(path: Path, notes: _Notes) -> dict:
    """config.yaml as a mapping ({} when it is absent or not one); a section of another shape is a note."""
    text = _read_text(path, notes)
    if text is None:
        return {}
    try:
        config = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        notes.add(path.name, f"not readable YAML ({reason}); the config is not shown")
        return {}
    if config is None:
        return {}
    if not isinstance(config, dict):
        notes.add(path.name, f"holds a {type(config).__name__}, not a mapping of settings; the config is not shown")
        return {}
    for name in SECTIONS:
        value = config.get(name)
        if value is not None and not isinstance(value, dict):
            notes.add(path.name, f"{name} is {_describe(value)}, not a mapping; its settings are not shown")
    return config


def _held_out(summary: dict, when: str, notes: _Notes) -> dict[str, float]:
    """summary.json's ``eval_before`` / ``eval_after`` as metric -> float (a non-finite one is NaN / inf)."""
    values = summary.get(when)
    if values is None:
        return {}
    if not isinstance(values, dict):
        notes.add("summary.json", f"{when} is {_describe(values)}, not a mapping; left out")
        return {}
    out = {}
    for key, value in values.items():
        if isinstance(value, str) and not is_finite(value):
            out[key] = float(value.strip().lower().replace("infinity", "inf"))
        elif _is_number(value):
            out[key] = float(_clip(value))
        else:
            notes.add("summary.json", f"{when}.{key} is {_describe(value)}, not a number; left out")
    return out


def _read_summary(path: Path, notes: _Notes) -> dict | None:
    """summary.json (a finished run's) with its fields checked: None when it is absent or unreadable; a
    field of the wrong type is left out with a note."""
    text = _read_text(path, notes)
    if text is None:
        return None
    try:
        summary = json.loads(text)
    except (ValueError, RecursionError):
        notes.add(path.name, "not JSON; the held-out results and versions are not shown")
        return None
    if not isinstance(summary, dict):
        notes.add(path.name, f"holds a JSON {type(summary).__name__}, not an object; not shown")
        return None
    summary = {**summary, "eval_before": _held_out(summary, "eval_before", notes)}
    summary["eval_after"] = _held_out(summary, "eval_after", notes)
    if "train_seconds" in summary and not (
        _is_number(summary["train_seconds"]) and abs(summary["train_seconds"]) < HUGE
    ):
        notes.add(path.name, f"train_seconds is {_describe(summary['train_seconds'])}, not a number; left out")
        del summary["train_seconds"]
    environment = summary.get("environment")
    if environment is not None and not isinstance(environment, dict):
        notes.add(path.name, f"environment is {_describe(environment)}, not a mapping; versions at report time shown")
        del summary["environment"]
    return summary


def _number_or_none(value):
    return _clip(value) if _is_number(value) else None


#: per-token lists of a logged sample (rollout_log): numbers, one per token
TOKEN_VALUES = ("ids", "logp", "logp_rollout", "entropy", "adv", "mask", "logp_ref")


def _clean_sample(sample, where: str, notes: _Notes) -> dict | None:
    """A logged sample the viewer can show: the fields rollout_log writes, each of its type (a field of another
    type is replaced: a number by null, text by its JSON form, a list by the values that fit); a sample that is
    not an object is None. A well-formed sample is returned unchanged."""
    if not isinstance(sample, dict):
        notes.add("rollouts.jsonl", f"{where} is {_describe(sample)}, not an object; skipped")
        return None
    out, bad = dict(sample), []
    tokens = sample.get("tokens")
    if not isinstance(tokens, list):
        bad.append("tokens")
        tokens = []
    out["tokens"] = [t if isinstance(t, str) else _describe(t) for t in tokens]
    if any(not isinstance(t, str) for t in tokens):
        bad.append("tokens")
    for key in TOKEN_VALUES:
        values = sample.get(key)
        if values is None and key in ("adv", "mask", "entropy", "logp_ref"):
            continue  # optional (an older run, no reference model)
        if not isinstance(values, list) or any(v is not None and not _is_number(v) for v in values):
            bad.append(key)
            values = values if isinstance(values, list) else []
            out[key] = [_number_or_none(v) for v in values]
    for key in ("group", "sample", "length"):
        if not (isinstance(sample.get(key), int) and not isinstance(sample.get(key), bool)):
            bad.append(key)
            out[key] = len(out["tokens"]) if key == "length" else None
    for key in ("reward", "advantage"):
        if sample.get(key) is not None and not _is_number(sample.get(key)):
            bad.append(key)
            out[key] = None
    for key in ("prompt", "finish_reason"):
        if not isinstance(sample.get(key, ""), str):
            bad.append(key)
            out[key] = _describe(sample.get(key))
    out.setdefault("prompt", "")
    out.setdefault("finish_reason", "")
    if bad:
        fields = ", ".join(dict.fromkeys(bad))
        notes.add("rollouts.jsonl", f"{where}: {fields} not of the type oxRL writes; shown as far as readable")
    return out


def _read_rollouts(path: Path, notes: _Notes) -> list[dict]:
    """rollouts.jsonl's lines with ``rewards`` a list of numbers (others null) and ``samples`` a list of
    cleaned samples (`_clean_sample`)."""
    out = []
    for record in _read_jsonl(path, notes):
        where = f"step {record['step']}"
        rewards = record.get("rewards")
        if rewards is not None and not isinstance(rewards, list):
            notes.add(path.name, f"{where}: rewards is {_describe(rewards)}, not a list; left out")
            rewards = None
        if rewards and any(v is not None and not _is_number(v) for v in rewards):
            count = sum(v is not None and not _is_number(v) for v in rewards)
            notes.add(path.name, f"{where}: {count} of the rewards are not numbers; left out of the distribution")
        samples = record.get("samples")
        if samples is not None and not isinstance(samples, list):
            notes.add(path.name, f"{where}: samples is {_describe(samples)}, not a list; left out")
            samples = None
        cleaned = [_clean_sample(s, f"{where}, sample {i + 1}", notes) for i, s in enumerate(samples or [])]
        out.append(
            {
                **record,
                "rewards": None if rewards is None else [_number_or_none(v) for v in rewards],
                "samples": [s for s in cleaned if s is not None],
            }
        )
    return out


def load_run(path: Path) -> RunData:
    """A run directory's files; a clear `OxrlError` when it is not one or has no readable metrics. A damaged
    file is a note (`RunData.notes`), never a failure: the report shows what it can."""
    path = Path(path)
    if not path.is_dir():
        raise OxrlError(f"{path}: not a directory (oxrl report reads run directories, e.g. runs/sgrpo-20261125-101500)")
    if not (path / "config.yaml").is_file() and not (path / "metrics.jsonl").is_file():
        raise OxrlError(f"{path}: not an oxRL run directory (no config.yaml, no metrics.jsonl)")
    notes = _Notes()
    records = _read_jsonl(path / "metrics.jsonl", notes)
    if not records:
        damaged = f" ({'; '.join(notes.lines())})" if notes.by_file.get("metrics.jsonl") else ""
        raise OxrlError(
            f"{path}: no metrics (metrics.jsonl is missing, empty or holds no readable step{damaged}: the run "
            "stopped before its first step)"
        )
    config = _read_config(path / "config.yaml", notes)
    summary = _read_summary(path / "summary.json", notes)
    error_log = _read_text(path / "error.log", notes) or ""
    rollouts = _read_rollouts(path / "rollouts.jsonl", notes)
    superseded = bool(error_log) and error_superseded(path)
    return RunData(path, path.resolve().name, config, records, summary, rollouts, error_log, superseded, notes.lines())


# ---------------------------------------------------------------------------------------------- SVG charts


def _esc(text) -> str:
    """Text from a run directory as HTML (element text or a quoted attribute): every value the page shows
    goes through here, whatever its type (a step, a metric's name, a config value, a directory's name)."""
    return html.escape(str(text), quote=True)


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


@dataclass
class Line:
    label: str
    color: str
    points: list[tuple[float, float]]  # (step, value); NaN = non-finite
    dash: str = ""
    markers: bool = False
    band: list[tuple[float, float, float]] | None = None  # (step, low, high): e.g. mean ± std


W, H, ML, MR, MT, MB = 420, 230, 58, 12, 10, 34


def line_chart(lines: list[Line], ylog: bool = False, xlabel: str = "step") -> str:
    """Lines (and bands) on shared axes as an <svg>; a non-finite value is a red × at the top edge."""
    xs = [x for ln in lines for x, _ in ln.points]
    ys = [y for ln in lines for _, y in ln.points if math.isfinite(y)]
    ys += [v for ln in lines for _, lo, hi in ln.band or () for v in (lo, hi) if math.isfinite(v)]
    if ylog:
        ys = [y for y in ys if y > 0]
    if not xs:
        return ""
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = (min(ys), max(ys)) if ys else ((1.0, 10.0) if ylog else (0.0, 1.0))  # no finite point: any axis
    tf = (lambda v: math.log10(v)) if ylog else (lambda v: v)
    y0, y1 = tf(y0), tf(y1)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - ML - MR, H - MT - MB

    def px(x: float) -> float:
        return ML + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return MT + (1 - (tf(y) - y0) / (y1 - y0)) * ph

    out = [f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    out.append(f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>')
    yticks = [10**t for t in _ticks(y0, y1, 4)] if ylog else _ticks(y0, y1, 4)
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ML - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{_fmt(t)}</text>')
    for t in _ticks(x0, x1, 5):
        x = px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT + ph}" y2="{MT + ph + 4}" stroke="#999"/>')
        out.append(f'<text x="{x:.1f}" y="{MT + ph + 15}" text-anchor="middle" font-size="10">{_fmt(t)}</text>')
    out.append(
        f'<text x="{ML + pw / 2}" y="{H - 4}" text-anchor="middle" font-size="10" fill="#555">{_esc(xlabel)}</text>'
    )
    for ln in lines:
        if ln.band:
            pts = [(x, lo, hi) for x, lo, hi in ln.band if math.isfinite(lo) and math.isfinite(hi)]
            if ylog:
                pts = [(x, lo, hi) for x, lo, hi in pts if lo > 0]
            if pts:
                upper = " ".join(f"{px(x):.1f},{py(hi):.1f}" for x, _, hi in pts)
                lower = " ".join(f"{px(x):.1f},{py(lo):.1f}" for x, lo, _ in reversed(pts))
                out.append(f'<polygon points="{upper} {lower}" fill="{ln.color}" fill-opacity="0.15" stroke="none"/>')
    for ln in lines:
        segment: list[str] = []
        segments = [segment]
        for x, y in ln.points:
            if math.isfinite(y) and (not ylog or y > 0):
                segment.append(f"{px(x):.1f},{py(y):.1f}")
            else:
                segment = []
                segments.append(segment)
                out.append(
                    f'<text x="{px(x):.1f}" y="{MT + 10}" text-anchor="middle" font-size="12" fill="#d00" '
                    f'class="nonfinite"><title>{_esc(ln.label)}: not finite at step {x:g}</title>×</text>'
                )
        dash = f' stroke-dasharray="{ln.dash}"' if ln.dash else ""
        for seg in segments:
            if len(seg) > 1:
                out.append(
                    f'<polyline points="{" ".join(seg)}" fill="none" stroke="{ln.color}" stroke-width="1.6"{dash}/>'
                )
            if len(seg) == 1 or ln.markers:
                for p in seg:
                    cx, cy = p.split(",")
                    out.append(f'<circle cx="{cx}" cy="{cy}" r="2.6" fill="{ln.color}"/>')
    out.append("</svg>")
    return "".join(out)


def heatmap(columns: list[tuple[int, list[float]]]) -> str:
    """The distribution of values at each logged step: one column per step, one row per value bin, the
    cell's shade the share of samples in it (a reward with few distinct values gets one row per value)."""
    values = sorted({v for _, col in columns for v in col if v is not None and math.isfinite(v)})
    if not values:
        return ""
    if len(values) <= 12:
        bins = [(v, v) for v in values]
    else:
        lo, hi = values[0], values[-1]
        edges = [lo + (hi - lo) * i / 10 for i in range(11)]
        bins = list(zip(edges[:-1], edges[1:]))

    def which(v: float) -> int:
        for k, (a, b) in enumerate(bins):
            if (a == b and v == a) or (a <= v <= b if k == len(bins) - 1 else a <= v < b):
                return k
        return len(bins) - 1

    pw, ph = W - ML - MR, H - MT - MB
    cw, ch = pw / len(columns), ph / len(bins)
    out = [f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    for c, (step, col) in enumerate(columns):
        finite = [v for v in col if v is not None and math.isfinite(v)]
        counts = [0] * len(bins)
        for v in finite:
            counts[which(v)] += 1
        for k, count in enumerate(counts):
            share = count / len(finite) if finite else 0
            x, y = ML + c * cw, MT + (len(bins) - 1 - k) * ch
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw + 0.5:.1f}" height="{ch + 0.5:.1f}" '
                f'fill="rgb(31,119,180)" fill-opacity="{share:.3f}"><title>step {_esc(step)}: {share:.0%} of '
                f"{len(finite)} samples in {_fmt(bins[k][0])}–{_fmt(bins[k][1])}</title></rect>"
            )
        if len(columns) <= 12 or c % max(1, len(columns) // 8) == 0:
            out.append(
                f'<text x="{ML + (c + 0.5) * cw:.1f}" y="{MT + ph + 15}" text-anchor="middle" font-size="10">{_esc(step)}</text>'
            )
    for k, (a, b) in enumerate(bins):
        label = _fmt(a) if a == b else f"{_fmt(a)}–{_fmt(b)}"
        y = MT + (len(bins) - 1 - k + 0.5) * ch + 4
        if len(bins) <= 12:
            out.append(f'<text x="{ML - 4}" y="{y:.1f}" text-anchor="end" font-size="10">{label}</text>')
    out.append(f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 4}" text-anchor="middle" font-size="10" fill="#555">step</text>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------- which curves


@dataclass(frozen=True)
class Plot:
    id: str
    title: str
    keys: tuple[str, ...]  # metric keys; a key ending in "/" means every key with that prefix
    note: str = ""
    ylog: bool = False
    band: str = ""  # the key of a ± band around the first key (reward/std around reward/mean)


PLOTS = (
    Plot("loss", "Loss", ("loss", "loss/"), "the training loss and its parts"),
    Plot("reward", "Reward (mean ± std over the rollout batch)", ("reward/mean",), band="reward/std"),
    Plot("heldout", "Held-out metrics", ("eval/",), "every evaluation (train.eval_every) and the last step"),
    Plot("rewards_pref", "Implicit rewards (preference)", ("rewards/chosen", "rewards/rejected", "rewards/margins")),
    Plot("pair_acc", "Pair accuracy (chosen scored above rejected)", ("rewards/accuracies",)),
    Plot("logps", "Log-probabilities of chosen / rejected", ("logps/",)),
    Plot("kl", "KL to the reference", ("kl/",)),
    Plot("entropy", "Entropy (nats / token)", ("entropy",)),
    Plot("length", "Response length (tokens)", ("response/length",)),
    Plot("clipped", "Share of completions cut at max_new_tokens", ("response/clipped",)),
    Plot("logprob_diff", "Trainer–rollout logprob gap", ("rollout/logprob_diff", "rollout/logprob_diff_max"), ylog=True),
    Plot("reward_failures", "Reward errors / timeouts (rows)", ("reward/errors", "reward/timeouts", "env/errors", "env/timeouts")),
    Plot("grad_norm", "Gradient norm (before clipping)", ("grad_norm",)),
    Plot("lr", "Learning rate", ("lr",)),
    Plot("tokens_per_s", "Throughput (tokens / s)", ("perf/tokens_per_s",)),
    Plot("mfu", "MFU (model FLOPs utilisation)", ("perf/mfu",)),
)  # fmt: skip


def _keys_of(plot: Plot, runs: list[RunData]) -> list[str]:
    present: list[str] = []
    for run in runs:
        for r in run.records:
            for key in r:
                if key in present or key == "step" or isinstance(r[key], (bool, list, dict)):
                    continue
                if any(key == k or (k.endswith("/") and key.startswith(k)) for k in plot.keys):
                    present.append(key)
    order = {k: i for i, k in enumerate(plot.keys)}
    return sorted(present, key=lambda k: (order.get(k, len(order)), k))


#: the most points a curve draws: a longer run keeps each bucket's lowest and highest value (spikes stay visible)
MAX_POINTS = 1200


def thin(points: list[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most about ``limit`` points of a curve: per bucket of steps its min and max, in step order, and
    every non-finite point."""
    if len(points) <= limit:
        return points
    size = -(-2 * len(points) // limit)
    out = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        finite = [p for p in bucket if math.isfinite(p[1])]
        keep = {min(finite, key=lambda p: p[1]), max(finite, key=lambda p: p[1])} if finite else set()
        out += sorted(keep | {p for p in bucket if not math.isfinite(p[1])})
    return out


def _lines(keys: list[str], runs: list[RunData], band: str = "", with_before: bool = False) -> list[Line]:
    lines = []
    dashes = ("", "5,3", "2,2", "8,3,2,3")
    for r, run in enumerate(runs):
        for k, key in enumerate(keys):
            points = [(float(s), v) for s, v in series(run.records, key)]
            if with_before and run.summary and key in (run.summary.get("eval_before") or {}):
                before = run.summary["eval_before"][key]
                points = [(0.0, float(before) if is_finite(before) else math.nan)] + points
            if not points:
                continue
            if len(runs) > 1:  # a colour per run, a dash per metric
                color, dash = PALETTE[r % len(PALETTE)], dashes[k % len(dashes)]
                label = f"{run.name}: {key}"
            else:
                color, dash, label = PALETTE[k % len(PALETTE)], "", key
            spread = None
            if band and k == 0:
                std = dict(series(run.records, band))
                spread = [(x, y - std.get(int(x), math.nan), y + std.get(int(x), math.nan)) for x, y in points]
            sparse = len(points) < 0.5 * max(len(run.records), 1) or len(points) <= 3
            if spread is not None and len(spread) > MAX_POINTS:
                spread = spread[:: -(-len(spread) // MAX_POINTS)]
            lines.append(Line(label, color, thin(points), dash, markers=sparse, band=spread))
    return lines


def _colour_class(colour: str) -> str:
    """The CSS class of a palette colour (``c0``, ``c1``, ...): the page has no ``style`` attribute, so that
    its Content-Security-Policy can allow only the one stylesheet."""
    return f"c{PALETTE.index(colour)}"


def _figure(title: str, svg: str, lines: list[Line], note: str = "", fid: str = "", eid: str = "") -> str:
    """One plot: ``fid`` names its kind (``data-plot``), ``eid`` (default ``fid``) its element id."""
    legend = "".join(
        f'<span class="key"><span class="swatch {_colour_class(ln.color)}"></span>{_esc(ln.label)}'
        f"{' (dashed)' if ln.dash else ''}</span>"
        for ln in lines
    )
    note = f'<div class="note">{_esc(note)}</div>' if note else ""
    return (
        f'<figure class="plot" id="plot-{_esc(eid or fid)}" data-plot="{_esc(fid)}"><figcaption>{_esc(title)}</figcaption>'
        f'{svg}<div class="legend">{legend}</div>{note}</figure>'
    )


def _plots(runs: list[RunData]) -> tuple[str, list[str]]:
    """The family's curves, then every other numeric metric; returns the HTML and the plot ids drawn."""
    shown, parts, ids = set(), [], []
    for plot in PLOTS:
        keys = _keys_of(plot, runs)
        if not keys:
            continue
        shown.update(keys)
        if plot.band:
            shown.add(plot.band)
        if plot.id == "heldout":  # one plot per held-out metric: their scales differ (a loss, an accuracy)
            headline = [k for k, _ in HEADLINE]
            for key in sorted(keys, key=lambda k: (headline.index(k) if k in headline else len(headline), k)):
                lines = _lines([key], runs, with_before=True)
                title = f"Held-out {key.removeprefix('eval/')} (step 0 = before training)"
                parts.append(_figure(title, line_chart(lines), lines, plot.note, plot.id, f"heldout-{key}"))
                ids.append(plot.id)
            continue
        lines = _lines(keys, runs, plot.band)
        if not lines:
            continue
        positive = all(y > 0 for ln in lines for _, y in ln.points if math.isfinite(y))
        svg = line_chart(lines, ylog=plot.ylog and positive)
        parts.append(
            _figure(plot.title + (" (log scale)" if plot.ylog and positive else ""), svg, lines, plot.note, plot.id)
        )
        ids.append(plot.id)
        if plot.id == "reward":
            dist = _reward_distribution(runs)
            if dist:
                parts.append(dist)
                ids.append("reward_distribution")
    rest = sorted(
        {
            k
            for run in runs
            for r in run.records
            for k, v in r.items()
            if k != "step"
            and k not in shown
            and isinstance(v, (int, float, str))
            and not isinstance(v, bool)
            and (not isinstance(v, str) or not is_finite(v))
        }
    )
    others = []
    for key in rest:
        lines = _lines([key], runs)
        if lines:
            others.append(_figure(key, line_chart(lines), lines, fid="other-" + key))
            ids.append("other-" + key)
    html_out = '<div class="grid">' + "".join(parts) + "</div>"
    if others:
        html_out += (
            f"<details><summary>Every other logged metric ({len(others)})</summary>"
            f'<div class="grid">{"".join(others)}</div></details>'
        )
    return html_out, ids


def _reward_distribution(runs: list[RunData]) -> str:
    """Each RL run's reward distribution over the steps rollouts.jsonl logged (every sample of the batch)."""
    figures = []
    for run in runs:
        columns = [(int(r["step"]), r["rewards"]) for r in run.rollouts if isinstance(r.get("rewards"), list)]
        svg = heatmap(columns) if columns else ""
        if svg:
            title = "Reward distribution over time" + (f" — {run.name}" if len(runs) > 1 else "")
            note = "shade = share of the rollout batch's samples with that reward, at each step rollouts.jsonl logged"
            figures.append(_figure(title, svg, [], note, "reward_distribution"))
    return "".join(figures)


# ---------------------------------------------------------------------------------------------- the page


def _data_text(run: RunData) -> str:
    train = run.section("data").get("train")
    if not train:
        return "the built-in arithmetic task"
    items = train if isinstance(train, list) else [train]
    return ", ".join(
        str(item.get("name") or item.get("path") or item) if isinstance(item, dict) else str(item) for item in items
    )


def _overview(run: RunData) -> str:
    cfg = run.config
    model = run.section("model").get("name") or "the built-in tiny model"
    train = run.section("train")
    last = run.records[-1]
    steps = f"{last.get('step')} of {run.max_steps}" if run.max_steps else str(last.get("step"))
    env = (run.summary or {}).get("environment")
    versions = env or current_versions()
    where = "recorded by the run" if env else "at report time (the run recorded none)"
    rows = [
        ("run directory", str(run.path.resolve())),
        ("algorithm", f"{cfg.get('algorithm', '?')} ({run.family})"),
        ("model", model),
        ("data", _data_text(run)),
        ("steps", steps),
        ("batch size · lr", f"{train.get('batch_size', '?')} · {train.get('lr', '?')}"),
    ]
    if run.family == "rl":
        ro = run.section("rollout")
        rows.append(("rollouts", f"n={ro.get('n')} · max_new_tokens={ro.get('max_new_tokens')} · "
                                 f"temperature={ro.get('temperature')} · backend={ro.get('backend')}"))  # fmt: skip
        rows.append(("reward", str(run.section("reward").get("name") or "the dataset's default")))
    if run.summary and "train_seconds" in run.summary:  # (a number: `_read_summary` checked it)
        rows.append(("training time", f"{run.summary['train_seconds']:.1f} s"))
    rows.append((f"versions ({where})", " · ".join(f"{k} {v}" for k, v in versions.items())))
    body = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _held_out_table(run: RunData) -> str:
    if not run.summary:
        return ""
    before, after = run.summary.get("eval_before") or {}, run.summary.get("eval_after") or {}
    keys = list(dict.fromkeys([*before, *after]))
    if not keys:
        return ""

    def cell(d: dict, k: str) -> str:
        v = d.get(k)
        return "–" if v is None else (f"{v:.4f}" if isinstance(v, (int, float)) else _esc(v))

    body = "".join(f"<tr><td>{_esc(k)}</td><td>{cell(before, k)}</td><td>{cell(after, k)}</td></tr>" for k in keys)
    return '<table class="heldout"><tr><th>held-out metric</th><th>before</th><th>after</th></tr>' + body + "</table>"


def _error_log(run: RunData) -> str:
    """error.log's last lines: the run's failure, or — when the run finished after it (`error_superseded`, as
    `oxrl bug-report` decides) — an earlier failure, said to be one."""
    if not run.error_log:
        return ""
    tail = redact("\n".join(run.error_log.splitlines()[-60:]), secret_values(_config_text(run, redacted=False)))
    what = (
        "an earlier failure: the run finished after it (summary.json is newer), e.g. after --resume"
        if run.error_superseded
        else "the run's failure"
    )
    return (
        f'<details class="error-log"><summary>error.log ({what})</summary>'
        f"<pre class='config'>{_esc(tail)}</pre></details>"
    )


def _notes(run: RunData) -> str:
    """What was damaged in the run directory (`RunData.notes`): the report shows the rest."""
    if not run.notes:
        return ""
    items = "".join(f'<li class="warning damaged">{_esc(note)}</li>' for note in run.notes)
    return (
        '<h3>Damaged files</h3><p class="note">These parts of the run directory could not be read as oxRL writes '
        f'them; the report shows everything else.</p><ul class="findings notes">{items}</ul>'
    )


def _config_text(run: RunData, redacted: bool = True) -> str:
    """config.yaml as shown: credentials redacted (a report is made to be shared), as `oxrl bug-report` does."""
    try:
        text = yaml.safe_dump(run.config, sort_keys=False, allow_unicode=True)
    except (yaml.YAMLError, RecursionError, ValueError, TypeError):  # a shape safe_load made but safe_dump refuses
        text = json.dumps(run.config, indent=2, default=repr)
    return redact(text) if redacted else text


def _findings(findings: list[Finding]) -> str:
    if not findings:
        return '<p class="ok">No warnings: nothing in the metrics looks wrong.</p>'
    items = "".join(
        f'<li class="{_esc(f.level)}" data-code="{_esc(f.code)}"><b>{_esc(f.level)}</b> {_esc(f.message)}</li>'
        for f in findings
    )
    return f'<ul class="findings">{items}</ul>'


def _viewer_data(run: RunData) -> list[dict]:
    """The logged rollout steps the viewer embeds: at most MAX_VIEWER_STEPS, evenly spaced, first and last kept."""
    logged = [r for r in run.rollouts if isinstance(r.get("samples"), list) and r["samples"]]
    if len(logged) > MAX_VIEWER_STEPS:
        picks = sorted({round(i * (len(logged) - 1) / (MAX_VIEWER_STEPS - 1)) for i in range(MAX_VIEWER_STEPS)})
        logged = [logged[i] for i in picks]
    return [{"step": r["step"], "samples": r["samples"]} for r in logged]


def _json_for_script(value) -> str:
    """JSON safe inside a ``<script type="application/json">`` element: no NaN (null instead), and no ``<``,
    ``>`` or ``&`` (written ``\\u003c`` ...), so that no value (``</script>``, ``<!--``) can close the element or
    change how the HTML parser reads it; ``ensure_ascii`` writes U+2028 / U+2029 escaped too. ``JSON.parse``
    reads the same values back."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    text = json.dumps(clean(value), ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


VIEWER_SCRIPT = r"""
(function () {
  "use strict";
  var QUANTITIES = {
    logp: {label: "logprob (trainer)", kind: "seq"},
    gap: {label: "trainer − rollout logprob gap", kind: "div"},
    entropy: {label: "entropy", kind: "seq"},
    adv: {label: "advantage", kind: "div"},
    mask: {label: "loss mask", kind: "mask"},
    kl: {label: "KL to the reference (k3)", kind: "seq"}
  };
  // data reaches the page only as text (textContent, title, value): never as HTML
  function at(list, i) {
    var v = list ? list[i] : null;
    return typeof v === "number" && isFinite(v) ? v : null;
  }
  function values(s, q) {
    var n = s.tokens.length, out = [], i;
    for (i = 0; i < n; i++) {
      var v = null, lp = at(s.logp, i);
      if (q === "gap") { v = (lp === null || at(s.logp_rollout, i) === null) ? null : lp - at(s.logp_rollout, i); }
      else if (q === "kl") {
        if (lp !== null && at(s.logp_ref, i) !== null) {
          var d = at(s.logp_ref, i) - lp; v = Math.exp(d) - d - 1;
        }
      }
      else { v = at(s[q], i); }
      out.push(v);
    }
    return out;
  }
  function colour(v, kind, scale) {
    if (v === null || v === undefined) { return "#eee"; }
    if (kind === "mask") { return v > 0 ? "rgba(44,160,44,0.35)" : "rgba(150,150,150,0.35)"; }
    var t = scale > 0 ? Math.min(Math.abs(v) / scale, 1) : 0;
    if (kind === "div") { return v >= 0 ? "rgba(44,160,44," + (0.08 + 0.8 * t).toFixed(3) + ")" : "rgba(214,39,40," + (0.08 + 0.8 * t).toFixed(3) + ")"; }
    return "rgba(31,119,180," + (0.08 + 0.8 * t).toFixed(3) + ")";
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function fmt(v) { return typeof v !== "number" || !isFinite(v) ? "–" : (Math.abs(v) < 1e-3 && v !== 0 ? v.toExponential(2) : v.toFixed(4)); }
  function ordinal(v) { return typeof v === "number" ? String(v + 1) : "?"; }
  function render(viewer, runData) {
    var step = viewer.querySelector("select.step").value;
    var q = viewer.querySelector("select.quantity").value;
    var out = viewer.querySelector(".samples");
    while (out.firstChild) { out.removeChild(out.firstChild); }
    var entry = null, i;
    for (i = 0; i < runData.length; i++) { if (String(runData[i].step) === step) { entry = runData[i]; } }
    if (!entry) { return; }
    var all = [];
    entry.samples.forEach(function (s) { values(s, q).forEach(function (v) { if (v !== null) { all.push(Math.abs(v)); } }); });
    var scale = all.length ? Math.max.apply(null, all) : 1;
    if (q === "logp") { scale = Math.max(scale, 1e-6); }
    var kind = QUANTITIES[q].kind;
    viewer.querySelector(".scale").textContent = QUANTITIES[q].label + ": " + (kind === "mask"
      ? "green = trained on (the model's tokens), grey = not (an environment's tokens)"
      : (kind === "div" ? "green = positive, red = negative" : "blue") + ", the darker the larger |value| (largest here " + fmt(scale) + ")");
    entry.samples.forEach(function (s) {
      var box = el("div", "sample");
      var head = el("div", "head", "prompt " + ordinal(s.group) + ", sample " + ordinal(s.sample) + " · reward " + fmt(s.reward) +
        " · advantage " + fmt(s.advantage) + " · " + s.length + " tokens (" + s.finish_reason + ")");
      box.appendChild(head);
      box.appendChild(el("pre", "prompt", s.prompt));
      var comp = el("div", "completion");
      var vals = values(s, q);
      s.tokens.forEach(function (piece, j) {
        var t = el("span", "tok", piece);
        t.style.background = colour(vals[j], QUANTITIES[q].kind, scale);
        t.title = "token " + at(s.ids, j) + " " + JSON.stringify(piece) + "\n" + QUANTITIES[q].label + ": " + fmt(vals[j]) +
          "\nlogprob " + fmt(at(s.logp, j)) + " · rollout " + fmt(at(s.logp_rollout, j)) + " · entropy " + fmt(at(s.entropy, j)) +
          " · mask " + (at(s.mask, j) === null ? "–" : String(at(s.mask, j)));
        comp.appendChild(t);
      });
      if (typeof s.length === "number" && s.length > s.tokens.length) { comp.appendChild(el("span", "more", " … " + (s.length - s.tokens.length) + " more tokens not logged")); }
      box.appendChild(comp);
      out.appendChild(box);
    });
  }
  document.querySelectorAll(".viewer").forEach(function (viewer) {
    var runData = JSON.parse(document.getElementById(viewer.getAttribute("data-source")).textContent);
    var qs = viewer.querySelector("select.quantity");
    Object.keys(QUANTITIES).forEach(function (k) {
      if (k === "kl" && !(runData.length && runData[0].samples.length && runData[0].samples[0].logp_ref)) { return; }
      if (k === "adv" && !(runData.length && runData[0].samples.length && runData[0].samples[0].adv)) { return; }
      var o = el("option", "", QUANTITIES[k].label); o.value = k; qs.appendChild(o);
    });
    viewer.querySelectorAll("select").forEach(function (s) { s.addEventListener("change", function () { render(viewer, runData); }); });
    render(viewer, runData);
  });
})();
"""


def _viewer(run: RunData, index: int, several: bool) -> str:
    data = _viewer_data(run)
    if not data:
        return ""
    source = f"rollouts-{index}"
    steps = "".join(f'<option value="{_esc(d["step"])}">step {_esc(d["step"])}</option>' for d in data)
    return (
        f'<section class="viewer" data-source="{source}"><h3>Rollouts{" — " + _esc(run.name) if several else ""}</h3>'
        '<p class="note">Prompts and completions rollouts.jsonl logged (logging.rollout_samples_every): each token '
        "coloured by the quantity chosen below; hover a token for all its values.</p>"
        f'<label>step <select class="step">{steps}</select></label> '
        '<label>colour by <select class="quantity"></select></label>'
        '<div class="scale note"></div><div class="samples"></div>'
        f'<script type="application/json" id="{source}">{_json_for_script(data)}</script></section>'
    )


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em auto;max-width:1400px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}th,td{text-align:left;padding:.2em .8em;border-bottom:1px solid #eee;
vertical-align:top}table.kv th{width:14em;color:#555;font-weight:600}
.grid{display:flex;flex-wrap:wrap;gap:12px}.plot{margin:0;width:422px;border:1px solid #e5e5e5;border-radius:6px;padding:6px;
background:#fafafa}.plot figcaption{font-weight:600;font-size:.9em;margin-bottom:4px}
.legend{font-size:.75em}.key{margin-right:.8em;white-space:nowrap}
.swatch{display:inline-block;width:10px;height:10px;margin-right:3px;border-radius:2px}
.note{font-size:.75em;color:#666;max-width:440px}
ul.findings{padding-left:1.2em}li.error{color:#b00}li.warning{color:#a60}p.ok{color:#080}
details{margin-top:1em}summary{cursor:pointer;font-weight:600}
.sample{border:1px solid #ddd;border-radius:6px;margin:.6em 0;padding:.5em;background:#fff}
.sample .head{font-size:.85em;color:#444;margin-bottom:.3em}
pre.prompt{white-space:pre-wrap;background:#f4f4f4;margin:.2em 0;padding:.3em;font-size:.8em;max-height:12em;overflow:auto}
.completion{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85em;white-space:pre-wrap;line-height:1.7}
.tok{border-radius:2px;padding:1px 0;margin-right:1px}.more{color:#888}
pre.config{background:#f6f6f6;padding:.6em;font-size:.8em;max-height:30em;overflow:auto}
""" + "".join(f".swatch.c{i}{{background:{colour}}}" for i, colour in enumerate(PALETTE))


def _sha256_source(text: str) -> str:
    """A CSP source that allows exactly the inline element whose content is ``text``."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


#: what the page may load and run: its own stylesheet and script (by hash), images only as data: URLs, and
#: nothing else — no other script (an injected <script>, an onerror= attribute, a javascript: URL), no
#: network, no form, no <base>. Set by a <meta> tag: the file opens from disk, with no server to send a header.
CSP = "; ".join(
    [
        "default-src 'none'",
        f"script-src {_sha256_source(VIEWER_SCRIPT)}",
        f"style-src {_sha256_source(STYLE)}",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
    ]
)


def render_report(runs: list[RunData]) -> str:
    """The whole HTML page (a string) for one or more runs."""
    names = ", ".join(run.name for run in runs)
    sections = []
    for i, run in enumerate(runs):
        findings = check_run(run.records, run.summary, run.max_steps, run.error)
        title = f"{run.name}" if len(runs) > 1 else "The run"
        sections.append(
            f'<section class="run" id="run-{i}"><h2>{_esc(title)}</h2>{_overview(run)}'
            f"{_notes(run)}<h3>Warnings</h3>{_findings(findings)}"
            f"{_held_out_table(run)}"
            f"{_error_log(run)}"
            f"<details><summary>Resolved config (config.yaml)</summary><pre class='config'>"
            f"{_esc(_config_text(run))}</pre></details></section>"
        )
    plots, _ = _plots(runs)
    viewers = "".join(_viewer(run, i, len(runs) > 1) for i, run in enumerate(runs))
    viewer_part = f"<h2>Rollout viewer</h2>{viewers}<script>{VIEWER_SCRIPT}</script>" if viewers else ""
    overlay = f" ({len(runs)} runs overlaid: a colour per run)" if len(runs) > 1 else ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_esc(CSP)}">'
        f"<title>oxRL report: {_esc(names)}</title><style>{STYLE}</style></head><body>"
        f"<h1>oxRL report: {_esc(names)}</h1>"
        + "".join(sections)
        + f"<h2>Curves{overlay}</h2>{plots}"
        + viewer_part
        + "</body></html>\n"
    )


def write_report(run_dirs: list[Path], output: Path) -> Path:
    """Read the run directories (an `OxrlError` for a bad one), write the report atomically, return its path.
    What a damaged file left out is said on stderr too (a ``note:`` line per file), not only in the page."""
    runs = [load_run(Path(d)) for d in run_dirs]
    output = Path(output)
    if output.parent and not output.parent.exists():
        raise OxrlError(f"-o {output}: the folder {output.parent} does not exist")
    write_text_atomic(output, render_report(runs))
    for run in runs:
        for note in run.notes:
            print(f"note: {run.path}/{note}", file=sys.stderr, flush=True)
    return output
