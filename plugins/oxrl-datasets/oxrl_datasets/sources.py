"""Where a dataset plugin's rows come from, and the checks every mapping shares.

Every plugin of this package is a `SourceDataset`: its ``Config`` (a `SourceConfig`) says where
the data is, and its ``map_row`` turns one source row into one oxRL row. ``rows(split)`` reads
the split and maps every row. The source, in this order:

- ``path`` is a file: ``.jsonl``/``.json``/``.parquet``, or ``.jsonl.gz``/``.json.bz2``/``.jsonl.xz``
  (read by `oxrl_core.data.sources.read_data_file`; ``.zst`` by `datasets`' json builder). It is the train split.
- ``path`` is a directory written by ``datasets.save_to_disk``: a ``DatasetDict``'s splits are
  picked by name (``train_split``, ``eval_split``); a single ``Dataset`` is the train split.
- ``path`` is any other directory, e.g. a hub snapshot (``huggingface-cli download ID
  --repo-type dataset --local-dir DIR``). When its README declares configs (subsets, custom split
  names): ``datasets.load_dataset(DIR, subset, data_dir=...)``, splits by name. Otherwise the
  split's files are found by name (``train.jsonl``, ``test-00000-of-00001.parquet``,
  ``train_prefs.jsonl.gz``, ...) under ``data_dir``: in ``<subset>/`` for each subset that has
  such a directory (else once), in ``data/`` or in the directory itself.
- ``path`` is empty: ``datasets.load_dataset(hub_id, subset, split=train_split|eval_split)``.

``subset`` and ``data_dir`` apply to the hub and to snapshot directories only.

The eval split is ``eval_path`` (a file) when that is set; else ``eval_split`` of the source above;
there is none — ``rows("eval") == []``, and the core runs without held-out data — when
``eval_split`` is empty or the source is a single file or a single saved ``Dataset``. A split the
source does not have is an `OxrlError` that lists the splits it has (for the hub, `datasets`'
own message does). A plugin whose data comes in several hub configs (MATH's subjects) returns
them from `SourceDataset.subsets`; they are read one after the other and concatenated.

A source row that lacks a field, or has one of the wrong type, is an `OxrlError` naming the
dataset, where the rows came from, the row number (1-based; the line number for JSONL) and the
field: ``dataset 'gsm8k' (data/train.jsonl): row 3: missing field 'question'``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from oxrl_core import Dataset, OxrlError

SPLITS = ("train", "eval")

# ----------------------------------------------------------------------------- the options


def hub_id_field(default: str = "") -> Any:
    return Field(default, description="the dataset's id on the Hugging Face hub, read when `path` is empty")


def subset_field(default: str = "") -> Any:
    return Field(
        default,
        description="the hub config (`datasets.load_dataset`'s `name`), also for a snapshot directory; "
        "empty = the dataset's only or default config",
    )


def train_split_field(default: str = "train") -> Any:
    return Field(default, min_length=1, description="the source split read as oxRL's train split")


def eval_split_field(default: str = "test") -> Any:
    return Field(default, description="the source split read as oxRL's eval split; empty = no eval split")


class SourceConfig(Dataset.Config):
    """Where the rows come from: a local copy (``path``, ``eval_path``) or the hub (``hub_id``)."""

    path: str = Field(
        "",
        description="a local copy: a JSONL/JSON/Parquet file (the train split), a directory written by "
        "`datasets.save_to_disk`, or a downloaded hub snapshot directory; empty = load `hub_id` from the hub",
    )
    eval_path: str = Field(
        "",
        description="a JSONL/JSON/Parquet file that is the eval split whenever it is set (e.g. when `path` is a file)",
    )
    hub_id: str = hub_id_field()
    subset: str = subset_field()
    data_dir: str = Field(
        "", description="a sub-directory of the hub dataset or snapshot to read (`datasets.load_dataset`'s `data_dir`)"
    )
    train_split: str = train_split_field()
    eval_split: str = eval_split_field()


# ----------------------------------------------------------------------------- one source row


@dataclass
class SourceRow:
    """One source row being mapped: its fields, and where it came from (for error messages)."""

    fields: dict
    dataset: str
    origin: str
    number: int | str

    def error(self, message: str) -> OxrlError:
        return OxrlError(f"dataset '{self.dataset}' ({self.origin}): row {self.number}: {message}")

    def value(self, name: str) -> Any:
        """The field ``name``, of any type; missing or null is an error naming it."""
        if self.fields.get(name) is None:
            raise self.error(f"missing field '{name}'")
        return self.fields[name]

    def text(self, name: str) -> str:
        """The field ``name``, which must be a string."""
        value = self.value(name)
        if not isinstance(value, str):
            raise self.error(f"field '{name}' must be a string, got {type(value).__name__}")
        return value

    def messages(self, name: str) -> list[dict]:
        """The field ``name``: a non-empty list of chat messages, returned as ``{role, content}`` only."""
        value = self.value(name)
        if not isinstance(value, list) or not value:
            raise self.error(f"field '{name}' must be a non-empty list of {{role, content}} messages")
        for j, message in enumerate(value):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise self.error(f"field '{name}[{j}]' must be an object with string 'role' and 'content'")
        return [{"role": m["role"], "content": m["content"]} for m in value]


# ----------------------------------------------------------------------------- reading a split


@dataclass
class Part:
    """Rows read from one place (each with ``_row``, its 1-based number there)."""

    origin: str
    rows: list[dict]


def numbered(ds, columns: tuple[str, ...] | None = None) -> list[dict]:
    """A `datasets.Dataset` as Python rows numbered from 1; ``columns`` keeps only those (when present)."""
    if columns is not None:
        ds = ds.select_columns([c for c in ds.column_names if c in columns])
    return [{**row, "_row": i} for i, row in enumerate(ds.to_list(), start=1)]


def pick_split(ds_dict, split_name: str, dataset: str, origin: str, split: str):
    """``ds_dict[split_name]``, or an error listing the splits there are."""
    if split_name in ds_dict:
        return ds_dict[split_name]
    option = "train_split" if split == "train" else "eval_split"
    hint = " (eval_split: '' runs without held-out data)" if split == "eval" else ""
    raise OxrlError(
        f"dataset '{dataset}' ({origin}): there is no split '{split_name}'; it has {', '.join(map(repr, ds_dict))}. "
        f"Set {option} to one of them{hint}."
    )


def read_file(path: Path, dataset: str, option: str) -> Part:
    """One JSONL/JSON/Parquet file (JSON/JSONL also ``.gz``/``.bz2``/``.xz``; ``.zst`` through `datasets`),
    every row of it. A bad byte, bad JSON or an unreadable file is an `OxrlError` naming the file and line."""
    from oxrl_core import path_kind, read_data_file

    label = f"dataset '{dataset}': {option}"
    if path_kind(str(path), label) != "file":
        raise OxrlError(f"{label} not found: {path}")
    if path.suffix.lower() == ".zst" and Path(path.stem).suffix.lower() in (".jsonl", ".json"):
        import datasets

        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        except Exception as exc:  # noqa: BLE001 - a bad file is reported with its path
            raise OxrlError(f"{label}: cannot read {path}: {type(exc).__name__}: {exc}") from None
        return Part(str(path), numbered(ds))
    return Part(str(path), read_data_file(path, label))


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` was written by ``save_to_disk`` (a DatasetDict or a single Dataset)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def read_saved(path: Path, dataset: str, split: str, split_name: str, columns) -> list[Part]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - load_from_disk fails in several types for a directory it cannot read
        raise OxrlError(
            f"dataset '{dataset}': cannot read the saved dataset {path}: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(ds, datasets.DatasetDict):
        return [Part(str(path), numbered(ds, columns))] if split == "train" else []
    if not split_name:
        return []
    return [
        Part(f"{path}, split '{split_name}'", numbered(pick_split(ds, split_name, dataset, str(path), split), columns))
    ]


def _load_kwargs(config: SourceConfig) -> dict:
    return {"data_dir": config.data_dir} if config.data_dir else {}


def _label(where: str, subset: str) -> str:
    return f"{where} {subset}" if subset else where


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def declares_configs(path: Path) -> bool:
    """Whether a snapshot directory's README.md declares its configs (``configs:`` in the YAML header),
    as hub datasets with several subsets or custom split names do; `datasets` then reads them."""
    readme = path / "README.md"
    if not readme.is_file():
        return False
    text = readme.read_text(encoding="utf-8", errors="replace")
    header = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
    return any(line.startswith("configs:") for line in header.splitlines())


def data_files(root: Path) -> dict[str, list[Path]]:
    """A plain directory's data files by split: ``train.jsonl``, ``test-00000-of-00001.parquet``, ``train_prefs.jsonl.gz``."""
    found: dict[str, list[Path]] = {}
    for f in sorted(root.iterdir()) if root.is_dir() else []:
        parts = f.name.split(".")
        if f.is_file() and len(parts) > 1 and "." + parts[1] in DATA_SUFFIXES:
            found.setdefault(parts[0].split("-")[0], []).append(f)
    return found


