"""SGRPO: GRPO (Shao et al. 2024, DeepSeekMath) with the stability choices later work converged on.

For a prompt x, a group of n samples o_1..o_n with scalar rewards r_1..r_n:

    A_i     = (r_i − mean(r)) / (std(r) + eps)                               group z-score advantage
    ρ_{i,t} = π_θ(o_{i,t} | x, o_{i,<t}) / π_old(o_{i,t} | x, o_{i,<t})       importance ratio
    L       = −(1/Σ_i|o_i|) Σ_i Σ_t [ min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1−ε_low, 1+ε_high) A_i) − β·KL_{i,t} ]
    KL_{i,t} = exp(Δ) − Δ − 1,  Δ = log π_ref(o_{i,t}) − log π_θ(o_{i,t})     (k3 estimator)

With ``rollout.tis_cap`` = C > 0, truncated importance sampling (TIS, Yao et al. 2025) corrects for
the rollout engine sampling from π_rollout (its kernels and precision), not exactly π_old: the
clipped surrogate of each token is multiplied by w_{i,t} = min(π_old(o_{i,t}) / π_rollout(o_{i,t}), C),
detached (the loop provides ``tis_weight``; 1 when off). The KL term is not weighted.

Deliberate deviations from GRPO as published, each for stability:
- Asymmetric clipping (ε_high > ε_low, "clip-higher" from DAPO, Yu et al. 2025): lets unlikely
  tokens with positive advantage grow, which keeps entropy from collapsing.
- Token-level aggregation: one mean over every completion token of the batch (DAPO), not
  GRPO's mean per sequence then over sequences, which under-weights tokens of long answers.
- The reference KL is optional and off by default (β = 0, as DAPO and Dr. GRPO for
  verifiable rewards); with β > 0 the loop provides reference logprobs and the k3 term is in
  the loss, as in GRPO.
- ``scale_rewards: false`` drops the division by the group std (Dr. GRPO, Liu et al. 2025).

The options every group-based algorithm shares (`PolicyGradient.Config`: ``kl_estimator``, ``kl_in_reward``,
``entropy_coeff``, ``loss_agg``, ``overlong_buffer``) act through ``shaped_rewards`` (before the advantages) and
``policy_objective`` (around the policy term); their defaults give exactly the objective above. Dr. GRPO is
``scale_rewards: false`` with ``loss_agg: seq-mean-token-sum-norm``; GRPO as published is ``loss_agg:
seq-mean-token-mean``, ``kl_coeff: 0.04``, ``clip_high: 0.2``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_core import PolicyGradient, RLAdvantagesBatch, RLLossBatch, ops


class SGRPO(PolicyGradient):
    name = "sgrpo"
    group_relative = True  # A_i = (r_i − mean_g) / std_g: an equal-reward group gets exactly 0
    loop = "rl"
    data_format = "prompt"
    #: samples compared within a group (rollout.n must be at least this)
    min_group_size = 2

    class Config(PolicyGradient.Config):
        clip_low: float = Field(0.2, ge=0, le=1, description="ε_low: the ratio is clipped below at 1 − ε_low")
        clip_high: float = Field(0.28, ge=0, description="ε_high: the ratio is clipped above at 1 + ε_high")
        scale_rewards: bool = Field(True, description="divide by the group std (false = Dr. GRPO's centred rewards)")
        eps: float = Field(1e-4, gt=0, description="added to the group std")

    def advantages(self, batch: RLAdvantagesBatch):
        rewards, metrics = ops.shaped_rewards(batch, self.config)  # (B,) + overlong shaping, KL in the reward
        # A_i = (r_i − mean_g) / (std_g + eps), the same for every token of sample i
        adv_seq = ops.group_advantages(rewards, batch["group_size"], self.config.scale_rewards, self.config.eps)  # (B,)
        adv = adv_seq[:, None] * batch["mask"]  # (B, T)
        return {"adv": adv}, {"adv/abs_mean": adv_seq.abs().mean(), **metrics}

    def loss(self, batch: RLLossBatch):
        c = self.config
        adv = batch["adv"]  # (B, T)
        # ρ = π_θ / π_old
        ratio = torch.exp(batch["logp"] - batch["logp_old"])  # (B, T)
        # min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A)
        surrogate, clipped = ops.clipped_surrogate(ratio, adv, c.clip_low, c.clip_high)  # (B, T)
        # TIS: w = min(π_old / π_rollout, C), detached (ones, or absent, when rollout.tis_cap = 0)
        tis_weight = batch.get("tis_weight", 1.0)  # (B, T)
        policy_term = -surrogate * tis_weight  # (B, T)
        # + β·KL (k3 by default), − c_H·H; aggregated by loss_agg (token-mean: (1/Σ|o_i|) Σ_i Σ_t)
        loss, metrics = ops.policy_objective(policy_term, batch, c)
        return loss, {**metrics, **ops.policy_metrics(policy_term, ratio, clipped, batch, c)}
