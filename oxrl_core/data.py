"""The data layer: sources -> validated rows -> token ids -> batches.

Sources (``data.train`` / ``data.eval``): a local ``.jsonl``/``.json``/``.parquet``/``.csv``
file (JSON/JSONL also ``.gz``/``.bz2``/``.xz``; JSONL and CSV UTF-8 with or without a BOM), a directory of such
files (all of one type, read in name order), a directory written by ``datasets.save_to_disk``, a dataset plugin name, or
a hub id (through ``datasets.load_dataset``); or a mapping ``{source, ratio, ...}``
whose other keys are the dataset plugin's options; or a list of those, mixed by
their ratios (`MixturePlan`). Every row is checked against the format the
algorithm consumes (the row formats: ``docs/architecture.md``); a bad row is an `OxrlError` naming the file, the
row number (1-based; the line number for JSONL) and the field. A byte that is not
UTF-8 names the file, the line and the byte offset; an OS error while looking a source up
or reading it (a name too long, an I/O error) names the field and the path. Rows are
checked completely when the data loads, never first when a row is batched or sampled:
a prompt or completion that encodes to no tokens is refused, and preference pairs whose
chosen equals rejected are dropped with a note (`Tokenised.notes`).

Tokenisation convention: the prompt goes through the chat template with the
generation prompt when the tokenizer has one (plain text otherwise); a
completion is its tokens without special tokens, then EOS; ``labels`` are -100
on prompt tokens. A multi-turn ``messages`` row (several assistant turns, tool
calls, tool results) is rendered whole by the chat template with labels on every
assistant turn (`tokenise_messages`). CPT (`text`) rows are packed into
``max_length`` blocks with labels on every token.
"""

from __future__ import annotations

import errno
import json
import lzma
import random
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from oxrl_core.chat_templates import describe_error
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Dataset

IGNORE = -100
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
        except Exception as exc:  # noqa: BLE001
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


def eval_source(data_cfg, registry, train_source: Source) -> Source | None:
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


# ----------------------------------------------------------------------------- validation

REQUIRED = {
    "prompt": ("prompt",),
    "prompt_response": ("prompt", "response"),
    "text": ("text",),
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
}
#: completions that must not be empty (compared or judged, an empty one says nothing; an empty SFT
#: response teaches the model to answer nothing, which is almost always a broken field mapping)
COMPLETIONS = {"preference": ("chosen", "rejected"), "unpaired": ("completion",), "prompt_response": ("response",)}


def _check_messages(value, where: str, field: str) -> None:
    if not isinstance(value, list) or not value:
        raise OxrlError(f"{where}: field '{field}' must be a non-empty list of {{role, content}} messages")
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise OxrlError(f"{where}: field '{field}[{j}]' must be an object with string 'role' and 'content'")


def row_where(row: dict, origin: str) -> str:
    """``file: row N`` (1-based; the line number for JSONL) for messages about one row."""
    return f"{row.get('_origin', origin)}: row {row.get('_row', '?')}"


#: the roles a multi-turn conversation may use (`check_conversation`)
ROLES = ("system", "user", "assistant", "tool")


def is_multi_turn(messages) -> bool:
    """True for a ``messages`` list that one prompt and one response cannot hold: several assistant turns,
    an assistant message with ``tool_calls``, or a ``tool`` message. Such a row is trained on every assistant
    turn (`tokenise_messages`); any other ``messages`` row is a prompt (all but the last message) and a response."""
    if not isinstance(messages, list):
        return False
    assistants = 0
    for msg in messages:
        if isinstance(msg, dict):
            if msg.get("role") == "tool" or msg.get("tool_calls"):
                return True
            assistants += msg.get("role") == "assistant"
    return assistants > 1


TOOL_CALL_SHAPE = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'


