"""User errors through the real `oxrl` CLI: exit status 2, one clear message on stderr, never a traceback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import oxrl, write_jsonl


def assert_user_error(proc, *parts: str) -> str:
    """Status 2, the message (with every part) on stderr, no traceback anywhere."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in output, output
    assert "error:" in proc.stderr, proc.stderr
    for part in parts:
        assert part in proc.stderr, f"{part!r} not on stderr:\n{proc.stderr}"
        assert part not in proc.stdout, f"{part!r} went to stdout:\n{proc.stdout}"
    return proc.stderr


def fast(model_dir: Path) -> list[str]:
    return ["--set", f"model.name={model_dir}", "--set", "train.max_steps=2", "--set", "train.batch_size=4"]


# ----------------------------------------------------------------------------- config file and --set


def test_bad_yaml_syntax(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: {lr: 1e-3\nmodel: x\n")
    proc = oxrl("run", "--alg", "sft", "--config", "bad.yaml", cwd=tmp_path)
    assert_user_error(proc, "bad.yaml", "invalid YAML", "line 2")


def test_yaml_top_level_not_a_mapping(tmp_path):
    (tmp_path / "list.yaml").write_text("- train\n- model\n")
    proc = oxrl("run", "--alg", "sft", "--config", "list.yaml", cwd=tmp_path)
    assert_user_error(proc, "list.yaml", "mapping")


def test_unknown_field_suggests_the_right_one(tmp_path):
    (tmp_path / "typo.yaml").write_text("train: {lrr: 1e-3}\n")
    proc = oxrl("run", "--alg", "sft", "--config", "typo.yaml", cwd=tmp_path)
    assert_user_error(proc, "typo.yaml", "train.lrr", "unknown field", "did you mean 'lr'")


def test_unknown_section_suggests_the_right_one(tmp_path):
    (tmp_path / "typo.yaml").write_text("trian:\n  lr: 1.0e-3\n")
    proc = oxrl("run", "--alg", "sft", "--config", "typo.yaml", cwd=tmp_path)
    assert_user_error(proc, "trian", "did you mean 'train'")


def test_wrong_type(tmp_path):
    proc = oxrl("run", "--alg", "sft", "--set", "train.lr=abc", cwd=tmp_path)
    assert_user_error(proc, "train.lr", "'abc'", "number")


def test_out_of_range_value(tmp_path):
    proc = oxrl("run", "--alg", "sft", "--set", "train.max_steps=0", cwd=tmp_path)
    assert_user_error(proc, "train.max_steps", "greater than 0")


def test_unknown_alg_field_for_sft(tmp_path):
    (tmp_path / "alg.yaml").write_text("alg:\n  label_smothing: 0.1\n")
    proc = oxrl("run", "--alg", "sft", "--config", "alg.yaml", cwd=tmp_path)
    assert_user_error(proc, "alg.yaml", "alg.label_smothing", "did you mean 'label_smoothing'")
    proc = oxrl("run", "--alg", "sft", "--set", "alg.beta=0.1", cwd=tmp_path)
    assert_user_error(proc, "alg.beta", "unknown field", "label_smoothing")


def test_set_without_equals(tmp_path):
    proc = oxrl("run", "--alg", "sft", "--set", "train.lr", cwd=tmp_path)
    assert_user_error(proc, "train.lr", "KEY=VALUE")


def test_set_into_a_value_that_is_not_a_section(tmp_path):
    proc = oxrl("run", "--alg", "sft", "--set", "train=5", "--set", "train.lr=1", cwd=tmp_path)
    assert_user_error(proc, "'train' is not a section")


def test_config_file_not_found(tmp_path):
    proc = oxrl("run", "--alg", "sft", "--config", "nope.yaml", cwd=tmp_path)
    assert_user_error(proc, "config file not found", "nope.yaml")


def test_unknown_algorithm_did_you_mean(tmp_path):
    proc = oxrl("run", "--alg", "sfft", cwd=tmp_path)
    assert_user_error(proc, "unknown algorithm 'sfft'", "Did you mean 'sft'", "oxrl plugins")


def test_no_algorithm(tmp_path):
    proc = oxrl("run", "--set", "train.lr=1e-3", cwd=tmp_path)
    assert_user_error(proc, "no algorithm", "--alg")


# ----------------------------------------------------------------------------- models and data


def test_model_dir_not_found(tmp_path):
    proc = oxrl(
        "run", "--alg", "sft", "--set", "model.name=./no-such-model", "--set", "train.max_steps=2", cwd=tmp_path
    )
    assert_user_error(proc, "model.name", "not found", "./no-such-model")
    assert not (tmp_path / "no-such-model").exists()


def test_loaders_name_the_field_of_a_missing_model_dir(tmp_path):
    """In-process: the tokenizer loader (which runs first) and the model loader both say 'not found'."""
    from oxrl_core.errors import OxrlError
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer

    for loader in (load_tokenizer, load_causal_lm):
        with pytest.raises(OxrlError, match=r"model\.teacher: model directory not found: .*no-such-teacher"):
            loader(str(tmp_path / "no-such-teacher"), field="model.teacher")


def test_missing_data_file(tmp_path, tiny_model_dir):
    proc = oxrl("run", "--alg", "sft", *fast(tiny_model_dir), "--set", "data.train=missing.jsonl", cwd=tmp_path)
    assert_user_error(proc, "missing.jsonl", "not found")


def test_malformed_row_in_jsonl(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(4)] + [{"prompt": "q", "answer": "no response"}]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    proc = oxrl("run", "--alg", "sft", *fast(tiny_model_dir), "--set", f"data.train={data}", cwd=tmp_path)
    assert_user_error(proc, str(data), "row 5", "'response'")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*/final"))


# ----------------------------------------------------------------------------- run directory


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mtime_ns) of every file under root."""
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_existing_run_dir_is_refused_without_resume(tmp_path, tiny_model_dir, sft_jsonl):
    args = [
        "run",
        "--alg",
        "sft",
        *fast(tiny_model_dir),
        "--set",
        f"data.train={sft_jsonl}",
        "--output-dir",
        "run",
        "-q",
    ]
    first = oxrl(*args, "--set", "train.save_every=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "run"
    assert (run_dir / "checkpoints" / "step-1" / "trainer_state.json").is_file()
    before = snapshot(run_dir)

    # a different config, so a rewritten config.yaml or metrics.jsonl would show
    second = oxrl(*args, "--set", "train.max_steps=3", "--set", "train.lr=0.5", cwd=tmp_path)
    assert_user_error(second, "already holds a run", "--resume", "run")
    assert snapshot(run_dir) == before
