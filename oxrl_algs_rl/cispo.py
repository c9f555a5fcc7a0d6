"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, Chen et al. 2025).

With group-relative advantages A_i (as in GRPO: z-scores of the rewards within a prompt's group):

    ρ_{i,t} = π_θ(o_{i,t}) / π_old(o_{i,t})
    L = −(1/Σ_i|o_i|) Σ_i Σ_t sg(clip(ρ_{i,t}, 1−ε_low, 1+ε_high)) · A_i · log π_θ(o_{i,t}) · w_{i,t}

w_{i,t} = min(π_old(o_{i,t}) / π_rollout(o_{i,t}), C) is the truncated importance weight (TIS, Yao et
al. 2025) against the rollout engine's numerics, detached, with C = ``rollout.tis_cap``; 1 when off.

Unlike PPO/GRPO, which drop the gradient of a token whose ratio leaves the clip range, CISPO
clips and detaches the importance weight, so every token keeps a gradient (rare "fork" tokens
such as "However" or "Wait" included). Defaults follow the paper: no lower bound on the weight
(ε_low = 1, so the weight is clipped at 0) and only ε_high tuned; no KL term.
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_core.interfaces import Algorithm, RLAdvantagesBatch, RLLossBatch, StrictModel
from oxrl_core.ops import group_advantages, masked_mean


class CISPO(Algorithm):
    name = "cispo"
    loop = "rl"
    data_format = "prompt"
    min_group_size = 2

    class Config(StrictModel):
        eps_low: float = Field(
            1.0, ge=0, le=1, description="ε_low: IS weight clipped below at 1 − ε_low (1 = no bound)"
        )
        eps_high: float = Field(0.28, ge=0, description="ε_high: IS weight clipped above at 1 + ε_high")
        scale_rewards: bool = Field(True, description="divide the centred rewards by the group std")
        eps: float = Field(1e-4, gt=0, description="added to the group std")

    def advantages(self, batch: RLAdvantagesBatch):
        adv_seq = group_advantages(
            batch["rewards"], batch["group_size"], self.config.scale_rewards, self.config.eps
        )  # (B,)
        return {"adv": adv_seq[:, None] * batch["mask"]}, {"adv/abs_mean": float(adv_seq.abs().mean())}  # (B, T)

    def loss(self, batch: RLLossBatch):
        c = self.config
        mask, adv, logp = batch["mask"], batch["adv"], batch["logp"]  # (B, T) each
        ratio = torch.exp(logp - batch["logp_old"])  # ρ (B, T)
        # sg(clip(ρ, 1−ε_low, 1+ε_high)): a detached weight, so the gradient flows through log π_θ only
        weight = ratio.clamp(1 - c.eps_low, 1 + c.eps_high).detach()  # (B, T)
        # TIS: w_tis = min(π_old / π_rollout, C), detached (ones, or absent, when rollout.tis_cap = 0)
        tis_weight = batch.get("tis_weight", 1.0)  # (B, T)
        # L = −(1/Σ|o_i|) Σ_i Σ_t w · A · log π_θ · w_tis
        loss = masked_mean(-weight * adv * logp * tis_weight, mask)
        clipped = (ratio > 1 + c.eps_high) | (ratio < 1 - c.eps_low)
        return loss, {
            "loss/policy": loss.detach(),
            "clip/frac": masked_mean(clipped.float(), mask).detach(),
            "ratio/mean": masked_mean(ratio, mask).detach(),
        }
