"""The SL loop (supervised algorithms; preference algorithms will share its skeleton).

    data -> collator -> policy (and teacher) forward -> algorithm loss
         -> backward (micro-batches weighted by their share of loss tokens)
         -> clip + optimiser step -> metrics / checkpoint

Gradient accumulation is exact: each micro-batch's loss is a mean over its own
loss tokens, and it is weighted by its share of the optimiser batch's loss
tokens, so accumulating k micro-batches gives the gradient of one big batch.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from oxrl_core.atomic import write_text_atomic
from oxrl_core.checkpoint import latest_checkpoint, load_training_state, save_model
from oxrl_core.data import IGNORE, collate, eval_source, load_data, make_plan, prepare_examples, regroup_by_tokens
from oxrl_core.distributed import all_reduce_sum, is_main, reduce_metrics, shard, world_size
from oxrl_core.engines import build_engine
from oxrl_core.errors import OxrlError
from oxrl_core.evaluation import evaluate
from oxrl_core.lifecycle import Checkpointer
from oxrl_core.lora import apply_lora, start_path, trainable_summary
from oxrl_core.models import count_parameters, load_causal_lm, load_tokenizer
from oxrl_core.packed_attention import packed_attn_implementation
from oxrl_core.perf import MfuMeter
from oxrl_core.progress import Reporter
from oxrl_core.token_head import choose_path, on_grid, token_stats
from oxrl_core.tracking import Tracker

#: collate keys that go to the model (the varlen keys come with packed micro-batches)
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def check_loss(loss: torch.Tensor, step: int, run_dir: Path) -> None:
    """Stop the run before a non-finite loss reaches the weights; the newest checkpoint stays as it was."""
    if not torch.isfinite(loss):
        last = latest_checkpoint(run_dir)
        raise OxrlError(
            f"step {step}: the loss is {loss.item()} (not finite); the run stops here. "
            f"Last complete checkpoint: {last or 'none'}. Lower train.lr or check the data, then --resume."
        )


def micro_batch_weight(batch: dict, weighting: str) -> float:
    if weighting == "sequences":
        return float(batch["input_ids"].shape[0])
    return float((batch["labels"][:, 1:] != IGNORE).sum())


def supervised_tokens(model, teacher, mb: dict, algorithm) -> dict:
    """The per-token tensors a supervised algorithm reads (see `Algorithm`): ``mask`` (B, T-1), 1 where a label
    is scored; ``logp`` (B, T-1), log π of that label (0 elsewhere); and as the algorithm asks, ``logp_mean``
    and, with a teacher, ``kl_teacher`` (B, T-1). Only scored positions meet the LM head (`token_head`)."""
    targets = mb["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
    mask = targets != IGNORE  # (B, T-1)
    rows, pos = mask.nonzero(as_tuple=True)  # (M,), (M,)
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


def _eval_data(cfg, registry, train_source, fmt, tokenizer):
    """Eval examples (for eval/loss) and rows (for accuracy): data.eval, else the plugin's eval split."""
    source = eval_source(cfg.data, registry, train_source)
    if source is None:
        return [], [], None
    examples = prepare_examples(source, fmt, tokenizer, cfg.data.max_length).examples
    rows = source.rows if "prompt" in source.rows[0] else []
    return examples, rows, source.dataset


