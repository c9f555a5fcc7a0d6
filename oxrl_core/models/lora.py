"""LoRA through PEFT, for every algorithm: ``lora: {enabled, r, alpha, dropout, target_modules}``.

The policy is wrapped with `peft.get_peft_model` right after it loads; only the adapter (and,
for a scalar-head model, its ``score`` head) trains, so the engine's optimiser holds just those
parameters. A reference or teacher model is never wrapped.

Saving (`checkpoint.save_model`) writes both forms, so nothing downstream needs PEFT:

- ``<dir>/`` — merged HF weights under the base model's own names (PEFT's ``base_model.model.``,
  ``.base_layer`` and ``modules_to_save`` prefixes stripped, the ``lora_`` tensors folded in):
  `AutoModelForCausalLM.from_pretrained(dir)` and vLLM load it directly;
- ``<dir>/adapter/`` — the PEFT adapter (`PeftModel.from_pretrained(base, dir/"adapter")`).

The saved key set is checked against the base architecture's own (built on the meta device): a
missing or unexpected key is an error at save time, never a ``final/`` that `from_pretrained`
silently re-initialises.

``target_modules: all-linear`` (the default) means every ``nn.Linear`` of the language model
(attention and dense MLP projections), resolved here rather than by PEFT: the output head, a
vision tower / multimodal projector, MoE routers and the fused MoE expert weights are left out
(PEFT's own ``all-linear`` wraps fused experts as parameters, and the router of a MoE model). A
MoE model therefore trains adapters on attention (and any dense/shared-expert MLP) with its
experts frozen; name the modules explicitly to adapt anything else.

The merge is PEFT's ``merge_adapter()`` / ``unmerge_adapter()`` around the export (no second copy
of the model), as TRL does before pushing weights to vLLM. Resuming loads the base model named in
``model.name`` and the checkpoint's adapter, so training continues on the same parameters.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from oxrl_core.errors import OxrlError

ADAPTER_DIR = "adapter"


def is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


_ROUTER_NAMES = {"gate", "router", "shared_expert_gate"}  # MoE routing layers (a dense MLP's is `gate_proj`)
_EXCLUDED_PARTS = {"experts", "vision_tower", "vision_model", "visual", "multi_modal_projector", "audio_tower"}


def default_targets(model) -> list[str]:
    """``all-linear`` as oxRL means it: the full names of the language model's ``nn.Linear`` modules,
    without the output head, vision/audio towers, MoE routers and experts."""
    from torch import nn

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    inside = {id(m) for m in decoder.modules()}
    names = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if (
            isinstance(module, nn.Linear)
            and id(module) in inside
            and parts[-1] not in _ROUTER_NAMES
            and not _EXCLUDED_PARTS.intersection(parts)
        ):
            names.append(name)
    return names


def _peft_config(cfg, head: str, model=None):
    from peft import LoraConfig, TaskType

    target = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    if target == "all-linear" and model is not None:
        target = default_targets(model) or target
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target,
        task_type=TaskType.SEQ_CLS if head == "score" else TaskType.CAUSAL_LM,  # SEQ_CLS keeps `score` trainable
    )


def apply_lora(model, cfg, head: str = "lm", resume_from: Path | None = None):
    """The policy with a LoRA adapter: a fresh one, or the adapter saved in checkpoint ``resume_from``."""
    if not cfg.enabled:
        return model
    from peft import PeftModel, get_peft_model

    if resume_from is not None:
        return PeftModel.from_pretrained(model, str(Path(resume_from) / ADAPTER_DIR), is_trainable=True)
    try:
        return get_peft_model(model, _peft_config(cfg, head, model))
    except ValueError as exc:  # e.g. target modules not found in the model
        raise OxrlError(f"lora.target_modules: {exc}") from None


@contextlib.contextmanager
def merged(model):
    """Inside the block, the LoRA weights are folded into the base weights (no-op without PEFT)."""
    if not is_peft(model):
        yield model
        return
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()


_PEFT_INFIX = re.compile(r"\.(?:base_layer|modules_to_save\.[^.]+)(?=\.)")


def hf_name(key: str) -> str | None:
    """A PEFT state-dict key under the base model's own name; None for adapter-only tensors.

    Every PEFT infix goes, however deep the wrapping (a parameter-wrapped MoE expert is
    ``experts.base_layer.base_layer.gate_up_proj``)."""
    if "lora_" in key or ".original_module." in key:
        return None
    return _PEFT_INFIX.sub("", key)


def check_keys(base, state: dict) -> None:
    """An error naming the keys when ``state`` does not match the base architecture's own state dict."""
    import torch

    with torch.device("meta"):
        fresh = type(base)._from_config(base.config)
    expected = set(fresh.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:

        def show(keys):
            return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")

        raise OxrlError(
            f"LoRA save: the merged weights do not match {type(base).__name__}'s own keys "
            f"(missing: {show(missing) or 'none'}; unexpected: {show(unexpected) or 'none'}); "
            "from_pretrained would re-initialise them. Set lora.target_modules to the layers to adapt."
        )


def merged_state_dict(model) -> dict:
    """The policy's weights as the base architecture names them, adapters merged (call inside `merged`)."""
    base = model.get_base_model()
    out = {}
    for key, tensor in base.state_dict().items():
        name = hf_name(key)
        if name is not None:
            out[name] = tensor.detach().clone()
    return out


def save_lora(tmp: Path, model, check=None) -> None:
    """Merged HF weights in ``tmp`` and the adapter in ``tmp/adapter``; ``check(state)`` may refuse the
    merged weights before anything is written (checkpoint.check_finite)."""
    with merged(model):
        state = merged_state_dict(model)
    check_keys(model.get_base_model(), state)
    if check is not None:
        check(state)
    model.get_base_model().save_pretrained(tmp, state_dict=state)
    model.save_pretrained(tmp / ADAPTER_DIR)


def trainable_summary(model) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (
        f"LoRA: {trainable / 1e6:.3f}M of {total / 1e6:.2f}M parameters train ({100 * trainable / max(total, 1):.2f}%)"
    )


def start_path(policy_path: str, ckpt: Path | None, cfg) -> tuple[str, Path | None]:
    """(where the policy's weights load from, the checkpoint whose adapter to resume): with LoRA the
    base model always loads from ``policy_path`` and a resumed run takes the checkpoint's adapter."""
    if cfg.enabled:
        return policy_path, ckpt
    return (str(ckpt) if ckpt else policy_path), None


def policy_state_dict(model) -> dict:
    """The policy's weights under the base architecture's names (adapters merged), e.g. to copy into a reference."""
    if not is_peft(model):
        return model.state_dict()
    with merged(model):
        return merged_state_dict(model)
