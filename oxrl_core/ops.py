"""The shared maths every algorithm (and the loops) import: masked means, token NLL, group-relative
advantages, the k3 KL estimator. A leaf module: it imports torch and nothing of oxRL.

Shapes: B = sequences (RL: prompts × n samples, the n samples of one prompt contiguous),
T = token positions.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_mean_value(x: torch.Tensor, mask: torch.Tensor) -> float:
    """`masked_mean` as a Python float, for metrics (no graph kept)."""
    return float(masked_mean(x.detach(), mask))


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Group z-scores: rewards (B,) -> A (B,).

        A_i = (r_i − mean_g) / (std_g + eps)      (or r_i − mean_g when ``scale`` is False, as Dr. GRPO)

    std is the sample standard deviation (Bessel-corrected, as TRL computes it); a group whose
    rewards are all equal (max == min) gets exactly A = 0 for every sample (it carries no learning
    signal) — tested on max == min rather than std > 0, since float32 rounding leaves std ≈ 1e-8 for
    e.g. eight rewards of 0.1, which std + eps would turn into A ≈ 1e-4.
    """
    r = rewards.view(-1, group_size)  # (P, n)
    mean = r.mean(dim=1, keepdim=True)  # (P, 1)
    centred = r - mean  # (P, n)
    if scale:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)  # (P, 1)
        centred = centred / (std + eps)
    # groups of equal rewards: A = 0 exactly
    equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # (P, 1)
    return torch.where(equal, torch.zeros_like(centred), centred).reshape(-1)  # (B,)


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref) (Schulman 2020), unbiased and never negative:

    KL_t ≈ exp(Δ_t) − Δ_t − 1,   Δ_t = log π_ref(o_t) − log π_θ(o_t)
    """
    delta = logp_ref - logp  # (B, T)
    return delta.exp() - delta - 1  # (B, T)
