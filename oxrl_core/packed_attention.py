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

_LAST_LAYOUT: tuple = (None, None)  # (segments list, its layout): every layer of one forward shares it


def _segment_layout(segments, device) -> dict:
    """Index tensors that regroup a shared-prefix row for two batched SDPA calls (built once per forward).

    Prompts: ``prompt_rows`` (P, p_max) row positions of each prompt, padded; ``prompt_mask``
    (P, 1, p_max, p_max) causal over its real tokens. Responses: ``response_rows`` (R, n_max) positions
    of each response's tokens, padded; ``key_rows`` (R, p_max + n_max) its prompt's positions then its
    own; ``response_mask`` (R, 1, n_max, p_max + n_max): the real prompt tokens, and itself causally.
    ``inverse`` (ΣL,): where each row position sits in ``cat(prompt outputs, response outputs)``.
    Padded entries point at position 0 and are masked out or never read back. Padded query rows still
    see the prompt's first token, so no softmax row is empty.
    """
    global _LAST_LAYOUT
    if _LAST_LAYOUT[0] is not segments:
        import torch

        p_max = max(p for _, p, _ in segments)
        responses = [(start + p + sum(lengths[:j]), n, s) for s, (start, p, lengths) in enumerate(segments)
                     for j, n in enumerate(lengths)]
        n_max = max((n for _, n, _ in responses), default=0)
        total = max(start + p + sum(lengths) for start, p, lengths in segments)
        prompt_rows = torch.zeros(len(segments), p_max, dtype=torch.long)
        inverse = torch.zeros(total, dtype=torch.long)
        causal = torch.ones(p_max, p_max, dtype=torch.bool).tril()
        prompt_mask = torch.zeros(len(segments), 1, p_max, p_max, dtype=torch.bool)
        for s, (start, p, _lengths) in enumerate(segments):
            prompt_rows[s, :p] = torch.arange(start, start + p)
            prompt_mask[s, 0, :, :p] = causal[:, :p]
            prompt_mask[s, 0, p:, 0] = True  # padded query rows: anything but an empty row
            inverse[start : start + p] = torch.arange(s * p_max, s * p_max + p)
        response_rows = torch.zeros(len(responses), n_max, dtype=torch.long)
        key_rows = torch.zeros(len(responses), p_max + n_max, dtype=torch.long)
        response_mask = torch.zeros(len(responses), 1, n_max, p_max + n_max, dtype=torch.bool)
        own = torch.ones(n_max, n_max, dtype=torch.bool).tril()
        base = len(segments) * p_max
        for r, (begin, n, s) in enumerate(responses):
            p = segments[s][1]
            response_rows[r, :n] = torch.arange(begin, begin + n)
            key_rows[r, :p_max] = prompt_rows[s]
            key_rows[r, p_max : p_max + n] = response_rows[r, :n]
            response_mask[r, 0, :, :p] = True  # the whole prompt
            response_mask[r, 0, :, p_max : p_max + n] = own[:, :n]  # itself, causally
            inverse[begin : begin + n] = torch.arange(base + r * n_max, base + r * n_max + n)
        layout = {k: v.to(device) for k, v in dict(
            prompt_rows=prompt_rows, prompt_mask=prompt_mask, response_rows=response_rows, key_rows=key_rows,
            response_mask=response_mask, inverse=inverse).items()}
        _LAST_LAYOUT = (segments, layout)
    return _LAST_LAYOUT[1]


def _shared_prefix_attention(query, key, value, segments, dropout: float, scaling):
    """Causal attention over a row of ``[prompt, response_1, ..., response_k]`` segments.

    ``segments``: one ``(start, p, (n_1, ..., n_k))`` per prompt. Each response's tokens attend to
    the prompt and causally to themselves, never to another response, and carry the positions they
    would have right after the prompt (the caller's ``position_ids``). So each response sees exactly
    what it would see as ``prompt + response`` on its own, while the prompt is computed once instead
    of k times (its gradient collects every response's contribution). Preference pairs are k = 2
    (chosen, rejected); an RL group is k = n samples.

    Two SDPA calls per layer, whatever the number of segments: all prompts as a batch (causal), then
    all responses as a batch, each over ``[its prompt's keys; its own keys]`` (`_segment_layout`).
    That costs Σ p² + Σ_j n_j (p + n_j) scores (up to padding), not the (p + Σ_j n_j)² of one masked
    call per segment, which is k times more for long answers.
    query (1, H, ΣL, D), key/value (1, H_kv, ΣL, D) -> (1, ΣL, H, D).
    """
    import torch
    import torch.nn.functional as F

    layout = _segment_layout(segments, query.device)
    gqa = key.shape[1] != query.shape[1]

    def gather(t, rows):  # t (1, H, ΣL, D), rows (N, m) -> (N, H, m, D)
        return t[0].index_select(1, rows.flatten()).unflatten(1, rows.shape).transpose(0, 1)

    prompts = F.scaled_dot_product_attention(  # (P, H, p_max, D)
        gather(query, layout["prompt_rows"]), gather(key, layout["prompt_rows"]), gather(value, layout["prompt_rows"]),
        attn_mask=layout["prompt_mask"], dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    outputs = [prompts.transpose(0, 1).flatten(1, 2)]  # (H, P·p_max, D)
    if layout["response_rows"].numel():
        responses = F.scaled_dot_product_attention(  # (R, H, n_max, D)
            gather(query, layout["response_rows"]), gather(key, layout["key_rows"]), gather(value, layout["key_rows"]),
            attn_mask=layout["response_mask"], dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        outputs.append(responses.transpose(0, 1).flatten(1, 2))  # (H, R·n_max, D)
    out = torch.cat(outputs, dim=1).index_select(1, layout["inverse"])  # (H, ΣL, D)
    return out.transpose(0, 1).unsqueeze(0).contiguous()  # (1, ΣL, H, D)


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
