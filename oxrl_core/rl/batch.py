"""What the RL loop does with prompts and samples, below the loop itself (`loops.rl`).

Prompts in, checked completions out (`check_completions`), the right-padded rollout batch
(`rollout_tensors`, `rollout_batch`), the policy's per-token logprobs on it (`policy_forward`: on
padded rows, or with each prompt computed once per micro-batch, `token_logprobs_shared`), how a
rollout batch is cut into micro-batches (`MicroBatches`), and the data-parallel helpers that
generate and score a batch across ranks.

Per-token tensors are (B, T) over next-token positions of the right-padded prompt+completion
rows: position t scores token t+1, ``mask`` is 1 where that token is a completion token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from oxrl_core.data.batching import token_budget_batches
from oxrl_core.data.encode import check_row_images, encode_row_prompt, image_fields
from oxrl_core.data.images import check_image_row, collate_pixels
from oxrl_core.data.rows import normalise_row
from oxrl_core.data.sources import can_verify
from oxrl_core.engines.distributed import all_gather_object, broadcast_object, is_main, rank, world_size
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import SamplingParams, generate_from
from oxrl_core.models.packed_attention import SHARED_PREFIX, shared_prefix_mask
from oxrl_core.models.token_head import on_grid, token_stats
from oxrl_core.scoring.rewards import Failures, score_batch
from oxrl_core.seeds import stream_seed

# ----------------------------------------------------------------------------- prompts and rollouts


def prepare_prompts(source, tokenizer, max_length: int, vision=None) -> Prompts:
    """Rows checked as prompt rows, their prompt token ids (and image inputs), and how many were too long (dropped).

    ``vision`` (a VLM run's processing, `vision.VLMProcessing`): every prompt goes through the model's processor
    (`encode.image_fields`), and an image row's example keeps its image inputs (and its ``pictures``, for a backend
    that expands images itself). Image rows are checked as the other
    loops check them (`images.check_image_row`, `encode.check_row_images`: a text model refuses them, naming the
    row)."""
    if not source.rows:
        raise OxrlError(f"{source.origin}: no rows")
    rows, ids, media, dropped = [], [], [], 0
    for raw in source.rows:
        n_images = check_image_row(raw, source.origin)
        row = check_row_images(normalise_row(raw, "prompt", source.origin), "prompt", source.origin, vision, n_images)
        if vision is not None:
            prompt_ids, fields = image_fields(vision, row, source.origin, max_length, pictures=True)
        else:  # 0 tokens: refused here, naming file and row
            prompt_ids, fields = encode_row_prompt(tokenizer, row, source.origin), {}
        if len(prompt_ids) >= max_length:
            dropped += 1
            continue
        rows.append({"_origin": source.origin, **row})  # relative image paths are read beside its file
        ids.append(prompt_ids)
        media.append(fields)
    if not rows:
        raise OxrlError(f"{source.origin}: every prompt is longer than data.max_length={max_length}")
    return Prompts(rows, ids, media, dropped)


@dataclass
class Prompts:
    """A prompt source, checked and encoded (`prepare_prompts`)."""

    rows: list[dict]
    ids: list[list[int]]  # (P,) each prompt's token ids
    media: list[dict]  # (P,) each prompt's media record: its image inputs, {} for a text prompt
    dropped: int  # prompts longer than data.max_length, left out

    def media_of(self, picks: list[int]) -> list[dict]:
        """The media records of the prompts ``picks`` (references, not copies)."""
        return [self.media[i] for i in picks]

    @property
    def has_media(self) -> bool:
        """Whether any prompt brings media (an image run)."""
        return any(self.media)


def step_sampling(ro, seed: int, step: int) -> SamplingParams:
    """An RL step's sampling (``rollout.n`` samples per prompt); its seed depends on the step only, so a batch
    generated ahead (asynchronous rollouts) or after a resume samples what it would have in a plain run."""
    return SamplingParams(ro.n, ro.max_new_tokens, ro.temperature, ro.top_p, stream_seed(seed, "rollout", step=step))


def check_completions(groups, n: int, max_new_tokens: int, eos_id: int, backend: str) -> None:
    """Catch a broken backend before its output is trained on: wrong counts, text after EOS, missing EOS.

    (A padding token *inside* a completion is not an error: a policy may sample it like any token.)
    """
    for p, group in enumerate(groups):
        if len(group) != n:
            raise OxrlError(
                f"rollout backend '{backend}': prompt {p + 1} of the batch got {len(group)} completions, expected {n}"
            )
        for s, c in enumerate(group):
            where = f"rollout backend '{backend}': prompt {p + 1} of the batch, sample {s + 1}"  # 1-based, as rows are
            if not c.token_ids or len(c.token_ids) > max_new_tokens:
                raise OxrlError(f"{where}: {len(c.token_ids)} tokens (expected 1..{max_new_tokens})")
            if len(c.logprobs) != len(c.token_ids):
                raise OxrlError(f"{where}: {len(c.logprobs)} logprobs for {len(c.token_ids)} tokens")
            if eos_id in c.token_ids[:-1]:
                raise OxrlError(f"{where}: tokens after EOS (the completion was not cut at its end)")
            if c.finish_reason == "stop" and c.token_ids[-1] != eos_id:
                raise OxrlError(f"{where}: finished ('stop') but does not end with EOS {eos_id}")
            if c.finish_reason == "length" and c.token_ids[-1] == eos_id:
                raise OxrlError(f"{where}: ends with EOS but is marked as cut at the length limit")


class HostRow(NamedTuple):
    """What the host knows of one row of the rollout batch, so that the update never reads it back from the device."""

    ids: list[int]  # the row's tokens, prompt + completion, unpadded (its length: attention_mask's 1s)
    prompt_len: int
    group: int  # the prompt it samples (``group``)
    scored: list[int]  # the positions t whose next token is trained on (``mask`` > 0)
    loss_tokens: float  # Σ_t mask: the row's weight in a token-mean loss


def host_rows(prompt_ids: list[list[int]], completions, n: int) -> list[HostRow]:
    """`HostRow` of each sample (B): its prompt ``prompt_ids[i]``, its completion, the ``n`` samples of a prompt
    contiguous; the scored positions are those `rollout_tensors` sets in ``mask``."""
    rows = []
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        start = len(p) - 1  # position start + j predicts completion token j
        sampled = [1] * len(c.token_ids) if c.sampled is None else c.sampled
        scored = [start + j for j, s in enumerate(sampled) if s > 0]
        rows.append(HostRow(p + c.token_ids, len(p), i // n, scored, float(sum(sampled))))
    return rows


def rows_from_tensors(mb: dict) -> list[HostRow]:
    """`HostRow` of each row of a micro-batch that came without them (read from its tensors: one device read each)."""
    ids, attn = mb["input_ids"].tolist(), mb["attention_mask"].sum(1).tolist()
    plen, group = mb["prompt_len"].tolist(), mb["group"].tolist()
    mask = mb["mask"].tolist() if "mask" in mb else None
    rows = []
    for i in range(len(ids)):
        scored = list(range(plen[i] - 1, attn[i] - 1)) if mask is None else [t for t, m in enumerate(mask[i]) if m > 0]
        weight = float(len(scored)) if mask is None else float(sum(mask[i]))
        rows.append(HostRow(ids[i][: attn[i]], plen[i], group[i], scored, weight))
    return rows


def rollout_tensors(prompt_ids: list[list[int]], completions, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows and the per-token tensors of the sampled tokens.

    prompt_ids[i], completions[i] for i in 0..B-1 ->
      input_ids, attention_mask (B, L); mask, logp_rollout (B, L-1)
    """
    lengths = [len(p) + len(c.token_ids) for p, c in zip(prompt_ids, completions)]
    B, L = len(lengths), max(lengths)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1))
    logp_rollout = torch.zeros((B, L - 1))
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        start, end = len(p), len(p) + len(c.token_ids)
        input_ids[i, :end] = torch.tensor(p + c.token_ids)
        attention_mask[i, :end] = 1
        # position t predicts token t+1; in a multi-turn episode only the model's own tokens are scored
        mask[i, start - 1 : end - 1] = 1 if c.sampled is None else torch.tensor(c.sampled, dtype=mask.dtype)
        logp_rollout[i, start - 1 : end - 1] = torch.tensor(c.logprobs)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "mask": mask, "logp_rollout": logp_rollout}


