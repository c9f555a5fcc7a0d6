"""Reading a run directory for `oxrl report`, defensively: ``config.yaml``, ``metrics.jsonl``, ``summary.json``,
``error.log`` and ``rollouts.jsonl`` into a `RunData`. Every file is treated as hostile: a value of the wrong shape
(a step that is not a number, a config that is a list, a summary that is not an object, a torn line) becomes a
note ("Damaged files"), never a crash.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from oxrl_core.errors import OxrlError
from oxrl_core.observability.health import error_superseded, is_finite

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


#: what a logged image may be (rollout_log writes PNG): a base64 data URI of a raster image and nothing else (no
#: ``javascript:`` or http URL, no quote or angle bracket); the viewer's script checks the same before ``img.src``
IMAGE_SRC = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=]+")


def _clean_images(sample: dict, out: dict, where: str, notes: _Notes) -> None:
    """A logged sample's ``images`` (an image run's; absent in a text run): only the strings `IMAGE_SRC` matches
    whole are kept, the others left out with a note. ``env_images`` (an environment's, in a multi-turn run): only
    the ``{"turn", "image"}`` objects whose image `IMAGE_SRC` matches whole are kept, each as just those two keys
    (a turn that is not a count as null), the others left out with a note. ``images_left_out`` and
    ``env_images_left_out`` (how many images the log's bound left out) are kept only where they are counts."""
    for key in ("images", "env_images"):
        values = sample.get(key)
        if isinstance(values, list):
            out[key] = [entry for entry in (_image_entry(key, v) for v in values) if entry is not None]
            if len(out[key]) < len(values):
                dropped = f"{len(values) - len(out[key])} of the {key} are not"
                kind = "a data: URI" if key == "images" else 'a {"turn", "image"} object with a data: URI'
                notes.add("rollouts.jsonl", f"{where}: {dropped} {kind} of a PNG, JPEG, GIF or WebP image; left out")
            if key == "env_images" and any(e["turn"] is None for e in out[key]):
                notes.add("rollouts.jsonl", f"{where}: an env_images turn is not a count; shown without its turn")
        elif values is not None:
            notes.add("rollouts.jsonl", f"{where}: {key} is {_describe(values)}, not a list; left out")
            out[key] = []
        left = sample.get(f"{key}_left_out")
        if left is not None and not _is_count(left):
            notes.add("rollouts.jsonl", f"{where}: {key}_left_out is {_describe(left)}, not a count; left out")
            del out[f"{key}_left_out"]


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**15


def _image_entry(key: str, value):
    """A logged image as the viewer may show it, or None: in ``images`` a string `IMAGE_SRC` matches whole; in
    ``env_images`` an object whose ``image`` is such a string, as ``{"turn": a count or None, "image"}``."""
    if key == "images":
        return value if isinstance(value, str) and IMAGE_SRC.fullmatch(value) else None
    if isinstance(value, dict) and isinstance(value.get("image"), str) and IMAGE_SRC.fullmatch(value["image"]):
        return {"turn": value["turn"] if _is_count(value.get("turn")) else None, "image": value["image"]}
    return None


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
    _clean_images(sample, out, where, notes)
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