def _check_tool_calls(calls, where: str, field: str) -> list[dict]:
    """An assistant message's ``tool_calls`` checked; ``arguments`` given as a JSON string become the object it
    encodes (chat templates expect an object: most write it with ``tojson``, which would quote a string again)."""
    if not isinstance(calls, list):
        raise OxrlError(f"{where}: field '{field}' must be a list of {TOOL_CALL_SHAPE}, got {type(calls).__name__}")
    checked = []
    for k, call in enumerate(calls):
        here = f"{field}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise OxrlError(f"{where}: field '{here}' must be an object {TOOL_CALL_SHAPE}")
        if call.get("type", "function") != "function":
            raise OxrlError(f"{where}: field '{here}.type' must be 'function', got {call['type']!r}")
        if not isinstance(function.get("name"), str) or not function["name"].strip():
            raise OxrlError(f"{where}: field '{here}.function.name' must be a non-empty string")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise OxrlError(
                    f"{where}: field '{here}.function.arguments' is a string but not JSON ({exc.msg}, column "
                    f"{exc.colno}); give an object or a JSON string of one"
                ) from None
        if not isinstance(arguments, dict):
            raise OxrlError(
                f"{where}: field '{here}.function.arguments' must be an object (or a JSON string of one), "
                f"got {type(arguments).__name__}"
            )
        checked.append({**call, "function": {**function, "arguments": arguments}})
    return checked