def check_no_padding_holes(batch: dict[str, torch.Tensor], multi_turn: bool = False) -> None:
    """Each row must be tokens then padding: attention 1…1 0…0, the loss mask inside the attended part,
    and the loss mask one contiguous run (the completion; at least one run, one per model turn, in a
    multi-turn episode). A hole would train on padding or hide tokens."""
    attn = batch["attention_mask"]  # (B, L)
    holes = (attn[:, 1:] > attn[:, :-1]).any(dim=1)  # a 0 followed by a 1
    mask = batch["mask"]  # (B, L-1)
    outside = ((mask > 0) & (attn[:, 1:] == 0)).any(dim=1)
    starts = (mask[:, 1:] > mask[:, :-1]).sum(dim=1) + (mask[:, 0] > 0).long()  # runs of ones
    bad = holes | outside | ((starts < 1) if multi_turn else (starts != 1))
    if bad.any():
        row = int(bad.nonzero()[0])
        raise OxrlError(
            f"rollout batch row {row}: padding hole (attention/loss mask not one contiguous run); "
            "the batch is not trained on"
        )


def token_logprobs(
    model,
    input_ids,
    attention_mask,
    temperature: float,
    want_hidden: bool = False,
    where=None,
    media: list[dict] | None = None,
    scored: list[list[int]] | None = None,
):
    """logp (B, L-1) of each next token under logits / temperature, entropy (B, L-1), last hidden state (B, L, H).

    Computed where ``where`` (B, L-1) is non-zero (default: every attended next token), 0 elsewhere;
    only those positions meet the LM head, chunk by chunk (`token_head`). ``scored``: those positions of each
    row as the host knows them (`HostRow.scored`; no device read to find them). ``media``: each row's media record
    (a VLM's image inputs; {} for a text row), joined row by row (`images.collate_pixels`: nothing for text rows)
    and given to the model."""
    if scored is not None:
        rows = torch.tensor([i for i, at in enumerate(scored) for _ in at], dtype=torch.long)  # (M,)
        pos = torch.tensor([t for at in scored for t in at], dtype=torch.long)  # (M,)
        rows, pos = rows.to(input_ids.device), pos.to(input_ids.device)
    else:
        where = attention_mask[:, 1:] if where is None else where
        rows, pos = (where > 0).nonzero(as_tuple=True)  # (M,), (M,)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    pixels = collate_pixels(media or [], input_ids.shape[1])
    inputs.update({k: v.to(input_ids.device) for k, v in pixels.items()})
    stats = token_stats(
        model,
        inputs,
        rows,
        pos,
        input_ids[rows, pos + 1],
        temperature=temperature,
        entropy=True,
        hidden=want_hidden,
    )
    shape = (input_ids.shape[0], input_ids.shape[1] - 1)
    return on_grid(stats["logp"], rows, pos, shape), on_grid(stats["entropy"], rows, pos, shape), stats.get("hidden")


