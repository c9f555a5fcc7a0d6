"""`oxrl bug-report [RUN_DIR]` and the error log it reads: a run that fails keeps its traceback in
``RUN_DIR/error.log`` (the terminal shows one line); the report has the sections, the traceback, the config
and the last metrics, and none of the secrets planted in the config, the environment or the traceback."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from conftest import oxrl

from oxrl_core.commands.bug_report import REDACTED, bug_report, fence, is_secret_name, redact, secret_values
from oxrl_core.run_io import lifecycle

HF_TOKEN = "hf_PLANTEDabcdefghijklmnopqrstuvwxyz012"
API_KEY = "sk-proj-PLANTEDkey0123456789abcdefABCDEF"
DB_PASSWORD = "correct-horse-battery-staple"

#: a reward that cannot start: its constructor raises (with the HF token in the message), after the run
#: directory exists — the failure `raise ... from None` turns into one line on the terminal
BOOM_REWARD = textwrap.dedent(
    """
    import os

    from oxrl_core.interfaces import Reward
    from oxrl_core.schema import StrictModel


    class Boom(Reward):
        name = "boom"

        class Config(StrictModel):
            api_key: str = ""
            db_password: str = ""

        def __init__(self, config=None):
            super().__init__(config)
            raise ConnectionError("the judge refused token " + os.environ["HF_TOKEN"])

        def score(self, prompts, completions, examples):
            return [0.0] * len(completions)
    """
)

SECTIONS = (
    "# oxRL bug report",
    "## What happened",
    "## Versions (`oxrl doctor`)",
    "## Plugins (`oxrl plugins`)",
    "## Resolved config (`config.yaml`)",
    "## Last error",
)


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A real run whose reward raises when it is built: exit 2, one line on the terminal, error.log kept."""
    root = tmp_path_factory.mktemp("crash")
    (root / "boom_reward.py").write_text(BOOM_REWARD)
    run_dir = root / "run"
    proc = oxrl(
        "run", "--alg", "sgrpo", "-o", str(run_dir), "--set", f"model.name={tiny_model_dir}",
        "--set", "train.max_steps=2", "--set", "reward.name=boom_reward.py:Boom",
        "--set", f"reward.api_key={API_KEY}", "--set", f"reward.db_password={DB_PASSWORD}",
        cwd=root, env={"HF_TOKEN": HF_TOKEN},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "could not start: ConnectionError" in proc.stderr
    assert "Traceback" not in proc.stderr  # the terminal keeps the one-line message
    return run_dir


@pytest.mark.slow
def test_a_failed_run_keeps_its_traceback_in_error_log(crashed_run):
    log = (crashed_run / "error.log").read_text()
    assert log.startswith(lifecycle.ERROR_LOG_HEADER)
    assert "error: OxrlError: reward 'boom_reward.py:Boom' could not start: ConnectionError" in log
    assert "Traceback (most recent call last)" in log
    assert "oxrl_core/scoring/rewards.py" in log and "build_reward" in log  # where the run failed
    # the plugin's own traceback, which `raise ... from None` hides on the terminal
    assert "raised while handling (hidden on the terminal)" in log
    assert 'boom_reward.py", line' in log and "in __init__" in log
    assert "command: oxrl run --alg sgrpo" in log
    assert not list(crashed_run.glob(".tmp-*"))  # written atomically: no temp file left


@pytest.mark.slow
def test_bug_report_of_a_failed_run_has_the_sections_and_no_secret(crashed_run, tmp_path):
    out = tmp_path / "issue.md"
    proc = oxrl("bug-report", str(crashed_run), "-o", str(out), env={"HF_TOKEN": HF_TOKEN, "MY_API_KEY": API_KEY})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # -o: the file only
    report = out.read_text()
    positions = [report.index(section) for section in SECTIONS]
    assert positions == sorted(positions)
    assert "Traceback (most recent call last)" in report and "ConnectionError: the judge refused token" in report
    assert "| torch | ok |" in report and "| algorithm | sgrpo | oxrl-algs-rl |" in report
    assert "algorithm: sgrpo" in report and "name: boom_reward.py:Boom" in report  # the resolved config
    assert f"  api_key: {REDACTED}" in report and f"  db_password: {REDACTED}" in report
    assert "No `metrics.jsonl`: the run did no step." in report
    for secret in (HF_TOKEN, API_KEY, DB_PASSWORD, "PLANTED"):
        assert secret not in report
    # the same report on stdout without -o, even with the secrets not in the environment (found by shape / name)
    proc = oxrl("bug-report", str(crashed_run), env={"HF_TOKEN": "", "MY_API_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    assert "## Last error" in proc.stdout and "Traceback (most recent call last)" in proc.stdout
    assert not any(secret in proc.stdout for secret in (HF_TOKEN, API_KEY, DB_PASSWORD, "PLANTED"))


@pytest.mark.slow
def test_bug_report_without_a_run_dir_has_versions_and_plugins_only():
    proc = oxrl("bug-report")
    assert proc.returncode == 0, proc.stderr
    assert "## Versions (`oxrl doctor`)" in proc.stdout and "## Plugins (`oxrl plugins`)" in proc.stdout
    assert "| oxrl | ok | " in proc.stdout and "| python | ok |" in proc.stdout
    assert "| dataset | arith | oxrl |" in proc.stdout
    for absent in ("## Resolved config", "## Last error", "metrics.jsonl"):
        assert absent not in proc.stdout


@pytest.mark.slow
def test_bug_report_of_a_finished_run_has_its_last_metrics_and_redacts_home_on_request(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    run_dir = home / "runs" / "sft"
    proc = oxrl(
        "run", "--alg", "sft", "-q", "-o", str(run_dir), "--set", f"model.name={tiny_model_dir}",
        "--set", "train.max_steps=3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert not (run_dir / "error.log").exists()  # a run that did not fail writes none
    env = {"HOME": str(home)}
    plain = oxrl("bug-report", str(run_dir), "--metrics", "2", env=env)
    assert plain.returncode == 0, plain.stderr
    assert "## Last 2 metrics lines (`metrics.jsonl`)" in plain.stdout
    assert '{"step": 2, ' in plain.stdout and '{"step": 3, ' in plain.stdout and '{"step": 1, ' not in plain.stdout
    assert "No `error.log` in the run directory" in plain.stdout
    assert str(home) in plain.stdout  # paths are kept unless asked
    redacted = oxrl("bug-report", str(run_dir), "--redact-paths", env=env)
    assert redacted.returncode == 0, redacted.stderr
    assert str(home) not in redacted.stdout and "~/runs/sft" in redacted.stdout


@pytest.mark.slow
def test_a_nan_stop_keeps_its_error_and_the_report_shows_the_metrics_before_it(tmp_path, tiny_model_dir, sft_jsonl):
    run_dir = tmp_path / "nan"
    proc = oxrl(
        "run", "--alg", "sft", "-q", "-o", str(run_dir), "--set", f"model.name={tiny_model_dir}",
        "--set", f"data.train={sft_jsonl}", "--set", "train.max_steps=20", "--set", "train.lr=1e30",
        "--set", "train.max_grad_norm=0",
    )  # fmt: skip
    assert proc.returncode == 2 and "not finite" in proc.stderr and "Traceback" not in proc.stderr
    log = (run_dir / "error.log").read_text()
    assert "(not finite); the run stops here" in log and "in check_loss" in log and "Traceback" in log
    report = oxrl("bug-report", str(run_dir), "--metrics", "1")
    assert report.returncode == 0, report.stderr
    assert "## Last 1 metrics lines (`metrics.jsonl`)" in report.stdout and "in check_loss" in report.stdout


def test_bug_report_refuses_a_run_dir_that_is_not_one(tmp_path):
    proc = oxrl("bug-report", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "is not a directory" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- the parts, by hand


def test_error_log_keeps_failures_not_requested_stops(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with lifecycle.error_log(tmp_path):
            1 / 0  # the failure under test
    log = (tmp_path / lifecycle.ERROR_LOG).read_text()
    assert "error: ZeroDivisionError: division by zero" in log and "in test_error_log_keeps" in log
    (tmp_path / lifecycle.ERROR_LOG).unlink()
    for stop in (lifecycle.Interrupted(2, "interrupted"), KeyboardInterrupt(), SystemExit(0)):
        with pytest.raises(type(stop)):
            with lifecycle.error_log(tmp_path):
                raise stop
    assert not (tmp_path / lifecycle.ERROR_LOG).exists()


def test_error_log_shows_what_raise_from_none_hides(tmp_path):
    from oxrl_core.errors import OxrlError

    def load():
        try:
            raise ValueError("the real cause")
        except ValueError:
            raise OxrlError("model.name: cannot load") from None

    with pytest.raises(OxrlError):
        with lifecycle.error_log(tmp_path):
            load()
    log = (tmp_path / lifecycle.ERROR_LOG).read_text()
    assert log.index("OxrlError: model.name: cannot load") < log.index("ValueError: the real cause")


@pytest.mark.parametrize(
    "name", ["hf_token", "HF_TOKEN", "WANDB_API_KEY", "reward.api_key", "db_password", "apiKey", "client_secret"]
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name", ["max_new_tokens", "pad_token_id", "max_tokens_per_micro_batch", "name", "tokenizer", "PWD", "keys"]
)
def test_names_that_are_not_secret(name):
    assert not is_secret_name(name)


def test_redact_by_name_by_value_and_by_shape():
    wandb = "0123456789abcdef0123456789abcdef01234567"
    text = (
        f"reward:\n  api_key: {API_KEY}\n  max_new_tokens: 64\n  pad_token_id: 0\n"
        f'{{"hf_token": "{HF_TOKEN}", "loss": 1.5}}\n'
        f"command: oxrl run --set reward.api_key={API_KEY} --set train.lr=1e-5\n"
        f"OPENAI_API_KEY='{API_KEY}' WANDB_API_KEY={wandb}\n"
        f"error: 401 for {HF_TOKEN}; wandb key {wandb}; Authorization: Bearer abc.def-ghi_jkl\n"
        f"the password was {DB_PASSWORD}\n"
    )
    secrets = secret_values(text, {"DB_PASSWORD": DB_PASSWORD, "PWD": "/home/me", "TOKENIZERS_PARALLELISM": "false"})
    assert DB_PASSWORD in secrets and "/home/me" not in secrets
    out = redact(text, secrets)
    for secret in (API_KEY, HF_TOKEN, wandb, DB_PASSWORD, "abc.def-ghi_jkl"):
        assert secret not in out
    assert "max_new_tokens: 64" in out and "pad_token_id: 0" in out and "train.lr=1e-5" in out
    assert f"api_key: {REDACTED}" in out and f'"hf_token": "{REDACTED}"' in out and '"loss": 1.5' in out
    assert f"OPENAI_API_KEY='{REDACTED}'" in out


def test_redact_paths_under_home_only_on_request():
    text = "/home/me/runs/x and /home/meadow/y and /home/me"
    assert redact(text) == text
    assert redact(text, home="/home/me") == "~/runs/x and /home/meadow/y and ~"


def test_a_fence_the_text_cannot_close():
    block = fence("a ``` inside\n````", "text")
    assert block.startswith("`````text\n") and block.endswith("\n`````")


def test_bug_report_in_process_reads_the_run_files(tmp_path):
    (tmp_path / "config.yaml").write_text(f"algorithm: sft\nlogging:\n  wandb_key: {'ab' * 20}\n")
    rows = [{"step": i, "loss": 1.0 / i} for i in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "lo')
    (tmp_path / lifecycle.ERROR_LOG).write_text(f"{lifecycle.ERROR_LOG_HEADER} at now\nTraceback: boom\n")
    os.utime(tmp_path / lifecycle.ERROR_LOG, (0, 0))
    (tmp_path / "summary.json").write_text('{"steps": 7}')
    report = bug_report(tmp_path, metrics=3, environ={})
    assert '"step": 5' in report and '"step": 7' in report and '"step": 4' not in report  # torn line skipped
    assert "Traceback: boom" in report and "the run finished after this error" in report
    assert "ab" * 20 not in report and f"wandb_key: {REDACTED}" in report
