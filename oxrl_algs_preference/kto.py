"""KTO: Kahneman–Tversky Optimization (Ethayarajh et al. 2024), on unpaired, labelled responses.

Each row is one response y to a prompt x, labelled desirable or undesirable. With the implicit
reward r = log π_θ(y|x) − log π_ref(y|x) and a reference point z (the policy's KL from the
reference, with no gradient):

    desirable:    L_D = λ_D·(1 − σ(β·(r − z)))
    undesirable:  L_U = λ_U·(1 − σ(β·(z − r)))
    L = mean over the rows of the batch of L_D or L_U

z is the batch "mismatched pair" estimate of the paper (§4.1) and TRL: each prompt x_i is
paired with the completion y_{i−1} of another row (cyclically within the batch), and

    z = max(0, (1/B) Σ_i [log π_θ(y_{i−1}|x_i) − log π_ref(y_{i−1}|x_i)])

computed without gradient. (A moving average is the other option the paper mentions; the
batch estimate is used because it needs no state and matches TRL.) λ_D and λ_U trade off
imbalanced data: the paper keeps λ_D·n_D / (λ_U·n_U) in [1, 4/3].
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_core import Algorithm, StrictModel, UnpairedPreferenceBatch


class KTO(Algorithm):
    name = "kto"
    loop = "preference"
    data_format = "unpaired"
    needs_ref = True
    loss_weighting = "sequences"

    class Config(StrictModel):
        beta: float = Field(0.1, gt=0, description="β: sharpness of the value function (and KL strength)")
        desirable_weight: float = Field(1.0, gt=0, description="λ_D: weight of desirable rows")
        undesirable_weight: float = Field(1.0, gt=0, description="λ_U: weight of undesirable rows")

    def loss(self, batch: UnpairedPreferenceBatch):
        beta = self.config.beta
        desirable = batch["label"] > 0.5  # (B,) bool
        # r = log π_θ(y|x) − log π_ref(y|x)
        r = batch["logp"] - batch["ref_logp"]  # (B,)
        # z = max(0, mean_i[log π_θ(y_{i−1}|x_i) − log π_ref(y_{i−1}|x_i)]), no gradient
        z = (batch["kl_logp"] - batch["ref_kl_logp"]).mean().clamp(min=0).detach()
        # L_D = λ_D·(1 − σ(β(r − z))),  L_U = λ_U·(1 − σ(β(z − r)))
        loss_desirable = self.config.desirable_weight * (1 - torch.sigmoid(beta * (r - z)))  # (B,)
        loss_undesirable = self.config.undesirable_weight * (1 - torch.sigmoid(beta * (z - r)))  # (B,)
        loss = torch.where(desirable, loss_desirable, loss_undesirable).mean()

        reward = (beta * r).detach()
        metrics = {"kl": z}
        if desirable.any():
            metrics["rewards/chosen"] = reward[desirable].mean()
            metrics["logps/chosen"] = batch["logp"].detach()[desirable].mean()
        if (~desirable).any():
            metrics["rewards/rejected"] = reward[~desirable].mean()
            metrics["logps/rejected"] = batch["logp"].detach()[~desirable].mean()
        return loss, metrics
