"""SFT: supervised fine-tuning, cross-entropy on the completion tokens only.

    L = -(1/N) Σ_{b,t} m_{b,t} · log π_θ(y_{b,t} | y_{b,<t}, x_b),    N = Σ_{b,t} m_{b,t}

m is 1 on completion tokens (the prompt is masked, DESIGN §5) and 0 elsewhere;
the mean runs over completion tokens of the whole optimiser batch (the loop
weights micro-batches by their token share), not per sequence, as in TRL and
OpenRLHF.
"""

import torch
from pydantic import Field

from oxrl_core.interfaces import Algorithm, StrictModel

IGNORE = -100


def masked_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token negative log-likelihood of next tokens, and the loss mask.

    logits (B, T, V), labels (B, T) with -100 where no loss is taken -> nll (B, T-1), mask (B, T-1).
    Position t predicts token t+1, so logits drop their last position and labels their first.
    """
    logits = logits[:, :-1].float()  # (B, T-1, V)
    targets = labels[:, 1:]  # (B, T-1)
    mask = targets != IGNORE  # (B, T-1)
    logp = torch.log_softmax(logits, dim=-1)  # (B, T-1, V)
    logp_target = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    return -logp_target * mask, mask


class SFT(Algorithm):
    name = "sft"
    family = "supervised"
    data_format = "prompt_response"

    class Config(StrictModel):
        """SFT has no hyper-parameters beyond `train.*`; `label_smoothing` is the one common extra."""

        label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="ε: mass spread uniformly over the vocabulary")

    def loss(self, batch):
        nll, mask = masked_token_nll(batch["logits"], batch["labels"])  # (B, T-1), (B, T-1)
        n_tokens = mask.sum().clamp(min=1)
        # L = -(1/N) Σ m · log π(y)
        loss_nll = nll.sum() / n_tokens
        loss = loss_nll
        eps = self.config.label_smoothing
        if eps > 0:
            # label smoothing: L = (1-ε)·NLL + ε·(1/N) Σ m · (-(1/V) Σ_v log π(v))
            logp = torch.log_softmax(batch["logits"][:, :-1].float(), dim=-1)  # (B, T-1, V)
            uniform = -(logp.mean(-1) * mask).sum() / n_tokens
            loss = (1 - eps) * loss_nll + eps * uniform
        return loss, {"loss/nll": loss_nll.detach()}