def run_supervised(trainer, ckpt: Path | None):
    from oxrl_core.trainer import RunResult

    cfg = trainer.config
    algorithm = trainer.algorithm
    spec = trainer.algorithm_cls
    run_dir = trainer.run_dir
    reporter = Reporter(trainer.quiet, cfg.train.log_steps)
    seed_everything(cfg.train.seed)

    # ---- data
    tokenizer = load_tokenizer(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    fmt = spec.data_format
    train_source = load_data(cfg.data.train, "train", trainer.registry)
    train = prepare_examples(train_source, fmt, tokenizer, cfg.data.max_length)
    eval_examples, eval_rows, eval_dataset = _eval_data(cfg, trainer.registry, train_source, fmt, tokenizer)
    plan = make_plan(
        train_source,
        [e["_source"] for e in train.examples],
        [len(e["input_ids"]) for e in train.examples],
        cfg.train.batch_size,
        cfg.train.seed,
        cfg.data.group_by_length,
    )
    if train.dropped:
        reporter.info(
            f"[yellow]note:[/yellow] {train.dropped} rows dropped: their prompt fills data.max_length={cfg.data.max_length}"
        )

    # ---- models (the tokenizer is loaded with the data, so bad data fails before any model loads)
    # packed micro-batches: attention row by row (sdpa -> PACKED_SDPA), not through a dense (ΣL)² mask
    attn = (
        packed_attn_implementation(cfg.model.attn_implementation) if cfg.data.packing else cfg.model.attn_implementation
    )
    load_from, adapter_ckpt = start_path(cfg.model.name, ckpt, cfg.lora)
    model = load_causal_lm(
        load_from,
        attn_implementation=attn,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    model = apply_lora(model, cfg.lora, resume_from=adapter_ckpt)
    if cfg.lora.enabled:
        reporter.info(trainable_summary(model))
    choose_path(model, cfg.train.logits_chunk_size, reporter.info)  # chunked LM head (or the model's full logits)
    teacher = None
    if spec.needs_teacher:
        teacher = load_causal_lm(cfg.model.teacher, field="model.teacher", attn_implementation=attn)
        if teacher.get_output_embeddings().weight.shape[0] != model.get_output_embeddings().weight.shape[0]:
            raise OxrlError(
                f"model.teacher: vocabulary size {teacher.get_output_embeddings().weight.shape[0]} differs from the "
                f"student's {model.get_output_embeddings().weight.shape[0]}; KD needs a shared tokenizer"
            )
        teacher.requires_grad_(False).eval()
        choose_path(teacher, cfg.train.logits_chunk_size, reporter.info)

    # ---- engine and state
    engine = build_engine(model, cfg.train, cfg.engine, cfg.model.gradient_checkpointing, run_dir=run_dir)
    if teacher is not None:
        teacher.to(engine.device)
    start_step, position, eval_before = 0, 0, {}
    if ckpt is not None:
        state = load_training_state(ckpt, engine)
        start_step, position, eval_before = state["step"], state["data_position"], state.get("eval_before", {})
        reporter.info(f"resuming from {ckpt} (step {start_step})")
    tracker = Tracker(run_dir, cfg.logging, cfg.model_dump(mode="json"), resume_step=start_step if ckpt else None)

    accum, max_steps = cfg.train.grad_accum_steps, cfg.train.max_steps
    saver = Checkpointer(run_dir, cfg, model, tokenizer, engine)  # train.save_steps / save_minutes / Ctrl-C
    reporter.info(
        f"[bold]oxrl {cfg.algorithm}[/bold] · model {cfg.model.name or 'built-in tiny llama'} "
        f"({count_parameters(model) / 1e6:.2f}M params, {engine.device}) · data {train_source.origin} "
        f"({len(train.examples)} examples) · run dir {run_dir} · {saver.describe()}"
    )

    def run_eval() -> dict:  # rank 0 evaluates (on whole parameters under ZeRO-3)
        with engine.full_weights():
            return (
                evaluate(
                    model,
                    tokenizer,
                    engine.device,
                    eval_examples,
                    eval_rows,
                    eval_dataset,
                    cfg.train.batch_size,
                    cfg.rollout.max_new_tokens,
                )
                if is_main()
                else {}
            )

    if start_step == 0 and (eval_examples or eval_rows):
        eval_before = run_eval()
        if "eval/accuracy" in eval_before:
            reporter.info(f"held-out accuracy before training: {eval_before['eval/accuracy']:.3f}")

    # ---- the loop
    records: list[dict] = []
    train_start = time.perf_counter()
    mfu_meter = MfuMeter(model, engine.device, world_size())  # perf/mfu where the device's peak is known
    reporter.start(max_steps, start_step)
    saver.start(start_step)
    try:
        for step in range(start_step + 1, max_steps + 1):
            t0 = time.perf_counter()
            picks = [plan.micro_batch(k) for k in range(position, position + accum)]
            # train.max_tokens_per_micro_batch: the same rows, regrouped by a token budget (0 = as drawn)
            picks = regroup_by_tokens(
                picks,
                lambda i: len(train.examples[i]["input_ids"]),
                cfg.train.max_tokens_per_micro_batch,
                cfg.data.packing,
            )
            shares = [shard(idx) for idx in picks]  # this rank's rows of each micro-batch (all of them in one process)
            micro = [
                collate([train.examples[i] for i in rows], tokenizer.pad_token_id, cfg.data.packing)
                for rows, _ in shares
            ]
            position += accum
            weights = [
                0.0 if padding else micro_batch_weight(mb, spec.loss_weighting)
                for mb, (_, padding) in zip(micro, shares)
            ]
            total_weight = all_reduce_sum([sum(weights)])[0] or 1.0  # over every rank's share of the batch
            lr = engine.lr
            sums: dict[str, float] = defaultdict(float)
            tokens = sequences = 0
            for mb, weight, (_, padding) in zip(micro, weights, shares):
                mb = engine.to_device(mb)
                with engine.autocast():
                    batch = {**mb, **supervised_tokens(model, teacher, mb, algorithm)}
                    loss, metrics = algorithm.loss(batch)
                check_loss(loss, step, run_dir)
                engine.backward(loss * (weight / total_weight))
                share = weight / total_weight
                sums["loss"] += float(loss.detach()) * share
                for key, value in metrics.items():
                    sums[key] += float(value) * share
                if not padding:
                    tokens += int(mb["attention_mask"].sum()) if "attention_mask" in mb else mb["input_ids"].numel()
                    sequences += mb["input_ids"].shape[0]
            sums = reduce_metrics({**sums, "perf/tokens": tokens, "perf/sequences": sequences})  # every rank's shares
            tokens, sequences = int(sums.pop("perf/tokens")), sums.pop("perf/sequences")
            grad_norm = engine.step()
            seconds = time.perf_counter() - t0
            record = {
                "loss": sums.pop("loss"),
                **sums,
                "lr": lr,
                "grad_norm": grad_norm,
                "epoch": position / plan.batches_per_epoch,
                "perf/tokens": tokens,
                "perf/micro_batches": len(picks),
                "perf/tokens_per_s": tokens / seconds,
                "perf/step_s": seconds,
                **mfu_meter(tokens / seconds, tokens / max(sequences, 1)),
                **plan.counts([i for idx in picks for i in idx]),
            }
            if step == max_steps or (cfg.train.eval_steps and step % cfg.train.eval_steps == 0):
                record.update(run_eval())
            tracker.log(step, record)
            records.append({"step": step, **record})
            reporter.step(step, max_steps, record)
            saver.after_step(step, {"data_position": position, "eval_before": eval_before})
    finally:
        reporter.stop()
        tracker.close()

    final_dir = run_dir / "final"
    save_model(final_dir, model, tokenizer, engine=engine)
    eval_after = {k: v for k, v in (records[-1] if records else {}).items() if k.startswith("eval/")}
    if not records and (eval_examples or eval_rows):
        eval_after = run_eval()
    summary = {
        "algorithm": cfg.algorithm,
        "steps": max_steps,
        "train_seconds": time.perf_counter() - train_start,
        "eval_before": eval_before,
        "eval_after": eval_after,
    }
    if is_main():
        write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    if "eval/accuracy" in eval_after:
        before = eval_before.get("eval/accuracy", math.nan)
        reporter.result(f"held-out accuracy: {before:.3f} before → {eval_after['eval/accuracy']:.3f} after")
    last_loss = records[-1]["loss"] if records else math.nan
    reporter.result(f"done: {max_steps} steps, final loss {last_loss:.4f}, model saved to {final_dir}")
    return RunResult(run_dir, final_dir, max_steps, records, eval_before, eval_after)
