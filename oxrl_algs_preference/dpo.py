"""DPO: Direct Preference Optimization (Rafailov et al. 2023).

For a prompt x with a chosen response y_c and a rejected one y_r, the policy's implicit reward
of a response is β·log(π_θ(y|x) / π_ref(y|x)), and the Bradley–Terry likelihood of the
preference gives

    h = β·[(log π_θ(y_c|x) − log π_ref(y_c|x)) − (log π_θ(y_r|x) − log π_ref(y_r|x))]
    L = −(1/B) Σ_b log σ(h_b)

with log π(y|x) summed over the completion tokens. Two options, both off by default:
- conservative DPO (cDPO, Mitchell 2023): labels flipped with probability ε,
  L = −(1/B) Σ_b [(1−ε)·log σ(h_b) + ε·log σ(−h_b)];
- an NLL term on the chosen responses (RPO, Pang et al. 2024), α·NLL(y_c), the NLL a mean over
  the chosen tokens of the batch (as in TRL's ``rpo_alpha``).
"""

from __future__ import annotations

from pydantic import Field

from oxrl_algs_preference.common import chosen_nll, pair_metrics, sigmoid_loss
from oxrl_core import Algorithm, PairedPreferenceBatch, StrictModel


class DPO(Algorithm):
    name = "dpo"
    loop = "preference"
    data_format = "preference"
    needs_ref = True
    loss_weighting = "sequences"

    class Config(StrictModel):
        beta: float = Field(0.1, gt=0, description="β: strength of the KL regularisation towards the reference")
        label_smoothing: float = Field(
            0.0, ge=0, lt=0.5, description="ε: probability that a preference label is wrong (cDPO)"
        )
        nll_alpha: float = Field(
            0.0, ge=0, description="α: weight of an NLL term on the chosen responses (RPO); 0 = off"
        )

    def loss(self, batch: PairedPreferenceBatch):
        beta = self.config.beta
        # log π_θ(y|x) − log π_ref(y|x) per pair
        chosen_logratio = batch["logp_chosen"] - batch["ref_logp_chosen"]  # (B,)
        rejected_logratio = batch["logp_rejected"] - batch["ref_logp_rejected"]  # (B,)
        # h = β·[(log π_θ(y_c) − log π_ref(y_c)) − (log π_θ(y_r) − log π_ref(y_r))]
        h = beta * (chosen_logratio - rejected_logratio)  # (B,)
        # L = −(1−ε)·log σ(h) − ε·log σ(−h), mean over pairs
        loss = sigmoid_loss(h, self.config.label_smoothing).mean()
        metrics = pair_metrics(
            beta * chosen_logratio, beta * rejected_logratio, batch["logp_chosen"], batch["logp_rejected"]
        )
        if self.config.nll_alpha > 0:
            nll = chosen_nll(batch["logp_chosen"], batch["n_chosen"])
            loss = loss + self.config.nll_alpha * nll
            metrics["loss/nll"] = nll.detach()
        return loss, metrics
