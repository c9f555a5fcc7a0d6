"""PPO for language models (Schulman et al. 2017; the RLHF recipe of Ouyang et al. 2022).

A critic V (a value head on the policy's backbone, or on its own copy of it) estimates the
return of each prefix. The sequence reward R arrives at the last completion token; a per-token
KL penalty to the reference policy is folded into the reward:

    r_t = −β · (log π_old(o_t) − log π_ref(o_t)) + [t = |o|] · R
    δ_t = r_t + γ V(s_{t+1}) − V(s_t)                         (V after the last token = 0)
    A_t = Σ_{k≥0} (γλ)^k δ_{t+k}                              GAE (Schulman et al. 2016)
    R_t = A_t + V(s_t)                                        value target

    ρ_t  = π_θ(o_t) / π_old(o_t)
    L_π  = −mean_t w_t · min(ρ_t Â_t, clip(ρ_t, 1−ε, 1+ε) Â_t)   Â: A whitened over the batch
    w_t  = min(π_old(o_t) / π_rollout(o_t), C)                TIS weight (Yao et al. 2025), detached
    L_V  = ½ · mean_t max((V_θ − R_t)², (V_old + clip(V_θ − V_old, −ε_V, ε_V) − R_t)²)
    L    = L_π + c_V · L_V − c_H · mean_t H(π_θ(· | s_t))

Means run over every completion token of the batch. GAE is computed for all positions at once
as a product with a (T, T) matrix of discount powers (no Python loop over time); that costs
T² memory, small next to the (B, T, V) logits. Deviation: a completion cut at the length
limit is treated as terminal (no bootstrap from V), as in TRL and OpenRLHF. In a multi-turn
episode the environment's tokens are not time steps: GAE runs over the model's tokens in order, so
V(s_{t+1}) at the end of a turn is the value at the start of the model's next turn. The truncated
importance weight w_t corrects for the rollout engine's numerics (C = ``rollout.tis_cap``; w = 1 when
off, the default); it weights the policy term only, not the value loss.

The KL options are the group algorithms' (``kl_estimator``, ``kl_in_reward``, ``entropy_coeff``): the
penalty above is ``kl_in_reward: true`` with k1 (log π_old − log π_ref), the default; ``kl_in_reward: false``
adds β·KL(π_θ || π_ref) to the loss instead. ``alg.ent_coef`` is the old name of ``entropy_coeff``.
PPO declares ``rollout.minibatches = 4``: four optimiser steps per rollout batch (as verl and OpenRLHF split
a batch into mini-batches), so that the ratio leaves 1 and the clip acts; the banner says so.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import AliasChoices, Field

from oxrl_core import Algorithm, KLEstimator, RLAdvantagesBatch, RLLossBatch, StrictModel, ops


def discounted_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """y_t = Σ_{k≥t} discount^(k−t) x_k along the last dim: x (B, T) -> y (B, T)."""
    T = x.shape[-1]
    pos = torch.arange(T, device=x.device, dtype=x.dtype)
    gap = pos[:, None] - pos[None, :]  # gap[k, t] = k − t  (T, T)
    weights = torch.where(gap >= 0, torch.full_like(gap, discount) ** gap.clamp(min=0), torch.zeros_like(gap))  # (T, T)
    return x @ weights  # (B, T)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over masked token positions.

    rewards, values, mask (B, T) -> advantages A (B, T), returns R = A + V (B, T); zero off the mask.

    The time steps are the masked (model) tokens in order: in a multi-turn episode the environment's
    tokens between two model turns are part of the transition, not steps, so s_{t+1} is the state at
    the model's next token and the discount counts model tokens only. Each row's masked positions are
    moved to the front in order (a stable sort), GAE runs there, and the result goes back in place.
    """
    order = torch.sort((mask <= 0).to(torch.uint8), dim=-1, stable=True).indices  # (B, T): masked first
    r, m = rewards.gather(-1, order), mask.gather(-1, order)  # (B, T); m is 1…1 0…0
    v = values.gather(-1, order) * m  # (B, T)
    next_v = torch.zeros_like(v)
    next_v[:, :-1] = v[:, 1:]  # V(s_{t+1}); 0 after the last model token
    # δ_t = r_t + γ V(s_{t+1}) − V(s_t)
    delta = (r + gamma * next_v - v) * m  # (B, T)
    # A_t = Σ_k (γλ)^k δ_{t+k}
    adv_packed = discounted_cumsum(delta, gamma * lam) * m  # (B, T)
    adv = torch.zeros_like(adv_packed).scatter(-1, order, adv_packed)  # (B, T), back in place
    return adv, (adv + values) * mask


