"""SPIN: Self-Play fIne-tuNing (Chen et al. 2024).

SFT data only: at iteration t the "opponent" is the previous policy π_θt, which generates a
response y' for each prompt; the new policy learns to tell the human response y from y':

    h = λ·[(log π_θ(y|x) − log π_θt(y|x)) − (log π_θ(y'|x) − log π_θt(y'|x))]
    L = −(1/B) Σ_b log σ(h_b)                  (the paper's logistic loss ℓ(t) = log(1 + e^{−t}))

which is DPO with chosen = the dataset response, rejected = the opponent's response and the
reference = π_θt. The loop does the self-play (``self_play``): the reference is the policy as
it was at the start of the iteration and generates the rejected responses; the run's
``train.max_steps`` are split into ``iterations`` equal parts.

Deliberate deviation: the paper generates y' for the whole dataset at the start of an
iteration; here y' is generated for each batch when it is drawn, by the same frozen π_θt, which
is the same distribution without a pass over the whole dataset (and with fresh samples when a
prompt comes back in a later epoch of the iteration).
"""

from __future__ import annotations

from pydantic import Field

from oxrl_algs_preference.common import pair_metrics, sigmoid_loss
from oxrl_core import Algorithm, PairedPreferenceBatch, StrictModel


class SPIN(Algorithm):
    name = "spin"
    loop = "preference"
    data_format = "prompt_response"
    needs_ref = True
    self_play = True
    loss_weighting = "sequences"

    class Config(StrictModel):
        beta: float = Field(0.1, gt=0, description="λ (β in DPO terms): strength of the regularisation towards π_θt")
        iterations: int = Field(
            2, ge=1, description="self-play iterations; train.max_steps is split evenly between them"
        )

    def iterations(self) -> int:
        return self.config.iterations

    def loss(self, batch: PairedPreferenceBatch):
        beta = self.config.beta
        # chosen = the dataset response y, rejected = the opponent's y'
        chosen_logratio = batch["logp_chosen"] - batch["ref_logp_chosen"]  # (B,)
        rejected_logratio = batch["logp_rejected"] - batch["ref_logp_rejected"]  # (B,)
        # h = λ·[(log π_θ(y) − log π_θt(y)) − (log π_θ(y') − log π_θt(y'))]
        h = beta * (chosen_logratio - rejected_logratio)  # (B,)
        loss = sigmoid_loss(h).mean()
        return loss, pair_metrics(
            beta * chosen_logratio, beta * rejected_logratio, batch["logp_chosen"], batch["logp_rejected"]
        )
