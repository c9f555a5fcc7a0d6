"""Linear-attention layers on packed rows: each sequence's recurrent state and convolution start afresh.

A Gated DeltaNet layer (Qwen3.5 dense and MoE, Qwen3-Next) carries a recurrent state and a short causal
convolution along its row. On a packed row (`data.packing`) the state and the convolution window of one
sequence would run on into the next: transformers passes the row boundaries (``cu_seq_lens_q``) to the delta rule,
and its GPU kernels (flash-linear-attention, causal-conv1d) take them, but the pure-PyTorch fallbacks
(``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``), which run on a CPU and on a GPU without those kernels,
accept the boundaries and ignore them.

`per_sequence_linear_attention(model)` makes every such layer of a loaded model regroup a packed row into one
right-padded batch of its sequences, run transformers' own layer on that batch (one call, no cache), and put the
outputs back in row order. The layer is causal, so the padding after a sequence changes nothing before it: each
sequence gets exactly what its own forward gives it, whichever kernel runs. A shared-prefix row
(``[prompt, response_1, ..., response_k]``, `packed_attention._shared_prefix_attention`) becomes one sequence
``[prompt; response_j]`` per response: the linear layer recomputes the prompt for each response (its state after
the prompt is what the response continues from), the attention layers still compute it once.

Calls without a packed row (padded batches, generation with a cache) go to the layer unchanged.
`models.packing_probe` measures the result on every model that packs, so a stateful layer this module does not
know (Mamba, Jamba, ...) makes packing step aside rather than compute something else.
"""

from __future__ import annotations

import types

from oxrl_core.models.packed_attention import ROW_BOUNDS, SHARED_PREFIX

#: the class-name ending of the layers handled here (transformers: Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet,
#: Qwen3NextGatedDeltaNet), all called as ``forward(hidden_states, cache_params, attention_mask, **kwargs)``
LINEAR_LAYER_SUFFIX = "GatedDeltaNet"

#: keyword arguments that describe the packed row and mean nothing to a layer that sees one sequence per batch row
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", ROW_BOUNDS)

_LAST: tuple = (None, None)  # (the row description, its layout): every linear layer of one forward shares it


def per_sequence_linear_attention(model) -> int:
    """Make each Gated DeltaNet layer of ``model`` run a packed row per sequence; returns how many layers it wraps
    (0 for a model without them). Idempotent; the wrapped layers compute as before on everything else."""
    wrapped = 0
    for module in model.modules():
        if not type(module).__name__.endswith(LINEAR_LAYER_SUFFIX):
            continue
        if getattr(module, "_oxrl_per_sequence", False):
            wrapped += 1
            continue
        module._oxrl_layer_forward = module.forward  # transformers' forward, bound to the layer
        module.forward = types.MethodType(_per_sequence_forward, module)
        module._oxrl_per_sequence = True
        wrapped += 1
    return wrapped


def _per_sequence_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """A Gated DeltaNet layer's forward; a packed row (batch 1, no cache, its boundaries in ``cu_seq_lens_q`` or a
    shared-prefix description) runs as a batch of its sequences."""
    import torch

    shared = kwargs.get(SHARED_PREFIX)
    # the row boundaries: the collator's ints (no device read), else the tensor
    bounds = kwargs.get(ROW_BOUNDS, kwargs.get("cu_seq_lens_q"))
    packed = cache_params is None and hidden_states.shape[0] == 1 and (shared is not None or bounds is not None)
    if not packed:
        return self._oxrl_layer_forward(
            hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
        )
    rest = {k: v for k, v in kwargs.items() if k not in _PACKED_KWARGS and k != SHARED_PREFIX}
    layout = _layout(shared if shared is not None else bounds, shared is not None, hidden_states.device)
    outputs = []
    for rows in layout["groups"]:  # sequences of similar length, right-padded to the longest of each group
        # hidden_states (1, ΣL, C) -> (n, L_g, C); the padding repeats token 0, and the layer is causal, so nothing
        # after a sequence's last token reaches it
        batch = hidden_states[0].index_select(0, rows.flatten()).unflatten(0, rows.shape)
        out = self._oxrl_layer_forward(batch, cache_params=None, attention_mask=None, **rest)  # (n, L_g, C_out)
        outputs.append(out.flatten(0, 1))
    return torch.cat(outputs).index_select(0, layout["inverse"]).unsqueeze(0)  # (1, ΣL, C_out)


#: a group of sequences is padded to its longest; a sequence joins the group while the padded size stays within
#: this factor of the group's real tokens (one call per layer for rows of similar lengths, a few for mixed ones)
PADDING_SLACK = 1.25


def _layout(description, shared: bool, device) -> dict:
    """Index tensors for one packed row, built once per forward (every linear layer of it reuses them).

    The row's sequences — packing (``description`` = ``cu_seq_lens``): one per boundary pair; shared prefix
    (``description`` = ``[(start, p, (n_1, ..., n_k)), ...]``): ``[prompt; response_j]`` per response (the prompt
    alone where it has none), the prompt's outputs read from its first sequence; the boundaries come as the collator's
    ints (``oxrl_row_bounds``) or as the tensor — sorted longest first and cut into
    groups whose padding stays within `PADDING_SLACK`. ``groups``: one (n, L_g) tensor of row positions per group,
    right-padded with position 0. ``inverse`` (ΣL,): where each row position's output sits in the concatenation of
    the groups' flattened outputs.
    """
    global _LAST
    if _LAST[0] is description:
        return _LAST[1]
    import torch

    if shared:
        sequences = []  # each sequence's row positions
        total = max(start + p + sum(lengths) for start, p, lengths in description)
        owners = [(0, 0)] * total  # row position -> (sequence, index in it)
        for start, p, lengths in description:
            prompt = list(range(start, start + p))
            for i in range(p):
                owners[start + i] = (len(sequences), i)
            begin = start + p
            for n in lengths or (0,):
                for j in range(n):
                    owners[begin + j] = (len(sequences), p + j)
                sequences.append(prompt + list(range(begin, begin + n)))
                begin += n
    else:
        cuts = description.tolist() if isinstance(description, torch.Tensor) else list(description)
        sequences = [list(range(s, e)) for s, e in zip(cuts[:-1], cuts[1:]) if e > s]
        owners = [(i, j) for i, sequence in enumerate(sequences) for j in range(len(sequence))]

    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    groups, current, tokens = [], [], 0
    for i in order:
        n = len(sequences[i])
        if current and (len(current) + 1) * len(sequences[current[0]]) > PADDING_SLACK * (tokens + n):
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    groups.append(current)

    offset, where, tensors = 0, {}, []  # where: sequence -> (its first flat index, its group's width)
    for group in groups:
        width = len(sequences[group[0]])
        rows = torch.zeros(len(group), width, dtype=torch.long)  # (n, L_g)
        for r, i in enumerate(group):
            rows[r, : len(sequences[i])] = torch.tensor(sequences[i], dtype=torch.long)
            where[i] = offset + r * width
        tensors.append(rows.to(device))
        offset += len(group) * width
    inverse = torch.tensor([where[i] + j for i, j in owners], dtype=torch.long)
    layout = {"groups": tensors, "inverse": inverse.to(device)}
    _LAST = (description, layout)
    return layout
