"""Process-wide settings for the Hugging Face libraries, applied before a model or tokenizer loads.

A leaf module (nothing of oxRL; torch and transformers are imported when `quiet_transformers` runs),
so the built-in model (`oxrl_core.models.tiny`), the model loader (`oxrl_core.models.loading`), `oxrl check-model`
and plugins (the reward-model reward) share one call.
"""

from __future__ import annotations

import os


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
