"""`oxrl report` and the end-of-run table for asynchronous rollouts (rollout.max_staleness >= 1), on hand-written
metrics.jsonl (no model runs): the reward against wall-clock time (perf/elapsed_s, logged by every RL run), the
staleness chart (async runs only), the speedup over the phases run in turn, and the trainer–rollout logprob-gap
warning, which an async run's staleness must not set off."""

from __future__ import annotations

import json
import re
from pathlib import Path

from oxrl_core.observability.health import ASYNC_BOUND, check_run, pipeline_text, summary_rows
from oxrl_core.observability.report import _lines, _time_axis, elapsed, load_run, render_report

STEPS = 6
GAP = [1e-4, 1e-4, 5e-4, 1e-3, 4e-3, 8e-3]  # a trainer–rollout logprob gap that grows 80× over the run


def sync_records() -> list[dict]:
    """A synchronous run: its phases run in turn, so perf/step_s is (about) their sum. As loops/rl.py times
    them, perf/train_s includes the weight sync (perf/sync_s)."""
    out, t = [], 0.0
    for s in range(1, STEPS + 1):
        phases = {"perf/gen_s": 2.0, "perf/reward_s": 0.1, "perf/train_s": 1.7, "perf/sync_s": 0.2}
        t += 3.8
        out.append(
            {"step": s, "loss": 1.0 / s, "reward/mean": 0.1 * s, "reward/std": 0.05, "rollout/logprob_diff": GAP[s - 1],
             "policy/version": float(s - 1), **phases, "perf/step_s": 3.8, "perf/elapsed_s": t}
        )  # fmt: skip
    return out


#: the async run (k = 1): per step the trainer waited perf/gen_wait_s for its batch, then scored, trained and pushed
WAIT = [2.0, 0.5, 0.5, 0.5, 0.5, 0.5]  # step 1 waits for the whole first batch; then training hides most of it
STALENESS = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # version max(0, s - 2): updates between generating and training


def async_records() -> list[dict]:
    out, t = [], 0.0
    for s in range(1, STEPS + 1):
        step_s = WAIT[s - 1] + 0.1 + 1.7  # waiting, reward phase, training (its 0.2 s of weight sync included)
        t += step_s
        out.append(
            {"step": s, "loss": 1.0 / s, "reward/mean": 0.1 * s, "reward/std": 0.05, "rollout/logprob_diff": GAP[s - 1],
             "policy/version": float(max(0, s - 2)), "policy/staleness_mean": STALENESS[s - 1],
             "policy/staleness_max": STALENESS[s - 1], "perf/gen_s": 2.0, "perf/gen_wait_s": WAIT[s - 1],
             "perf/reward_s": 0.1, "perf/train_s": 1.7, "perf/sync_s": 0.2, "perf/step_s": step_s,
             "perf/elapsed_s": t, "perf/idle_share": WAIT[s - 1] / step_s, "perf/overlap_share": 1 - WAIT[s - 1] / 2.0,
             "offpolicy/kl_k3": 1e-3, "offpolicy/chi2": 2e-3, "offpolicy/ess": 0.99, "tis/weight_mean": 1.0,
             "tis/clipped_frac": 0.0}
        )  # fmt: skip
    return out


# by hand: phases 6 × (gen 2.0 + reward 0.1 + train 1.7, the sync's 0.2 s inside it, counted once) = 22.8 s;
# wall 3.8 + 5 × 2.3 = 15.3 s; 22.8 / 15.3 = 1.4902;
# waited 2.0 + 5 × 0.5 = 4.5 s of 15.3 = 29.4 %; staleness mean 5 / 6 = 0.833, max 1
ASYNC_ROW = (
    "1.49× speedup over its phases run in turn (at most 2×; phases 22.8 s, wall 15.3 s; trainer idle 29%); "
    "staleness mean 0.83, max 1 policy updates"
)


def write_run(path: Path, records: list[dict], staleness: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        f"algorithm: sgrpo\ntrain:\n  max_steps: {STEPS}\nrollout:\n  actors: 1\n  max_staleness: {staleness}\n"
    )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"steps": STEPS, "train_seconds": records[-1]["perf/elapsed_s"], "eval_before": {}, "eval_after": {}}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def figure(text: str, plot: str) -> str:
    """The HTML of the report's figure of kind ``plot`` ("" if not drawn)."""
    found = re.search(rf'<figure class="plot" id="[^"]*" data-plot="{plot}">.*?</figure>', text, re.S)
    return found.group(0) if found else ""


def codes(records: list[dict]) -> set[str]:
    return {f.code for f in check_run(records, {"eval_before": {}, "eval_after": {}})}


def test_report_draws_reward_against_wall_clock_time_and_staleness_only_for_the_async_run(tmp_path):
    sync = render_report([load_run(write_run(tmp_path / "sync", sync_records(), 0))])
    asyn = render_report([load_run(write_run(tmp_path / "async", async_records(), 1))])
    for text in (sync, asyn):  # every RL run logs perf/elapsed_s: reward against step and against time
        assert figure(text, "reward") and "wall-clock time (s)" in figure(text, "reward_time")
        assert "reward/mean" in figure(text, "reward_time") and "<polygon" in figure(text, "reward_time")  # ± std
    staleness = figure(asyn, "staleness")
    assert "policy/staleness_mean" in staleness and "policy/staleness_max" in staleness and "<polyline" in staleness
    assert not figure(sync, "staleness") and "policy/staleness" not in sync
    # the overview says what overlapping bought, for the async run only
    assert f"<th>async rollouts</th><td>{ASYNC_ROW}</td>" in asyn and "async rollouts" not in sync