def check_conversation(messages: list, where: str) -> list[dict]:
    """A multi-turn ``messages`` list (`is_multi_turn`) checked and ready for a chat template.

    Roles are ``system``, ``user``, ``assistant`` or ``tool``; every message has string ``content``, except an
    assistant message with ``tool_calls`` (a list of `TOOL_CALL_SHAPE`), whose content may be empty or absent;
    an assistant message without calls needs content; the last message is the assistant's and at least one
    message comes before the first. A field that is null counts as absent (Parquet files and `datasets` give
    every message every field). Errors name ``where`` (the file and row) and the field."""
    checked = []
    for j, msg in enumerate(messages):
        field = f"messages[{j}]"
        if not isinstance(msg, dict):
            raise OxrlError(f"{where}: field '{field}' must be an object with 'role' and 'content'")
        msg = {key: value for key, value in msg.items() if value is not None}
        role = msg.get("role")
        if role not in ROLES:
            raise OxrlError(f"{where}: field '{field}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        calls = msg.pop("tool_calls", [])
        if calls != []:
            if role != "assistant":
                raise OxrlError(f"{where}: field '{field}.tool_calls': only assistant messages make tool calls")
            msg["tool_calls"] = _check_tool_calls(calls, where, f"{field}.tool_calls")
            msg.setdefault("content", "")
        if not isinstance(msg.get("content"), str):
            raise OxrlError(
                f"{where}: field '{field}.content' must be a string ({role} message), "
                f"got {type(msg.get('content')).__name__}"
            )
        if role == "assistant" and "tool_calls" not in msg and not msg["content"].strip():
            raise OxrlError(f"{where}: field '{field}': an assistant message needs content or tool_calls")
        if not isinstance(msg.get("name", ""), str):
            raise OxrlError(f"{where}: field '{field}.name' must be a string, got {type(msg['name']).__name__}")
        checked.append(msg)
    if checked[-1]["role"] != "assistant":
        raise OxrlError(f"{where}: field 'messages': the last message must have role 'assistant'")
    if checked[0]["role"] == "assistant":
        raise OxrlError(f"{where}: field 'messages': needs at least one message before the first assistant's")
    return checked


def normalise_row(row: dict, fmt: str, origin: str) -> dict:
    """Check `row` against `fmt`; return it with `prompt` (str or messages) and the format's fields.

    A multi-turn ``messages`` row (`is_multi_turn`) is returned with its checked ``messages`` and no ``prompt``:
    it is trained on every assistant turn (`tokenise_messages`)."""
    where = row_where(row, origin)
    if fmt == "prompt_response" and "messages" in row and "prompt" not in row:
        msgs = row["messages"]
        if is_multi_turn(msgs):
            return {**row, "messages": check_conversation(msgs, where)}
        _check_messages(msgs, where, "messages")
        if msgs[-1]["role"] != "assistant":
            raise OxrlError(f"{where}: field 'messages': the last message must have role 'assistant'")
        if len(msgs) < 2:
            raise OxrlError(f"{where}: field 'messages': needs at least one message before the assistant's")
        row = {**row, "prompt": msgs[:-1], "response": msgs[-1]["content"]}
    for field in REQUIRED[fmt]:
        if field not in row or row[field] is None:
            raise OxrlError(f"{where}: missing field '{field}' (format '{fmt}' needs {', '.join(REQUIRED[fmt])})")
    if "prompt" in REQUIRED[fmt]:
        if isinstance(row["prompt"], list):
            _check_messages(row["prompt"], where, "prompt")
        elif not isinstance(row["prompt"], str):
            raise OxrlError(
                f"{where}: field 'prompt' must be a string or a list of messages, got {type(row['prompt']).__name__}"
            )
    for field in REQUIRED[fmt]:
        if field in ("prompt", "label"):
            continue
        if not isinstance(row[field], str):
            raise OxrlError(f"{where}: field '{field}' must be a string, got {type(row[field]).__name__}")
    if fmt == "unpaired" and isinstance(row["label"], str) and row["label"].strip().lower() in ("true", "false"):
        row = {**row, "label": row["label"].strip().lower() == "true"}  # a CSV cell is text
    if fmt == "unpaired" and not isinstance(row["label"], bool):
        raise OxrlError(f"{where}: field 'label' must be true or false, got {row['label']!r}")
    for field in COMPLETIONS.get(fmt, ()):
        if not row[field].strip():
            raise OxrlError(f"{where}: field '{field}' is empty (a completion needs at least one token besides EOS)")
    return row


# ----------------------------------------------------------------------------- tokenisation


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if not isinstance(out, list) else out
        return list(ids)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def encode_completion(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def encode_row_prompt(tokenizer, row: dict, origin: str) -> list[int]:
    """`encode_prompt` of a checked row; a prompt of 0 tokens is an error naming the file and row.

    It happens with a tokenizer that has no chat template and adds no BOS (GPT-2/NeoX-style base
    models) and an empty prompt. Nothing would condition the first completion token: a rollout cannot
    start, and packed attention indexes an empty segment. So it is refused when the data loads,
    not when the row is sampled. A chat template that fails on this row (a ``system`` turn it refuses, a
    ``raise_exception``) is an error naming the file, the row and the template's line."""
    try:
        ids = encode_prompt(tokenizer, row["prompt"])
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception, a KeyError in it
        raise OxrlError(
            f"{row_where(row, origin)}: field 'prompt': the tokenizer's chat template cannot render it "
            f"({describe_error(exc)}); change the row (e.g. the roles its messages use) or set model.chat_template"
        ) from None
    if not ids:
        raise OxrlError(
            f"{row_where(row, origin)}: field 'prompt' encodes to no tokens (it is empty, and this tokenizer has no chat "
            "template and adds no BOS token); give the row a prompt or remove it (plain text without a prompt is "
            'the CPT format: {"text": ...})'
        )
    return ids


def encode_row_completion(tokenizer, row: dict, field: str, origin: str) -> list[int]:
    """`encode_completion` of ``row[field]``; text that encodes to no tokens (before EOS) is an error."""
    ids = encode_completion(tokenizer, row[field])
    if len(ids) < 2:
        raise OxrlError(
            f"{row_where(row, origin)}: field '{field}' encodes to no tokens with this tokenizer "
            f"({row[field]!r}); give it text the tokenizer can represent or remove the row"
        )
    return ids


def rows_text(where: list[tuple[str, object]], limit: int = 5) -> str:
    """``a.jsonl rows 3, 5, 9, ...`` for (file, row) pairs: the first ``limit`` rows, grouped by file."""
    by_file: dict[str, list[str]] = {}
    for origin, row in where[:limit]:
        by_file.setdefault(origin, []).append(str(row))
    more = ", ..." if len(where) > limit else ""
    return (
        "; ".join(f"{origin} row{'s' if len(rows) > 1 else ''} {', '.join(rows)}" for origin, rows in by_file.items())
        + more
    )


@dataclass
class Tokenised:
    examples: list[dict]  # {"input_ids": [...], "labels": [...]}
    dropped: int = 0  # rows whose prompt leaves no room for a completion token in data.max_length
    identical: list[tuple[str, object]] = dataclass_field(
        default_factory=list
    )  # (file, row) of pairs with chosen == rejected
    per_turn: list[tuple[str, object]] = dataclass_field(
        default_factory=list
    )  # (file, row) of conversations trained as one example per assistant turn (`tokenise_messages`)

    def notes(self, max_length: int) -> list[str]:
        """One line per kind of dropped or split row, for the run's start-up output."""
        notes = []
        if self.dropped:
            notes.append(f"{self.dropped} rows dropped: their prompt fills data.max_length={max_length}")
        if self.identical:
            notes.append(
                f"{len(self.identical)} preference pairs dropped: chosen equals rejected (after truncation "
                f"to data.max_length={max_length}), nothing to prefer: {rows_text(self.identical)}"
            )
        if self.per_turn:
            notes.append(
                f"{len(self.per_turn)} multi-turn rows trained as one example per assistant turn: the chat template "
                f"renders earlier turns differently in a longer conversation (e.g. drops their <think>): "
                f"{rows_text(self.per_turn)}"
            )
        return notes


def _render(tokenizer, messages: list[dict], generation_prompt: bool, where: str, tokenize: bool = True):
    """The chat template applied to ``messages``: token ids (or the text); a template error names the row."""
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=tokenize)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception, ...
        raise OxrlError(
            f"{where}: the tokenizer's chat template cannot render this conversation ({type(exc).__name__}: {exc}); "
            "use a model whose chat template takes these roles and tool calls"
        ) from None
    if not tokenize:
        return out
    return list(out if isinstance(out, list) else out["input_ids"])


def _assistant_turn(
    tokenizer, messages: list[dict], i: int, whole: list[int], where: str
) -> tuple[list[int], list[int]]:
    """(prefix, span) of assistant message i: prefix = the template of ``messages[:i]`` with the generation prompt;
    span = what ``messages[: i + 1]`` adds to it, up to and including its first EOS."""
    prefix = _render(tokenizer, messages[:i], True, where)
    full = whole if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False, where)
    if full[: len(prefix)] == prefix:
        span = full[len(prefix) :]
    else:  # a token spans the boundary (e.g. a generation prompt ending in a space): split the text instead
        prefix_text = _render(tokenizer, messages[:i], True, where, tokenize=False)
        full_text = _render(tokenizer, messages[: i + 1], False, where, tokenize=False)
        if not full_text.startswith(prefix_text):
            raise OxrlError(
                f"{where}: the chat template renders 'messages[{i}]' (an assistant turn) without its generation "
                "prompt in front, so its tokens cannot be told apart; use a model with a standard chat template"
            )
        span = tokenizer(full_text[len(prefix_text) :], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos in span:  # what follows the EOS (ChatML's newline) is not generated: no loss on it
        span = span[: span.index(eos) + 1]
    if not span:
        raise OxrlError(f"{where}: the chat template renders 'messages[{i}]' (an assistant turn) as no tokens")
    shown = tokenizer.decode(span)
    for k, call in enumerate(messages[i].get("tool_calls", [])):
        if call["function"]["name"] not in shown:
            raise OxrlError(
                f"{where}: the tokenizer's chat template does not render 'messages[{i}].tool_calls[{k}]' (a call to "
                f"'{call['function']['name']}'), so the model would learn to answer without it; use a model whose "
                "chat template renders tool_calls (tool-use instruct models' do)"
            )
    return prefix, span


def tokenise_messages(tokenizer, messages: list[dict], max_length: int, where: str = "row") -> tuple[list[dict], bool]:
    """A conversation (`check_conversation`) as SFT examples with the loss on every assistant turn and nowhere else.

    Incremental rendering with the tokenizer's chat template: for assistant message i, ``prefix_i`` is the
    template of ``messages[:i]`` with the generation prompt, and the turn's tokens are what the template of
    ``messages[: i + 1]`` adds to it, up to and including the first EOS (what follows, e.g. ChatML's newline after
    ``<|im_end|>``, is not generated, so it gets no loss; a template that closes turns without EOS trains the
    whole span). A tool call is trained as the template renders it; tool results, user and system messages are
    context only.

    One sequence (the usual case): ``input_ids`` is the template of the whole conversation, which starts with
    every ``prefix_i`` and holds turn i's tokens right after it; ``labels`` are those tokens on the turns and
    IGNORE everywhere else. Where the template renders an earlier turn differently inside a longer conversation
    (Qwen3 drops the ``<think>`` of earlier assistant turns), one example per assistant turn instead: prompt
    ``prefix_i``, completion turn i's tokens -- exactly what the model sees and generates at that turn.

    Examples are cut to ``max_length`` tokens; one that keeps no token of its (first) turn is left out, so a row
    whose first assistant turn starts past ``max_length`` gives no example.

    Returns ``(examples, one_sequence)``: ``{"input_ids", "labels"}`` dicts, and False when the conversation was
    split per turn. A tokenizer without a chat template, a template that fails on the conversation or does not
    show a tool call is an `OxrlError` naming ``where`` (the file and row).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise OxrlError(
            f"{where}: a multi-turn conversation (several assistant turns, tool calls or tool results) needs the "
            "tokenizer's chat template to mark its turns, and this tokenizer has none; use a model with a chat "
            "template (an instruct or chat model), or give the row as {prompt, response}"
        )
    whole = _render(tokenizer, messages, False, where)
    turns = [
        _assistant_turn(tokenizer, messages, i, whole, where)
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
    ]
    one_sequence = all(whole[: len(p)] == p and whole[len(p) : len(p) + len(s)] == s for p, s in turns)
    if one_sequence:
        labels = [IGNORE] * len(whole)
        for prefix, span in turns:
            labels[len(prefix) : len(prefix) + len(span)] = span
        candidates = [(whole, labels, len(turns[0][0]))]
    else:
        candidates = [(prefix + span, [IGNORE] * len(prefix) + span, len(prefix)) for prefix, span in turns]
    examples = [
        {"input_ids": ids[:max_length], "labels": labels[:max_length]}
        for ids, labels, start in candidates
        if start < max_length  # at least one token of the turn fits
    ]
    return examples, one_sequence


def tokenise_prompt_response(rows: list[dict], tokenizer, max_length: int, origin: str = "") -> Tokenised:
    """SFT examples of checked rows (`normalise_row`): the prompt's tokens with IGNORE labels, then the response's
    tokens and EOS; a row that keeps no response token within ``max_length`` is dropped. A multi-turn
    conversation (a row with ``messages`` and no ``prompt``) goes through `tokenise_messages`."""
    examples, dropped, per_turn = [], 0, []
    for row in rows:
        if "prompt" not in row:  # a multi-turn conversation
            out, one_sequence = tokenise_messages(tokenizer, row["messages"], max_length, row_where(row, origin))
            examples += out
            dropped += not out
            if out and not one_sequence:
                per_turn.append((row.get("_origin", origin), row.get("_row", "?")))
            continue
        prompt_ids = encode_row_prompt(tokenizer, row, origin)
        completion_ids = encode_row_completion(tokenizer, row, "response", origin)
        input_ids = (prompt_ids + completion_ids)[:max_length]
        if len(input_ids) <= len(prompt_ids):
            dropped += 1  # nothing of the completion fits
            continue
        labels = [IGNORE] * len(prompt_ids) + completion_ids
        examples.append({"input_ids": input_ids, "labels": labels[: len(input_ids)]})
    return Tokenised(examples, dropped, per_turn=per_turn)


def tokenise_text_packed(rows: list[dict], tokenizer, max_length: int) -> Tokenised:
    """Concatenate `text + EOS` of every row and cut into `max_length` blocks (the last one may be shorter)."""
    stream: list[int] = []
    for row in rows:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        stream.extend(ids + [tokenizer.eos_token_id])
    blocks = [stream[i : i + max_length] for i in range(0, len(stream), max_length)]
    blocks = [b for b in blocks if len(b) > 1]
    return Tokenised([{"input_ids": b, "labels": list(b)} for b in blocks])


def _last_turn(row: dict, origin: str) -> dict:
    """A conversation as self-play reads it: the prompt is every message but the last, the response the last
    assistant message's text. Self-play generates plain text, so a conversation with tool calls is refused."""
    messages = row["messages"]
    if any(m["role"] == "tool" or "tool_calls" in m for m in messages):
        raise OxrlError(
            f"{row_where(row, origin)}: field 'messages': self-play compares one generated text answer with the "
            "last assistant message, and this conversation has tool calls; train it with sft"
        )
    return {**row, "prompt": messages[:-1], "response": messages[-1]["content"]}


def tokenise_preference(rows: list[dict], fmt: str, tokenizer, max_length: int, origin: str = "") -> Tokenised:
    """Preference-loop examples: ``prompt_ids`` plus completion ids that each end with EOS.

    ``preference`` -> ``chosen_ids``, ``rejected_ids``; ``unpaired`` -> ``completion_ids``,
    ``label``; ``prompt_response`` (self-play) -> ``chosen_ids`` (the rejected one is generated).
    A completion is cut so that prompt + completion fits ``max_length``; a row whose prompt
    leaves no room for a completion token is dropped. A pair whose chosen and rejected are the
    same tokens after that cut is dropped and listed in ``identical``: its loss has no gradient
    towards either side (DPO's stays at log 2), so training on it only dilutes the batch.
    """
    fields = {"preference": ("chosen", "rejected"), "unpaired": ("completion",), "prompt_response": ("response",)}[fmt]
    examples, dropped, identical = [], 0, []
    for row in rows:
        if "prompt" not in row:  # a multi-turn conversation: self-play's chosen answer is its last turn
            row = _last_turn(row, origin)
        prompt_ids = encode_row_prompt(tokenizer, row, origin)
        room = max_length - len(prompt_ids)
        if room < 1:
            dropped += 1
            continue
        ex = {"prompt_ids": prompt_ids, "_row": row.get("_row")}
        for name in fields:
            key = "chosen_ids" if name == "response" else f"{name}_ids"
            ex[key] = encode_row_completion(tokenizer, row, name, origin)[:room]
        if fmt == "preference" and ex["chosen_ids"] == ex["rejected_ids"]:
            identical.append((row.get("_origin", origin), row.get("_row", "?")))
            continue
        if fmt == "unpaired":
            ex["label"] = row["label"]
        examples.append(ex)
    return Tokenised(examples, dropped, identical)


def prepare_examples(source: Source, fmt: str, tokenizer, max_length: int, self_play: bool = False) -> Tokenised:
    """Validated, tokenised examples; each carries ``_source`` (its part of a mixture; 0 otherwise).

    Every row check happens here, when the data loads: the fields (`normalise_row`), a prompt or a
    completion that encodes to no tokens, pairs with nothing to prefer. The parts of a mixture are
    tokenised one by one, so CPT blocks never span two sources.
    """
    if not source.rows:
        raise OxrlError(f"{source.origin}: no rows")
    by_part: dict[int, list[dict]] = {}
    for r in source.rows:
        by_part.setdefault(r.get("_source", 0), []).append(normalise_row(r, fmt, source.origin))
    examples, dropped, identical, per_turn = [], 0, [], []
    for part, rows in by_part.items():
        if fmt in ("preference", "unpaired") or self_play:
            out = tokenise_preference(rows, fmt, tokenizer, max_length, source.origin)
        elif fmt == "prompt_response":
            out = tokenise_prompt_response(rows, tokenizer, max_length, source.origin)
        elif fmt == "text":
            out = tokenise_text_packed(rows, tokenizer, max_length)
        else:
            raise OxrlError(f"the supervised and preference loops cannot train on '{fmt}' rows")
        if not out.examples:
            raise _nothing_left(rows[0].get("_origin", source.origin), out, max_length)
        examples += [{**ex, "_source": part} for ex in out.examples]
        dropped += out.dropped
        identical += out.identical
        per_turn += out.per_turn
    return Tokenised(examples, dropped, identical, per_turn)


def _nothing_left(origin: str, out: Tokenised, max_length: int) -> OxrlError:
    """Why a source has no usable row left, and what to change."""
    if not out.identical:
        return OxrlError(f"{origin}: every row was longer than data.max_length={max_length} in its prompt")
    same = (
        f"{len(out.identical)} pairs have chosen equal to rejected (after truncation to data.max_length={max_length}: "
    )
    reasons = [f"{same}{rows_text(out.identical)})"]
    if out.dropped:
        reasons.append(f"{out.dropped} prompts fill data.max_length")
    return OxrlError(
        f"{origin}: no usable preference pair: {'; '.join(reasons)}. Check the chosen/rejected fields "
        f"(a pair needs two different answers), or raise data.max_length if they differ only past it"
    )


# ----------------------------------------------------------------------------- batching


class BatchPlan:
    """Deterministic micro-batches: the k-th micro-batch depends only on (seed, k).

    That is what makes resume exact: the data position is one integer. With
    `group_by_length`, rows are shuffled, cut into windows of 64 micro-batches,
    sorted by length inside a window, split into micro-batches, and the
    micro-batch order is shuffled again.
    """

    WINDOW = 64

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group_by_length: bool = True):
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.group_by_length = group_by_length
        self._cache: dict[int, list[list[int]]] = {}

    def epoch(self, epoch: int) -> list[list[int]]:
        if epoch not in self._cache:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            order = list(range(len(self.lengths)))
            rng.shuffle(order)
            batches: list[list[int]] = []
            if self.group_by_length:
                window = self.batch_size * self.WINDOW
                for start in range(0, len(order), window):
                    chunk = sorted(order[start : start + window], key=lambda i: -self.lengths[i])
                    batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
                rng.shuffle(batches)
            else:
                batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
            self._cache = {epoch: batches}
        return self._cache[epoch]

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def micro_batch(self, k: int) -> list[int]:
        epoch, index = divmod(k, self.batches_per_epoch)
        return self.epoch(epoch)[index]

    def counts(self, indices: list[int]) -> dict[str, float]:
        """Per-source counts of a batch (``data/<name>``); one source has none."""
        return {}


