"""Issue 14's fixes outside the attention paths, each with a test that fails on the old code:

- LoRA with the default targets on every family saves a `final/` that `from_pretrained` loads with no
  missing/unexpected keys (Qwen3-MoE used to save `mlp.experts.base_layer.*`, re-initialised at random)
  and that gives the adapter model's logits;
- PPO on a Gemma-3 multimodal-layout checkpoint (text config nested), both critic layouts;
- PPO's `clip/frac` counts the tokens whose clipped term is the active one of the min;
- a group of equal rewards gets exactly zero advantage in float32;
- the mismatch alarm: a backend whose logprobs are off stops the run (exit 2, one message, checkpoint kept);
- the vllm backend on the built-in task, held-out evaluation included (slow).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from archs import FAMILIES, LENGTH_REWARD, run_cli
from conftest import oxrl, read_metrics, write_jsonl

PROMPTS = [{"prompt": f"What is {a}+{b}? Think step by step.", "answer": str(a + b)} for a, b in ((1, 2), (4, 5))]


def _rl_sets(tmp_path: Path, model_dir: Path) -> list[str]:
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    return [
        f"model.name={model_dir}",
        f"data.train={data}",
        "train.max_steps=1",
        f"train.batch_size={len(PROMPTS)}",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        f"reward.name={reward}:LengthReward",
        "train.precision=fp32",
    ]


# ----------------------------------------------------------------------------- LoRA: default targets, every family


def _check_lora_final(final: Path, base_dir: Path) -> None:
    """`final/` loads with no missing/unexpected keys and gives base + `final/adapter`'s logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged, info = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), final / "adapter"
    )
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 23, 9, 40, 41, 12, 7, 30, 31]])
    with torch.no_grad():
        out_merged, out_adapter, out_base = (m.eval()(ids).logits for m in (merged, adapter, base))
    torch.testing.assert_close(out_merged, out_adapter, atol=2e-5, rtol=0)
    assert (out_merged - out_base).abs().max() > 1e-4  # the adapter learned something


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_default_targets_save_a_loadable_final(family, arch_model, tmp_path):
    """SFT with LoRA on the default targets (`all-linear`), one step at a high learning rate: the first loss is the
    base model's (plain transformers per row; the adapter starts at zero), and `final/` = base + adapter (so only
    the adapter changed)."""
    from test_archs import plain_sft_loss

    model_dir = arch_model(family)
    rows = [{"prompt": "What is 2+3?", "response": "The answer is 5."}, {"prompt": "What is 4+4?", "response": "8."}]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    run = tmp_path / "run"
    metrics = run_cli(
        "sft",
        run,
        f"model.name={model_dir}",
        f"data.train={data}",
        "train.max_steps=1",
        "train.batch_size=2",
        "train.lr=1e-2",
        "lora.enabled=true",
        "lora.r=4",
        "train.save_every=0",
        "train.precision=fp32",
    )
    assert metrics[0]["loss"] == pytest.approx(plain_sft_loss(model_dir, rows)[0], abs=1e-5)
    _check_lora_final(run / "final", model_dir)


def test_lora_default_targets_leave_moe_experts_router_and_vision_tower_out(arch_model):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from oxrl_core.config import LoraConfig
    from oxrl_core.models.lora import _peft_config

    cfg = LoraConfig(enabled=True, r=4)
    for family, absent in (
        ("qwen3_moe", ("experts", "mlp.gate")),
        ("qwen3_5_moe", ("experts", "mlp.gate", "shared_expert_gate")),
        ("gemma3_mm", ("vision_tower", "multi_modal_projector")),
    ):
        model = AutoModelForCausalLM.from_pretrained(arch_model(family))
        peft_model = get_peft_model(model, _peft_config(cfg, "lm", model))
        adapted = {k.rsplit(".lora_A", 1)[0] for k in peft_model.state_dict() if ".lora_A" in k}
        assert any("self_attn.q_proj" in k for k in adapted)
        if family == "qwen3_5_moe":  # the Gated DeltaNet projections and the shared expert are adapted
            assert any("linear_attn.in_proj_qkv" in k for k in adapted) and any("shared_expert." in k for k in adapted)
        assert not [k for k in adapted if any(a + "." in k + "." for a in absent)], sorted(adapted)