def shared_prompt_row(rows: list[HostRow]) -> dict:
    """A micro-batch of rollout rows as one packed row in which the samples of a prompt share it.

    Rows with the same ``group`` have the same prompt (``prompt_len`` tokens); each group becomes a
    segment ``[prompt, completion_1, ..., completion_k]`` (`packed_attention.SHARED_PREFIX`), the
    completions at the positions they have after the prompt, each without its last token (whose
    logits would predict nothing). ``scored``: (row, column, at) of each completion token, by sample row, its
    column in the (B, L-1) grid and the position in the packed row whose logits predict it — lists, from the host.
    """
    members: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        members.setdefault(row.group, []).append(i)
    flat, positions, segments = [], [], []
    at = {}  # (row, column) -> its position in the packed row
    for group in members.values():
        start, p = len(flat), rows[group[0]].prompt_len
        flat += rows[group[0]].ids[:p]
        positions += list(range(p))
        lengths = []
        for i in group:
            c = len(rows[i].ids) - p  # completion tokens of row i
            offset = len(flat)
            # the completion's last token predicts nothing: only its first c-1 tokens are inputs
            flat += rows[i].ids[p : p + c - 1]
            positions += list(range(p, p + c - 1))
            lengths.append(c - 1)
            # position p-1 (the prompt's last token) predicts the first completion token, then the completion's own
            at[i, p - 1] = start + p - 1
            at.update({(i, p + j): offset + j for j in range(c - 1)})
        segments.append((start, p, tuple(lengths)))
    order = sorted(at)  # row by row, column by column
    return {
        "input_ids": torch.tensor([flat]),
        "position_ids": torch.tensor([positions]),
        SHARED_PREFIX: segments,
        "scored": ([i for i, _ in order], [t for _, t in order], [at[k] for k in order]),
    }


