"""RLAIF: group-relative policy optimisation with an AI judge as the reward (Bai et al. 2022; Lee et al. 2023).

The objective is SGRPO's (see ``sgrpo.py``) with a KL to the reference on by default
(β = 0.05, as in ``rlhf.py``). The reward is an LLM judge — by default the ``llm_judge``
reward of ``oxrl-rewards``: a language model served through a rollout backend reads a rubric
template filled with the prompt and the completion, and its score is parsed from its answer
(``reward.model``, ``reward.template``, ``reward.pattern``); an answer with no parsable score
scores 0 and is counted in ``reward/errors``.

    r_i = parse(judge(template(x, o_i))) / scale
    A_i = (r_i − mean_g) / (std_g + eps)
    L   = −(1/Σ|o_i|) Σ_i Σ_t [ min(ρ A_i, clip(ρ, 1−ε_low, 1+ε_high) A_i) − β·KL_k3 ]
"""

from __future__ import annotations

from pydantic import Field

from oxrl_algs_rl.sgrpo import SGRPO


class RLAIF(SGRPO):
    name = "rlaif"
    default_reward = "llm_judge"

    class Config(SGRPO.Config):
        kl_coeff: float = Field(0.05, ge=0, description="β: weight of the k3 KL to the reference model")
