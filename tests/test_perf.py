"""`perf/mfu`: the training FLOPs per token (hand-derived), the device peaks, and the metric in a real run."""

from __future__ import annotations

import torch
from conftest import oxrl, read_metrics

from oxrl_core.models.perf import mfu, peak, peak_flops, train_flops


def _llama(vocab: int, hidden: int, mlp: int):
    """A 2-layer Llama with one head as wide as the model and an untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=hidden,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _tiny():
    return _llama(100, 64, 128)


def _small():
    """A Llama small enough to count by hand: vocabulary 10, hidden 4, MLP 8, 2 layers, one head of 4."""
    return _llama(10, 4, 8)


def test_step_flops_of_a_packed_micro_batch_by_hand():
    model = _small()
    # N by hand: embeddings + head 2·10·4 = 80; per layer q,k,v,o 4·4·4 = 64, MLP 3·4·8 = 96, two norms 2·4 = 8
    # (168, × 2 layers = 336); final norm 4. N = 80 + 336 + 4 = 420
    assert sum(p.numel() for p in model.parameters()) == 420
    # two packed rows: [3 + 5] and [4]; the sequences are 3, 5 and 4 tokens long (each packed one on its own)
    # tokens = 3 + 5 + 4 = 12, Σ T² = 9 + 25 + 16 = 50
    # weights: 6·N·tokens = 6·420·12 = 30,240; attention: 12·L·H·Σ T² = 12·2·4·50 = 96·50 = 4,800
    assert train_flops(model, 12, 50) == 35_040
    # (the count this replaces took T = tokens / rows = 6 for every token: 96·6·12 = 6,912 for the attention)
    assert train_flops(model, 12, 50) != 30_240 + 6_912
    # MFU over 2 s on one device of 10 kFLOP/s: 35,040 / (2 · 10,000) = 1.752; on two devices half that
    assert mfu(35_040, 2.0, 1e4) == {"perf/mfu": 1.752}
    assert mfu(35_040, 2.0, 1e4, devices=2) == {"perf/mfu": 0.876}
    assert mfu(35_040, 2.0, None) == {}
    # the head frozen (LoRA-like): its 40 weights need no weight gradient, f = 380/420, (4 + 2f)·N = 4·420 + 2·380
    model.lm_head.requires_grad_(False)
    assert train_flops(model, 12, 50) == (4 * 420 + 2 * 380) * 12 + 4_800  # 2,440·12 + 4,800 = 34,080


def test_preference_rows_count_each_sequence_by_hand():
    from oxrl_core.loops.preference import policy_square_lengths

    pair = {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]}  # p = 3, c = 2, r = 1
    # chosen (3 + 2)² + rejected (3 + 1)² = 25 + 16
    assert policy_square_lengths([pair]) == 41
    # shared prompt: p² + c·(p + c) + r·(p + r) = 9 + 2·5 + 1·4 = 23
    assert policy_square_lengths([pair], shared=True) == 23
    # self-play: the generated rejected response (4 tokens) replaces the row's: 25 + (3 + 4)² = 74
    assert policy_square_lengths([pair], rejected=[[7, 8, 9, 9]]) == 74
    # unpaired (KTO): one sequence of prompt + completion, (2 + 3)² + (1 + 1)² = 29
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5]}, {"prompt_ids": [1], "completion_ids": [2]}]
    assert policy_square_lengths(rows) == 29


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
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak(torch.device("cuda", 0)) == (
        756e12,
        "756 TFLOP/s per device (NVIDIA H100 PCIe: H100 PCIe dense bf16, datasheet)",
    )
    monkeypatch.setenv("OXRL_PEAK_TFLOPS", "2.5")
    assert peak_flops(torch.device("cpu")) == 2.5e12


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


def test_a_packed_sft_step_reports_the_mfu_of_its_sequences(tmp_path, tiny_model_dir):
    """One step over all four rows, packed into one micro-batch row: perf/mfu · peak · perf/step_s is the hand
    formula over the four sequences' own lengths, not over one sequence of their summed length."""
    from conftest import write_jsonl
    from transformers import AutoConfig

    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_source
    from oxrl_core.models.loading import count_parameters, load_causal_lm, load_tokenizer

    rows = [{"prompt": "What is 2+2?", "response": "4"}, {"prompt": "Say hello", "response": "hello there, friend"}]
    rows += [{"prompt": "Count to five", "response": "1 2 3 4 5"}, {"prompt": "x", "response": "y"}]
    data = write_jsonl(tmp_path / "four.jsonl", rows)
    run = tmp_path / "packed"
    args = ["run", "--alg", "sft", "--set", f"model.name={tiny_model_dir}", "--set", f"data.train={data}"]
    args += ["--set", "data.packing=true", "--set", "train.batch_size=4", "--set", "train.max_steps=1", "-o", str(run)]
    proc = oxrl(*args, cwd=tmp_path, env={"OXRL_PEAK_TFLOPS": "0.5"})
    assert proc.returncode == 0, proc.stderr
    assert "MFU against 0.5 TFLOP/s per device (OXRL_PEAK_TFLOPS) × 1" in proc.stderr  # the banner names the peak
    m = read_metrics(run)[0]
    assert m["perf/micro_batches"] == 1  # one packed row holds the four sequences
    # the sequences' lengths as the loop encodes them (chat template + response + EOS)
    examples = prepare_examples(
        load_source(str(data), "train"), "prompt_response", load_tokenizer(str(tiny_model_dir)), 512
    )
    lengths = [len(e["input_ids"]) for e in examples.examples]
    assert len(set(lengths)) == 4 and sum(lengths) == m["perf/tokens"]
    config = AutoConfig.from_pretrained(tiny_model_dir)
    n, attention = (
        count_parameters(load_causal_lm(str(tiny_model_dir))),
        12 * config.num_hidden_layers * config.hidden_size,
    )
    # step FLOPs = 6·N·Σ T + 12·L·H·Σ T², all trainable
    expected = 6 * n * sum(lengths) + attention * sum(t * t for t in lengths)
    flops = m["perf/mfu"] * 0.5e12 * m["perf/step_s"]
    assert abs(flops - expected) <= 1e-9 * expected
    # the packed row counted as one sequence of Σ T tokens would be 12·L·H·(Σ T)²: far more
    assert 6 * n * sum(lengths) + attention * sum(lengths) ** 2 > 1.05 * expected


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
    assert meter(1000, 37_000, 0.5) == mfu(train_flops(model, 1000, 37_000), 0.5, 2e12, devices=2)
    assert meter.describe() == "MFU against 2 TFLOP/s per device (OXRL_PEAK_TFLOPS) × 2"
    monkeypatch.delenv("OXRL_PEAK_TFLOPS")
    assert MfuMeter(model, torch.device("cpu"))(1000, 37_000, 0.5) == {}
    assert MfuMeter(model, torch.device("cpu")).describe() == ""
