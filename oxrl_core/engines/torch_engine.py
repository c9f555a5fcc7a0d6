"""The `torch` engine: one process, CPU or one GPU.

AdamW (fused; no weight decay on biases and norm weights; or the leaner ``train.optimizer`` variants,
`oxrl_core.engines.optimizers`), a transformers LR schedule
with warm-up, gradient clipping, bf16 autocast where the device supports it,
and gradient checkpointing when the model config asks for it. The `deepspeed` engine
(`oxrl_core.engines.deepspeed_engine`) has the same interface and the same optimiser
(there in torch's default multi-tensor form, which ZeRO's partitioned parameters take).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from oxrl_core.engines import distributed
from oxrl_core.engines.optimizers import build_optimizer, state_classes
from oxrl_core.engines.state_files import load_state_file
from oxrl_core.errors import OxrlError


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise OxrlError("engine.device: 'cuda' was asked for but torch sees no CUDA device (see `oxrl doctor`)")
    return torch.device(name)


def pick_autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast: always when asked, on `auto` only on a GPU that supports bf16."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def adamw_param_groups(model: torch.nn.Module, extra_modules=(), weight_decay: float = 0.0) -> list[dict]:
    """AdamW groups: weight decay on matrices, none on biases and norm weights; trainable parameters of
    ``model`` then of each extra module, a parameter shared between them (a backbone) once."""
    named = list(model.named_parameters())
    for i, module in enumerate(extra_modules):
        named += [(f"extra{i}.{n}", p) for n, p in module.named_parameters()]
    decay, no_decay, seen = [], [], set()
    for name, param in named:
        if id(param) in seen:  # a shared backbone appears once
            continue
        seen.add(id(param))
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class PrecisionAndDevice:
    """What every engine does alike with its ``device`` and ``autocast_dtype``."""

    device: torch.device
    autocast_dtype: torch.dtype | None

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class TorchEngine(PrecisionAndDevice):
    def __init__(
        self,
        model: torch.nn.Module,
        train_cfg,
        engine_cfg,
        gradient_checkpointing: bool = False,
        extra_modules=(),
        total_steps: int | None = None,
    ):
        """``extra_modules`` (e.g. a critic) are trained by the same optimiser, after the model's parameters;
        ``total_steps`` is the number of optimiser steps of the run (default ``train.max_steps``)."""
        from transformers import get_scheduler

        self.device = pick_device(engine_cfg.device)
        self.model = model.to(self.device)
        self.autocast_dtype = pick_autocast_dtype(train_cfg.precision, self.device)
        self.max_grad_norm = train_cfg.max_grad_norm
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        model.train()
        for module in extra_modules:
            module.to(self.device).train()
        # fused: one kernel over all parameters (CPU and CUDA; 4x faster than foreach on the tiny model's CPU step)
        fused = self.device.type in ("cpu", "cuda") and all(
            p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in model.parameters() if p.requires_grad
        )
        self.optimizer_name = train_cfg.optimizer
        groups = adamw_param_groups(model, extra_modules, train_cfg.weight_decay)
        self.optimizer = build_optimizer(train_cfg.optimizer, groups, train_cfg.lr, train_cfg.seed, fused or None)
        self.scheduler = get_scheduler(
            train_cfg.lr_scheduler,
            self.optimizer,
            num_warmup_steps=train_cfg.warmup_steps,
            num_training_steps=total_steps or train_cfg.max_steps,
        )

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, check=None) -> float:
        """Clip, ``check(grad_norm)`` (the norm still on the device: the caller reads it with its other figures,
        and may stop here, before the update), step optimiser and scheduler, zero grads; the pre-clip norm."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # (), on the device: no host read
        norm = check(grad_norm) if check is not None else None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm) if norm is None else norm

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])  # (torchao's optimiser keeps lr as a CPU tensor)

    def full_weights(self):
        """Whole parameters for code outside the training step (generation, evaluation, saving); they
        always are in one process (see `DeepSpeedEngine.full_weights` for ZeRO-3). As there, code inside
        may issue no collective (`distributed.local_section`): the rule is checked in one process too."""
        return distributed.local_section()

    def describe(self) -> dict:
        """What a checkpoint records about the engine that wrote it (resume checks it)."""
        return {"name": "torch", **({"optimizer": self.optimizer_name} if self.optimizer_name != "adamw" else {})}

    def save_state(self, directory: Path) -> None:
        """Optimiser and scheduler into a checkpoint directory (``engine.pt``)."""
        torch.save(self.state_dict(), Path(directory) / "engine.pt")

    def load_state(self, directory: Path) -> None:
        allowed = state_classes(self.optimizer_name)  # (adamw_8bit: its quantised state's tensor class)
        self.load_state_dict(load_state_file(Path(directory) / "engine.pt", allowed, map_location=self.device))

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
