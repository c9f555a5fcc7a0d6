"""The SL loop (supervised algorithms: SFT, CPT, KD, ...), on the run skeleton (`loops.run`).

    data -> collator -> policy (and teacher) forward -> algorithm loss
         -> backward (micro-batches weighted by their share of loss tokens)
         -> clip + optimiser step -> metrics / checkpoint

Gradient accumulation is exact: each micro-batch's loss is a mean over its own
loss tokens, and it is weighted by its share of the optimiser batch's loss
tokens, so accumulating k micro-batches gives the gradient of one big batch.
"""

from __future__ import annotations

import time
from pathlib import Path

from oxrl_core.data.batching import collate
from oxrl_core.data.encode import IGNORE, prepare_examples
from oxrl_core.data.sources import eval_source, load_data
from oxrl_core.engines.distributed import all_reduce_sum, is_main, reduce_metrics, shard
from oxrl_core.errors import OxrlError
from oxrl_core.loops.run import MODEL_INPUTS, Run, RunResult, StepSums, backward_share
from oxrl_core.loops.setup import Setup
from oxrl_core.models.loading import builtin_model_for, load_causal_lm, load_tokenizer
from oxrl_core.models.packed_attention import packed_attn_implementation
from oxrl_core.models.token_head import on_grid, token_stats
from oxrl_core.models.vision import packed_position_ids
from oxrl_core.scoring.evaluation import evaluate


def micro_batch_weight(batch: dict, weighting: str) -> float:
    if weighting == "sequences":
        return float(batch["input_ids"].shape[0])
    if "n_scored" in batch:  # counted on the host by the collator
        return float(batch["n_scored"])
    return float((batch["labels"][:, 1:] != IGNORE).sum())


