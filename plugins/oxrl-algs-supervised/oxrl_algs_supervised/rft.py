"""RFT: rejection-sampling fine-tuning (Yuan et al. 2023; the filtering step of STaR and ReST).

Each round: sample k completions for each prompt from the current model, score them with the
reward, keep those at or above a threshold (or only the best of the k), and fine-tune on the
kept set with SFT's loss:

    keep_i = [r_i ≥ τ]                     (best_of_k: also i = argmax_j r_j within its group)
    L      = −(1/N) Σ_i keep_i Σ_t log π_θ(o_{i,t} | x_i, o_{i,<t}),    N = Σ_i keep_i |o_i|

In oxRL one RL-loop step is one round: ``train.batch_size`` prompts × ``rollout.n`` (= k)
samples, then ``rollout.passes_per_batch`` passes of ``rollout.minibatches`` optimiser steps over the
round's samples (only the kept ones carry loss); ``train.max_steps`` is the number of rounds R.
Deviation from offline RFT: rounds are small and frequent (fresh samples from the current
model every round) rather than one large sampling pass per round over the whole dataset; a
round with nothing kept makes no update. With ``rollout.micro_batch_size`` set, micro-batches
are weighted by their completion tokens, so the mean over kept tokens is then approximate.
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_core import Algorithm, RLAdvantagesBatch, RLLossBatch, StrictModel


class RFT(Algorithm):
    name = "rft"
    signal_note = (
        "it fine-tunes on every sample that reaches the reward threshold, so an all-correct group is training data"
    )
    loop = "rl"  # trained on its own generations (the RL loop)
    data_format = "prompt"

    class Config(StrictModel):
        threshold: float = Field(1.0, description="τ: keep samples whose reward is at least this")
        best_of_k: bool = Field(False, description="keep at most one sample per prompt: the best one (if it reaches τ)")

    def advantages(self, batch: RLAdvantagesBatch):
        rewards, k = batch["rewards"], batch["group_size"]  # (B,), k samples per prompt
        keep = rewards >= self.config.threshold  # (B,)
        if self.config.best_of_k:
            best = rewards.view(-1, k).argmax(dim=1)  # (P,) first best sample of each group
            is_best = torch.zeros_like(keep).view(-1, k)
            is_best[torch.arange(best.shape[0]), best] = True
            keep = keep & is_best.view(-1)
        # "adv" is the 0/1 weight of each token: 1 on the completion tokens of kept samples
        weight = keep.float()[:, None] * batch["mask"]  # (B, T)
        return {"adv": weight}, {"rft/kept_frac": keep.float().mean(), "rft/kept": keep.sum()}

    def loss(self, batch: RLLossBatch):
        weight = batch["adv"]  # (B, T) 1 on kept completion tokens
        # L = −(1/N) Σ keep · log π_θ(o_t)
        n_kept = weight.sum()
        loss = -(weight * batch["logp"]).sum() / n_kept.clamp(min=1)
        return loss, {"loss/nll": loss.detach(), "rft/kept_tokens": n_kept.detach()}
