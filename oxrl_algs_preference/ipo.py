"""IPO: Identity Preference Optimisation (Azar et al. 2023, "A General Theoretical Paradigm...").

DPO's log σ can push h to infinity on deterministic preferences; IPO regresses the log-ratio
gap onto a fixed target instead:

    g = [log π_θ(y_c|x) − log π_ref(y_c|x)] − [log π_θ(y_r|x) − log π_ref(y_r|x)]     (= h/β)
    L = (1/B) Σ_b (g_b − 1/(2β))²          (τ of the paper is β here)

Log-probabilities are **length-averaged** (divided by the response's token count), not summed:
with sums, g grows with the response length while the target 1/(2β) does not, so long pairs
would be pulled much harder than short ones. Averaging keeps g on one scale for all lengths;
it is what the IPO authors' follow-up experiments and TRL's ``loss_type="ipo"`` do. This is a
deliberate deviation from the paper's notation, which writes sequence log-probabilities.
"""

from __future__ import annotations

from pydantic import Field

from oxrl_algs_preference.common import pair_metrics
from oxrl_core import Algorithm, PairedPreferenceBatch, StrictModel


class IPO(Algorithm):
    name = "ipo"
    loop = "preference"
    data_format = "preference"
    needs_ref = True
    loss_weighting = "sequences"

    class Config(StrictModel):
        beta: float = Field(0.1, gt=0, description="β (τ in the paper): the regression target is 1/(2β)")

    def loss(self, batch: PairedPreferenceBatch):
        beta = self.config.beta
        # length-averaged log-ratios: (log π_θ(y|x) − log π_ref(y|x)) / |y|
        chosen_logratio = (batch["logp_chosen"] - batch["ref_logp_chosen"]) / batch["n_chosen"]  # (B,)
        rejected_logratio = (batch["logp_rejected"] - batch["ref_logp_rejected"]) / batch["n_rejected"]  # (B,)
        g = chosen_logratio - rejected_logratio  # (B,)
        # L = (g − 1/(2β))²
        loss = ((g - 1 / (2 * beta)) ** 2).mean()
        metrics = pair_metrics(
            beta * chosen_logratio, beta * rejected_logratio, batch["logp_chosen"], batch["logp_rejected"]
        )
        return loss, metrics