def read_plain_dir(
    path: Path, config: SourceConfig, dataset: str, split: str, split_name: str, subsets: list[str]
) -> list[Part]:
    """A directory of files named by split (no README configs): in ``data_dir``, then ``<subset>/`` for each
    subset that has a directory (else the directory once), then ``data/`` or the directory itself."""
    base = path / config.data_dir if config.data_dir else path
    named = [s for s in subsets if s and (base / s).is_dir()]
    parts: list[Part] = []
    for roots in [[base / s] for s in named] or [[base / "data", base]]:
        by_split = next((found for found in map(data_files, roots) if found), {})
        if split_name not in by_split:
            pick_split(
                by_split, split_name, dataset, str(roots[0].parent if roots[0].name == "data" else roots[0]), split
            )
        parts += [read_file(f, dataset, "path") for f in by_split[split_name]]
    return parts


def read_snapshot(
    path: Path, config: SourceConfig, dataset: str, split: str, split_name: str, subset: str, columns
) -> Part:
    """A downloaded hub snapshot whose README declares its configs: ``datasets.load_dataset(dir, subset)``."""
    import datasets

    label = _label(str(path), subset)
    try:
        ds_dict = datasets.load_dataset(str(path), subset or None, **_load_kwargs(config))
    except Exception as exc:  # noqa: BLE001 - no data files, unknown config, ...: all one message
        raise OxrlError(
            f"dataset '{dataset}': cannot load the directory {label}: {type(exc).__name__}: {exc}"
        ) from None
    return Part(
        f"{label}, split '{split_name}'", numbered(pick_split(ds_dict, split_name, dataset, label, split), columns)
    )


