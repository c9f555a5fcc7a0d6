"""Model FLOPs utilisation (``perf/mfu`` in metrics.jsonl).

MFU = the model FLOPs of an optimiser step / (its seconds · the device's peak FLOP/s · devices).

The model FLOPs of one training step of a causal LM with N parameters, L layers and hidden size H over
sequences of lengths T₁ … Tₛ (tokens = Σᵢ Tᵢ) are PaLM's count (Chowdhery et al., 2022, appendix B; no
recomputation counted):

    step FLOPs = 6·N·tokens + 12·L·H·Σᵢ Tᵢ²

- 6·N per token: the forward's 2·N (a multiply-add per weight) and a backward twice the forward.
- 12·L·H·Tᵢ per token of sequence i: per layer, the forward's Q·Kᵀ and attention·V are 2·H·Tᵢ each (4·H·Tᵢ)
  and the backward twice that. Summed over sequence i's Tᵢ tokens: 12·L·H·Tᵢ².
- **No causal halving**: as in PaLM, every token is counted against all Tᵢ positions of its sequence, though a
  causal mask lets it see only those before it (so this count is the one other MFU figures use, and about twice the
  attention work a causal kernel does).
- **Each sequence counts on its own**: a packed micro-batch row holding sequences of lengths 3 and 5 costs
  12·L·H·(3² + 5²), not 12·L·H·8² (its rows cannot see each other). The loops sum Tᵢ² from the lengths they
  know on the host (``perf/square_lengths`` in the step's ``perf`` dict, never logged).
- Frozen weights (LoRA's base) need no weight gradient: their backward costs 2·N instead of 4·N, so with a
  fraction f of the parameters trainable the weight term is (4 + 2·f)·N·tokens.

The peak is the device's dense bf16 tensor-core figure from its datasheet, looked up by GPU name, or
``OXRL_PEAK_TFLOPS`` (per device; e.g. for another GPU or to state a CPU's peak); the run's banner names the
one used. With no known peak, ``perf/mfu`` is not logged.
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


def peak(device) -> tuple[float, str] | None:
    """Peak FLOP/s of one ``device`` (a torch.device) and where it comes from, or None when unknown."""
    override = os.environ.get("OXRL_PEAK_TFLOPS", "")
    if override:
        return float(override) * 1e12, f"{float(override):g} TFLOP/s per device (OXRL_PEAK_TFLOPS)"
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():  # the more specific names come first
        if key in name:
            return tflops * 1e12, f"{tflops:g} TFLOP/s per device ({name}: {key} dense bf16, datasheet)"
    return None


def peak_flops(device) -> float | None:
    """Peak FLOP/s of one ``device`` (a torch.device), or None when unknown."""
    found = peak(device)
    return found[0] if found else None


def attention_flops_per_position(model) -> float:
    """12·L·H: the attention FLOPs of one token per position of its sequence, from the language model's sizes (a
    vision-language model's config nests them under its text config)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return 12 * config.num_hidden_layers * config.hidden_size


def weight_flops_per_token(model) -> float:
    """(4 + 2·f)·N for ``model`` (f = trainable share of its N parameters). A VLM's N includes its vision tower,
    counted for every token (an over-count by the tower's share)."""
    total = count_parameters(model)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    return (4 + 2 * trainable / max(total, 1)) * total


def train_flops(model, tokens: float, square_lengths: float) -> float:
    """Step FLOPs = (4 + 2·f)·N·tokens + 12·L·H·Σᵢ Tᵢ² for ``tokens`` = Σᵢ Tᵢ and ``square_lengths`` = Σᵢ Tᵢ²."""
    return weight_flops_per_token(model) * tokens + attention_flops_per_position(model) * square_lengths


def mfu(flops: float, seconds: float, peak_per_device: float | None, devices: int = 1) -> dict[str, float]:
    """``{"perf/mfu": flops / (seconds · peak · devices)}``; empty when the peak is unknown."""
    if not peak_per_device:
        return {}
    return {"perf/mfu": flops / (seconds * peak_per_device * devices)}


class MfuMeter:
    """``perf/mfu`` of one run: the device's peak looked up and the model's sizes counted once, not per step.

    ``meter(tokens, square_lengths, seconds)`` is ``mfu(train_flops(model, tokens, square_lengths), seconds,
    peak, devices)``; an empty dict (and no counting at all) when the device's peak is unknown. ``describe()``
    names the peak used (for the run's banner).
    """

    def __init__(self, model, device, devices: int = 1):
        found, self.devices = peak(device), devices
        self.peak, self.peak_source = found if found else (None, "")
        if self.peak:
            self.weight_flops = weight_flops_per_token(model)  # (4 + 2f)·N
            self.attention_flops = attention_flops_per_position(model)  # 12·L·H, per token per position

    def describe(self) -> str:
        return f"MFU against {self.peak_source} × {self.devices}" if self.peak else ""

    def __call__(self, tokens: float, square_lengths: float, seconds: float) -> dict[str, float]:
        if not self.peak:
            return {}
        flops = self.weight_flops * tokens + self.attention_flops * square_lengths
        return mfu(flops, seconds, self.peak, self.devices)
