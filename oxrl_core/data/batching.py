"""Micro-batches: deterministic plans (the data position is one integer), mixtures by ratio, token budgets,
and the collator (padded or packed).
"""

from __future__ import annotations

import random

from oxrl_core.data.encode import IGNORE
from oxrl_core.data.images import collate_pixels
from oxrl_core.data.sources import Source
from oxrl_core.errors import OxrlError
from oxrl_core.seeds import stream_seed

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
            rng = random.Random(stream_seed(self.seed, "plan", epoch=epoch))
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


def collate(examples: list[dict], pad_id: int, packing: bool = False, host: bool = False) -> dict:
    """Pad to the longest row (right padding), or pack all rows into one row.

    Packed: ``input_ids`` (1, ΣL) with ``position_ids`` restarting at 0 for each
    row and no attention mask; transformers then builds a block-diagonal causal
    mask, so rows cannot see each other — but only when the forward pass has no
    KV cache: call the model with ``use_cache=False``. The first token of each row gets no
    label, so no row is trained to predict the next row. The row boundaries also come as
    transformers' varlen keys (``cu_seq_lens_q/k`` (R+1,) int32, ``max_length_q/k``), so
    flash-attention and `packed_attention.PACKED_SDPA` attend row by row instead of through that mask.

    A VLM's rows also bring their image inputs (`images.collate_pixels`). Packed image rows are exact only where
    the loop also gives the model each row's own rotary positions (`vision.packed_position_ids`, Qwen-VL); the
    loops pad image rows of the other families (`loops.setup.Setup.packing_for`).

    ``host``: also what the host knows, so that no training step reads it back from the device: ``scored_rows``,
    ``scored_pos`` (M,) the positions t whose next token t+1 carries a label, ``n_scored`` (M) and
    ``n_tokens`` (the real tokens) as ints; packed, ``oxrl_row_bounds``, the row boundaries as a tuple of ints
    (`packed_attention` attends row by row from it).
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
        known = {"oxrl_row_bounds": tuple(bounds), **scored_positions([labels]), "n_tokens": len(ids)}
        return {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([pos]),
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": longest,
            "max_length_k": longest,
            **(known if host else {}),
            # a VLM's rows: their pixels, per-token inputs as one row (Qwen-VL's rotary positions: the loop's)
            **collate_pixels(examples, 0, packed=True),
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
    # a VLM's rows: their pixels and per-token image inputs, row by row (`images.collate_pixels`)
    pixels = collate_pixels(examples, width)
    known = {
        **scored_positions([ex["labels"] for ex in examples]),
        "n_tokens": sum(len(ex["input_ids"]) for ex in examples),
    }
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        **(known if host else {}),
        **pixels,
    }


def scored_positions(labels: list[list[int]]) -> dict:
    """From the rows' label lists (on the host): ``scored_rows``, ``scored_pos`` (M,) the (row, t) whose next token
    t+1 is labelled — ``(labels[:, 1:] != IGNORE).nonzero()`` without a device read — and ``n_scored`` = M."""
    import torch

    rows, pos = [], []
    for i, row in enumerate(labels):
        for t in range(len(row) - 1):
            if row[t + 1] != IGNORE:
                rows.append(i)
                pos.append(t)
    return {
        "scored_rows": torch.tensor(rows, dtype=torch.long),
        "scored_pos": torch.tensor(pos, dtype=torch.long),
        "n_scored": len(rows),
    }
