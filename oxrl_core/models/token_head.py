"""Per-token quantities of the language-model head, one token × vocabulary tile at a time.

A loss reads a few numbers at each position it scores: log π(y_t) of the target token, the
entropy H_t, the mean over the vocabulary of log π(v) (label smoothing), the KL from a teacher
(KD). Computed from the full logits they cost a (tokens, V) float32 tensor and its gradient,
several times over: 4,000 tokens × 151,936 × 4 bytes = 2.4 GB each. Here the loop runs the
backbone once and gathers the last hidden states of the scored positions only; the head then
works on tiles of ``chunk_size`` tokens × ``vocab_tile`` vocabulary entries:

    raw = h_tile · W_tileᵀ (+ b)            the compute dtype (bf16 under autocast), into ONE reused buffer
    z   = transform(raw) / temperature       float32: the model's own output transform (logit scale, soft-cap)
    m, s, Σ e·z, Σ z, z_y                    fp32 online folds over the vocabulary tiles, e = exp(z − m)
    lse = m + log s;  log π(y) = z_y − lse;  H = lse − Σ e·z / s;  mean_v log π(v) = Σ z / V − lse

Backward recomputes each tile, writes ∂L/∂raw into the same buffer in place and accumulates
∂L/∂h and ∂L/∂W (and ∂L/∂b) in float32 (`tiled_head._TiledHead`); the weight is cast one tile at a time.
No ``torch.utils.checkpoint``, no (tokens, V) tensor, no bf16 sums across tiles: the transient is
one tile in the compute dtype and two in float32 (2,048 × 8,192: 32 + 2 × 64 MB), whatever V.

Three paths, chosen once per model at setup by `choose_path` (``train.logits_chunk_size``,
``train.logits_vocab_tile``, ``train.logits_chunk_min_mb``):
  tiled    the above, where it saves memory: the full float32 logits of one micro-batch (the most
           tokens it can score × the vocabulary × 4 bytes) would exceed ``logits_chunk_min_mb``
           (64 MB: a 152k vocabulary from 110 scored tokens, a 32k one from 525), and the head is a
           plain ``nn.Linear`` whose weight the process holds whole;
  module   a head it cannot tile by weight — ZeRO-3 partitions it (each call gathers it from every
           rank), PEFT wraps it, a test hands an ``Identity`` — is called ``chunk_size`` tokens at a
           time with the whole vocabulary, under activation checkpointing (`_SoftmaxStats`);
  plain    the model's own forward and full logits, then the same maths with autograd
           (`stats_from_logits`): below that size (a tiny vocabulary, where the full logits cost
           less than the tiles' bookkeeping), with ``train.logits_chunk_size: 0``, and as the
           fallback when a probe at setup finds that the head does not reproduce
           ``model(...).logits`` (an architecture with an output transform this module does not know).
All give the same values and gradients (tests/test_token_head.py, every family of the matrix).

Never-sampled tokens (``HeadPath.masked``: a VLM's image placeholders and their delimiters,
`vision.placeholder_token_ids`): every path scores the distribution the sampler draws from, the logits of those
tokens set to `MASKED_LOGIT` (π = 0 there exactly; finite, so π·z and the entropy stay 0 rather than NaN), the mean
over the vocabulary taken over the other tokens, and no gradient reaches their logits.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from oxrl_core.engines import distributed
from oxrl_core.models.tiled_head import MASKED_LOGIT, dot, masked_ids, tiled_stats

#: relative tolerance of the setup probe (log-probabilities of both paths, fp32, no autocast)
PROBE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class HeadPath:
    """How per-token quantities are computed for one model."""

    chunk_size: int = 0  # tokens per tile; 0 = the plain path
    softcap: float | None = None  # z = c·tanh(z / c) (Gemma-2 ``final_logit_softcapping``)
    scale: float = 1.0  # z = scale · lm_head(h) (Cohere ``logit_scale``, Granite 1/``logits_scaling``, ...)
    note: str = ""  # why the plain path was chosen where the chunked one was wanted (a fallback)
    full_mb: float | None = None  # one micro-batch's full float32 logits, MB (when the caller gave its tokens)
    vocab_tile: int = 8192  # vocabulary entries per tile (the tiled path; the module path takes the whole vocabulary)
    masked: tuple[int, ...] = ()  # token ids never sampled: logit `MASKED_LOGIT` on every path (module docstring)

    @property
    def chunked(self) -> bool:
        return self.chunk_size > 0


PLAIN = HeadPath()
_PATHS: "weakref.WeakKeyDictionary[torch.nn.Module, HeadPath]" = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- the model's parts


def _inner(model):
    """The transformers model under the PEFT and DeepSpeed wrappers (LoRA layers stay in place)."""
    if type(model).__name__ == "DeepSpeedEngine":
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def backbone_and_head(model):
    """(backbone, lm_head) of a causal LM: the module whose ``last_hidden_state`` feeds the head, and the head."""
    inner = _inner(model)
    head = inner.get_output_embeddings()
    backbone = getattr(inner, inner.base_model_prefix, None) if inner.base_model_prefix else None
    if backbone is None or backbone is inner:
        backbone = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    return backbone, head


def output_transform(model) -> tuple[float | None, float]:
    """(soft-cap, scale) the model's forward applies after ``lm_head``, read from its config (the probe checks them)."""
    config = _inner(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None) or None
    scale = (
        getattr(text, "logit_scale", None)
        or getattr(text, "output_multiplier", None)
        or getattr(text, "lm_head_multiplier", None)
    )
    if scale is None and getattr(text, "logits_scaling", None):
        # Granite and MiniCPM3 divide by it, HyperCLOVA X multiplies
        scale = text.logits_scaling if text.model_type == "hyperclovax" else 1 / text.logits_scaling
    return softcap, float(scale or 1.0)


