"""The chunked LM head (`oxrl_core.models.token_head`): per-token quantities without a (tokens, V) tensor.

* the chunk maths by hand (a 2-token vocabulary), and equal to full-logits autograd — values and
  gradients of the hidden states and the head's weight and bias — with soft-capping, a logit scale,
  a temperature and a KD teacher;
* on real models (every family of the architecture matrix, Gemma-2 with its final soft-capping), under LoRA, and
  through the loops' functions (padded, packed, shared-prefix rows): equal to the model's own logits;
* the setup probe falls back to the plain path for a model whose forward transforms its logits in a
  way the head does not know;
* the real CLI: SFT and KD runs give the same losses chunked and with ``train.logits_chunk_size=0``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from archs import FAMILIES
from conftest import oxrl, read_metrics
from test_archs import never_sampled

from oxrl_core.models.token_head import (
    HeadPath,
    _tileable,
    backbone_and_head,
    choose_path,
    head_stats,
    on_grid,
    path_of,
    stats_from_logits,
    token_stats,
)

LN3 = math.log(3)


# ----------------------------------------------------------------------------- the chunk maths


def test_hand_derived_quantities_of_one_distribution():
    """logits [0, ln 3] -> π = [1/4, 3/4]; target 1.

    logp = ln(3/4) = −0.287682; H = −(¼ ln ¼ + ¾ ln ¾) = 0.562335; logp_mean = (ln ¼ + ln ¾)/2 = −0.836988.
    Temperature 0.5: logits [0, 2 ln 3] = [0, ln 9] -> π = [1/10, 9/10], logp = ln 0.9.
    Teacher [0, 0] at τ = 1: KL([½, ½] ‖ [¼, ¾]) = ½ ln 2 + ½ ln(2/3) = ½ ln(4/3) = 0.143841.
    """
    logits, target = torch.tensor([[0.0, LN3]]), torch.tensor([1])
    out = head_stats(
        logits,
        target,
        torch.nn.Identity(),
        HeadPath(chunk_size=1),
        entropy=True,
        logp_mean=True,
        h_teacher=torch.zeros(1, 2),
        teacher_head=torch.nn.Identity(),
    )
    assert float(out["logp"]) == pytest.approx(math.log(3 / 4), abs=1e-6)
    assert float(out["entropy"]) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    assert float(out["logp_mean"]) == pytest.approx((math.log(0.25) + math.log(0.75)) / 2, abs=1e-6)
    assert float(out["kl_teacher"]) == pytest.approx(0.5 * math.log(4 / 3), abs=1e-6)
    hot = head_stats(logits, target, torch.nn.Identity(), HeadPath(chunk_size=1), temperature=0.5)
    assert float(hot["logp"]) == pytest.approx(math.log(0.9), abs=1e-6)


@pytest.mark.parametrize(
    "softcap, scale, temperature, teacher",
    [(None, 1.0, 0.0, False), (3.0, 1.0, 0.7, False), (3.0, 0.5, 0.0, True), (None, 2.0, 1.3, True)],
)
@pytest.mark.parametrize("head_kind", ["tiled", "module"])
def test_chunks_equal_full_logits_values_and_gradients(softcap, scale, temperature, teacher, head_kind):
    """13 tokens in tiles of 4 tokens × 7 vocabulary entries (the last ones short) vs log_softmax over the full
    logits with autograd; ``module``: the head called as a module (a forward hook stops the tiling), whole rows."""
    torch.manual_seed(0)
    M, H, V = 13, 8, 50
    head, teacher_head = torch.nn.Linear(H, V), torch.nn.Linear(H, V)
    if head_kind == "module":
        head.register_forward_hook(lambda m, i, o: None)
    h, h_teacher, targets = torch.randn(M, H, requires_grad=True), torch.randn(M, H), torch.randint(0, V, (M,))
    weights = {k: torch.randn(M) for k in ("logp", "entropy", "logp_mean", "kl_teacher")}  # an arbitrary loss

    def transform(x):  # what the model's forward does after lm_head
        x = x * scale
        return softcap * torch.tanh(x / softcap) if softcap else x

    def run(stats: dict):
        head.zero_grad()
        h.grad = None
        sum((stats[k] * weights[k]).sum() for k in stats).backward()
        return {k: v.detach() for k, v in stats.items()}, [h.grad, head.weight.grad, head.bias.grad]

    plain = run(
        stats_from_logits(
            transform(head(h)),
            targets,
            temperature,
            True,
            True,
            transform(teacher_head(h_teacher)) if teacher else None,
            2.0,
        )
    )
    chunked = run(
        head_stats(
            h,
            targets,
            head,
            HeadPath(4, softcap, scale, vocab_tile=7),
            temperature,
            True,
            True,
            h_teacher if teacher else None,
            teacher_head,
            2.0,
        )
    )
    assert (
        plain[0].keys()
        == chunked[0].keys()
        == ({"logp", "entropy", "logp_mean"} | ({"kl_teacher"} if teacher else set()))
    )
    for k in plain[0]:
        assert torch.allclose(plain[0][k], chunked[0][k], atol=1e-5), k
    for a, b in zip(plain[1], chunked[1]):
        assert torch.allclose(a, b, atol=1e-5)
    assert teacher_head.weight.grad is None  # the teacher is a fixed target


def test_a_masked_token_gets_probability_zero_by_hand():
    """logits [0, ln 3, 5] with token 2 never sampled (``masked``) -> π = [1/4, 3/4, 0], on every path: logp of
    token 1 = ln(3/4), of token 2 exp(logp) = 0; H = 0.562335 (the two-token distribution's); logp_mean over the two
    kept tokens = (ln ¼ + ln ¾)/2; no gradient reaches the masked logit."""
    logits = torch.tensor([[0.0, LN3, 5.0], [0.0, LN3, 5.0]], requires_grad=True)
    targets = torch.tensor([1, 2])
    for head_kind in ("plain", "tiled", "module"):
        x = logits.detach().clone().requires_grad_(True)
        if head_kind == "plain":
            out = stats_from_logits(x, targets, entropy=True, logp_mean=True, masked=(2,))
        else:
            head = torch.nn.Linear(3, 3, bias=False)
            with torch.no_grad():
                head.weight.copy_(torch.eye(3))
            if head_kind == "module":
                head.register_forward_hook(lambda m, i, o: None)
            out = head_stats(x, targets, head, HeadPath(1, vocab_tile=2, masked=(2,)), entropy=True, logp_mean=True)
        assert float(out["logp"][0]) == pytest.approx(math.log(3 / 4), abs=1e-6), head_kind
        assert float(out["logp"][1].exp()) == 0.0, head_kind
        assert float(out["entropy"][0]) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
        assert float(out["logp_mean"][0]) == pytest.approx((math.log(0.25) + math.log(0.75)) / 2, abs=1e-6)
        (out["logp"][0] + out["entropy"][0] + out["logp_mean"][0]).backward()
        assert float(x.grad[0, 2]) == 0.0, head_kind
        assert torch.isfinite(x.grad).all(), head_kind


@pytest.mark.parametrize("head_kind", ["plain", "tiled", "module"])
@pytest.mark.parametrize("teacher", [False, True])
def test_masked_tokens_equal_the_distribution_over_the_other_tokens(head_kind, teacher):
    """Never-sampled tokens (`HeadPath.masked`, ids in several vocabulary tiles) on every path equal an independent
    computation: log_softmax over the vocabulary with those columns removed (targets re-indexed), values and
    gradients of h and of the head's weight and bias (0 on the masked rows), at temperature 0.7, with a teacher."""
    torch.manual_seed(1)
    M, H, V = 11, 8, 40
    masked = (3, 17, 18, 39)
    kept = torch.tensor([v for v in range(V) if v not in masked])
    head, teacher_head = torch.nn.Linear(H, V), torch.nn.Linear(H, V)
    if head_kind == "module":
        head.register_forward_hook(lambda m, i, o: None)
    h, h_teacher = torch.randn(M, H, requires_grad=True), torch.randn(M, H)
    targets = kept[torch.randint(0, len(kept), (M,))]
    weights = {k: torch.randn(M) for k in ("logp", "entropy", "logp_mean", "kl_teacher")}

    def run(stats: dict):
        head.zero_grad()
        h.grad = None
        sum((stats[k] * weights[k]).sum() for k in stats).backward()
        grads = [g if g is not None else torch.zeros_like(p) for g, p in ((h.grad, h), (head.weight.grad, head.weight))]
        return {k: v.detach() for k, v in stats.items()}, grads + [head.bias.grad]

    # independent: the distribution over the kept tokens only
    index = {int(v): i for i, v in enumerate(kept)}
    sub_targets = torch.tensor([index[int(t)] for t in targets])
    z = head(h)[:, kept] / 0.7  # (M, V')
    logp_all = torch.log_softmax(z, -1)
    expected = {
        "logp": logp_all.gather(-1, sub_targets[:, None]).squeeze(-1),
        "entropy": -(logp_all.exp() * logp_all).sum(-1),
        "logp_mean": logp_all.mean(-1),
    }
    if teacher:
        q = torch.log_softmax(teacher_head(h_teacher)[:, kept].detach() / 2.0, -1)
        expected["kl_teacher"] = (q.exp() * (q - torch.log_softmax(head(h)[:, kept] / 2.0, -1))).sum(-1)
    want = run(expected)
    assert float(want[1][1][list(masked)].abs().sum()) == 0.0  # the independent side never touches masked rows
    if head_kind == "plain":
        got = stats_from_logits(
            head(h), targets, 0.7, True, True, teacher_head(h_teacher) if teacher else None, 2.0, masked=masked
        )
    else:
        path = HeadPath(4, vocab_tile=7, masked=masked)
        got = head_stats(h, targets, head, path, 0.7, True, True, h_teacher if teacher else None, teacher_head, 2.0)
    got = run(got)
    assert got[0].keys() == want[0].keys()
    for k in want[0]:
        assert torch.allclose(got[0][k], want[0][k], atol=1e-5), (k, got[0][k], want[0][k])
    for a, b in zip(got[1], want[1]):
        assert torch.allclose(a, b, atol=1e-5)


def _bf16_case(seed: int = 0):
    torch.manual_seed(seed)
    M, H, V = 300, 64, 3000
    head = torch.nn.Linear(H, V, bias=False)
    h = torch.randn(M, H) * 2
    targets = torch.randint(0, V, (M,))
    weights = torch.randn(M)
    return head, h, targets, weights


def _grads(head, h, targets, weights, fn, autocast: bool):
    """(logp, entropy, ∂/∂h, ∂/∂W) of Σ w·(log π(y) + 0.1 H) by ``fn(h)`` -> stats."""
    head.zero_grad(set_to_none=True)
    h = h.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        stats = fn(h)
    (weights * (stats["logp"] + 0.1 * stats["entropy"])).sum().backward()
    return stats["logp"].detach().float(), stats["entropy"].detach().float(), h.grad.float(), head.weight.grad.float()


@pytest.mark.parametrize("tile", ["float32 tile (CPU)", "bf16 tile (CUDA's route)"])
def test_tiled_head_under_bf16_autocast_is_as_accurate_as_full_logits(tile, monkeypatch):
    """Under bf16 autocast, 300 tokens in tiles of 128 × 512 of a 3,000-word vocabulary: log π and H within 2e-2 of
    the full logits', and every gradient's error against float32 no larger than the full logits' own (they sum
    in bf16; the tiles accumulate in float32). The second case runs CUDA's route on the CPU: the tile and its
    gradient held in bf16, products rounded once per tile."""
    from oxrl_core.models import tiled_head

    if tile.startswith("bf16"):
        monkeypatch.setattr(tiled_head, "_tile_dtype", lambda device, dtype: dtype)
    head, h, targets, weights = _bf16_case()
    full = lambda x: stats_from_logits(head(x), targets, entropy=True)
    tiled = lambda x: head_stats(x, targets, head, HeadPath(128, vocab_tile=512), entropy=True)
    exact = _grads(head, h, targets, weights, full, autocast=False)
    full_bf16 = _grads(head, h, targets, weights, full, autocast=True)
    tiled_bf16 = _grads(head, h, targets, weights, tiled, autocast=True)
    for i in (0, 1):  # log π, H
        assert (tiled_bf16[i] - full_bf16[i]).abs().max() <= 2e-2
    for i in (2, 3):  # ∂/∂h, ∂/∂W: relative error against float32
        error = lambda got: float((got - exact[i]).norm() / exact[i].norm())
        assert error(tiled_bf16[i]) <= 1.05 * error(full_bf16[i]), (i, error(tiled_bf16[i]), error(full_bf16[i]))


def test_tiled_head_holds_one_tile_and_reads_the_weight_one_tile_at_a_time(monkeypatch):
    """No tensor of the tiled head's forward or backward is larger than a tile (4 tokens × 7 entries of a 50-word
    vocabulary), but the float32 gradient of the weight it returns; no activation checkpointing."""
    from torch.utils import checkpoint as checkpoint_module

    from oxrl_core.models import token_head

    def no_checkpoint(*args, **kwargs):
        raise AssertionError("the tiled head uses no activation checkpointing")

    monkeypatch.setattr(token_head, "checkpoint", no_checkpoint)
    monkeypatch.setattr(checkpoint_module, "checkpoint", no_checkpoint)
    torch.manual_seed(0)
    M, H, V = 13, 8, 50
    head = torch.nn.Linear(H, V)
    h = torch.randn(M, H, requires_grad=True)
    largest = []

    class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.shape != head.weight.shape:
                    largest.append((t.numel(), str(func)))
            return out

    with Sizes():
        out = head_stats(h, torch.randint(0, V, (M,)), head, HeadPath(4, vocab_tile=7), entropy=True)
        (out["logp"].sum() + out["entropy"].sum()).backward()
    assert max(largest)[0] <= max(4 * 7, M * H), max(largest)


def test_backward_recomputes_one_chunk_at_a_time():
    """The module path (a head that cannot be tiled by its weight: here a forward hook) runs the head once per
    chunk forward and once more per chunk in backward, but for the last chunk, whose logits backward needs
    first: no other chunk's logits are kept."""
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 30)
    shapes = []
    head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    h = torch.randn(10, 4, requires_grad=True)
    out = head_stats(h, torch.randint(0, 30, (10,)), head, HeadPath(chunk_size=4), entropy=True)
    assert shapes == [(4, 30), (4, 30), (2, 30)]
    (out["logp"].sum() + out["entropy"].sum()).backward()
    assert shapes == [(4, 30), (4, 30), (2, 30), (4, 30), (4, 30)]


