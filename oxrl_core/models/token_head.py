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
∂L/∂h and ∂L/∂W (and ∂L/∂b) in float32 (`_TiledHead`); the weight is cast one tile at a time.
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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from oxrl_core.engines import distributed

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
    model, chunk_size: int, log=None, *, tokens: int | None = None, min_mb: float = 0.0, vocab_tile: int = 8192
) -> HeadPath:
    """Decide, once, how this model's per-token quantities are computed; `path_of` returns the decision.

    ``tokens``: the most tokens one micro-batch can score. The chunked head is wanted when
    ``chunk_size > 0`` and the full float32 logits of those tokens would exceed ``min_mb``
    (``tokens`` not given: whenever ``chunk_size > 0``). Then a probe (a few tokens, fp32, no
    autocast) compares the chunked head's log-probabilities with ``log_softmax(model(...).logits)``;
    where they differ, or the model has no backbone/head to call, the plain path is used and ``log``
    gets a note saying why."""
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
    _PATHS[model] = path
    return path


def path_of(model) -> HeadPath:
    """The path `choose_path` chose for ``model`` (the plain one when none was chosen)."""
    return _PATHS.get(model, PLAIN)


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
) -> dict[str, torch.Tensor]:
    """The per-token quantities from full logits with autograd (the plain path, and the reference).

    logits (M, V) as the model returns them, targets (M,) ->
      logp (M,)        log π(y) at ``temperature`` (> 0: logits / temperature; 0: the raw ones)
      entropy (M,)     H = −Σ_v π(v) log π(v), same distribution
      logp_mean (M,)   (1/V) Σ_v log π(v), same distribution (label smoothing)
      kl_teacher (M,)  KL(p_T^τ ‖ p_S^τ) = Σ_v p_T^τ(v) (log p_T^τ(v) − log p_S^τ(v)), τ = ``kd_temperature``
    """
    z = logits.float()  # (M, V)
    if temperature > 0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)  # (M, V)
    out = {"logp": logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)}
    if entropy:
        out["entropy"] = -(logp_all.exp() * logp_all).sum(-1)
    if logp_mean:
        out["logp_mean"] = logp_all.mean(-1)
    if teacher_logits is not None:
        logp_student = torch.log_softmax(logits.float() / kd_temperature, dim=-1)  # (M, V)
        logp_teacher = torch.log_softmax(teacher_logits.detach().float() / kd_temperature, dim=-1)  # (M, V)
        out["kl_teacher"] = (logp_teacher.exp() * (logp_teacher - logp_student)).sum(-1)
    return out


# ----------------------------------------------------------------------------- the maths, one chunk


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a_v b_v per row, (N, V) × (N, V) -> (N,), without an (N, V) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


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
        rescaled = (temperature > 0 and temperature != 1.0) or teacher_raw is not None
        z = _transform(raw, path, reuse=not rescaled)  # (N, V); ``raw`` itself when it is only read
        if temperature > 0 and temperature != 1.0:
            z.div_(temperature)
        lse, p = _log_softmax_parts(z)  # (N,), (N, V)
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (N,)
        ent = (lse - _dot(p, z)) if entropy else None  # H = lse − Σ π z
        mean = (z.mean(-1) - lse) if logp_mean else None
        del p
        kl = lse_kd = None
        if teacher_raw is not None:
            z.mul_(temperature if temperature > 0 else 1.0).div_(kd_temperature)  # the student's z / τ
            lse_kd, _ = _log_softmax_parts(z)
            log_q = _transform(teacher_raw, path).div_(kd_temperature)  # (N, V)
            lse_q, q = _log_softmax_parts(log_q)
            log_q.sub_(lse_q.unsqueeze(-1))
            # KL = Σ q log q − Σ q (z_S − lse_S)
            kl = _dot(q, log_q) - _dot(q, z) + lse_kd
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
        # ``raw`` (recomputed for this backward) is overwritten when nothing below reads it again
        z = _transform(raw, path, reuse=teacher_raw is None)  # (N, V)
        if t != 1.0:
            z.div_(t)
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
        grad.add_((g_mean / V).unsqueeze(-1))  # + g_mean / V
        grad.div_(t)
        if g_kl is not None and teacher_raw is not None:
            # + g_KL (π^τ − q) / τ
            z_kd = _transform(raw, path).div_(tau)
            p_kd = z_kd.sub_(lse_kd.unsqueeze(-1)).exp_()  # (N, V)
            grad.addcmul_(p_kd, (g_kl.float() / tau).unsqueeze(-1))
            del p_kd, z_kd
            z_q = _transform(teacher_raw, path).div_(tau)
            lse_q, q = _log_softmax_parts(z_q)
            del z_q
            grad.addcmul_(q, (g_kl.float() / tau).unsqueeze(-1), value=-1.0)
            del q
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


