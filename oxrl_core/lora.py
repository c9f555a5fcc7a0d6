"""LoRA through PEFT, for every algorithm: ``lora: {enabled, r, alpha, dropout, target_modules}``.

The policy is wrapped with `peft.get_peft_model` right after it loads; only the adapter (and,
for a scalar-head model, its ``score`` head) trains, so the engine's optimiser holds just those
parameters. A reference or teacher model is never wrapped.

Saving (`checkpoint.save_model`) writes both forms, so nothing downstream needs PEFT:

- ``<dir>/`` — merged HF weights under the base model's own names (PEFT's ``base_model.model.``,
  ``.base_layer`` and ``modules_to_save`` prefixes stripped, the ``lora_`` tensors folded in):
  `AutoModelForCausalLM.from_pretrained(dir)` and vLLM load it directly;
- ``<dir>/adapter/`` — the PEFT adapter (`PeftModel.from_pretrained(base, dir/"adapter")`).

The merge is PEFT's ``merge_adapter()`` / ``unmerge_adapter()`` around the export (no second copy
of the model), as TRL does before pushing weights to vLLM. Resuming loads the base model named in
``model.name`` and the checkpoint's adapter, so training continues on the same parameters.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

ADAPTER_DIR = "adapter"


def is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _peft_config(cfg, head: str):
    from peft import LoraConfig, TaskType

    target = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    return LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=target,
        task_type=TaskType.SEQ_CLS if head == "score" else TaskType.CAUSAL_LM,  # SEQ_CLS keeps `score` trainable
    )


def apply_lora(model, cfg, head: str = "lm", resume_from: Path | None = None):
    """The policy with a LoRA adapter: a fresh one, or the adapter saved in checkpoint ``resume_from``."""
    if not cfg.enabled:
        return model
    from peft import PeftModel, get_peft_model

    from oxrl_core.errors import OxrlError

    if resume_from is not None:
        return PeftModel.from_pretrained(model, str(Path(resume_from) / ADAPTER_DIR), is_trainable=True)
    try:
        return get_peft_model(model, _peft_config(cfg, head))
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


def hf_name(key: str) -> str | None:
    """A PEFT state-dict key under the base model's own name; None for adapter-only tensors."""
    if "lora_" in key or ".original_module." in key:
        return None
    key = key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
    return key


def merged_state_dict(model) -> dict:
    """The policy's weights as the base architecture names them, adapters merged (call inside `merged`)."""
    base = model.get_base_model()
    out = {}
    for key, tensor in base.state_dict().items():
        name = hf_name(key)
        if name is not None:
            out[name] = tensor.detach().clone()
    return out


def save_lora(tmp: Path, model) -> None:
    """Merged HF weights in ``tmp`` and the adapter in ``tmp/adapter``."""
    with merged(model):
        state = merged_state_dict(model)
    model.get_base_model().save_pretrained(tmp, state_dict=state)
    model.save_pretrained(tmp / ADAPTER_DIR)


def trainable_summary(model) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"LoRA: {trainable / 1e6:.3f}M of {total / 1e6:.2f}M parameters train ({100 * trainable / max(total, 1):.2f}%)"


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
