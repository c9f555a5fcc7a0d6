"""RLHF: group-relative policy optimisation against a learned reward model.

The objective is SGRPO's (see ``sgrpo.py``) with two differences:

- the reward r_i is a trained reward model's scalar score of (prompt, completion): by default
  the ``reward_model`` reward of ``oxrl-rewards``, configured with ``reward.model`` (a
  sequence-classification checkpoint such as ``oxrl run --alg rm`` produces);
- a reward model can be exploited, so the k3 KL to the reference policy is on by default
  (β = 0.05), as in RLHF practice (Ouyang et al. 2022); SGRPO's default is 0.

    A_i = (RM(x, o_i) − mean_g) / (std_g + eps)
    L   = −(1/Σ|o_i|) Σ_i Σ_t [ min(ρ A_i, clip(ρ, 1−ε_low, 1+ε_high) A_i) − β·KL_k3 ]

Group z-scores also remove the reward model's arbitrary offset and scale.
"""

from __future__ import annotations

from pydantic import Field

from oxrl_algs_rl.sgrpo import SGRPO


class RLHF(SGRPO):
    name = "rlhf"
    default_reward = "reward_model"

    class Config(SGRPO.Config):
        kl_coeff: float = Field(0.05, ge=0, description="β: weight of the k3 KL to the reference model")