def test_wall_clock_curve_is_placed_by_time_goes_on_after_a_resume_and_turns_to_minutes(tmp_path):
    records = async_records()
    run = load_run(write_run(tmp_path / "async", records, 1))
    xs, label = _time_axis([run])
    (line,) = _lines(["reward/mean"], [run], "reward/std", xs=xs)
    assert label == "wall-clock time (s)"
    assert line.points == [(r["perf/elapsed_s"], r["reward/mean"]) for r in records]
    assert line.band == [(r["perf/elapsed_s"], r["reward/mean"] - 0.05, r["reward/mean"] + 0.05) for r in records]
    # resumed after step 3: the clock restarted at 0, the curve goes on from step 3's time; a step without a
    # (finite, numeric) time is left out of this curve, not drawn at x = 0
    resumed = [dict(r) for r in records]
    for r, t in zip(resumed[3:], (5.0, 2000.0, "<b>nan</b>")):
        r["perf/elapsed_s"] = t
    run = load_run(write_run(tmp_path / "resumed", resumed, 1))
    last = records[2]["perf/elapsed_s"]
    times = [r["perf/elapsed_s"] for r in records[:3]]
    assert elapsed(run) == {1: times[0], 2: times[1], 3: last, 4: last + 5.0, 5: last + 2000.0}
    xs, label = _time_axis([run])  # past 10 minutes: the axis is in minutes
    assert label == "wall-clock time (min)" and xs[0][5] == (last + 2000.0) / 60
    text = render_report([run])
    assert "wall-clock time (min)" in figure(text, "reward_time") and "<b>nan" not in text


def test_two_runs_overlay_on_the_time_axis_with_their_names_escaped(tmp_path):
    runs = [load_run(write_run(tmp_path / name, recs, k)) for name, recs, k in
            (("sync<i>", sync_records(), 0), ("async", async_records(), 1))]  # fmt: skip
    text = render_report(runs)
    chart = figure(text, "reward_time")
    assert "sync&lt;i&gt;: reward/mean" in chart and "async: reward/mean" in chart and "<i>" not in text
    assert "async: policy/staleness_mean" in figure(text, "staleness")


def test_end_of_run_table_gives_the_async_speedup_over_the_phases_and_nothing_for_a_sync_run():
    summary = {"steps": STEPS, "train_seconds": 15.3, "eval_before": {}, "eval_after": {}}
    rows = summary_rows(async_records(), summary, [], None, "runs/a", "runs/a/final")
    assert ("async rollouts", ASYNC_ROW, "") in rows
    labels = [label for label, _, _ in rows]
    assert labels.index("async rollouts") == labels.index("reward") + 1  # next to the reward
    sync = summary_rows(sync_records(), summary, [], None, "runs/s", "runs/s/final")
    assert pipeline_text(sync_records()) == "" and "async rollouts" not in [label for label, _, _ in sync]
    # a step whose time is not finite is left out of both sums; a run with staleness 0 so far still gets the row
    damaged = async_records()
    damaged[1]["perf/step_s"] = "nan"
    assert pipeline_text(damaged).startswith(f"{(22.8 - 3.8) / (15.3 - 2.3):.2f}× ")
    assert pipeline_text(async_records()[:1]).startswith("1.00× ")  # step 1 waits for the whole batch


def test_the_speedup_counts_generation_inside_the_steps_only_and_keeps_to_its_bound():
    """Synthetic records of a run whose first batches were made during start-up: step 1's batch took 10 s of
    generation before step 1 began (``perf/gen_s``), of which none fell in a step (``perf/gen_in_step_s``)."""
    records = async_records()
    records[0]["perf/gen_s"], records[0]["perf/gen_in_step_s"] = 10.0, 0.0
    for r in records[1:]:
        r["perf/gen_in_step_s"] = 2.0
    # by hand: phases 0 + 5 × 2.0 + 6 × (0.1 + 1.7) = 20.8 s over the same 15.3 s of wall-clock
    assert pipeline_text(records).startswith(f"{20.8 / 15.3:.2f}× speedup over its phases run in turn (at most 2×")
    # a run logged before perf/gen_in_step_s: each step's generation counts at most its step's time
    legacy = async_records()
    legacy[0]["perf/gen_s"] = 10.0
    assert pipeline_text(legacy).startswith(f"{(3.8 + 5 * 2.0 + 6 * 1.8) / 15.3:.2f}× ")
    assert float(pipeline_text(legacy).split("×")[0]) <= ASYNC_BOUND


def test_logprob_gap_warning_does_not_fire_for_staleness_but_still_for_an_equal_sync_run():
    assert "logprob_gap_growing" in codes(sync_records())
    assert "logprob_gap_growing" not in codes(async_records())  # the gap holds the policy's own updates
    # staleness logged but 0 at every step (nothing trained stale): the check applies as in a sync run
    fresh = [{**r, "policy/staleness_mean": 0.0, "policy/staleness_max": 0.0} for r in async_records()]
    assert "logprob_gap_growing" in codes(fresh)
