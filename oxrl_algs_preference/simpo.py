"""SimPO: Simple Preference Optimization with a reference-free reward (Meng et al. 2024).

The implicit reward is the length-normalised log-likelihood, and a target margin γ separates
chosen from rejected:

    h = (β/|y_c|)·log π_θ(y_c|x) − (β/|y_r|)·log π_θ(y_r|x) − γ
    L = −(1/B) Σ_b log σ(h_b)

Defaults β = 2.0, γ = 1.0 (γ/β = 0.5), in the range the paper recommends; with optional
label smoothing ε as in DPO.
"""

from __future__ import annotations

from pydantic import Field

from oxrl_algs_preference.common import pair_metrics, sigmoid_loss
from oxrl_core import Algorithm, PairedPreferenceBatch, StrictModel


class SimPO(Algorithm):
    name = "simpo"
    loop = "preference"
    data_format = "preference"
    loss_weighting = "sequences"

    class Config(StrictModel):
        beta: float = Field(2.0, gt=0, description="β: scale of the length-normalised reward")
        gamma: float = Field(1.0, ge=0, description="γ: target reward margin between chosen and rejected")
        label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="ε: probability that a preference label is wrong")

    def loss(self, batch: PairedPreferenceBatch):
        beta, gamma = self.config.beta, self.config.gamma
        # (β/|y|)·log π_θ(y|x): the length-normalised implicit reward
        reward_chosen = beta * batch["logp_chosen"] / batch["n_chosen"]  # (B,)
        reward_rejected = beta * batch["logp_rejected"] / batch["n_rejected"]  # (B,)
        # h = r(y_c) − r(y_r) − γ
        h = reward_chosen - reward_rejected - gamma  # (B,)
        loss = sigmoid_loss(h, self.config.label_smoothing).mean()
        return loss, pair_metrics(reward_chosen, reward_rejected, batch["logp_chosen"], batch["logp_rejected"])
