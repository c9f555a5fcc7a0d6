"""KD: knowledge distillation from a teacher model (Hinton et al. 2015), on completion tokens.

    L = α · CE(y, π_S) + (1 − α) · T² · KL(p_T^τ ‖ p_S^τ)

    KL(p_T^τ ‖ p_S^τ) = (1/N) Σ_{b,t} m_{b,t} Σ_v p_T^τ(v) · (log p_T^τ(v) − log p_S^τ(v))

p^τ = softmax(logits / T) for teacher (T) and student (S), m = 1 on completion
tokens, N = Σ m. The T² factor keeps the soft-target gradients on the same
scale as the hard-target ones when the temperature changes. The teacher comes
from `model.teacher` and must share the student's vocabulary; the loop computes the
per-position KL at this algorithm's T (`distill_temperature`) as `kl_teacher`, chunk by
chunk over the vocabulary-sized distributions (no gradient reaches the teacher).
"""

from pydantic import Field

from oxrl_core import Algorithm, StrictModel, SupervisedBatch


class KD(Algorithm):
    name = "kd"
    loop = "supervised"
    data_format = "prompt_response"
    needs_teacher = True

    class Config(StrictModel):
        alpha: float = Field(0.5, ge=0.0, le=1.0, description="α: weight of the hard-label cross-entropy")
        temperature: float = Field(2.0, gt=0.0, description="T: softens both distributions in the KL term")

    def distill_temperature(self) -> float:
        return self.config.temperature

    def loss(self, batch: SupervisedBatch):
        alpha, T = self.config.alpha, self.config.temperature
        logp, mask = batch["logp"], batch["mask"]  # (B, T-1), (B, T-1)
        n_tokens = mask.sum().clamp(min=1)
        ce = -(logp * mask).sum() / n_tokens

        # KL(p_T ‖ p_S) per position = Σ_v p_T (log p_T − log p_S), at temperature T
        kl_per_token = batch["kl_teacher"]  # (B, T-1)
        kl = (kl_per_token * mask).sum() / n_tokens

        # L = α·CE + (1 − α)·T²·KL
        loss = alpha * ce + (1 - alpha) * T**2 * kl
        return loss, {"loss/ce": ce.detach(), "loss/kl": kl.detach()}
