"""`oxrl check-model PATH`: the onboarding report on every family of the architecture matrix
(tests/archs.py), on deliberately broken models, and on paths that are not models at all."""

from __future__ import annotations

import json

import pytest
from archs import FAMILIES, LINEAR_ATTENTION, WINDOW, build_broken
from conftest import oxrl


def check(*args: str):
    """The real CLI in-process: (exit status, output)."""
    from typer.testing import CliRunner

    from oxrl_core.cli import app

    result = CliRunner().invoke(app, ["check-model", *map(str, args)], terminal_width=200)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def report_of(path) -> tuple[int, dict]:
    status, output = check(path, "--json")
    return status, json.loads(output)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    return {kind: build_broken(kind, root / kind) for kind in ("no_chat_template", "no_eos")}


#: what each family must report: (sliding window, attention soft-cap, final soft-cap, experts, nested text config)
EXPECTED = {
    "llama": (None, None, None, None, False),
    "qwen2": (None, None, None, None, False),
    "qwen3": (None, None, None, None, False),
    "qwen3_moe": (None, None, None, "experts", False),
    "gemma2": (WINDOW, "cap", "cap", None, False),
    "gemma3": (WINDOW, None, None, None, False),
    "gemma3_mm": (WINDOW, None, None, None, True),
    "mistral": (WINDOW, None, None, None, False),
    "phi3": (WINDOW, None, None, None, False),
    "olmo2": (None, None, None, None, False),
    "qwen3_5": (None, None, None, None, False),
    "qwen3_5_moe": (None, None, None, "experts", False),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_check_model_reports_each_family(arch_model, family):
    """Every matrix family: trainable (exit 0), its features reported, numbers equal to an independent load."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = arch_model(family)
    status, report = report_of(path)
    assert status == 0 and report["ok"], report["problems"]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = AutoConfig.from_pretrained(path).get_text_config()
    assert report["architecture"] == type(model).__name__
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert report["vocab"] == {
        "config": text.vocab_size,
        "embedding_rows": model.get_input_embeddings().weight.shape[0],
        "tokenizer": len(tokenizer),
    }
    assert report["tokens"]["eos"]["id"] == tokenizer.eos_token_id is not None
    assert report["attention"]["head_dim"] == 64 and report["paths"]["vllm_cpu"]["applies"]
    assert report["attention"]["num_kv_heads"] == text.num_key_value_heads

    window, softcap, final_softcap, experts, nested = EXPECTED[family]
    assert report["attention"]["sliding_window"] == window
    assert (report["attention"]["attn_logit_softcapping"] is not None) == bool(softcap)
    assert (report["attention"]["final_logit_softcapping"] is not None) == bool(final_softcap)
    assert report["nested_text_config"] is nested
    if experts:
        assert report["moe"]["num_experts"] == text.num_experts > 1
        # oxRL's default LoRA targets leave the fused experts and the router out
        assert (
            not {"experts", "gate"} & set(report["lora_targets"])
            and "left out: experts" in report["paths"]["lora"]["detail"]
        )
    else:
        assert report["moe"] is None
    if nested:
        assert report["model_type"] == "gemma3" and report["text_model_type"] == "gemma3_text"
        assert "vision_tower" in report["paths"]["lora"]["detail"]
    assert report["paths"]["critic"]["applies"] and str(text.hidden_size) in report["paths"]["critic"]["detail"]
    # the hf backend's prefill-once cache is only for plain full-attention caches (not sliding, not linear attention)
    assert report["paths"]["hf_prefill_cache"]["applies"] is (window is None and family not in LINEAR_ATTENTION)
    assert report["paths"]["packing"]["applies"] and report["paths"]["chunked_logits"]["applies"]
    assert "measured: a packed row = the separate forwards" in report["paths"]["packing"]["detail"]
    if family in LINEAR_ATTENTION:  # LoRA's all-linear includes the Gated DeltaNet projections
        assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"} <= set(report["lora_targets"])
    # LoRA adapts the attention projections (Phi-3's are fused into qkv_proj), never the output head
    assert {"q_proj", "qkv_proj"} & set(report["lora_targets"]) and "lm_head" not in report["lora_targets"]

    chat = report["chat_template"]
    assert (
        chat["present"]
        and chat["renders_conversation"]
        and chat["renders_generation_prompt"]
        and chat["completion_follows"]
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith(chat["prompt_tail"])


def test_check_model_table(arch_model):
    """The rich table names the features (gemma2: sliding window and both soft-caps)."""
    status, output = check(arch_model("gemma2"))
    assert status == 0
    assert f"{WINDOW} (1/2 layers)" in output
    assert "attention 50.0, final logits 30.0" in output
    assert "oxRL can train this model" in output and "model.attn_implementation=eager" in output


def test_check_model_no_chat_template(broken):
    status, report = report_of(broken["no_chat_template"])
    assert status == 0 and report["ok"]  # trainable on plain prompts: a warning, not an error
    assert report["chat_template"]["present"] is False
    (problem,) = [p for p in report["problems"] if "chat template" in p["problem"]]
    assert problem["severity"] == "warning" and "chat_template" in problem["fix"]


def test_check_model_template_without_generation_prompt(tmp_path, arch_model):
    """A ChatML template with no `add_generation_prompt` branch: the prompt lacks the assistant header, so a
    completion appended to it is not the template's own assistant turn — a warning naming the fix."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(arch_model("qwen2"))
    assert "add_generation_prompt" in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.split("{% if add_generation_prompt %}")[0]
    path = tmp_path / "nogen"
    import shutil

    shutil.copytree(arch_model("qwen2"), path)
    tokenizer.save_pretrained(path)
    status, report = report_of(path)
    assert status == 0 and report["chat_template"]["renders_conversation"]
    assert report["chat_template"]["completion_follows"] is False and report["chat_template"]["generation_header"] == ""
    assert any("add_generation_prompt" in p["fix"] for p in report["problems"])


def test_check_model_no_eos_subprocess(broken):
    """The real console script: the table still printed, the EOS error and its fix, exit status 2."""
    done = oxrl("check-model", str(broken["no_eos"]), env={"COLUMNS": "200"}, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no EOS token" in done.stdout and "eos_token" in done.stdout and "cannot train this model" in done.stdout
    assert "EOS / pad / BOS" in done.stdout  # the table is printed before the verdict
    assert "Traceback" not in done.stderr and "warn" not in done.stderr.lower(), done.stderr

    status, report = report_of(broken["no_eos"])
    assert status == 2 and not report["ok"]
    assert [p["severity"] for p in report["problems"] if "EOS" in p["problem"]] == ["error"]


def test_check_model_missing_pad_uses_eos(tmp_path, arch_model):
    """A tokenizer without pad: noted, pad reported as EOS, still trainable."""
    import shutil

    path = shutil.copytree(arch_model("llama"), tmp_path / "nopad")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["pad_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    special = path / "special_tokens_map.json"
    if special.exists():
        smap = json.loads(special.read_text())
        smap.pop("pad_token", None)
        special.write_text(json.dumps(smap))
    status, report = report_of(path)
    assert status == 0 and report["tokens"]["pad_is_eos"] and report["tokens"]["pad"] == report["tokens"]["eos"]
    assert any("no pad token" in p["problem"] and "EOS as pad" in p["fix"] for p in report["problems"])


def test_check_model_tokenizer_larger_than_embedding(tmp_path, arch_model):
    """Token ids past the embedding rows: an error (exit 2) naming both sizes."""
    import shutil

    from transformers import AutoTokenizer

    path = shutil.copytree(arch_model("llama"), tmp_path / "bigtok")
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = json.loads((path / "config.json").read_text())["vocab_size"]
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(rows - len(tokenizer) + 3)])
    tokenizer.save_pretrained(path)
    status, report = report_of(path)
    assert status == 2 and report["vocab"]["tokenizer"] == rows + 3 == report["vocab"]["embedding_rows"] + 3
    assert any("resize_token_embeddings" in p["fix"] and p["severity"] == "error" for p in report["problems"])


def test_check_model_garbage_weights(tmp_path, arch_model):
    """The config reads but the weights do not load: the report still comes, with the error (exit 2)."""
    import shutil

    path = shutil.copytree(arch_model("qwen3"), tmp_path / "garbage")
    (path / "model.safetensors").write_bytes(b"junk")
    status, report = report_of(path)
    assert status == 2 and report["parameters"] is None and report["vocab"]["tokenizer"] is not None
    assert [p["severity"] for p in report["problems"] if p["problem"].startswith("cannot load a causal LM")] == [
        "error"
    ]


def test_check_model_missing_dir_and_corrupt_config(tmp_path, monkeypatch, capsys):
    """Not a model: one clear line, exit status 2, no traceback (the console script's own error path)."""
    import sys

    from oxrl_core.cli import main
    from oxrl_core.commands.check_model import check_model
    from oxrl_core.errors import OxrlError

    monkeypatch.setattr(sys, "argv", ["oxrl", "check-model", str(tmp_path / "nope")])
    with pytest.raises(SystemExit) as exit_:
        main()
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == ""
    assert captured.err.strip().splitlines() == [f"error: check-model: model directory not found: {tmp_path / 'nope'}"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(OxrlError, match=r"cannot read the model config .*config.json"):
        check_model(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OxrlError, match="no config.json"):
        check_model(str(empty))