# ----------------------------------------------------------------------------- real models


def _padded_rows(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 11), generator=g)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 8:] = 0  # a padded row
    mask = torch.zeros(2, 10)
    mask[0, 4:] = 1
    mask[1, 3:7] = 1
    return ids, attention_mask, mask


def _both_paths(model, fn):
    """fn() under the plain path, then under the chunked one (chunks of 3): outputs and parameter gradients; a VLM's
    never-sampled tokens (registered when it loaded) masked on both."""
    results = []
    masked = path_of(model).masked
    for chunk in (0, 3):
        path = choose_path(model, chunk, vocab_tile=37, masked=masked)  # tiles of 3 tokens × 37 vocabulary entries
        assert path.chunked == bool(chunk), path.note
        assert not chunk or _tileable(backbone_and_head(model)[1]) is not None  # by weight tiles, not the module
        model.zero_grad()
        out = fn()
        results.append(
            ([o.detach() for o in out], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (out_plain, g_plain), (out_chunked, g_chunked) = results
    for a, b in zip(out_plain, out_chunked):
        assert torch.allclose(a, b, atol=1e-5)
    assert g_plain.keys() == g_chunked.keys() and g_plain
    for name in g_plain:
        assert torch.allclose(g_plain[name], g_chunked[name], atol=1e-5), name


@pytest.mark.parametrize("family", FAMILIES)
def test_rl_logprobs_equal_the_models_own_logits(arch_model, family):
    """token_logprobs (temperature 0.8, entropy, completion positions only) chunked = plain, values and gradients,
    on every family of the matrix (the probe keeps the chunked path on all of them). Gemma-2 soft-caps its
    final logits at 30: the probe finds it and the head applies it."""
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.rl.batch import token_logprobs

    model = load_causal_lm(str(arch_model(family)))
    if family == "gemma2":
        assert choose_path(model, 3).softcap == 30.0
    ids, attention_mask, mask = _padded_rows(model.get_output_embeddings().weight.shape[0])

    def fn():
        logp, entropy, _ = token_logprobs(model, ids, attention_mask, 0.8, where=mask)
        (logp * torch.linspace(-1, 1, 10) + 0.1 * entropy).mul(mask).sum().backward()
        return logp, entropy

    _both_paths(model, fn)
    # and the model's own logits, by hand, at the scored positions
    with torch.no_grad():
        logp, entropy, _ = token_logprobs(model, ids, attention_mask, 0.8, where=mask)
        logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1].float()
        logits[..., never_sampled(model.config)] = float("-inf")  # a VLM (gemma3_mm) never samples its image tokens
        full = torch.log_softmax(logits / 0.8, -1)
    expected = full.gather(-1, ids[:, 1:, None])[..., 0] * mask
    assert torch.allclose(logp, expected, atol=1e-5)


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    import vlm_archs

    root = tmp_path_factory.mktemp("vlms")
    return {family: vlm_archs.build_vlm(family, root / family) for family in vlm_archs.FAMILIES}


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "gemma3", "llava", "idefics3", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"]
)
def test_vlm_logprobs_tiled_equal_the_full_logits(vlm_dirs, family):
    """On an image prompt and its answer, every VLM family of the matrix: token_stats (temperature 0.7, entropy)
    tiled = plain, values and gradients, the never-sampled tokens masked on both (in several vocabulary tiles);
    the image's placeholder tokens are in the row, not scored."""
    from PIL import Image
    from vlm_archs import IMAGE_SIZE, encode_rendered, processor_of, with_appended

    from oxrl_core.models.loading import load_causal_lm

    model = load_causal_lm(str(vlm_dirs[family]))
    processor = processor_of(family, vlm_dirs[family])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (220, 30, 30))
    prompt = encode_rendered(processor, text, [image])
    answer = processor.tokenizer("a red square", add_special_tokens=False)["input_ids"]
    inputs = with_appended(prompt, answer)
    T = inputs["input_ids"].shape[1]
    pos = torch.arange(T - len(answer) - 1, T - 1)  # the positions predicting the answer
    rows, targets = torch.zeros_like(pos), inputs["input_ids"][0, pos + 1]
    weights = torch.linspace(-1, 1, len(pos))

    def fn():
        stats = token_stats(model, inputs, rows, pos, targets, temperature=0.7, entropy=True)
        ((stats["logp"] * weights).sum() + 0.1 * stats["entropy"].sum()).backward()
        return stats["logp"], stats["entropy"]

    assert path_of(model).masked  # registered when it loaded
    _both_paths(model, fn)


