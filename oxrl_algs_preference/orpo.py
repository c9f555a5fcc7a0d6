"""ORPO: Odds Ratio Preference Optimization (Hong et al. 2024), reference-free.

SFT on the chosen response plus a penalty that raises the odds of the chosen response over the
rejected one:

    p(y|x)  = exp((1/|y|) Σ_t log π_θ(y_t | x, y_<t))           length-averaged likelihood
    odds(y) = p / (1 − p),   log odds(y) = log p − log(1 − p)
    L_OR    = −log σ(log odds(y_c) − log odds(y_r))
    L       = NLL(y_c) + λ·(1/B) Σ_b L_OR,b

NLL(y_c) is the chosen tokens' negative log-likelihood, a mean over the chosen tokens of the
batch. λ is 0.1 by default (TRL's default; the paper sweeps 0.1–1.0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from oxrl_algs_preference.common import chosen_nll, pair_metrics
from oxrl_core import Algorithm, PairedPreferenceBatch, StrictModel


def log_odds(avg_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 − p)) from log p (< 0): log p − log(1 − exp(log p)), computed stably."""
    return avg_logp - torch.log1p(-torch.exp(avg_logp).clamp(max=1 - 1e-7))


class ORPO(Algorithm):
    name = "orpo"
    loop = "preference"
    data_format = "preference"
    loss_weighting = "sequences"

    class Config(StrictModel):
        lam: float = Field(0.1, ge=0, description="λ: weight of the odds-ratio term (TRL calls it beta)")

    def loss(self, batch: PairedPreferenceBatch):
        lam = self.config.lam
        avg_chosen = batch["logp_chosen"] / batch["n_chosen"]  # (B,) log p(y_c|x)
        avg_rejected = batch["logp_rejected"] / batch["n_rejected"]  # (B,)
        # log odds(y_c) − log odds(y_r)
        log_odds_ratio = log_odds(avg_chosen) - log_odds(avg_rejected)  # (B,)
        # L_OR = −log σ(log odds(y_c) − log odds(y_r))
        loss_or = -F.logsigmoid(log_odds_ratio).mean()
        nll = chosen_nll(batch["logp_chosen"], batch["n_chosen"])
        # L = NLL(y_c) + λ·L_OR
        loss = nll + lam * loss_or
        metrics = pair_metrics(lam * avg_chosen, lam * avg_rejected, batch["logp_chosen"], batch["logp_rejected"])
        metrics.update(
            {"loss/nll": nll.detach(), "loss/or": loss_or.detach(), "log_odds_ratio": log_odds_ratio.detach().mean()}
        )
        return loss, metrics
