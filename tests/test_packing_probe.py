"""The load-time packing probe (`models.packing_probe`): packing, shared prompts and the hf backend's prefill-once
cache apply only where a packed row of the loaded model equals its sequences' separate forwards.

Models whose packed forward differs: Qwen3.5 without oxRL's per-sequence linear attention (its Gated DeltaNet state
runs from one sequence into the next: the bug of issue 44) and a tiny Mamba2 (a stateful mixer with no layer types
to flag it). Qwen3-Next has Qwen3.5's layers and passes with them. `oxrl run` says which way `data.packing: auto`
went; the matrix (tests/test_archs.py) checks that the probe passes on every family there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from archs import LENGTH_REWARD, build_tokenizer
from conftest import read_metrics, write_jsonl
from test_archs import PROMPTS, SFT_ROWS, plain_sft_loss


def _save_mamba2(out_dir: Path) -> Path:
    """A tiny Mamba2 (2 layers, hidden 64) with a ChatML byte-level BPE tokenizer, saved as a plain HF directory."""
    import transformers as tf

    tokenizer = build_tokenizer("qwen3")
    config = tf.Mamba2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=32,
        state_size=16,
        n_groups=1,
        expand=2,
        chunk_size=32,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    tf.Mamba2ForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _qwen3_next():
    import transformers as tf

    config = tf.Qwen3NextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return tf.Qwen3NextForCausalLM(config)


def test_probe_steps_aside_where_a_packed_row_differs(arch_model, tmp_path):
    """A boundary-blind model fails the probe (with a note naming its model type) and loses the prefill-once cache;
    the same model with per-sequence linear attention, and Qwen3-Next with it, pass."""
    from transformers import AutoModelForCausalLM

    from oxrl_core.models import packing_probe
    from oxrl_core.models.linear_attention import per_sequence_linear_attention
    from oxrl_core.models.packed_attention import packed_attn_implementation
    from oxrl_core.rollout.hf import HFRolloutBackend

    packing_probe._CACHE.clear()
    packed = packed_attn_implementation("sdpa")
    blind = AutoModelForCausalLM.from_pretrained(arch_model("qwen3_5"), dtype=torch.float32, attn_implementation=packed)
    verdict = packing_probe.probe(blind, shared_prefix=True)  # transformers' layers as they are: boundary-blind
    assert not verdict.packing and not verdict.shared_prefix and verdict.packing_diff > 1e-3, verdict
    note = verdict.note()
    assert "model type 'qwen3_5_text'" in note and "padded" in note and f"{verdict.packing_diff:.3g}" in note
    assert not packing_probe.allows_prefill_once(blind)
    backend = HFRolloutBackend(blind, build_tokenizer("qwen3_5"))
    ids, mask = torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long)
    assert backend._prefilled_cache(ids, mask, n=2, capacity=8) is None

    assert per_sequence_linear_attention(blind) == 1
    packing_probe._CACHE.clear()
    fixed = packing_probe.probe(blind, shared_prefix=True)
    assert fixed.packing and fixed.shared_prefix and fixed.packing_diff <= 1e-5, fixed
    assert packing_probe.allows_prefill_once(blind)

    qwen3_next = _qwen3_next()
    qwen3_next.set_attn_implementation(packed)
    assert not packing_probe.probe(qwen3_next).packing  # transformers' Qwen3-Next is boundary-blind on a CPU too
    assert per_sequence_linear_attention(qwen3_next) == 1
    packing_probe._CACHE.clear()
    assert packing_probe.probe(qwen3_next, shared_prefix=True).shared_prefix

    mamba = AutoModelForCausalLM.from_pretrained(_save_mamba2(tmp_path / "mamba2"), dtype=torch.float32)
    verdict = packing_probe.probe(mamba)
    assert not verdict.packing and "model type 'mamba2'" in verdict.note(), verdict


def _run(alg: str, run_dir: Path, *sets: str) -> str:
    """`oxrl run --alg ALG --set ...` in process, not quiet: what it printed."""
    from typer.testing import CliRunner

    from oxrl_core.cli import app

    args = ["run", "--alg", alg, "-o", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"oxrl {' '.join(args)} failed:\n{result.output}\n{result.exception!r}"
    return result.output


def test_packing_auto_says_on_or_off_and_why(arch_model, tmp_path):
    """`data.packing` unset (auto): SFT and SGRPO on Qwen3.5 say packing is on; SFT on Mamba2 says it is off and why,
    and trains on padded rows (the same loss as data.packing=false)."""
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    model_dir = arch_model("qwen3_5")
    common = (f"data.train={data}", "train.max_steps=1", f"train.batch_size={len(SFT_ROWS)}", "train.save_every=0")
    out = _run("sft", tmp_path / "sft", f"model.name={model_dir}", *common)
    assert "data.packing: on (auto)" in out and "qwen3_5_text" in out, out
    assert read_metrics(tmp_path / "sft")[0]["loss"] == pytest.approx(plain_sft_loss(model_dir, SFT_ROWS)[0], abs=1e-5)

    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    out = _run(
        "sgrpo",
        tmp_path / "sgrpo",
        f"model.name={model_dir}",
        f"data.train={write_jsonl(tmp_path / 'prompts.jsonl', PROMPTS)}",
        "train.max_steps=1",
        f"train.batch_size={len(PROMPTS)}",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        f"reward.name={reward}:LengthReward",
        "train.save_every=0",
    )
    assert "data.packing: on (auto)" in out, out

    mamba = (f"model.name={_save_mamba2(tmp_path / 'mamba2')}", "model.attn_implementation=eager")  # it has no sdpa
    out = _run("sft", tmp_path / "mamba-auto", *mamba, *common)
    assert "packing off for model type 'mamba2'" in out and "data.packing: on" not in out, out
    _run("sft", tmp_path / "mamba-padded", *mamba, *common, "data.packing=false")
    auto, padded = (read_metrics(tmp_path / name)[0] for name in ("mamba-auto", "mamba-padded"))
    assert auto["loss"] == padded["loss"] and auto["grad_norm"] == padded["grad_norm"]
