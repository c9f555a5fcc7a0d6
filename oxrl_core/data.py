"""The data layer: sources -> validated rows -> token ids -> batches.

Sources (``data.train`` / ``data.eval``): a local ``.jsonl``/``.json``/``.parquet``
file, a directory written by ``datasets.save_to_disk``, a dataset plugin name, or
a hub id (through ``datasets.load_dataset``); or a mapping ``{source, ratio, ...}``
whose other keys are the dataset plugin's options; or a list of those, mixed by
their ratios (`MixturePlan`). Every row is checked against the format the
algorithm consumes (DESIGN §5); a bad row is an `OxrlError` naming the file, the
row number (1-based; the line number for JSONL) and the field.

Tokenisation convention: the prompt goes through the chat template with the
generation prompt when the tokenizer has one (plain text otherwise); a
completion is its tokens without special tokens, then EOS; ``labels`` are -100
on prompt tokens. CPT (`text`) rows are packed into ``max_length`` blocks with
labels on every token.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Dataset

IGNORE = -100
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


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


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
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
    return rows


def _read_json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
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


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise OxrlError(f"{path}: cannot read Parquet: {exc}") from None
    return [{**row, "_row": i} for i, row in enumerate(table.to_pylist(), start=1)]


def _from_hf(ds, origin: str, split: str) -> list[dict]:
    from datasets import DatasetDict

    if isinstance(ds, DatasetDict):
        names = list(ds)
        pick = split if split in ds else ("test" if split == "eval" and "test" in ds else None)
        if pick is None:
            raise OxrlError(f"{origin}: has splits {names}, none of them is '{split}'")
        ds = ds[pick]
    return [{**row, "_row": i} for i, row in enumerate(ds, start=1)]


def load_source(spec: str, split: str, registry=None, options: dict | None = None, field: str = "data.train") -> Source:
    """Resolve one source string to rows; ``options`` go to a dataset plugin's ``Config``."""
    path = Path(spec).expanduser()
    is_plugin = not path.exists() and registry is not None and spec in registry.entries["dataset"]
    if options and not is_plugin:
        raise OxrlError(
            f"{field}.{next(iter(options))}: options apply to dataset plugins only, and '{spec}' is not one "
            "(a file, a directory or a hub id takes just `source` and `ratio`)"
        )
    if path.is_file():
        suffix = path.suffix.lower()
        readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
        if suffix not in readers:
            raise OxrlError(f"{path}: unsupported data file type '{suffix}' (use {', '.join(FILE_SUFFIXES)})")
        return Source(readers[suffix](path), str(path))
    if path.is_dir():
        try:
            from datasets import load_from_disk

            ds = load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001
            raise OxrlError(f"{path}: not a dataset saved with `datasets.save_to_disk` ({exc})") from None
        return Source(_from_hf(ds, str(path), split), str(path))
    if is_plugin:
        dataset = build_dataset(registry, spec, options or {}, field)
        try:
            rows = dataset.rows(split)
        except OxrlError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin failing is reported with its name
            raise OxrlError(f"dataset '{spec}' failed to produce its '{split}' split: {type(exc).__name__}: {exc}") from None
        return Source([{**r, "_row": i} for i, r in enumerate(rows, start=1)], f"dataset '{spec}'", dataset)
    looks_like_file = path.suffix.lower() in FILE_SUFFIXES or spec.startswith((".", "/", "~")) or spec.count("/") > 1
    if looks_like_file or "/" not in spec:
        hint = ""
        if registry is not None:
            import difflib

            close = difflib.get_close_matches(spec, registry.names("dataset"), n=1)
            hint = f" Did you mean dataset '{close[0]}'?" if close else ""
        raise OxrlError(f"data source not found: '{spec}' is neither a file nor a dataset plugin.{hint}")
    try:  # a hub id such as "openai/gsm8k"
        from datasets import load_dataset

        ds = load_dataset(spec)
    except Exception as exc:  # noqa: BLE001 - offline, missing, gated: all one message
        raise OxrlError(f"data source '{spec}': not a local file and could not be loaded from the hub: {exc}") from None
    return Source(_from_hf(ds, spec, split), spec)


def build_dataset(registry, name: str, options: dict, field: str):
    """The dataset plugin ``name`` with its options validated by its ``Config`` (errors name ``field.option``)."""
    from pydantic import ValidationError

    from oxrl_core.config import format_validation_error
    from oxrl_core.errors import PluginError
    from oxrl_core.interfaces import Dataset

    cls = registry.load("dataset", name)
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise PluginError(f"dataset '{name}': {cls!r} is not an oxrl_core.Dataset subclass")
    try:
        config = cls.Config.model_validate(options)
    except ValidationError as exc:
        raise format_validation_error(exc, cls.Config, f"dataset '{name}'", prefix=f"{field}.") from None
    try:
        return cls(config)
    except OxrlError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin that cannot start is reported with its name
        raise OxrlError(f"{field}: dataset '{name}' could not start: {type(exc).__name__}: {exc}") from None


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
    loaded = [(load_source(spec, split, registry, options, label), spec, ratio) for spec, ratio, options, label in specs]
    parts = [Part(_part_name(spec, taken), ratio, src.origin) for src, spec, ratio in loaded]
    if len(loaded) == 1:
        source = loaded[0][0]
        source.parts = parts
        return source
    rows = []
    for i, (src, _, _) in enumerate(loaded):
        rows += [{**r, "_source": i, "_origin": src.origin} for r in src.rows]
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
        if not Path(spec).expanduser().exists() and registry is not None and spec in registry.entries["dataset"]
    ]
    held_out = [s for s in (load_source(spec, "eval", registry, options, label) for spec, options, label in plugin_specs) if s.rows]
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
        from oxrl_core.evaluation import can_verify

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
#: completions that must not be empty (compared or judged, an empty one says nothing)
COMPLETIONS = {"preference": ("chosen", "rejected"), "unpaired": ("completion",)}


