"""The architecture matrix: every family of tests/archs.py through the real CLI (in process).

Each fast path is checked against an independent per-sequence computation in plain transformers
(`AutoModelForCausalLM`, the family's tokenizer and chat template, one `model(ids)` per sequence),
never against oxRL itself:

- SFT: the first step's loss, padded and packed, = the token-mean cross-entropy of the completions.
- DPO (a reference initialised from another seed): the first step's loss, padded and packed (shared
  prompts), = the DPO loss from per-sequence log-probabilities of policy and reference.
- SGRPO, padded and packed (shared prompts): trainer and rollout log-probabilities of the sampled
  tokens agree (`rollout/logprob_diff` < 1e-4 in fp32), and both runs give the same update.
- PPO: one step on each family.

Rows are longer than the 16-token sliding window of Gemma-2/3, Mistral and Phi-3, so an attention path
that drops the window (the bugs of issue 14: packed SFT on Mistral/Phi-3, packed DPO and shared-prompt
SGRPO on the sliding-window families) fails here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from archs import FAMILIES, LENGTH_REWARD, LINEAR_ATTENTION, WINDOW, run_cli
from conftest import oxrl, read_metrics, write_jsonl

WINDOWED = ("gemma2", "gemma3", "gemma3_mm", "mistral", "phi3")
#: the chunk of transformers' delta rule (Qwen3.5's linear attention): every row is longer, so a state that runs
#: from one packed sequence into the next shows
DELTA_CHUNK = 64

SFT_ROWS = [
    {
        "prompt": f"Compute {a} times {b} and then add {c}. Please think step by step.",
        "response": f"{a} times {b} is {a * b}. Adding {c} gives {a * b + c}. The answer is {a * b + c}. "
        f"Let me check: the sum of {a * b} and {c} is {a * b + c}, so the result is {a * b + c}.",
    }
    for a, b, c in ((3, 4, 5), (7, 8, 2), (11, 2, 9), (6, 6, 6))
]
PAIRS = [
    {
        "prompt": f"What is {a}+{b}? Answer briefly, then explain the sum in one short sentence.",
        "chosen": f"The answer is {a + b}. The sum of {a} and {b} is {a + b}. Please think step by step: {a} and "
        f"{b} is {a + b}. So it is {a + b}.",
        "rejected": f"The answer is {a + b + 1}. A model learns to add numbers one step at a time. The quick brown "
        "fox jumps over the lazy dog.",
    }
    for a, b in ((2, 3), (9, 4), (13, 7), (5, 16))
]
PROMPTS = [
    {"prompt": f"You are a helpful assistant. What is {a}+{b}? Think step by step.", "answer": str(a + b)}
    for a, b in ((1, 2), (4, 5))
]


# ----------------------------------------------------------------------------- plain transformers, per sequence


def _load(model_dir: Path, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval(), tokenizer


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(out if isinstance(out, list) else out["input_ids"])


def never_sampled(config) -> list[int]:
    """A vision-language model's image token and the tokens around it, read off its config (the Gemma-3 multimodal
    layout here: ``image_token_index``, ``boi_token_index``, ``eoi_token_index``); [] for a text model. A VLM never
    samples them, so the policy oxRL trains is the distribution without them, text rows too."""
    if getattr(config, "vision_config", None) is None:
        return []
    names = ("image_token_index", "boi_token_index", "eoi_token_index")
    return [v for n in names if isinstance(v := getattr(config, n, None), int)]


def _completion_logps(model, tokenizer, prompt: str, completion: str) -> torch.Tensor:
    """log π(y_t | x, y_<t) of each completion token (its tokens, then EOS), one plain forward: (n,); with
    gradients when they are enabled. A VLM's distribution is without the tokens it never samples (`never_sampled`)."""
    p = _prompt_ids(tokenizer, prompt)
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([p + c])
    logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()  # (n, V)
    never = never_sampled(model.config)
    if never:
        logits = logits.index_fill(-1, torch.tensor(never), float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)


def _grad_norm(model) -> float:
    """‖∇‖₂ over every parameter (what the trainer logs as ``grad_norm`` before clipping)."""
    return float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())


