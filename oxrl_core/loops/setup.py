"""What a run builds before its first step: the `Setup` every loop starts from (the seed, the progress
reporter, and the helpers that load the policy, the frozen models and the engine). `loops.run.Run` takes over
once they exist.
"""

from __future__ import annotations

import math
from pathlib import Path

from oxrl_core.config import fit_warmup
from oxrl_core.data.batching import make_plan
from oxrl_core.engines import build_engine
from oxrl_core.loops.run import seed_everything
from oxrl_core.models.loading import load_causal_lm, resolve_model_path
from oxrl_core.models.lora import apply_lora, start_path, trainable_summary
from oxrl_core.models.packing_probe import probe
from oxrl_core.models.token_head import choose_path, path_of
from oxrl_core.models.vision import PACKS, freeze_vision, is_vlm, load_processing, placeholder_token_ids
from oxrl_core.observability.progress import Reporter


class Setup:
    """A run before its first step, while the loop builds it: the config, the seed and the progress reporter,
    and the helpers that load the policy, the frozen models and the engine. `Run` takes over once they exist."""

    def __init__(self, trainer, ckpt: Path | None):
        self.cfg, self.ckpt, self.algorithm = trainer.config, ckpt, trainer.algorithm
        self.run_dir, self.registry = trainer.run_dir, trainer.registry
        self.reporter = Reporter(trainer.quiet, self.cfg.train.log_every)
        self.info = self.reporter.info
        seed_everything(self.cfg.train.seed)
        self.adapter_ckpt: Path | None = None  # under LoRA: the adapter of the checkpoint being resumed
        self._frozen: list = []  # moved to the engine's device by `build_engine`
        self.processing = None  # a VLM run's `vision.VLMProcessing` (`vision`)

    def start_from(self, policy_path: str) -> str:
        """Where the policy's weights load from: the checkpoint being resumed, or ``policy_path``
        (under LoRA the base model, the adapter coming from the checkpoint)."""
        load_from, self.adapter_ckpt = start_path(policy_path, self.ckpt, self.cfg.lora)
        return load_from

    def vision(self, name: str):
        """The processing of a VLM run (`vision.VLMProcessing`: its processor, family and image token) when
        ``name`` is a vision-language model, else None; kept as ``self.processing``. A VLM whose processor does not
        load (a multimodal layout saved without its image processor, used for text) runs as a text model, with a
        note."""
        path = resolve_model_path(name)
        self.processing = None
        if is_vlm(path):
            try:
                self.processing = load_processing(path)
            except OSError as exc:  # a multimodal layout saved without its image processor: text rows only
                first = str(exc).split(". ")[0]
                self.info(
                    f"[yellow]note:[/yellow] model.name is a vision-language model whose processor does not load "
                    f"({first}); it trains on text rows, and image rows are refused"
                )
        return self.processing

    def packing_for(self, packing, packed_positions: bool = False):
        """``data.packing`` for this run. A VLM's rows pack exactly only where the loop gives every packed row its own
        rotary positions (``packed_positions``: the supervised loop, for `vision.PACKS` families); elsewhere they
        are padded, with a note."""
        if not packing or self.processing is None:
            return packing
        family = self.processing.family.model_type
        if packed_positions and family in PACKS:
            return packing
        self.info(
            f"[yellow]note:[/yellow] data.packing: image rows are padded, not packed (packing {family} rows is "
            "not verified here)"
        )
        return False

    def packs_exactly(self, packing, *models, unshared: str = "packing without them"):
        """``packing`` (True, ``"shared"`` for shared-prompt rows, or falsy) once the loaded ``models`` are measured
        (`packing_probe.probe`: a packed row against the separate forwards, cached per model): packing a model
        fails steps aside to padded rows (False), shared prompts that fail to ordinary packing (True; ``unshared``
        says what the loop does then), each with one note naming the model type. ``data.packing: auto`` that stays on
        says so."""
        if not packing:
            return False
        for model in models:
            if model is None:
                continue
            verdict = probe(model, shared_prefix=packing == "shared")
            if not verdict.packing:
                self.info(f"[yellow]note:[/yellow] {verdict.note()}")
                return False
            if packing == "shared" and not verdict.shared_prefix:
                self.info(f"[yellow]note:[/yellow] {verdict.note('shared prompts', unshared)}")
                packing = True
        if self.cfg.data.packing == "auto":
            self.info(
                f"data.packing: on (auto): a packed row of this {verdict.model_type} model equals its sequences' "
                f"separate forwards (measured, max |Δ| {verdict.packing_diff:.1g}); data.packing=false pads instead"
            )
        return "shared" if packing == "shared" else True

    def policy(self, model, head: str = "lm"):
        """The loaded policy made trainable: a VLM's vision tower frozen (``model.freeze_vision``), LoRA
        (``lora.*``) and the chunked LM head."""
        if self.processing is not None and self.cfg.model.freeze_vision:
            frozen = freeze_vision(model)
            self.info(f"vision tower frozen ({frozen:,} parameters; model.freeze_vision: false trains it)")
        model = apply_lora(model, self.cfg.lora, head, resume_from=self.adapter_ckpt)
        if self.cfg.lora.enabled:
            self.info(trainable_summary(model))
        if head == "lm":
            self.choose_head(model)  # chunked LM head (or full logits)
        return model

    def scored_tokens(self) -> int:
        """The most tokens one training micro-batch can score, from the config (an upper bound): the rows of a
        micro-batch × the longest a row's scored part can be, or ``train.max_tokens_per_micro_batch`` if smaller."""
        cfg, loop = self.cfg, self.algorithm.loop
        if loop == "rl":
            rows = cfg.rollout.micro_batch_size or -(-cfg.train.batch_size * cfg.rollout.n // cfg.rollout.minibatches)
            tokens = rows * (cfg.env.max_tokens if cfg.env.name else cfg.rollout.max_new_tokens)
        else:
            tokens = cfg.train.batch_size * (2 if loop == "preference" else 1) * cfg.data.max_length
        budget = cfg.train.max_tokens_per_micro_batch
        return min(tokens, budget) if budget else tokens

    def choose_head(self, model):
        """How ``model``'s per-token quantities are computed (`models.token_head.choose_path`): chunk by chunk
        where one micro-batch's full logits would exceed ``train.logits_chunk_min_mb``, else the full logits; a
        VLM's never-sampled tokens masked on every path (the distribution its rollouts sample from)."""
        t = self.cfg.train
        tokenizer = self.processing.tokenizer if self.processing is not None else None
        masked = path_of(model).masked or tuple(placeholder_token_ids(getattr(model, "config", None), tokenizer))
        choose_path(
            model,
            t.logits_chunk_size,
            self.info,
            tokens=self.scored_tokens(),
            min_mb=t.logits_chunk_min_mb,
            vocab_tile=t.logits_vocab_tile,
            masked=masked,  # a VLM's never-sampled tokens (registered when it loaded)
        )

    def frozen(self, path: str, field: str, attn: str, check=None):
        """A model that is read, never trained (reference, teacher): no gradients, eval mode; moved to
        the engine's device by `build_engine`. ``check(model)`` runs on it first."""
        model = load_causal_lm(path, field=field, attn_implementation=attn, reporter=self.reporter)
        if check is not None:
            check(model)
        model.requires_grad_(False).eval()
        self.choose_head(model)
        self._frozen.append(model)
        return model

    def reference(self, policy_path: str, attn: str):
        """The reference: ``model.ref``, else the initial policy (never the checkpoint being resumed)."""
        cfg = self.cfg.model
        return self.frozen(cfg.ref or policy_path, "model.ref" if cfg.ref else "model.name", attn)

    def build_engine(self, model, **options):
        """The training engine (``engine.*``: torch or DeepSpeed); frozen models join it on its device."""
        cfg = self.cfg
        engine = build_engine(
            model, cfg.train, cfg.engine, cfg.model.gradient_checkpointing, run_dir=self.run_dir, **options
        )
        for module in self._frozen:
            module.to(engine.device)
        self._frozen = []
        return engine

    def plan(self, source, sources: list[int], lengths: list[int], group_by_length: bool = True):
        """The order rows are dealt in (`data.batching.make_plan`): train.batch_size rows a micro-batch, seeded,
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