def test_hf_name_strips_every_peft_infix_and_a_bad_save_is_an_error(arch_model, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from oxrl_core.errors import OxrlError
    from oxrl_core.models.lora import hf_name, save_lora

    assert (
        hf_name("model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj")
        == "model.layers.0.mlp.experts.gate_up_proj"
    )
    assert hf_name("score.modules_to_save.default.weight") == "score.weight"
    assert hf_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    # PEFT's own all-linear on a MoE model (what oxRL used to pass through): the experts are wrapped twice,
    # the save now has the base model's names; a key the architecture lacks is refused
    model = AutoModelForCausalLM.from_pretrained(arch_model("qwen3_moe"))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # a trained-looking adapter, experts included
            param.data.normal_(0, 0.05)
    save_lora(tmp_path / "ok", peft_model)
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ok", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[5, 17, 23, 9, 40, 41, 12, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, atol=1e-5, rtol=0)
    import oxrl_core.models.lora as lora

    real = lora.hf_name
    try:
        lora.hf_name = lambda key: None if "lora_" in key else key.replace(".base_layer.", ".", 1)  # the old one
        with pytest.raises(OxrlError, match="missing: .*experts"):
            save_lora(tmp_path / "bad", peft_model)
    finally:
        lora.hf_name = real


# ----------------------------------------------------------------------------- PPO on Gemma-3 multimodal layout


@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_ppo_on_gemma3_multimodal_layout(layout, arch_model, tmp_path):
    model_dir = arch_model("gemma3_mm")
    run = tmp_path / "ppo"
    metrics = run_cli("ppo", run, *_rl_sets(tmp_path, model_dir), f"alg.critic={layout}", "train.save_every=0")
    assert [m["step"] for m in metrics] == [1] and math.isfinite(metrics[0]["loss"])
    assert (run / "final" / "config.json").is_file()


@pytest.mark.slow
def test_ppo_separate_critic_on_gemma3_multimodal_subprocess(arch_model, tmp_path):
    """The console script: the separate critic's backbone is the language model of the nested config."""
    sets = _rl_sets(tmp_path, arch_model("gemma3_mm")) + ["alg.critic=separate", "train.save_every=1"]
    run = tmp_path / "run"
    proc = oxrl("run", "--alg", "ppo", *[a for s in sets for a in ("--set", s)], "-q", "-o", str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    critic = torch.load(run / "final" / "critic.pt", weights_only=True)
    assert critic["head.weight"].shape == (1, 64)  # the text config's hidden size
    assert not [k for k in critic if "vision" in k]


# ----------------------------------------------------------------------------- PPO clip/frac, equal-reward advantage


def test_ppo_clip_frac_counts_the_tokens_whose_clipped_term_is_active():
    """ε = 0.2. Hand-derived, token by token (ρ, A) -> min(ρA, clip(ρ)A):
    (1.5, +1): min(1.5, 1.2) = 1.2 clipped;   (1.5, −1): min(−1.5, −1.2) = −1.5 unclipped;
    (0.5, +1): min(0.5, 0.8) = 0.5 unclipped; (0.5, −1): min(−0.5, −0.8) = −0.8 clipped;
    (1.1, +1): inside the range. clip/frac = 2/5 (the old |ρ−1| > ε count gave 4/5)."""
    from oxrl_algs_rl.ppo import PPO

    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
    logp_old = torch.full_like(ratio, -1.0)
    logp = (logp_old + ratio.log()).requires_grad_()
    zeros = torch.zeros_like(ratio)
    batch = {
        "logp": logp,
        "logp_old": logp_old,
        "adv": adv,
        "mask": torch.ones_like(ratio),
        "values_new": zeros,
        "values": zeros,
        "returns": zeros,
        "entropy": zeros,
    }
    loss, metrics = PPO().loss(batch)
    assert float(metrics["clip/frac"]) == pytest.approx(2 / 5)
    # independently: the clipped tokens are exactly those with no gradient through ρ
    loss.backward()
    assert (logp.grad == 0).float().mean().item() == pytest.approx(2 / 5)


def test_equal_rewards_get_exactly_zero_advantage_in_float32():
    """Group 1: eight rewards of 0.1 (float32: mean ≠ 0.1 by 7e-9, std 8e-9 — the old std > 0 test let
    A = −7.45e-5 through). Group 2: four 0.1 and four 0.3: mean 0.2, sample std sqrt(8·0.01/7) = 0.1069045,
    A = ±0.1 / (0.1069045 + 1e-4) = ±0.934540."""
    from oxrl_core.ops import group_advantages

    rewards = torch.tensor([0.1] * 8 + [0.1] * 4 + [0.3] * 4, dtype=torch.float32)
    adv = group_advantages(rewards, 8)
    assert torch.equal(adv[:8], torch.zeros(8))
    assert adv[8:].tolist() == pytest.approx([-0.934540] * 4 + [0.934540] * 4, abs=1e-5)
    assert torch.equal(group_advantages(rewards, 8, scale=False)[:8], torch.zeros(8))  # Dr. GRPO too


# ----------------------------------------------------------------------------- mismatch alarm

OFFSET_BACKEND = (
    "from oxrl_core.rollout.hf import HFRolloutBackend\n\n"
    "class OffsetBackend(HFRolloutBackend):\n"
    "    '''The hf backend, whose logprobs are 0.5 nats off once the policy has been updated.'''\n\n"
    "    def generate(self, prompt_token_ids, sampling):\n"
    "        groups = super().generate(prompt_token_ids, sampling)\n"
    "        if self.policy_version >= 1:\n"
    "            for group in groups:\n"
    "                for c in group:\n"
    "                    c.logprobs[:] = [lp - 0.5 for lp in c.logprobs]\n"
    "        return groups\n"
)


@pytest.mark.slow
def test_mismatch_alarm_stops_the_run_and_keeps_the_checkpoint(arch_model, tmp_path):
    backend = tmp_path / "offset_backend.py"
    backend.write_text(OFFSET_BACKEND)
    sets = _rl_sets(tmp_path, arch_model("qwen3")) + [
        "train.max_steps=2",
        "train.save_every=1",
        f"rollout.backend={backend}:OffsetBackend",
    ]
    run = tmp_path / "run"
    proc = oxrl("run", "--alg", "sgrpo", *[a for s in sets for a in ("--set", s)], "-q", "-o", str(run), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "step 2: rollout/logprob_diff = 0.5" in out and "rollout.max_logprob_diff = 0.01" in out, out
    assert "stale" in out and "packing" in out and "precision" in out
    ckpt = run / "checkpoints" / "step-1"
    assert str(ckpt) in out and (ckpt / "config.json").is_file()
    assert [m["step"] for m in read_metrics(run)] == [1]
    assert read_metrics(run)[0]["rollout/logprob_diff"] < 1e-4  # fp32 hf: the alarm's default margin is real
    assert not (run / "final").exists()