def test_lora_gradients_equal_the_plain_path(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    from oxrl_algs_supervised.sft import SFT
    from oxrl_core.loops.supervised import supervised_tokens
    from oxrl_core.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = get_peft_model(
        load_causal_lm(str(tiny_model_dir)), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    ids, attention_mask, mask = _padded_rows(model.get_output_embeddings().weight.shape[0])
    labels = torch.where(torch.cat([torch.zeros(2, 1), mask], 1) > 0, ids, -100)
    sft = SFT(SFT.Config(label_smoothing=0.1))

    def fn():
        batch = {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}
        loss, _ = sft.loss({**batch, **supervised_tokens(model, None, batch, sft)})
        loss.backward()
        return (loss,)

    _both_paths(model, fn)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_preference_and_shared_prompt_rl_logprobs_equal_per_sequence_transformers(tiny_model_dir, layout):
    """sequence_logps (padded, packed, shared prompts) and token_logprobs_shared, chunked, against each
    sequence on its own through plain transformers."""
    from oxrl_core.loops.preference import collate_sequences, collate_shared_prompts, sequence_logps
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.models.packed_attention import packed_attn_implementation
    from oxrl_core.rl.batch import token_logprobs_shared

    attn = "sdpa" if layout == "padded" else packed_attn_implementation("sdpa")
    model = load_causal_lm(str(tiny_model_dir), attn_implementation=attn)
    assert choose_path(model, 2).chunked
    prompts, chosen, rejected = [[5, 9, 11], [7, 8]], [[20, 21, 3], [30, 3]], [[22, 3], [31, 32, 33, 3]]
    seqs = list(zip(prompts, chosen)) + list(zip(prompts, rejected))
    batch = (
        collate_shared_prompts(prompts, chosen, rejected)
        if layout == "shared"
        else collate_sequences(seqs, 0, layout == "packed")
    )
    with torch.no_grad():
        sums, _ = sequence_logps(model, batch)
        for i, (p, c) in enumerate(seqs):
            ids = torch.tensor([p + c])
            direct = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[
                len(p) - 1 :, 0
            ]
            assert float(sums[i]) == pytest.approx(float(direct.sum()), abs=1e-4)
        if layout == "shared":  # the RL form: 2 samples of each prompt in one packed row
            from oxrl_core.rl.batch import token_logprobs

            rows = [p + c for p, c in seqs[:1] + seqs[2:3] + seqs[1:2] + seqs[3:]]  # prompt 0 twice, prompt 1 twice
            L = max(map(len, rows))
            mb = {
                "input_ids": torch.tensor([r + [0] * (L - len(r)) for r in rows]),
                "attention_mask": torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows]),
                "prompt_len": torch.tensor([3, 3, 2, 2]),
                "group": torch.tensor([0, 0, 1, 1]),
            }
            logp, entropy = token_logprobs_shared(model, mb, 0.7)
            choose_path(model, 0)
            model.config._attn_implementation = "sdpa"
            where = torch.zeros(4, L - 1)
            for i, r in enumerate(rows):
                where[i, int(mb["prompt_len"][i]) - 1 : len(r) - 1] = 1
            logp_plain, entropy_plain, _ = token_logprobs(model, mb["input_ids"], mb["attention_mask"], 0.7)
            assert torch.allclose(logp, logp_plain * where, atol=1e-5)
            assert torch.allclose(entropy, entropy_plain * where, atol=1e-5)


