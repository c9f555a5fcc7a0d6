"""DeepSpeed ZeRO-3 over two Ray ranks on the built-in task, held-out evaluation included, through the real CLI.

Held-out evaluation runs on rank 0 alone inside ``engine.full_weights()``; the chunked LM head once
issued a collective there (its chunk count), which paired with rank 1's DeepSpeed parameter gather:
rank 0 read a garbage count and looped, memory climbing, and the run never got past "held-out
evaluation: 0/200 samples". Here SFT, DPO, KD (teacher: the SFT run's ``final/``) and SGRPO each
finish under ZeRO-3 × 2 and give the first-step loss and the held-out metrics of the one-process run,
with an odd number of held-out rows (33: the last evaluation batch holds one row) and token-budget
micro-batches (``train.max_tokens_per_micro_batch``) of odd sizes, down to one row, so one rank has
fewer rows than the other or none.

A planted mismatch — rank 1 skips one call of the chunked head at step 2 — stops the run with the
collective guard's message (`distributed.CollectiveMismatch`: the step, the call sites, the ranks),
exit status 2, the step-1 checkpoint intact and resumable.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("ray") is None,
        reason="needs deepspeed and ray (pip install 'oxrl[deepspeed,ray]')",
    ),
]

DP2 = [
    "--set",
    "engine.name=deepspeed",
    "--set",
    "engine.zero_stage=3",
    "--set",
    "engine.world_size=2",
    "--set",
    "engine.timeout_s=120",
    "--set",
    "train.logits_chunk_min_mb=0",  # the chunked head even at this vocabulary: its collectives are what is tested
]
#: one torch thread per process: the two ranks get a core each
ENV = {"OMP_NUM_THREADS": "1"}

SKIP_HEAD = '''
"""SGRPO whose rank 1 skips one call of the chunked LM head at step OXRL_TEST_SKIP_HEAD_AT: a planted
collective mismatch (the policy's no-grad log-probabilities of the rollout batch)."""

import os

import torch

from oxrl_algs_rl.sgrpo import SGRPO
from oxrl_core.engines import distributed
from oxrl_core.models import token_head

if os.environ.get("RANK") == "1" and os.environ.get("OXRL_TEST_SKIP_HEAD_AT"):
    _head_stats, _skipped = token_head.head_stats, []

    def head_stats(h, targets, head, path, *args, **kwargs):
        at = int(os.environ["OXRL_TEST_SKIP_HEAD_AT"])
        if distributed._step == at and hasattr(head.weight, "ds_id") and not torch.is_grad_enabled() and not _skipped:
            _skipped.append(True)
            zeros = h.new_zeros(h.shape[0], dtype=torch.float32)  # no head call: none of its collectives
            return {"logp": zeros, "entropy": zeros, "logp_mean": zeros}
        return _head_stats(h, targets, head, path, *args, **kwargs)

    token_head.head_stats = head_stats


class SkipHeadSGRPO(SGRPO):
    name = "skip-head-sgrpo"
'''


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    from oxrl_core.data.task import rows

    root = tmp_path_factory.mktemp("zero3-held-out")
    write_jsonl(root / "held_out.jsonl", rows("eval")[:33])  # the built-in task's held-out rows, an odd number
    (root / "skip_head.py").write_text(SKIP_HEAD)
    return root


def _run(work: Path, alg: str, name: str, *sets: str) -> Path:
    run = work / name
    _ok(
        oxrl(
            "run",
            "--alg",
            alg,
            "--set",
            "train.max_steps=2",
            "--set",
            f"data.eval={work / 'held_out.jsonl'}",
            *sets,
            "-o",
            str(run),
            cwd=work,
            env=ENV,
        )
    )
    return run


def _assert_same_run(single: Path, dp: Path) -> None:
    """The first step's loss (to float32 rounding: the ranks sum in another order) and every held-out metric."""
    one, two = read_metrics(single), read_metrics(dp)
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2]
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-5)
    a, b = (json.loads((r / "summary.json").read_text()) for r in (single, dp))
    for when in ("eval_before", "eval_after"):
        assert a[when].keys() == b[when].keys() and a[when], (when, a[when], b[when])
        for key in a[when]:
            assert b[when][key] == pytest.approx(a[when][key], abs=1e-4), (when, key)


# (algorithm, settings): token budgets give micro-batches of 1-3 rows (odd sizes: one rank fewer rows or none)
CASES = {
    "sft": ["--set", "train.max_tokens_per_micro_batch=40"],
    "dpo": ["--set", "train.batch_size=6", "--set", "train.max_tokens_per_micro_batch=80"],
    "sgrpo": [
        "--set",
        "train.batch_size=4",
        "--set",
        "rollout.n=3",
        "--set",
        "rollout.max_new_tokens=4",
        "--set",
        "engine.rollout_shards=2",
        "--set",
        "train.max_tokens_per_micro_batch=60",
    ],
}


@pytest.mark.parametrize("alg", ["sft", "kd", "dpo", "sgrpo"])
def test_zero3_on_two_ranks_evaluates_held_out_and_matches_one_process(work, alg):
    sets = CASES.get(alg, CASES["sft"])
    if alg == "kd":  # the teacher: the one-process SFT run's final/ (made here when this case runs alone)
        teacher = work / "single-sft" / "final"
        if not teacher.is_dir():
            _run(work, "sft", "single-sft", *CASES["sft"])
        sets = [*sets, "--set", f"model.teacher={teacher}"]
    single = work / f"single-{alg}"
    if not (single / "final").is_dir():
        _run(work, alg, f"single-{alg}", *sets)
    dp = _run(work, alg, f"dp-{alg}", *sets, *DP2)
    _assert_same_run(single, dp)
    assert [r["rank"] for r in json.loads((dp / "ranks.json").read_text())] == [0, 1]
    micro = [m["perf/micro_batches"] for m in read_metrics(dp) if "perf/micro_batches" in m]
    assert not micro or max(micro) > 1  # several micro-batches a step: the token budget regrouped the rows


def test_a_rank_that_skips_a_head_call_stops_the_run_with_the_guards_message(work):
    """Rank 1 skips the chunked head once at step 2 (its chunk-count collective with it): rank 0's next checked
    collective meets rank 1's next one, and both stop naming them; the step-1 checkpoint resumes."""
    run = work / "skip-head"
    args = ["run", "--alg", f"{work / 'skip_head.py'}:SkipHeadSGRPO", *CASES["sgrpo"], "--set", "train.max_steps=3"]
    args += ["--set", "train.save_every=1", *DP2, "-o", str(run)]
    proc = oxrl(*args, cwd=work, env={**ENV, "OXRL_TEST_SKIP_HEAD_AT": "2"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert "ranks out of step at step 2: rank 0 at oxrl_core.models.token_head:" in error and "(_chunk_count)" in error
    assert "; rank 1 at oxrl_core.loops.rl:" in error and "(forward_rows)" in error
    assert f"continue with: oxrl run --resume --output-dir {run}" in error
    # the checkpoint of step 1 is intact: --resume (without the planted skip) finishes the run
    from oxrl_core.run_io.checkpoint import latest_checkpoint

    assert latest_checkpoint(run) == run / "checkpoints" / "step-1"
    assert not (run / "final").exists()
    resumed = _ok(oxrl("run", "--resume", "-o", str(run), cwd=work, env=ENV))
    assert "(step 1)" in resumed.stderr
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
