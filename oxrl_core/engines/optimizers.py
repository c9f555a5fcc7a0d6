"""The optimisers ``train.optimizer`` names, built for both engines by `build_optimizer`.

- ``adamw``: ``torch.optim.AdamW`` (the default): fp32 moment estimates, 8 bytes of state per fp32 parameter.
- ``adamw_bf16``: `AdamWBf16` below: the same update with both moment estimates stored in bf16, 4 bytes.
- ``adamw_8bit``: torchao's ``AdamW8bit`` (block-wise 8-bit moment estimates, about 2 bytes; a tensor with fewer
  than 4,096 elements keeps fp32 ones), where torchao is installed (`engines.check_optimizer` says so otherwise). Its update is ``torch.compile``d once per
  parameter shape on the first step (a C++ compiler on a CPU; minutes for a real model on a small CPU).
"""

from __future__ import annotations

import math

import torch

#: what ``train.optimizer`` accepts (the config's Literal lists the same)
OPTIMIZERS = ("adamw", "adamw_bf16", "adamw_8bit")


def build_optimizer(name: str, groups: list[dict], lr: float, seed: int = 0, fused: bool | None = None):
    """The optimiser ``name`` (one of `OPTIMIZERS`) over the parameter ``groups`` (`adamw_param_groups`).
    ``fused`` (adamw only): torch's one-kernel AdamW; ``seed``: adamw_bf16's rounding generator."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused)
    if name == "adamw_bf16":
        return AdamWBf16(groups, lr=lr, seed=seed)
    if name == "adamw_8bit":
        from torchao.optim import AdamW8bit  # lazy: an optional library, needed by this optimiser only

        return AdamW8bit(groups, lr=lr, weight_decay=0.0)  # each group brings its own weight decay
    raise ValueError(f"train.optimizer: unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")


def state_classes(name: str) -> list[type]:
    """The classes beyond tensors and containers that optimiser ``name``'s state dict holds: what reading it back
    from ``engine.pt`` must allow (`state_files.load_state_file`)."""
    if name == "adamw_8bit":
        from torchao.optim.subclass_8bit import OptimState8bit  # lazy: an optional library, this optimiser only

        return [OptimState8bit]
    return []


def state_bytes(optimizer) -> int:
    """Bytes of the optimiser's per-parameter state (moment estimates, step counters; a quantised state's codes
    and scales): what ``train.optimizer`` changes."""
    return sum(_nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def _nbytes(tensor: torch.Tensor) -> int:
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):  # a quantised state (torchao)
        names, _ = tensor.__tensor_flatten__()
        return sum(_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: to the neighbour above with probability (x − below) / (above −
    below), else to the one below, so E[round(x)] = x.

    bf16 is the top 16 bits of fp32. Adding a uniform random u ∈ [0, 2¹⁶) to the bit pattern and dropping the low 16
    bits carries into the kept bits exactly when u ≥ 2¹⁶ − (the dropped bits): with probability dropped / 2¹⁶. (On a
    negative number the bits count the magnitude, so it rounds away from zero with that probability, as it should.)
    """
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    kept = noise.add_(x.view(torch.int32)).bitwise_and_(-(1 << 16))  # -2¹⁶ = 0xFFFF0000: the top 16 bits
    return kept.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


class AdamWBf16(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter, 2019; ``torch.optim.AdamW``'s update and defaults) whose moment estimates m
    (``exp_avg``) and v (``exp_avg_sq``) are stored in bf16: 4 bytes of optimiser state per parameter instead of 8.

    Each step reads m and v into fp32, computes the whole update in fp32 (the parameter too, in its own dtype:
    fp32 master weights stay fp32), updates the parameter with the fp32 m and v, and stores them back in bf16. So
    the first step equals ``torch.optim.AdamW``'s; later ones differ by bf16's rounding of the stored moments.

    How each is rounded: bf16 keeps 8 significant bits, so a stored value moves only when its update is at least
    half the spacing to its neighbour, 2⁻⁹ to 2⁻⁸ of the value.

    - v ← β₂·v + (1 − β₂)·g², β₂ = 0.999, changes v by at most 0.1% downwards (g = 0): rounded to nearest, v could
      never decrease, and the step size would stall wherever gradients shrink. So v is stored with **stochastic
      rounding** (`round_to_bf16`): equal to the fp32 v in expectation, at one random 16-bit draw per element.
    - m ← β₁·m + (1 − β₁)·g, β₁ = 0.9, moves by a tenth of g − m, far above that threshold unless g is within a few
      tenths of a percent of m already; m is **rounded to nearest**. (Measured on the built-in task,
      docs/benchmarks.md: both moments stochastically rounded ended at 1.4–1.5× adamw's training loss at two seeds,
      either one alone within adamw's seed spread.)

    The draws come from the optimiser's own generator, seeded by ``seed`` and saved in its ``state_dict``, so a
    resumed run takes the same draws as an uninterrupted one. Large tensors are updated ``chunk`` elements at a
    time, which bounds the fp32 temporaries.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, seed=0, chunk=1 << 22):
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0 and lr >= 0 and eps >= 0 and weight_decay >= 0):
            raise ValueError(f"AdamWBf16: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed, self.chunk = seed, chunk
        self.generator: torch.Generator | None = None  # made on the parameters' device at the first step
        self._generator_state: torch.Tensor | None = None  # a loaded state waiting for that generator

    def _rounding_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
            if self._generator_state is not None:
                self.generator.set_state(self._generator_state)
        return self.generator

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
                state["step"] += 1
                t = state["step"].item()  # a CPU tensor: no device sync
                generator = self._rounding_generator(p.device)
                # the bias corrections 1 − β₁ᵗ, 1 − β₂ᵗ
                bias_correction1, bias_correction2 = 1 - beta1**t, 1 - beta2**t
                flat = zip(
                    p.view(-1).split(self.chunk),
                    p.grad.reshape(-1).split(self.chunk),
                    state["exp_avg"].view(-1).split(self.chunk),
                    state["exp_avg_sq"].view(-1).split(self.chunk),
                )
                for theta_stored, grad, m_stored, v_stored in flat:
                    g = grad.float()
                    theta = theta_stored.float()  # the parameter itself when it is fp32
                    # decoupled weight decay: θ ← θ − lr·λ·θ
                    theta.mul_(1 - lr * weight_decay)
                    # m ← β₁·m + (1 − β₁)·g
                    m = m_stored.float().lerp_(g, 1 - beta1)
                    # v ← β₂·v + (1 − β₂)·g²
                    v = v_stored.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    # θ ← θ − lr·m̂ / (√v̂ + ε), with m̂ = m / (1 − β₁ᵗ), v̂ = v / (1 − β₂ᵗ)
                    denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
                    theta.addcdiv_(m, denom, value=-lr / bias_correction1)
                    if theta.data_ptr() != theta_stored.data_ptr():  # a bf16 / fp16 parameter: rounded to nearest
                        theta_stored.copy_(theta)
                    m_stored.copy_(m)  # rounded to nearest
                    v_stored.copy_(round_to_bf16(v, generator))  # rounded stochastically
        return loss

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["rounding_generator"] = self.generator.get_state() if self.generator is not None else self._generator_state
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved_generator = state_dict.pop("rounding_generator", None)
        super().load_state_dict(state_dict)  # torch casts floating-point states to the parameter's dtype ...
        for state in self.state.values():  # ... so back to bf16 (exact: they were bf16 values)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)
        self._generator_state = saved_generator
        if self.generator is not None and saved_generator is not None:
            self.generator.set_state(saved_generator)