def plain_sft(model_dir: Path, rows: list[dict], attn_implementation: str = "sdpa") -> dict:
    """SFT's first step in plain transformers, one forward per row: the token-mean NLL of the completions, its
    gradient norm, and the longest row's length."""
    model, tokenizer = _load(model_dir, attn_implementation)
    logps = [_completion_logps(model, tokenizer, r["prompt"], r["response"]) for r in rows]
    loss = -torch.cat(logps).mean()
    loss.backward()
    longest = max(len(_prompt_ids(tokenizer, r["prompt"])) + len(lp) for r, lp in zip(rows, logps))
    return {"loss": float(loss.detach()), "grad_norm": _grad_norm(model), "longest": longest}


def plain_sft_loss(model_dir: Path, rows: list[dict], attn_implementation: str = "sdpa") -> tuple[float, int]:
    """Token-mean NLL of the completions (SFT's loss), and the longest row's length."""
    with torch.no_grad():
        model, tokenizer = _load(model_dir, attn_implementation)
        logps = [_completion_logps(model, tokenizer, r["prompt"], r["response"]) for r in rows]
    longest = max(len(_prompt_ids(tokenizer, r["prompt"])) + len(lp) for r, lp in zip(rows, logps))
    return float(-torch.cat(logps).mean()), longest


def plain_dpo(policy_dir: Path, ref_dir: Path, pairs: list[dict], beta: float) -> dict:
    """DPO's first step in plain transformers, one forward per sequence:
    L = -mean log σ(β[(log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l))]), sums over tokens; with the
    mean log-probabilities of chosen and rejected and the gradient norm."""
    (policy, tokenizer), (ref, _) = _load(policy_dir), _load(ref_dir)

    def logp(model, row, key):  # () summed over the completion's tokens
        return _completion_logps(model, tokenizer, row["prompt"], row[key]).sum()

    chosen = torch.stack([logp(policy, row, "chosen") for row in pairs])  # (P,)
    rejected = torch.stack([logp(policy, row, "rejected") for row in pairs])  # (P,)
    with torch.no_grad():
        ref_chosen = torch.stack([logp(ref, row, "chosen") for row in pairs])
        ref_rejected = torch.stack([logp(ref, row, "rejected") for row in pairs])
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    loss = -torch.nn.functional.logsigmoid(beta * margin).mean()
    loss.backward()
    return {
        "loss": float(loss.detach()),
        "grad_norm": _grad_norm(policy),
        "logps/chosen": float(chosen.detach().mean()),
        "logps/rejected": float(rejected.detach().mean()),
    }


def plain_dpo_loss(policy_dir: Path, ref_dir: Path, pairs: list[dict], beta: float) -> float:
    """The DPO loss of `plain_dpo`."""
    return plain_dpo(policy_dir, ref_dir, pairs, beta)["loss"]


# ----------------------------------------------------------------------------- the matrix


