"""SFT: supervised fine-tuning, cross-entropy on the completion tokens only.

    L = -(1/N) Σ_{b,t} m_{b,t} · log π_θ(y_{b,t} | y_{b,<t}, x_b),    N = Σ_{b,t} m_{b,t}

m is 1 on completion tokens (the prompt is masked) and 0 elsewhere;
the mean runs over completion tokens of the whole optimiser batch (the loop
weights micro-batches by their token share), not per sequence, as in TRL and
OpenRLHF.
"""

from pydantic import Field

from oxrl_core import Algorithm, StrictModel, SupervisedBatch


class SFT(Algorithm):
    name = "sft"
    loop = "supervised"
    data_format = "prompt_response"

    class Config(StrictModel):
        """SFT has no hyper-parameters beyond `train.*`; `label_smoothing` is the one common extra."""

        label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="ε: mass spread uniformly over the vocabulary")

    def uses_logp_mean(self) -> bool:
        return self.config.label_smoothing > 0

    def loss(self, batch: SupervisedBatch):
        logp, mask = batch["logp"], batch["mask"]  # (B, T-1) each: log π(y_t), 1 on completion tokens
        n_tokens = mask.sum().clamp(min=1)
        # L = -(1/N) Σ m · log π(y)
        loss_nll = -(logp * mask).sum() / n_tokens
        loss = loss_nll
        eps = self.config.label_smoothing
        if eps > 0:
            # label smoothing: L = (1-ε)·NLL + ε·(1/N) Σ m · (-(1/V) Σ_v log π(v))
            uniform = -(batch["logp_mean"] * mask).sum() / n_tokens
            loss = (1 - eps) * loss_nll + eps * uniform
        return loss, {"loss/nll": loss_nll.detach()}
