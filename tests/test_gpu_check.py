"""`benchmarks/gpu_check.py --dry-run`: the GPU measurement command, at toy size on the CPU, still works.

GPU time is rare; the command that uses it must not rot between windows. The dry run drives the
same scripts through the same sections (tiny models, 1-2 steps, one thread): this checks that it
exits 0, that every section is in the JSON with a valid status, that the sections which ran
report numbers of the right kind, that skipped ones say why, and that the Markdown names them all.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from vlm_archs import FAMILIES as VLM_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ("archs", "sft_throughput", "step_profile", "sgrpo_step", "memory", "images", "async_rollouts", "estimators")
MEASURED = SECTIONS  # every section measures something now


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    return report, (out / "gpu_check.md").read_text(), proc.stdout


@pytest.mark.slow
def test_dry_run_reports_every_section(dry_run):
    report, md, stdout = dry_run
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert list(report["sections"]) == list(SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] in ("ok", "skipped", "failed"), name
        if section["status"] != "ok":
            assert isinstance(section.get("reason"), str) and section["reason"], name
        assert f"| {name} | {section['status']} |" in md  # the summary table names every section
    for name in MEASURED:  # the toy run of every measuring section must pass: a failure here is a regression
        section = report["sections"][name]
        assert section["status"] == "ok", (name, section.get("reason"), section.get("stderr_tail"))
        assert section["commands"] and section["seconds"] > 0, name
    env = report["environment"]
    assert env["packages"]["torch"] and env["git_commit"] and env["date"]
    assert "cuda_available" in env["gpu"]
    assert "| section | status | figures | reason |" in md and md in stdout  # the table is printed too


@pytest.mark.slow
def test_dry_run_figures(dry_run):
    sections = dry_run[0]["sections"]
    vlm = sections["images"]["rows"]  # every VLM family: SFT, then SGRPO generating from its image prompts
    assert [r["family"] for r in vlm] == list(VLM_FAMILIES)
    for r in vlm:
        assert r["status"] == "ok" and len(r["sft_losses"]) == len(r["sgrpo_losses"]) == 2, r
        assert 0 <= r["rollout_logprob_diff"] < 0.05 and _positive(r["sgrpo_step_s"]), r

    from archs import FAMILIES

    families = {r["family"]: r for r in sections["archs"]["rows"]}
    assert list(families) == list(FAMILIES)
    for family, row in families.items():
        assert row["status"] == "ok", (family, row.get("reason"))
        assert len(row["sft_losses"]) == 2 and all(math.isfinite(x) for x in row["sft_losses"]), family
        assert 0 <= row["logp_max_diff"] <= sections["archs"]["tolerance"], family
        assert row["head_path"] == "chunked", family

    engines = {r["engine"].split()[0]: r for r in sections["sft_throughput"]["rows"]}
    assert _positive(engines["torch"]["tokens_per_s"]) and _positive(engines["torch"]["mfu"])
    if importlib.util.find_spec("deepspeed") is not None:  # ZeRO-3 runs on the CPU in the dry run
        assert engines["deepspeed"]["status"] == "ok" and _positive(engines["deepspeed"]["tokens_per_s"])
    else:
        assert engines["deepspeed"]["reason"] == "no DeepSpeed installed"
    assert "Qwen2" in sections["sft_throughput"]["model"]

    (profiled,) = sections["step_profile"]["rows"]  # one SFT step under the profiler (CPU: no kernels, no sync mode)
    assert _positive(profiled["step_wall_s"]) and _positive(profiled["tokens_per_s"]) and _positive(profiled["mfu"])
    assert profiled["kernel_s"] is None and profiled["syncs"] is None
    assert sections["step_profile"]["top_kernels"] and "Qwen2" in sections["step_profile"]["model"]

    rows = {r["row"]: r for r in sections["sgrpo_step"]["rows"]}
    hf = rows["SGRPO step, rollout.backend=hf"]
    assert hf["status"] == "ok"
    assert all(_positive(hf[k]) for k in ("step_s", "gen_s", "train_s", "gen_tokens_per_s"))
    vllm = rows["vllm backend: generation and weight sync"]
    if importlib.util.find_spec("vllm") is not None:
        assert vllm["status"] == "ok", vllm.get("reason")
        assert _positive(vllm["gen_tokens_per_s"]) and _positive(vllm["sync_s"])
    else:
        assert vllm["status"] == "skipped" and "no vLLM installed" in vllm["reason"]
    step = rows["SGRPO step, rollout.backend=vllm"]
    assert step["status"] == "skipped" and step["reason"]  # the dry run leaves the vLLM step to the GPU

    memory = {(r["workload"], r["side"]): r for r in sections["memory"]["rows"]}
    trl = importlib.util.find_spec("trl") is not None  # the VLM row's TRL side runs in the dry run too
    vlm_sides = {("vlm", "oxrl")} | ({("vlm", "trl"), ("vlm", "oxrl/trl")} if trl else set())
    assert set(memory) == {("sft", "oxrl"), ("sgrpo", "oxrl")} | vlm_sides
    sides = [r for key, r in memory.items() if "/" not in key[1]]
    assert all(_positive(r["peak_gb"]) and _positive(r["tokens_per_s"]) for r in sides)
    if trl:  # both sides trained on the same inputs: checked, and the step-1 losses agree
        assert _positive(memory[("vlm", "oxrl/trl")]["peak_ratio"])
        check = sections["memory"]["vlm_check"]
        assert check["same_inputs"] is True and 0 <= check["first_loss_diff"] <= 1e-4

    k0, k1 = sections["async_rollouts"]["rows"]  # rollout.max_staleness 0 then 1, one rollout actor each
    assert (k0["k"], k1["k"]) == (0, 1) and k0["staleness_mean"] == 0 and k1["staleness_mean"] > 0
    assert all(_positive(r["train_seconds"]) and 0 <= r["overlap_share"] <= 1 for r in (k0, k1))
    assert k0["rewards"][0] == k1["rewards"][0]  # step 1 is version 0's batch on both sides
    summary = sections["async_rollouts"]["summary"]  # the ratio of steps/s, said as such
    assert summary.startswith(f"k=1 steps/s = {k1['speedup_vs_k0']}× k=0's ("), summary

    estimators = {r["alg"]: r for r in sections["estimators"]["rows"]}  # each with its own defaults, in bf16
    assert list(estimators) == ["sgrpo", "cispo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"]
    for alg, row in estimators.items():
        assert row["status"] == "ok" and len(row["losses"]) == 2, (alg, row.get("reason"))
        assert row["updates_per_step"] == {"cispo": 4, "gspo": 2, "ppo": 4}.get(alg, 1), alg
        assert _positive(row["train_s_vs_sgrpo"]) and 0 <= row["rollout_logprob_diff"] < 0.05, alg


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--out", "/proc/nope"], "--out /proc/nope: cannot write reports there"),
        (["--budget-s", "-5"], "--budget-s -5: give a positive number of seconds"),
        (["--budget-s", "0"], "--budget-s 0: give a positive number of seconds"),
    ],
)
def test_unusable_arguments_are_usage_errors_before_any_section(tmp_path, args, expected):
    """A usage error (exit 2, one line, no traceback) before anything runs, not a skipped check that exits 0."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "gpu_check.json").exists()
