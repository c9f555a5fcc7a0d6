"""Attention for packed micro-batches (`data.packing: true`).

A packed micro-batch is one row holding several sequences (`data.collate(..., packing=True)`),
with position_ids restarting per sequence and the row boundaries in ``cu_seq_lens_q/k``.
Registered with transformers' `AttentionInterface`, so the model code is untouched.
"""

from __future__ import annotations


#: `sdpa` for packed micro-batches: each packed row attends on its own (see `packed_sdpa_attention`).
PACKED_SDPA = "oxrl_packed_sdpa"


_LAST_BOUNDS: tuple = (None, None)  # (cu_seq_lens tensor, its list): every layer of one forward shares it


def _row_bounds(cu_seq_lens) -> list[int]:
    """`cu_seq_lens.tolist()`, once per forward pass instead of once per layer (one device sync on a GPU)."""
    global _LAST_BOUNDS
    if _LAST_BOUNDS[0] is not cu_seq_lens:
        _LAST_BOUNDS = (cu_seq_lens, cu_seq_lens.tolist())
    return _LAST_BOUNDS[1]


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """`sdpa` that runs causal attention row by row inside a packed micro-batch.

    A packed micro-batch is one row of ΣL tokens (`data.collate(..., packing=True)`). Plain `sdpa` sees it
    through the dense (ΣL)×(ΣL) block-diagonal mask transformers builds from the restarting position_ids,
    so attention costs (ΣL)² and cannot use SDPA's causal kernel. Given the row boundaries
    (`cu_seq_lens_q`, which the collator passes), each row gets causal SDPA on its own: the same maths
    (the mask was block-diagonal causal) at Σ L_i² cost. Everything else — padded batches, generation with
    a KV cache, sliding-window, non-causal or biased attention — is transformers' `sdpa`, unchanged.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shared = kwargs.get(SHARED_PREFIX)
    if shared is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        return _shared_prefix_attention(query, key, value, shared, dropout, scaling), None
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    plain = (
        cu_seq_lens is None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]  # a KV cache
        or kwargs.get("is_causal") is False
        or not getattr(module, "is_causal", True)
        or getattr(module, "sliding_window", None) is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("s_aux") is not None
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    bounds = _row_bounds(cu_seq_lens)
    gqa = key.shape[1] != query.shape[1]
    # query (1, H, ΣL, D), key/value (1, H_kv, ΣL, D) -> one causal SDPA per row -> (1, H, ΣL, D)
    out = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa,
            )
            for s, e in zip(bounds[:-1], bounds[1:])
        ],
        dim=2,
    )
    return out.transpose(1, 2).contiguous(), None  # (1, ΣL, H, D), as `sdpa_attention_forward` returns


#: model keyword (passed through to the attention) that describes a shared-prefix row, see below
SHARED_PREFIX = "oxrl_shared_prefix"

_LAST_MASKS: tuple = (None, None)  # (segments list, its masks): every layer of one forward shares them


def _segment_masks(segments, device) -> list:
    """One boolean mask per segment, built once per forward pass (every layer reuses it)."""
    global _LAST_MASKS
    if _LAST_MASKS[0] is not segments:
        import torch

        masks = []
        for _start, p, lengths in segments:
            size = p + sum(lengths)
            allowed = torch.zeros(size, size, dtype=torch.bool, device=device)
            allowed[:, :p] = True  # everything sees the prompt ...
            allowed[:p, :p] = torch.ones(p, p, dtype=torch.bool, device=device).tril()  # ... the prompt causally
            offset = p
            for n in lengths:  # ... and each response itself, causally, never another response
                allowed[offset : offset + n, offset : offset + n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
                offset += n
            masks.append(allowed)
        _LAST_MASKS = (segments, masks)
    return _LAST_MASKS[1]


def _shared_prefix_attention(query, key, value, segments, dropout: float, scaling):
    """Causal attention over a row of ``[prompt, response_1, ..., response_k]`` segments.

    ``segments``: one ``(start, p, (n_1, ..., n_k))`` per prompt. Each response's tokens attend to
    the prompt and causally to themselves, never to another response, and carry the positions they
    would have right after the prompt (the caller's ``position_ids``). So each response sees exactly
    what it would see as ``prompt + response`` on its own, while the prompt is computed once instead
    of k times (its gradient collects every response's contribution). Preference pairs are k = 2
    (chosen, rejected); an RL group is k = n samples. One SDPA call per segment.
    query (1, H, ΣL, D), key/value (1, H_kv, ΣL, D) -> (1, ΣL, H, D).
    """
    import torch
    import torch.nn.functional as F

    gqa = key.shape[1] != query.shape[1]
    parts = []
    for (start, p, lengths), allowed in zip(segments, _segment_masks(segments, query.device)):
        end = start + p + sum(lengths)
        parts.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            attn_mask=allowed, dropout_p=dropout, scale=scaling, enable_gqa=gqa,
        ))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def packed_attn_implementation(attn_implementation: str) -> str:
    """The attention implementation to train packed micro-batches with.

    `sdpa` becomes `PACKED_SDPA` (registered with transformers on first use; it is not written to a saved
    config, so saved models load as before); any other implementation is kept (flash-attention reads the
    row boundaries from the same `cu_seq_lens_*` keys).
    """
    if attn_implementation != "sdpa":
        return attn_implementation
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # padded batches (eval) still need sdpa's mask
    return PACKED_SDPA
