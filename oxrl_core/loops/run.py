"""The run skeleton the three loops share, written once.

A loop file (`supervised`, `preference`, `rl`) keeps only what is its own: how its data becomes
batches and what one step does. Everything else is a `Run` method, called in this order:

    run = Run(trainer, ckpt)                   # seed, progress reporter
    start = run.start_from(policy_path)        # the checkpoint (or the base model) to load
    model = run.policy(load(start))            # LoRA, chunked LM head
    ref = run.frozen(path, field, attn)        # reference / teacher: no gradients, eval mode
    engine = run.build_engine(model)           # optimiser, device; frozen models moved there
    run.resume()                               # step, data position, eval-before of a checkpoint
    run.checkpointer(model, tokenizer)         # train.save_steps / save_minutes / Ctrl-C
    run.banner(model, label, data)
    run.evaluate_before(run_eval, has_eval)
    records = run.train(model, step)           # step(step) -> record; eval every N, log, checkpoint
    return run.finish(model, tokenizer, records)   # final/, summary.json, the result lines

Gradient accumulation is exact in every loop: a micro-batch's loss is a mean over its own rows or
tokens, scaled by its share of the optimiser batch (`backward_share`), so k micro-batches give the
gradient of one big batch. See docs/architecture.md for how the loops sit in the layers.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from oxrl_core.atomic import write_text_atomic
from oxrl_core.config import fit_warmup
from oxrl_core.data.batching import make_plan, regroup_by_tokens
from oxrl_core.engines import build_engine
from oxrl_core.engines.distributed import at_step, is_main, world_size
from oxrl_core.errors import OxrlError
from oxrl_core.loops.result import RunResult
from oxrl_core.models.loading import count_parameters, load_causal_lm
from oxrl_core.models.lora import apply_lora, start_path, trainable_summary
from oxrl_core.models.perf import MfuMeter
from oxrl_core.models.token_head import choose_path
from oxrl_core.observability.health import check_run, print_summary, summary_rows, versions
from oxrl_core.observability.progress import Reporter
from oxrl_core.run_io.checkpoint import latest_checkpoint, load_training_state, save_model
from oxrl_core.run_io.lifecycle import Checkpointer
from oxrl_core.run_io.tracking import Tracker

__all__ = ["MODEL_INPUTS", "Run", "RunResult", "backward_share", "check_finite", "check_loss", "seed_everything"]

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

#: the held-out lines of the supervised and preference loops: (metric, label), shown when present
ACCURACY = (("eval/accuracy", "held-out accuracy"),)


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


def check_finite(name: str, tensor: torch.Tensor, step: int, run_dir: Path) -> None:
    """Every entry, masked or not: NaN · 0 is still NaN once it reaches the loss."""
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        last = latest_checkpoint(run_dir)
        raise OxrlError(
            f"step {step}: {bad} non-finite value(s) (NaN/inf) in '{name}'; the run stops before updating the model. "
            f"Last complete checkpoint: {last or 'none'}. Check the reward / lower train.lr, then --resume."
        )


def backward_share(engine, loss: torch.Tensor, metrics: dict, share: float, sums: dict) -> None:
    """One micro-batch's part of an optimiser step: the gradient of ``loss × share`` (its share of the
    batch's rows or tokens), and its loss and metrics added to ``sums`` with the same share."""
    engine.backward(loss * share)
    sums["loss"] += float(loss.detach()) * share
    for key, value in metrics.items():
        sums[key] += float(value) * share


