"""Golden runs: the numbers oxRL logged before its core was reorganised, reproduced by the code of today.

Ten algorithms (one of each loop shape: supervised, distillation, paired and unpaired preference, reward
model, group-relative RL on-policy (SGRPO) and with several updates per batch (CISPO), actor-critic RL, online
preference) run 5 steps on the built-in model with a fixed
seed; every logged loss and reward (`loss*`, `reward*`, `rewards/*`, `eval/*`) must match the recorded
value to 1e-5. A refactor that changes a single number in a loss, a batch order or a seed fails here.

`python tests/test_golden.py` re-records `fixtures/golden_runs.json` — only after a change that is meant
to alter the numbers, saying why in the commit. PPO's run was re-recorded (and CISPO's added) when both began
to declare ``rollout.minibatches = 4``: four optimiser steps per rollout batch, so that their clips act. All
runs were re-recorded when the warm start they begin from became a stored one (`warm_starts.py`): trained at
test time, it differed from machine to machine, and so did every run that starts from it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "fixtures" / "golden_runs.json"
RUNS = ["sft", "cpt", "kd", "dpo", "kto", "rm", "sgrpo", "cispo", "ppo", "online_dpo", "sgrpo_actors"]
#: runs that are an algorithm with extra settings: name -> (algorithm, --set arguments). ``sgrpo_actors`` was
#: recorded before asynchronous rollouts existed: ``rollout.max_staleness`` = 0 must issue the same calls in the
#: same order as the synchronous step always did, so it reproduces this run value for value.
VARIANTS = {"sgrpo_actors": ("sgrpo", ["--set", "rollout.actors=1"])}
COMMON = [
    "--set",
    "train.max_steps=5",
    "--set",
    "train.seed=7",
    "--set",
    "train.batch_size=8",
    "--set",
    "rollout.max_new_tokens=8",
    "-q",
]
KEPT = ("loss", "reward", "rewards/", "eval/")


def run(name: str, out: Path) -> dict:
    """One 5-step run through the real CLI, in a process of its own (nothing carries over from whatever ran
    before in the test process); its logged losses and rewards. KD's teacher is the SFT golden run's final/
    (run first when it is not there yet). The built-in model and its warm start come from ``$OXRL_CACHE``,
    which must be a fresh directory (the test session's, or the recorder's own)."""
    alg, extra = VARIANTS.get(name, (name, []))
    extra = list(extra)
    if alg == "kd":
        if not (out / "sft" / "final").is_dir():
            run("sft", out)
        extra += ["--set", f"model.teacher={out / 'sft' / 'final'}"]
    exe = Path(sys.executable).with_name("oxrl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "oxrl_core.cli"]
    cmd += ["run", "--alg", alg, *COMMON, *extra, "-o", str(out / name)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [{k: v for k, v in m.items() if k.startswith(KEPT) and isinstance(v, (int, float))} for m in lines]
    summary = json.loads((out / name / "summary.json").read_text())
    return {"steps": steps, "summary": numbers(summary)}


def numbers(tree: dict, prefix: str = "") -> dict:
    """The numeric leaves of summary.json (held-out metrics before/after), flattened; timings and the number of
    held-out rows (``eval_rows``, the noise the verdict allows for: a count, not a figure the run measured) left
    out."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(numbers(value, f"{name}."))
        elif (
            isinstance(value, (int, float))
            and "seconds" not in name
            and not name.endswith("_s")
            and name != "eval_rows"
        ):
            flat[name] = value
    return flat


def close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5 * max(1.0, abs(b))


@pytest.mark.slow
@pytest.mark.parametrize("alg", RUNS)
def test_golden_run_reproduces_every_logged_loss_and_reward(alg, tmp_path_factory):
    want = json.loads(GOLDEN.read_text())[alg]
    got = run(alg, tmp_path_factory.getbasetemp() / "golden")
    assert len(got["steps"]) == len(want["steps"]) == 5
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"]), start=1):
        assert sorted(g) == sorted(w), f"step {step}: keys differ"
        bad = {k: (g[k], w[k]) for k in w if not close(g[k], w[k])}
        assert not bad, f"{alg} step {step}: (now, recorded) {bad}"
    assert sorted(got["summary"]) == sorted(want["summary"])
    bad = {k: (got["summary"][k], v) for k, v in want["summary"].items() if not close(got["summary"][k], v)}
    assert not bad, f"{alg} summary: {bad}"


def test_the_default_cispo_run_is_not_the_default_sgrpo_run():
    """With one update per rollout batch CISPO's ratio is exactly 1 and its run was SGRPO's, value for value; CISPO
    now declares rollout.minibatches=4, so its clip acts. The two golden runs (same seed, same settings; the test
    above reproduces each from today's code) sample the same first batch and part by step 3."""
    golden = json.loads(GOLDEN.read_text())
    sgrpo, cispo = ([step["reward/mean"] for step in golden[alg]["steps"]] for alg in ("sgrpo", "cispo"))
    assert sgrpo[0] == cispo[0]  # the same policy samples the same first batch
    assert any(not close(a, b) for a, b in zip(sgrpo[:3], cispo[:3])), (sgrpo, cispo)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        import warm_starts

        os.environ["OXRL_CACHE"] = str(Path(tmp) / "cache")  # a fresh built-in model, the stored warm starts
        os.environ["OMP_NUM_THREADS"] = "1"  # as in a suite worker (2 cores, 2 workers)
        (Path(tmp) / "cache").mkdir()
        warm_starts.install(Path(tmp) / "cache")
        record = {alg: run(alg, Path(tmp)) for alg in (sys.argv[1:] or RUNS)}
    if sys.argv[1:]:
        record = {**json.loads(GOLDEN.read_text()), **record}
    GOLDEN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"recorded {', '.join(record)} in {GOLDEN}")
