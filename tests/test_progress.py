"""Progress you can trust: the warm start, the held-out evaluation and model loading say what they are doing
(counts, not a silent minute), the step line shows reward and KL, and --quiet prints none of it.

The end-to-end tests run the real CLI (the fresh-cache one through its entry point in this process, with a
shortened warm start that really is built); their stderr is captured, not a terminal, so progress comes as plain
lines.
"""

from __future__ import annotations

import io
import re

import pytest
from conftest import oxrl
from rich.console import Console

from oxrl_core.observability.progress import Reporter, counter, nice_interval, step_fields

PROGRESS_LINE = re.compile(r"^(warm start|held-out evaluation): (\d+)/(\d+) (steps|samples)( in [\d.]+ s)?$")


def _plain_reporter(quiet: bool = False) -> tuple[Reporter, io.StringIO]:
    reporter = Reporter(quiet=quiet)
    buffer = io.StringIO()
    reporter.console = Console(file=buffer, force_terminal=False, soft_wrap=True)
    return reporter, buffer


def test_nice_interval_is_about_a_tenth_rounded_up():
    assert [nice_interval(n) for n in (1, 7, 10, 170, 450, 900, 2000)] == [1, 1, 1, 20, 50, 100, 200]


def test_plain_counter_lines_at_zero_every_tenth_and_the_end(capsys):
    reporter = Reporter()
    reporter.plain_min_gap_s = 0  # every tenth (the gap between lines is tested below)
    with reporter.counter("warm start", "steps", total=170) as update:
        for step in range(170):
            update(step + 1)
    lines = capsys.readouterr().err.splitlines()
    counts = [int(PROGRESS_LINE.match(line).group(2)) for line in lines]
    assert counts == [0, 20, 40, 60, 80, 100, 120, 140, 160, 170]
    assert re.fullmatch(r"warm start: 170/170 steps in [\d.]+ s", lines[-1])


def test_counter_total_given_on_the_first_update_and_batches_crossing_a_tenth(capsys):
    reporter = Reporter()
    reporter.plain_min_gap_s = 0
    with reporter.counter("held-out evaluation", "samples") as update:
        update(0, 900)
        for done in (64, 100, 612, 900):
            update(done)
    counts = [int(PROGRESS_LINE.match(line).group(2)) for line in capsys.readouterr().err.splitlines()]
    assert counts == [0, 100, 612, 900]  # 64 is still in the first tenth


def test_a_quick_phase_is_two_lines(capsys):
    """Lines between the first and the last come at least `plain_min_gap_s` apart: a phase quicker than that
    says where it starts and where it ends."""
    reporter = Reporter()
    reporter.plain_min_gap_s = 3600
    with reporter.counter("held-out evaluation", "samples", total=200) as update:
        for done in range(32, 201, 32):
            update(min(done, 200))
        update(200)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "held-out evaluation: 0/200 samples"
    assert re.fullmatch(r"held-out evaluation: 200/200 samples in [\d.]+ s", lines[1]) and len(lines) == 2


def test_quiet_and_no_reporter_print_nothing(capsys):
    reporter = Reporter(quiet=True)
    with reporter.counter("warm start", "steps", total=10) as update:
        for i in range(10):
            update(i + 1)
    with reporter.activity("loading model.name x"):
        pass
    reporter.step(1, 1, {"loss": 1.0, "lr": 1e-3, "reward/mean": 0.5})
    with counter(None, "warm start", "steps", total=10) as update:
        update(10)
    assert capsys.readouterr().err == ""


def test_activity_is_one_line_when_not_a_terminal(capsys):
    with Reporter().activity("loading model.name /m"):
        pass
    assert capsys.readouterr().err == "loading model.name /m ...\n"


