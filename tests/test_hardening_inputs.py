"""Issue 24, items 11 and 12: a run trains what it was given and can be continued from anywhere.

Item 11: the built-in model's 20-step warm-up is cut to 10% of a shorter run (train.epochs on small data used to
run every step at learning rate 0), a warm-up the user set as long as the run is refused naming both values, and a
run whose every step had learning rate 0 is a warning in the end-of-run table.
Item 12: rows and a model given to the Python API in memory are written under the run directory and config.yaml
names them so that --resume finds them from any working directory; relative paths given on the command line
are recorded as absolute paths.
"""

from __future__ import annotations

import json

import yaml
from conftest import oxrl, read_metrics, write_jsonl

SFT_ROWS = [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(6) for b in range(6)]  # 36 rows


def _text(proc) -> str:
    return proc.stdout + proc.stderr


def _user_error(proc, *parts: str) -> str:
    text = _text(proc)
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    for part in parts:
        assert part in text, (part, text)
    return text


# ----------------------------------------------------------------------------- item 11: warm-up and run length


def test_epochs_on_small_data_with_the_built_in_model_train_at_the_learning_rate(tmp_path):
    """36 rows, 32 a step, 2 epochs: 4 steps, shorter than the built-in 20-step warm-up. It is cut to 10% of the
    run (0 steps) with a note naming it; every step trains at a learning rate above 0 and final/ differs from the
    built-in model it started from; config.yaml leaves the built-in warm-up out, so read back (as --resume and
    data-parallel ranks read it) it is the defaults' again and is fitted the same way, not refused as the user's."""
    from safetensors.torch import load_file

    from oxrl_core.config import load_run_config, read_yaml
    from oxrl_core.models.tiny import default_model_dir
    from oxrl_core.observability.health import check_run, summary_rows

    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run = tmp_path / "run"
    proc = oxrl("run", "--alg", "sft", "--set", f"data.train={data}", "--set", "train.epochs=2", "-o", str(run))
    text = _text(proc)
    assert proc.returncode == 0 and "Traceback" not in text, text
    assert (
        "the built-in model's default warm-up of 20 steps (train.warmup_steps) is at least as long as the run "
        "(4 steps from train.epochs=2 on 36 examples): cut to 0 steps" in " ".join(text.split())
    ), text
    rates = [m["lr"] for m in read_metrics(run)]
    assert len(rates) == 4 and rates[0] == 1e-3 and all(rate > 0 for rate in rates), rates
    start, final = load_file(default_model_dir() / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert sorted(start) == sorted(final) and any(not start[k].equal(final[k]) for k in start)
    assert "weights the run started from" not in text and "warnings" in text and "none" in text

    saved = read_yaml(run / "config.yaml")
    assert "warmup_steps" not in saved["train"]
    again = load_run_config(base=saved)
    assert again.train.warmup_steps == 20 and again.train.warmup_from_defaults

    # the same run had every step been at learning rate 0 (as before the cut): a warning in the end-of-run table
    records = [{**m, "lr": 0.0} for m in read_metrics(run)]
    summary = json.loads((run / "summary.json").read_text())
    findings = check_run(records, summary)
    assert [f.code for f in findings] == ["weights_unchanged"]
    rows = summary_rows(records, summary, findings, None, run, run / "final")
    assert (
        "warning",
        "the learning rate was 0 at all 4 steps: the weights did not change, final/ holds the weights the run started "
        "from (a warm-up as long as the run does this: lower train.warmup_steps)",
        "yellow",
    ) in rows
    assert not any(label == "warnings" for label, _, _ in rows)


def test_a_warm_up_the_user_set_as_long_as_the_run_is_refused_naming_both_values(tmp_path, tiny_model_dir):
    """With train.max_steps the refusal comes when the config is read (no run directory is made); with train.epochs
    once the data has loaded and the steps are known, before any model loads or step runs."""
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run = tmp_path / "steps"
    common = ["run", "--alg", "sft", "--set", f"model.name={tiny_model_dir}", "--set", f"data.train={data}"]
    _user_error(
        oxrl(*common, "--set", "train.max_steps=5", "--set", "train.warmup_steps=5", "-o", str(run), cwd=tmp_path),
        "train.warmup_steps=5 is at least as long as the run (train.max_steps=5)",
        "set train.warmup_steps below 5",
    )
    assert not run.exists()

    run = tmp_path / "epochs"
    _user_error(
        oxrl(*common, "--set", "train.epochs=1", "--set", "train.warmup_steps=8", "-o", str(run), cwd=tmp_path),
        "train.warmup_steps=8 is at least as long as the run (5 steps from train.epochs=1 on 36 examples)",
        "set train.warmup_steps below 5",
    )
    assert not (run / "metrics.jsonl").exists() and not (run / "final").exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["warmup_steps"] == 8  # the user's, as given


# ----------------------------------------------------------------------------- item 12: paths in config.yaml


def test_an_api_run_with_in_memory_inputs_resumes_from_any_directory(tmp_path, tiny_model_dir, monkeypatch):
    """Rows and a loaded model given to the API, a relative held-out file and a relative output directory: config.yaml
    names them by absolute paths (inputs/ under the run directory, the held-out file as the working directory made
    it), so `oxrl run --resume` from another directory continues the run (it used to stop at "model directory not
    found"). A run directory of an older oxRL, whose config.yaml holds the relative paths, still resumes from the
    directory it was started in: the paths read back the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oxrl_core import Trainer
    from oxrl_core.run_io.checkpoint import write_manifest

    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir(), elsewhere.mkdir()
    write_jsonl(started / "held.jsonl", SFT_ROWS[:4])
    monkeypatch.chdir(started)
    Trainer(
        alg="sft",
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
        data=SFT_ROWS,
        output_dir="out",
        quiet=True,
        overrides=["data.eval=held.jsonl"],
        train={"max_steps": 2, "batch_size": 8, "save_every": 1},
    ).train()
    run = started / "out"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["name"] == str(run / "inputs" / "model")
    assert saved["data"]["train"] == str(run / "inputs" / "train.jsonl")
    assert saved["data"]["eval"] == str(started / "held.jsonl")

    proc = oxrl("run", "--resume", "-o", str(run), "--set", "train.max_steps=3", "-q", cwd=elsewhere)
    assert proc.returncode == 0 and "Traceback" not in _text(proc), _text(proc)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3] and "eval/loss" in metrics[-1]
    assert (run / "final" / "model.safetensors").is_file() and not (elsewhere / "runs").exists()

    for config in (run / "config.yaml", *run.glob("checkpoints/*/config.yaml")):  # as an older oxRL wrote them
        old = yaml.safe_load(config.read_text())
        old["model"]["name"], old["data"]["train"] = "out/inputs/model", "out/inputs/train.jsonl"
        config.write_text(yaml.safe_dump(old, sort_keys=False))
        if config.parent.parent.name == "checkpoints":
            write_manifest(config.parent)  # the checkpoint stays whole, with its older config.yaml
    result = Trainer(alg="sft", output_dir="out", resume=True, quiet=True, train={"max_steps": 4}).train()
    assert result.steps == 4 and [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
