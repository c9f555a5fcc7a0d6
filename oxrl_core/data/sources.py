"""Where rows come from: files, directories, saved `datasets`, dataset plugins, hub ids, and mixtures.

``data.train`` / ``data.eval``: a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file (JSON/JSONL also
``.gz``/``.bz2``/``.xz``; JSONL and CSV UTF-8 with or without a BOM), a directory of such files (all of one type,
read in name order), a directory written by ``datasets.save_to_disk``, a dataset plugin name, or a hub id (through
``datasets.load_dataset``); or a mapping ``{source, ratio, ...}`` whose other keys are the dataset plugin's options;
or a list of those, mixed by their ratios (`batching.MixturePlan`). A byte that is not UTF-8 names the file, the
line and the byte offset; an OS error while looking a source up or reading it (a name too long, an I/O error) names
the field and the path.
"""

from __future__ import annotations

import errno
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Dataset

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class Part:
    """One source of a run's data: a short name (for ``data/<name>`` metrics) and its sampling ratio."""

    name: str
    ratio: float
    origin: str


@dataclass
class Source:
    """Rows plus where they came from (for error messages) and the plugin, if any.

    A mixture of several sources is one `Source` whose rows are the parts' rows one after the
    other, each tagged ``_source`` (its index in ``parts``) and ``_origin``.
    """

    rows: list[dict]
    origin: str
    dataset: Any = None  # the Dataset plugin instance, when the source is one
    parts: list[Part] | None = None


# ----------------------------------------------------------------------------- loading


UTF8_BOM = b"\xef\xbb\xbf"


def _decode(path: Path, data: bytes, lineno: int = 1, offset: int = 0) -> str:
    """``data`` (one line, or a whole file, starting at line ``lineno`` and byte ``offset`` of the file) as
    UTF-8 text; a BOM at the start of the file is dropped. A byte that is not UTF-8 is an `OxrlError`
    naming the file, its 1-based line and its byte offset, with the fix."""
    body = data[len(UTF8_BOM) :] if offset == 0 and data.startswith(UTF8_BOM) else data
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        pos = len(data) - len(body) + exc.start  # the bad byte's position in `data`
        line = lineno + data.count(b"\n", 0, pos)
        column = pos - (data.rfind(b"\n", 0, pos) + 1) + 1
        raise OxrlError(
            f"{path}: line {line}: byte 0x{data[pos]:02x} at byte offset {offset + pos} (column {column}) is not "
            f"valid UTF-8 ({exc.reason}); data files must be UTF-8: re-encode the file "
            f"(e.g. `iconv -f latin1 -t utf-8`) or fix that line"
        ) from None


def _unreadable(path: Path, exc: OSError, field: str) -> OxrlError:
    """An OS error while reading a data file (no permission, an I/O error, ...) as one line naming the file."""
    reason = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
    return OxrlError(f"{field}: cannot read {path}: {reason}")


#: compressed JSON/JSONL files read line by line like plain ones (``.zst`` needs `datasets`' reader)
DECOMPRESS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}


def _open_bytes(path: Path):
    """``path`` opened for binary reading, decompressed on the fly when its suffix says so."""
    module = DECOMPRESS.get(path.suffix.lower())
    if module is None:
        return path.open("rb")
    import importlib

    return importlib.import_module(module).open(path, "rb")


def _read_jsonl(path: Path, field: str = "data.train") -> list[dict]:
    """Rows of a JSONL file (plain, or ``.gz``/``.bz2``/``.xz``), each tagged ``_row`` = its 1-based line
    number (blank lines skipped).

    Lines are read as bytes and decoded one by one, so a byte that is not UTF-8 is reported with its
    line and byte offset (in the decompressed text) instead of Python's UnicodeDecodeError from
    somewhere in a buffered read."""
    rows, offset = [], 0
    try:
        with _open_bytes(path) as handle:
            for lineno, raw in enumerate(handle, start=1):
                line = _decode(path, raw, lineno, offset)
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise OxrlError(f"{path}: row {lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
                if not isinstance(row, dict):
                    raise OxrlError(f"{path}: row {lineno}: expected a JSON object, got {type(row).__name__}")
                row["_row"] = lineno
                rows.append(row)
    except (OSError, EOFError, lzma.LZMAError) as exc:  # also a truncated or corrupt compressed stream
        raise _unreadable(path, exc, field) from None
    return rows


def _read_json(path: Path, field: str = "data.train") -> list[dict]:
    """Rows of a JSON file: a list of objects, or ``{"<name>": [...]}``; a bad byte is reported like JSONL's."""
    try:
        with _open_bytes(path) as handle:
            raw = handle.read()
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise _unreadable(path, exc, field) from None
    try:
        data = json.loads(_decode(path, raw))
    except json.JSONDecodeError as exc:
        raise OxrlError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]} / {"train": [...]}
    if not isinstance(data, list):
        raise OxrlError(f"{path}: expected a JSON list of row objects")
    rows = []
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise OxrlError(f"{path}: row {i}: expected a JSON object, got {type(row).__name__}")
        rows.append({**row, "_row": i})
    return rows


