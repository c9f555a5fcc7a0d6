"""REINFORCE++: critic-free policy optimisation with global advantage normalisation (Hu et al. 2025).

PPO's recipe without the critic: the KL to the reference is a per-token penalty in the reward, each token's
advantage is its return-to-go, and advantages are normalised over the whole batch (not per prompt group):

    r_{i,t} = −β · KL_t(π_old || π_ref) + [t = |o_i|] · R_i       β = kl_coeff, KL by kl_estimator (k1)
    G_{i,t} = Σ_{k≥t} r_{i,k}                                    return-to-go (γ = 1)
    A_{i,t} = (G_{i,t} − mean(G)) / (std(G) + ε)                 mean, std over every token of the batch
    ρ_{i,t} = π_θ(o_{i,t}) / π_old(o_{i,t})
    L = −mean_{i,t} w_{i,t} · min(ρ A, clip(ρ, 1−ε_c, 1+ε_c) A)

Normalising over the batch instead of the group keeps a prompt whose samples all score the same from being
blown up or zeroed by a tiny group std, and makes the method work with one sample per prompt (``rollout.n``
may be 1). w_{i,t} is the truncated importance weight against the rollout engine (``rollout.tis_cap``).

Defaults follow OpenRLHF's REINFORCE++ (``kl_in_reward``, k1, β = 0.01, ε_c = 0.2, token-mean). Overlong
shaping (``overlong_buffer``) changes R_i; ``kl_in_reward: false`` moves the KL into the loss instead.
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_core import KLEstimator, PolicyGradient, RLAdvantagesBatch, RLLossBatch, ops


class REINFORCEPP(PolicyGradient):
    name = "reinforce_pp"
    signal_note = "its baseline is the whole batch's mean return, so the samples of an equal-reward group still get non-zero advantages"
    loop = "rl"
    data_format = "prompt"

    class Config(PolicyGradient.Config):
        clip_eps: float = Field(0.2, ge=0, le=1, description="ε_c: ratio clip range")
        kl_coeff: float = Field(0.01, ge=0, description="β: weight of the per-token KL to the reference")
        kl_estimator: KLEstimator = Field("k1", description="per-token KL estimator of the penalty")
        kl_in_reward: bool = Field(True, description="the KL is a per-token reward penalty (false: a loss term)")

    def sequence_rewards(self, batch: RLAdvantagesBatch) -> tuple[torch.Tensor, dict]:
        """R_i (B,): the reward with overlong shaping (REINFORCE++-baseline subtracts its group mean here)."""
        return ops.shaped_rewards(batch, self.config, kl=False)

    def advantages(self, batch: RLAdvantagesBatch):
        mask = batch["mask"]  # (B, T)
        rewards, metrics = self.sequence_rewards(batch)  # (B,)
        # r_{i,t} = −β KL_t + [t = |o_i|] R_i
        token_rewards, kl_metrics = ops.token_kl_rewards(rewards, batch, self.config)  # (B, T)
        # G_{i,t} = Σ_{k≥t} r_{i,k}
        returns = ops.returns_to_go(token_rewards, mask)  # (B, T)
        # A = (G − mean) / std over the batch's tokens
        adv = ops.whiten(returns, mask)  # (B, T)
        return {"adv": adv}, {"returns/mean": ops.masked_mean(returns, mask), **metrics, **kl_metrics}

    def loss(self, batch: RLLossBatch):
        c = self.config
        adv = batch["adv"]  # (B, T)
        ratio = torch.exp(batch["logp"] - batch["logp_old"])  # ρ (B, T)
        # min(ρ A, clip(ρ, 1−ε_c, 1+ε_c) A)
        surrogate, clipped = ops.clipped_surrogate(ratio, adv, c.clip_eps, c.clip_eps)  # (B, T)
        policy_term = -surrogate * batch.get("tis_weight", 1.0)  # (B, T)
        # + β·KL (only with kl_in_reward: false), − c_H·H; aggregated by loss_agg (token-mean)
        loss, metrics = ops.policy_objective(policy_term, batch, c)
        return loss, {**metrics, **ops.policy_metrics(policy_term, ratio, clipped, batch, c)}
