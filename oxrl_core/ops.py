"""The shared maths every algorithm (and the loops) import: masked means, token NLL, group-relative
advantages, the KL estimators and loss aggregations. A leaf module: it imports torch and, of oxRL, only the
torch-free `oxrl_core.batches` (where the names of the estimators and aggregations are listed).

Shapes: B = sequences (RL: prompts × n samples, the n samples of one prompt contiguous),
T = token positions.
"""

from __future__ import annotations

from typing import get_args

import torch

from oxrl_core.batches import KLEstimator, LossAggregation


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_mean_value(x: torch.Tensor, mask: torch.Tensor) -> float:
    """`masked_mean` as a Python float, for metrics (no graph kept)."""
    return float(masked_mean(x.detach(), mask))


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Group z-scores: rewards (B,) -> A (B,).

        A_i = (r_i − mean_g) / (std_g + eps)      (or r_i − mean_g when ``scale`` is False, as Dr. GRPO)

    std is the sample standard deviation (Bessel-corrected, as TRL computes it); a group whose
    rewards are all equal (max == min) gets exactly A = 0 for every sample (it carries no learning
    signal) — tested on max == min rather than std > 0, since float32 rounding leaves std ≈ 1e-8 for
    e.g. eight rewards of 0.1, which std + eps would turn into A ≈ 1e-4.
    """
    r = rewards.view(-1, group_size)  # (P, n)
    mean = r.mean(dim=1, keepdim=True)  # (P, 1)
    centred = r - mean  # (P, n)
    if scale:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)  # (P, 1)
        centred = centred / (std + eps)
    # groups of equal rewards: A = 0 exactly
    equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # (P, 1)
    return torch.where(equal, torch.zeros_like(centred), centred).reshape(-1)  # (B,)


# ----------------------------------------------------------------------------- the shared policy-gradient options
# What every group-based RL algorithm offers under ``alg.`` (`oxrl_core.interfaces.PolicyGradient`): the KL
# estimator and where the KL goes, an entropy bonus, DAPO's overlong shaping and the loss aggregation.

#: the names the config accepts (its ``Literal``s), for the messages naming the choices
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from tokens sampled by π_θ (Schulman 2020), Δ = log π_ref − log π_θ:

        k1 = −Δ                  unbiased, can be negative, high variance (PPO's per-token reward penalty)
        k2 = ½ Δ²                biased, low variance; its gradient is that of the true KL's (on-policy)
        k3 = exp(Δ) − Δ − 1      unbiased, never negative (GRPO)

    logp, logp_ref (B, T) -> (B, T).
    """
    delta = logp_ref - logp  # (B, T)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta**2
    if estimator == "k3":
        return delta.exp() - delta - 1
    raise ValueError(f"unknown KL estimator {estimator!r}: one of {', '.join(KL_ESTIMATORS)}")


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None = None) -> torch.Tensor:
    """One scalar from per-token loss terms ℓ_{i,t} (B, T) over the completion tokens (``mask`` (B, T)):

        token-mean               Σ_i Σ_t ℓ / Σ_i |o_i|             every token weighs the same (DAPO)
        seq-mean-token-mean      (1/B) Σ_i (1/|o_i|) Σ_t ℓ         every sequence weighs the same (GRPO, GSPO)
        seq-mean-token-sum       (1/B) Σ_i Σ_t ℓ                   a sequence weighs its length (REINFORCE, RLOO)
        seq-mean-token-sum-norm  (1/B) Σ_i (1/L) Σ_t ℓ, L = max_len  a constant normaliser (Dr. GRPO, L = max tokens)

    B counts the rows with at least one completion token (a fully masked row adds nothing and is not counted);
    0 when no row has one. The loop weights micro-batches by tokens for ``token-mean`` and by such rows for the
    others, so the value over a batch split into micro-batches (or ranks) is the value over the whole batch.
    """
    tokens = mask.sum(-1)  # (B,) |o_i|
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    per_seq = (per_token * mask).sum(-1)  # (B,) Σ_t ℓ
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("loss aggregation seq-mean-token-sum-norm needs max_len (rollout.max_new_tokens)")
        per_seq = per_seq / max_len
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}: one of {', '.join(LOSS_AGGREGATIONS)}")
    rows = (tokens > 0).to(per_token.dtype)  # (B,)
    return (per_seq * rows).sum() / rows.sum().clamp(min=1)


def mean_metric(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """A per-token quantity's mean for the metrics (a ratio, a clip indicator), weighted as ``mode`` weights the
    loss: over tokens for ``token-mean``, else per sequence then over sequences (the loop weights such losses'
    micro-batches by sequences, and a metric must add up across micro-batches and ranks as the loss does)."""
    return aggregate_loss(x, mask, "token-mean" if mode == "token-mean" else "seq-mean-token-mean").detach()


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``penalty``: lengths (B,) -> (B,)

    R_len(y) = 0                               |y| ≤ L_max − L_buf
               ((L_max − L_buf) − |y|) / L_buf   L_max − L_buf < |y| ≤ L_max
               −1                              |y| > L_max
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0) / buffer  # (B,) 0 below the buffer, 1 at L_max
    return -penalty * over.clamp(max=1.0)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's baseline (Kool et al. 2019; Ahmadian et al. 2024): rewards (B,) -> A (B,).

        A_i = r_i − (1/(n−1)) Σ_{j≠i} r_j  =  n/(n−1) · (r_i − mean_g)

    A group whose rewards are all equal gets exactly 0. Needs n ≥ 2.
    """
    r = rewards.view(-1, group_size)  # (P, n)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)  # (P, n) mean of the other n−1
    adv = r - others
    equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # (P, 1)
    return torch.where(equal, torch.zeros_like(adv), adv).reshape(-1)  # (B,)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / (std + eps) over the masked positions of the whole tensor (B, T); 0 off the mask."""
    mean = masked_mean(x, mask)
    std = masked_mean((x - mean) ** 2, mask).sqrt()
    return (x - mean) / (std + eps) * mask