def test_fixtures_are_their_family(arch_model):
    """Every family saves a plain HF directory whose chat template renders and whose rows outgrow the window."""
    from transformers import AutoConfig, AutoTokenizer

    expected = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
        "gemma3_mm": "Gemma3ForConditionalGeneration",
        "mistral": "MistralForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "olmo2": "Olmo2ForCausalLM",
        "qwen3_5": "Qwen3_5ForCausalLM",
        "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    }
    marker = {
        "llama": "<|im_start|>",
        "qwen2": "<|im_start|>",
        "qwen3": "<|im_start|>",
        "qwen3_moe": "<|im_start|>",
        "olmo2": "<|im_start|>",
        "gemma2": "<start_of_turn>",
        "gemma3": "<start_of_turn>",
        "gemma3_mm": "<start_of_turn>",
        "mistral": "[INST]",
        "phi3": "<|user|>",
        "qwen3_5": "<|im_start|>",
        "qwen3_5_moe": "<|im_start|>",
    }
    for family in FAMILIES:
        path = arch_model(family)
        config = AutoConfig.from_pretrained(path)
        text = config.get_text_config()
        assert config.architectures == [expected[family]], family
        assert (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) == 64
        assert text.num_hidden_layers == 2 and 64 <= text.hidden_size <= 128 and text.max_position_embeddings >= 512
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert len(tokenizer) == text.vocab_size and 300 <= len(tokenizer) <= 1000
        assert tokenizer.eos_token_id is not None
        assert (tokenizer.pad_token_id is None) == (family == "mistral")  # Mistral ships no pad token
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        )
        assert marker[family] in rendered, (family, rendered)
        if family in WINDOWED:
            assert text.sliding_window == WINDOW
        if family in LINEAR_ATTENTION:
            assert text.layer_types == ["linear_attention", "full_attention"]
        for row in SFT_ROWS + PAIRS:
            assert len(_prompt_ids(tokenizer, row["prompt"])) > WINDOW  # every row outgrows the window
            for key in ("response", "chosen", "rejected"):  # and the delta rule's 64-token chunk
                if key in row:
                    completion = tokenizer(row[key], add_special_tokens=False)["input_ids"]
                    assert len(_prompt_ids(tokenizer, row["prompt"])) + len(completion) + 1 > DELTA_CHUNK  # + EOS
    # the multimodal layout loads through AutoModelForCausalLM as itself (the text config nested), as oxRL loads it
    model, _ = _load(arch_model("gemma3_mm"))
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_fast_paths_equal_plain_transformers(family, arch_model):
    """Below the CLI: a packed row (row-by-row SDPA; Qwen3.5's linear-attention layers per sequence) and a
    shared-prompt row give each sequence the logits plain transformers gives it alone — on the sliding-window and
    linear-attention families too; and the load-time packing probe passes on every family, within a second."""
    from oxrl_core.models import packing_probe
    from oxrl_core.models.linear_attention import per_sequence_linear_attention
    from oxrl_core.models.packed_attention import SHARED_PREFIX, attention_fast_paths, packed_attn_implementation

    model, _ = _load(arch_model(family))
    assert per_sequence_linear_attention(model) == (1 if family in LINEAR_ATTENTION else 0)  # what loading does
    fast = attention_fast_paths(model.config)
    assert fast["packing"][0] and fast["shared_prefix"][0], fast
    if family in WINDOWED:
        assert f"sliding window {WINDOW}" in fast["shared_prefix"][1]
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    # all longer than the 16-token window, the first and last than the delta rule's 64-token chunk
    seqs = [torch.randint(10, vocab, (n,), generator=gen) for n in (80, 23, 70)]
    with torch.no_grad():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        model.set_attn_implementation(packed_attn_implementation("sdpa"))
        bounds = torch.tensor([0, 80, 103, 173], dtype=torch.int32)
        packed = model(
            input_ids=torch.cat(seqs)[None],
            position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None],
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=80,
            max_length_k=80,
            use_cache=False,
        ).logits[0]
        for (s, e), ref in zip(zip(bounds[:-1], bounds[1:]), alone):
            torch.testing.assert_close(packed[s:e], ref, atol=1e-5, rtol=1e-5)
        # [prompt (20), response 1 (60), response 2 (15)], each response at the positions it has after the prompt
        prompt, first, second = seqs[0][:20], seqs[0][20:], seqs[2][:15]
        row = torch.cat([prompt, first, second])[None]
        positions = torch.cat([torch.arange(20), torch.arange(20, 80), torch.arange(20, 35)])[None]
        shared = model(
            input_ids=row, position_ids=positions, use_cache=False, **{SHARED_PREFIX: [(0, 20, (60, 15))]}
        ).logits[0]
    torch.testing.assert_close(shared[:80], alone[0], atol=1e-5, rtol=1e-5)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        second_alone = model(input_ids=torch.cat([prompt, second])[None]).logits[0]
    torch.testing.assert_close(shared[80:], second_alone[20:], atol=1e-5, rtol=1e-5)

    model.set_attn_implementation(packed_attn_implementation("sdpa"))
    packing_probe._CACHE.clear()  # measured here, not recalled from an earlier test
    verdict = packing_probe.probe(model, shared_prefix=True)
    assert verdict.packing and verdict.shared_prefix and verdict.packing_diff <= 1e-5, verdict
    assert verdict.seconds <= 1.0, verdict  # one packed forward per load, cheap on the tiny models
    assert model.oxrl_packing_verdict is verdict and packing_probe.probe(model, shared_prefix=True) is verdict


