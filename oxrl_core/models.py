"""Loading models and tokenizers (hub id or local dir; empty name = the built-in tiny model)."""

from __future__ import annotations

from pathlib import Path

from oxrl_core.errors import OxrlError


def resolve_model_path(name: str) -> str:
    if not name:
        from oxrl_core.tiny import default_model_dir

        return str(default_model_dir())
    return name


def initial_policy_path(name: str, log=None) -> str:
    """Where RL and preference runs start: ``model.name``, or with it empty the built-in tiny model
    after its cached SFT warm start on the built-in task (a random model never answers right)."""
    if name:
        return name
    from oxrl_core.tiny import warm_start_dir

    return str(warm_start_dir(log=log))


def _check_local_dir(path: str, field: str) -> None:
    """A name that is clearly a path (not a hub id) must exist; say so instead of a hub error."""
    if not Path(path).exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise OxrlError(f"{field}: model directory not found: {path}")


def _quiet_transformers() -> None:
    import os

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not torch.cuda.is_available():  # accelerate imports DeepSpeed (when installed), which warns when it picks the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def load_tokenizer(name: str, field: str = "model.name", trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    _quiet_transformers()
    path = resolve_model_path(name)
    _check_local_dir(path, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - missing dir, offline hub, bad files: one message
        raise OxrlError(f"{field}: cannot load a tokenizer from '{path}': {type(exc).__name__}: {exc}") from None
    if tokenizer.eos_token_id is None:
        raise OxrlError(f"{field}: the tokenizer at '{path}' has no EOS token; completions end with EOS")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name: str, field: str = "model.name", attn_implementation: str = "sdpa", trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    path = resolve_model_path(name)
    _check_local_dir(path, field)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # noqa: BLE001
        raise OxrlError(f"{field}: cannot load a causal LM from '{path}': {type(exc).__name__}: {exc}") from None
    return model


def count_parameters(model) -> int:
    """Parameters of the model (under ZeRO-3 a rank holds a slice; ``ds_numel`` is the whole size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def load_score_model(name: str, pad_token_id: int, field: str = "model.name", attn_implementation: str = "sdpa", trust_remote_code: bool = False):
    """A sequence-classification model with one output (a reward model), e.g. from a causal-LM
    checkpoint (the scalar head ``score`` then starts fresh, seeded by the run's seed)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    _quiet_transformers()
    path = resolve_model_path(name)
    _check_local_dir(path, field)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # noqa: BLE001
        raise OxrlError(f"{field}: cannot load a sequence-classification model from '{path}': {type(exc).__name__}: {exc}") from None
    if not isinstance(getattr(model, "score", None), torch.nn.Module):
        raise OxrlError(f"{field}: '{path}' has no per-token `score` head (a decoder reward model is expected)")
    model.config.pad_token_id = pad_token_id
    return model