# ----------------------------------------------------------------------------- the maths, tiled by weight


@dataclass(frozen=True)
class _Spec:
    """What one `_TiledHead` call computes, and how."""

    tokens: int  # rows of h per tile
    vocab: int  # vocabulary entries per tile
    dtype: torch.dtype  # the compute dtype: autocast's, else the weight's (h and W are rounded to it)
    tile_dtype: torch.dtype  # the tile buffer's and its products' (`_tile_dtype`)
    scale: float  # z = scale · raw (then soft-capped)
    softcap: float | None
    temperature: float  # log π at this temperature (1.0 = the raw distribution)
    entropy: bool
    logp_mean: bool
    kd_temperature: float


def _tile_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the logits tile is computed and held in. On CUDA the compute dtype (bf16 tensor cores; backward
    writes the gradient over the tile and multiplies it there, accumulating in float32). On a CPU float32, from
    the inputs rounded to the compute dtype — the same products as autocast's but for the output's rounding: a
    CPU's bf16 products are slower than its float32 ones, and its float32 gradient tile then feeds backward's
    products directly (no pass writing it into a bf16 buffer)."""
    return dtype if device.type == "cuda" else torch.float32


class _Online:
    """The online softmax over vocabulary tiles (Milakov & Gimelshein, 2018): the running max m, Σ e^{z−m} and,
    for each tile tensor x given, Σ e^{z−m}·x — rescaled by e^{m_old − m_new} whenever the max grows."""

    def __init__(self, n: int, device, dots: int = 0):
        self.m = torch.full((n,), float("-inf"), device=device)  # (n,)
        self.s = torch.zeros(n, device=device)  # (n,)
        self.dots = [torch.zeros(n, device=device) for _ in range(dots)]  # (n,) each

    def add(self, z: torch.Tensor, work: torch.Tensor, *xs: torch.Tensor) -> None:
        """Fold one (n, v) float32 tile ``z``; ``work`` (n, v) is overwritten (it may be ``z`` itself when no
        ``xs`` are given)."""
        m_new = torch.maximum(self.m, z.amax(1))  # (n,)
        alpha = torch.exp(self.m - m_new)  # (n,): 0 on the first tile
        e = torch.sub(z, m_new.unsqueeze(1), out=work).exp_()  # (n, v)
        self.s = self.s * alpha + e.sum(1)
        # Σ e·x: the last one multiplies e in place (one pass fewer than a batched dot product on a CPU)
        sums = [_dot(e, x) for x in xs[:-1]] + ([e.mul_(xs[-1]).sum(1)] if xs else [])
        self.dots = [d * alpha + dot for d, dot in zip(self.dots, sums)]
        self.m = m_new

    def lse(self) -> torch.Tensor:
        return self.m + self.s.log()  # (n,)


class _Tiles:
    """The buffers of one call: ``raw`` (one tile in the compute dtype; a teacher gets its own) and float32 work
    tiles, allocated once and viewed at each tile's shape."""

    def __init__(self, spec: _Spec, n: int, device, work: int, teacher: bool):
        size = min(n, spec.tokens) * spec.vocab
        self.raw = torch.empty(size, dtype=spec.tile_dtype, device=device)
        self.raw_teacher = torch.empty(size, dtype=spec.tile_dtype, device=device) if teacher else None
        self.work = [torch.empty(size, device=device) for _ in range(work)]

    @staticmethod
    def view(buffer: torch.Tensor, n: int, v: int) -> torch.Tensor:
        return buffer[: n * v].view(n, v)


def _logits_tile(buffer, h, w, bias, v0: int, v1: int) -> torch.Tensor:
    """raw = h · wᵀ (+ b[v0:v1]) for the weight tile ``w`` (v, H), written into ``buffer`` (n, v) in the compute
    dtype."""
    raw = _Tiles.view(buffer, h.shape[0], v1 - v0)
    if bias is None:
        return torch.mm(h, w.t(), out=raw)
    return torch.addmm(bias[v0:v1].to(w.dtype), h, w.t(), out=raw)