def token_logprobs_shared(model, mb: dict, temperature: float):
    """`token_logprobs` with each prompt computed once per micro-batch: logp, entropy (B, L-1), set at
    completion-predicting positions (0 elsewhere, where nothing reads them). The packed row is laid out on the
    host from ``mb["host"]`` (`HostRow`; read from the tensors when absent)."""
    device = mb["input_ids"].device
    row = shared_prompt_row(mb["host"] if "host" in mb else rows_from_tensors(mb))
    # the scored tokens, by sample row and column, and where in the packed row each is predicted (a prompt's last
    # token: once per sample)
    rows, cols, at = (torch.tensor(v, dtype=torch.long, device=device) for v in row["scored"])  # (M,) each
    inputs = {
        "input_ids": row["input_ids"].to(device),
        "position_ids": row["position_ids"].to(device),
        "attention_mask": shared_prefix_mask(device),  # no mask to build, no packed rows to look for
        SHARED_PREFIX: row[SHARED_PREFIX],
    }
    stats = token_stats(
        model, inputs, torch.zeros_like(at), at, mb["input_ids"][rows, cols + 1], temperature=temperature, entropy=True
    )
    B, L = mb["input_ids"].shape
    return on_grid(stats["logp"], rows, cols, (B, L - 1)), on_grid(stats["entropy"], rows, cols, (B, L - 1))


# ----------------------------------------------------------------------------- data parallelism


def sync_weights(backend, model, version: int) -> None:
    """The weight sync; with rollout actors only rank 0 holds them (``backend`` is None elsewhere)."""
    if backend is not None:
        backend.update_weights(model, version)


def generate_sharded(
    backend, engine, prompts: list[list[int]], sampling: SamplingParams, shards: int, media: list[dict]
):
    """The rollout batch's groups, generated in ``shards`` seeded shards of whole prompts that are dealt
    to the ranks in contiguous blocks (each rank samples its own on whole weights) and gathered on
    every rank. The samples depend on ``shards``, not on the world size; one shard in one process is
    one ``generate`` call with ``sampling``. With rollout actors (``rollout.actors``) rank 0 has the
    actors generate every shard and broadcasts the result. ``media``: each prompt's media record ({}: text)."""
    if backend is None or backend.remote:
        parts = backend.generate_shards(seeded_shards(prompts, sampling, shards, media)) if is_main() else None
        return [group for part in broadcast_object(parts) for group in part]
    per_rank, local = shards // world_size(), []
    with engine.full_weights():
        for shard in seeded_shards(prompts, sampling, shards, media)[rank() * per_rank : (rank() + 1) * per_rank]:
            local += generate_from(backend, *shard)
    return [group for part in all_gather_object(local) for group in part]


def seeded_shards(prompts: list[list[int]], sampling: SamplingParams, shards: int, media: list[dict]):
    """The rollout batch cut into ``shards`` contiguous shards of whole prompts, shard k sampling with the batch's
    seed moved to shard k (`stream_seed`; shard 0 keeps the unsharded seed): (prompts, sampling, each prompt's media
    record) each. Whoever generates a shard calls the backend through `interfaces.generate_from` (in-process and in
    the rollout actors), which calls it as for text when a shard's records are all empty."""
    size = len(prompts) // shards
    seeds = [None if sampling.seed is None else stream_seed(sampling.seed, shard=k) for k in range(shards)]
    return [
        (
            prompts[k * size : (k + 1) * size],
            replace(sampling, seed=seeds[k]),
            media[k * size : (k + 1) * size],
        )
        for k in range(shards)
    ]


