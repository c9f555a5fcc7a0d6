"""`perf/mfu`: the training FLOPs per token (hand-derived), the device peaks, and the metric in a real run."""

from __future__ import annotations

import torch
from conftest import oxrl, read_metrics

from oxrl_core.models.perf import mfu, peak_flops, train_flops_per_token


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def test_flops_per_token_is_6n_plus_12lht_and_frozen_weights_cost_4n():
    model = _tiny()
    # N by hand: embeddings and head 2·100·64; per layer q,k,v,o 4·64·64, MLP 3·64·128, two norms 2·64; final norm 64
    n = 2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert sum(p.numel() for p in model.parameters()) == n
    assert train_flops_per_token(model, 10) == 6 * n + 12 * 2 * 64 * 10
    model.lm_head.requires_grad_(False)  # f = (n - 6400) / n trainable
    f = (n - 6400) / n
    assert abs(train_flops_per_token(model, 10) - ((4 + 2 * f) * n + 12 * 2 * 64 * 10)) < 1e-6


def test_peaks_by_device_name_and_override(monkeypatch):
    monkeypatch.delenv("OXRL_PEAK_TFLOPS", raising=False)
    assert peak_flops(torch.device("cpu")) is None
    for name, tflops in [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Some Other GPU", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(torch.device("cuda", 0)) == (tflops * 1e12 if tflops else None), name
    monkeypatch.setenv("OXRL_PEAK_TFLOPS", "2.5")
    assert peak_flops(torch.device("cpu")) == 2.5e12


def test_mfu_is_achieved_over_peak_flops_of_every_device():
    assert mfu(1000.0, 6e6, 1e10, devices=2) == {"perf/mfu": 1000.0 * 6e6 / 2e10}
    assert mfu(1000.0, 6e6, None) == {}


def test_a_run_logs_mfu_when_the_peak_is_known(tmp_path, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    run = tmp_path / "sft"
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.batch_size=4",
        "-q",
        "-o",
        str(run),
        cwd=tmp_path,
        env={"OXRL_PEAK_TFLOPS": "0.5"},
    )
    assert proc.returncode == 0, proc.stderr
    config = AutoConfig.from_pretrained(tiny_model_dir)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    per_layer_token = 12 * config.num_hidden_layers * config.hidden_size
    for m in read_metrics(run):
        flops_per_token = m["perf/mfu"] * 0.5e12 / m["perf/tokens_per_s"]
        assert (
            6 * n + per_layer_token * 1 <= flops_per_token <= 6 * n + per_layer_token * 512
        )  # T between 1 and max length
    plain = tmp_path / "plain"
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.batch_size=4",
        "-q",
        "-o",
        str(plain),
        cwd=tmp_path,
        env={"OXRL_PEAK_TFLOPS": ""},
    )
    assert proc.returncode == 0 and "perf/mfu" not in read_metrics(plain)[0]  # CPU, no stated peak


def test_an_rl_run_logs_the_mfu_of_its_update_phase(tmp_path, tiny_model_dir):
    run = tmp_path / "sgrpo"
    proc = oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.batch_size=2",
        "--set",
        "rollout.max_new_tokens=4",
        "--set",
        "train.eval_every=0",
        "-q",
        "-o",
        str(run),
        cwd=tmp_path,
        env={"OXRL_PEAK_TFLOPS": "0.5"},
    )
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    m = read_metrics(run)[0]
    # the update phase: tokens × FLOPs/token over perf/train_s, so FLOPs/token = mfu · peak · train_s / tokens
    flops_per_token = m["perf/mfu"] * 0.5e12 * m["perf/train_s"] / m["perf/tokens"]
    assert 6 * n < flops_per_token < 6 * n + 12 * 2 * 64 * 512


def test_a_preference_run_logs_the_mfu_of_its_policy(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "dpo"
    proc = oxrl(
        "run",
        "--alg",
        "dpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.eval_every=0",
        "-q",
        "-o",
        str(run),
        cwd=tmp_path,
        env={"OXRL_PEAK_TFLOPS": "0.5"},
    )
    assert proc.returncode == 0, proc.stderr
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    for m in read_metrics(run):
        flops_per_token = m["perf/mfu"] * 0.5e12 / m["perf/tokens_per_s"]
        assert 6 * n < flops_per_token < 6 * n + 12 * 2 * 64 * 512


def test_the_run_meter_counts_once_what_mfu_counts_per_step(monkeypatch):
    from oxrl_core.models.perf import MfuMeter

    model = _tiny()
    monkeypatch.setenv("OXRL_PEAK_TFLOPS", "2")
    meter = MfuMeter(model, torch.device("cpu"), devices=2)
    assert meter(1000.0, 37) == mfu(1000.0, train_flops_per_token(model, 37), 2e12, devices=2)
    monkeypatch.delenv("OXRL_PEAK_TFLOPS")
    assert MfuMeter(model, torch.device("cpu"))(1000.0, 37) == {}
