"""RM: a Bradley–Terry reward model (Ouyang et al. 2022; the margin from Touvron et al. 2023).

A scalar head r(x, y) on the language model, read at the response's last token (its EOS), is
trained so that chosen responses score higher than rejected ones:

    L = −(1/B) Σ_b log σ(r(x, y_c) − r(x, y_r) − m)  +  c·(1/B) Σ_b (r(x, y_c) + r(x, y_r))²

m is an optional constant margin (0 by default); the second term (c > 0, "reward centering",
Eisenstein et al. 2023) keeps rewards near zero mean, since the Bradley–Terry loss only sees
differences. The run's ``final/`` is an ``AutoModelForSequenceClassification`` checkpoint with
one label, the input of the ``reward_model`` reward (and so of RLHF).
"""

from __future__ import annotations

import torch.nn.functional as F
from pydantic import Field

from oxrl_algs_preference.common import pair_metrics
from oxrl_core import Algorithm, ScoreBatch, StrictModel


class RM(Algorithm):
    name = "rm"
    loop = "preference"
    data_format = "preference"
    head = "score"
    loss_weighting = "sequences"

    class Config(StrictModel):
        margin: float = Field(0.0, description="m: the chosen reward must exceed the rejected one by this much")
        center_coeff: float = Field(0.0, ge=0, description="c: weight of the reward-centering term (0 = off)")

    def loss(self, batch: ScoreBatch):
        r_chosen, r_rejected = batch["rewards_chosen"], batch["rewards_rejected"]  # (B,), (B,)
        # L_BT = −log σ(r_c − r_r − m)
        loss = -F.logsigmoid(r_chosen - r_rejected - self.config.margin).mean()
        metrics = pair_metrics(r_chosen, r_rejected)
        if self.config.center_coeff > 0:
            # c·mean((r_c + r_r)²)
            centering = ((r_chosen + r_rejected) ** 2).mean()
            loss = loss + self.config.center_coeff * centering
            metrics["loss/centering"] = centering.detach()
        return loss, metrics