def score_sharded(
    reward, prompts: list, texts: list[str], rows: list[dict], failures: Failures
) -> tuple[list[float], dict[str, float]]:
    """`score_batch` of this rank's block of samples; the scores gathered on every rank and the metrics
    recomputed over the whole batch (mean, population std; errors and timeouts are row counts); every
    rank's failures added to ``failures``."""
    if world_size() == 1:
        return score_batch(reward, prompts, texts, rows, failures)
    per_rank = len(texts) // world_size()
    mine = slice(rank() * per_rank, (rank() + 1) * per_rank)
    local = Failures(failures.name)
    parts = all_gather_object((*score_batch(reward, prompts[mine], texts[mine], rows[mine], local), local))
    for _, _, part_failures in parts:
        failures.merge(part_failures)
    parts = [(part, m) for part, m, _ in parts]
    scores = [s for part, _ in parts for s in part]
    metrics = {k: sum(m[k] * len(part) for part, m in parts) / len(scores) for k in parts[0][1]}  # row-weighted means
    mean = sum(scores) / len(scores)
    metrics["reward/mean"] = mean
    metrics["reward/std"] = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    for count in ("reward/errors", "reward/timeouts"):
        if count in metrics:
            metrics[count] = float(sum(m[count] for _, m in parts))
    return scores, metrics


# ----------------------------------------------------------------------------- evaluation


def rl_evaluate(
    backend,
    tokenizer,
    rows,
    prompt_ids,
    reward,
    dataset,
    ro,
    seed: int,
    media: list[dict],
    batch: int = 64,
    progress=None,
) -> dict:
    """The held-out prompts, answered greedily (``eval/reward``, and ``eval/accuracy`` when the data can
    check answers) and sampled as in training, ``rollout.n`` samples at ``rollout.temperature`` with a
    fixed seed (``eval/reward_sampled``: the expected reward of the policy, the quantity RL maximises).
    ``progress(done, total)`` counts the completions (a `progress.Reporter.counter` update); ``media``: each
    prompt's media record ({}: a text prompt)."""
    if not rows:
        return {}
    metrics = {}
    modes = {"": SamplingParams(n=1, max_new_tokens=ro.max_new_tokens, temperature=0.0)}
    if ro.temperature > 0:
        modes["_sampled"] = SamplingParams(ro.n, ro.max_new_tokens, ro.temperature, ro.top_p, stream_seed(seed, "eval"))
    update = progress or (lambda done, total=None: None)
    done, total = 0, len(prompt_ids) * sum(sampling.n for sampling in modes.values())
    update(done, total)
    for suffix, sampling in modes.items():
        texts: list[str] = []
        for start in range(0, len(prompt_ids), batch):
            part = media[start : start + batch]
            groups = generate_from(backend, prompt_ids[start : start + batch], sampling, part)
            texts += [tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]
            done += len(groups) * sampling.n
            update(done)
        sample_rows = [r for r in rows for _ in range(sampling.n)]
        scores, _ = score_batch(reward, [r["prompt"] for r in sample_rows], texts, sample_rows)
        metrics[f"eval/reward{suffix}"] = sum(scores) / len(scores)
        if not suffix and can_verify(dataset):
            metrics["eval/accuracy"] = sum(bool(dataset.verify(t, r)) for t, r in zip(texts, rows)) / len(rows)
    return metrics


def check_on_policy(completions, version: int, strict: bool, step: int) -> set[int]:
    """The policy versions the samples came from; strict on-policy mode refuses any but ``version``."""
    versions = {c.policy_version for c in completions}
    if strict and versions != {version}:
        raise OxrlError(
            f"step {step}: samples from policy version(s) {sorted(versions)} but the trainer is at version "
            f"{version}: the rollout backend missed a weight sync (strict on-policy). "
            f"Set rollout.strict_on_policy=false to allow stale samples."
        )
    return versions


