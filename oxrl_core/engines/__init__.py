"""Training engines: own the model's device, precision, optimiser and scheduler.

`build_engine` picks one from ``engine.name``: `torch` (one process; the default) or
`deepspeed` (ZeRO 0-3, CPU offload; one process, or one rank of a data-parallel run started by
`oxrl_core.launcher`). DeepSpeed is imported only when its engine is built. `check_engine`
refuses, before anything is loaded or launched, settings that cannot work together. `distributed` holds the ranks'
view of each other: checked collectives, the local sections inside `full_weights()`; `placement` where Ray
puts ranks and rollout actors on a cluster's nodes.

May import: the leaves, `interfaces`, `config`.
"""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from oxrl_core.engines.distributed import resolve_ray_address
from oxrl_core.errors import OxrlError

if TYPE_CHECKING:
    import torch


# what the loops use of `build_engine`'s result (`TorchEngine`, `DeepSpeedEngine`)
class Engine(Protocol):
    """The training engine as the loops see it."""

    device: torch.device  # where the batches and the trained model live
    autocast_dtype: torch.dtype | None  # mixed precision of the forward passes (None: full precision)

    def autocast(self) -> AbstractContextManager:
        """The forward passes' precision context."""

    def to_device(self, batch: dict) -> dict:
        """``batch`` with every tensor moved to `device` (other values unchanged)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss``."""

    def step(self, check=None) -> float:
        """Clip, step the optimiser and the scheduler, zero the gradients; the pre-clip gradient norm.
        ``check(grad_norm)`` runs after clipping and before the optimiser updates anything, with the pre-clip norm
        as a 0-d device tensor (None where the engine clips inside its own step); it may raise to stop the update,
        and the float it returns (the norm, read with the step's other figures) is returned."""

    @property
    def lr(self) -> float:
        """The learning rate of the step just taken (what is logged)."""

    def full_weights(self) -> AbstractContextManager:
        """Whole parameters inside the context, for code outside the training step (generation,
        evaluation, saving); a no-op except for ZeRO-3."""

    def describe(self) -> dict:
        """What a checkpoint records about the engine that wrote it (resume checks it)."""

    def save_state(self, directory: Path) -> None:
        """Optimiser and scheduler state into a checkpoint directory."""

    def load_state(self, directory: Path) -> None:
        """Optimiser and scheduler state from a checkpoint directory."""


def build_engine(
    model,
    train_cfg,
    engine_cfg,
    gradient_checkpointing: bool = False,
    extra_modules=(),
    total_steps: int | None = None,
    run_dir: Path | None = None,
):
    """The engine ``engine.name`` asks for (see `TorchEngine` for the arguments)."""
    if engine_cfg.name == "deepspeed":
        # lazy: DeepSpeed (an optional extra) loads only when its engine is built
        from oxrl_core.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(
            model, train_cfg, engine_cfg, gradient_checkpointing, extra_modules, total_steps, run_dir
        )
    # lazy: torch loads with the engine; `check_engine` and `engine_record` run before it (trainer start-up)
    from oxrl_core.engines.torch_engine import TorchEngine

    return TorchEngine(model, train_cfg, engine_cfg, gradient_checkpointing, extra_modules, total_steps)


