"""End-to-end runs of the real `oxrl` CLI (and the Python API) on tiny local models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, oxrl, read_metrics

EXAMPLES = ROOT / "examples"


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same_weights(a: Path, b: Path, atol: float = 1e-6) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=atol, rtol=0, msg=f"tensor {key} differs")


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_run_directory_contract(tmp_path, tiny_model_dir, sft_jsonl):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    _ok(
        oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train={sft_jsonl}",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.save_every=2",
            "--set",
            "train.batch_size=4",
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    config = (run / "config.yaml").read_text()
    assert "algorithm: sft" in config and "label_smoothing: 0.0" in config and f"train: {sft_jsonl}" in config
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(isinstance(m["loss"], float) and m["loss"] > 0 for m in metrics)
    assert {"lr", "grad_norm", "loss/nll", "perf/tokens_per_s"} <= metrics[0].keys()
    ckpt = run / "checkpoints" / "step-2"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "engine.pt", "rng.pt", "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / "trainer_state.json").read_text())["data_position"] == 2
    assert not (run / "checkpoints" / "step-4").exists()  # the last step is final/, not a checkpoint
    assert not [p for p in run.rglob(".tmp-*")]
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    ids = tokenizer("What is 1+1?", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("alg", ["sft", "cpt", "kd"])
def test_examples_run(alg, tmp_path, tiny_model_dir, teacher_model_dir):
    """Each example YAML runs a couple of steps (tiny model swapped in to keep it quick; no warm-up: the examples'
    own is longer than two steps, which a run refuses)."""
    sets = ["--set", f"model.name={tiny_model_dir}", "--set", "train.max_steps=2", "--set", "train.save_every=1"]
    sets += ["--set", "train.warmup_steps=0"]
    if alg == "kd":
        sets += ["--set", f"model.teacher={teacher_model_dir}"]
    run = tmp_path / alg
    _ok(oxrl("run", "--config", str(EXAMPLES / f"{alg}.yaml"), *sets, "-o", str(run), cwd=tmp_path))
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    expected = {"sft": "loss/nll", "cpt": "perplexity", "kd": "loss/kl"}[alg]
    assert expected in metrics[0]
    assert (run / "checkpoints" / "step-1" / "model.safetensors").is_file()
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_kd_without_teacher_is_a_clear_error(tmp_path, tiny_model_dir):
    proc = oxrl("run", "--alg", "kd", "--set", f"model.name={tiny_model_dir}", "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "model.teacher" in proc.stderr and "Traceback" not in proc.stderr


def test_cpt_learns_packed_text(tmp_path, tiny_model_dir, text_jsonl):
    run = tmp_path / "cpt"
    _ok(
        oxrl(
            "run",
            "--alg",
            "cpt",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train={text_jsonl}",
            "--set",
            "data.max_length=64",
            "--set",
            "train.max_steps=30",
            "--set",
            "train.lr=3e-3",
            "--set",
            "train.batch_size=4",
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    losses = [m["loss"] for m in read_metrics(run)]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def _grad_run(tmp_path, name, tiny_model_dir, sft_jsonl, *sets):
    run = tmp_path / name
    _ok(
        oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train={sft_jsonl}",
            "--set",
            "train.max_steps=3",
            "--set",
            "train.lr=1e-3",
            *sets,
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    return run


@pytest.mark.slow
def test_gradient_accumulation_equals_big_batch(tmp_path, tiny_model_dir, sft_jsonl):
    """8 rows in one micro-batch == 4 + 4 accumulated: the loop weights micro-batches by loss tokens."""
    big = _grad_run(tmp_path, "big", tiny_model_dir, sft_jsonl, "--set", "train.batch_size=8")
    acc = _grad_run(
        tmp_path, "acc", tiny_model_dir, sft_jsonl, "--set", "train.batch_size=4", "--set", "train.grad_accum_steps=2"
    )
    for a, b in zip(read_metrics(big), read_metrics(acc)):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    _assert_same_weights(big / "final", acc / "final", atol=1e-5)


@pytest.mark.slow
def test_packing_and_gradient_checkpointing_do_not_change_the_maths(tmp_path, tiny_model_dir, sft_jsonl):
    base = _grad_run(tmp_path, "base", tiny_model_dir, sft_jsonl, "--set", "data.packing=false")  # padded
    packed = _grad_run(tmp_path, "packed", tiny_model_dir, sft_jsonl, "--set", "data.packing=true")
    ckpt = _grad_run(tmp_path, "gc", tiny_model_dir, sft_jsonl, "--set", "model.gradient_checkpointing=true")
    for other in (packed, ckpt):
        for a, b in zip(read_metrics(base), read_metrics(other)):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)


@pytest.mark.slow
def test_bf16_autocast_runs_on_cpu(tmp_path, tiny_model_dir, sft_jsonl):
    run = _grad_run(tmp_path, "bf16", tiny_model_dir, sft_jsonl, "--set", "train.precision=bf16")
    assert all(m["loss"] == m["loss"] for m in read_metrics(run))  # finite, not NaN


def test_runs_are_deterministic(tmp_path, tiny_model_dir, sft_jsonl):
    a = _grad_run(tmp_path, "a", tiny_model_dir, sft_jsonl)
    b = _grad_run(tmp_path, "b", tiny_model_dir, sft_jsonl)
    assert [m["loss"] for m in read_metrics(a)] == [m["loss"] for m in read_metrics(b)]
    _assert_same_weights(a / "final", b / "final", atol=0)


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    """SIGKILL mid-run, `--resume`, and the final weights equal an uninterrupted run's."""
    sets = [
        "--set",
        "train.max_steps=80",
        "--set",
        "train.save_every=10",
        "--set",
        "train.save_total_limit=2",
        "--set",
        "train.lr=1e-3",
        "--set",
        "train.batch_size=16",
    ]
    full = tmp_path / "full"
    _ok(oxrl("run", "--alg", "sft", *sets, "-o", str(full), cwd=tmp_path))

    killed = tmp_path / "killed"
    exe = Path(sys.executable).with_name("oxrl")
    proc = subprocess.Popen(
        [str(exe), "run", "--alg", "sft", *sets, "-o", str(killed), "--quiet"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step-20").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists()
    resumed = _ok(oxrl("run", "--resume", "-o", str(killed), cwd=tmp_path))
    assert "resuming from" in resumed.stderr
    steps = [m["step"] for m in read_metrics(killed)]
    assert steps == list(range(1, 81))  # nothing lost, nothing logged twice
    assert len(list((killed / "checkpoints").iterdir())) == 2  # save_total_limit
    _assert_same_weights(full / "final", killed / "final", atol=1e-5)
    full_losses = [m["loss"] for m in read_metrics(full)]
    resumed_losses = [m["loss"] for m in read_metrics(killed)]
    assert resumed_losses == pytest.approx(full_losses, abs=1e-5)
    again = _ok(oxrl("run", "--resume", "-o", str(killed), cwd=tmp_path))  # a finished run is left alone
    assert "already complete" in again.stderr
    _assert_same_weights(full / "final", killed / "final", atol=1e-5)


def test_python_api_runs_what_the_cli_runs(tmp_path, tiny_model_dir, sft_jsonl):
    from oxrl_core import Trainer

    result = Trainer(
        alg="sft",
        model=str(tiny_model_dir),
        data=str(sft_jsonl),
        output_dir=tmp_path / "api",
        quiet=True,
        train={"max_steps": 3, "lr": 1e-3},
    ).train()
    assert result.steps == 3 and (result.final_dir / "model.safetensors").is_file()
    cli = _grad_run(tmp_path, "cli", tiny_model_dir, sft_jsonl)
    assert [m["loss"] for m in result.metrics] == [m["loss"] for m in read_metrics(cli)]
    _assert_same_weights(result.final_dir, cli / "final", atol=0)


def test_quiet_prints_only_the_result(tmp_path, tiny_model_dir, sft_jsonl):
    loud = _grad_run(tmp_path, "loud", tiny_model_dir, sft_jsonl)
    del loud
    proc = _ok(
        oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train={sft_jsonl}",
            "--set",
            "train.max_steps=3",
            "-q",
            "-o",
            str(tmp_path / "q"),
            cwd=tmp_path,
        )
    )
    assert "step 1/3" not in proc.stderr and "done: 3 steps" in proc.stderr
    proc = _ok(
        oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train={sft_jsonl}",
            "--set",
            "train.max_steps=3",
            "-o",
            str(tmp_path / "v"),
            cwd=tmp_path,
        )
    )
    assert "step 1/3 loss" in proc.stderr  # plain progress lines when not on a terminal