# ----------------------------------------------------------------------------- the setup probe


def test_an_unknown_output_transform_falls_back_to_the_models_logits(tiny_model_dir, monkeypatch):
    """A forward that scales its logits (a transform the head does not know): the probe sees the difference,
    the plain path is chosen with a note, and the log-probabilities are those of the scaled logits."""
    from oxrl_core.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    original = model.forward

    def scaled(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    monkeypatch.setattr(model, "forward", scaled)
    notes = []
    path = choose_path(model, 1024, notes.append)
    assert not path.chunked and path_of(model) is path
    assert len(notes) == 1 and "logits_chunk_size" in notes[0] and "differs" in notes[0]
    ids = torch.tensor([[5, 6, 7, 8]])
    rows, pos = torch.zeros(3, dtype=torch.long), torch.arange(3)
    with torch.no_grad():
        logp = token_stats(model, {"input_ids": ids}, rows, pos, ids[0, 1:])["logp"]
        expected = torch.log_softmax(2.0 * original(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[
            :, 0
        ]
    assert torch.allclose(logp, expected, atol=1e-6)
    # an untouched model keeps the chunked path, without a note
    assert choose_path(load_causal_lm(str(tiny_model_dir)), 1024, notes.append).chunked and len(notes) == 1


def test_the_head_is_chunked_only_where_the_full_logits_would_exceed_the_threshold(tiny_model_dir):
    """vocabulary × tokens × 4 bytes against train.logits_chunk_min_mb: the built-in model's 104-token vocabulary
    stays on the full logits up to 161,319 scored tokens at 64 MB; the threshold 0 (or no token count) chunks."""
    from oxrl_core.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    vocab = model.get_output_embeddings().weight.shape[0]
    limit = int(64 * 2**20 / (4 * vocab))  # the most tokens whose full logits fit in 64 MB
    small = choose_path(model, 1024, tokens=limit, min_mb=64)
    assert not small.chunked and not small.note and small.full_mb == pytest.approx(64, rel=1e-3)
    assert path_of(model) is small
    large = choose_path(model, 1024, tokens=limit + 1, min_mb=64)
    assert large.chunked and large.chunk_size == 1024 and large.full_mb > 64
    assert choose_path(model, 1024, tokens=10, min_mb=0).chunked
    assert choose_path(model, 1024).chunked  # no token count: chunked whenever a chunk size is set
    assert not choose_path(model, 0, tokens=limit + 1, min_mb=64).chunked


@pytest.mark.parametrize(
    ("alg", "sets", "tokens"),
    [
        ("sft", ["train.batch_size=4", "data.max_length=100"], 4 * 100),
        ("sft", ["train.batch_size=4", "data.max_length=100", "train.max_tokens_per_micro_batch=256"], 256),
        ("dpo", ["train.batch_size=4", "data.max_length=100"], 2 * 4 * 100),  # chosen and rejected rows
        ("sgrpo", ["train.batch_size=4", "rollout.n=8", "rollout.max_new_tokens=50", "rollout.minibatches=2"], 800),
        (
            "sgrpo",
            ["train.batch_size=4", "rollout.n=8", "rollout.max_new_tokens=50", "rollout.micro_batch_size=3"],
            150,
        ),
        ("sgrpo", ["train.batch_size=2", "rollout.n=2", "env.name=calculator", "env.max_tokens=300"], 4 * 300),
    ],
)
def test_the_scored_tokens_of_a_micro_batch_are_bounded_from_the_config(alg, sets, tokens):
    """`Setup.scored_tokens`, the token count the head is chosen from: rows of one micro-batch × the longest
    scored part of a row (RL: the completion, or the episode's tokens after the prompt)."""
    from oxrl_core import Trainer
    from oxrl_core.loops.setup import Setup

    trainer = Trainer(alg, overrides=sets, quiet=True)
    assert Setup(trainer, None).scored_tokens() == tokens


@pytest.mark.slow
def test_the_heads_transient_memory_in_a_bf16_sft_run_is_a_few_tiles(tmp_path):
    """`benchmarks/lm_head.py`'s memory part: an SFT step (train.precision=bf16) of a 2-layer Llama with hidden 128
    on 2 rows of ~2,000 tokens needs at most 0.5 GB more than on 2 rows of ~60 with Qwen2.5's 151,936-word
    vocabulary, 0.6 GB with Gemma-3's 262,208 (the module path needed 1.1 GB at 151,936: its chunks of 1,024 tokens
    × the whole vocabulary in float32)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import lm_head

    for vocab, bound in ((151936, 0.5), (262208, 0.6)):
        row = lm_head.head_memory(vocab, "tiled", tmp_path, threads=1)
        assert 0 < row["transient_gb"] <= bound, row


def test_on_grid_places_values_and_passes_gradients():
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    grid = on_grid(values, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 3]), (2, 4))
    assert grid.tolist() == [[0, 0, 1, 0], [2, 0, 0, 3]]
    grid.sum().backward()
    assert values.grad.tolist() == [1, 1, 1]


# ----------------------------------------------------------------------------- the real CLI


@pytest.mark.slow
def test_cli_sft_and_kd_losses_are_the_same_chunked_and_plain(tmp_path, tiny_model_dir, teacher_model_dir, sft_jsonl):
    """`oxrl run` (the console script) with the chunked head forced on (chunks of 3 tokens), and in process with
    chunking off."""
    from test_archs import run_cli

    common = [
        f"model.name={tiny_model_dir}",
        f"data.train={sft_jsonl}",
        "train.max_steps=2",
        "train.batch_size=2",
        "train.lr=1e-3",
    ]
    for alg, extra in (("sft", ["alg.label_smoothing=0.1"]), ("kd", [f"model.teacher={teacher_model_dir}"])):
        sets = common + extra
        args = ["run", "--alg", alg, "-q", "-o", str(tmp_path / f"{alg}-chunked")]
        for s in sets + ["train.logits_chunk_size=3", "train.logits_chunk_min_mb=0"]:
            args += ["--set", s]
        proc = oxrl(*args)
        assert proc.returncode == 0, proc.stderr
        chunked = read_metrics(tmp_path / f"{alg}-chunked")
        plain = run_cli(alg, tmp_path / f"{alg}-plain", *sets, "train.logits_chunk_size=0")
        for a, b in zip(chunked, plain):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        if alg == "kd":
            assert all(r["loss/kl"] > 0 for r in chunked)
