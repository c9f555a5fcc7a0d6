"""Data mixing (several sources with ratios: seeded, resumable, counted), source options, `oxrl eval`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl

from oxrl_core.commands.eval_command import ks_for, pass_at_k
from oxrl_core.data.batching import MixturePlan
from oxrl_core.data.encode import prepare_examples
from oxrl_core.data.sources import Part, load_data


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout
    return proc.stderr


# ----------------------------------------------------------------------------- the plan


def _plan(sizes=(50, 1000), ratios=(3, 1), batch_size=8, seed=1) -> MixturePlan:
    sources_of = [s for s, n in enumerate(sizes) for _ in range(n)]
    parts = [Part(f"s{i}", r, f"source {i}") for i, r in enumerate(ratios)]
    return MixturePlan(sources_of, parts, batch_size, seed)


def test_mixture_draws_by_ratio_not_by_size():
    plan = _plan()
    counts = Counter()
    for k in range(500):
        counts.update(plan.counts(plan.micro_batch(k)))
    # 4000 draws at p = 3/4: the standard deviation of the count is about 27 rows
    assert counts["data/s0"] + counts["data/s1"] == 4000
    assert abs(counts["data/s0"] - 3000) < 150


def test_mixture_is_a_function_of_seed_and_position():
    a, b = _plan(), _plan()
    sequential = [a.micro_batch(k) for k in range(3000)]  # crosses a block of source choices
    assert b.micro_batch(2999) == sequential[2999]  # jumping there directly (a resume) gives the same rows
    assert b.micro_batch(5) == sequential[5]
    assert _plan(seed=2).micro_batch(5) != sequential[5]


def test_mixture_walks_each_source_in_shuffled_passes():
    plan = _plan(sizes=(10, 10), ratios=(1, 1), batch_size=4)
    drawn = [i for k in range(200) for i in plan.micro_batch(k)]
    small = [i for i in drawn if i < 10]
    for start in range(0, len(small) - 10, 10):  # every pass over a source covers each row exactly once
        assert sorted(small[start : start + 10]) == list(range(10))
    assert small[:10] != list(range(10))  # shuffled


def test_mixture_with_an_empty_source_is_an_error():
    from oxrl_core.errors import OxrlError

    with pytest.raises(OxrlError, match="source 1: no usable rows"):
        MixturePlan([0, 0, 0], [Part("a", 1, "source 0"), Part("b", 1, "source 1")], 2, 0)


def test_load_data_tags_rows_and_tokenises_each_source_apart(tmp_path):
    from oxrl_core.models.tiny import build_tokenizer
    from oxrl_core.plugins import registry

    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "a" * 30}, {"text": "b" * 30}])
    source = load_data([str(texts), {"source": "arith", "ratio": 2}], "train", registry())
    assert [p.name for p in source.parts] == ["texts", "arith"]
    assert [p.ratio for p in source.parts] == [1.0, 2.0]
    assert {r["_source"] for r in source.rows[:2]} == {0} and source.rows[2]["_source"] == 1
    examples = prepare_examples(source, "text", build_tokenizer(), 16).examples
    first = [e for e in examples if e["_source"] == 0]
    tokenizer = build_tokenizer()
    decoded = "".join(tokenizer.decode(e["input_ids"]) for e in first)
    assert set(decoded) <= {"a", "b", "<", "|", "e", "n", "d", ">"}  # CPT blocks never run into arith's text


# ----------------------------------------------------------------------------- config and source errors


def test_bad_source_specs_are_clear_errors(tmp_path, tiny_model_dir, sft_jsonl):
    base = ["run", "--alg", "sft", "--set", f"model.name={tiny_model_dir}", "-o", str(tmp_path / "r")]
    msg = _error(oxrl(*base, "--set", f"data.train=[{{ratio: 3}}, {sft_jsonl}]", cwd=tmp_path))
    assert "data.train: [0].source: Field required" in msg
    msg = _error(oxrl(*base, "--set", f"data.train=[{{source: {sft_jsonl}, ratio: 0}}]", cwd=tmp_path))
    assert "data.train: [0].ratio" in msg and "greater than 0" in msg
    msg = _error(oxrl(*base, "--set", "data.train={source: arith, split: dev}", cwd=tmp_path))
    assert "data.train.split: unknown field" in msg
    msg = _error(oxrl(*base, "--set", f"data.train=[arith, {{source: {sft_jsonl}, path: x}}]", cwd=tmp_path))
    assert "data.train[1].path: options apply to dataset plugins only" in msg
    missing = tmp_path / "missing.jsonl"
    msg = _error(oxrl(*base, "--set", f"data.train=[{sft_jsonl}, {missing}]", cwd=tmp_path))
    assert "missing.jsonl" in msg


def test_a_bad_row_in_a_mixture_names_its_own_file(tmp_path, tiny_model_dir, sft_jsonl):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "response": "y"}, {"prompt": "x"}])
    msg = _error(
        oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train=[{sft_jsonl}, {bad}]",
            "-o",
            str(tmp_path / "r"),
            cwd=tmp_path,
        )
    )
    assert f"{bad}: row 2: missing field 'response'" in msg


# ----------------------------------------------------------------------------- mixed runs


def _mix_files(tmp_path: Path) -> tuple[Path, Path]:
    a = write_jsonl(tmp_path / "plus.jsonl", [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(40)])
    b = write_jsonl(tmp_path / "minus.jsonl", [{"prompt": f"{i}-1=", "response": str(i - 1)} for i in range(200)])
    return a, b


@pytest.mark.slow
def test_mixed_run_draws_3_to_1_and_resumes_at_the_same_position_after_sigkill(tmp_path, tiny_model_dir):
    plus, minus = _mix_files(tmp_path)
    sets = [
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train=[{{source: {plus}, ratio: 3}}, {{source: {minus}, ratio: 1}}]",
        "--set",
        "train.max_steps=60",
        "--set",
        "train.batch_size=8",
        "--set",
        "train.lr=1e-3",
        "--set",
        "train.save_every=10",
    ]
    full = tmp_path / "full"
    _ok(oxrl("run", "--alg", "sft", *sets, "-o", str(full), "--quiet", cwd=tmp_path))
    records = read_metrics(full)
    plus_rows = sum(r["data/plus"] for r in records)
    minus_rows = sum(r["data/minus"] for r in records)
    assert plus_rows + minus_rows == 60 * 8
    assert 2.4 < plus_rows / minus_rows < 3.8  # 480 draws at p = 3/4: the ratio's spread is about ±0.45

    killed = tmp_path / "killed"
    exe = Path(sys.executable).with_name("oxrl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "oxrl_core.cli"]
    proc = subprocess.Popen(
        cmd + ["run", "--alg", "sft", *sets, "-o", str(killed), "--quiet"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step-20").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists()
    _ok(oxrl("run", "--resume", "-o", str(killed), "--quiet", cwd=tmp_path))
    resumed = read_metrics(killed)
    assert [r["step"] for r in resumed] == list(range(1, 61))
    # the same rows in the same order: the same per-source counts and the same losses at every step
    assert [(r["data/plus"], r["data/minus"]) for r in resumed] == [(r["data/plus"], r["data/minus"]) for r in records]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records], abs=1e-5)


@pytest.mark.slow
def test_mixed_rl_run_counts_its_sources_and_checks_each_row_with_its_own_plugin(tmp_path):
    from oxrl_core.data.sources import MixedDataset
    from oxrl_core.plugins import registry

    # two arith parts: each part's rows are checked by its own instance (a MixedDataset)
    source = load_data(["arith", {"source": "arith", "ratio": 3}], "train", registry())
    assert isinstance(source.dataset, MixedDataset)
    assert [p.name for p in source.parts] == ["arith", "arith_2"]
    proc = _ok(
        oxrl(
            "run",
            "--alg",
            "sgrpo",
            "--set",
            "data.train=[arith, {source: arith, ratio: 3}]",
            "--set",
            "train.max_steps=2",
            "--set",
            "train.batch_size=8",
            "--set",
            "rollout.n=2",
            "-o",
            str(tmp_path / "rl"),
            cwd=tmp_path,
        )
    )
    records = read_metrics(tmp_path / "rl")
    assert all(r["data/arith"] + r["data/arith_2"] == 8 for r in records)
    assert "eval/accuracy" in records[-1]  # the held-out split of the plugins, checked by them
    assert "data dataset 'arith' (1) + dataset 'arith' (3)" in proc.stderr


# ----------------------------------------------------------------------------- oxrl eval


def test_pass_at_k_hand_derived():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 − C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong samples: some pick is always right
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = the share of correct samples
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


@pytest.mark.slow
def test_eval_reports_higher_accuracy_after_sft(tmp_path):
    from oxrl_core.models.tiny import default_model_dir, warm_start_dir

    untrained, trained = (
        default_model_dir(),
        warm_start_dir(),
    )  # the built-in model, before and after its SFT warm start
    reports = {}
    for name, model in (("untrained", untrained), ("trained", trained)):
        proc = _ok(
            oxrl("eval", "--model", str(model), "--data", "arith", "--max-new-tokens", "8", "--json", cwd=tmp_path)
        )
        reports[name] = json.loads(proc.stdout)
    assert reports["untrained"]["metrics"]["prompts"] == 100
    before, after = reports["untrained"]["metrics"]["pass@1"], reports["trained"]["metrics"]["pass@1"]
    assert after > before + 0.1, (before, after)  # measured: 0.02 -> 0.22

    out = tmp_path / "report.json"
    proc = _ok(
        oxrl(
            "eval",
            "--model",
            str(trained),
            "--data",
            "arith",
            "-n",
            "4",
            "--max-new-tokens",
            "8",
            "--limit",
            "20",
            "--output",
            str(out),
            cwd=tmp_path,
        )
    )
    assert "pass@4" in proc.stdout  # the table
    report = json.loads(out.read_text())
    m = report["metrics"]
    assert m["samples"] == 80 and report["temperature"] == 1.0
    assert m["pass@1"] <= m["pass@2"] <= m["pass@4"]
    assert len(report["samples"]) == 20 and len(report["samples"][0]["completions"]) == 4
    correct = [sum(s >= 1 for s in row["scores"]) for row in report["samples"]]
    assert m["pass@4"] == pytest.approx(sum(c > 0 for c in correct) / 20)


def test_eval_bad_input_is_a_clear_error(tmp_path, tiny_model_dir):
    msg = _error(oxrl("eval", "--model", str(tiny_model_dir), "--data", str(tmp_path / "nope.jsonl"), cwd=tmp_path))
    assert "nope.jsonl" in msg
    msg = _error(oxrl("eval", "--model", str(tiny_model_dir), "-n", "4", "--temperature", "0", cwd=tmp_path))
    assert "--temperature" in msg
    msg = _error(oxrl("eval", "--model", str(tiny_model_dir), "--reward", "nosuchreward", cwd=tmp_path))
    assert "unknown reward 'nosuchreward'" in msg
    rows = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    msg = _error(oxrl("eval", "--model", str(tiny_model_dir), "--data", str(rows), cwd=tmp_path))
    assert "no reward" in msg
    msg = _error(oxrl("eval", "--model", str(tmp_path / "no-model"), cwd=tmp_path))
    assert "--model" in msg and "no-model" in msg


def test_training_evaluates_every_n_steps_into_metrics(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    _ok(
        oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.eval_every=2",
            "--set",
            "train.batch_size=4",
            "--set",
            "rollout.max_new_tokens=4",
            "-o",
            str(run),
            "--quiet",
            cwd=tmp_path,
        )
    )
    evaluated = [r["step"] for r in read_metrics(run) if "eval/accuracy" in r and "eval/loss" in r]
    assert evaluated == [2, 4]
