"""Attention for packed micro-batches (`data.packing: true`).

A packed micro-batch is one row holding several sequences (`data.collate(..., packing=True)`),
with position_ids restarting per sequence and the row boundaries in ``cu_seq_lens_q/k``.
Registered with transformers' `AttentionInterface`, so the model code is untouched.

Two fast paths, each tested equal (per sequence) to plain transformers on every family of the
architecture matrix (tests/test_archs.py):

- **packing** (`packed_sdpa_attention`): causal SDPA row by row instead of one (ΣL)² masked call.
  A sliding window (the ``sliding_window=`` keyword models pass, else the module's attribute) is
  honoured with a banded causal mask per row; what it does not reproduce (non-causal attention, a
  KV cache, a position bias, attention sinks) goes to transformers' own ``sdpa`` with the
  block-diagonal mask transformers builds from the restarting position_ids (it does so only without
  an attention_mask and a cache: the loops call the model with ``use_cache=False``) — never something else.
- **shared prefix** (`_shared_prefix_attention`, packed DPO-family pairs and packed RL groups):
  each prompt computed once. Its masks honour a sliding window by true positions (prompt: causal
  band; response: band over ``[prompt; itself]``). There is no per-call fallback for it (the row
  layout is its own), so it is decided once at setup: `attention_fast_paths(config)` says whether
  it applies, and where it does not the loops fall back to ordinary packing (preference) or padded
  rows (RL) with a printed note. A shared-prefix row that reaches an attention feature it cannot
  honour anyway raises `OxrlError`.

Soft-capping (Gemma-2's ``attn_logit_softcapping``, the ``softcap=`` keyword): SDPA cannot apply it,
and transformers' own ``sdpa`` (5.x) drops it silently — padded and packed alike. Both fast paths run
only under ``sdpa`` and compute exactly what transformers' ``sdpa`` computes, so they stay equal to
the plain path; `attention_fast_paths` says so in its reason, and the soft-capped attention needs
``model.attn_implementation=eager`` (where packing goes through transformers' eager attention with
its block-diagonal mask and the shared prefix does not apply).
"""

from __future__ import annotations

from oxrl_core.errors import OxrlError

#: `sdpa` for packed micro-batches: each packed row attends on its own (see `packed_sdpa_attention`).
PACKED_SDPA = "oxrl_packed_sdpa"


_LAST_BOUNDS: tuple = (None, None)  # (cu_seq_lens tensor, its list): every layer of one forward shares it


#: model keyword with the packed row boundaries as ints, which the collator knows on the host
ROW_BOUNDS = "oxrl_row_bounds"