def test_step_line_shows_reward_and_kl_beside_loss_and_tokens_per_second(capsys):
    metrics = {"loss": 0.25, "lr": 1e-5, "reward/mean": 0.625, "kl/ref": 0.0123, "perf/tokens_per_s": 1234.0}
    Reporter().step(1, 10, metrics)
    assert capsys.readouterr().err == "step 1/10 loss 0.2500 reward 0.625 kl 0.0123 lr 1e-05 1,234 tok/s\n"
    assert step_fields({"loss": 1.0}) == {"loss": "1.0000", "tok/s": "0"}  # no reward, no KL: not shown


def test_terminal_shows_phases_inside_the_training_bar_with_counts():
    """On a terminal, a phase during training (an evaluation every N steps) joins the training bar's live
    display (rich allows one at a time) and its counts and the training bar's reward and KL are drawn."""
    reporter = Reporter()
    buffer = io.StringIO()
    reporter.console = Console(file=buffer, force_terminal=True, width=160, soft_wrap=True)
    assert reporter.console.is_terminal
    reporter.start(total=4)
    reporter.step(1, 4, {"loss": 0.5, "lr": 1e-3, "reward/mean": 0.75, "kl/ref": 0.02, "perf/tokens_per_s": 10.0})
    with reporter.counter("held-out evaluation", "samples") as update:
        update(0, 30)
        update(20)
        reporter.progress.refresh()
        shown = buffer.getvalue()
        assert "held-out evaluation" in shown and "20/30 samples" in shown
        assert "reward 0.750" in shown and "kl 0.0200" in shown
        assert len(reporter.progress.task_ids) == 2
        update(30)
    assert len(reporter.progress.task_ids) == 1  # the phase is gone, the training bar stays
    assert "held-out evaluation: 30/30 samples in" in buffer.getvalue()
    reporter.stop()
    assert reporter.progress is None


def test_terminal_phase_before_training_starts_and_stops_its_own_display():
    reporter = Reporter()
    reporter.console = Console(file=io.StringIO(), force_terminal=True, width=120)
    with reporter.activity("loading model.name /m"):
        assert reporter.progress is not None and len(reporter.progress.task_ids) == 1
    assert reporter.progress is None


def test_warm_start_reports_its_steps(tmp_path, monkeypatch, capsys):
    """`warm_start_dir` with a reporter: the announcement, then counted steps up to the end."""
    from oxrl_core.models.tiny import warm_start_dir

    monkeypatch.setenv("OXRL_CACHE", str(tmp_path / "cache"))
    reporter = Reporter()
    reporter.plain_min_gap_s = 0
    path = warm_start_dir(steps=12, reporter=reporter)
    assert (path / "config.json").is_file()
    err = capsys.readouterr().err
    assert "a 12-step SFT warm start" in err
    counts = [int(m.group(2)) for m in map(PROGRESS_LINE.match, err.splitlines()) if m]
    assert counts[0] == 0 and counts[-1] == 12 and counts == sorted(counts) and len(counts) >= 3
    warm_start_dir(steps=12, reporter=Reporter())  # cached: nothing to do, nothing said
    assert capsys.readouterr().err == ""


def _progress_lines(stderr: str, label: str) -> list[tuple[int, int]]:
    return [
        (int(m.group(2)), int(m.group(3)))
        for m in map(PROGRESS_LINE.match, stderr.splitlines())
        if m and m.group(1) == label
    ]


#: the warm start of the fresh-cache run below: shorter than the built-in 450 steps (WARM_START_STEPS), the same loop
SHORT_WARM_START = 40