def rollout_batch(
    prompts: list[list[int]], completions, scores: list[float], n: int, pad_id: int, engine, media: list[dict] = ()
) -> dict:
    """The rollout batch the update reads, on the trainer's device: `rollout_tensors` of each sample's prompt
    (B of them) and completion, plus ``rewards`` (B,), ``group_size`` (n), ``group`` (B,) the prompt of each
    sample, ``prompt_len`` (B,), ``host`` (B,) each row's `HostRow` (a list, selected with the rows), and ``media`` (B,) each
    sample's media record (its prompt's image inputs, {} for text): a list, selected with the rows
    (`MicroBatches.rows_of`) and joined per micro-batch by the forward (`token_logprobs`)."""
    batch = rollout_tensors(prompts, completions, pad_id)
    check_no_padding_holes(batch, multi_turn=any(c.sampled is not None for c in completions))
    device = engine.device
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["rewards"] = torch.tensor(scores, dtype=torch.float32, device=device)  # (B,)
    batch["group_size"] = n
    batch["group"] = torch.arange(len(completions), device=device) // n  # (B,)
    batch["prompt_len"] = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    batch["host"] = host_rows(prompts, completions, n)  # (B,) what the host knows of each row (`HostRow`)
    batch["media"] = list(media) or [{}] * len(completions)  # (B,) each row's media record (default: text rows)
    return batch


# ----------------------------------------------------------------------------- the policy forward, micro-batches


def policy_forward(model, critic, mb: dict, temperature: float, shared: bool = False):
    """The policy's logp, entropy (B, L-1) on a micro-batch (and the critic's values_new (B, L-1))."""
    if shared:
        logp, entropy = token_logprobs_shared(model, mb, temperature)
        return {"logp": logp, "entropy": entropy}
    want_hidden = critic is not None and critic.shared
    # logprobs at the completion tokens only (``mask``): the prompt's positions never meet the LM head
    scored = [row.scored for row in mb["host"]] if "host" in mb else None  # (B,) known on the host
    logp, entropy, hidden = token_logprobs(
        model, mb["input_ids"], mb["attention_mask"], temperature, want_hidden, mb["mask"], mb.get("media"), scored
    )
    out = {"logp": logp, "entropy": entropy}
    if critic is not None:
        out["values_new"] = critic(hidden, mb["input_ids"], mb["attention_mask"])[:, :-1]  # V(s_t) (B, L-1)
    return out


def chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)] if size > 0 else [indices]


class MicroBatches:
    """How one rollout batch of B rows is cut: micro-batches of ``rollout.micro_batch_size`` rows, or
    filled up to ``train.max_tokens_per_micro_batch`` tokens; whole groups of ``unit`` rows when the
    loss compares a group's samples."""

    def __init__(self, batch: dict, unit: int, micro: int, token_budget: int, shared: bool):
        self.batch, self.unit, self.micro, self.token_budget, self.shared = batch, unit, micro, token_budget, shared
        self.B = batch["input_ids"].shape[0]
        # (B,) prompt + completion tokens of each row, from the host where it came with the batch
        host = batch.get("host")
        self.lengths = [len(row.ids) for row in host] if host else batch["attention_mask"].sum(1).tolist()

    def __call__(self, rows: list[int]) -> list[list[int]]:
        if self.token_budget > 0:
            parts = token_budget_batches([self.lengths[i] for i in rows], self.token_budget, self.shared, self.unit)
            return [[rows[j] for j in part] for part in parts]
        return chunks(rows, self.micro)

    def rows_of(self, idx: list[int]) -> dict:
        """The batch's per-row tensors (and per-row lists: ``media``, ``host``) at rows ``idx`` (scalars as they are)."""
        index = torch.tensor(idx, device=self.batch["input_ids"].device)
        B = self.B

        def select(v):
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == B:
                return v.index_select(0, index)
            return [v[i] for i in idx] if isinstance(v, list) and len(v) == B else v

        return {k: select(v) for k, v in self.batch.items()}

    def single(self) -> bool:
        """Whether the whole batch is one micro-batch."""
        return (self.micro == 0 or self.micro >= self.B) and (
            self.token_budget <= 0 or len(self(list(range(self.B)))) == 1
        )

    def for_scoring(self) -> list[list[int]]:
        """The micro-batches of a no-grad pass over every row."""
        every = list(range(self.B))
        return self(every) if (0 < self.micro < self.B or self.token_budget > 0) else [every]
