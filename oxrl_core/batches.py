"""The batches the loops hand an algorithm: one `TypedDict` per kind, one key per line with its shape.

Per-token tensors are over next-token positions (position t scores token t+1); the loop does every forward pass,
an algorithm only turns these into a loss. Never a (B, T, V) tensor: the loop computes the per-token quantities
chunk by chunk. Shapes: B = rows (RL: prompts × n samples, the n samples of one prompt contiguous), T = token
positions. `oxrl_core.interfaces` (and `oxrl_core` itself) export every type here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypedDict

if TYPE_CHECKING:  # torch stays out of discovery
    import torch

__all__ = [
    "SupervisedBatch",
    "RLAdvantagesBatch",
    "RLLossBatch",
    "PairedPreferenceBatch",
    "UnpairedPreferenceBatch",
    "ScoreBatch",
]

# The options that turn an RL batch's per-token terms into a loss. They live here, below both their users, so the
# one list serves the config's validation (`oxrl_core.interfaces` re-exports them, torch-free) and the maths that
# computes them (`oxrl_core.ops`, which derives its tuples of names from them).

#: `PolicyGradient.Config.loss_agg`: how per-token loss terms become one loss (`oxrl_core.ops.aggregate_loss`)
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
#: `PolicyGradient.Config.kl_estimator` (`oxrl_core.ops.kl_estimate`)
KLEstimator = Literal["k1", "k2", "k3"]


class _SupervisedBatch(TypedDict):
    input_ids: torch.Tensor  # (B, T) token ids
    labels: torch.Tensor  # (B, T) token ids, -100 where no loss is taken
    mask: torch.Tensor  # (B, T-1) bool, True where labels[:, 1:] is scored
    logp: torch.Tensor  # (B, T-1) log π_θ(labels[:, t+1] | ≤ t), with gradients; 0 where not scored


class SupervisedBatch(_SupervisedBatch, total=False):
    """What a supervised algorithm's `Algorithm.loss` gets (SFT, CPT, KD). Never a (B, T, V)
    tensor: the loop computes the per-token quantities chunk by chunk."""

    logp_mean: torch.Tensor  # (B, T-1) (1/V) Σ_v log π_θ(v | ≤ t); only when `uses_logp_mean()` (label smoothing)
    kl_teacher: torch.Tensor  # (B, T-1) KL(p_T^τ ‖ p_S^τ), p^τ = softmax(logits / τ), τ = `distill_temperature()`;
    #                           the teacher has no gradient; only when ``needs_teacher``


class _RLAdvantagesBatch(TypedDict):
    rewards: torch.Tensor  # (B,) one scalar reward per sample
    mask: torch.Tensor  # (B, T) 1 on completion tokens, 0 on prompt and padding
    logp_old: torch.Tensor  # (B, T) the trainer's log π of the sampled tokens when they were sampled
    group_size: int  # n, samples per prompt (rows i·n … i·n+n−1 share a prompt)
    max_new_tokens: int  # L_max, rollout.max_new_tokens (overlong shaping, seq-mean-token-sum-norm)


class RLAdvantagesBatch(_RLAdvantagesBatch, total=False):
    """What `Algorithm.advantages` gets on the RL loop: one rollout batch, no gradients."""

    logp_ref: torch.Tensor  # (B, T) log π_ref of the sampled tokens; only when `uses_ref()`
    values: torch.Tensor  # (B, T) the critic's V(s_t) at sampling time; only when ``needs_critic``


class _RLLossBatch(RLAdvantagesBatch):
    logp: torch.Tensor  # (B, T) log π_θ of the sampled tokens, with gradients (0 where mask is 0)
    entropy: torch.Tensor  # (B, T) entropy of π_θ at each position, with gradients (0 where mask is 0)
    tis_weight: (
        torch.Tensor
    )  # (B, T) min(π_old / π_rollout, C) (is_mode=mask: 0 outside [is_low, C]), detached; ones when off


class RLLossBatch(_RLLossBatch, total=False):
    """What `Algorithm.loss` gets on the RL loop: a minibatch (rows of the rollout batch) of
    `RLAdvantagesBatch`, plus every tensor `advantages` returned (``adv`` (B, T), ``returns``,
    ``role``, ...; algorithm-specific, hence not listed), plus the current policy's terms."""

    values_new: torch.Tensor  # (B, T) the critic's V(s_t) now, with gradients; only when ``needs_critic``


class _PairedPreferenceBatch(TypedDict):
    logp_chosen: torch.Tensor  # (B,) log π_θ(y_w | x), summed over completion tokens, with gradients
    logp_rejected: torch.Tensor  # (B,) log π_θ(y_l | x), summed over completion tokens, with gradients
    n_chosen: torch.Tensor  # (B,) |y_w|, completion lengths
    n_rejected: torch.Tensor  # (B,) |y_l|


class PairedPreferenceBatch(_PairedPreferenceBatch, total=False):
    """What a preference algorithm's `Algorithm.loss` gets on ``preference`` rows, or on
    ``prompt_response`` rows with ``self_play`` (the rejected response is generated). The prompt
    is never scored."""

    ref_logp_chosen: torch.Tensor  # (B,) log π_ref(y_w | x), no gradient; only when `uses_ref()`
    ref_logp_rejected: torch.Tensor  # (B,) log π_ref(y_l | x), no gradient; only when `uses_ref()`


class _UnpairedPreferenceBatch(TypedDict):
    logp: torch.Tensor  # (B,) log π_θ(y | x), summed over completion tokens, with gradients
    n_tokens: torch.Tensor  # (B,) |y|
    label: torch.Tensor  # (B,) 1. desirable, 0. undesirable


class UnpairedPreferenceBatch(_UnpairedPreferenceBatch, total=False):
    """What a preference algorithm's `Algorithm.loss` gets on ``unpaired`` rows (KTO). The
    mismatched pairs are prompt i with completion i−1 (cyclically) of the same batch."""

    ref_logp: torch.Tensor  # (B,) log π_ref(y | x), no gradient; only when `uses_ref()`
    kl_logp: torch.Tensor  # (B,) log π_θ of the mismatched pairs, no gradient; only when `uses_ref()`
    ref_kl_logp: torch.Tensor  # (B,) log π_ref of the mismatched pairs; only when `uses_ref()`


class ScoreBatch(TypedDict):
    """What an algorithm with ``head = "score"`` (a scalar head, e.g. a reward model) gets on
    ``preference`` rows: the head's output at each sequence's last token (its EOS)."""

    rewards_chosen: torch.Tensor  # (B,) r(x, y_w), with gradients
    rewards_rejected: torch.Tensor  # (B,) r(x, y_l), with gradients
