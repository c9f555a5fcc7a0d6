"""The `deepspeed` engine: ZeRO stages 0-3, CPU offload, one rank of a data-parallel run.

The loops cannot tell it from `TorchEngine`: ``device``, ``autocast()``, ``to_device()``,
``backward(loss)``, ``step() -> pre-clip gradient norm``, ``lr``, plus ``full_weights()``,
``save_state()`` / ``load_state()`` and ``describe()`` for generation, checkpoints and resume.

- The optimiser is the torch engine's: AdamW with the same decay / no-decay groups and the same
  transformers LR schedule, handed to DeepSpeed as a client optimiser and scheduler (torch's
  AdamW also with ``offload_optimizer``: DeepSpeedCPUAdam would need a compiled op). ``train.optimizer`` is
  adamw here: ZeRO partitions and restores the optimiser's states itself, built for AdamW; the leaner
  adamw_bf16 / adamw_8bit are refused before the run starts (`engines.check_optimizer`).
- The loops own gradient accumulation (micro-batches weighted by loss tokens, a variable number
  per step in the RL loop), so DeepSpeed runs with ``managed_gradient_accumulation: false``:
  every `backward` accumulates, every `step` is the boundary (reduce, clip, update, zero).
- `backward(loss)` takes this rank's part of the global loss (the ranks' parts sum to it);
  DeepSpeed averages gradients over ranks, so the part is scaled by the world size.
- The loops call the model itself, not DeepSpeed's wrapper (a critic, or a reward model's
  backbone and head, are separate calls), so `backward` does the two things
  ``DeepSpeedEngine.forward`` would have done for the micro-step: clear ZeRO's backward-seen
  flag (which advances its micro-step, so gradients accumulate instead of being overwritten) and
  hook DeepSpeed's backward prologue onto the loss.
- ``train.precision`` bf16 (or auto on a bf16 GPU) is DeepSpeed's bf16 mode: bf16 parameters and
  gradients, fp32 master weights in the optimiser; ``final/`` then holds bf16 weights.
- The DeepSpeed JSON is generated from the validated config (`deepspeed_config`) and written to
  ``<run>/deepspeed_config.json`` for inspection; there is no hand-kept second config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from oxrl_core.engines import distributed
from oxrl_core.engines.optimizers import build_optimizer
from oxrl_core.engines.state_files import deepspeed_allowed, load_state_file
from oxrl_core.engines.torch_engine import PrecisionAndDevice, adamw_param_groups, pick_autocast_dtype, pick_device
from oxrl_core.errors import OxrlError

CONFIG_FILE = "deepspeed_config.json"
STATE_DIR, STATE_TAG = "deepspeed", "state"  # checkpoints/step-N/deepspeed/state/: every rank's partition


def deepspeed_config(train_cfg, engine_cfg, bf16: bool, clip_in_deepspeed: bool = True) -> dict:
    """The DeepSpeed JSON of a run, from the validated ``train`` and ``engine`` sections.

    The batch fields are DeepSpeed's bookkeeping only (the loops own accumulation): a micro-batch
    of ``train.batch_size`` rows is split over the ranks, ``train.grad_accum_steps`` of them make
    an optimiser step, so DeepSpeed's ``train_batch_size`` is the single-process optimiser batch.
    """
    zero: dict = {"stage": engine_cfg.zero_stage}
    if engine_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if engine_cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": max(1, train_cfg.batch_size // engine_cfg.world_size),
        "gradient_accumulation_steps": train_cfg.grad_accum_steps,
        "managed_gradient_accumulation": False,
        # ZeRO stage 0 in fp32 hands the reduced gradients to the client optimiser, whose step hook clips
        "gradient_clipping": train_cfg.max_grad_norm if clip_in_deepspeed else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,  # the client optimiser is torch's AdamW
        "zero_force_ds_cpu_optimizer": False,  # ... also with offload_optimizer
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def import_deepspeed(device_type: str):
    """Import DeepSpeed quietly, for ``device_type`` (its accelerator is chosen at import)."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated.*", category=FutureWarning, module=r"torch\.distributed.*"
    )
    # DeepSpeed's autotuner (oxRL never runs it) imports mlflow when installed: about 1.6 s per rank. It is
    # hidden for this import only; a run that logs to MLflow imports it itself (run_io.tracking).
    hide_mlflow = "mlflow" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise OxrlError(
            f"engine.name: deepspeed needs the deepspeed package (pip install 'oxrl[deepspeed]'): {exc}"
        ) from None
    finally:
        if hide_mlflow and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # DeepSpeed compiles a shared-memory all-reduce for CPU *inference* when its group starts (about
    # 100 s on a fresh machine); training never uses it, so mark it unavailable.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _safe_checkpoint_engine(ds):
    """DeepSpeed's torch checkpoint engine (the one oxRL's generated config selects) with `load` reading each state
    file through `load_state_file`: DeepSpeed's own loads use ``weights_only=False``, so a pickle payload placed in
    a copied run's ``deepspeed/state/`` would run on ``--resume``; here it is refused, naming the file."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(ds.checkpoint_engine) is not TorchCheckpointEngine:
        raise OxrlError(
            f"DeepSpeed chose the {type(ds.checkpoint_engine).__name__} checkpoint engine; oxRL reads state files only "
            "through the torch one (checkpoint settings in the DeepSpeed config are not supported)"
        )

    class SafeLoads(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return load_state_file(Path(path), deepspeed_allowed(), map_location)

    return SafeLoads(ds._config)


class _Trained(torch.nn.Module):
    """The policy and the extra modules (a critic) as one module for DeepSpeed; never called itself."""

    def __init__(self, model: torch.nn.Module, extra_modules):
        super().__init__()
        self.policy = model
        self.extra = torch.nn.ModuleList(extra_modules)


class DeepSpeedEngine(PrecisionAndDevice):
    def __init__(
        self,
        model: torch.nn.Module,
        train_cfg,
        engine_cfg,
        gradient_checkpointing: bool = False,
        extra_modules=(),
        total_steps: int | None = None,
        run_dir: Path | None = None,
    ):
        """As `TorchEngine`; ``run_dir`` receives the generated ``deepspeed_config.json`` (rank 0)."""
        from transformers import get_scheduler

        self.device = pick_device(engine_cfg.device)
        deepspeed = import_deepspeed(self.device.type)
        distributed.init_process_group(self.device.type, engine_cfg.timeout_s)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.world_size = distributed.world_size()
        self.zero_stage = engine_cfg.zero_stage
        self.autocast_dtype = pick_autocast_dtype(train_cfg.precision, self.device)
        bf16 = self.autocast_dtype == torch.bfloat16
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        model.train()
        for module in extra_modules:
            module.train()
        self.module = _Trained(model, extra_modules) if extra_modules else model
        groups = [g for g in adamw_param_groups(model, extra_modules, train_cfg.weight_decay) if g["params"]]
        if train_cfg.optimizer != "adamw":  # `engines.check_optimizer` refuses the others before any engine is built
            raise OxrlError(f"train.optimizer={train_cfg.optimizer}: the deepspeed engine builds AdamW only")
        self.optimizer = build_optimizer("adamw", groups, train_cfg.lr)
        self.scheduler = get_scheduler(
            train_cfg.lr_scheduler,
            self.optimizer,
            num_warmup_steps=train_cfg.warmup_steps,
            num_training_steps=total_steps or train_cfg.max_steps,
        )
        # ZeRO optimisers and DeepSpeed's bf16 optimiser clip and report the pre-clip norm; at stage 0
        # in fp32 DeepSpeed steps the client optimiser directly, so a step pre-hook measures and clips.
        self.max_grad_norm = train_cfg.max_grad_norm
        self._norm_in_hook = engine_cfg.zero_stage == 0 and not bf16
        self._hook_norm = 0.0
        if self._norm_in_hook:
            self.optimizer.register_step_pre_hook(self._clip_before_update)
        self.config = deepspeed_config(train_cfg, engine_cfg, bf16, clip_in_deepspeed=not self._norm_in_hook)
        if run_dir is not None and distributed.is_main():
            (Path(run_dir) / CONFIG_FILE).write_text(json.dumps(self.config, indent=2) + "\n")
        self.ds, *_ = deepspeed.initialize(
            model=self.module, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=self.config
        )
        self.ds.checkpoint_engine = _safe_checkpoint_engine(self.ds)
        self._full_depth = 0

    # ------------------------------------------------------------------ the training step

    def backward(self, loss: torch.Tensor) -> None:
        """``loss``: this rank's part of the global loss; gradients are summed over ranks."""
        from deepspeed.runtime.utils import register_output_backward_hooks

        optimizer = self.ds.optimizer
        if hasattr(optimizer, "clear_backward_seen_flag"):  # ZeRO: a new micro-step (accumulate, do not overwrite)
            optimizer.clear_backward_seen_flag()
        register_output_backward_hooks(loss, preprocess_once_fn=self.ds._backward_prologue)
        self.ds.backward(loss * self.world_size, scale_wrt_gas=False)

    def _clip_before_update(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        self._hook_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def step(self, check=None) -> float:
        """Reduce, clip, step optimiser and scheduler, zero grads; return the pre-clip gradient norm. ``check(None)``
        runs before DeepSpeed's step (which clips inside it), so it may stop the update."""
        if check is not None:
            check(None)
        self.ds.step()
        if self.zero_stage == 3:
            self._end_of_step()
        if self._norm_in_hook:
            return self._hook_norm
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def _end_of_step(self) -> None:
        """ZeRO-3 closes its parameter-fetch trace when the wrapped module's forward starts; with extra
        modules the wrapper is never called, so close it after each optimiser step."""
        if isinstance(self.module, _Trained):
            self.ds.optimizer.parameter_offload.get_param_coordinator().reset_step()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ outside the training step

    @contextlib.contextmanager
    def full_weights(self):
        """ZeRO-3: every parameter whole on every rank, with DeepSpeed's fetch/release hooks taken off,
        for code outside the training step (generation, evaluation, saving, a weight sync), which then
        runs without collectives and may run on one rank only (`distributed.local_section`: an oxRL
        collective inside raises). Entering is collective (every rank gathers). ZeRO-0/1/2 keep whole
        parameters on every rank: nothing to gather.

        (The hooks would release parameters after each module and gather them again, and close a
        trace at each top-level call: collectives that ranks generating different lengths, or one
        rank evaluating alone, would not match.)
        """
        if self.zero_stage != 3 or self._full_depth:
            self._full_depth += 1
            try:
                with distributed.local_section():
                    yield
            finally:
                self._full_depth -= 1
            return
        import deepspeed

        offload = self.ds.optimizer.parameter_offload
        params = list(self.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            for param in params:
                param.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            offload.fwd_pre_hook.remove()
            self._full_depth += 1
            try:
                with distributed.local_section():  # whole weights, no hooks: the chunked head gathers nothing
                    yield
            finally:
                self._full_depth -= 1
                coordinator = offload.get_param_coordinator()
                if not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
                offload._register_deepspeed_module(offload.module)
                offload.fwd_pre_hook = offload.module.register_forward_pre_hook(
                    lambda module, *args: offload.get_param_coordinator().reset_step()
                )

    def describe(self) -> dict:
        return {"name": "deepspeed", "zero_stage": self.zero_stage, "world_size": self.world_size}

    def save_state(self, directory: Path) -> None:
        """Every rank: its partition of the optimiser state and fp32 master weights, and the scheduler,
        in DeepSpeed's checkpoint format under ``<directory>/deepspeed/state/`` (DeepSpeed also
        leaves its ``zero_to_fp32.py`` there, which rebuilds fp32 weights from the partitions)."""
        self.ds.save_checkpoint(str(Path(directory) / STATE_DIR), tag=STATE_TAG, save_latest=False)

    def load_state(self, directory: Path) -> None:
        """Every rank: its state back from ``save_state``'s files, each read without running code it holds
        (`_safe_checkpoint_engine`)."""
        path = Path(directory) / STATE_DIR
        if not (path / STATE_TAG).is_dir():
            raise OxrlError(
                f"{directory}: no DeepSpeed state ({STATE_DIR}/{STATE_TAG}/) to resume the deepspeed engine from"
            )
        loaded, _ = self.ds.load_checkpoint(
            str(path), tag=STATE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise OxrlError(f"{path}: DeepSpeed could not load its checkpoint")