def vocab_size(model) -> int:
    """Rows of the model's output embedding (the vocabulary the head scores)."""
    head = _inner(model).get_output_embeddings()
    if head is not None and hasattr(head, "weight"):
        shape = getattr(head.weight, "ds_shape", None) or head.weight.shape  # ZeRO-3: the full shape
        return int(shape[0])
    config = _inner(model).config
    return int((config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size)


def full_logits_mb(tokens: int, vocab: int) -> float:
    """MB of one (tokens, vocab) float32 tensor: what each full-logits copy of a micro-batch costs."""
    return tokens * vocab * 4 / 2**20


def choose_path(
    model,
    chunk_size: int,
    log=None,
    *,
    tokens: int | None = None,
    min_mb: float = 0.0,
    vocab_tile: int = 8192,
    masked: tuple[int, ...] = (),
) -> HeadPath:
    """Decide, once, how this model's per-token quantities are computed; `path_of` returns the decision.

    ``tokens``: the most tokens one micro-batch can score. The chunked head is wanted when
    ``chunk_size > 0`` and the full float32 logits of those tokens would exceed ``min_mb``
    (``tokens`` not given: whenever ``chunk_size > 0``). Then a probe (a few tokens, fp32, no
    autocast) compares the chunked head's log-probabilities with ``log_softmax(model(...).logits)``;
    where they differ, or the model has no backbone/head to call, the plain path is used and ``log``
    gets a note saying why. ``masked``: the token ids the model never samples (`HeadPath.masked`), on every path."""
    path = PLAIN
    full_mb = None if tokens is None else full_logits_mb(tokens, vocab_size(model))
    if chunk_size > 0 and full_mb is not None and full_mb <= min_mb:
        path = HeadPath(full_mb=full_mb)  # chunking would save less than it costs
    elif chunk_size > 0:
        softcap, scale = output_transform(model)
        path = HeadPath(chunk_size, softcap, scale, vocab_tile=vocab_tile)
        backbone, head = backbone_and_head(model)
        if backbone is None or head is None:
            path = HeadPath(note="no backbone / output embeddings to call")
        else:
            try:
                diff = _probe(model, path)
            except Exception as exc:  # noqa: BLE001 - a backbone that cannot be called on its own: the plain path
                diff, path = (
                    float("nan"),
                    HeadPath(note=f"the backbone alone fails on a probe: {type(exc).__name__}: {exc}"),
                )
            if path.chunked and not diff <= PROBE_TOLERANCE:
                path = HeadPath(note=f"the chunked head differs from the model's logits by {diff:.2e} on a probe")
        if path.note and log is not None:
            log(
                f"[yellow]note:[/yellow] train.logits_chunk_size: full-vocabulary logits for "
                f"{type(_inner(model)).__name__} ({path.note})"
            )
        if full_mb is not None:
            path = replace(path, full_mb=full_mb)
    path = replace(path, masked=tuple(sorted(set(masked))))
    _PATHS[model] = path
    return path


def path_of(model) -> HeadPath:
    """The path `choose_path` chose for ``model``, else for the model under its PEFT / DeepSpeed wrapper (a VLM's
    loading registers its never-sampled tokens), else the plain one."""
    path = _PATHS.get(model)
    return path if path is not None else _PATHS.get(_inner(model), PLAIN)


@torch.no_grad()
def _probe(model, path: HeadPath) -> float:
    """Largest |Δ log π| (relative to the scale of the log-probabilities) between the two paths on 8 tokens."""
    backbone, head = backbone_and_head(model)
    vocab = vocab_size(model)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            expected = torch.log_softmax(model(**inputs, use_cache=False).logits[0].float(), -1)  # (8, V)
            z = _transform(head(backbone(**inputs, use_cache=False).last_hidden_state[0]), path)  # (8, V)
            got = torch.log_softmax(z, -1)
    finally:
        model.train(was_training)
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1.0))


