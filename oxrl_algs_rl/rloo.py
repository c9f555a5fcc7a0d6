"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

For a prompt x, n samples o_1..o_n with rewards r_1..r_n, each sample's baseline is the mean reward of the
other n − 1 — an unbiased baseline (it does not depend on o_i), with no learned critic:

    A_i = r_i − (1/(n−1)) Σ_{j≠i} r_j                          leave-one-out advantage
    ρ_{i,t} = π_θ(o_{i,t}) / π_old(o_{i,t})
    L = −(1/n) Σ_i Σ_t w_{i,t} · min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1−ε, 1+ε) A_i)

With one update per rollout batch (the default) ρ = 1 and the gradient is the paper's REINFORCE estimator
−A_i ∇ log π_θ(o_i) = −A_i Σ_t ∇ log π_θ(o_{i,t}): a sum over the sample's tokens, a mean over samples
(``loss_agg: seq-mean-token-sum``, the default here). The clip (as TRL's RLOO) only acts when a batch gets
several updates. w_{i,t} is the truncated importance weight against the rollout engine (``rollout.tis_cap``).

The paper adds a sequence-level KL penalty to the reward, r_i ← r_i − β Σ_t KL_t: that is ``kl_in_reward:
true`` (the default here) with ``kl_coeff`` = β > 0; β is 0 by default, as for SGRPO with verifiable rewards.
Unlike GRPO there is no division by the group std (the estimator stays unbiased).
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_core import LossAggregation, PolicyGradient, RLAdvantagesBatch, RLLossBatch, ops


class RLOO(PolicyGradient):
    name = "rloo"
    group_relative = True  # leave-one-out baseline: an equal-reward group gets exactly 0
    loop = "rl"
    data_format = "prompt"
    min_group_size = 2

    class Config(PolicyGradient.Config):
        clip_eps: float = Field(0.2, ge=0, le=1, description="ε: ratio clip range (acts from a batch's 2nd update)")
        kl_in_reward: bool = Field(True, description="β·Σ_t KL_t is subtracted from the reward (the paper's)")
        loss_agg: LossAggregation = Field(
            "seq-mean-token-sum", description="how per-token terms become the loss; the default is REINFORCE's"
        )

    def advantages(self, batch: RLAdvantagesBatch):
        rewards, metrics = ops.shaped_rewards(batch, self.config)  # (B,) + overlong shaping, KL in the reward
        # A_i = r_i − mean of the other n − 1 rewards of the group
        adv_seq = ops.leave_one_out_advantages(rewards, batch["group_size"])  # (B,)
        return {"adv": adv_seq[:, None] * batch["mask"]}, {"adv/abs_mean": adv_seq.abs().mean(), **metrics}

    def loss(self, batch: RLLossBatch):
        c = self.config
        adv = batch["adv"]  # (B, T)
        ratio = torch.exp(batch["logp"] - batch["logp_old"])  # ρ (B, T)
        # min(ρ A, clip(ρ, 1−ε, 1+ε) A)
        surrogate, clipped = ops.clipped_surrogate(ratio, adv, c.clip_eps, c.clip_eps)  # (B, T)
        policy_term = -surrogate * batch.get("tis_weight", 1.0)  # (B, T)
        # + β·KL (when not in the reward), − c_H·H; aggregated by loss_agg (seq-mean-token-sum: (1/n) Σ_i Σ_t)
        loss, metrics = ops.policy_objective(policy_term, batch, c)
        return loss, {**metrics, **ops.policy_metrics(policy_term, ratio, clipped, batch, c)}
