"""GSPO: group sequence policy optimisation (Zheng et al. 2025, Qwen3), one importance ratio per sequence.

For a prompt x, a group of n samples o_1..o_n with rewards r_1..r_n and group z-score advantages A_i (as GRPO):

    s_i(θ) = (π_θ(o_i | x) / π_old(o_i | x))^(1/|o_i|) = exp((1/|o_i|) Σ_t log ρ_{i,t})    sequence ratio
    L      = −(1/n) Σ_i min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i)

Token-level ratios ρ_{i,t} are noisy, and clipping them token by token lets that noise pile up along a long
sequence; the paper reports it destabilises training of mixture-of-experts models, where routing changes
between updates. GSPO clips the length-normalised ratio of the whole sequence, so every token of a sample is
kept or clipped together, and the clip range is much narrower (3e-4 / 4e-4, the paper's).

Computed in the paper's GSPO-token form, whose value and gradient equal GSPO's when every token of a sample
has the same advantage:

    s_{i,t} = sg[s_i] · π_θ(o_{i,t}) / sg[π_θ(o_{i,t})]     (= s_i in value; ∇ s_{i,t} = s_i ∇ log π_θ(o_{i,t}))

so with ``loss_agg: seq-mean-token-mean`` (the default here) the loss is the paper's (1/n) Σ_i (1/|o_i|) Σ_t.
The truncated importance weight w_{i,t} = min(π_old / π_rollout, C) (``rollout.tis_cap``; 1 when off)
multiplies each token's term, as in ``sgrpo.py``.

With one update per rollout batch every s_i is exactly 1 and GSPO is GRPO with sequence-mean aggregation; so
GSPO declares ``rollout.minibatches = 2`` (two optimiser steps per rollout batch; the banner says so). Deviation:
the paper splits each batch into four minibatches. On the built-in task (lr 3e-4 on a 1M-parameter model) one
update moves a sequence's ratio far past the paper's 4e-4 clip, so with four minibatches the last three are
mostly clipped and the demo lifts held-out accuracy 0.22 → 0.28; with two, 0.22 → 0.61. Set
``rollout.minibatches: 4`` for the paper's schedule. The shared options (`PolicyGradient.Config`) apply as in
``sgrpo.py``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_core import LossAggregation, PolicyGradient, RLAdvantagesBatch, RLLossBatch, ops


class GSPO(PolicyGradient):
    name = "gspo"
    group_relative = True  # group z-scores: an equal-reward group gets exactly 0
    loop = "rl"
    data_format = "prompt"
    min_group_size = 2
    #: two optimiser steps per rollout batch, so that s_i moves away from 1 and the clip acts (the paper: four)
    rollout_defaults = {"minibatches": 2}

    class Config(PolicyGradient.Config):
        clip_low: float = Field(3e-4, ge=0, le=1, description="ε_low: s_i is clipped below at 1 − ε_low")
        clip_high: float = Field(4e-4, ge=0, description="ε_high: s_i is clipped above at 1 + ε_high")
        scale_rewards: bool = Field(True, description="divide the centred rewards by the group std")
        eps: float = Field(1e-4, gt=0, description="added to the group std")
        loss_agg: LossAggregation = Field(
            "seq-mean-token-mean",
            description="how per-token terms become the loss; the default gives GSPO's (1/n) Σ_i of sequence terms",
        )

    def advantages(self, batch: RLAdvantagesBatch):
        rewards, metrics = ops.shaped_rewards(batch, self.config)  # (B,) + overlong shaping, KL in the reward
        # A_i = (r_i − mean_g) / (std_g + eps), the same for every token of sample i
        adv_seq = ops.group_advantages(rewards, batch["group_size"], self.config.scale_rewards, self.config.eps)  # (B,)
        return {"adv": adv_seq[:, None] * batch["mask"]}, {"adv/abs_mean": adv_seq.abs().mean(), **metrics}

    def loss(self, batch: RLLossBatch):
        c = self.config
        mask, adv, logp = batch["mask"], batch["adv"], batch["logp"]  # (B, T) each
        # log s_i = (1/|o_i|) Σ_t (log π_θ − log π_old)
        log_ratio = (logp - batch["logp_old"]) * mask  # (B, T)
        log_s = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        # s_{i,t} = sg[s_i] · π_θ(o_{i,t}) / sg[π_θ(o_{i,t})]: s_i in value, s_i ∇ log π_θ(o_{i,t}) in gradient
        s = torch.exp(log_s.detach()[:, None] + logp - logp.detach())  # (B, T)
        # min(s A, clip(s, 1−ε_low, 1+ε_high) A)
        surrogate = torch.minimum(s * adv, s.clamp(1 - c.clip_low, 1 + c.clip_high) * adv)  # (B, T)
        # TIS: w = min(π_old / π_rollout, C), detached (ones, or absent, when rollout.tis_cap = 0)
        policy_term = -surrogate * batch.get("tis_weight", 1.0)  # (B, T)
        # + β·KL, − c_H·H; aggregated by loss_agg (seq-mean-token-mean: (1/n) Σ_i (1/|o_i|) Σ_t)
        loss, metrics = ops.policy_objective(policy_term, batch, c)
        seq_ratio = log_s.detach().exp()  # (B,) s_i
        adv_seq = adv.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,) A_i
        clipped = ((seq_ratio < 1 - c.clip_low) & (adv_seq < 0)) | ((seq_ratio > 1 + c.clip_high) & (adv_seq > 0))
        # a sequence's clip and s_i hold for each of its tokens: weighted as the loss weighs them (sequences for the
        # seq-mean modes, the default here: the share of clipped sequences, the mean s_i; tokens for token-mean)
        per_token = (clipped.float()[:, None] * mask, seq_ratio[:, None] * mask)  # (B, T) each
        metrics.update(
            {
                "loss/policy": ops.aggregate_loss(policy_term, mask, c.loss_agg, batch.get("max_new_tokens")).detach(),
                "clip/frac": ops.mean_metric(per_token[0], mask, c.loss_agg),
                "ratio/mean": ops.mean_metric(per_token[1], mask, c.loss_agg),
            }
        )
        return loss, metrics