def test_fast_paths_decide_at_setup_and_refuse_what_they_cannot_express():
    """`attention_fast_paths`: sdpa models of the matrix get both paths; non-causal, chunked attention, an
    unverified architecture or another attention implementation lose the shared prefix (with the reason)."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    from oxrl_core.models.packed_attention import attention_fast_paths

    mistral = attention_fast_paths(MistralConfig(sliding_window=16))
    assert mistral["packing"][0] and mistral["shared_prefix"][0] and "sliding window 16" in mistral["packing"][1]
    gemma2 = attention_fast_paths(Gemma2Config())
    assert gemma2["shared_prefix"][0] and "soft-capping" in gemma2["shared_prefix"][1]
    eager = attention_fast_paths(Gemma2Config(), attn_implementation="eager")
    assert eager["packing"][0] and not eager["shared_prefix"][0] and "sdpa" in eager["shared_prefix"][1]
    chunked = LlamaConfig()
    chunked.attention_chunk_size = 8
    assert not attention_fast_paths(chunked)["shared_prefix"][0]
    other = LlamaConfig()
    other.model_type = "my_new_arch"
    applies, reason = attention_fast_paths(other)["shared_prefix"]
    assert not applies and "my_new_arch" in reason


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_packed_equals_padded_equals_plain(family, arch_model, tmp_path):
    """Packed SFT on Mistral/Phi-3 dropped the sliding window (6.679 vs 6.607 in the issue); on Qwen3.5 the
    linear-attention state ran from one packed row into the next (0.0059 nats, gradient norm 0.5% off).
    The first step's loss and gradient norm, padded and packed (several rows longer than the delta rule's chunk
    in one packed row), = plain transformers row by row."""
    model_dir = arch_model(family)
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    expected = plain_sft(model_dir, SFT_ROWS)
    assert expected["longest"] > max(2 * WINDOW, DELTA_CHUNK)
    common = (
        f"model.name={model_dir}",
        f"data.train={data}",
        "train.max_steps=1",
        f"train.batch_size={len(SFT_ROWS)}",
        "train.lr=1e-6",
        "train.save_every=0",
    )
    padded = run_cli("sft", tmp_path / "padded", *common, "data.packing=false")[0]
    packed = run_cli("sft", tmp_path / "packed", *common, "data.packing=true")[0]
    assert packed["perf/micro_batches"] == 1  # the four rows in one packed row
    for metrics in (padded, packed):
        assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_packed_equals_padded_equals_plain(family, arch_model, tmp_path):
    """Packed DPO (shared prompts) ignored the window: up to 0.22 off on Gemma-2/3, Mistral, Phi-3; on Qwen3.5 the
    linear-attention state crossed rows (0.0042 off, the rejected log-probability by 0.16 nats). The first step's
    loss, log-probabilities and gradient norm, padded and packed, = plain transformers sequence by sequence."""
    policy, ref = arch_model(family), arch_model(family, seed=1)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    beta = 2.0  # a large β: a path that attends differently moves the loss well past the tolerance
    expected = plain_dpo(policy, ref, PAIRS, beta)
    assert abs(expected["loss"] - math.log(2)) > 1e-3  # the separate reference puts the margins away from 0
    common = (
        f"model.name={policy}",
        f"model.ref={ref}",
        f"data.train={data}",
        "train.max_steps=1",
        f"train.batch_size={len(PAIRS)}",
        "train.lr=1e-6",
        f"alg.beta={beta}",
        "train.save_every=0",
    )
    padded = run_cli("dpo", tmp_path / "padded", *common, "data.packing=false")[0]
    packed = run_cli("dpo", tmp_path / "packed", *common, "data.packing=true")[0]
    for metrics in (padded, packed):
        for key in ("loss", "logps/chosen", "logps/rejected"):
            assert metrics[key] == pytest.approx(expected[key], abs=1e-4), key
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)


def _sgrpo(model_dir: Path, tmp_path: Path, name: str, *sets: str) -> dict:
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    return run_cli(
        "sgrpo",
        tmp_path / name,
        f"model.name={model_dir}",
        f"data.train={data}",
        "train.max_steps=1",
        f"train.batch_size={len(PROMPTS)}",
        "rollout.n=3",
        "rollout.max_new_tokens=8",
        f"reward.name={reward}:LengthReward",
        "train.save_every=0",
        "train.precision=fp32",
        *sets,
    )[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sgrpo_shared_prompts_match_the_rollout(family, arch_model, tmp_path):
    """Shared-prompt SGRPO's rollout/logprob_diff was 0.5-1.0 nats on the sliding-window families (4e-7 padded)."""
    model_dir = arch_model(family)
    padded = _sgrpo(model_dir, tmp_path, "padded", "data.packing=false")
    packed = _sgrpo(model_dir, tmp_path, "packed", "data.packing=true")
    for metrics in (padded, packed):
        assert metrics["rollout/logprob_diff"] < 1e-4, metrics
        assert metrics["rollout/logprob_diff_max"] < 1e-3, metrics
    for key in ("loss", "reward/mean"):
        assert packed[key] == pytest.approx(padded[key], abs=1e-4), key


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_ppo_runs_one_step(family, arch_model, tmp_path):
    model_dir = arch_model(family)
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    run = tmp_path / "ppo"
    metrics = run_cli(
        "ppo",
        run,
        f"model.name={model_dir}",
        f"data.train={data}",
        "train.max_steps=1",
        f"train.batch_size={len(PROMPTS)}",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        f"reward.name={reward}:LengthReward",
        "train.save_every=0",
        "train.precision=fp32",
    )
    assert [m["step"] for m in metrics] == [1] and math.isfinite(metrics[0]["loss"])
    assert metrics[0]["rollout/logprob_diff"] < 1e-4
    assert (run / "final" / "config.json").is_file()


