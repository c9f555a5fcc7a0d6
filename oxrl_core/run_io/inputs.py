"""What the Python API takes beside names and paths: rows held in memory (a list of row dicts or a
`datasets.Dataset`) and an already-loaded transformers model with its tokenizer.

A run's config names its data and model so that ``config.yaml`` says what was trained and ``--resume`` finds
it again; so in-memory inputs are written into the run directory when the run starts (``inputs/train.jsonl``,
``inputs/eval.jsonl``, ``inputs/model/``) and the config names those files. Until then (while `Trainer`
checks the config, before the run directory exists) the config holds a placeholder such as
``<in-memory: 120 rows>``. Rows are turned into JSON lines at once, so a value JSON cannot hold is refused
before anything is written.

Every local path a config names is made absolute before ``config.yaml`` is written (`absolute_paths`): the
``inputs/`` files, and relative paths given on the command line, in a config file or to the API, resolved
against the working directory the run started in, which is what they meant then. So ``--resume`` reads the
same files from any working directory. Absolute rather than relative to the run directory because a path the
user gave points outside it (data, models), and every reader of config.yaml (``--resume``, the data-parallel
ranks, ``oxrl report``, ``oxrl bug-report``) then reads it as it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oxrl_core.atomic import write_text_atomic
from oxrl_core.chat_templates import TEMPLATES
from oxrl_core.errors import OxrlError

INPUTS_DIR = "inputs"
PLACEHOLDER = "<in-memory"


#: fields of the row formats: a dict holding one is a row even if it has a ``source`` column too
ROW_FIELDS = {"prompt", "response", "messages", "chosen", "rejected", "completion", "label", "text"}


def _is_source_spec(item: Any) -> bool:
    """A ``{source, ratio, <plugin options>}`` mapping of data.train (not a row that has a `source` column)."""
    return isinstance(item, dict) and "source" in item and not (set(item) & ROW_FIELDS)


def is_rows(value: Any) -> bool:
    """A `datasets.Dataset`, or a non-empty list / tuple of row dicts (none a ``{source, ratio}`` mapping)."""
    if _is_hf_dataset(value):
        return True
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(item, dict) for item in value)
        and not any(_is_source_spec(item) for item in value)
    )


def _is_hf_dataset(value: Any) -> bool:
    return type(value).__module__.startswith("datasets.") and type(value).__name__ in ("Dataset", "DatasetDict")


def is_loaded_model(value: Any) -> bool:
    """A model object (anything with ``save_pretrained`` that is not a name or a section mapping)."""
    return not isinstance(value, (str, Path, dict)) and value is not None and hasattr(value, "save_pretrained")


def rows_as_jsonl(value: Any, field: str) -> tuple[str, int]:
    """The rows as JSONL text and their count; a row that is not a mapping of JSON values names its index."""
    if type(value).__name__ == "DatasetDict":
        raise OxrlError(
            f"{field}: a DatasetDict holds several splits ({', '.join(value)}); pass one each: "
            "data=ds['train'], eval_data=ds['test']"
        )
    rows = value.to_list() if _is_hf_dataset(value) else list(value)
    if not rows:
        raise OxrlError(f"{field}: the rows are empty")
    lines = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise OxrlError(f"{field}: row {i}: expected a dict of fields, got {type(row).__name__}")
        try:
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise OxrlError(
                f"{field}: row {i}: a value cannot be stored as JSON ({exc}); rows hold strings, numbers, booleans, "
                "lists and dicts"
            ) from None
    return "".join(line + "\n" for line in lines), len(rows)


@dataclass
class Inputs:
    """The in-memory inputs of one `Trainer`: ``rows[section] = (jsonl text, count)`` and the model pair."""

    rows: dict[str, tuple[str, int]] = field(default_factory=dict)
    model: Any = None
    tokenizer: Any = None

    def placeholder(self, section: str) -> str:
        if section == "model":
            return f"{PLACEHOLDER}: {type(self.model).__name__}>"
        return f"{PLACEHOLDER}: {self.rows[section][1]} rows>"

    def path(self, run_dir: Path, section: str) -> Path:
        """Where ``section`` is written: an absolute path (config.yaml names it, read from any directory)."""
        return Path(os.path.abspath(run_dir)) / INPUTS_DIR / ("model" if section == "model" else f"{section}.jsonl")

    def write(self, run_dir: Path, resume: bool) -> dict[str, str]:
        """Write the inputs into ``run_dir/inputs/``; returns ``{"model" | "train" | "eval": path}``.

        On --resume the files are already there: rows must be the ones the run trained on (else a refusal), the
        model directory is kept as it is (the checkpoint holds the trained weights)."""
        written = {}
        for section, (text, count) in self.rows.items():
            path = self.path(run_dir, section)
            if resume and path.is_file():
                if path.read_text(encoding="utf-8") != text:
                    raise OxrlError(
                        f"--resume: the {count} in-memory {section} rows differ from those {run_dir} trained on "
                        f"({path}); pass the same rows, or nothing and data.{section}={path}"
                    )
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(path, text)
            written[section] = str(path)
        if self.model is not None:
            path = self.path(run_dir, "model")
            if not (resume and (path / "config.json").is_file()):
                self.model.save_pretrained(path)
                self.tokenizer.save_pretrained(path)
            written["model"] = str(path)
        return written


# ----------------------------------------------------------------------------- paths in config.yaml

#: config fields that may name a local file or directory (else a hub id, a dataset plugin, a built-in template).
#: Plugins given as ``file.py:Class`` (algorithm, reward.name, env.name, env.tool_parser) are left as written: their
#: name is how messages, metrics and reports refer to them
PATH_FIELDS = (
    "model.name",
    "model.ref",
    "model.teacher",
    "model.chat_template",
    "data.train",
    "data.eval",
)


def _local(value: str) -> str:
    """``value`` made absolute when it is a relative path to an existing file or directory; anything else (a hub id,
    a plugin name, an absolute or ``~`` path, a name the OS cannot look up) as it is. An existing local path is what
    the loaders take first too (before a plugin or the hub), so its meaning does not change."""
    if not value or os.path.isabs(value) or value.startswith("~") or not os.path.exists(value):
        return value
    return os.path.abspath(value)


def _sources(value: Any) -> Any:
    """data.train / data.eval: a source string, a ``{source, ratio, ...}`` mapping (or `config.SourceSpec`), a list."""
    if isinstance(value, list):
        return [_sources(item) for item in value]
    if isinstance(value, str):
        return _local(value)
    spec = value if isinstance(value, dict) else value.model_dump()
    return {**spec, "source": _local(spec["source"])} if isinstance(spec.get("source"), str) else spec


def absolute(key: str, value: Any) -> Any:
    """The value of config field ``key`` (one of `PATH_FIELDS`) with its relative local paths made absolute."""
    if key.startswith("data."):
        return _sources(value)
    if key == "model.chat_template" and value in TEMPLATES:
        return value  # a built-in name wins over a file of that name
    return _local(value)


def absolute_paths(config) -> None:
    """Every `PATH_FIELDS` value of ``config`` (a `config.RunConfig`) with relative local paths made absolute."""
    for key in PATH_FIELDS:
        section, name = key.split(".")
        part = getattr(config, section)
        value = getattr(part, name)
        new = absolute(key, value)
        if new != value:  # (a `SourceSpec` is given back as a mapping: validated into one again)
            setattr(part, name, new)