@pytest.mark.slow
def test_rl_run_on_a_fresh_cache_shows_warm_start_loading_and_evaluation(tmp_path, monkeypatch, capsys):
    """`oxrl run` (its console entry point, in this process) on a fresh cache: the warm start is built with counted
    steps, then the policy and reference load, then the held-out evaluation. The warm start is shortened to
    SHORT_WARM_START steps (the built-in 450 took ~45 s on 2 cores for the same lines)."""
    import sys

    from oxrl_core import cli
    from oxrl_core.models import tiny

    assert tiny.WARM_START_STEPS == 450  # what a user's first RL run builds
    monkeypatch.setattr(tiny, "WARM_START_STEPS", SHORT_WARM_START)
    monkeypatch.setenv("OXRL_CACHE", str(tmp_path / "fresh-cache"))
    monkeypatch.setattr(sys, "argv", [
        "oxrl", "run", "--alg", "sgrpo", "-o", str(tmp_path / "run"), "--set", "train.max_steps=2",
        "--set", "train.eval_every=0", "--set", "alg.kl_coeff=0.05", "--set", "train.log_every=1",
    ])  # fmt: skip
    try:
        cli.main()
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    err = capsys.readouterr().err
    assert status == 0, err
    n = SHORT_WARM_START
    warm = _progress_lines(err, "warm start")  # (lines in between: one per tenth, 2 s apart at least)
    assert warm[0] == (0, n) and warm[-1] == (n, n), err
    assert [d for d, _ in warm] == sorted(d for d, _ in warm) and len(set(warm)) == len(warm)
    assert re.search(rf"^warm start: {n}/{n} steps in [\d.]+ s$", err, re.M)
    assert re.search(rf"^loading model\.name .*warm{n}.* \.\.\.$", err, re.M)  # the policy
    assert re.search(r"^loading model\.ref .* \.\.\.$", err, re.M) or err.count("loading model.name") >= 2  # the ref
    evals = _progress_lines(err, "held-out evaluation")
    finished = [e for e in evals if e[0] == e[1]]
    assert len(finished) == 2, err  # before training and after the last step
    assert all(total > 0 for _, total in evals)
    assert err.index(f"warm start: 0/{n}") < err.index("loading model.name") < err.index("held-out evaluation: 0/")
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert steps and all(re.search(r" loss -?[\d.]+ reward [\d.]+ kl -?[\d.]+ lr ", s) for s in steps), steps


def test_a_quiet_warm_start_prints_nothing(tmp_path, monkeypatch, capsys):
    """The warm start on a fresh cache with a quiet reporter (what `oxrl run -q` gives it): built, silent."""
    from oxrl_core.models.tiny import warm_start_dir

    monkeypatch.setenv("OXRL_CACHE", str(tmp_path / "cache"))
    path = warm_start_dir(steps=12, reporter=Reporter(quiet=True))
    assert (path / "config.json").is_file() and capsys.readouterr().err == ""


@pytest.mark.slow
def test_quiet_run_prints_no_progress(tmp_path):
    """-q during loading, evaluation and training: only the outcome lines (the warm start: above)."""
    proc = oxrl("run", "--alg", "sgrpo", "-q", "-o", str(tmp_path / "run"), "--set", "train.max_steps=2")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    for quiet_about in ("warm start", "held-out evaluation:", "loading model", "step 1/"):
        assert quiet_about not in err, err
    assert "done: 2 steps" in err


@pytest.mark.slow
def test_oxrl_eval_shows_loading_and_samples_and_quiet_shows_none(tmp_path, tiny_model_dir):
    args = (
        "eval", "-m", str(tiny_model_dir), "--limit", "40", "-n", "2", "--temperature", "1", "--max-new-tokens", "4",
    )  # fmt: skip
    proc = oxrl(*args)
    assert proc.returncode == 0, proc.stderr
    assert f"loading --model {tiny_model_dir} ...\n" in proc.stderr
    assert "evaluation: 0/80 samples\n" in proc.stderr
    assert re.search(r"^evaluation: 80/80 samples in [\d.]+ s$", proc.stderr, re.M)
    quiet = oxrl(*args, "-q")
    assert quiet.returncode == 0, quiet.stderr
    assert "loading" not in quiet.stderr and "evaluation:" not in quiet.stderr
    assert "pass@1" in quiet.stdout  # the result still comes