def read_hub(config: SourceConfig, dataset: str, split_name: str, subset: str, columns) -> Part:
    """``datasets.load_dataset(hub_id, subset, split=split_name)``."""
    import datasets

    label = _label(config.hub_id, subset)
    try:
        ds = datasets.load_dataset(config.hub_id, subset or None, split=split_name, **_load_kwargs(config))
    except Exception as exc:  # noqa: BLE001 - offline, gated, unknown split: all one message
        raise OxrlError(
            f"dataset '{dataset}': cannot load split '{split_name}' of {label} from the hub "
            f"(set `path` to a local copy to work offline): {type(exc).__name__}: {exc}"
        ) from None
    return Part(f"{label}, split '{split_name}'", numbered(ds, columns))


def read_split(dataset: str, config: SourceConfig, split: str, subsets: list[str], columns=None) -> list[Part]:
    """The source rows of oxRL split ``split`` (``train`` or ``eval``), as the module docstring says."""
    if split == "eval" and config.eval_path:
        return [read_file(Path(config.eval_path).expanduser(), dataset, "eval_path")]
    split_name = config.train_split if split == "train" else config.eval_split
    if not config.path:
        if not config.hub_id:
            raise OxrlError(f"dataset '{dataset}': set `path` (a local copy) or `hub_id`")
        return [read_hub(config, dataset, split_name, s, columns) for s in subsets] if split_name else []
    from oxrl_core import path_kind

    path = Path(config.path).expanduser()
    kind = path_kind(config.path, f"dataset '{dataset}': path")
    if kind == "file":
        return [read_file(path, dataset, "path")] if split == "train" else []
    if kind != "dir":
        raise OxrlError(f"dataset '{dataset}': path not found: {config.path}")
    if is_saved_dataset(path):
        return read_saved(path, dataset, split, split_name, columns)
    if not split_name:
        return []
    if not declares_configs(path):
        return read_plain_dir(path, config, dataset, split, split_name, subsets)
    return [read_snapshot(path, config, dataset, split, split_name, s, columns) for s in subsets]


# ----------------------------------------------------------------------------- the plugin base


class SourceDataset(Dataset):
    """A dataset plugin that reads `SourceConfig`'s source and maps each row with `map_row`."""

    class Config(SourceConfig):
        """Where the rows come from."""

    #: the source columns `map_row` reads: the others of a `datasets` source are never turned
    #: into Python objects (saves memory on wide datasets); None = all of them
    source_columns: ClassVar[tuple[str, ...] | None] = None

    def subsets(self) -> list[str]:
        """The hub configs to read (for the hub and snapshot directories), concatenated in order."""
        return [self.config.subset]

    def rows(self, split: str) -> list[dict]:
        if split not in SPLITS:
            raise OxrlError(f"dataset '{self.name}': unknown split '{split}' (expected 'train' or 'eval')")
        out = []
        for part in read_split(self.name, self.config, split, self.subsets(), self.source_columns):
            for i, fields in enumerate(part.rows, start=1):
                mapped = self.map_row(SourceRow(fields, self.name, part.origin, fields.get("_row", i)))
                if mapped is not None:
                    out.append(mapped)
        return out

    @abstractmethod
    def map_row(self, row: SourceRow) -> dict | None:
        """The oxRL row for one source row (None drops the row)."""