class Run:
    """One run's shared state (config, engine, step, data position, evaluation) and its common steps."""

    def __init__(self, trainer, ckpt: Path | None):
        self.cfg, self.ckpt = trainer.config, ckpt
        self.algorithm, self.spec = trainer.algorithm, trainer.algorithm_cls
        self.run_dir, self.registry = trainer.run_dir, trainer.registry
        self.reporter = Reporter(trainer.quiet, self.cfg.train.log_steps)
        self.info = self.reporter.info
        seed_everything(self.cfg.train.seed)
        self.start_step, self.position, self.eval_before = 0, 0, {}
        self.evaluate = dict  # set by `evaluate_before`: the loop's held-out evaluation
        self.adapter_ckpt: Path | None = None
        self._frozen: list = []

    # ---- models

    def start_from(self, policy_path: str) -> str:
        """Where the policy's weights load from: the checkpoint being resumed, or ``policy_path``
        (under LoRA the base model, the adapter coming from the checkpoint)."""
        load_from, self.adapter_ckpt = start_path(policy_path, self.ckpt, self.cfg.lora)
        return load_from

    def policy(self, model, head: str = "lm"):
        """The loaded policy made trainable: LoRA (``lora.*``) and the chunked LM head."""
        model = apply_lora(model, self.cfg.lora, head, resume_from=self.adapter_ckpt)
        if self.cfg.lora.enabled:
            self.info(trainable_summary(model))
        if head == "lm":
            choose_path(model, self.cfg.train.logits_chunk_size, self.info)  # chunked LM head (or full logits)
        return model

    def frozen(self, path: str, field: str, attn: str, check=None):
        """A model that is read, never trained (reference, teacher): no gradients, eval mode; moved to
        the engine's device by `build_engine`. ``check(model)`` runs on it first."""
        model = load_causal_lm(path, field=field, attn_implementation=attn, reporter=self.reporter)
        if check is not None:
            check(model)
        model.requires_grad_(False).eval()
        choose_path(model, self.cfg.train.logits_chunk_size, self.info)
        self._frozen.append(model)
        return model

    def reference(self, policy_path: str, attn: str):
        """The reference: ``model.ref``, else the initial policy (never the checkpoint being resumed)."""
        cfg = self.cfg.model
        return self.frozen(cfg.ref or policy_path, "model.ref" if cfg.ref else "model.name", attn)

    def build_engine(self, model, **options):
        """The training engine (``engine.*``: torch or DeepSpeed); frozen models join it on its device."""
        cfg = self.cfg
        self.engine = build_engine(
            model, cfg.train, cfg.engine, cfg.model.gradient_checkpointing, run_dir=self.run_dir, **options
        )
        for module in self._frozen:
            module.to(self.engine.device)
        self._frozen = []
        return self.engine

    # ---- state

    def resume(self) -> bool:
        """Optimiser state, step, data position and eval-before of the checkpoint being resumed (if any)."""
        if self.ckpt is None:
            return False
        state = load_training_state(self.ckpt, self.engine)
        self.start_step, self.eval_before = state["step"], state.get("eval_before", {})
        self.position = state.get("data_position", 0)
        self.info(f"resuming from {self.ckpt} (step {self.start_step})")
        return True

    def checkpointer(self, model, tokenizer, extra=None) -> Checkpointer:
        """Checkpoints every train.save_steps / save_minutes and on Ctrl-C; ``extra(dir)`` adds the loop's files."""
        self.saver = Checkpointer(self.run_dir, self.cfg, model, tokenizer, self.engine, extra=extra)
        return self.saver

    def banner(self, model, label: str, data: str) -> None:
        self.info(
            f"[bold]oxrl {self.cfg.algorithm}[/bold] · model {self.cfg.model.name or label} "
            f"({count_parameters(model) / 1e6:.2f}M params, {self.engine.device}) · data {data} · "
            f"run dir {self.run_dir} · {self.saver.describe()}"
            + (
                f" · {self.cfg.train.max_steps} steps ({self.cfg.train.epochs:g} epoch"
                f"{'' if self.cfg.train.epochs == 1 else 's'})"
                if self.cfg.train.epochs
                else ""
            )
        )

    # ---- evaluation

    def evaluate_before(self, evaluate, has_eval: bool, every_metric: bool = False) -> None:
        """Keep ``evaluate`` (``evaluate(progress) -> eval/ metrics``, ``progress(done, total)`` counting what it
        evaluates) as ``self.evaluate()``, which shows its progress; and, at step 0, run it once."""
        self.evaluate, self.has_eval = lambda: self._evaluate(evaluate), has_eval
        if self.start_step != 0 or not has_eval:
            return
        self.eval_before = self.evaluate()
        if every_metric:
            self.info("held-out before training: " + ", ".join(f"{k} {v:.3f}" for k, v in self.eval_before.items()))
        elif "eval/accuracy" in self.eval_before:
            self.info(f"held-out accuracy before training: {self.eval_before['eval/accuracy']:.3f}")

    def _evaluate(self, evaluate) -> dict:
        with self.reporter.counter("held-out evaluation", "samples") as progress:
            return evaluate(progress)

    # ---- the loop

    def plan(self, source, sources: list[int], lengths: list[int], group_by_length: bool = True):
        """The order rows are dealt in (`data.make_plan`): train.batch_size rows a micro-batch, seeded,
        grouped by length when data.group_by_length (and the loop allows it)."""
        cfg = self.cfg
        group = cfg.data.group_by_length and group_by_length
        return make_plan(source, sources, lengths, cfg.train.batch_size, cfg.train.seed, group)

    def steps_from_epochs(self, rows: int, what: str, accum: int | None = None) -> None:
        """With train.epochs, train.max_steps from the data: ⌈epochs × ⌈rows / batch_size⌉ / accum⌉ steps (a micro-
        batch is train.batch_size rows, a step ``accum`` of them: train.grad_accum_steps, 1 for RL's prompts).
        Then the warm-up is fitted to the run's length (`config.fit_warmup`: the built-in default cut, a warm-up
        the user set as long as the run refused). Called once the data has loaded and before the engine, whose
        learning-rate schedule spans the steps."""
        train = self.cfg.train
        length = f"train.max_steps={train.max_steps}"
        if train.epochs is not None:
            accum = train.grad_accum_steps if accum is None else accum
            per_epoch = -(-rows // train.batch_size) / accum  # optimiser steps per pass over the data
            train.max_steps = max(1, math.ceil(train.epochs * per_epoch - 1e-9))
            self.info(
                f"train.epochs={train.epochs:g}: {train.max_steps} steps ({rows} {what}, {train.batch_size * accum} "
                "a step)"
            )
            length = f"{train.max_steps} steps from train.epochs={train.epochs:g} on {rows} {what}"
        note = fit_warmup(train, length)
        if note:
            self.info(f"[yellow]note:[/yellow] {note}")

    def draw(self, plan, row_tokens, packing: bool) -> list[list[int]]:
        """The next optimiser step's micro-batches (train.grad_accum_steps of them, as the plan deals
        them), regrouped by train.max_tokens_per_micro_batch (0 = as drawn); the data position moves on."""
        accum = self.cfg.train.grad_accum_steps
        picks = [plan.micro_batch(k) for k in range(self.position, self.position + accum)]
        self.position += accum
        return regroup_by_tokens(picks, row_tokens, self.cfg.train.max_tokens_per_micro_batch, packing)

    def record(self, sums: dict, lr: float, grad_norm: float, plan, picks, perf: dict, seconds: float) -> dict:
        """A supervised / preference step's metrics: loss, the algorithm's metrics, the optimiser's,
        ``perf`` (which must hold perf/tokens and perf/sequences), throughput and MFU, the data mix."""
        tokens, sequences = perf["perf/tokens"], perf.pop("perf/sequences")
        return {
            "loss": sums.pop("loss"),
            **sums,
            "lr": lr,
            "grad_norm": grad_norm,
            "epoch": self.position / plan.batches_per_epoch,
            **perf,
            "perf/tokens_per_s": tokens / seconds,
            "perf/step_s": seconds,
            **self.mfu(tokens / seconds, tokens / max(sequences, 1)),
            **plan.counts([i for idx in picks for i in idx]),
        }

    def train(self, model, step_fn, close=None) -> list[dict]:
        """Steps start_step+1 .. train.max_steps: ``step_fn(step)`` returns the step's metrics; the
        held-out evaluation runs every train.eval_steps and at the last step; each record is logged
        (metrics.jsonl, trackers, progress) and a checkpoint taken when due. ``close()`` runs at the end."""
        cfg, max_steps = self.cfg, self.cfg.train.max_steps
        resume_step = self.start_step if self.ckpt else None
        self.tracker = Tracker(self.run_dir, cfg.logging, cfg.model_dump(mode="json"), resume_step=resume_step)
        self.mfu = MfuMeter(model, self.engine.device, world_size())  # perf/mfu where the device's peak is known
        records: list[dict] = []
        self.train_start = time.perf_counter()
        self.reporter.start(max_steps, self.start_step)
        self.saver.start(self.start_step)
        try:
            for step in range(self.start_step + 1, max_steps + 1):
                at_step(step)  # named by a collective mismatch (`distributed.CollectiveMismatch`)
                record = step_fn(step)
                if step == max_steps or (cfg.train.eval_steps and step % cfg.train.eval_steps == 0):
                    record.update(self.evaluate())
                self.tracker.log(step, record)
                records.append({"step": step, **record})
                self.reporter.step(step, max_steps, record)
                self.saver.after_step(step, {"data_position": self.position, "eval_before": self.eval_before})
        finally:
            self.reporter.stop()
            self.tracker.close()
            if close is not None:
                close()
        return records

    # ---- the end

    def finish(
        self, model, tokenizer, records, held_out=ACCURACY, final_loss=True, extra=None, eval_if_idle=False
    ) -> RunResult:
        """final/ (the weights, ``extra(dir)`` files), summary.json, and the result lines: each
        ``held_out`` metric before → after (``None``: every held-out metric on one line)."""
        cfg, run_dir = self.cfg, self.run_dir
        final_dir = run_dir / "final"
        save_model(final_dir, model, tokenizer, extra=extra, engine=self.engine)
        eval_after = {k: v for k, v in (records[-1] if records else {}).items() if k.startswith("eval/")}
        if not records and eval_if_idle and self.has_eval:
            eval_after = self.evaluate()
        eval_before = self.eval_before
        summary = {
            "algorithm": cfg.algorithm,
            "steps": cfg.train.max_steps,
            "train_seconds": time.perf_counter() - self.train_start,
            "eval_before": eval_before,
            "eval_after": eval_after,
            "environment": {**versions(), "device": str(self.engine.device)},
        }
        if is_main():
            write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
        # how the run went (`health`): a table shown even with --quiet, the outcome like the "done:" line
        findings = check_run(records, summary)
        if not self.reporter.silent:
            rows = summary_rows(records, summary, findings, held_out, run_dir, final_dir)
            print_summary(self.reporter.console, f"oxrl {cfg.algorithm}: how the run went", rows)
        loss = f", final loss {records[-1]['loss'] if records else math.nan:.4f}" if final_loss else ""
        errors = sum(f.level == "error" for f in findings)
        flagged = f" · {errors} error(s), {len(findings) - errors} warning(s) above" if findings else ""
        self.reporter.result(f"done: {cfg.train.max_steps} steps{loss}, model saved to {final_dir}{flagged}")
        return RunResult(run_dir, final_dir, cfg.train.max_steps, records, eval_before, eval_after)
