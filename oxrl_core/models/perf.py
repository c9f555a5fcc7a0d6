"""Model FLOPs utilisation (``perf/mfu`` in metrics.jsonl).

MFU = achieved model FLOPs per second / the hardware's peak, where the model FLOPs of training
on one token of a causal LM with N parameters, L layers, hidden size H and sequence length T are
(Chowdhery et al., 2022, PaLM, appendix B; no recomputation counted)

    6·N + 12·L·H·T        (forward 2N + attention 4LHT; backward twice the forward)

Frozen weights (LoRA's base) need no weight gradient: their backward costs 2N instead of 4N,
so with a fraction f of the parameters trainable the count is (4 + 2f)·N + 12·L·H·T.

The peak is the device's dense bf16 tensor-core figure from its datasheet, looked up by GPU
name, or ``OXRL_PEAK_TFLOPS`` (per device; e.g. for another GPU or to state a CPU's peak). With
no known peak, ``perf/mfu`` is not logged.
"""

from __future__ import annotations

import os

from oxrl_core.models.loading import count_parameters

#: dense bf16 peak TFLOP/s per device (datasheets; SXM parts unless named)
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}


def peak_flops(device) -> float | None:
    """Peak FLOP/s of one ``device`` (a torch.device), or None when unknown."""
    override = os.environ.get("OXRL_PEAK_TFLOPS", "")
    if override:
        return float(override) * 1e12
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():  # the more specific names come first
        if key in name:
            return tflops * 1e12
    return None


def attention_flops_per_position(model) -> float:
    """12·L·H: the attention FLOPs per token per position of context, from the language model's sizes (a
    vision-language model's config nests them under its text config)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return 12 * config.num_hidden_layers * config.hidden_size


def train_flops_per_token(model, seq_len: float) -> float:
    """(4 + 2f)·N + 12·L·H·T for ``model`` (f = trainable share of the N parameters) at sequence length ``seq_len``.
    A VLM's N includes its vision tower, counted for every token (an over-count by the tower's share)."""
    total = count_parameters(model)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    return (4 + 2 * trainable / max(total, 1)) * total + attention_flops_per_position(model) * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, devices: int = 1) -> dict[str, float]:
    """``{"perf/mfu": ...}`` over ``devices`` devices of ``peak`` FLOP/s each; empty when the peak is unknown."""
    if not peak:
        return {}
    return {"perf/mfu": tokens_per_s * flops_per_token / (peak * devices)}


class MfuMeter:
    """``perf/mfu`` of one run: the device's peak looked up and the model's FLOPs counted once, not per step.

    ``meter(tokens_per_s, seq_len)`` is ``mfu(tokens_per_s, train_flops_per_token(model, seq_len), peak,
    devices)``; an empty dict (and no counting at all) when the device's peak is unknown.
    """

    def __init__(self, model, device, devices: int = 1):
        self.peak, self.devices = peak_flops(device), devices
        if self.peak:
            self.weight_flops = train_flops_per_token(model, 0)  # (4 + 2f)·N
            self.attention_flops = attention_flops_per_position(model)  # per position of T

    def __call__(self, tokens_per_s: float, seq_len: float) -> dict[str, float]:
        if not self.peak:
            return {}
        return mfu(tokens_per_s, self.weight_flops + self.attention_flops * seq_len, self.peak, self.devices)