def check_engine(config, needs_rollouts: bool) -> None:
    """Cross-section checks of the engine settings (``engine`` alone is checked by its pydantic model),
    each message naming the fields and the arithmetic. Data parallelism keeps the single-process
    batch: every optimiser step sees the same rows; each rank takes a share of every micro-batch."""
    engine, train = config.engine, config.train
    n = engine.world_size
    if n > 1:
        what = "prompts per step" if needs_rollouts else "rows per micro-batch"
        if train.batch_size % n:
            raise OxrlError(
                f"train.batch_size={train.batch_size} {what} must split evenly over engine.world_size={n} ranks "
                f"({train.batch_size} / {n} = {train.batch_size / n:g} per rank). With data parallelism an optimiser "
                f"step still sees train.batch_size × train.grad_accum_steps = {train.batch_size} × {train.grad_accum_steps} "
                f"= {train.batch_size * train.grad_accum_steps} {'prompts' if needs_rollouts else 'rows'}, each rank "
                f"1/{n} of every micro-batch: use a multiple of {n}"
            )
    if needs_rollouts:
        shards = engine.rollout_shards or n
        if shards % n:
            raise OxrlError(
                f"engine.rollout_shards={shards} rollout shards cannot be dealt evenly to engine.world_size={n} ranks "
                f"({shards} / {n} = {shards / n:g}); use a multiple of {n}"
            )
        if train.batch_size % shards:
            raise OxrlError(
                f"train.batch_size={train.batch_size} prompts cannot be cut into {shards} equal rollout shards "
                f"(engine.rollout_shards={engine.rollout_shards or f'0 = engine.world_size={n}'}; "
                f"{train.batch_size} / {shards} = {train.batch_size / shards:g}); use a multiple of {shards}"
            )
        if n > 1 and config.rollout.backend != "hf":
            raise OxrlError(
                f"rollout.backend={config.rollout.backend!r} with engine.world_size={n}: data-parallel runs generate "
                "with each rank's own hf backend on the policy it trains; a backend in separate rollout actors "
                "(vLLM) is not wired to the Ray launcher yet: use rollout.backend: hf or engine.world_size: 1"
            )
    check_optimizer(train.optimizer, engine.name)
    if engine.name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise OxrlError(
            "engine.name: deepspeed needs the deepspeed package: pip install 'oxrl[deepspeed]' (see `oxrl doctor`)"
        )
    if n > 1 and importlib.util.find_spec("ray") is None:
        raise OxrlError(f"engine.world_size={n} runs one Ray actor per rank and needs ray: pip install 'oxrl[ray]'")
    if engine.name == "deepspeed" and resolve_ray_address(engine.ray_address)[0] == "local":
        check_local_gpus(engine)


def check_optimizer(optimizer: str, engine_name: str) -> None:
    """``train.optimizer`` where it can run: adamw everywhere; adamw_bf16 and adamw_8bit on the torch engine (under
    ZeRO, DeepSpeed partitions and restores the optimiser's states itself, which is built and tested for AdamW
    only); adamw_8bit where torchao is installed."""
    if optimizer != "adamw" and engine_name == "deepspeed":
        raise OxrlError(
            f"train.optimizer={optimizer} runs on the torch engine; with engine.name: deepspeed use "
            "train.optimizer: adamw (ZeRO partitions and restores the optimiser states itself, built for AdamW only; "
            "engine.zero_stage 1+ already splits them over the ranks)"
        )
    if optimizer == "adamw_8bit" and importlib.util.find_spec("torchao") is None:
        raise OxrlError(
            "train.optimizer: adamw_8bit needs torchao, which is not installed here (pip install torchao); "
            "use adamw or adamw_bf16"
        )


def check_local_gpus(engine) -> None:
    """One GPU per rank on this machine (a Ray address is checked against the cluster at launch)."""
    if engine.device == "cpu":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if engine.device == "cuda" and have == 0:
        raise OxrlError("engine.device: 'cuda' was asked for but torch sees no CUDA device (see `oxrl doctor`)")
    if have and engine.world_size > have:
        raise OxrlError(
            f"engine.world_size={engine.world_size} ranks need {engine.world_size} GPUs (one each) but this machine has "
            f"{have}: lower engine.world_size to {have}, set engine.ray_address to a cluster with more GPUs, or "
            "engine.device: cpu to train on CPU ranks"
        )


def engine_record(engine_cfg, optimizer: str = "adamw") -> dict:
    """What a checkpoint records about the engine that writes it (`describe()` of the built engine): the torch
    engine's optimiser when it is not the default (a checkpoint of adamw records none, as before it had a choice)."""
    if engine_cfg.name == "torch":
        return {"name": "torch", **({"optimizer": optimizer} if optimizer != "adamw" else {})}
    return {"name": "deepspeed", "zero_stage": engine_cfg.zero_stage, "world_size": engine_cfg.world_size}
