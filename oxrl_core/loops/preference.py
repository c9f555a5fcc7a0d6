"""The preference loop (offline preference algorithms: DPO, IPO, ORPO, KTO, SimPO, RM, SPIN, ...).

    rows -> (prompt, completion) sequences -> one forward pass of the policy over chosen and
         rejected together (and one of the reference, without gradients) -> per-sequence
         log-probabilities summed over completion tokens -> algorithm loss -> backward
         (micro-batches weighted by their share of rows) -> clip + optimiser step

It runs on the shared skeleton (`loops.run`: data position, checkpoints, metrics) and feeds the
algorithm per-sequence tensors (see `oxrl_core.interfaces.Algorithm`). Logits are computed
only at positions that predict a completion token (``logits_to_keep``), so the prompt costs
no vocabulary projection. With ``data.packing`` the 2B sequences of a micro-batch go through
the model as one padding-free row; with the default attention (sdpa) the chosen and rejected
responses of a pair also share one copy of their prompt, so each prompt is computed once.

Self-play algorithms (``self_play``, SPIN) take ``prompt_response`` rows: the chosen response is
the dataset's, the rejected one is generated for the prompt by the reference model, which is
the policy as it was at the start of the current iteration. An image row's rejected response is generated
from its prompt with the image (the backend gets the row's pixel inputs), and the pair trains with them as DPO's do.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from oxrl_core.data.batching import collate
from oxrl_core.data.encode import IGNORE, prepare_examples
from oxrl_core.data.images import image_fields_of, is_image_row
from oxrl_core.data.rows import row_where
from oxrl_core.data.sources import Source, can_verify, eval_source, load_data
from oxrl_core.engines.distributed import is_main, reduce_metrics, shard
from oxrl_core.engines.state_files import load_state_file
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import SamplingParams, generate_from
from oxrl_core.loops.run import ACCURACY, MODEL_INPUTS, Run, RunResult, StepSums, backward_share
from oxrl_core.loops.setup import Setup
from oxrl_core.models.loading import initial_policy_path, load_causal_lm, load_score_model, load_tokenizer
from oxrl_core.models.lora import is_peft, policy_state_dict
from oxrl_core.models.packed_attention import (
    PACKED_SDPA,
    SHARED_PREFIX,
    attention_fast_paths,
    packed_attn_implementation,
    shared_prefix_mask,
)
from oxrl_core.models.token_head import token_stats
from oxrl_core.scoring.evaluation import evaluate
from oxrl_core.seeds import stream_seed

REF_FILE = "ref.pt"  # self-play checkpoints keep the reference of the current iteration

# ----------------------------------------------------------------------------- sequences -> tensors


def collate_sequences(seqs: list[tuple], pad_id: int, packing: bool) -> dict:
    """(prompt ids, completion ids[, the prompt's image fields]) -> a model batch plus where each completion token is
    scored. A VLM's image fields (`encode.image_fields`) go with their prompt into every sequence that holds it.

    ``pred_index`` (M, 2): (row, position) whose logits predict completion token m, ``target``
    (M,) that token, ``owner`` (M,) its sequence; ``last`` (N, 2): (row, position) of each
    sequence's last token, where a scalar head is read.
    """
    examples = [{"input_ids": s[0] + s[1], "labels": [IGNORE] * len(s[0]) + s[1], **_image(s)} for s in seqs]
    batch = collate(examples, pad_id, packing, host=True)  # scored positions found on the host
    targets = batch["labels"][:, 1:]  # (R, T-1): position t predicts token t+1
    rows, pos = batch.pop("scored_rows"), batch.pop("scored_pos")  # (M,), (M,)
    del batch["n_scored"], batch["n_tokens"]
    if packing:
        bounds = batch["cu_seq_lens_q"].long()  # (N+1,)
        owner = torch.searchsorted(bounds, pos + 1, right=True) - 1  # the sequence token pos+1 belongs to
        last = torch.stack([torch.zeros_like(bounds[1:]), bounds[1:] - 1], dim=1)  # (N, 2)
    else:
        owner = rows
        last = torch.stack([torch.arange(len(seqs)), batch["attention_mask"].sum(1) - 1], dim=1)  # (N, 2)
    batch.update(
        pred_index=torch.stack([rows, pos], dim=1),
        target=targets[rows, pos],
        owner=owner,
        last=last,
        n_seqs=len(seqs),
        # (N,) the scored tokens of each sequence (labels[1:], as `targets`), counted on the host
        seq_tokens=torch.tensor([sum(label != IGNORE for label in ex["labels"][1:]) for ex in examples]),
    )
    return batch


def collate_shared_prompts(prompts: list[list[int]], chosen: list[list[int]], rejected: list[list[int]]) -> dict:
    """Pairs as one packed row of ``[prompt, chosen, rejected]`` segments: each prompt is computed once.

    The rejected tokens take the positions they would have right after the prompt, and attend to
    the prompt and to themselves only (`packed_attention.SHARED_PREFIX`), so every log-probability
    equals the one of ``prompt + response`` on its own. Sequences 0..B-1 are the chosen responses,
    B..2B-1 the rejected ones, as in `collate_sequences`.
    """
    B = len(prompts)
    ids, positions, pred, target, owner, last, segments = [], [], [], [], [], [], []
    for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected)):
        start = len(ids)
        ids += p + c + r
        positions += list(range(len(p) + len(c))) + list(range(len(p), len(p) + len(r)))
        segments.append((start, len(p), (len(c), len(r))))
        prompt_end = start + len(p) - 1  # the last prompt token predicts both responses' first token
        c0, r0 = start + len(p), start + len(p) + len(c)
        pred += [prompt_end] + list(range(c0, c0 + len(c) - 1)) + [prompt_end] + list(range(r0, r0 + len(r) - 1))
        target += c + r
        owner += [i] * len(c) + [B + i] * len(r)
        last.append((c0 + len(c) - 1, r0 + len(r) - 1))
    pred_pos = torch.tensor(pred)
    return {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.tensor([positions]),
        "attention_mask": shared_prefix_mask("cpu"),  # no mask to build, no packed rows to look for (a device read)
        SHARED_PREFIX: segments,
        "pred_index": torch.stack([torch.zeros_like(pred_pos), pred_pos], dim=1),
        "target": torch.tensor(target),
        "owner": torch.tensor(owner),
        "last": torch.tensor([[0, c] for c, _ in last] + [[0, r] for _, r in last]),
        "n_seqs": 2 * B,
        "seq_tokens": torch.tensor([len(c) for c in chosen] + [len(r) for r in rejected]),  # (2B,)
    }


def _model_inputs(batch: dict) -> dict:
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if SHARED_PREFIX in batch:
        inputs[SHARED_PREFIX] = batch[SHARED_PREFIX]
    return inputs


def sequence_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_t log π(y_t | x, y_<t) over each sequence's completion, and its length: (N,), (N,).

    Only the positions that predict a completion token meet the LM head, chunk by chunk (`token_head`)."""
    rows, pos = batch["pred_index"].t().contiguous()  # (M,), (M,)
    logp = token_stats(model, _model_inputs(batch), rows, pos, batch["target"])["logp"]  # (M,)
    n, owner = batch["n_seqs"], batch["owner"]
    sums = torch.zeros(n, device=logp.device, dtype=logp.dtype).index_add(0, owner, logp)  # (N,)
    if "seq_tokens" in batch:  # counted on the host
        return sums, batch["seq_tokens"].to(logp.dtype)
    counts = torch.bincount(owner, minlength=n).to(logp.dtype)  # (N,)
    return sums, counts


def sequence_scores(model, batch: dict) -> torch.Tensor:
    """A scalar head read at each sequence's last token (its EOS): (N,)."""
    inner = model.get_base_model() if is_peft(model) else model  # under LoRA: the adapted model, `score` trainable
    backbone = getattr(inner, inner.base_model_prefix)
    hidden = backbone(**_model_inputs(batch), use_cache=False).last_hidden_state  # (R, T, H)
    last = batch["last"]  # (N, 2)
    return inner.score(hidden[last[:, 0], last[:, 1]]).squeeze(-1).float()  # (N,)


# ----------------------------------------------------------------------------- batches


def _image(seq: tuple) -> dict:
    """The image fields of a (prompt, completion[, image fields]) sequence; {} for text."""
    return seq[2] if len(seq) > 2 else {}


def _pair_seqs(examples: list[dict], rejected: list[list[int]] | None = None) -> list[tuple]:
    """[chosen of each row] + [rejected of each row]: chosen and rejected in one forward pass (a VLM's row brings
    its image to both)."""
    rejected = rejected if rejected is not None else [ex["rejected_ids"] for ex in examples]
    return [(ex["prompt_ids"], ex["chosen_ids"], image_fields_of(ex)) for ex in examples] + [
        (ex["prompt_ids"], r, image_fields_of(ex)) for ex, r in zip(examples, rejected)
    ]


def pair_batch(examples: list[dict], rejected, pad_id: int, packing) -> dict:
    """Chosen and rejected of every row for one forward pass: padded, packed, or packed with shared
    prompts (``packing == "shared"``: our packed attention computes each prompt once)."""
    if packing == "shared":
        rejected = rejected if rejected is not None else [ex["rejected_ids"] for ex in examples]
        return collate_shared_prompts(
            [ex["prompt_ids"] for ex in examples], [ex["chosen_ids"] for ex in examples], rejected
        )
    return collate_sequences(_pair_seqs(examples, rejected), pad_id, bool(packing))


def build_batch(algorithm, model, ref, examples, engine, pad_id, packing, rejected=None) -> dict:
    """The algorithm's input for one micro-batch (the policy's tensors carry gradients)."""
    B = len(examples)
    wants_ref = ref is not None
    if algorithm.data_format == "unpaired":
        matched = [(ex["prompt_ids"], ex["completion_ids"], image_fields_of(ex)) for ex in examples]
        batch = {"label": torch.tensor([float(ex["label"]) for ex in examples], device=engine.device)}
        packing = bool(packing)
        seqs = engine.to_device(collate_sequences(matched, pad_id, packing))
        batch["logp"], batch["n_tokens"] = sequence_logps(model, seqs)
        if wants_ref:
            # KL baseline: prompt i with the completion of row i−1 (cyclically), as in TRL's KTO
            mismatched = [
                (examples[i]["prompt_ids"], examples[i - 1]["completion_ids"], image_fields_of(examples[i]))
                for i in range(B)
            ]
            both = engine.to_device(collate_sequences(matched + mismatched, pad_id, packing))
            kl_seqs = engine.to_device(collate_sequences(mismatched, pad_id, packing))
            with torch.no_grad():
                batch["kl_logp"] = sequence_logps(model, kl_seqs)[0]
                ref_logp = sequence_logps(ref, both)[0]
            batch["ref_logp"], batch["ref_kl_logp"] = ref_logp[:B], ref_logp[B:]
        return batch
    seqs = engine.to_device(pair_batch(examples, rejected, pad_id, packing))
    if algorithm.head == "score":
        rewards = sequence_scores(model, seqs)  # (2B,)
        return {"rewards_chosen": rewards[:B], "rewards_rejected": rewards[B:]}
    logp, n_tokens = sequence_logps(model, seqs)  # (2B,), (2B,)
    batch = {"logp_chosen": logp[:B], "logp_rejected": logp[B:], "n_chosen": n_tokens[:B], "n_rejected": n_tokens[B:]}
    if "ref_logp_chosen" in examples[0] and rejected is None:  # precomputed for the dataset
        batch["ref_logp_chosen"] = torch.tensor([ex["ref_logp_chosen"] for ex in examples], device=engine.device)
        batch["ref_logp_rejected"] = torch.tensor([ex["ref_logp_rejected"] for ex in examples], device=engine.device)
    elif wants_ref:
        with torch.no_grad():
            ref_logp = sequence_logps(ref, seqs)[0]
        batch["ref_logp_chosen"], batch["ref_logp_rejected"] = ref_logp[:B], ref_logp[B:]
    return batch


def row_tokens(example: dict, packing) -> int:
    """What one row costs a micro-batch's token budget (`regroup_by_tokens`). Padded, a pair is two
    sequences padded to the longer one; packed, both sequences' tokens; with shared prompts
    (``packing == "shared"``) the prompt once. An unpaired row is one sequence."""
    p = len(example["prompt_ids"])
    if "completion_ids" in example:
        return p + len(example["completion_ids"])
    c, r = len(example["chosen_ids"]), len(example.get("rejected_ids", ()))
    if packing == "shared":
        return p + c + r
    if packing:
        return 2 * p + c + r
    return 2 * (p + max(c, r))  # padded: counted as two rows of the longer sequence


def policy_tokens(examples: list[dict], rejected: list[list[int]] | None = None, shared: bool = False) -> int:
    """Tokens the policy's training forward pass reads for these rows (padding not counted)."""
    if "completion_ids" in examples[0]:
        return sum(len(ex["prompt_ids"]) + len(ex["completion_ids"]) for ex in examples)
    rejected = rejected if rejected is not None else [ex["rejected_ids"] for ex in examples]
    prompts = 1 if shared else 2  # with shared prompts each prompt is read once
    return sum(prompts * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(r) for ex, r in zip(examples, rejected))


def policy_square_lengths(examples: list[dict], rejected: list[list[int]] | None = None, shared: bool = False) -> int:
    """Σᵢ Tᵢ² over the sequences the policy's training forward pass reads for these rows (`models.perf`): a pair is
    its chosen and its rejected sequence; with shared prompts, the prompt's p tokens attend to p positions and each
    response's tokens to the prompt's and their own: p² + c·(p + c) + r·(p + r)."""
    if "completion_ids" in examples[0]:
        return sum((len(ex["prompt_ids"]) + len(ex["completion_ids"])) ** 2 for ex in examples)
    rejected = rejected if rejected is not None else [ex["rejected_ids"] for ex in examples]
    total = 0
    for ex, r_ids in zip(examples, rejected):
        p, c, r = len(ex["prompt_ids"]), len(ex["chosen_ids"]), len(r_ids)
        total += p * p + c * (p + c) + r * (p + r) if shared else (p + c) ** 2 + (p + r) ** 2
    return total


def generate_rejected(backend, examples: list[dict], ro, seed: int) -> list[list[int]]:
    """Self-play: one completion per prompt from the reference model (the previous iteration's policy). An image
    row's prompt is generated from with its image inputs (`images.image_fields_of`): the rejected answer is the
    opponent's answer about that picture, as the chosen one is the dataset's."""
    sampling = SamplingParams(
        n=1, max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, seed=seed
    )
    prompts = [ex["prompt_ids"] for ex in examples]
    images = [image_fields_of(ex) for ex in examples]  # (P,); a batch of text rows trains without pixels: None
    groups = generate_from(backend, prompts, sampling, images if any(images) else None)
    return [g[0].token_ids for g in groups]


@torch.no_grad()
def precompute_ref(ref, examples: list[dict], engine, pad_id: int, packing: bool, batch_size: int) -> None:
    """Reference log-probabilities of every training pair, once, stored on the examples."""
    for start in range(0, len(examples), batch_size):
        part = examples[start : start + batch_size]
        with engine.autocast():
            logp = sequence_logps(ref, engine.to_device(pair_batch(part, None, pad_id, packing)))[0].tolist()
        for i, ex in enumerate(part):
            ex["ref_logp_chosen"], ex["ref_logp_rejected"] = logp[i], logp[len(part) + i]


@torch.no_grad()
def pair_metrics(algorithm, model, ref, examples, engine, pad_id, packing, batch_size) -> dict:
    """The algorithm's loss and metrics on held-out rows, averaged over rows (``eval/`` names)."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = defaultdict(float)
    try:
        for start in range(0, len(examples), batch_size):
            part = examples[start : start + batch_size]
            if algorithm.data_format == "unpaired" and len(part) < 2:
                continue
            with engine.autocast():
                loss, metrics = algorithm.loss(build_batch(algorithm, model, ref, part, engine, pad_id, packing))
            share = len(part) / len(examples)
            sums["eval/loss"] += float(loss) * share
            for key, value in metrics.items():
                sums[f"eval/{key}"] += float(value) * share
    finally:
        model.train(was_training)
    return dict(sums)


@dataclass
class PreferenceData:
    """A run's rows, read and encoded before any model loads (`read_data`), and what reading them decided."""

    source: Source  # the training rows as read
    train: Any  # their examples (`encode.prepare_examples`)
    policy_path: str  # the model the run starts from (the built-in VLM's warm start for image rows)
    tokenizer: Any
    vision: Any  # a VLM's processing (`vision.load_processing`), else None
    images: bool  # image rows on the built-in model
    packing: bool  # data.packing as this model takes it (a VLM's rows are padded)
    eval_examples: list[dict]  # held-out pairs (pair accuracy); none for self-play
    eval_rows: list[dict]  # held-out rows for greedy accuracy (a verifiable dataset, an LM head)
    eval_dataset: Any  # the held-out rows' dataset plugin (its answer check)


def read_data(setup: Setup) -> PreferenceData:
    """The training and held-out rows, encoded with the tokenizer (a VLM's prompts go through its processor); what
    this loop cannot do with them, and options the algorithm cannot honour, are refused here, before any model
    loads; ``train.epochs`` sets the steps from the rows."""
    cfg, algorithm = setup.cfg, setup.algorithm
    fmt, self_play = algorithm.data_format, algorithm.self_play
    train_source = load_data(cfg.data.train, "train", setup.registry)
    images = not cfg.model.name and any(is_image_row(r) for r in train_source.rows)  # the built-in VLM's warm start
    policy_path = initial_policy_path(cfg.model.name, reporter=setup.reporter, images=images)
    tokenizer = load_tokenizer(policy_path, trust_remote_code=cfg.model.trust_remote_code)
    vision = setup.vision(policy_path)
    _check_images(cfg, algorithm, train_source, vision)
    train = prepare_examples(train_source, fmt, tokenizer, cfg.data.max_length, self_play, vision=vision)
    packing = setup.packing_for(cfg.data.packing)  # a VLM's rows are padded
    for note in train.notes(cfg.data.max_length):  # too-long prompts, pairs with chosen == rejected
        setup.info(f"[yellow]note:[/yellow] {note}")
    held_out = eval_source(cfg.data, setup.registry)
    eval_examples, eval_rows, eval_dataset = [], [], None
    if held_out is not None:
        if not self_play:  # self-play pairs need generations; held-out accuracy still applies
            eval_examples = prepare_examples(held_out, fmt, tokenizer, cfg.data.max_length, vision=vision).examples
        eval_dataset = held_out.dataset
        if algorithm.head == "lm" and can_verify(eval_dataset):
            # each row keeps its file: relative image paths are read beside it (`images.image_base_dir`)
            eval_rows = [{"_origin": held_out.origin, **r} for r in held_out.rows if "prompt" in r]
    _check_options(cfg, algorithm, fmt)
    setup.steps_from_epochs(len(train.examples), "rows")  # train.epochs: the steps follow from the data
    return PreferenceData(
        train_source, train, policy_path, tokenizer, vision, images, packing, eval_examples, eval_rows, eval_dataset
    )


def load_policy(setup: Setup, policy_path: str, pad_id: int, packing: bool) -> tuple[Any, str, bool | str]:
    """The policy (a causal LM, or a score model for ``head == "score"``), its attention implementation, and the
    fast path, chosen here once: packing, and with packed sdpa on pairs, shared prompts (``"shared"``) unless the
    model's attention cannot take them."""
    cfg, algorithm = setup.cfg, setup.algorithm
    attn = packed_attn_implementation(cfg.model.attn_implementation) if packing else cfg.model.attn_implementation
    if packing and attn == PACKED_SDPA and algorithm.data_format != "unpaired":
        packing = "shared"  # pairs share their prompt: it is computed once (see collate_shared_prompts)
    start = setup.start_from(policy_path)
    if algorithm.head == "score":
        model = load_score_model(
            start,
            pad_token_id=pad_id,
            attn_implementation=attn,
            trust_remote_code=cfg.model.trust_remote_code,
            log=setup.info,
            reporter=setup.reporter,
        )
    else:
        model = load_causal_lm(
            start, attn_implementation=attn, trust_remote_code=cfg.model.trust_remote_code, reporter=setup.reporter
        )
    if packing == "shared" and not (fast := attention_fast_paths(model.config))["shared_prefix"][0]:
        packing = True  # decided once: ordinary packing (row by row), each prompt computed twice
        setup.info(
            f"[yellow]note:[/yellow] data.packing: shared prompts do not apply ({fast['shared_prefix'][1]}); packing without them"
        )
    return model, attn, packing


def held_out_metrics(cfg, algorithm, model, ref, engine, data: PreferenceData, pad_id: int, packing, progress) -> dict:
    """The held-out evaluation, on rank 0 (on whole parameters under ZeRO-3): pair accuracy on the held-out pairs,
    greedy accuracy on the held-out rows."""
    metrics = {}
    with engine.full_weights():
        if data.eval_examples and is_main():
            metrics.update(
                pair_metrics(algorithm, model, ref, data.eval_examples, engine, pad_id, packing, cfg.train.batch_size)
            )
        if data.eval_rows and is_main():
            metrics.update(
                evaluate(
                    model,
                    data.tokenizer,
                    engine.device,
                    [],
                    data.eval_rows,
                    data.eval_dataset,
                    cfg.train.batch_size,
                    cfg.rollout.max_new_tokens,
                    progress=progress,
                    vision=data.vision,
                )
            )
    return metrics


# ----------------------------------------------------------------------------- the loop


def run_preference(trainer, ckpt: Path | None) -> RunResult:
    setup = Setup(trainer, ckpt)
    cfg, algorithm, self_play = setup.cfg, setup.algorithm, setup.algorithm.self_play
    data = read_data(setup)  # before any model loads, so bad data fails fast
    train, tokenizer, vision, packing = data.train, data.tokenizer, data.vision, data.packing
    pad_id = tokenizer.pad_token_id
    model, attn, packing = load_policy(setup, data.policy_path, pad_id, packing)
    eval_examples, eval_rows = data.eval_examples, data.eval_rows
    ref = setup.reference(data.policy_path, attn) if algorithm.uses_ref() else None
    packing = setup.packs_exactly(packing, model, ref)  # measured: a packed row = the separate forwards
    model = setup.policy(model, algorithm.head)
    engine = setup.build_engine(model)
    if ckpt is not None and self_play:
        ref.load_state_dict(load_state_file(ckpt / REF_FILE, map_location=engine.device))
    if cfg.train.precompute_ref_logps:
        precompute_ref(ref, train.examples, engine, pad_id, packing, cfg.train.batch_size)
        if not eval_examples:
            ref = None  # every reference logprob the run needs is stored: free the model
    backend = None
    if self_play:
        from oxrl_core.rollout.hf import HFRolloutBackend  # lazy: self-play alone generates

        backend = HFRolloutBackend(ref, tokenizer)
    iteration_steps = -(-cfg.train.max_steps // algorithm.iterations()) if self_play else cfg.train.max_steps
    lengths = [
        len(ex["prompt_ids"]) + max(len(v) for k, v in ex.items() if k.endswith("_ids") and k != "prompt_ids")
        for ex in train.examples
    ]
    plan = setup.plan(data.source, [ex["_source"] for ex in train.examples], lengths)

    def extra_files(tmp: Path) -> None:  # self-play checkpoints keep the reference of the current iteration
        if self_play:
            torch.save(ref.state_dict(), tmp / REF_FILE)

    # rank 0 evaluates (on whole parameters under ZeRO-3)
    run_eval = partial(held_out_metrics, cfg, algorithm, model, ref, engine, data, pad_id, packing)
    saved_with = vision if vision is not None else tokenizer  # a VLM's final/ keeps its processor
    held_out = len(eval_rows) or len(eval_examples)  # greedy accuracy's rows, else pair accuracy's pairs
    run = Run(setup, model, saved_with, engine, run_eval if eval_examples or eval_rows else None, extra=extra_files,
              eval_rows=held_out)  # fmt: skip
    builtin = "built-in tiny Qwen2-VL (warm start)" if data.images else "built-in tiny llama (warm start)"
    run.banner(builtin, f"{data.source.origin} ({len(train.examples)} rows)")

    def step(step: int) -> dict:
        t0 = time.perf_counter()
        # 0. self-play: a new iteration plays against the current policy
        if self_play and step > 1 and (step - 1) % iteration_steps == 0:
            with engine.full_weights():
                ref.load_state_dict(policy_state_dict(model))
        # 1. this step's micro-batches (rows); this rank's rows of each (all of them in one process)
        picks = run.draw(plan, lambda i: row_tokens(train.examples[i], packing), bool(packing))
        shares = [shard(idx) for idx in picks]
        total_rows = sum(len(idx) for idx in picks)
        lr = engine.lr
        sums = StepSums()  # on the device until the step's one read (`Run.update`)
        gen_seconds, tokens, square_lengths = 0.0, 0, 0
        for k, (rows, padding) in enumerate(shares):
            examples = [train.examples[i] for i in rows]
            # 2. self-play: the rejected responses, generated by the reference
            rejected = None
            if self_play:
                t_gen = time.perf_counter()
                rejected = generate_rejected(
                    backend, examples, cfg.rollout, stream_seed(cfg.train.seed, "rejected", step=step, micro_batch=k)
                )
                gen_seconds += time.perf_counter() - t_gen
            # 3. sequence log-probabilities (policy, reference), then the loss; each micro-batch weighted by its rows
            with engine.autocast():
                batch = build_batch(algorithm, model, ref, examples, engine, pad_id, packing, rejected)
                loss, metrics = algorithm.loss(batch)  # ALGO: the algorithm's loss
            tokens += 0 if padding else policy_tokens(examples, rejected, packing == "shared")
            square_lengths += 0 if padding else policy_square_lengths(examples, rejected, packing == "shared")
            backward_share(engine, loss, metrics, 0.0 if padding else len(examples) / total_rows, sums)
        # 4. the optimiser step (a non-finite loss stops the run before it), metrics summed over ranks
        grad_norm, sums = run.update(sums, step)
        sums = reduce_metrics({**sums, "perf/tokens": tokens, "perf/square_lengths": square_lengths})
        tokens, square_lengths = int(sums.pop("perf/tokens")), sums.pop("perf/square_lengths")
        # the policy's training FLOPs (the reference model's forward is not counted)
        perf = {
            "perf/rows": total_rows,
            "perf/micro_batches": len(picks),
            "perf/tokens": tokens,
            "perf/square_lengths": square_lengths,
        }
        record = run.record(sums, lr, grad_norm, plan, picks, perf, time.perf_counter() - t0)
        if self_play:
            record["iteration"] = (step - 1) // iteration_steps + 1
            record["time/generate_s"] = gen_seconds
        return record

    records = run.train(step)
    held_out = (("eval/rewards/accuracies", "held-out pair accuracy"), *ACCURACY)
    return run.finish(records, held_out)


def _check_images(cfg, algorithm, source, vision) -> None:
    """What this loop cannot do with a VLM or image rows, refused before any model loads: a reward model (``rm``:
    a score head on a causal LM). Self-play trains on image rows: its rejected answers are generated from the
    prompt with its pixels (`generate_rejected`)."""
    image_row = next((r for r in source.rows if is_image_row(r)), None)
    if algorithm.head == "score" and image_row is not None:
        raise OxrlError(
            f"{row_where(image_row, source.origin)}: field 'images': '{cfg.algorithm}' trains a reward model (a "
            "scalar head on a text model's last token), which reads no images; give it text rows"
        )
    if algorithm.head == "score" and vision is not None:
        raise OxrlError(
            f"model.name: '{cfg.algorithm}' trains a reward model (a scalar head on a causal language model) and "
            f"this is a vision-language model ({vision.family.model_type}); train the reward model on a text model"
        )


def _check_options(cfg, algorithm, fmt: str) -> None:
    """Options that this algorithm cannot honour, refused before any model loads."""
    if fmt == "unpaired" and algorithm.uses_ref() and cfg.train.batch_size < 2:
        raise OxrlError(
            f"train.batch_size: '{cfg.algorithm}' estimates its KL baseline by pairing each prompt with another "
            f"row's completion, so a micro-batch needs at least 2 rows (got {cfg.train.batch_size})"
        )
    if cfg.train.precompute_ref_logps and (fmt != "preference" or not algorithm.uses_ref()):
        raise OxrlError(
            f"train.precompute_ref_logps: '{cfg.algorithm}' has no fixed pairs to precompute reference "
            "log-probabilities for (it needs a reference model and preference rows)"
        )