def _read_parquet(path: Path, field: str = "data.train") -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        rows = table.to_pylist()
    except UnicodeDecodeError as exc:  # a string column holding bytes that are not UTF-8
        raise OxrlError(
            f"{path}: a string column holds bytes that are not valid UTF-8 ({exc.reason}); "
            "write the file with UTF-8 strings"
        ) from None
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise OxrlError(f"{path}: cannot read Parquet: {exc}") from None
    return [{**row, "_row": i} for i, row in enumerate(rows, start=1)]


def _read_csv(path: Path, field: str = "data.train") -> list[dict]:
    """Rows of a CSV file with a header line (UTF-8, a BOM dropped); every cell is a string, each row tagged
    ``_row`` = the line it starts on. A row with more or fewer cells than the header names its line."""
    import csv
    import io

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _unreadable(path, exc, field) from None
    reader = csv.reader(io.StringIO(_decode(path, raw), newline=""))
    try:
        header = next(reader, None)
        if not header or not any(name.strip() for name in header):
            raise OxrlError(f"{path}: the CSV file has no header line (the first line names the columns)")
        header = [name.strip() for name in header]
        repeated = sorted({name for name in header if header.count(name) > 1 or not name})
        if repeated:
            raise OxrlError(f"{path}: line 1: the CSV header has empty or repeated column names: {repeated}")
        rows, start = [], reader.line_num + 1
        for cells in reader:
            if cells and any(cell.strip() for cell in cells):
                if len(cells) != len(header):
                    raise OxrlError(
                        f"{path}: row {start}: {len(cells)} cells, but the header names {len(header)} columns "
                        f"({', '.join(header)}); quote cells that hold a comma"
                    )
                rows.append({**dict(zip(header, cells)), "_row": start})
            start = reader.line_num + 1
    except csv.Error as exc:
        raise OxrlError(f"{path}: line {reader.line_num}: malformed CSV: {exc}") from None
    return rows


def _from_hf(ds, origin: str, split: str) -> list[dict]:
    from datasets import DatasetDict

    if isinstance(ds, DatasetDict):
        names = list(ds)
        pick = split if split in ds else ("test" if split == "eval" and "test" in ds else None)
        if pick is None:
            raise OxrlError(f"{origin}: has splits {names}, none of them is '{split}'")
        ds = ds[pick]
    return [{**row, "_row": i} for i, row in enumerate(ds, start=1)]


def data_suffix(path: Path) -> str:
    """``.jsonl`` for ``x.jsonl`` and ``x.jsonl.gz``: the format, whatever the compression."""
    suffixes = [x.lower() for x in path.suffixes[-2:]]
    return suffixes[0] if len(suffixes) == 2 and suffixes[1] in DECOMPRESS else path.suffix.lower()


def read_data_file(path: Path, field: str = "data.train") -> list[dict]:
    """Every row of a JSONL / JSON (also ``.gz``/``.bz2``/``.xz``) or Parquet file, numbered from 1."""
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}
    suffix = data_suffix(path)
    if suffix not in readers or (suffix in (".parquet", ".csv") and path.suffix.lower() in DECOMPRESS):
        raise OxrlError(
            f"{path}: unsupported data file type '{''.join(path.suffixes[-2:]) or path.name}' "
            f"(use {', '.join(FILE_SUFFIXES)}, JSON/JSONL also compressed as .gz, .bz2 or .xz)"
        )
    return readers[suffix](path, field)


def path_kind(
    spec: str, field: str, expected: str = "a data file or directory, a dataset plugin name or a hub id"
) -> str | None:
    """``"file"``, ``"dir"`` or None (nothing there) for a source or model string that may be a path.

    Any OS error while looking (a name longer than the file system allows, no permission on a parent
    directory, ...) is an `OxrlError` naming ``field`` and the path, instead of an OSError traceback:
    the string is then no usable path, and not a plugin name or hub id either."""
    try:
        path = Path(spec).expanduser()
        return "file" if path.is_file() else "dir" if path.is_dir() else None
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL byte
        shown = spec if len(spec) <= 80 else f"{spec[:60]}...{spec[-12:]} ({len(spec)} characters)"
        reason = getattr(exc, "strerror", None) or str(exc)
        hint = (
            " (the file system allows at most 255 bytes per name)"
            if getattr(exc, "errno", None) == errno.ENAMETOOLONG
            else ""
        )
        raise OxrlError(f"{field}: '{shown}' cannot be used as a path: {reason}{hint}; give {expected}") from None


