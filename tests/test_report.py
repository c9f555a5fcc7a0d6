"""`oxrl report`, rollouts.jsonl and the end-of-run table (issue 18, items 1 and 2).

Real runs of each family (SFT, DPO, SGRPO, PPO, and a run stopped by a non-finite loss) are made once
per module through the Python API; `oxrl report` (the real CLI) writes their reports, which must parse,
hold each expected plot and the rollout viewer's entries, point nowhere outside the file, and open in a
real headless Chromium with a non-blank screenshot and no console message. The end-of-run table is read
from a real CLI run whose reward is always 0. The health checks themselves are tested on hand-made metrics.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl
from test_multiturn_e2e import ALWAYS_CALLS

from oxrl_core.observability.health import check_run
from oxrl_core.observability.report import thin
from oxrl_core.rollout.log import MAX_TOKENS, PROMPTS, SAMPLES

RL = ["train.batch_size=4", "rollout.n=4", "train.max_steps=4", "train.eval_every=2", "logging.rollout_samples_every=2"]
RUNS = {
    "sft": ("sft", ["train.max_steps=4", "train.batch_size=8", "train.eval_every=2"]),
    "dpo": ("dpo", ["train.max_steps=4", "train.batch_size=8", "train.eval_every=2"]),
    "sgrpo": ("sgrpo", RL),
    "ppo": ("ppo", RL),
    # lr 1e30 without clipping: the loss turns non-finite within a few steps and the run stops
    "nan": ("sft", ["train.max_steps=8", "train.lr=1e30", "train.max_grad_norm=0"]),
}

ZERO_REWARD = """
from oxrl_core.interfaces import Reward


class Zero(Reward):
    name = "zero"

    def score(self, prompts, completions, examples):
        return [0.0] * len(completions)
