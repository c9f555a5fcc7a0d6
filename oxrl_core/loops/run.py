"""The run skeleton the three loops share, written once.

A loop file (`supervised`, `preference`, `rl`) keeps only what is its own: how its data becomes
batches and what one step does. The rest is two objects, one per phase:

    setup = Setup(trainer, ckpt)                 # (loops.setup) seed, progress reporter: before anything loads
    model = setup.policy(load(setup.start_from(path)))   # the checkpoint (or base model); LoRA, chunked LM head
    ref = setup.frozen(path, field, attn)        # reference / teacher: no gradients, eval mode
    engine = setup.build_engine(model)           # optimiser, device; frozen models moved there
    run = Run(setup, model, tokenizer, engine, evaluate)   # complete: resumed, checkpointer ready
    run.banner(label, data)
    records = run.train(step)                    # eval before; step(step) -> record; eval every N, log, save
    return run.finish(records)                   # final/, summary.json, the result lines

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
from oxrl_core.data.batching import regroup_by_tokens
from oxrl_core.engines.distributed import at_step, is_main, world_size
from oxrl_core.errors import OxrlError
from oxrl_core.loops.result import RunResult
from oxrl_core.models.loading import count_parameters
from oxrl_core.models.perf import MfuMeter
from oxrl_core.models.vision import MEDIA_INPUTS
from oxrl_core.observability.health import check_run, print_summary, summary_rows, versions
from oxrl_core.run_io.checkpoint import latest_checkpoint, load_training_state, save_model
from oxrl_core.run_io.lifecycle import Checkpointer
from oxrl_core.run_io.tracking import Tracker

__all__ = [
    "MODEL_INPUTS",
    "Run",
    "RunResult",
    "StepSums",
    "backward_share",
    "non_finite_count",
    "read_together",
    "check_finite",
    "check_non_finite_count",
    "check_loss",
    "seed_everything",
]

#: collate keys that go to the model (the varlen keys come with packed micro-batches)
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "oxrl_row_bounds",  # the same boundaries as ints, from the host (`packed_attention`)
    *MEDIA_INPUTS,  # a VLM's image inputs, as its family's processor names them (`models.vision.FAMILIES`)
)

#: the held-out lines of the supervised and preference loops: (metric, label), shown when present
ACCURACY = (("eval/accuracy", "held-out accuracy"),)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def check_loss(loss: float, step: int, run_dir: Path) -> None:
    """Stop the run before a non-finite loss reaches the weights; the newest checkpoint stays as it was."""
    if not math.isfinite(loss):
        last = latest_checkpoint(run_dir)
        raise OxrlError(
            f"step {step}: the loss is {loss} (not finite); the run stops here. "
            f"Last complete checkpoint: {last or 'none'}. Lower train.lr or check the data, then --resume."
        )


def check_finite(name: str, tensor: torch.Tensor, step: int, run_dir: Path) -> None:
    """Every entry, masked or not: NaN · 0 is still NaN once it reaches the loss."""
    if not torch.isfinite(tensor).all():
        check_non_finite_count(name, int((~torch.isfinite(tensor)).sum()), step, run_dir)


def non_finite_count(tensor: torch.Tensor) -> torch.Tensor:
    """How many entries of ``tensor`` are NaN or inf, as a 0-d tensor on its device (read later, with other figures:
    `check_non_finite_count`)."""
    return (~torch.isfinite(tensor.detach())).sum()


def check_non_finite_count(name: str, bad: int, step: int, run_dir: Path) -> None:
    """`check_finite` from a count read on the host: stop the run when ``bad`` entries of ``name`` were not finite."""
    if bad:
        last = latest_checkpoint(run_dir)
        raise OxrlError(
            f"step {step}: {bad} non-finite value(s) (NaN/inf) in '{name}'; the run stops before updating the model. "
            f"Last complete checkpoint: {last or 'none'}. Check the reward / lower train.lr, then --resume."
        )


class StepSums:
    """One optimiser step's loss and metrics, each micro-batch's added with its share (`backward_share`) and kept on
    the device, then read on the host once, with the gradient norm, before the optimiser updates anything
    (`Run.update`): a GPU step waits for its device once, not once per metric and micro-batch."""

    def __init__(self):
        self.values: dict = {}  # name -> a 0-d device tensor (or a host float)

    def add(self, name: str, value, share: float = 1.0) -> None:
        value = value.detach().float().reshape(()) * share if torch.is_tensor(value) else float(value) * share
        self.values[name] = self.values.get(name, 0.0) + value

    def read(self, grad_norm=None) -> tuple[dict[str, float], float | None]:
        """(the sums as floats, the gradient norm as a float) from one device-to-host copy."""
        (sums,), norm = read_together([self], grad_norm)
        return sums, norm


def read_together(parts: list[StepSums], grad_norm=None) -> tuple[list[dict[str, float]], float | None]:
    """Several `StepSums` (the step's figures and, say, what the RL update computed once before it) and the
    gradient norm from one device-to-host copy: (each one's values as floats, the norm as a float)."""
    tensors = [v for part in parts for v in part.values.values() if torch.is_tensor(v)]
    if torch.is_tensor(grad_norm):
        tensors.append(grad_norm.detach().float().reshape(()).to(tensors[0].device if tensors else None))
    host = iter(torch.stack(tensors).tolist() if tensors else [])  # the step's one read
    read = [{k: next(host) if torch.is_tensor(v) else float(v) for k, v in part.values.items()} for part in parts]
    return read, next(host) if torch.is_tensor(grad_norm) else grad_norm


def backward_share(engine, loss: torch.Tensor, metrics: dict, share: float, sums: StepSums) -> None:
    """One micro-batch's part of an optimiser step: the gradient of ``loss × share`` (its share of the
    batch's rows or tokens), and its loss and metrics added to ``sums`` with the same share (kept on the device
    until the step's one read)."""
    engine.backward(loss * share)
    sums.add("loss", loss, share)
    for key, value in metrics.items():
        sums.add(key, value, share)


class Run:
    """A run from its first step on, complete when constructed: the policy, its tokenizer, the engine, the
    held-out evaluation (``evaluate(progress) -> eval/ metrics``, ``progress(done, total)`` counting what it
    evaluates; None without held-out data) and the loop's own checkpoint files (``extra(dir)``). Constructing
    it resumes the checkpoint being continued (optimiser state, step, data position, eval-before)."""

    def __init__(self, setup, model, tokenizer, engine, evaluate=None, extra=None, every_metric=False, eval_rows=0):
        self.cfg, self.ckpt, self.algorithm, self.run_dir = setup.cfg, setup.ckpt, setup.algorithm, setup.run_dir
        self.reporter, self.info = setup.reporter, setup.info
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self._evaluate, self.has_eval, self.every_metric = evaluate, evaluate is not None, every_metric
        self.eval_rows = eval_rows  # the held-out rows the headline metric is a share of (the verdict's noise)
        self.start_step, self.position, self.eval_before = 0, 0, {}
        if self.ckpt is not None:
            state = load_training_state(self.ckpt, engine)
            self.start_step, self.eval_before = state["step"], state.get("eval_before", {})
            self.position = state.get("data_position", 0)
            self.info(f"resuming from {self.ckpt} (step {self.start_step})")
        # checkpoints every train.save_every / save_minutes and on Ctrl-C; ``extra(dir)`` adds the loop's files
        self.saver = Checkpointer(self.run_dir, self.cfg, model, tokenizer, engine, extra=extra)
        self.mfu = MfuMeter(model, engine.device, world_size())  # perf/mfu where the device's peak is known
        self.train_start = time.perf_counter()  # from `train`'s start on

    @property
    def resumed(self) -> bool:
        return self.ckpt is not None

    def banner(self, label: str, data: str) -> None:
        train = self.cfg.train
        epochs = (
            f" · {train.max_steps} steps ({train.epochs:g} epoch{'' if train.epochs == 1 else 's'})"
            if train.epochs
            else ""
        )
        own = self.cfg.algorithm_defaults  # the algorithm's own rollout.* defaults in use (several updates per batch)
        defaults = (
            f" · {self.cfg.algorithm}'s defaults: " + ", ".join(f"{k}={v}" for k, v in own.items()) if own else ""
        )
        self.info(
            f"[bold]oxrl {self.cfg.algorithm}[/bold] · model {self.cfg.model.name or label} "
            f"({count_parameters(self.model) / 1e6:.2f}M params, {self.engine.device}) · data {data} · "
            f"run dir {self.run_dir} · {self.saver.describe()}{epochs}{defaults}"
            + (f" · {self.mfu.describe()}" if self.mfu.peak else "")
        )

    def evaluate(self) -> dict:
        """The held-out evaluation, its progress shown ({} without held-out data)."""
        if self._evaluate is None:
            return {}
        with self.reporter.counter("held-out evaluation", "samples") as progress:
            return self._evaluate(progress)

    def _evaluate_before(self) -> None:
        """At step 0, the held-out evaluation before any update (a resumed run keeps its checkpoint's)."""
        if self.start_step != 0 or not self.has_eval:
            return
        self.eval_before = self.evaluate()
        if self.every_metric:
            self.info("held-out before training: " + ", ".join(f"{k} {v:.3f}" for k, v in self.eval_before.items()))
        elif "eval/accuracy" in self.eval_before:
            self.info(f"held-out accuracy before training: {self.eval_before['eval/accuracy']:.3f}")

    # ---- the loop

    def update(self, sums: StepSums, step: int) -> tuple[float, dict[str, float]]:
        """The optimiser step: clip, read the step's sums and the gradient norm in one host read, stop the run on
        a non-finite loss before anything is updated (`check_loss`), then update. (gradient norm, sums)."""
        read: dict = {}

        def check(grad_norm):
            read["sums"], norm = sums.read(grad_norm)
            check_loss(read["sums"].get("loss", 0.0), step, self.run_dir)
            return norm

        grad_norm = self.engine.step(check)
        return grad_norm, read["sums"]

    def draw(self, plan, row_tokens, packing: bool) -> list[list[int]]:
        """The next optimiser step's micro-batches (train.grad_accum_steps of them, as the plan deals
        them), regrouped by train.max_tokens_per_micro_batch (0 = as drawn); the data position moves on."""
        accum = self.cfg.train.grad_accum_steps
        picks = [plan.micro_batch(k) for k in range(self.position, self.position + accum)]
        self.position += accum
        return regroup_by_tokens(picks, row_tokens, self.cfg.train.max_tokens_per_micro_batch, packing)

    def record(self, sums: dict, lr: float, grad_norm: float, plan, picks, perf: dict, seconds: float) -> dict:
        """A supervised / preference step's metrics: loss, the algorithm's metrics, the optimiser's,
        ``perf`` (which must hold perf/tokens and perf/square_lengths, Σᵢ Tᵢ² over the step's sequences, packed ones
        each on its own: `models.perf`), throughput and MFU, the data mix."""
        tokens, square_lengths = perf["perf/tokens"], perf.pop("perf/square_lengths")
        return {
            "loss": sums.pop("loss"),
            **sums,
            "lr": lr,
            "grad_norm": grad_norm,
            "epoch": self.position / plan.batches_per_epoch,
            **perf,
            "perf/tokens_per_s": tokens / seconds,
            "perf/step_s": seconds,
            **self.mfu(tokens, square_lengths, seconds),
            **plan.counts([i for idx in picks for i in idx]),
        }

    def train(self, step_fn, close=None) -> list[dict]:
        """The held-out evaluation before training (at step 0), then steps start_step+1 .. train.max_steps:
        ``step_fn(step)`` returns the step's metrics; the held-out evaluation runs every train.eval_every and at
        the last step; each record is logged (metrics.jsonl, trackers, progress) and a checkpoint taken when due.
        ``close()`` runs at the end, whatever happens."""
        cfg, max_steps = self.cfg, self.cfg.train.max_steps
        try:
            self._evaluate_before()
        except BaseException:
            if close is not None:
                close()
            raise
        resume_step = self.start_step if self.ckpt else None
        tracker = Tracker(self.run_dir, cfg.logging, cfg.model_dump(mode="json"), resume_step=resume_step)
        records: list[dict] = []
        self.train_start = time.perf_counter()
        self.reporter.start(max_steps, self.start_step)
        self.saver.start(self.start_step)
        try:
            for step in range(self.start_step + 1, max_steps + 1):
                at_step(step)  # named by a collective mismatch (`distributed.CollectiveMismatch`)
                record = step_fn(step)
                if step == max_steps or (cfg.train.eval_every and step % cfg.train.eval_every == 0):
                    record.update(self.evaluate())
                tracker.log(step, record)
                records.append({"step": step, **record})
                self.reporter.step(step, max_steps, record)
                self.saver.after_step(step, {"data_position": self.position, "eval_before": self.eval_before})
        finally:
            self.reporter.stop()
            tracker.close()
            if close is not None:
                close()
        return records

    # ---- the end

    def finish(self, records, held_out=ACCURACY, final_loss=True, extra=None, eval_if_idle=False) -> RunResult:
        """final/ (the weights, ``extra(dir)`` files), summary.json, and the result lines: each
        ``held_out`` metric before → after (``None``: every held-out metric on one line)."""
        cfg, run_dir = self.cfg, self.run_dir
        final_dir = run_dir / "final"
        save_model(final_dir, self.model, self.tokenizer, extra=extra, engine=self.engine)
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
            **({"eval_rows": self.eval_rows} if self.eval_rows else {}),
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
