"""LoRA with the `vllm` rollout backend: the trainer's adapter pushed to vLLM as an adapter (in
memory, a new adapter id per policy version), verified by the probe check; LoRA runs through the
real CLI in both sync modes; and the saved `final/` (merged weights, and `final/adapter`) loaded by
vLLM gives the adapter model's log-probabilities.

Skipped, with the reason, when vLLM does not import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e 'plugins/oxrl-vllm[cpu]' or '[gpu]')")

from conftest import oxrl, read_metrics
from test_rollout_hf import PROMPTS, teacher_forced_logprobs, tokens
from test_vllm import vllm_run

from oxrl_core.config import LoraConfig, RolloutConfig
from oxrl_core.data.encode import encode_prompt
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import SamplingParams
from oxrl_core.models.loading import load_causal_lm, load_tokenizer
from oxrl_core.models.lora import apply_lora
from oxrl_core.rollout.hf import HFRolloutBackend
from oxrl_core.rollout.sync import check_weight_sync, probe_sequence
from oxrl_vllm.backend import VLLMRolloutBackend

LORA = ["--set", "lora.enabled=true", "--set", "lora.r=4", "--set", "lora.alpha=8"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The trainer's PEFT model (rank 4 on every linear layer); tests that change it restore it."""
    return apply_lora(load_causal_lm(str(tiny_model_dir)), LoraConfig(enabled=True, r=4, alpha=8))


@pytest.fixture(scope="module")
def engine(model, tokenizer, tiny_model_dir):
    backend = VLLMRolloutBackend.build(
        model, tokenizer, str(tiny_model_dir), RolloutConfig(backend="vllm", lora="adapter")
    )
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [encode_prompt(tokenizer, p) for p in PROMPTS]


def _lora_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_the_engine_serves_the_adapter_from_the_start(engine, model, tokenizer, prompt_ids):
    assert engine.adapter and engine.lora_request is not None and engine.lora_request.lora_int_id == 1
    probe = probe_sequence(tokenizer, prompt_ids[0])
    assert check_weight_sync(engine, model, probe, 0, 1e-3, nullcontext)["sync/probe_logprob_diff"] < 1e-5


def test_a_pushed_adapter_gives_the_trainers_logprobs_and_leaves_its_tensors_alone(
    engine, model, tokenizer, prompt_ids
):
    """Train-like change of lora_B (the base stays frozen): stale until the push, exact after it;
    generations follow the adapter model, and the trainer's tensors are not touched by vLLM."""
    probe = probe_sequence(tokenizer, prompt_ids[0])
    original = _lora_tensors(model)
    start = engine.policy_version
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
        with pytest.raises(OxrlError, match=f"policy version {start + 1}"):
            check_weight_sync(engine, model, probe, start + 1, 1e-3, nullcontext)
        pushed = _lora_tensors(model)
        engine.update_weights(model, start + 1)
        assert all(torch.equal(p.detach(), pushed[n]) for n, p in model.named_parameters() if "lora_" in n)
        assert engine.lora_request.lora_int_id == start + 2
        assert engine.llm.llm_engine.list_loras() == {start + 2}  # the previous version's adapter is gone
        assert check_weight_sync(engine, model, probe, start + 1, 1e-3, nullcontext)["sync/probe_logprob_diff"] < 1e-4
        greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
        got = engine.generate(prompt_ids, greedy)
        assert tokens(got) == tokens(HFRolloutBackend(model, tokenizer).generate(prompt_ids, greedy))
        assert all(c.policy_version == start + 1 for g in got for c in g)
        for prompt, group in zip(prompt_ids, got):
            torch.testing.assert_close(
                torch.tensor(group[0].logprobs),
                teacher_forced_logprobs(model, prompt, group[0].token_ids),
                atol=1e-4,
                rtol=0,
            )
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in original:
                    p.copy_(original[name])
        engine.update_weights(model, engine.policy_version + 1)
    assert (
        check_weight_sync(engine, model, probe, engine.policy_version, 1e-3, nullcontext)["sync/probe_logprob_diff"]
        < 1e-5
    )