class MixturePlan:
    """Micro-batches drawn from several sources by their ratios; the k-th depends only on (seed, k).

    Every row slot j = k·batch_size + b picks its source at random with probability
    ratio_s / Σ ratios (a seeded generator per block of slots), so a 3:1 mix draws about
    3:1 whatever the sources' sizes. The c-th draw from source s is row ``perm_s,e[c mod n_s]``
    of a seeded shuffle per pass e = c // n_s: a source is walked in shuffled passes, and a
    small source repeats. Like `BatchPlan`, the data position is one integer, so `--resume`
    continues exactly where the run stopped.
    """

    BLOCK = 1 << 14  # row slots per block of source choices

    def __init__(self, sources_of: list[int], parts: list, batch_size: int, seed: int):
        import numpy as np

        self.np = np
        self.names = [p.name for p in parts]
        self.members = [np.flatnonzero(np.asarray(sources_of) == s) for s in range(len(parts))]
        for part, members in zip(parts, self.members):
            if len(members) == 0:
                raise OxrlError(f"{part.origin}: no usable rows in this source of the mixture")
        ratios = np.array([p.ratio for p in parts], dtype=np.float64)
        self.probs = ratios / ratios.sum()
        self.batch_size, self.seed = batch_size, seed
        self.total = len(sources_of)
        self._starts = [np.zeros(len(parts), dtype=np.int64)]  # draws per source before block m
        self._blocks: dict[int, tuple] = {}
        self._perms: dict[tuple[int, int], object] = {}

    @property
    def batches_per_epoch(self) -> int:
        return -(-self.total // self.batch_size)

    def _block(self, m: int):
        """(source of each slot, the draw number of each slot within its source) for block m."""
        if m not in self._blocks:
            np = self.np
            while len(self._starts) <= m:  # draws before each block, accumulated block by block
                choice = np.random.default_rng([self.seed, len(self._starts) - 1]).choice(
                    len(self.probs), self.BLOCK, p=self.probs
                )
                self._starts.append(self._starts[-1] + np.bincount(choice, minlength=len(self.probs)))
            choice = np.random.default_rng([self.seed, m]).choice(len(self.probs), self.BLOCK, p=self.probs)
            draw = np.empty(self.BLOCK, dtype=np.int64)
            for s in range(len(self.probs)):
                where = np.flatnonzero(choice == s)
                draw[where] = self._starts[m][s] + np.arange(len(where))
            self._blocks = {m: (choice, draw)}
        return self._blocks[m]

    def _row(self, source: int, draw: int) -> int:
        members = self.members[source]
        epoch, index = divmod(int(draw), len(members))
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[key] = self.np.random.default_rng([self.seed, 1 + source, epoch]).permutation(members)
        return int(self._perms[key][index])

    def micro_batch(self, k: int) -> list[int]:
        rows = []
        for j in range(k * self.batch_size, (k + 1) * self.batch_size):
            m, offset = divmod(j, self.BLOCK)
            choice, draw = self._block(m)
            rows.append(self._row(int(choice[offset]), int(draw[offset])))
        return rows

    def source_of(self, index: int) -> int:
        for s, members in enumerate(self.members):
            pos = self.np.searchsorted(members, index)
            if pos < len(members) and members[pos] == index:
                return s
        raise IndexError(index)

    def counts(self, indices: list[int]) -> dict[str, float]:
        """``data/<name>``: how many rows of the batch came from each source."""
        found = [0] * len(self.names)
        for i in indices:
            found[self.source_of(i)] += 1
        return {f"data/{name}": float(n) for name, n in zip(self.names, found)}


def make_plan(
    source: Source, sources_of: list[int], lengths: list[int], batch_size: int, seed: int, group_by_length: bool
):
    """A `BatchPlan` for one source, a `MixturePlan` for several (length grouping does not apply to a mix)."""
    if source.parts is not None and len(source.parts) > 1:
        return MixturePlan(sources_of, source.parts, batch_size, seed)
    return BatchPlan(lengths, batch_size, seed, group_by_length)


def token_budget_batches(lengths: list[int], budget: int, packing: bool = False, unit: int = 1) -> list[list[int]]:
    """Positions ``0..len(lengths)-1`` split into micro-batches that each fit a token budget.

    A micro-batch costs what its forward pass holds: the padded width times its rows
    (``rows · max length``), or with ``packing`` the sum of its lengths. Units of ``unit``
    consecutive positions (an RL group whose loss compares its samples) stay together.
    The units are taken longest first, so rows of similar length share a micro-batch and
    padding stays small; the greedy fill starts a new micro-batch when the next unit would
    exceed ``budget``. A unit longer than the budget on its own gets a micro-batch of its own.
    Which micro-batch a row lands in never changes the gradient: the loops weight each
    micro-batch's mean loss by its share of the optimiser batch's loss tokens (or rows).
    """
    units = [list(range(u, min(u + unit, len(lengths)))) for u in range(0, len(lengths), unit)]
    units.sort(key=lambda rows: -max(lengths[i] for i in rows))  # stable: ties keep their order
    batches: list[list[int]] = []
    current: list[int] = []
    for rows in units:
        trial = current + rows
        width = [lengths[i] for i in trial]
        cost = sum(width) if packing else len(trial) * max(width)
        if current and cost > budget:
            batches.append(current)
            trial = rows
        current = trial
    if current:
        batches.append(current)
    return batches


def regroup_by_tokens(picks: list[list[int]], length_of, budget: int, packing: bool = False) -> list[list[int]]:
    """The rows of one optimiser step (``picks``: its micro-batches of row indices) regrouped into
    micro-batches of at most ``budget`` tokens (`token_budget_batches`; ``length_of(row)`` is a row's
    tokens). ``budget`` 0 keeps ``picks`` as they are (a fixed number of rows per micro-batch)."""
    if budget <= 0:
        return picks
    rows = [i for idx in picks for i in idx]
    return [[rows[j] for j in batch] for batch in token_budget_batches([length_of(i) for i in rows], budget, packing)]


def collate(examples: list[dict], pad_id: int, packing: bool = False) -> dict:
    """Pad to the longest row (right padding), or pack all rows into one row.

    Packed: ``input_ids`` (1, ΣL) with ``position_ids`` restarting at 0 for each
    row and no attention mask; transformers then builds a block-diagonal causal
    mask, so rows cannot see each other — but only when the forward pass has no
    KV cache: call the model with ``use_cache=False``. The first token of each row gets no
    label, so no row is trained to predict the next row. The row boundaries also come as
    transformers' varlen keys (``cu_seq_lens_q/k`` (R+1,) int32, ``max_length_q/k``), so
    flash-attention and `packed_attention.PACKED_SDPA` attend row by row instead of through that mask.
    """
    import torch

    if packing:
        ids, labels, pos, bounds = [], [], [], [0]
        for ex in examples:
            ids += ex["input_ids"]
            labels += [IGNORE] + ex["labels"][1:]
            pos += list(range(len(ex["input_ids"])))
            bounds.append(bounds[-1] + len(ex["input_ids"]))
        cu_seq_lens = torch.tensor(bounds, dtype=torch.int32)
        longest = max(len(ex["input_ids"]) for ex in examples)
        return {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([pos]),
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": longest,
            "max_length_k": longest,
        }
    width = max(len(ex["input_ids"]) for ex in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        input_ids[i, :n] = torch.tensor(ex["input_ids"])
        labels[i, :n] = torch.tensor(ex["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
