"""Packing is allowed by measurement: a packed forward must equal the separate forwards on the loaded model.

`data.packing` (and the shared-prefix rows built on it) is exact only where every layer of a model restarts at a
sequence boundary. Attention does through `packed_attention`; Gated DeltaNet layers do through `linear_attention`;
a stateful layer nobody taught about boundaries (Mamba-style mixers, a remote-code model, a transformers release
that changes a layer) would silently run one sequence's state into the next. So when a run would pack, the
loaded model is measured once (`probe`): two random sequences of 96 and 80 tokens — longer than a convolution
kernel and than the delta rule's 64-token chunk — as one packed row against each on its own, and, where the
shared-prefix path would be used, a ``[prompt, response_1, response_2]`` row against ``prompt + response_j`` on
their own. Packing (or the shared prefix) applies only where the logits agree; otherwise the run steps aside to
padded rows with a note naming the model type, never computing something else.

Tolerance: float32 logits within 1e-5 relative to the largest logit (at least 1e-5 absolute); a model loaded in
bfloat16/float16 (``model.dtype``) at that dtype's rounding (`torch.testing`'s default rtol: 1.6e-2 / 1e-3), which
still sees a boundary-blind layer (differences of the order of the logits themselves).

The verdict is cached per model (its config, attention implementation and dtype), so a reference or teacher that
is the policy's architecture costs nothing more, and it is kept on the model (``oxrl_packing_verdict``) for the
`hf` rollout backend, whose prefill-once cache steps aside with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from oxrl_core.models.packed_attention import ROW_BOUNDS, SHARED_PREFIX

#: the probe's sequence lengths: both longer than a linear-attention layer's convolution and 64-token chunk
LENGTHS = (96, 80)
#: where the shared-prefix probe cuts the first sequence into prompt and first response
PROMPT = 40

_CACHE: dict = {}  # (config json, attention implementation, dtype) -> Verdict


@dataclass(frozen=True)
class Verdict:
    """What the probe measured on one model."""

    model_type: str
    packing: bool  #: a packed row equals the separate forwards
    shared_prefix: bool  #: a shared-prefix row does too (False when not probed)
    packing_diff: float  #: the largest |Δ logit| of the packed row
    shared_diff: float | None  #: the same for the shared-prefix row; None when not probed
    tolerance: float
    seconds: float
    error: str = ""  #: the exception a packed call raised (then packing is False)

    def note(self, what: str = "packing", then: str = "its rows are padded") -> str:
        """Why ``what`` ('packing', 'shared prompts', ...) steps aside and what happens ``then``, in one line."""
        if self.error:
            cause = f"a packed forward raises {self.error}"
        else:
            # the shared-prompt row's difference where it was measured, else the packed row's (which failed first)
            diff = self.shared_diff if self.packing and self.shared_diff is not None else self.packing_diff
            cause = f"a packed row differs from the separate forwards by {diff:.3g} (tolerance {self.tolerance:.1g})"
        return (
            f"data.packing: {what} off for model type '{self.model_type}': {cause}; it has layers that do not "
            f"restart at a sequence boundary, so {then}"
        )


def probe(model, shared_prefix: bool = False) -> Verdict:
    """Measure (or recall) whether ``model`` packs exactly; ``shared_prefix`` also measures a shared-prefix row.
    Runs in eval mode without gradients and leaves the model's mode as it was."""
    config = model.config
    dtype = next(model.parameters()).dtype
    key = (config.to_json_string(use_diff=False), getattr(config, "_attn_implementation", None), str(dtype))
    verdict = _CACHE.get(key)
    if verdict is None or (shared_prefix and verdict.shared_diff is None and verdict.packing):
        verdict = _measure(model, shared_prefix, dtype)
        _CACHE[key] = verdict
    model.oxrl_packing_verdict = verdict
    return verdict


def allows_prefill_once(model) -> bool:
    """False where the probe found that ``model`` does not pack exactly (the `hf` backend then prefills each sample
    through transformers' own cache); True where it passed or never ran."""
    verdict = getattr(model, "oxrl_packing_verdict", None)
    return verdict is None or verdict.packing


def _measure(model, shared_prefix: bool, dtype) -> Verdict:
    import torch

    text = config_text(model.config)
    model_type = getattr(text, "model_type", "") or getattr(model.config, "model_type", "")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, text.vocab_size, (n,), generator=gen).to(device) for n in LENGTHS)  # (96,), (80,)
    rtol = 1e-5 if dtype == torch.float32 else {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}.get(dtype, 1e-5)
    # a causal LM's logits; a reward model's (`AutoModelForSequenceClassification`) pools one score per row, so its
    # base model's per-token hidden states
    scored = model if model.get_output_embeddings() is not None else model.base_model
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    shared_diff = None
    try:
        with torch.no_grad():

            def forward(**inputs):  # (1, L) -> (L, V) logits, or (L, C) hidden states for a score model
                out = scored(**inputs, use_cache=False)
                return (out.logits if hasattr(out, "logits") else out.last_hidden_state)[0].float()

            def alone(ids):  # (L,) -> (L, V)
                return forward(input_ids=ids[None])

            def positions(*lengths):  # (1, ΣL): each sequence's own positions
                return torch.cat([torch.arange(n, device=device) for n in lengths])[None]

            separate = [alone(a), alone(b)]
            tolerance = rtol * max(1.0, max(float(s.abs().max()) for s in separate))
            bounds = torch.tensor([0, len(a), len(a) + len(b)], dtype=torch.int32, device=device)
            packed = forward(  # (ΣL, V)
                input_ids=torch.cat([a, b])[None],
                position_ids=positions(len(a), len(b)),
                cu_seq_lens_q=bounds,
                cu_seq_lens_k=bounds,
                max_length_q=max(LENGTHS),
                max_length_k=max(LENGTHS),
                **{ROW_BOUNDS: (0, len(a), len(a) + len(b))},  # as the collator passes them (host ints)
            )
            packing_diff = max(
                float((packed[: len(a)] - separate[0]).abs().max()),
                float((packed[len(a) :] - separate[1]).abs().max()),
            )
            if shared_prefix and packing_diff <= tolerance:
                # [prompt a[:40], response a[40:], response b[:56]]: each response at the positions it has after the prompt
                second = b[: len(a) - PROMPT]
                row = torch.cat([a, second])[None]
                shared_pos = torch.cat([positions(len(a))[0], torch.arange(PROMPT, len(a), device=device)])[None]
                shared = forward(
                    input_ids=row,
                    position_ids=shared_pos,
                    **{SHARED_PREFIX: [(0, PROMPT, (len(a) - PROMPT, len(second)))]},
                )
                second_alone = alone(torch.cat([a[:PROMPT], second]))[PROMPT:]
                shared_diff = max(
                    float((shared[: len(a)] - separate[0]).abs().max()),
                    float((shared[len(a) :] - second_alone).abs().max()),
                )
    except Exception as exc:  # noqa: BLE001 - a model that cannot take a packed row does not pack
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return Verdict(model_type, False, False, float("inf"), None, 0.0, time.perf_counter() - start, error)
    finally:
        model.train(was_training)
    return Verdict(
        model_type,
        packing=packing_diff <= tolerance,
        shared_prefix=shared_diff is not None and shared_diff <= tolerance,
        packing_diff=packing_diff,
        shared_diff=shared_diff,
        tolerance=tolerance,
        seconds=time.perf_counter() - start,
    )


def config_text(config):
    """The text part of a (possibly multimodal) config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