"""


def multi_turn(root: Path) -> list[str]:
    """Calculator episodes whose every odd-length turn is read as a tool call: environment tokens in the samples."""
    (root / "always_calls.py").write_text(ALWAYS_CALLS)
    rows = [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(2, 9)]
    sets = {
        "data.train": write_jsonl(root / "q.jsonl", rows), "env.name": "calculator", "env.max_turns": 3,
        "env.tool_parser": f"{root / 'always_calls.py'}:AlwaysCalls", "env.max_tokens": 48, "reward.name": "arith",
        "train.batch_size": 4, "rollout.n": 4, "rollout.max_new_tokens": 8, "train.max_steps": 2,
        "logging.rollout_samples_every": 1,
    }  # fmt: skip
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """One real run of each family (in this process: no interpreter start-up per run)."""
    from oxrl_core import Trainer
    from oxrl_core.errors import OxrlError

    root = tmp_path_factory.mktemp("report-runs")
    out = {}
    for name, (alg, sets) in [*RUNS.items(), ("multiturn", ("sgrpo", multi_turn(root)))]:
        trainer = Trainer(
            alg=alg, overrides=[f"model.name={tiny_model_dir}", *sets], output_dir=root / name, quiet=True
        )
        if name == "nan":
            with pytest.raises(OxrlError, match="not finite"):
                trainer.train()
        else:
            trainer.train()
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def reports(runs, tmp_path_factory) -> dict[str, Path]:
    """`oxrl report` (the CLI) on each run, and one overlaying the two RL runs."""
    root = tmp_path_factory.mktemp("reports")
    out = {}
    for name, run in runs.items():
        proc = oxrl("report", str(run), "-o", str(root / f"{name}.html"))
        assert proc.returncode == 0, proc.stderr
        assert "report written to" in proc.stdout
        out[name] = root / f"{name}.html"
    proc = oxrl("report", str(runs["sgrpo"]), str(runs["ppo"]), "-o", str(root / "overlay.html"))
    assert proc.returncode == 0, proc.stderr
    out["overlay"] = root / "overlay.html"
    return out


# ---------------------------------------------------------------------------------------------- reading the HTML


class Page(HTMLParser):
    """What the tests read from a report: plots (figure ids), svg count, every src/href, viewer data, findings."""

    def __init__(self, text: str):
        super().__init__()
        self.plots: list[str] = []
        self.svgs = 0
        self.links: list[str] = []
        self.findings: list[str] = []
        self.scripts: dict[str, str] = {}
        self.viewers = 0
        self._script: str | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure" and "data-plot" in a:
            self.plots.append(a["data-plot"])
        if tag == "svg":
            self.svgs += 1
        if tag == "section" and "viewer" in (a.get("class") or "").split():
            self.viewers += 1
        if tag == "li" and "data-code" in a:
            self.findings.append(a["data-code"])
        for key in ("src", "href", "action", "xlink:href", "data"):
            if key in a:
                self.links.append(a[key])
        if tag == "script":
            self._script = a.get("id", f"inline-{len(self.scripts)}")
            self.scripts[self._script] = ""

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            self.scripts[self._script] += data


def page(path: Path) -> tuple[Page, str]:
    text = path.read_text()
    return Page(text), text


def no_external_reference(text: str, parsed: Page) -> None:
    assert not re.search(r"https?://", text), re.search(r".{40}https?://.{40}", text)
    assert not [link for link in parsed.links if not link.startswith("#")], parsed.links
    assert "@import" not in text and "url(" not in text


# ---------------------------------------------------------------------------------------------- a real browser


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert exe, "no Chromium: apt-get install -y chromium (.ci/run installs it)"  # CI must not skip this
    return exe


def open_in_browser(html: Path, tmp: Path) -> tuple[Path, str, list[str]]:
    """Headless Chromium: a screenshot, the DOM after the page's script ran, and every console message."""
    exe, png = chromium(), tmp / (html.stem + ".png")
    common = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--enable-logging=stderr",
        "--v=0",
        f"--user-data-dir={tmp / 'profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # nothing may come from the network anyway
        "--window-size=1400,1800",
    ]
    shot = subprocess.run(
        [*common, f"--screenshot={png}", html.resolve().as_uri()], capture_output=True, text=True, timeout=120
    )
    dom = subprocess.run([*common, "--dump-dom", html.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for proc in (shot, dom) for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert png.is_file(), shot.stderr[-2000:]
    return png, dom.stdout, console


def non_blank(png: Path) -> tuple[float, int]:
    """The share of pixels that are not the page's white background, and how many grey levels the page has
    (a blank or one-colour page: 0 and 1). PIL comes with tensorboard (the tracking extra)."""
    from PIL import Image

    image = Image.open(png).convert("L")
    histogram = image.histogram()
    return 1 - sum(histogram[250:]) / (image.width * image.height), sum(count > 0 for count in histogram)


# ---------------------------------------------------------------------------------------------- the reports

EXPECTED_PLOTS = {
    "sft": {"loss", "grad_norm", "lr", "tokens_per_s"},
    "dpo": {"loss", "rewards_pref", "pair_acc", "logps", "grad_norm", "lr", "tokens_per_s"},
    "sgrpo": {"loss", "reward", "reward_distribution", "heldout", "entropy", "length", "clipped", "logprob_diff"}
    | {"reward_failures", "grad_norm", "lr", "tokens_per_s"},
    "ppo": {"loss", "reward", "reward_distribution", "heldout", "kl", "entropy", "length", "clipped"}
    | {"logprob_diff", "grad_norm", "lr", "tokens_per_s"},
    "nan": {"loss", "grad_norm", "lr"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_report_of_each_family_has_its_plots_and_no_external_reference(name, runs, reports):
    parsed, text = page(reports[name])
    assert text.startswith("<!DOCTYPE html>")
    missing = EXPECTED_PLOTS[name] - set(parsed.plots)
    assert not missing, (missing, parsed.plots)
    assert parsed.svgs >= len(EXPECTED_PLOTS[name])
    no_external_reference(text, parsed)
    config = __import__("yaml").safe_load((runs[name] / "config.yaml").read_text())
    assert f"{config['algorithm']} (" in text  # the config and environment section
    assert "versions (" in text and "torch" in text
    if name in ("sgrpo", "ppo"):  # the rollout viewer, with every logged step and sample
        assert parsed.viewers == 1
        data = json.loads(parsed.scripts["rollouts-0"])
        logged = [json.loads(line) for line in (runs[name] / "rollouts.jsonl").read_text().splitlines()]
        assert [d["step"] for d in data] == [r["step"] for r in logged] == [1, 2, 4]
        assert data[0]["samples"] == logged[0]["samples"]
        assert "held-out metric" in text  # the before/after table
    else:
        assert parsed.viewers == 0 and "rollouts-0" not in parsed.scripts
    if name == "nan":  # the failed run says so: error.log (the trainer writes it) holds its error
        assert "non_finite_stop" in parsed.findings, parsed.findings
        assert "the loss is nan (not finite)" in text and "error.log" in text


@pytest.mark.slow
def test_two_runs_overlay_their_curves(runs, reports):
    parsed, text = page(reports["overlay"])
    assert "2 runs overlaid" in text and parsed.viewers == 2
    # each curve of the reward plot is there once per run, labelled with the run's name
    assert f"{runs['sgrpo'].name}: reward/mean" in text and f"{runs['ppo'].name}: reward/mean" in text
    assert "kl" in parsed.plots  # a metric only PPO logs is still drawn


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgrpo", "nan", "overlay"])
def test_report_opens_in_a_real_browser_without_errors(name, reports, tmp_path):
    png, dom, console = open_in_browser(reports[name], tmp_path)
    assert console == [], console  # no error, no warning, nothing logged by the page's script
    inked, levels = non_blank(png)
    assert inked > 0.01 and levels > 30, (inked, levels)
    assert dom.count("<svg") >= 3
    if name != "nan":  # the viewer's script ran: the first logged step's tokens, each in a coloured span
        data = json.loads(Page(reports[name].read_text()).scripts["rollouts-0"])
        tokens = sum(len(s["tokens"]) for s in data[0]["samples"])
        assert dom.count('class="tok"') >= tokens > 0
        assert "reward " in dom and "advantage " in dom


# ---------------------------------------------------------------------------------------------- rollouts.jsonl


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgrpo", "ppo"])
def test_rollouts_jsonl_is_bounded_and_its_values_are_the_batch(name, runs):
    lines = [json.loads(line) for line in (runs[name] / "rollouts.jsonl").read_text().splitlines()]
    metrics = {m["step"]: m for m in read_metrics(runs[name])}
    assert [r["step"] for r in lines] == [1, 2, 4]  # the first step, every 2nd, the last
    for record in lines:
        assert len(record["rewards"]) == 4 * 4  # every sample of the batch
        assert sum(record["rewards"]) / 16 == pytest.approx(metrics[record["step"]]["reward/mean"], abs=1e-4)
        samples = record["samples"]
        assert 0 < len(samples) <= PROMPTS * SAMPLES
        for s in samples:
            n = len(s["ids"])
            assert 0 < n <= MAX_TOKENS and n == s["length"]
            for key in ("tokens", "logp", "logp_rollout", "entropy", "adv", "mask"):
                assert len(s[key]) == n, key
            assert s["mask"] == [1.0] * n  # single-turn: every completion token is trained on
            assert all(abs(a - b) < 1e-3 for a, b in zip(s["logp"], s["logp_rollout"]))  # the same policy
            assert all(lp <= 0 for lp in s["logp"]) and all(e >= 0 for e in s["entropy"])
            assert s["reward"] == record["rewards"][s["group"] * 4 + s["sample"]]
        if name == "sgrpo":  # group-relative: a sample above its group's mean reward has a positive advantage
            for s in samples:
                group = record["rewards"][s["group"] * 4 : s["group"] * 4 + 4]
                mean = sum(group) / 4
                if abs(s["reward"] - mean) > 1e-6:
                    assert (s["advantage"] > 0) == (s["reward"] > mean)
                else:
                    assert s["advantage"] == pytest.approx(0, abs=1e-4)
    if name == "ppo":
        assert "logp_ref" in lines[0]["samples"][0]


@pytest.mark.slow
def test_rollouts_jsonl_keeps_multi_turn_episodes_with_their_loss_mask(runs, reports):
    lines = [json.loads(line) for line in (runs["multiturn"] / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    episodes = [s for r in lines for s in r["samples"] if 0.0 in s["mask"]]
    assert episodes, "no sample with an environment turn"
    for s in episodes:
        # the model's turn (trained), the environment's answer (not trained), the model's next turn (trained)
        runs_of = [m for j, m in enumerate(s["mask"]) if j == 0 or m != s["mask"][j - 1]]
        assert runs_of[:3] == [1.0, 0.0, 1.0], runs_of
        environment = "".join(t for t, m in zip(s["tokens"], s["mask"]) if m == 0.0)
        assert environment.startswith("<|tool|>"), environment  # the calculator's message, as the template renders it
        assert len(s["mask"]) == len(s["ids"]) == s["length"]
    parsed, text = page(reports["multiturn"])
    assert parsed.viewers == 1 and json.loads(parsed.scripts["rollouts-0"])[1]["samples"] == lines[1]["samples"]


# ---------------------------------------------------------------------------------------------- bad input


def test_report_refuses_what_is_not_a_run_with_one_message(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "nometrics").mkdir()
    (tmp_path / "nometrics" / "config.yaml").write_text("algorithm: sft\n")
    (tmp_path / "nometrics" / "metrics.jsonl").write_text("")
    for target, message in (
        (tmp_path / "missing", "not a directory"),
        (tmp_path / "empty", "not an oxRL run directory"),
        (tmp_path / "nometrics", "no metrics"),
    ):
        proc = oxrl("report", str(target), "-o", str(tmp_path / "r.html"))
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "r.html").exists()


def test_report_reads_a_torn_last_line_and_an_error_log(tmp_path):
    """A run killed mid-append (a torn metrics line) that left error.log: the report is written and says why."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algorithm: sft\ntrain:\n  max_steps: 10\n")
    good = [{"step": 1, "loss": 2.0, "lr": 1e-3}, {"step": 2, "loss": "nan", "lr": 1e-3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 3, "lo')
    (run / "error.log").write_text(
        "oxrl run failed at 2026-11-25\ncommand: oxrl run\nerror: OxrlError: step 3: the loss is nan (not finite); "
        "the run stops here.\n\nTraceback ...\n"
    )
    proc = oxrl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    parsed, text = page(run / "report.html")
    assert set(parsed.findings) >= {"non_finite_stop", "non_finite"}
    assert "step 3: the loss is nan" in text and "error.log" in text
    assert "not finite at step 2" in text  # the loss curve marks the non-finite point


# ---------------------------------------------------------------------------------------------- the health checks


def steps(**series) -> list[dict]:
    n = len(next(iter(series.values())))
    return [{"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in series.items()}} for i in range(n)]


def codes(records, summary=None, max_steps=None, error="") -> set[str]:
    summary = {"eval_before": {}, "eval_after": {}} if summary is None else summary
    return {f.code for f in check_run(records, summary, max_steps, error)}


def test_health_checks_each_finding_and_only_when_it_applies():
    healthy = steps(loss=[1.0, 0.9, 0.8, 0.7, 0.6, 0.5], reward__mean=[0.1, 0.2, 0.2, 0.3, 0.4, 0.5],
                    reward__std=[0.3] * 6, entropy=[1.0, 0.9, 0.9, 0.8, 0.8, 0.8],
                    rollout__logprob_diff=[1e-4] * 6, response__clipped=[0.0] * 6)  # fmt: skip
    improved = {"eval_before": {"eval/accuracy": 0.2}, "eval_after": {"eval/accuracy": 0.4}}
    assert codes(healthy, improved) == set()
    # a reward that is 0 for every sample of every step: broken (an error)
    zero = steps(reward__mean=[0.0] * 5, reward__std=[0.0] * 5)
    assert codes(zero) == {"reward_constant"}
    assert check_run(zero, {"eval_before": {}, "eval_after": {}})[0].level == "error"
    # ... constant only since step 6 of 12: a warning; a constant mean with spread is not flagged
    late = steps(reward__mean=[0.1, 0.2, 0.3, 0.4, 0.5] + [1.0] * 7, reward__std=[0.3] * 5 + [0.0] * 7)
    assert [(f.code, f.level) for f in check_run(late, {})] == [("reward_constant", "warning")]
    assert codes(steps(reward__mean=[0.5] * 5, reward__std=[0.5] * 5)) == set()
    assert codes(steps(entropy=[1.2, 1.1, 0.6, 0.2, 0.05, 0.02])) == {"entropy_collapse"}
    assert codes(steps(rollout__logprob_diff=[1e-4, 1e-4, 5e-4, 1e-3, 4e-3, 8e-3])) == {"logprob_gap_growing"}
    assert codes(steps(reward__errors=[0, 2, 0], reward__timeouts=[0, 0, 1])) == {"reward_failures"}
    assert codes(steps(env__errors=[0, 1], env__timeouts=[0, 0])) == {"env_failures"}
    assert codes(steps(response__clipped=[0.2, 0.9, 1.0])) == {"clipped"}
    assert codes(steps(loss=[1.0, float("nan")])) == {"non_finite"}
    assert codes(steps(grad_norm=[1.0, "inf"])) == {"non_finite"}  # as metrics.jsonl writes it
    flat = {
        "eval_before": {"eval/accuracy": 0.2, "eval/loss": 1.0},
        "eval_after": {"eval/accuracy": 0.2, "eval/loss": 1.1},
    }
    assert codes(healthy, flat) == {"no_held_out_gain"}
    lower_loss = {"eval_before": {"eval/loss": 1.0}, "eval_after": {"eval/loss": 0.8}}
    assert codes(healthy, lower_loss) == set()  # a held-out loss that falls is an improvement
    assert codes(healthy[:2], None, max_steps=6) == set()  # a summary (even empty) means the run finished
    stopped = check_run(healthy[:2], None, 6)  # still running, or killed: no error known
    assert [(f.code, f.level) for f in stopped] == [("stopped", "warning")] and "step 2 of 6" in stopped[0].message
    failed = check_run(healthy[:2], None, 6, "RuntimeError: CUDA out of memory")
    assert [(f.code, f.level) for f in failed] == [("stopped", "error")] and "out of memory" in failed[0].message
    nan_stop = check_run(healthy[:2], None, 6, "step 3: the loss is nan (not finite); the run stops here.")
    assert [f.code for f in nan_stop] == ["non_finite_stop"]


def test_a_held_out_fall_beyond_its_noise_warns_whatever_else_rose():
    """The reinforce_pp case of issue 43: accuracy 0.390 → 0.290 over 100 rows (noise 2·√(0.39·0.61/100) = 0.0975)
    while eval/reward_sampled rose by 0.005 of noise: a warning, where 'any metric rose' saw nothing wrong."""
    healthy = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}]
    before = {"eval/reward": 0.39, "eval/accuracy": 0.39, "eval/reward_sampled": 0.234}

    def summary(accuracy, rows=100, **after):
        return {"eval_before": before, "eval_rows": rows,
                "eval_after": {**before, "eval/reward_sampled": 0.239, "eval/accuracy": accuracy, **after}}  # fmt: skip

    [fell] = [f for f in check_run(healthy, summary(0.29)) if f.code == "held_out_fell"]
    assert fell.level == "warning" and fell.message == (
        "held-out accuracy fell: 0.390 → 0.290, more than its noise 0.098 over 100 held-out rows (whatever else rose)"
    )
    assert codes(healthy, summary(0.30)) == set()  # 0.09: within the noise of 100 rows
    assert codes(healthy, summary(0.36, rows=10_000)) == {"held_out_fell"}  # 0.03 > 2·√(p(1−p)/n) = 0.0098
    assert codes(healthy, summary(0.375, rows=10_000)) == set()  # 0.015: under the 0.02 floor
    assert codes(healthy, summary(0.36, rows=0)) == {"held_out_fell"}  # n unknown (an older run): 0.02
    loss = {"eval_before": {"eval/loss": 1.0}, "eval_after": {"eval/loss": 1.05}, "eval_rows": 50}
    assert codes(healthy, loss) == {"held_out_fell", "no_held_out_gain"}
    assert codes(healthy, {**loss, "eval_after": {"eval/loss": 1.01}}) == {"no_held_out_gain"}


def test_long_curves_are_thinned_keeping_spikes_and_non_finite_points():
    points = [(float(s), 1.0) for s in range(1, 10_001)]
    points[4_321] = (4_322.0, 50.0)  # a spike
    points[7_000] = (7_001.0, float("nan"))
    kept = thin(points, 1000)
    assert len(kept) <= 1100 and kept == sorted(kept, key=lambda p: p[0])
    assert (4_322.0, 50.0) in kept and any(x == 7_001.0 for x, y in kept if y != y)
    assert thin(points[:50], 1000) == points[:50]


@pytest.mark.slow
def test_end_of_run_table_flags_a_constant_zero_reward(tmp_path, tiny_model_dir):
    """A real run whose reward is always 0: the table (shown even with --quiet) says so, as an error."""
    plugin = tmp_path / "zero.py"
    plugin.write_text(ZERO_REWARD)
    run = tmp_path / "zero"
    proc = oxrl(
        "run", "--alg", "sgrpo", "--set", f"model.name={tiny_model_dir}", "--set", f"reward.name={plugin}:Zero",
        "--set", "train.batch_size=4", "--set", "rollout.n=2", "--set", "train.max_steps=2", "-q", "-o", str(run),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "how the run went" in err and "reward constant at 0.000 over all 2 steps" in err
    assert re.search(r"^\s*error\s+reward constant", err, re.M)  # the row is labelled an error
    assert f"oxrl report {run}" in err and str(run / "final") in err  # where the report command and the model are
    assert re.search(r"steps\s+2 of 2", err) and re.search(r"time\s+\d+s", err)
    assert "done: 2 steps" in err and "1 error(s)" in err
    assert "step 1/2" not in err  # --quiet: no progress lines, only the outcome
    summary = json.loads((run / "summary.json").read_text())
    assert summary["environment"]["torch"] and summary["environment"]["device"] == "cpu"


@pytest.mark.slow
def test_rollouts_jsonl_on_resume_is_cut_back_to_the_checkpoint_and_equals_an_uninterrupted_run(
    tmp_path, tiny_model_dir
):
    from oxrl_core import Trainer

    sets = [f"model.name={tiny_model_dir}", "train.batch_size=4", "rollout.n=2", "train.eval_every=0"]
    sets += ["logging.rollout_samples_every=1", "train.save_every=2"]
    run = tmp_path / "run"
    Trainer(alg="sgrpo", overrides=[*sets, "train.max_steps=3"], output_dir=run, quiet=True).train()
    uninterrupted = (run / "rollouts.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in uninterrupted] == [1, 2, 3]
    # as if killed after step 3's line was written but before its checkpoint: resume from step 2
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    for ckpt in (run / "checkpoints").iterdir():
        if ckpt.name != "step-2":
            shutil.rmtree(ckpt)
    Trainer(alg="sgrpo", overrides=[*sets, "train.max_steps=3"], output_dir=run, resume=True, quiet=True).train()
    resumed = (run / "rollouts.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in resumed] == [1, 2, 3]  # step 3 once, not twice
    assert [json.loads(line) for line in resumed] == [json.loads(line) for line in uninterrupted]


def test_end_of_run_table_is_coloured_on_a_terminal_and_plain_in_a_log():
    import io

    from rich.console import Console

    from oxrl_core.observability.health import Finding, print_summary, summary_rows

    summary = {"steps": 2, "train_seconds": 75.0, "eval_before": {"eval/accuracy": 0.2}, "eval_after": {}}
    records = [{"step": 1, "loss": 1.0, "reward/mean": 0.0}, {"step": 2, "loss": 0.5, "reward/mean": 0.0}]
    findings = [Finding("error", "reward_constant", "reward constant at 0.000"), Finding("warning", "x", "look")]
    rows = summary_rows(records, summary, findings, None, Path("runs/r"), Path("runs/r/final"))
    assert ("time", "1m 15s", "") in rows and ("error", "reward constant at 0.000", "bold red") in rows
    assert ("warning", "look", "yellow") in rows and rows[-2:] == [
        ("report", "oxrl report runs/r", ""),
        ("model", "runs/r/final", ""),
    ]
    terminal = io.StringIO()
    print_summary(Console(file=terminal, force_terminal=True, width=100), "how it went", rows)
    assert "\x1b[1;31m" in terminal.getvalue()  # bold red
    log = io.StringIO()
    print_summary(Console(file=log, width=80), "how it went", rows)
    assert "\x1b[" not in log.getvalue() and "reward constant at 0.000" in log.getvalue()
    assert not [f for f in summary_rows(records, summary, [], None, "r", "f") if f[0] in ("error", "warning")]


def test_every_curve_kind_is_drawn_when_its_metric_is_logged(tmp_path):
    """A run dir with every metric a plot reads (MFU only comes from a GPU, KL only with a reference): each plot."""
    from oxrl_core.observability.report import PLOTS

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algorithm: ppo\ntrain:\n  max_steps: 3\n")
    keys = [k for plot in PLOTS for k in plot.keys if not k.endswith("/")]
    keys += ["loss/value", "eval/accuracy", "logps/chosen", "kl/ref", "reward/std", "values/mean", "perf/elapsed_s"]
    lines = [{"step": s, **{k: 0.1 * s + i for i, k in enumerate(keys)}} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = {"steps": 3, "train_seconds": 1.0, "eval_before": {"eval/accuracy": 0.1}, "eval_after": {}}
    (run / "summary.json").write_text(json.dumps(summary))
    proc = oxrl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    parsed, text = page(run / "report.html")
    assert {plot.id for plot in PLOTS} <= set(parsed.plots), {plot.id for plot in PLOTS} - set(parsed.plots)
    assert "other-values/mean" in parsed.plots  # a metric no plot names is still drawn, under "every other"
    assert "reward_distribution" not in parsed.plots and parsed.viewers == 0  # no rollouts.jsonl: no viewer
