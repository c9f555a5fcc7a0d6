"""The trainer and the rollout engine must agree; two guards for when they do not (docs/architecture.md: the RL step).

Verified weight sync. After each `RolloutBackend.update_weights` (and once at the start, so a
backend that loaded the wrong model is caught before training) the backend scores a fixed probe
sequence with `RolloutBackend.score` and the trainer scores it too (no gradient, eval mode, raw
logits, the trainer's autocast):

    gap = max_i | log p_backend(x_i | x_<i) − log p_trainer(x_i | x_<i) |      i = 1..L-1

A gap above the tolerance means stale or corrupted weights in the engine: the run stops with an
`OxrlError` naming the gap, the tolerance and the policy version (the newest checkpoint stays).
The check can only see updates that move the probe's logprobs by more than the tolerance (the
numerical noise between two implementations of the same weights): a wrong model or corrupted
weights always, a single skipped update of a tiny learning rate in bf16 not necessarily.

Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"). The rollout engine samples from π_rollout, which differs
from the trainer's π_old by numerics (kernels, precision) even with identical weights; each
token's policy-gradient term is weighted by

    w_t = min(π_old(o_t) / π_rollout(o_t), C)          (detached; C = `rollout.tis_cap`)

Mismatch alarm. Every step the loop measures, over the completion tokens of the batch,

    rollout/logprob_diff = mean_t | log π_old(o_t) − log π_rollout(o_t) |

(the trainer's and the rollout engine's logprobs of the same sampled tokens). Above
`rollout.max_logprob_diff` the run stops with an `OxrlError` naming the likely causes and the newest
complete checkpoint. Defaults by the trainer's precision (`default_max_logprob_diff`): 0.01 nats in
float32, 0.25 under bf16/fp16 autocast; 0 turns the alarm off.
"""

from __future__ import annotations

import torch

from oxrl_core.errors import OxrlError
from oxrl_core.run_io.checkpoint import latest_checkpoint

#: appended to the first training prompt to make the probe (any fixed text would do)
PROBE_TEXT = " The quick brown fox jumps over the lazy dog; 12 + 30 = 42, and 7 × 6 = 42 too."
PROBE_MAX_TOKENS = 64