def _row_bounds(cu_seq_lens, host=None) -> list[int]:
    """The row boundaries: ``host`` (the collator's ints: no device read), else `cu_seq_lens.tolist()` once per
    forward pass instead of once per layer (one device sync on a GPU)."""
    if host is not None:
        return list(host)
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
    (the mask was block-diagonal causal) at Σ L_i² cost. A sliding window — the ``sliding_window=`` keyword
    (Mistral, Phi-3, Qwen2 pass it) or the module's attribute (Gemma) — makes each row's mask a causal band
    of that width, as transformers' sliding-window mask is. Everything else — padded batches, generation
    with a KV cache, non-causal or biased attention, attention sinks — is transformers' `sdpa`, unchanged.
    A ``softcap=`` keyword (Gemma-2) is ignored here exactly as transformers' `sdpa` ignores it.
    A shared-prefix row (``oxrl_shared_prefix=``) goes to `_shared_prefix_attention`.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = _window(module, kwargs)
    shared = kwargs.get(SHARED_PREFIX)
    if shared is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        unknown = _unsupported(module, kwargs)
        if unknown:
            raise OxrlError(
                f"data.packing: shared-prompt attention cannot honour this model's {unknown}; "
                "set data.packing=false (attention_fast_paths should have ruled it out at setup)"
            )
        return _shared_prefix_attention(query, key, value, shared, dropout, scaling, window), None
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    plain = (
        cu_seq_lens is None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]  # a KV cache
        or _unsupported(module, kwargs)
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    bounds = _row_bounds(cu_seq_lens, kwargs.get(ROW_BOUNDS))
    gqa = key.shape[1] != query.shape[1]

    def attend(s: int, e: int):  # one packed row, causal (banded under a sliding window)
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        if window is None or window >= e - s:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
            )
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=_row_band(e - s, window, q.device), dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )

    # query (1, H, ΣL, D), key/value (1, H_kv, ΣL, D) -> one causal SDPA per row -> (1, H, ΣL, D)
    out = torch.cat([attend(s, e) for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None  # (1, ΣL, H, D), as `sdpa_attention_forward` returns


#: attention keywords that change what attention computes and that the fast paths do not reproduce: a packed
#: row goes to transformers' sdpa; a shared-prefix row raises (other keywords — position_ids, cu_seq_lens_*,
#: a MoE's output_router_logits, ... — ride along with every model call and change nothing here)
_UNSUPPORTED_KWARGS = ("position_bias", "s_aux", "sinks", "alibi", "attention_chunk_size", "head_mask")


def _window(module, kwargs) -> int | None:
    """The layer's sliding window: the ``sliding_window=`` keyword (Mistral, Phi-3, Qwen2 pass it), else the
    module's attribute (Gemma sets both); None = full causal attention."""
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    return int(window) if window else None


def _unsupported(module, kwargs) -> str:
    """What in this attention call the fast paths cannot reproduce ('' = nothing)."""
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        return "non-causal attention"
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            return f"'{name}'"
    return ""


_ROW_BANDS: dict = {}  # (length, window, device) -> (L, L) band, for the rows of the current forward


def _row_band(length: int, window: int, device):
    """`_band` of one packed row, built once per forward for all layers (the dict is emptied when it grows)."""
    key = (length, window, str(device))
    if key not in _ROW_BANDS:
        if len(_ROW_BANDS) >= 16:
            _ROW_BANDS.clear()
        _ROW_BANDS[key] = _band(length, length, 0, window, device)
    return _ROW_BANDS[key]


def _band(n_q: int, n_k: int, offset: int, window: int | None, device):
    """(n_q, n_k) bool: query i (true position offset + i) sees key j (true position j) iff
    j <= offset + i and offset + i - j < window — transformers' causal mask with its sliding-window overlay."""
    import torch

    q = torch.arange(n_q, device=device).unsqueeze(1) + offset  # (n_q, 1)
    k = torch.arange(n_k, device=device).unsqueeze(0)  # (1, n_k)
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed


#: model keyword (passed through to the attention) that describes a shared-prefix row, see below
SHARED_PREFIX = "oxrl_shared_prefix"

_LAST_LAYOUT: tuple = (None, {})  # (segments list, {window: layout}): every layer of one forward shares it


def shared_prefix_mask(device):
    """The ``attention_mask`` a shared-prefix forward passes: an empty 4-D one. transformers takes a 4-D mask as
    already prepared, so it neither builds a (ΣL)² mask nor looks for packed rows in ``position_ids`` (a device
    read per forward pass); `packed_sdpa_attention` never reads it (the segments say who attends to whom), and any
    other attention would refuse its shape rather than attend through it."""
    import torch

    return torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device)


def _segment_layout(segments, device, window: int | None = None) -> dict:
    """Index tensors that regroup a shared-prefix row for two batched SDPA calls (built once per forward
    and sliding window).

    Prompts: ``prompt_rows`` (P, p_max) row positions of each prompt, padded; ``prompt_mask``
    (P, 1, p_max, p_max) causal over its real tokens (a band of ``window`` under a sliding window).
    Responses: ``response_rows`` (R, n_max) positions of each response's tokens, padded; ``key_rows``
    (R, p_max + n_max) its prompt's positions then its own; ``response_mask`` (R, 1, n_max, p_max + n_max):
    the real prompt tokens, and itself causally — under a sliding window only keys whose true position
    (prompt j, response p + b) is within ``window`` of the query's (p + a).
    ``inverse`` (ΣL,): where each row position sits in ``cat(prompt outputs, response outputs)``.
    Padded entries point at position 0 and are masked out or never read back. Padded query rows
    see the prompt's first token only, so no softmax row is empty.
    """
    global _LAST_LAYOUT
    if _LAST_LAYOUT[0] is not segments:
        _LAST_LAYOUT = (segments, {})
    cache = _LAST_LAYOUT[1]
    if window not in cache:
        import torch

        p_max = max(p for _, p, _ in segments)
        responses = [
            (start + p + sum(lengths[:j]), n, s)
            for s, (start, p, lengths) in enumerate(segments)
            for j, n in enumerate(lengths)
        ]
        n_max = max((n for _, n, _ in responses), default=0)
        total = max(start + p + sum(lengths) for start, p, lengths in segments)
        prompt_rows = torch.zeros(len(segments), p_max, dtype=torch.long)
        inverse = torch.zeros(total, dtype=torch.long)
        prompt_mask = torch.zeros(len(segments), 1, p_max, p_max, dtype=torch.bool)
        for s, (start, p, _lengths) in enumerate(segments):
            prompt_rows[s, :p] = torch.arange(start, start + p)
            prompt_mask[s, 0, :p, :p] = _band(p, p, 0, window, "cpu")  # query i sees prompt j <= i (within the window)
            prompt_mask[s, 0, p:, 0] = True  # padded query rows: anything but an empty row
            inverse[start : start + p] = torch.arange(s * p_max, s * p_max + p)
        response_rows = torch.zeros(len(responses), n_max, dtype=torch.long)
        key_rows = torch.zeros(len(responses), p_max + n_max, dtype=torch.long)
        response_mask = torch.zeros(len(responses), 1, n_max, p_max + n_max, dtype=torch.bool)
        base = len(segments) * p_max
        for r, (begin, n, s) in enumerate(responses):
            p = segments[s][1]
            response_rows[r, :n] = torch.arange(begin, begin + n)
            key_rows[r, :p_max] = prompt_rows[s]
            key_rows[r, p_max : p_max + n] = response_rows[r, :n]
            # response token a sits at true position p + a: the prompt (positions 0..p-1), then itself causally
            response_mask[r, 0, :n, :p] = _band(n, p, p, window, "cpu")
            response_mask[r, 0, :n, p_max : p_max + n] = _band(n, n, 0, window, "cpu")
            response_mask[r, 0, n:, 0] = True  # padded query rows: anything but an empty row
            inverse[begin : begin + n] = torch.arange(base + r * n_max, base + r * n_max + n)
        cache[window] = {
            k: v.to(device)
            for k, v in dict(
                prompt_rows=prompt_rows,
                prompt_mask=prompt_mask,
                response_rows=response_rows,
                key_rows=key_rows,
                response_mask=response_mask,
                inverse=inverse,
            ).items()
        }
    return cache[window]


def _shared_prefix_attention(query, key, value, segments, dropout: float, scaling, window: int | None = None):
    """Causal attention over a row of ``[prompt, response_1, ..., response_k]`` segments.

    ``segments``: one ``(start, p, (n_1, ..., n_k))`` per prompt. Each response's tokens attend to
    the prompt and causally to themselves, never to another response, and carry the positions they
    would have right after the prompt (the caller's ``position_ids``). So each response sees exactly
    what it would see as ``prompt + response`` on its own, while the prompt is computed once instead
    of k times (its gradient collects every response's contribution). Preference pairs are k = 2
    (chosen, rejected); an RL group is k = n samples. Under a sliding ``window`` every query sees only
    keys within ``window`` true positions of its own, as transformers' sliding-window mask does.

    Two SDPA calls per layer, whatever the number of segments: all prompts as a batch (causal), then
    all responses as a batch, each over ``[its prompt's keys; its own keys]`` (`_segment_layout`).
    That costs Σ p² + Σ_j n_j (p + n_j) scores (up to padding), not the (p + Σ_j n_j)² of one masked
    call per segment, which is k times more for long answers.
    query (1, H, ΣL, D), key/value (1, H_kv, ΣL, D) -> (1, ΣL, H, D).
    """
    import torch
    import torch.nn.functional as F

    layout = _segment_layout(segments, query.device, window)
    gqa = key.shape[1] != query.shape[1]

    def gather(t, rows):  # t (1, H, ΣL, D), rows (N, m) -> (N, H, m, D)
        return t[0].index_select(1, rows.flatten()).unflatten(1, rows.shape).transpose(0, 1)

    prompts = F.scaled_dot_product_attention(  # (P, H, p_max, D)
        gather(query, layout["prompt_rows"]),
        gather(key, layout["prompt_rows"]),
        gather(value, layout["prompt_rows"]),
        attn_mask=layout["prompt_mask"],
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=gqa,
    )
    outputs = [prompts.transpose(0, 1).flatten(1, 2)]  # (H, P·p_max, D)
    if layout["response_rows"].numel():
        responses = F.scaled_dot_product_attention(  # (R, H, n_max, D)
            gather(query, layout["response_rows"]),
            gather(key, layout["key_rows"]),
            gather(value, layout["key_rows"]),
            attn_mask=layout["response_mask"],
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
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


#: model types whose attention the shared-prefix path is verified on (tests/test_archs.py); others fall back
SHARED_PREFIX_VERIFIED = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "mistral",
        "phi3",
        "olmo2",
        "qwen3_5_text",
        "qwen3_5_moe_text",
    }
)


