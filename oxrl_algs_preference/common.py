"""Maths shared by the preference algorithms (sequence-level tensors, shapes (B,))."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid_loss(h: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """−(1−ε)·log σ(h) − ε·log σ(−h), per pair (B,): the Bradley–Terry log-loss, with conservative
    label smoothing ε (cDPO, Mitchell 2023: the preference label is flipped with probability ε)."""
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def chosen_nll(logp_chosen: torch.Tensor, n_chosen: torch.Tensor) -> torch.Tensor:
    """−(Σ_b log π(y_c,b)) / (Σ_b |y_c,b|): the chosen responses' NLL, a mean over their tokens."""
    return -logp_chosen.sum() / n_chosen.sum().clamp(min=1)


def pair_metrics(
    reward_chosen: torch.Tensor, reward_rejected: torch.Tensor, logp_chosen=None, logp_rejected=None
) -> dict:
    """The metrics every pairwise method logs (TRL's names): implicit rewards, margin, accuracy, logps."""
    metrics = {
        "rewards/chosen": reward_chosen.detach().mean(),
        "rewards/rejected": reward_rejected.detach().mean(),
        "rewards/margins": (reward_chosen - reward_rejected).detach().mean(),
        # a pair counts as ranked right only when the chosen reward is strictly higher
        "rewards/accuracies": (reward_chosen > reward_rejected).float().mean(),
    }
    if logp_chosen is not None:
        metrics["logps/chosen"] = logp_chosen.detach().mean()
        metrics["logps/rejected"] = logp_rejected.detach().mean()
    return metrics
