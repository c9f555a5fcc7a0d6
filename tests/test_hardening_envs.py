"""Hardening, environments (issue 24, items 4-7), through the real `oxrl` CLI where a user meets them.

5. An environment that fails in every episode: its first failure (the call, the exception, where it was
   raised) in one log line per step and in the metrics (``env/first_error``, ``env/error_share``), and the
   run stops after ``env.error_steps`` steps over ``env.max_error_share``, naming the environment and its
   error, checkpoints kept.

The CLI runs use the built-in model's arithmetic warm start (shared with tests/test_multiturn_e2e.py) on a
small local file, one short run per item.
"""

from __future__ import annotations

import pytest
from conftest import oxrl, read_metrics, write_jsonl

from oxrl_core.errors import OxrlError
from oxrl_core.loops.episodes import EnvFailures, EnvWatch, Episode
from oxrl_core.tiny import warm_start_dir


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_user_error(proc, *fragments: str) -> str:
    """Exit 2, every fragment in the (whitespace-collapsed) output, no traceback."""
    text = flat(proc.stdout + proc.stderr)
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in: {text[-3000:]}"
    return text


def sets(tmp_path, **extra) -> list[str]:
    """A small multi-turn run on the arithmetic warm start: 4 prompts x 4 episodes a step, no held-out set."""
    rows = write_jsonl(
        tmp_path / "q.jsonl",
        [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(2, 9)],
    )
    values = {
        "model.name": warm_start_dir(), "data.train": rows, "env.max_turns": 3, "env.max_tokens": 48,
        "train.batch_size": 4, "rollout.n": 4, "rollout.max_new_tokens": 8, "reward.name": "arith",
        "train.eval_steps": 0, **extra,
    }  # fmt: skip
    return [x for k, v in values.items() for x in ("--set", f"{k}={v}")]


# ---------------------------------------------------------------------------------------------
# 5. An environment that fails in every episode
# ---------------------------------------------------------------------------------------------

FAILING_ENV = """
from oxrl_core.interfaces import Environment


class Failing(Environment):
    name = "failing"

    def step(self, messages):
        raise RuntimeError("the simulator crashed")
"""


def test_an_environment_failing_in_every_episode_stops_the_run_naming_it_and_its_error(tmp_path):
    from oxrl_core.checkpoint import latest_checkpoint

    env_file = tmp_path / "failing_env.py"
    env_file.write_text(FAILING_ENV)
    run = tmp_path / "run"
    args = sets(tmp_path, **{"env.name": f"{env_file}:Failing", "train.max_steps": 4, "train.save_steps": 1})
    proc = oxrl("run", "--alg", "sgrpo", *args, "--set", "env.error_steps=2", "-o", str(run))
    last = latest_checkpoint(run)
    assert last is not None and last.name == "step-1", proc.stderr  # the step before the stop is kept
    crash = "step() raised RuntimeError: the simulator crashed (failing_env.py:9)"
    text = assert_user_error(
        proc,
        f"step 2: environment '{env_file}:Failing' failed in ",
        " of 16 episodes (",
        "env.max_error_share=0.5 in each of the last 2 steps",
        "first failure on row ",
        crash,
        f"last complete checkpoint: {last}",
        "--resume",
    )
    assert "done" not in text and not (run / "final").exists()
    (metrics,) = read_metrics(run)  # step 2 stopped before training on episodes that all score 0
    # every episode that reached the environment failed (one cut at rollout.max_new_tokens never called it)
    assert metrics["env/errors"] > 8 and metrics["env/error_share"] == metrics["env/errors"] / 16
    assert crash in metrics["env/first_error"]
    # one line per step, with the error's text (16 episodes a step here, ~1,000 in a real run)
    assert len([line for line in proc.stderr.splitlines() if line.startswith("step ") and crash in line]) == 2


def _episode(ended: str = "", error: str = "", prompt: str = "What is 2*3?") -> Episode:
    return Episode({"prompt": prompt}, None, [], [], ended=ended, error=error)


def test_env_failures_keep_the_first_error_and_the_watch_counts_steps_in_a_row(tmp_path):
    timeout = _episode("timeout", "step() ran past the environment's timeout_s=0.5 s")
    error = _episode("error", "step() raised KeyError: 'answr' (env.py:3)", prompt="What is 7*8? " * 20)
    failures = EnvFailures("sim").count([_episode("done"), timeout, error, _episode("max_turns")])
    assert (failures.episodes, failures.errors, failures.timeouts, failures.share) == (4, 1, 1, 0.5)
    # an exception says more than a timeout: it is the first failure shown, with its row and prompt
    assert failures.first().startswith("row 3 (prompt 'What is 7*8? What is") and "KeyError: 'answr'" in failures.first()
    line = failures.describe()
    assert line.startswith("environment 'sim' failed on row 3: step() raised KeyError: 'answr' (env.py:3)")
    assert "2 of 4 episodes failed (50%, 1 raised or returned something malformed, 1 timed out)" in line
    other = EnvFailures("sim").count([timeout])  # another rank's share
    assert EnvFailures("sim").merge(other).merge(failures).first() == failures.first()

    def step(failed: int, episodes: int = 10) -> EnvFailures:
        return EnvFailures("sim").count([error] * failed + [_episode("done")] * (episodes - failed))

    watch = EnvWatch(0.5, 3)
    for failed in (10, 6, 5, 10, 10):  # 5 of 10 is not above 0.5: the streak starts again
        watch.after_scoring(1, step(failed), tmp_path)
    with pytest.raises(OxrlError) as info:
        watch.after_scoring(6, step(7), tmp_path)
    message = str(info.value)
    assert "step 6: environment 'sim' failed in 7 of 10 episodes (70%)" in message
    assert "env.max_error_share=0.5 in each of the last 3 steps" in message and "no checkpoint was saved yet" in message
    for watch in (EnvWatch(0.5, 0), EnvWatch(1.0, 1)):  # off: 0 steps, or a share that cannot be exceeded
        for _ in range(5):
            watch.after_scoring(1, step(10), tmp_path)


def test_env_error_keys_default_as_the_reward_ones_and_are_validated():
    from pydantic import ValidationError

    from oxrl_core.config import RunConfig, env_options

    cfg = RunConfig.model_validate({"algorithm": "sgrpo", "env": {"name": "x", "level": 2}})
    assert (cfg.env.max_error_share, cfg.env.error_steps) == (
        cfg.rollout.max_reward_error_share,
        cfg.rollout.reward_error_steps,
    ) == (0.5, 3)
    assert env_options(cfg) == {"level": 2}  # the environment's own options only
    for bad in ({"max_error_share": 1.5}, {"max_error_share": -0.1}, {"error_steps": -1}):
        with pytest.raises(ValidationError):
            RunConfig.model_validate({"algorithm": "sgrpo", "env": {"name": "x", **bad}})
