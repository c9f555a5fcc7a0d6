"""The LM head's tiled path (`token_head`): per-token quantities computed by the head's weight, one token ×
vocabulary tile at a time, with a hand-written backward (`_TiledHead`). `token_head` chooses the path and holds
the module path and the plain maths; this module is the tiled maths alone, which needs nothing of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a_v b_v per row, (N, V) × (N, V) -> (N,), without an (N, V) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


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
    masked: tuple[int, ...] = ()  # never-sampled token ids (`token_head.HeadPath.masked`)


#: the logit of a never-sampled token (`token_head.HeadPath.masked`): exp(MASKED_LOGIT − max) is 0 in float32, as
#: -inf's is, and finite, so π·z is 0 there rather than NaN
MASKED_LOGIT = -1e9

_MASK_IDS: dict[tuple, torch.Tensor] = {}


def masked_ids(masked: tuple[int, ...], device) -> torch.Tensor | None:
    """The never-sampled ids as a (k,) long tensor on ``device``, made once per device (no copy per step); None
    when there are none."""
    if not masked:
        return None
    key = (masked, str(device))
    if key not in _MASK_IDS:
        _MASK_IDS[key] = torch.tensor(masked, dtype=torch.long, device=device)
    return _MASK_IDS[key]


def _masked_in(spec: _Spec, v0: int, v1: int, device) -> torch.Tensor | None:
    """The never-sampled ids inside the vocabulary tile [v0, v1), as indices into the tile (a tensor made once per
    tile and device, from the ids on the host: no device read in the loop); None when none are."""
    local = tuple(i - v0 for i in spec.masked if v0 <= i < v1)
    return masked_ids(local, device)


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
        sums = [dot(e, x) for x in xs[:-1]] + ([e.mul_(xs[-1]).sum(1)] if xs else [])
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
        masked = _masked_in(spec, v0, v1, device)
        for i, r in enumerate(rows):
            n = r.stop - r.start
            raw = _logits_tile(tiles.raw, hc[r], w, bias, v0, v1)  # (n, v)
            work = [_Tiles.view(buffer, n, v1 - v0) for buffer in tiles.work]
            z = _transformed(raw, raw if raw.dtype == torch.float32 else work[0], spec, t)  # (n, v) float32
            if spec.logp_mean:  # Σ z over the kept tokens
                z_sum[r] += z.sum(1) - (0 if masked is None else z.index_select(1, masked).sum(1))
            if masked is not None:
                z.index_fill_(1, masked, MASKED_LOGIT)  # never sampled: π = 0 there
            z_y[r] += _target_logit(z, targets[r], v0)
            if teacher is not None:
                z_kd = torch.mul(z, t / tau, out=work[2])  # the student's transform(raw) / τ
                fold_kd[i].add(z_kd, work[1])
                raw_q = _logits_tile(tiles.raw_teacher, h_q[r], w_q, teacher[2], v0, v1)
                z_q = _transformed(raw_q, work[3], spec, tau)  # the teacher's transform(raw) / τ
                if masked is not None:
                    z_q.index_fill_(1, masked, MASKED_LOGIT)
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
    # (1/V') Σ_v log π(v) = Σ z / V' − lse, over the V' tokens not masked
    kept = V - len(spec.masked)
    mean = z_sum / kept - lse if spec.logp_mean else None
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
    kept = V - len(spec.masked)
    for v0, v1 in _vocab_tiles(V, spec):
        w = _rounded(weight[v0:v1], spec)  # (v, H)
        w_q = None if g_kl is None else _rounded(teacher[1][v0:v1], spec)
        masked = _masked_in(spec, v0, v1, device)
        for r in _row_tiles(M, spec):
            n = r.stop - r.start
            raw = _logits_tile(tiles.raw, hc[r], w, bias, v0, v1)  # (n, v)
            work = [_Tiles.view(buffer, n, v1 - v0) for buffer in tiles.work]
            z = _transformed(raw, raw if in_place else work[0], spec, t)
            if masked is not None:
                z.index_fill_(1, masked, MASKED_LOGIT)
            log_p = z.sub_(lse[r].unsqueeze(1))  # (n, v) log π
            grad = torch.exp(log_p, out=work[1])  # (n, v) π, becomes ∂L/∂z
            if g_ent is not None:
                # −π (g_H (log π + H) + g_logp + g_mean)
                log_p.add_(ent[r].unsqueeze(1)).mul_(g_ent[r].float().unsqueeze(1)).add_(coef[r])
                grad.mul_(log_p).neg_()
            else:
                grad.mul_(coef[r]).neg_()  # −π (g_logp + g_mean)
            _add_at_targets(grad, targets[r], v0, g_logp[r])  # + g_logp 1_y
            if spec.logp_mean:
                grad.add_((g_mean[r] / kept).unsqueeze(1))  # + g_mean / V'
            if t != 1.0:
                grad.div_(t)
            if g_kl is not None:
                # + g_KL (π^τ − q) / τ
                g = (g_kl[r].float() / tau).unsqueeze(1)  # (n, 1)
                z_kd = _transformed(raw, work[0], spec, tau)
                if masked is not None:
                    z_kd.index_fill_(1, masked, MASKED_LOGIT)
                grad.addcmul_(z_kd.sub_(lse_kd[0, r].unsqueeze(1)).exp_(), g)  # π^τ
                raw_q = _logits_tile(tiles.raw_teacher, h_q[r], w_q, teacher[2], v0, v1)
                z_q = _transformed(raw_q, work[2], spec, tau)
                if masked is not None:
                    z_q.index_fill_(1, masked, MASKED_LOGIT)
                grad.addcmul_(z_q.sub_(lse_kd[1, r].unsqueeze(1)).exp_(), g, value=-1.0)  # q
            if spec.softcap:
                # z = c·tanh(s·raw / c): ∂z/∂(s·raw) = 1 − tanh²
                tanh = torch.mul(raw, spec.scale / spec.softcap, out=work[0]).tanh_()
                grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
            if spec.scale != 1.0:
                grad.mul_(spec.scale)
            if masked is not None:
                grad.index_fill_(1, masked, 0.0)  # a masked logit is a constant: no gradient
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


def tiled_stats(h, targets, weights, path, temperature, entropy, logp_mean, h_teacher, teacher_weights, kd_temp):
    """`token_head.head_stats` by weight tiles: ``weights`` (and a teacher's) the (weight, bias) of a head that
    `token_head._tileable` found the process may compute by its weight, ``path`` a `token_head.HeadPath`."""
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
        masked=path.masked,
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