def _rounded(x: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """``x`` rounded to the compute dtype, held in the tile's dtype."""
    return x.to(spec.dtype).to(spec.tile_dtype)


def _transformed(raw: torch.Tensor, out: torch.Tensor, spec: _Spec, divisor: float) -> torch.Tensor:
    """z = transform(raw) / divisor in float32, into ``out`` (``raw`` itself: in place): scale·raw, or
    c·tanh(scale·raw / c) soft-capped."""
    z = out if out is raw else out.copy_(raw)
    if spec.softcap:
        return z.mul_(spec.scale / spec.softcap).tanh_().mul_(spec.softcap / divisor)
    if spec.scale / divisor != 1.0:
        z.mul_(spec.scale / divisor)
    return z


def _target_logit(z: torch.Tensor, targets: torch.Tensor, v0: int) -> torch.Tensor:
    """z[i, y_i − v0] where the target lies in this tile, 0 elsewhere: (n,)."""
    local = targets - v0  # (n,)
    inside = (local >= 0) & (local < z.shape[1])
    return torch.where(inside, z.gather(1, local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1), 0.0)


def _add_at_targets(grad: torch.Tensor, targets: torch.Tensor, v0: int, values: torch.Tensor) -> None:
    """grad[i, y_i − v0] += values[i] where the target lies in this tile."""
    local = targets - v0
    inside = (local >= 0) & (local < grad.shape[1])
    grad.scatter_add_(1, local.clamp(0, grad.shape[1] - 1).unsqueeze(1), torch.where(inside, values, 0.0).unsqueeze(1))


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, ``acc`` float32: exact float32 products for float32 inputs; for low-precision ones the
    device's float32-output product where it has one (CUDA), else one rounding of this tile's product (never of
    the running sum)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b.float())
    elif _has_fp32_output_mm(a.device):
        torch.addmm(acc, a, b.to(a.dtype), out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b.to(a.dtype))


_FP32_OUTPUT_MM: dict[str, bool] = {}


