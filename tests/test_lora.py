"""LoRA through PEFT: runs of the real CLI save merged HF weights (PEFT prefixes stripped) and the
adapter; both give the adapter model's log-probabilities; resume continues the same adapter."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import oxrl, read_metrics

LORA = ["--set", "lora.enabled=true", "--set", "lora.r=4", "--set", "lora.alpha=8"]


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1)


def _check_final(final: Path, base_dir: Path, cls_name: str = "AutoModelForCausalLM") -> None:
    """`final/` is a plain HF model (no PEFT names) whose outputs equal base + `final/adapter`."""
    import transformers
    from peft import PeftModel
    from safetensors import safe_open

    with safe_open(str(final / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not [k for k in keys if "lora_" in k or "base_layer" in k or "base_model" in k or "modules_to_save" in k]
    assert (final / "adapter" / "adapter_config.json").is_file()
    auto = getattr(transformers, cls_name)
    kwargs = {"num_labels": 1} if "Sequence" in cls_name else {}
    merged = auto.from_pretrained(final, **kwargs).eval()
    adapter = PeftModel.from_pretrained(auto.from_pretrained(base_dir, **kwargs), final / "adapter").eval()
    base = auto.from_pretrained(base_dir, **kwargs).eval()
    ids = torch.tensor([[5, 17, 23, 9, 40, 41, 12, 7]])
    with torch.no_grad():
        out_merged, out_adapter, out_base = merged(ids).logits, adapter(ids).logits, base(ids).logits
    torch.testing.assert_close(out_merged, out_adapter, atol=2e-5, rtol=0)
    assert (out_merged - out_base).abs().max() > 1e-4  # the adapter learned something


@pytest.mark.slow
def test_lora_sft_saves_merged_weights_and_adapter(tmp_path, tiny_model_dir):
    run = tmp_path / "sft"
    proc = _ok(
        oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={tiny_model_dir}",
            *LORA,
            "--set",
            "train.max_steps=8",
            "--set",
            "train.batch_size=8",
            "--set",
            "train.lr=1e-2",
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    assert "LoRA" in proc.stderr  # the trainable share is reported
    losses = [m["loss"] for m in read_metrics(run)]
    assert losses[-1] < losses[0]
    _check_final(run / "final", tiny_model_dir)


@pytest.mark.slow
def test_lora_sgrpo_saves_merged_weights_and_adapter(tmp_path, tiny_model_dir):
    run = tmp_path / "sgrpo"
    reward = tmp_path / "length_reward.py"  # varies between samples, so advantages (and updates) are non-zero
    reward.write_text(
        "from oxrl_core import Reward\n\n"
        "class LengthReward(Reward):\n"
        "    name = 'length'\n\n"
        "    def score(self, prompts, completions, examples):\n"
        "        return [float(len(c)) for c in completions]\n"
    )
    _ok(
        oxrl(
            "run",
            "--alg",
            "sgrpo",
            "--set",
            f"model.name={tiny_model_dir}",
            *LORA,
            "--set",
            "train.max_steps=3",
            "--set",
            "train.batch_size=4",
            "--set",
            "rollout.n=4",
            "--set",
            "rollout.max_new_tokens=6",
            "--set",
            "train.lr=5e-2",
            "--set",
            f"reward.name={reward}:LengthReward",
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    _check_final(run / "final", tiny_model_dir)


@pytest.mark.slow
def test_lora_reward_model_final_is_a_sequence_classifier(tmp_path, tiny_model_dir):
    run = tmp_path / "rm"
    _ok(
        oxrl(
            "run",
            "--alg",
            "rm",
            "--set",
            f"model.name={tiny_model_dir}",
            *LORA,
            "--set",
            "train.max_steps=3",
            "--set",
            "train.batch_size=8",
            "--set",
            "train.lr=1e-2",
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    # the adapter carries the trained `score` head (PEFT modules_to_save): base + adapter = the merged final/
    _check_final(run / "final", tiny_model_dir, "AutoModelForSequenceClassification")


@pytest.mark.slow
def test_lora_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """Resume from step 3's checkpoint (base model + the checkpoint's adapter): steps 4-6 and final/ are the same."""
    import shutil

    sets = [
        "--set",
        f"model.name={tiny_model_dir}",
        *LORA,
        "--set",
        "train.batch_size=8",
        "--set",
        "train.lr=1e-2",
        "--set",
        "train.save_every=3",
        "--set",
        "train.max_steps=6",
    ]
    full = tmp_path / "full"
    _ok(oxrl("run", "--alg", "sft", *sets, "-o", str(full), "--quiet", cwd=tmp_path))
    cut = tmp_path / "cut"  # the same run as if it had been killed after its step-3 checkpoint
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "final")
    (cut / "summary.json").unlink()
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    _ok(oxrl("run", "--resume", "-o", str(cut), "--quiet", cwd=tmp_path))
    assert [m["loss"] for m in read_metrics(cut)] == pytest.approx([m["loss"] for m in read_metrics(full)], abs=1e-6)
    from safetensors.torch import load_file

    a, b = load_file(full / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


def test_lora_bad_target_modules_is_a_clear_error(tmp_path, tiny_model_dir):
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        *LORA,
        "--set",
        "lora.target_modules=[no_such_proj]",
        "-o",
        str(tmp_path / "r"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "lora.target_modules" in proc.stderr and "no_such_proj" in proc.stderr