#: files `datasets.save_to_disk` writes (a directory holding one is read with `load_from_disk`)
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def _read_data_dir(path: Path, field: str) -> Source:
    """Every data file of a directory (not recursive, hidden files skipped), in name order: all of one type
    (e.g. train-00000.parquet, train-00001.parquet); each row keeps its own file in ``_origin``."""
    files = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    if not files:
        raise OxrlError(
            f"{field}: the directory {path} is empty; put JSONL, Parquet or CSV files in it "
            "(or give a `datasets.save_to_disk` directory)"
        )
    kinds = {p: data_suffix(p) if p.is_file() else "a directory" for p in files}
    unknown = [p.name for p, k in kinds.items() if k not in FILE_SUFFIXES]
    if unknown:
        raise OxrlError(
            f"{field}: the directory {path} holds {', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}, "
            f"which is not a data file ({', '.join(FILE_SUFFIXES)}) nor a `datasets.save_to_disk` directory; "
            "leave only the data files in it"
        )
    if len(set(kinds.values())) > 1:
        by_type = ", ".join(f"{k} ({sum(1 for v in kinds.values() if v == k)})" for k in sorted(set(kinds.values())))
        raise OxrlError(
            f"{field}: the directory {path} mixes file types ({by_type}); a directory source is files of one "
            "type, or list the files as sources of data.train"
        )
    rows = [{**row, "_origin": str(p)} for p in files for row in read_data_file(p, field)]
    return Source(rows, f"{path}/ ({len(files)} files)")


def load_source(spec: str, split: str, registry=None, options: dict | None = None, field: str = "data.train") -> Source:
    """Resolve one source string to rows; ``options`` go to a dataset plugin's ``Config``."""
    path = Path(spec).expanduser()
    kind = path_kind(spec, field)
    is_plugin = kind is None and registry is not None and registry.has("dataset", spec)
    if options and not is_plugin:
        raise OxrlError(
            f"{field}.{next(iter(options))}: options apply to dataset plugins only, and '{spec}' is not one "
            "(a file, a directory or a hub id takes just `source` and `ratio`)"
        )
    if kind == "file":
        return Source(read_data_file(path, field), str(path))
    if kind == "dir" and not any((path / name).is_file() for name in SAVED_DATASET_FILES):
        return _read_data_dir(path, field)
    if kind == "dir":
        try:
            from datasets import load_from_disk

            ds = load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - load_from_disk fails in several types for a directory it cannot read
            raise OxrlError(f"{path}: not a dataset saved with `datasets.save_to_disk` ({exc})") from None
        return Source(_from_hf(ds, str(path), split), str(path))
    if is_plugin:
        dataset = registry.build("dataset", spec, options or {}, field=field)
        try:
            rows = dataset.rows(split)
        except OxrlError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin failing is reported with its name
            raise OxrlError(
                f"dataset '{spec}' failed to produce its '{split}' split: {type(exc).__name__}: {exc}"
            ) from None
        return Source([{**r, "_row": i} for i, r in enumerate(rows, start=1)], f"dataset '{spec}'", dataset)
    looks_like_file = path.suffix.lower() in FILE_SUFFIXES or spec.startswith((".", "/", "~")) or spec.count("/") > 1
    if looks_like_file or "/" not in spec:
        hint = ""
        if registry is not None:
            import difflib

            close = difflib.get_close_matches(spec, registry.names("dataset"), n=1)
            hint = f" Did you mean dataset '{close[0]}'?" if close else ""
        raise OxrlError(f"{field}: data source not found: '{spec}' is neither a file nor a dataset plugin.{hint}")
    try:  # a hub id such as "openai/gsm8k"
        from datasets import load_dataset

        ds = load_dataset(spec)
    except Exception as exc:  # noqa: BLE001 - offline, missing, gated: all one message
        raise OxrlError(f"data source '{spec}': not a local file and could not be loaded from the hub: {exc}") from None
    return Source(_from_hf(ds, spec, split), spec)


def can_verify(dataset) -> bool:
    """True when the dataset plugin implements `verify` (answers can be checked)."""
    return dataset is not None and type(dataset).verify is not Dataset.verify