def supervised_tokens(model, teacher, mb: dict, algorithm) -> dict:
    """The per-token tensors a supervised algorithm reads (see `Algorithm`): ``mask`` (B, T-1), 1 where a label
    is scored; ``logp`` (B, T-1), log π of that label (0 elsewhere); and as the algorithm asks, ``logp_mean``
    and, with a teacher, ``kl_teacher`` (B, T-1). Only scored positions meet the LM head (`token_head`)."""
    targets = mb["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
    mask = targets != IGNORE  # (B, T-1)
    if "scored_pos" in mb:  # found on the host by the collator (no device read)
        rows, pos = mb["scored_rows"], mb["scored_pos"]  # (M,), (M,)
    else:
        rows, pos = mask.nonzero(as_tuple=True)
    stats = token_stats(
        model,
        {k: mb[k] for k in MODEL_INPUTS if k in mb},
        rows,
        pos,
        targets[rows, pos],
        logp_mean=algorithm.uses_logp_mean(),
        teacher=teacher,
        kd_temperature=algorithm.distill_temperature(),
    )
    return {"mask": mask, **{name: on_grid(value, rows, pos, mask.shape) for name, value in stats.items()}}


def _eval_data(cfg, registry, fmt, tokenizer, vision=None):
    """Eval examples (for eval/loss) and rows (for accuracy): data.eval, else the plugin's eval split."""
    source = eval_source(cfg.data, registry)
    if source is None:
        return [], [], None
    examples = prepare_examples(source, fmt, tokenizer, cfg.data.max_length, vision=vision).examples
    # each row keeps the file it came from: relative image paths are read beside it (`images.image_base_dir`)
    rows = [{"_origin": source.origin, **r} for r in source.rows] if "prompt" in source.rows[0] else []
    return examples, rows, source.dataset


def run_supervised(trainer, ckpt: Path | None) -> RunResult:
    setup = Setup(trainer, ckpt)
    cfg, algorithm = setup.cfg, setup.algorithm

    # ---- data (the tokenizer is loaded with the data, so bad data fails before any model loads); a VLM's
    # prompts go through its processor (`Setup.vision`), and its image rows are padded (`Setup.packing_for`)
    train_source = load_data(cfg.data.train, "train", setup.registry)
    name = builtin_model_for(cfg.model.name, train_source.rows)  # empty: the built-in model (a VLM for images)
    tokenizer = load_tokenizer(name, trust_remote_code=cfg.model.trust_remote_code)
    vision = setup.vision(name)
    train = prepare_examples(train_source, algorithm.data_format, tokenizer, cfg.data.max_length, vision=vision)
    eval_examples, eval_rows, eval_dataset = _eval_data(cfg, setup.registry, algorithm.data_format, tokenizer, vision)
    packing = setup.packing_for(cfg.data.packing, packed_positions=True)  # a VLM: Qwen-VL packs, others pad
    lengths = [len(e["input_ids"]) for e in train.examples]
    plan = setup.plan(train_source, [e["_source"] for e in train.examples], lengths)
    setup.steps_from_epochs(len(train.examples), "examples")  # train.epochs: the steps follow from the data
    for note in train.notes(cfg.data.max_length):  # too-long prompts, conversations split per assistant turn
        setup.info(f"[yellow]note:[/yellow] {note}")

    # ---- models: packed micro-batches attend row by row (sdpa -> PACKED_SDPA), not through a dense (ΣL)² mask
    attn = packed_attn_implementation(cfg.model.attn_implementation) if packing else cfg.model.attn_implementation
    model = load_causal_lm(
        setup.start_from(name),
        attn_implementation=attn,
        trust_remote_code=cfg.model.trust_remote_code,
        reporter=setup.reporter,
    )
    teacher = None
    if algorithm.needs_teacher:
        teacher = setup.frozen(cfg.model.teacher, "model.teacher", attn, check=lambda t: _check_vocab(t, model))
    packing = setup.packs_exactly(packing, model, teacher)  # measured: a packed row = the separate forwards
    model = setup.policy(model)
    engine = setup.build_engine(model)

    def run_eval(progress) -> dict:  # rank 0 evaluates (on whole parameters under ZeRO-3)
        with engine.full_weights():
            if not is_main():
                return {}
            return evaluate(
                model,
                tokenizer,
                engine.device,
                eval_examples,
                eval_rows,
                eval_dataset,
                cfg.train.batch_size,
                cfg.rollout.max_new_tokens,
                progress=progress,
                vision=vision,
            )

    # final/ and checkpoints save a VLM's processor (its tokenizer, image processor and chat template)
    saved_with = vision if vision is not None else tokenizer
    run = Run(
        setup, model, saved_with, engine, run_eval if eval_examples or eval_rows else None, eval_rows=len(eval_rows)
    )
    builtin = "built-in tiny Qwen2-VL" if vision is not None else "built-in tiny llama"
    run.banner(builtin, f"{train_source.origin} ({len(train.examples)} examples)")

    def step(step: int) -> dict:
        t0 = time.perf_counter()
        # 1. this step's micro-batches; this rank's rows of each (all of them in one process)
        picks = run.draw(plan, lambda i: lengths[i], packing)
        shares = [shard(idx) for idx in picks]
        micro = [
            collate([train.examples[i] for i in rows], tokenizer.pad_token_id, packing, host=True) for rows, _ in shares
        ]
        # 2. each micro-batch weighted by its share of the loss tokens of every rank's batch
        weights = [
            0.0 if padding else micro_batch_weight(mb, algorithm.loss_weighting)
            for mb, (_, padding) in zip(micro, shares)
        ]
        total_weight = all_reduce_sum([sum(weights)])[0] or 1.0
        lr = engine.lr
        sums = StepSums()  # on the device until the step's one read (`Run.update`)
        tokens = square_lengths = 0  # Σ Tᵢ, Σ Tᵢ² over the step's sequences (a packed row's each on its own)
        for mb, weight, (rows, padding) in zip(micro, weights, shares):
            mb = engine.to_device(mb)
            if packing and vision is not None:  # Qwen-VL: each packed row's own rotary positions
                mb["position_ids"] = packed_position_ids(model, mb)
            # 3. per-token log-probabilities, then the loss
            with engine.autocast():
                batch = {**mb, **supervised_tokens(model, teacher, mb, algorithm)}
                loss, metrics = algorithm.loss(batch)  # ALGO: the algorithm's loss
            backward_share(engine, loss, metrics, weight / total_weight, sums)
            if not padding:
                tokens += mb["n_tokens"]
                square_lengths += sum(lengths[i] ** 2 for i in rows)
        # 4. the optimiser step (a non-finite loss stops the run before it), metrics summed over ranks
        grad_norm, sums = run.update(sums, step)
        sums = reduce_metrics({**sums, "perf/tokens": tokens, "perf/square_lengths": square_lengths})
        tokens, square_lengths = int(sums.pop("perf/tokens")), sums.pop("perf/square_lengths")
        perf = {"perf/tokens": tokens, "perf/micro_batches": len(picks), "perf/square_lengths": square_lengths}
        return run.record(sums, lr, grad_norm, plan, picks, perf, time.perf_counter() - t0)

    records = run.train(step)
    return run.finish(records, eval_if_idle=True)


def _check_vocab(teacher, model) -> None:
    """KD compares the two models' distributions over one vocabulary."""
    if teacher.get_output_embeddings().weight.shape[0] != model.get_output_embeddings().weight.shape[0]:
        raise OxrlError(
            f"model.teacher: vocabulary size {teacher.get_output_embeddings().weight.shape[0]} differs from the "
            f"student's {model.get_output_embeddings().weight.shape[0]}; KD needs a shared tokenizer"
        )
