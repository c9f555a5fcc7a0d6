"""Maths shared by the RL algorithms: masked means, group-relative advantages, the k3 KL estimator.

Shapes: B = prompts × n samples (the n samples of one prompt contiguous), T = token positions.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Group z-scores: rewards (B,) -> A (B,).

        A_i = (r_i − mean_g) / (std_g + eps)      (or r_i − mean_g when ``scale`` is False, as Dr. GRPO)

    std is the sample standard deviation (Bessel-corrected, as TRL computes it); a group whose
    rewards are all equal gets A = 0 for every sample (it carries no learning signal).
    """
    r = rewards.view(-1, group_size)  # (P, n)
    mean = r.mean(dim=1, keepdim=True)  # (P, 1)
    centred = r - mean  # (P, n)
    if scale:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)  # (P, 1)
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))  # equal rewards -> 0
    return centred.reshape(-1)  # (B,)


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref) (Schulman 2020), unbiased and never negative:

        KL_t ≈ exp(Δ_t) − Δ_t − 1,   Δ_t = log π_ref(o_t) − log π_θ(o_t)
    """
    delta = logp_ref - logp  # (B, T)
    return delta.exp() - delta - 1  # (B, T)