def source_specs(value, field: str) -> list[tuple[str, float, dict, str]]:
    """``data.train``/``data.eval`` as (source, ratio, plugin options, field label) per source."""
    items = value if isinstance(value, list) else [value]
    specs = []
    for i, item in enumerate(items):
        label = f"{field}[{i}]" if isinstance(value, list) else field
        if isinstance(item, str):
            specs.append((item, 1.0, {}, label))
        else:  # config.SourceSpec (or a plain mapping)
            data = item if isinstance(item, dict) else item.model_dump()
            data = dict(data)
            source, ratio = data.pop("source"), float(data.pop("ratio", 1.0))
            specs.append((source, ratio, data, label))
    return specs


def sources_argument(value: list | tuple) -> list:
    """The Python API's ``Trainer(data=[...])``: a list of sources (paths, plugin names, ``{source, ratio}``)
    to mix, as ``data.train`` takes them. (A list of row dicts alone is rows, taken by `inputs`; a list mixing
    the two is refused here.)"""
    if not value:
        raise OxrlError("data=[]: the list of sources is empty")
    sources = []
    for i, item in enumerate(value):
        if isinstance(item, (str, Path)):
            sources.append(str(item))
        elif isinstance(item, dict) and "source" in item:
            sources.append({**item, "source": str(item["source"])})
        else:
            shown = type(item).__name__ if not isinstance(item, dict) else f"a row with keys {sorted(item)[:5]}"
            raise OxrlError(
                f"data[{i}]: expected a data source (a path, a dataset plugin name or {{source, ratio}}), got {shown}. "
                "A list is either data sources to mix or rows (dicts of fields, e.g. {'prompt': ..., 'response': ...}), "
                "not both"
            )
    return sources


def _part_name(spec: str, taken: set[str]) -> str:
    path = Path(spec)
    base = path.stem if path.suffix.lower() in FILE_SUFFIXES else (path.name or spec)
    base = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in base) or "source"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def load_data(value, split: str, registry=None, field: str = "data.train") -> Source:
    """All sources of ``data.train`` (or ``data.eval``), one `Source`; several are tagged for mixing."""
    specs = source_specs(value, field)
    if not specs:
        raise OxrlError(f"{field}: the list of sources is empty")
    taken: set[str] = set()
    loaded = [
        (load_source(spec, split, registry, options, label), spec, ratio) for spec, ratio, options, label in specs
    ]
    parts = [Part(_part_name(spec, taken), ratio, src.origin) for src, spec, ratio in loaded]
    if len(loaded) == 1:
        source = loaded[0][0]
        source.parts = parts
        return source
    rows = []
    for i, (src, _, _) in enumerate(loaded):
        rows += [{**r, "_source": i, "_origin": r.get("_origin", src.origin)} for r in src.rows]
    datasets = [src.dataset for src, _, _ in loaded]
    origin = " + ".join(f"{p.origin} ({p.ratio:g})" for p in parts)
    return Source(rows, origin, MixedDataset.of(datasets), parts)


def eval_source(data_cfg, registry) -> Source | None:
    """Held-out rows: ``data.eval`` when set, else the eval splits of the dataset plugins in
    ``data.train`` (those that have one), else none."""
    if data_cfg.eval:
        return load_data(data_cfg.eval, "eval", registry, "data.eval")
    plugin_specs = [
        (spec, options, label)
        for spec, _, options, label in source_specs(data_cfg.train, "data.train")
        if path_kind(spec, label) is None and registry is not None and registry.has("dataset", spec)
    ]
    held_out = [
        s
        for s in (load_source(spec, "eval", registry, options, label) for spec, options, label in plugin_specs)
        if s.rows
    ]
    if not held_out:
        return None
    if len(held_out) == 1:
        return held_out[0]
    rows = []
    for i, src in enumerate(held_out):
        rows += [{**r, "_source": i, "_origin": src.origin} for r in src.rows]
    return Source(rows, " + ".join(s.origin for s in held_out), MixedDataset.of([s.dataset for s in held_out]))


class MixedDataset(Dataset):
    """Several dataset plugins' answer checks behind one: a row is checked by the plugin it came from."""

    name = "mix"
    formats = ()

    def __init__(self, datasets: list):
        super().__init__()
        self.datasets = datasets

    @classmethod
    def of(cls, datasets: list):
        """One plugin when every part is the same one; a mix when every part can check answers; else None."""
        if all(d is not None for d in datasets) and len({id(d) for d in datasets}) == 1:
            return datasets[0]
        if datasets and all(can_verify(d) for d in datasets):
            return cls(datasets)
        return None

    def rows(self, split: str) -> list[dict]:
        raise OxrlError("a mixture of datasets is read through its parts")

    def verify(self, completion: str, row: dict) -> bool | None:
        return self.datasets[row.get("_source", 0)].verify(completion, row)
