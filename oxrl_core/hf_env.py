"""Process-wide settings for the Hugging Face libraries, applied before a model or tokenizer loads.

A leaf module (nothing of oxRL; torch and transformers are imported when `quiet_transformers` runs),
so the built-in model (`oxrl_core.models.tiny`), the model loader (`oxrl_core.models.loading`), `oxrl check-model`
and plugins (the reward-model reward) share one call.
"""

from __future__ import annotations

import os
import sys


def quiet_transformers() -> None:
    """Only errors from transformers' logger, no download progress bars; and on a machine without
    CUDA, ``DS_ACCELERATOR=cpu`` unless set (accelerate imports DeepSpeed when installed, which
    warns when it picks the CPU)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _unwrap_without_importing_deepspeed()


def _unwrap_without_importing_deepspeed() -> None:
    """``save_pretrained`` unwraps the model through accelerate's ``extract_model_from_parallel``, which
    imports DeepSpeed whenever it is installed (about 2 s: its autotuner imports mlflow) only to test
    ``isinstance(model, DeepSpeedEngine)``. An object can be a DeepSpeedEngine only once DeepSpeed is
    imported, so accelerate asks that question here only then; the answer is the same either way."""
    try:
        from accelerate.utils import other
    except ImportError:  # accelerate is optional for transformers; without it nothing imports DeepSpeed here
        return
    installed = other.is_deepspeed_available
    if getattr(installed, "oxrl_only_when_loaded", False):
        return

    def deepspeed_loaded() -> bool:
        return "deepspeed" in sys.modules and installed()

    deepspeed_loaded.oxrl_only_when_loaded = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = deepspeed_loaded