def _check_messages(value, where: str, field: str) -> None:
    if not isinstance(value, list) or not value:
        raise OxrlError(f"{where}: field '{field}' must be a non-empty list of {{role, content}} messages")
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise OxrlError(f"{where}: field '{field}[{j}]' must be an object with string 'role' and 'content'")


def normalise_row(row: dict, fmt: str, origin: str) -> dict:
    """Check `row` against `fmt`; return it with `prompt` (str or messages) and the format's fields."""
    where = f"{row.get('_origin', origin)}: row {row.get('_row', '?')}"
    if fmt == "prompt_response" and "messages" in row and "prompt" not in row:
        msgs = row["messages"]
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
            raise OxrlError(f"{where}: field 'prompt' must be a string or a list of messages, got {type(row['prompt']).__name__}")
    for field in REQUIRED[fmt]:
        if field in ("prompt", "label"):
            continue
        if not isinstance(row[field], str):
            raise OxrlError(f"{where}: field '{field}' must be a string, got {type(row[field]).__name__}")
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


@dataclass
class Tokenised:
    examples: list[dict]  # {"input_ids": [...], "labels": [...]}
    dropped: int = 0


def tokenise_prompt_response(rows: list[dict], tokenizer, max_length: int) -> Tokenised:
    examples, dropped = [], 0
    for row in rows:
        prompt_ids = encode_prompt(tokenizer, row["prompt"])
        completion_ids = encode_completion(tokenizer, row["response"])
        input_ids = (prompt_ids + completion_ids)[:max_length]
        if len(input_ids) <= len(prompt_ids):
            dropped += 1  # nothing of the completion fits
            continue
        labels = [IGNORE] * len(prompt_ids) + completion_ids
        examples.append({"input_ids": input_ids, "labels": labels[: len(input_ids)]})
    return Tokenised(examples, dropped)


def tokenise_text_packed(rows: list[dict], tokenizer, max_length: int) -> Tokenised:
    """Concatenate `text + EOS` of every row and cut into `max_length` blocks (the last one may be shorter)."""
    stream: list[int] = []
    for row in rows:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        stream.extend(ids + [tokenizer.eos_token_id])
    blocks = [stream[i : i + max_length] for i in range(0, len(stream), max_length)]
    blocks = [b for b in blocks if len(b) > 1]
    return Tokenised([{"input_ids": b, "labels": list(b)} for b in blocks])


def tokenise_preference(rows: list[dict], fmt: str, tokenizer, max_length: int) -> Tokenised:
    """Preference-loop examples: ``prompt_ids`` plus completion ids that each end with EOS.

    ``preference`` -> ``chosen_ids``, ``rejected_ids``; ``unpaired`` -> ``completion_ids``,
    ``label``; ``prompt_response`` (self-play) -> ``chosen_ids`` (the rejected one is generated).
    A completion is cut so that prompt + completion fits ``max_length``; a row whose prompt
    leaves no room for a completion token is dropped.
    """
    fields = {"preference": ("chosen", "rejected"), "unpaired": ("completion",), "prompt_response": ("response",)}[fmt]
    examples, dropped = [], 0
    for row in rows:
        prompt_ids = encode_prompt(tokenizer, row["prompt"])
        room = max_length - len(prompt_ids)
        if room < 1:
            dropped += 1
            continue
        ex = {"prompt_ids": prompt_ids, "_row": row.get("_row")}
        for field in fields:
            key = "chosen_ids" if field == "response" else f"{field}_ids"
            ex[key] = encode_completion(tokenizer, row[field])[:room]
        if fmt == "unpaired":
            ex["label"] = row["label"]
        examples.append(ex)
    return Tokenised(examples, dropped)


def prepare_examples(source: Source, fmt: str, tokenizer, max_length: int, self_play: bool = False) -> Tokenised:
    """Validated, tokenised examples; each carries ``_source`` (its part of a mixture; 0 otherwise).

    The parts of a mixture are tokenised one by one, so CPT blocks never span two sources.
    """
    if not source.rows:
        raise OxrlError(f"{source.origin}: no rows")
    by_part: dict[int, list[dict]] = {}
    for r in source.rows:
        by_part.setdefault(r.get("_source", 0), []).append(normalise_row(r, fmt, source.origin))
    examples, dropped = [], 0
    for part, rows in by_part.items():
        if fmt in ("preference", "unpaired") or self_play:
            out = tokenise_preference(rows, fmt, tokenizer, max_length)
        elif fmt == "prompt_response":
            out = tokenise_prompt_response(rows, tokenizer, max_length)
        elif fmt == "text":
            out = tokenise_text_packed(rows, tokenizer, max_length)
        else:
            raise OxrlError(f"the supervised and preference loops cannot train on '{fmt}' rows")
        if not out.examples:
            raise OxrlError(f"{rows[0].get('_origin', source.origin)}: every row was longer than data.max_length={max_length} in its prompt")
        examples += [{**ex, "_source": part} for ex in out.examples]
        dropped += out.dropped
    return Tokenised(examples, dropped)


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
                choice = np.random.default_rng([self.seed, len(self._starts) - 1]).choice(len(self.probs), self.BLOCK, p=self.probs)
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


def make_plan(source: Source, sources_of: list[int], lengths: list[int], batch_size: int, seed: int, group_by_length: bool):
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