#: layer types the fast paths handle: attention (row by row / banded), and Gated DeltaNet linear attention, which
#: `linear_attention.per_sequence_linear_attention` runs per sequence of a packed row
KNOWN_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "linear_attention"})


def attention_fast_paths(config, attn_implementation: str = "sdpa") -> dict[str, tuple[bool, str]]:
    """Which attention fast paths apply to a model, decided once at setup: ``{"packing": (applies, reason),
    "shared_prefix": (applies, reason)}``.

    ``packing``: `data.packing` is exact on this model — row-by-row SDPA (`packed_sdpa_attention`, a sliding
    window honoured with a banded mask; anything else it does not know goes to transformers' sdpa with the
    block-diagonal mask), or transformers' own implementation with that mask. ``shared_prefix``: packed
    preference pairs and RL groups compute each prompt once (`_shared_prefix_attention`); where it does not
    apply the loops fall back to ordinary packing (preference) or padded rows (RL) and print the reason.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "") or ""
    window = getattr(text, "sliding_window", None)
    uses_window = bool(window) and (
        getattr(text, "use_sliding_window", True) is not False
        or any(t == "sliding_attention" for t in (getattr(text, "layer_types", None) or ()))
    )
    softcap = getattr(text, "attn_logit_softcapping", None)
    notes = []
    if uses_window:
        notes.append(f"sliding window {window} honoured (banded masks)")
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        notes.append("linear-attention layers run per sequence")
    if softcap is not None:
        notes.append(
            f"attention soft-capping {softcap} is dropped by transformers' '{attn_implementation}' itself, "
            "padded and packed alike (model.attn_implementation=eager applies it)"
            if attn_implementation != "eager"
            else f"attention soft-capping {softcap} (eager)"
        )
    suffix = f"; {'; '.join(notes)}" if notes else ""

    if attn_implementation != "sdpa":
        packing = (
            True,
            f"transformers' '{attn_implementation}' attention over the packed rows (no oxRL fast path){suffix}",
        )
        return {
            "packing": packing,
            "shared_prefix": (False, f"needs model.attn_implementation=sdpa (is '{attn_implementation}')"),
        }

    blocker = ""
    layer_types = set(getattr(text, "layer_types", None) or ())
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        blocker = "non-causal (bidirectional) attention"
    elif getattr(text, "attention_chunk_size", None):
        blocker = f"chunked attention (attention_chunk_size={text.attention_chunk_size})"
    elif layer_types - KNOWN_LAYER_TYPES:
        blocker = f"layer types {sorted(layer_types - KNOWN_LAYER_TYPES)}"
    elif model_type not in SHARED_PREFIX_VERIFIED:
        blocker = f"model type '{model_type}' is not in the verified architecture matrix"
    packing = (
        True,
        f"row-by-row causal SDPA{suffix}"
        if not blocker
        else f"transformers' sdpa with the block-diagonal mask ({blocker}){suffix}",
    )
    if blocker:
        return {"packing": packing, "shared_prefix": (False, f"{blocker}: the shared-prompt masks cannot express it")}
    return {"packing": packing, "shared_prefix": (True, f"each prompt computed once{suffix}")}