def shaped_rewards(batch: dict, options, kl: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A group algorithm's sequence rewards (B,) after the shared options (``options`` = its config):

        r_i ← r_i + R_len(o_i)                          ``overlong_buffer`` > 0 (`overlong_penalty`)
        r_i ← r_i − β Σ_t KL_t(π_old || π_ref)          ``kl_in_reward`` with β = ``kl_coeff`` > 0 (as verl)

    KL_t is ``kl_estimator``'s at the sampling policy (logp_old), detached. Metrics (0-d tensors) name what was
    applied.
    ``kl=False`` leaves the KL to the caller (REINFORCE++ puts it in each token's reward, `token_kl_rewards`).
    """
    rewards, mask = batch["rewards"], batch["mask"]  # (B,), (B, T)
    metrics: dict[str, torch.Tensor] = {}
    if options.overlong_buffer > 0:
        length_penalty = overlong_penalty(
            mask.sum(-1), batch["max_new_tokens"], options.overlong_buffer, options.overlong_penalty
        )  # fmt: skip  (B,)
        rewards = rewards + length_penalty
        metrics["reward/overlong_penalty"] = length_penalty.mean()
    if kl and options.kl_in_reward and options.kl_coeff > 0:
        kl = kl_estimate(batch["logp_old"], batch["logp_ref"], options.kl_estimator) * mask  # (B, T)
        rewards = rewards - options.kl_coeff * kl.sum(-1)
        metrics[f"kl/reward_{options.kl_estimator}"] = masked_mean(kl, mask).detach()
    return rewards, metrics


def token_kl_rewards(rewards: torch.Tensor, batch: dict, options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token rewards (B, T): the sequence reward R_i (B,) on its last completion token and, with
    ``kl_in_reward`` and β = ``kl_coeff`` > 0, a KL penalty on every token (PPO's and REINFORCE++'s reward):

        r_{i,t} = −β · KL_t(π_old || π_ref) + [t = last token of o_i] · R_i
    """
    mask = batch["mask"]  # (B, T)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()  # (B, T) the last completion token
    token_rewards = last.to(rewards.dtype) * rewards[:, None]  # (B, T)
    metrics: dict[str, torch.Tensor] = {}
    if options.kl_in_reward and options.kl_coeff > 0:
        kl = kl_estimate(batch["logp_old"], batch["logp_ref"], options.kl_estimator) * mask  # (B, T)
        token_rewards = token_rewards - options.kl_coeff * kl
        metrics[f"kl/reward_{options.kl_estimator}"] = masked_mean(kl, mask).detach()
    return token_rewards, metrics


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{k≥t} r_k over a row's completion tokens (γ = 1): (B, T) -> (B, T), 0 off the mask. In a
    multi-turn episode the environment's tokens (mask 0) carry no reward, so G_t sums the model's later tokens."""
    return (token_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al. 2017), and where its clip binds (no gradient through ρ):

    min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A)        ratio ρ, adv A (B, T) -> (B, T), (B, T) bool
    """
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    return surrogate, clipped


def policy_metrics(policy_term: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, batch: dict, options):
    """``loss/policy``, ``clip/frac`` and ``ratio/mean`` of a group algorithm, weighted as its loss (`mean_metric`)."""
    mask, mode = batch["mask"], options.loss_agg
    return {
        "loss/policy": aggregate_loss(policy_term, mask, mode, batch.get("max_new_tokens")).detach(),
        "clip/frac": mean_metric(clipped.float(), mask, mode),
        "ratio/mean": mean_metric(ratio, mask, mode),
    }


def policy_objective(policy_term: torch.Tensor, batch: dict, options) -> tuple[torch.Tensor, dict]:
    """A group algorithm's loss from its per-token policy term (B, T) and the shared options:

        ℓ_{i,t} = policy_term + β · KL_t(π_θ || π_ref) − c_H · H_t       (KL here unless ``kl_in_reward``)
        L       = aggregate_loss(ℓ, mask, ``loss_agg``)

    Returns the loss and the detached metrics of the KL and entropy terms, each aggregated as the loss is (so
    L = loss/policy + β·loss/kl − c_H·loss/entropy, and a batch split into micro-batches weighted as the loop weights
    them gives the whole batch's values): ``loss/kl``, ``loss/entropy``, and ``kl/loss_<estimator>`` the per-token
    KL weighted as the loss weights tokens (`mean_metric`).
    """
    mask, mode, max_len = batch["mask"], options.loss_agg, batch.get("max_new_tokens")  # (B, T)
    per_token, metrics = policy_term, {}
    if options.kl_coeff > 0 and not options.kl_in_reward:
        kl = kl_estimate(batch["logp"], batch["logp_ref"], options.kl_estimator)  # (B, T)
        per_token = per_token + options.kl_coeff * kl
        metrics["loss/kl"] = aggregate_loss(kl, mask, mode, max_len).detach()
        metrics[f"kl/loss_{options.kl_estimator}"] = mean_metric(kl, mask, mode)
    if options.entropy_coeff > 0:
        per_token = per_token - options.entropy_coeff * batch["entropy"]
        metrics["loss/entropy"] = aggregate_loss(batch["entropy"], mask, mode, max_len).detach()
    loss = aggregate_loss(per_token, mask, mode, max_len)
    return loss, metrics