def test_non_finite_loss_stops_with_a_clear_message_and_keeps_checkpoints(tmp_path, tiny_model_dir, sft_jsonl):
    run = tmp_path / "nan"
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={sft_jsonl}",
        "--set",
        "train.max_steps=20",
        "--set",
        "train.save_every=1",
        "--set",
        "train.lr=1e30",
        "--set",
        "train.max_grad_norm=0",
        "-o",
        str(run),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "not finite" in proc.stderr and "Traceback" not in proc.stderr
    assert (run / "checkpoints" / "step-1" / "trainer_state.json").is_file()


@pytest.mark.slow
def test_tracking_tensorboard_and_mlflow(tmp_path, tiny_model_dir, sft_jsonl, monkeypatch):
    run = _grad_run(
        tmp_path,
        "track",
        tiny_model_dir,
        sft_jsonl,
        "--set",
        "logging.tensorboard=true",
        "--set",
        "logging.mlflow=true",
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]

    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading a file store, as oxrl wrote it
    client = mlflow.MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "oxrl"]
    [mlrun] = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(mlrun.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert len(client.get_metric_history(mlrun.info.run_id, "loss_nll")) == 3
    assert mlrun.data.params["algorithm"] == "sft"


def test_doctor_reports_the_environment(tmp_path):
    proc = _ok(oxrl("doctor", cwd=tmp_path))
    assert "torch" in proc.stdout and "deepspeed" in proc.stdout and "vllm" in proc.stdout


@pytest.mark.slow
def test_default_offline_run_raises_heldout_accuracy(tmp_path):
    """`oxrl run --alg sft` with nothing configured: built-in tiny model + arithmetic task."""
    proc = _ok(oxrl("run", "--alg", "sft", "-o", str(tmp_path / "default"), cwd=tmp_path))
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    before, after = summary["eval_before"]["eval/accuracy"], summary["eval_after"]["eval/accuracy"]
    assert "held-out accuracy" in proc.stderr
    assert "data.packing: on (auto)" in proc.stderr  # the probe passed on the built-in model: packed rows
    assert after >= before + 0.15, (before, after)


def test_resume_without_output_dir_continues_the_newest_run(tmp_path, tiny_model_dir, sft_jsonl):
    """`oxrl run --alg sft --resume` finds runs/sft-* on its own and extends it (here from 4 to 6 steps)."""
    sets = ["--set", f"model.name={tiny_model_dir}", "--set", f"data.train={sft_jsonl}", "--set", "train.save_every=2"]
    _ok(oxrl("run", "--alg", "sft", *sets, "--set", "train.max_steps=5", cwd=tmp_path))
    [run] = list((tmp_path / "runs").glob("sft-*"))
    assert (run / "checkpoints" / "step-4").is_dir()
    proc = _ok(oxrl("run", "--alg", "sft", "--resume", "--set", "train.max_steps=6", cwd=tmp_path))
    assert f"resuming from {run.relative_to(tmp_path) / 'checkpoints' / 'step-4'}" in proc.stderr
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert "max_steps: 6" in (run / "config.yaml").read_text()