def _has_fp32_output_mm(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` runs on bf16 inputs on this device (asked once)."""
    if device.type not in _FP32_OUTPUT_MM:
        try:
            x = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            torch.addmm(torch.zeros(2, 2, device=device), x, x, out_dtype=torch.float32)
            _FP32_OUTPUT_MM[device.type] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUTPUT_MM[device.type] = False
    return _FP32_OUTPUT_MM[device.type]


class _TiledHead(torch.autograd.Function):
    """logp, entropy, logp_mean, kl_teacher (M,) of ``transform(h Wᵀ + b)``, one token × vocabulary tile at a time.

    Forward (per row tile, over the vocabulary tiles): z = transform(raw)/t, folded online into m, s, Σ e·z
    (`_Online`), Σ z and z_y. Backward recomputes each tile and writes, with π = e^{z − lse},
        ∂L/∂z = g_logp (1_y − π) + g_mean (1/V − π) − g_H π (log π + H)     (then / t)
              + g_KL (π^τ − q) / τ                                          (KD, τ its temperature)
        ∂L/∂raw = ∂L/∂z · scale · (1 − tanh²(scale·raw / c))                (the soft-cap's chain rule)
    and accumulates ∂L/∂h += ∂L/∂raw · W, ∂L/∂W += ∂L/∂rawᵀ · h, ∂L/∂b += Σ ∂L/∂raw in float32.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, teacher, spec: _Spec):
        ctx.set_materialize_grads(False)
        M, V = h.shape[0], weight.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            outputs = _tiled_forward(h, weight, bias, targets, teacher, spec, M, V)
        logp, ent, mean, kl, lse, lse_kd = outputs  # lse_kd: (2, M), the student's and the teacher's at τ
        ctx.save_for_backward(h, weight, bias, targets, lse, ent, lse_kd)
        ctx.teacher, ctx.spec = teacher, spec
        return logp, ent, mean, kl

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_mean, g_kl):
        h, weight, bias, targets, lse, ent, lse_kd = ctx.saved_tensors
        spec, teacher = ctx.spec, ctx.teacher
        with torch.autocast(h.device.type, enabled=False):
            grads = _tiled_backward(
                h, weight, bias, targets, teacher, spec, lse, ent, lse_kd, g_logp, g_entropy, g_mean, g_kl, ctx
            )
        return (*grads, None, None, None)


def _row_tiles(M: int, spec: _Spec) -> list[slice]:
    return [slice(r0, min(r0 + spec.tokens, M)) for r0 in range(0, M, spec.tokens)]


def _vocab_tiles(V: int, spec: _Spec):
    """(v0, v1) of each vocabulary tile."""
    return [(v0, min(v0 + spec.vocab, V)) for v0 in range(0, V, spec.vocab)]


def _tiled_forward(h, weight, bias, targets, teacher, spec: _Spec, M: int, V: int):
    """The vocabulary tiles in the outer loop (each weight tile is cast once), the row tiles inside, each with its
    own running folds."""
    device, t, tau = h.device, spec.temperature, spec.kd_temperature
    tiles = _Tiles(spec, M, device, work=(4 if teacher else 2 if spec.entropy else 1), teacher=teacher is not None)
    rows = _row_tiles(M, spec)
    hc = _rounded(h.detach(), spec)  # (M, H)
    h_q = None if teacher is None else _rounded(teacher[0], spec)  # (M, H_T)
    fold = [_Online(r.stop - r.start, device, dots=1 if spec.entropy else 0) for r in rows]
    fold_kd = [_Online(r.stop - r.start, device) for r in rows] if teacher is not None else None
    fold_q = [_Online(r.stop - r.start, device, dots=2) for r in rows] if teacher is not None else None
    z_y, z_sum = torch.zeros(M, device=device), torch.zeros(M, device=device)
    for v0, v1 in _vocab_tiles(V, spec):
        w = _rounded(weight[v0:v1], spec)  # (v, H): the weight cast one tile at a time
        w_q = None if teacher is None else _rounded(teacher[1][v0:v1], spec)
        for i, r in enumerate(rows):
            n = r.stop - r.start
            raw = _logits_tile(tiles.raw, hc[r], w, bias, v0, v1)  # (n, v)
            work = [_Tiles.view(buffer, n, v1 - v0) for buffer in tiles.work]
            z = _transformed(raw, raw if raw.dtype == torch.float32 else work[0], spec, t)  # (n, v) float32
            z_y[r] += _target_logit(z, targets[r], v0)
            if spec.logp_mean:
                z_sum[r] += z.sum(1)
            if teacher is not None:
                z_kd = torch.mul(z, t / tau, out=work[2])  # the student's transform(raw) / τ
                fold_kd[i].add(z_kd, work[1])
                raw_q = _logits_tile(tiles.raw_teacher, h_q[r], w_q, teacher[2], v0, v1)
                z_q = _transformed(raw_q, work[3], spec, tau)  # the teacher's transform(raw) / τ
                fold_q[i].add(z_q, work[1], z_q, z_kd)  # Σ e_q z_q, Σ e_q z_kd
            if spec.entropy:
                fold[i].add(z, work[1], z)  # Σ e z
            else:
                fold[i].add(z, z)
    lse = torch.cat([f.lse() for f in fold])  # (M,)
    # log π(y) = z_y − lse
    logp = z_y - lse
    # H = −Σ π log π = lse − Σ π z
    ent = lse - torch.cat([f.dots[0] / f.s for f in fold]) if spec.entropy else None
    # (1/V) Σ_v log π(v) = Σ z / V − lse
    mean = z_sum / V - lse if spec.logp_mean else None
    kl = lse_kd = None
    if teacher is not None:
        # KL(q ‖ π^τ) = Σ q log q − Σ q log π^τ = (Σ q z_q − lse_q) − (Σ q z_kd − lse_kd)
        lse_kd = torch.stack([torch.cat([f.lse() for f in fold_kd]), torch.cat([f.lse() for f in fold_q])])  # (2, M)
        kl = torch.cat([(f.dots[0] - f.dots[1]) / f.s for f in fold_q]) - lse_kd[1] + lse_kd[0]
    return logp, ent, mean, kl, lse, lse_kd


def _tiled_backward(h, weight, bias, targets, teacher, spec, lse, ent, lse_kd, g_logp, g_ent, g_mean, g_kl, ctx):
    M, V = h.shape[0], weight.shape[0]
    device, t, tau = h.device, spec.temperature, spec.kd_temperature
    want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    g_kl = g_kl if teacher is not None else None
    zeros = torch.zeros(M, device=device)
    g_logp = zeros if g_logp is None else g_logp.float()
    g_mean = zeros if g_mean is None or not spec.logp_mean else g_mean.float()
    coef = (g_logp + g_mean).unsqueeze(1)  # (M, 1)
    tiles = _Tiles(spec, M, device, work=3 if g_kl is not None else 2, teacher=g_kl is not None)
    hc = _rounded(h.detach(), spec)  # (M, H)
    h_q = None if g_kl is None else _rounded(teacher[0], spec)
    in_place = spec.tile_dtype == torch.float32 and not spec.softcap and g_kl is None  # raw is not read again
    grad_h = torch.zeros(M, h.shape[1], device=device) if want_h else None  # float32
    grad_w = torch.zeros(V, h.shape[1], device=device) if want_w else None  # float32
    grad_b = torch.zeros(V, device=device) if want_b else None
    for v0, v1 in _vocab_tiles(V, spec):
        w = _rounded(weight[v0:v1], spec)  # (v, H)
        w_q = None if g_kl is None else _rounded(teacher[1][v0:v1], spec)
        for r in _row_tiles(M, spec):
            n = r.stop - r.start
            raw = _logits_tile(tiles.raw, hc[r], w, bias, v0, v1)  # (n, v)
            work = [_Tiles.view(buffer, n, v1 - v0) for buffer in tiles.work]
            log_p = _transformed(raw, raw if in_place else work[0], spec, t).sub_(lse[r].unsqueeze(1))  # (n, v) log π
            grad = torch.exp(log_p, out=work[1])  # (n, v) π, becomes ∂L/∂z
            if g_ent is not None:
                # −π (g_H (log π + H) + g_logp + g_mean)
                log_p.add_(ent[r].unsqueeze(1)).mul_(g_ent[r].float().unsqueeze(1)).add_(coef[r])
                grad.mul_(log_p).neg_()
            else:
                grad.mul_(coef[r]).neg_()  # −π (g_logp + g_mean)
            _add_at_targets(grad, targets[r], v0, g_logp[r])  # + g_logp 1_y
            if spec.logp_mean:
                grad.add_((g_mean[r] / V).unsqueeze(1))  # + g_mean / V
            if t != 1.0:
                grad.div_(t)
            if g_kl is not None:
                # + g_KL (π^τ − q) / τ
                g = (g_kl[r].float() / tau).unsqueeze(1)  # (n, 1)
                p_kd = _transformed(raw, work[0], spec, tau).sub_(lse_kd[0, r].unsqueeze(1)).exp_()  # π^τ
                grad.addcmul_(p_kd, g)
                raw_q = _logits_tile(tiles.raw_teacher, h_q[r], w_q, teacher[2], v0, v1)
                q = _transformed(raw_q, work[2], spec, tau).sub_(lse_kd[1, r].unsqueeze(1)).exp_()
                grad.addcmul_(q, g, value=-1.0)
            if spec.softcap:
                # z = c·tanh(s·raw / c): ∂z/∂(s·raw) = 1 − tanh²
                tanh = torch.mul(raw, spec.scale / spec.softcap, out=work[0]).tanh_()
                grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
            if spec.scale != 1.0:
                grad.mul_(spec.scale)
            if raw.dtype != torch.float32:
                grad = raw.copy_(grad)  # ∂L/∂raw written over the tile, in its low precision
            if want_h:
                _accumulate(grad_h[r], grad, w)  # ∂L/∂h += ∂L/∂raw · W
            if want_w:
                _accumulate(grad_w[v0:v1], grad.t(), hc[r])  # ∂L/∂W += ∂L/∂rawᵀ · h
            if want_b:
                grad_b[v0:v1] += grad.sum(0, dtype=torch.float32)
    return (
        None if grad_h is None else grad_h.to(h.dtype),
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(bias.dtype),
    )


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
        return _tiled_stats(
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


def _tiled_stats(h, targets, weights, path, temperature, entropy, logp_mean, h_teacher, teacher_weights, kd_temp):
    weight, bias = weights
    device = h.device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else weight.dtype
    spec = _Spec(
        tokens=path.chunk_size,
        vocab=path.vocab_tile,
        dtype=dtype,
        scale=path.scale,
        softcap=path.softcap,
        temperature=temperature if temperature > 0 else 1.0,
        entropy=entropy,
        logp_mean=logp_mean,
        kd_temperature=kd_temp,
        tile_dtype=_tile_dtype(device, dtype),
    )
    teacher = None if h_teacher is None else (h_teacher.detach(), *teacher_weights)
    logp, ent, mean, kl = _TiledHead.apply(h, weight, bias, targets, teacher, spec)
    out = {"logp": logp}
    if entropy:
        out["entropy"] = ent
    if logp_mean:
        out["logp_mean"] = mean
    if h_teacher is not None:
        out["kl_teacher"] = kl
    return out


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
    stats = stats_from_logits(logits, targets, temperature, entropy, logp_mean, teacher_logits, kd_temperature)
    if hidden:
        stats["hidden"] = out.hidden_states[-1]
    return stats


def on_grid(values: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(M,) values at (rows, pos) -> a (B, T) tensor, 0 elsewhere (gradients flow to ``values``)."""
    return values.new_zeros(shape).index_put((rows, pos), values)