def _transform(raw: torch.Tensor, path: HeadPath, reuse: bool = False) -> torch.Tensor:
    """The model's output transform in float32: a new tensor, or ``raw`` itself when ``reuse`` and there is
    nothing to do (float32, no transform): the caller may then overwrite ``raw``."""
    if path.scale != 1.0:
        z = raw.float() * path.scale
    elif raw.dtype != torch.float32:
        z = raw.float()
    else:
        z = raw if reuse and not path.softcap else raw.clone()
    if path.softcap:
        z.div_(path.softcap).tanh_().mul_(path.softcap)  # z = c·tanh(z / c)
    return z


# ----------------------------------------------------------------------------- the maths, plain


def stats_from_logits(
    logits,
    targets,
    temperature: float = 0.0,
    entropy: bool = False,
    logp_mean: bool = False,
    teacher_logits=None,
    kd_temperature: float = 1.0,
    masked: tuple[int, ...] = (),
) -> dict[str, torch.Tensor]:
    """The per-token quantities from full logits with autograd (the plain path, and the reference).

    logits (M, V) as the model returns them, targets (M,) ->
      logp (M,)        log π(y) at ``temperature`` (> 0: logits / temperature; 0: the raw ones)
      entropy (M,)     H = −Σ_v π(v) log π(v), same distribution
      logp_mean (M,)   (1/V') Σ_v log π(v), same distribution (label smoothing), over the V' tokens not ``masked``
      kl_teacher (M,)  KL(p_T^τ ‖ p_S^τ) = Σ_v p_T^τ(v) (log p_T^τ(v) − log p_S^τ(v)), τ = ``kd_temperature``
    where π is the distribution with the ``masked`` tokens' logits at `MASKED_LOGIT` (teacher's too).
    """
    ids = masked_ids(masked, logits.device)

    def keep(z):  # the never-sampled tokens' logits out of the distribution (no gradient reaches them)
        return z if ids is None else z.index_fill(-1, ids, MASKED_LOGIT)

    z = keep(logits.float())  # (M, V)
    if temperature > 0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)  # (M, V)
    out = {"logp": logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)}
    if entropy:
        out["entropy"] = -(logp_all.exp() * logp_all).sum(-1)
    if logp_mean:
        kept = logits.shape[-1] - (0 if ids is None else ids.numel())
        out["logp_mean"] = (logp_all if ids is None else logp_all.index_fill(-1, ids, 0.0)).sum(-1) / kept
    if teacher_logits is not None:
        logp_student = torch.log_softmax(keep(logits.float()) / kd_temperature, dim=-1)  # (M, V)
        logp_teacher = torch.log_softmax(keep(teacher_logits.detach().float()) / kd_temperature, dim=-1)  # (M, V)
        out["kl_teacher"] = (logp_teacher.exp() * (logp_teacher - logp_student)).sum(-1)
    return out


# ----------------------------------------------------------------------------- the maths, one chunk