def probe_sequence(tokenizer, first_prompt_ids: list[int], max_tokens: int = PROBE_MAX_TOKENS) -> list[int]:
    """The fixed probe: the first training prompt followed by `PROBE_TEXT`, cut to ``max_tokens``,
    repeated until it has at least 32 tokens (a tokenizer with long tokens still gets a real probe)."""
    tail = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    ids = list(first_prompt_ids[: max_tokens // 2]) + tail
    while len(ids) < 32:
        ids += tail
    return ids[:max_tokens]


def default_tolerance(autocast_dtype) -> float:
    """`rollout.sync_tolerance` = 0: 1e-3 nats when the trainer computes in float32, 1.0 under bf16/fp16
    autocast. Measured max gaps on a 64-token probe: float32 `hf` or vLLM vs the float32 trainer ≤ 1e-5;
    on the trained built-in model (hidden 128, 4 layers) bf16 vLLM or an fp32 backend vs a bf16-autocast
    trainer 0.03-0.18, and larger models round more. In bf16 the check catches a wrong model, missing
    layers or corrupted weights (gaps of several nats), not a single skipped small update."""
    return 1e-3 if autocast_dtype is None else 1.0


def default_max_logprob_diff(autocast_dtype) -> float:
    """`rollout.max_logprob_diff` unset: 0.01 nats when the trainer computes in float32, 0.25 under
    bf16/fp16 autocast. Measured mean |trainer − rollout| per completion token on the tiny models of the
    suite: `hf` fp32 ~1e-7, vLLM (CPU, fp32) ~1e-6; a bf16-autocast trainer against an fp32 backend
    ~0.01-0.03; attention paths that drop a sliding window give 0.5-1.0 (issue 14)."""
    return 0.01 if autocast_dtype is None else 0.25


def check_logprob_diff(
    diff: float, threshold: float, step: int, backend_name: str, autocast_dtype, last_checkpoint=None
) -> None:
    """The mismatch alarm: raise `OxrlError` when a step's mean |trainer − rollout| logprob exceeds
    ``threshold`` (0 = off)."""
    if threshold <= 0 or diff <= threshold:  # NaN is caught earlier by the finite checks
        return
    precision = "float32" if autocast_dtype is None else f"{autocast_dtype} autocast".replace("torch.", "")
    raise OxrlError(
        f"step {step}: rollout/logprob_diff = {diff:.3g} nats (mean |trainer − rollout| logprob of the sampled "
        f"tokens) exceeds rollout.max_logprob_diff = {threshold:g} ({precision} trainer): the samples do not come "
        f"from the policy being trained. Likely causes: the rollout backend '{backend_name}' or its precision "
        f"(rollout.dtype) differs from the trainer's; an attention path that computes something else "
        f"(packing / shared prefixes with a sliding window or custom mask: try data.packing=false); stale "
        f"weights in the backend after a weight sync. The run stops before updating the model; last complete "
        f"checkpoint: {last_checkpoint or 'none'}. (rollout.max_logprob_diff raises the threshold; 0 turns "
        f"the alarm off.)"
    )


@torch.no_grad()
def trainer_logprobs(model, token_ids: list[int], autocast) -> torch.Tensor:
    """log p(x_i | x_<i), i = 1..L-1 (L-1,) of the trainer's model: eval mode, raw logits, float32 softmax.

    Raw on both sides, as a backend's `score` is (vLLM's prompt logprobs are of the raw logits): the probe checks
    the weights, so a VLM's never-sampled tokens are not masked here as they are in training forwards."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)  # (1, L)
    was_training = model.training
    model.eval()
    try:
        with autocast():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    finally:
        model.train(was_training)
    logp_all = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # (L-1, V)
    return logp_all.gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()  # (L-1,)


def check_weight_sync(
    backend, model, probe: list[int], version: int, tolerance: float, autocast, last_checkpoint=None
) -> dict[str, float]:
    """Score the probe on both sides; raise `OxrlError` when they disagree. Returns the sync metrics."""
    want = trainer_logprobs(model, probe, autocast)  # (L-1,)
    got = backend.score(probe)
    if len(got) != len(want):
        raise OxrlError(
            f"rollout backend '{backend.name}': score() returned {len(got)} logprobs for a {len(probe)}-token "
            f"probe (expected {len(want)})"
        )
    gap = float((torch.tensor(got, dtype=torch.float32) - want).abs().max())
    if not gap <= tolerance:  # NaN fails too
        when = "at the start (the backend's initial weights)" if version == 0 else "after the weight sync"
        raise OxrlError(
            f"weight sync check failed {when}, policy version {version}: the rollout backend '{backend.name}' "
            f"scores the probe sequence up to {gap:.3g} nats away from the trainer (tolerance {tolerance:g}), so "
            f"its weights are stale or corrupted and its samples would not come from the policy being trained. "
            f"The run stops; last complete checkpoint: {last_checkpoint or 'none'}. "
            f"(rollout.sync_tolerance raises the tolerance; rollout.sync_check=false turns the check off.)"
        )
    return {"sync/probe_logprob_diff": gap, "sync/probe_tolerance": tolerance}


def tis_weight(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, cap: float, mode="truncate", low=0.0
):
    """The importance weights (B, T) and their metrics (0-d tensors, read with the step's figures); ones (and no
    metrics) when ``cap`` is 0.

    logp_old, logp_rollout, mask (B, T): the trainer's (proximal policy's) and the rollout engine's (behaviour
    policy's) logprobs of the sampled tokens, 1 on completion tokens. ``mode`` (`rollout.is_mode`): ``truncate``
    clips the weight at ``cap``; ``mask`` drops a token whose weight is outside [``low``, ``cap``] (weight 0;
    it still counts in the loss's token normaliser, so the kept tokens' weights are not rescaled).
    """
    if cap <= 0:
        return torch.ones_like(logp_old), {}
    ratio = torch.exp(logp_old - logp_rollout).detach()  # (B, T) r_t = π_old(o_t) / π_rollout(o_t)
    tokens = mask.sum().clamp(min=1)
    if mode == "mask":
        # w_t = r_t if low <= r_t <= C else 0
        kept = ((ratio >= low) & (ratio <= cap)).float()  # (B, T)
        weight = ratio * kept * mask  # (B, T), 0 off the completion and where dropped
        share = {"tis/masked_frac": ((1 - kept) * mask).sum() / tokens}
    else:
        # w_t = min(r_t, C)
        weight = ratio.clamp(max=cap) * mask  # (B, T), 0 off the completion
        share = {"tis/clipped_frac": ((ratio > cap).float() * mask).sum() / tokens}
    return weight, {"tis/weight_mean": weight.sum() / tokens, **share}


def off_policy_metrics(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the behaviour policy (the rollout engine's, possibly older) is from the proximal one (the trainer's
    current weights), over the completion tokens (B, T) sampled from the behaviour policy, with r_t = π_old / π_rollout:

        offpolicy/kl_k3 = mean_t (r_t − 1) − log r_t        (k3 estimate of KL(π_rollout ‖ π_old), ≥ 0)
        offpolicy/chi2  = mean_t (r_t − 1)²                 (χ² divergence estimate)
        offpolicy/ess   = (Σ_t r_t)² / (N Σ_t r_t²)          (effective sample share, 1 = on-policy)

    Each a 0-d tensor (read with the step's figures).
    """
    log_ratio = (logp_old - logp_rollout).detach()  # (B, T)
    ratio = torch.exp(log_ratio) * mask
    tokens = mask.sum().clamp(min=1)
    return {
        "offpolicy/kl_k3": (((ratio - 1) - log_ratio) * mask).sum() / tokens,
        "offpolicy/chi2": (((ratio - 1) ** 2) * mask).sum() / tokens,
        "offpolicy/ess": ratio.sum() ** 2 / (tokens * (ratio**2).sum()).clamp(min=1e-30),
    }


class SyncCheck:
    """`rollout.sync_check`, set up once: the probe (when the backend can score), its tolerance, and
    whether a check after a sync can see anything. Called with a policy version, it checks the sync
    that produced it and returns its metrics (``{}`` when nothing is checked)."""

    def __init__(
        self, backend, can_score: bool, model, engine, tokenizer, first_prompt, ro, start_version, run_dir, info
    ):
        self.backend, self.model, self.engine, self.start_version = backend, model, engine, start_version
        self.run_dir = run_dir
        self.probe = probe_sequence(tokenizer, first_prompt) if ro.sync_check and can_score else None
        self.tolerance = ro.sync_tolerance or default_tolerance(getattr(engine, "autocast_dtype", None))
        if ro.sync_check and self.probe is None:
            info(f"[yellow]note:[/yellow] rollout backend '{ro.backend}' has no score(): weight syncs are not verified")
        # The built-in hf backend generates with the trained module itself: after the start check (which covers
        # its generation path) a sync cannot leave it stale, so the probe is not re-scored after every sync.
        self.shares_module = backend is not None and backend.model is model

    def __call__(self, policy_version: int) -> dict:
        if self.probe is None or (self.shares_module and policy_version != self.start_version):
            return {}
        engine = self.engine
        with engine.full_weights():  # (a collective under ZeRO-3: every rank enters it)
            if self.backend is None:  # rollout actors: rank 0 checks them
                return {}
            return check_weight_sync(
                self.backend,
                self.model,
                self.probe,
                policy_version,
                self.tolerance,
                engine.autocast,
                latest_checkpoint(self.run_dir),
            )