class PPO(Algorithm):
    name = "ppo"
    signal_note = "its advantages come from a learned critic (GAE), so every sample carries signal whatever its group"
    loop = "rl"
    data_format = "prompt"
    needs_critic = True
    #: four optimiser steps per rollout batch (mini-batches, as verl and OpenRLHF), so that the clip acts
    rollout_defaults = {"minibatches": 4}

    class Config(StrictModel):
        gamma: float = Field(1.0, ge=0, le=1, description="γ: discount")
        lam: float = Field(0.95, ge=0, le=1, description="λ: GAE trace decay")
        clip_eps: float = Field(0.2, ge=0, le=1, description="ε: ratio clip range")
        value_clip: float = Field(0.2, ge=0, description="ε_V: value clip range around the old values")
        vf_coef: float = Field(0.5, ge=0, description="c_V: weight of the value loss")
        entropy_coeff: float = Field(
            0.0,
            ge=0,
            validation_alias=AliasChoices("entropy_coeff", "ent_coef"),
            description="c_H: weight of the entropy bonus (old name: ent_coef)",
        )
        kl_coeff: float = Field(0.05, ge=0, description="β: weight of the KL to the reference")
        kl_estimator: KLEstimator = Field("k1", description="per-token KL estimator (k1 = log π − log π_ref)")
        kl_in_reward: bool = Field(True, description="the KL is a per-token reward penalty (false: a loss term)")
        whiten_advantages: bool = Field(
            True, description="normalise advantages to mean 0, std 1 over the batch's tokens"
        )
        critic: Literal["shared", "separate"] = Field(
            "shared", description="value head on the policy's backbone, or on its own copy"
        )

    def uses_ref(self) -> bool:
        return self.config.kl_coeff > 0

    def advantages(self, batch: RLAdvantagesBatch):
        c = self.config
        mask = batch["mask"]  # (B, T)
        # the sequence reward R sits on the last completion token
        last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()  # (B, T)
        rewards = last.float() * batch["rewards"][:, None]  # (B, T)
        metrics = {}
        if c.kl_coeff > 0 and c.kl_in_reward:
            # r_t −= β KL_t, KL_t = log π_old − log π_ref with k1
            kl = ops.kl_estimate(batch["logp_old"], batch["logp_ref"], c.kl_estimator) * mask  # (B, T)
            rewards = rewards - c.kl_coeff * kl
            metrics["kl/penalty"] = metrics[f"kl/reward_{c.kl_estimator}"] = ops.masked_mean(kl, mask)
        adv, returns = gae(rewards, batch["values"], mask, c.gamma, c.lam)  # (B, T), (B, T)
        if c.whiten_advantages:
            mean = ops.masked_mean(adv, mask)
            std = ops.masked_mean((adv - mean) ** 2, mask).sqrt()
            adv = (adv - mean) / (std + 1e-8) * mask
        metrics["values/mean"] = ops.masked_mean(batch["values"], mask)
        metrics["returns/mean"] = ops.masked_mean(returns, mask)
        return {"adv": adv, "returns": returns}, metrics

    def loss(self, batch: RLLossBatch):
        c = self.config
        mask, adv = batch["mask"], batch["adv"]  # (B, T)
        # clipped policy loss
        ratio = torch.exp(batch["logp"] - batch["logp_old"])  # ρ (B, T)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - c.clip_eps, 1 + c.clip_eps) * adv)  # (B, T)
        # TIS: w = min(π_old / π_rollout, C), detached (ones, or absent, when rollout.tis_cap = 0)
        tis_weight = batch.get("tis_weight", 1.0)  # (B, T)
        loss_policy = ops.masked_mean(-surrogate * tis_weight, mask)
        # clipped value loss
        values, values_old, returns = batch["values_new"], batch["values"], batch["returns"]  # (B, T)
        values_clipped = values_old + (values - values_old).clamp(-c.value_clip, c.value_clip)
        loss_value = 0.5 * ops.masked_mean(
            torch.maximum((values - returns) ** 2, (values_clipped - returns) ** 2), mask
        )
        # entropy bonus
        entropy = ops.masked_mean(batch["entropy"], mask)
        loss = loss_policy + c.vf_coef * loss_value - c.entropy_coeff * entropy
        metrics = {}
        if c.kl_coeff > 0 and not c.kl_in_reward:  # + β·KL(π_θ || π_ref) in the loss
            kl = ops.masked_mean(ops.kl_estimate(batch["logp"], batch["logp_ref"], c.kl_estimator), mask)
            loss = loss + c.kl_coeff * kl
            metrics["loss/kl"] = metrics[f"kl/loss_{c.kl_estimator}"] = kl.detach()
        # clipped share: tokens whose clipped term is the active one of the min (zero gradient through ρ)
        clipped = ((ratio < 1 - c.clip_eps) & (adv < 0)) | ((ratio > 1 + c.clip_eps) & (adv > 0))
        return loss, {
            **metrics,
            "loss/policy": loss_policy.detach(),
            "loss/value": loss_value.detach(),
            "clip/frac": ops.masked_mean(clipped.float(), mask).detach(),
            "ratio/mean": ops.masked_mean(ratio, mask).detach(),
        }