def test_lora_auto_merges_on_cpu(tiny_model_dir, tokenizer, model, monkeypatch):
    """`auto` pushes adapters on a GPU only; on CPU it syncs merged weights (vLLM's CPU LoRA kernels are slow).
    Checked without starting a second engine: the engine arguments are captured."""
    import vllm

    seen = {}

    class Captured(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Captured

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    for mode, lora_enabled in [("auto", False), ("merged", False), ("adapter", True)]:
        seen.clear()
        with pytest.raises(OxrlError, match="did not start"):
            VLLMRolloutBackend.build(model, tokenizer, str(tiny_model_dir), RolloutConfig(backend="vllm", lora=mode))
        assert seen.get("enable_lora", False) is lora_enabled, mode
    assert seen["max_lora_rank"] == 8 and seen["max_loras"] == 1  # rank 4 served in vLLM's smallest bucket >= 4


def test_adapter_mode_needs_the_peft_model(engine, model):
    with pytest.raises(OxrlError, match="PEFT model"):
        engine.update_weights(model.get_base_model().state_dict(), engine.policy_version + 1)


def test_a_rank_vllm_cannot_serve_is_refused_before_the_engine_starts(tiny_model_dir, tokenizer):
    big = apply_lora(load_causal_lm(str(tiny_model_dir)), LoraConfig(enabled=True, r=1024, alpha=8))
    with pytest.raises(OxrlError, match="lora.r: vLLM serves adapters up to rank 512, got 1024"):
        VLLMRolloutBackend.build(big, tokenizer, str(tiny_model_dir), RolloutConfig(backend="vllm", lora="adapter"))


# ----------------------------------------------------------------------------- the real CLI and final/ in vLLM

#: run in a fresh process (one vLLM engine per process): prompt logprobs of `ids` from vLLM serving
#: the merged `final/`, and from vLLM serving the base model with `final/adapter` as a disk adapter
SCORE_FINAL = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.lora.request import LoRARequest

if __name__ == "__main__":
    model_dir, adapter_dir, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    kwargs = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**28, seed=0)
    lora = None
    if adapter_dir:
        kwargs.update(enable_lora=True, max_lora_rank=8)
        lora = LoRARequest("final", 1, adapter_dir)
    out = LLM(model=model_dir, **kwargs).generate([TokensPrompt(prompt_token_ids=ids)], params, lora_request=lora, use_tqdm=False)
    print("LOGPROBS", json.dumps([p[t].logprob for p, t in zip(out[0].prompt_logprobs[1:], ids[1:])]))
"""


def _vllm_logprobs(tmp_path: Path, model_dir: Path, adapter_dir: Path | None, ids: list[int]) -> torch.Tensor:
    script = tmp_path / "score_final.py"
    script.write_text(SCORE_FINAL)
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(adapter_dir or ""), json.dumps(ids)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **os.environ},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("LOGPROBS "))
    return torch.tensor(json.loads(line.split(" ", 1)[1]))


def _adapter_model_logprobs(base_dir: Path, adapter_dir: Path, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)  # (L-1, V)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _check_final_in_vllm(tmp_path: Path, final: Path, base_dir: Path, tokenizer) -> None:
    ids = probe_sequence(tokenizer, encode_prompt(tokenizer, PROMPTS[0]))
    want = _adapter_model_logprobs(base_dir, final / "adapter", ids)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        base_logp = torch.log_softmax(base(torch.tensor([ids])).logits[0, :-1], -1).gather(
            -1, torch.tensor(ids[1:])[:, None]
        )[:, 0]
    assert (want - base_logp).abs().max() > 1e-3  # the adapter learned something the comparison can see
    torch.testing.assert_close(_vllm_logprobs(tmp_path, final, None, ids), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(_vllm_logprobs(tmp_path, base_dir, final / "adapter", ids), want, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["adapter", "auto"])
def test_cli_lora_sgrpo_with_vllm_verifies_every_sync(tmp_path, tiny_model_dir, tokenizer, mode):
    run = tmp_path / "run"
    proc = vllm_run(
        tmp_path,
        tiny_model_dir,
        "--set",
        "rollout.backend=vllm",
        "--set",
        f"rollout.lora={mode}",
        *LORA,
        "--set",
        "train.lr=5e-2",
        "--set",
        "train.max_steps=3",
        "-q",
        "-o",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_metrics(run)
    assert [m["policy/version"] for m in metrics] == [0.0, 1.0, 2.0]
    assert all(m["grad_norm"] > 0 for m in metrics)  # the adapter changes, so the later steps' samples prove the sync
    for m in metrics:
        assert m["sync/probe_logprob_diff"] < 1e-4 and m["rollout/logprob_diff"] < 1e-4
    if mode == "adapter":  # final/ (merged) and final/adapter, each served by vLLM = the adapter model
        _check_final_in_vllm(tmp_path, run / "final", tiny_model_dir, tokenizer)


@pytest.mark.slow
def test_lora_sft_final_loads_in_vllm_with_the_adapter_models_logprobs(tmp_path, tiny_model_dir, tokenizer):
    run = tmp_path / "sft"
    proc = oxrl(
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
        "-q",
        "-o",
        str(run),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    _check_final_in_vllm(tmp_path, run / "final", tiny_model_dir, tokenizer)


def test_cli_bad_lora_mode_is_a_clear_error(tmp_path, tiny_model_dir):
    proc = oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "rollout.backend=vllm",
        *LORA,
        "--set",
        "rollout.lora=fused",
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "rollout.lora" in proc.stderr and "adapter" in proc.stderr