def _log_softmax_parts(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp (N,), e = exp(z − max) (N, V), Σ e (N,)) -> lse and p = e / Σ e written into e."""
    top = z.amax(-1, keepdim=True)  # (N, 1)
    p = torch.sub(z, top).exp_()  # (N, V)
    total = p.sum(-1, keepdim=True)  # (N, 1)
    p.div_(total)
    return (top + total.log()).squeeze(-1), p


class _SoftmaxStats(torch.autograd.Function):
    """logp, entropy, logp_mean, kl_teacher (N,) of one chunk of logits, with the gradient written by hand.

    z = transform(raw)/t, log π = z − lse(z):
      ∂ log π(y) / ∂z = e_y − π          ∂ mean_v log π(v) / ∂z = 1/V − π
      ∂ H / ∂z        = −π (log π + H)   ∂ KL(q ‖ π^τ) / ∂(raw-side z) = (π^τ − q) / τ
    then through the transform: ∂z/∂raw = scale · (1 − tanh²) / t. Saved: ``raw`` and per-token
    scalars; backward needs two (N, V) float32 buffers beside ``raw`` (three with a teacher).
    """

    @staticmethod
    def forward(
        ctx,
        raw,
        targets,
        teacher_raw,
        path: HeadPath,
        temperature: float,
        entropy: bool,
        logp_mean: bool,
        kd_temperature: float,
    ):
        ctx.set_materialize_grads(False)
        ids = masked_ids(path.masked, raw.device)
        rescaled = (temperature > 0 and temperature != 1.0) or teacher_raw is not None or ids is not None
        z = _transform(raw, path, reuse=not rescaled)  # (N, V); ``raw`` itself when it is only read
        if temperature > 0 and temperature != 1.0:
            z.div_(temperature)
        z_sum = (z.sum(-1) - (0 if ids is None else z.index_select(-1, ids).sum(-1))) if logp_mean else None
        if ids is not None:
            z.index_fill_(-1, ids, MASKED_LOGIT)  # never sampled: π = 0 there
        lse, p = _log_softmax_parts(z)  # (N,), (N, V)
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (N,)
        ent = (lse - dot(p, z)) if entropy else None  # H = lse − Σ π z
        # (1/V') Σ_{v kept} log π(v) = Σ z / V' − lse
        mean = (z_sum / (z.shape[-1] - len(path.masked)) - lse) if logp_mean else None
        del p
        kl = lse_kd = None
        if teacher_raw is not None:
            z.mul_(temperature if temperature > 0 else 1.0).div_(kd_temperature)  # the student's z / τ
            lse_kd, _ = _log_softmax_parts(z)
            log_q = _transform(teacher_raw, path).div_(kd_temperature)  # (N, V)
            if ids is not None:
                log_q.index_fill_(-1, ids, MASKED_LOGIT)
            lse_q, q = _log_softmax_parts(log_q)
            log_q.sub_(lse_q.unsqueeze(-1))
            # KL = Σ q log q − Σ q (z_S − lse_S)
            kl = dot(q, log_q) - dot(q, z) + lse_kd
        ctx.save_for_backward(
            raw, targets, teacher_raw, lse, ent if ent is not None else lse, lse_kd if lse_kd is not None else lse
        )
        ctx.path, ctx.temperature, ctx.kd_temperature = path, temperature, kd_temperature
        return logp, ent, mean, kl

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_mean, g_kl):
        raw, targets, teacher_raw, lse, ent, lse_kd = ctx.saved_tensors
        path, t, tau = ctx.path, (ctx.temperature if ctx.temperature > 0 else 1.0), ctx.kd_temperature
        N, V = raw.shape
        zeros = torch.zeros(N, device=raw.device)
        g_logp = zeros if g_logp is None else g_logp.float()
        g_mean = zeros if g_mean is None else g_mean.float()
        ids = masked_ids(path.masked, raw.device)
        # ``raw`` (recomputed for this backward) is overwritten when nothing below reads it again
        z = _transform(raw, path, reuse=teacher_raw is None)  # (N, V)
        if t != 1.0:
            z.div_(t)
        if ids is not None:
            z.index_fill_(-1, ids, MASKED_LOGIT)
        log_p = z.sub_(lse.unsqueeze(-1))  # (N, V) log π, in place
        grad = log_p.exp()  # (N, V) π, becomes the gradient
        coef = (g_logp + g_mean).unsqueeze(-1)  # (N, 1)
        if g_entropy is not None:
            # −π (g_H (log π + H) + g_logp + g_mean)
            log_p.add_(ent.unsqueeze(-1)).mul_(g_entropy.float().unsqueeze(-1)).add_(coef)
            grad.mul_(log_p).neg_()
        else:
            grad.mul_(coef).neg_()  # −π (g_logp + g_mean)
        del log_p, z
        grad[torch.arange(N, device=raw.device), targets] += g_logp  # + g_logp e_y
        grad.add_((g_mean / (V - len(path.masked))).unsqueeze(-1))  # + g_mean / V'
        grad.div_(t)
        if g_kl is not None and teacher_raw is not None:
            # + g_KL (π^τ − q) / τ
            z_kd = _transform(raw, path).div_(tau)
            if ids is not None:
                z_kd.index_fill_(-1, ids, MASKED_LOGIT)
            p_kd = z_kd.sub_(lse_kd.unsqueeze(-1)).exp_()  # (N, V)
            grad.addcmul_(p_kd, (g_kl.float() / tau).unsqueeze(-1))
            del p_kd, z_kd
            z_q = _transform(teacher_raw, path).div_(tau)
            if ids is not None:
                z_q.index_fill_(-1, ids, MASKED_LOGIT)
            lse_q, q = _log_softmax_parts(z_q)
            del z_q
            grad.addcmul_(q, (g_kl.float() / tau).unsqueeze(-1), value=-1.0)
            del q
        if ids is not None:
            grad.index_fill_(-1, ids, 0.0)  # a masked logit is a constant: no gradient
        if path.softcap:
            # z = c·tanh(s·raw / c): ∂z/∂(s·raw) = 1 − tanh²
            tanh = (raw.float() * path.scale).div_(path.softcap).tanh_()
            grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
            del tanh
        if path.scale != 1.0:
            grad.mul_(path.scale)
        return grad.to(raw.dtype), None, None, None, None, None, None, None


def _chunk_stats(h, targets, h_teacher, head, teacher_head, path, temperature, entropy, logp_mean, kd_temperature):
    raw = head(h)  # (N, V) logits of this chunk only
    teacher_raw = None
    if h_teacher is not None:
        with torch.no_grad():
            teacher_raw = teacher_head(h_teacher)
    return _SoftmaxStats.apply(raw, targets, teacher_raw, path, temperature, entropy, logp_mean, kd_temperature)


# ----------------------------------------------------------------------------- the entry point


def _gathers_each_call(head) -> bool:
    """Whether each call of ``head`` gathers its weight from every rank: a ZeRO-3 partitioned weight, several
    ranks, and DeepSpeed's hooks in place — not inside ``engine.full_weights()``, where the weight is whole, the
    hooks are off and ranks may run different code (rank 0 evaluating alone)."""
    weight = getattr(head, "weight", None)
    return hasattr(weight, "ds_id") and distributed.world_size() > 1 and not distributed.in_local_section()


def _chunk_count(tokens: int, chunk_size: int, head) -> int:
    """Chunks for ``tokens``; where each call of the head is a collective (`_gathers_each_call`) the most any
    rank needs, so that every rank calls the head equally often (the extra chunks are empty)."""
    count = -(-tokens // chunk_size)
    if _gathers_each_call(head):
        count = int(distributed.max_over_ranks(count))
    return count


def head_stats(
    h,
    targets,
    head,
    path: HeadPath,
    temperature: float = 0.0,
    entropy: bool = False,
    logp_mean: bool = False,
    h_teacher=None,
    teacher_head=None,
    kd_temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """`stats_from_logits` of ``transform(head(h))``: by weight tiles where ``head`` (and a teacher's) can be
    tiled (`_tileable`), else ``path.chunk_size`` rows of ``h`` (M, H) at a time through the module."""
    weights, teacher_weights = _tileable(head), (None if teacher_head is None else _tileable(teacher_head))
    if weights is not None and (h_teacher is None or teacher_weights is not None):
        return tiled_stats(
            h, targets, weights, path, temperature, entropy, logp_mean, h_teacher, teacher_weights, kd_temperature
        )
    return _module_stats(
        h, targets, head, path, temperature, entropy, logp_mean, h_teacher, teacher_head, kd_temperature
    )


def _tileable(head) -> tuple | None:
    """(weight, bias) of a head the tiled path may compute by its weight: exactly ``nn.Linear`` (a subclass or a
    PEFT layer may compute something else), no hooks (offloading, DeepSpeed's), a weight this process holds
    whole (not a ZeRO-3 partition); None otherwise."""
    if type(head) is not torch.nn.Linear or head._forward_hooks or head._forward_pre_hooks:
        return None
    if hasattr(head.weight, "ds_id") or head.weight.dim() != 2:
        return None
    return head.weight, head.bias


def _module_stats(h, targets, head, path, temperature, entropy, logp_mean, h_teacher, teacher_head, kd_temperature):
    """The module path: ``head`` called ``path.chunk_size`` rows at a time, each chunk's logits recomputed in
    backward (activation checkpointing)."""
    head_params = [p for p in head.parameters() if p.requires_grad]
    recompute = torch.is_grad_enabled() and (h.requires_grad or bool(head_params))
    parts: list[tuple] = []
    n = path.chunk_size
    count = _chunk_count(h.shape[0], n, head)
    for k in range(count):
        args = (
            h[k * n : (k + 1) * n],
            targets[k * n : (k + 1) * n],
            None if h_teacher is None else h_teacher[k * n : (k + 1) * n],
            head,
            teacher_head,
            path,
            temperature,
            entropy,
            logp_mean,
            kd_temperature,
        )
        # Backward recomputes each chunk's logits instead of keeping them, but the last chunk's: backward needs
        # those first (one recompute fewer); they are held only while the loss is built (with DPO: the reference's
        # forward). (No metadata check of the recomputed tensors: ZeRO-3
        # re-partitions a frozen lm_head weight (LoRA) right after the recompute, which the check would take for a
        # different tensor; the values are the same — tests/test_deepspeed.py, LoRA under ZeRO-3.)
        if recompute and k < count - 1:
            parts.append(checkpoint(_chunk_stats, *args, use_reentrant=False, determinism_check="none"))
        else:
            parts.append(_chunk_stats(*args))
    out = {}
    names = (("logp", True), ("entropy", entropy), ("logp_mean", logp_mean), ("kl_teacher", h_teacher is not None))
    for i, (name, wanted) in enumerate(names):
        if wanted:
            out[name] = torch.cat([p[i] for p in parts]) if parts else h.new_zeros(0, dtype=torch.float32) * h.sum()
    return out


def token_stats(
    model,
    inputs: dict,
    rows: torch.Tensor,
    pos: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 0.0,
    entropy: bool = False,
    logp_mean: bool = False,
    teacher=None,
    kd_temperature: float = 1.0,
    hidden: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token quantities at the scored positions, by the path chosen for ``model`` (`choose_path`).

    inputs: the model's keyword inputs ((R, T) rows, packed or padded); ``rows``, ``pos`` (M,): the
    positions whose next-token distribution is scored (repeats allowed), ``targets`` (M,) the token
    scored there. Returns ``logp`` (M,) and, as asked (see `stats_from_logits`), ``entropy``,
    ``logp_mean``, ``kl_teacher`` (M,) — ``teacher`` given: the KD teacher, run on the same inputs
    without gradients — and ``hidden`` (R, T, H), the last hidden state (a critic's input).
    """
    path = path_of(model)
    if teacher is not None and not path_of(teacher).chunked:
        path = PLAIN  # both heads go through the same path
    if not path.chunked:
        return _plain_stats(
            model, inputs, rows, pos, targets, temperature, entropy, logp_mean, teacher, kd_temperature, hidden
        )

    backbone, head = backbone_and_head(model)
    last = backbone(**inputs, use_cache=False).last_hidden_state  # (R, T, H)
    h = last[rows, pos]  # (M, H): only the scored positions meet the head
    h_teacher, teacher_head = None, None
    if teacher is not None:
        teacher_backbone, teacher_head = backbone_and_head(teacher)
        with torch.no_grad():
            h_teacher = teacher_backbone(**inputs, use_cache=False).last_hidden_state[rows, pos]  # (M, H_T)
    out = head_stats(h, targets, head, path, temperature, entropy, logp_mean, h_teacher, teacher_head, kd_temperature)
    if hidden:
        out["hidden"] = last
    return out


def _plain_stats(model, inputs, rows, pos, targets, temperature, entropy, logp_mean, teacher, kd_temperature, hidden):
    """The model's own forward and full logits at every position (this path is chosen where they are small, or
    as the fallback), read at the scored ones — no data-dependent selection of positions, so no device read."""
    out = model(**inputs, use_cache=False, output_hidden_states=hidden)
    logits = out.logits[rows, pos]  # (M, V)
    teacher_logits = None
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher(**inputs, use_cache=False).logits[rows, pos]
    masked = path_of(model).masked
    stats = stats_from_logits(
        logits, targets, temperature, entropy, logp_mean, teacher_logits, kd_temperature, masked=masked
    )
    if hidden:
        stats["hidden"] = out.hidden_states[-1]
    return stats


def on_grid(values: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(M,) values at (rows, pos) -> a (B, T) tensor, 0 elsewhere (gradients flow to ``values``)."""
    return values.new_zeros(shape).index_put((rows, pos), values)