def test_packed_sft_subprocess_on_a_sliding_window_model(arch_model, tmp_path):
    """The console script itself, once: packed SFT on Mistral (window 16) = plain transformers."""
    model_dir = arch_model("mistral")
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run = tmp_path / "run"
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={model_dir}",
        "--set",
        f"data.train={data}",
        "--set",
        "train.max_steps=1",
        "--set",
        f"train.batch_size={len(SFT_ROWS)}",
        "--set",
        "data.packing=true",
        "--set",
        "train.save_every=0",
        "-q",
        "-o",
        str(run),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_metrics(run)[0]["loss"] == pytest.approx(plain_sft_loss(model_dir, SFT_ROWS)[0], abs=1e-5)
    assert json.loads((run / "final" / "config.json").read_text())["sliding_window"] == WINDOW


def test_gemma2_soft_capping_is_what_transformers_sdpa_computes(arch_model, tmp_path):
    """Gemma-2's attention soft-capping: transformers' sdpa drops it (padded and packed alike), so oxRL's sdpa fast
    paths match it and say so; under eager (which applies it) packing goes through transformers' eager attention
    and packed SFT still equals plain per-sequence eager."""
    from oxrl_core.models.packed_attention import attention_fast_paths

    model, _ = _load(arch_model("gemma2"))
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 0.05  # small enough to matter on random weights
    ids = torch.randint(10, 500, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits
        model.set_attn_implementation("eager")
        capped = model(input_ids=ids).logits
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(input_ids=ids).logits
    torch.testing.assert_close(sdpa, uncapped, atol=1e-5, rtol=1e-5)  # sdpa ignores the soft-cap
    assert (sdpa - capped).abs().max() > 1e-3
    assert "dropped by transformers' 'sdpa'" in attention_fast_paths(model.config)["packing"][1]

    model_dir = arch_model("gemma2")
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    expected = plain_sft_loss(model_dir, SFT_ROWS, "eager")[0]
    common = (
        f"model.name={model_dir}",
        f"data.train={data}",
        "train.max_steps=1",
        f"train.batch_size={len(SFT_ROWS)}",
        "train.save_every=0",
        "model.attn_implementation=eager",
    )
    assert run_cli("sft", tmp_path / "padded", *common, "data.packing=false")[0]["loss"] == pytest.approx(
        expected, abs=1e-5
    )
    assert run_cli("sft", tmp_path / "packed", *common, "data.packing=true")[0]["loss"] == pytest.approx(
        expected, abs=1e-5
    )


def test_packing_falls_back_when_shared_prompts_do_not_apply(arch_model, tmp_path, monkeypatch):
    """An architecture outside the verified matrix: packed DPO falls back to ordinary packing and packed SGRPO
    to padded rows (decided once at setup) — still exact."""
    import oxrl_core.models.packed_attention as packed_attention

    monkeypatch.setattr(packed_attention, "SHARED_PREFIX_VERIFIED", frozenset())

    def never(*args, **kwargs):
        raise AssertionError("the shared-prefix path ran although attention_fast_paths ruled it out")

    monkeypatch.setattr(packed_attention, "_shared_prefix_attention", never)
    policy, ref = arch_model("mistral"), arch_model("mistral", seed=1)
    assert not packed_attention.attention_fast_paths(_load(policy)[0].config)["shared_prefix"][0]
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    loss = run_cli(
        "dpo",
        tmp_path / "dpo",
        f"model.name={policy}",
        f"model.ref={ref}",
        f"data.train={data}",
        "train.max_steps=1",
        f"train.batch_size={len(PAIRS)}",
        "alg.beta=2.0",
        "train.save_every=0",
        "data.packing=true",
    )[0]["loss"]
    assert loss == pytest.approx(plain_dpo_loss(policy, ref, PAIRS, 2.0), abs=1e-4)
    assert _sgrpo(policy, tmp_path, "sgrpo", "data.packing=true")["rollout/logprob_diff"] < 1e-4
