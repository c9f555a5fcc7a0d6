"""REINFORCE++-baseline (Hu et al. 2025): REINFORCE++ with each prompt's mean reward as the baseline.

The objective is REINFORCE++'s (see ``reinforce_pp.py``); the sequence reward is first centred within its
prompt's group, and the KL to the reference goes into the loss:

    R̃_i     = R_i − mean_g(R)                                  group baseline, no division by the group std
    A_{i,t} = (G_{i,t} − mean(G)) / (std(G) + ε)                G = return-to-go of R̃ on the last token,
                                                                 normalised over the whole batch
    L = −mean_{i,t} w · min(ρ A, clip(ρ, 1−ε_c, 1+ε_c) A) + β · mean_{i,t} KL_k2(π_θ || π_ref)

Subtracting the group mean removes the prompt's difficulty (as GRPO), and the batch-wide normalisation replaces
GRPO's per-group std, which inflates the advantages of prompts whose samples nearly agree. Defaults follow
the paper's and OpenRLHF's recipe for reasoning tasks: KL in the loss with the k2 estimator, β = 0.001.
A group whose rewards are all equal has R̃ = 0 exactly (its tokens get the batch's −mean(G)/std(G)).
"""

from __future__ import annotations

from pydantic import Field

from oxrl_algs_rl.reinforce_pp import REINFORCEPP
from oxrl_core import KLEstimator, RLAdvantagesBatch, ops


class REINFORCEPPBaseline(REINFORCEPP):
    name = "reinforce_pp_baseline"
    group_relative = True  # R_i − mean_g(R): an equal-reward group has R̃ = 0 (only the batch-wide shift remains)
    min_group_size = 2

    class Config(REINFORCEPP.Config):
        kl_coeff: float = Field(0.001, ge=0, description="β: weight of the KL to the reference")
        kl_estimator: KLEstimator = Field("k2", description="per-token KL estimator (k2: ½(log π − log π_ref)²)")
        kl_in_reward: bool = Field(False, description="false: the KL is a loss term (true: a per-token penalty)")

    def sequence_rewards(self, batch: RLAdvantagesBatch):
        rewards, metrics = ops.shaped_rewards(batch, self.config, kl=False)  # (B,) with overlong shaping
        # R̃_i = R_i − mean_g(R)
        groups = rewards.view(-1, batch["group_size"])  # (P, n)
        centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)  # (B,)
        return centred, metrics
