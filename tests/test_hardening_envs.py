"""Hardening, environments (issue 24, items 4-7), through the real `oxrl` CLI where a user meets them.

4. An environment that busy-loops past its ``timeout_s``: its episode's worker process is killed (the pid is
   gone, and nothing of it uses the CPU afterwards); a result that cannot cross the process boundary, a worker
   that dies, a hang in ``reset`` are each that episode's failure, named.
5. An environment that fails in every episode: its first failure (the call, the exception, where it was
   raised) in one log line per step and in the metrics (``env/first_error``, ``env/error_share``), and the
   run stops after ``env.error_steps`` steps over ``env.max_error_share``, naming the environment and its
   error, checkpoints kept. (One CLI run shows items 4 and 5: half its episodes raise, half busy-loop.)
6. The context-length check and the end-of-run finding name ``env.max_tokens`` when it is the setting that
   is too long or that cut the episodes, not ``rollout.max_new_tokens``.
7. A typo in ``env.*`` (the environment's own options, ``env.tool_parser``) is reported before the built-in
   model's tool-use warm start, and leaves no run directory.

The CLI runs use the built-in model's arithmetic warm start (shared with tests/test_multiturn_e2e.py) on a
small local file; the unit tests play episodes with test_episodes.py's scripted backend.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl
from test_episodes import play

from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Environment
from oxrl_core.models.tiny import build_model, build_tokenizer, warm_start_dir
from oxrl_core.rl.episodes import EnvWatch, Episode, episode_failures
from oxrl_core.scoring.rewards import Failures


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
        "train.eval_every": 0, **extra,
    }  # fmt: skip
    return [x for k, v in values.items() for x in ("--set", f"{k}={v}")]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# 4. Each episode's environment in a worker process, killed on timeout
# ---------------------------------------------------------------------------------------------


class BusyLoop(Environment):
    name, timeout_s = "busy_loop", 0.5

    def step(self, messages):
        while True:
            pass


def _cpu_seconds() -> float:
    """CPU time of this process and of every process below it (the environment host and its workers)."""
    total, todo, tick = 0.0, [os.getpid()], os.sysconf("SC_CLK_TCK")
    while todo:
        pid = todo.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def test_a_busy_looping_environment_is_killed_at_its_timeout_and_nothing_of_it_keeps_running():
    tok = build_tokenizer()
    runner, _, episodes = play(tok, build_model(len(tok)), ["a", "b"], env_cls=BusyLoop, max_turns=3)
    assert [e.ended for e in episodes] == ["timeout", "timeout"]
    assert all(e.error == "step() ran past the environment's timeout_s=0.5 s" for e in episodes)
    assert runner.metrics(episodes)["env/timeouts"] == 2
    assert not [e.env.pid for e in episodes if _exists(e.env.pid)]  # the workers are gone ...
    before = _cpu_seconds()
    time.sleep(2)
    assert _cpu_seconds() - before < 0.2  # ... and nothing spins on (a thread left looping would burn 2 s)


class Misbehaves(Environment):
    """Each prompt a different way to fail across the process boundary."""

    name, timeout_s = "misbehaves", 0.5

    def reset(self, row):
        while row["prompt"] == "hang in reset":
            pass
        return None

    def step(self, messages):
        prompt = messages[0]["content"]
        if prompt == "unpicklable":
            return [{"role": "tool", "content": "x", "callback": lambda: 0}], 0.0, False
        if prompt == "dies":
            os._exit(3)
        if prompt == "exits":
            raise SystemExit(1)
        return [], 1.0, True


def test_what_cannot_cross_the_process_boundary_or_ends_its_worker_is_that_episodes_failure():
    tok = build_tokenizer()
    rows = [{"prompt": p} for p in ("hang in reset", "unpicklable", "dies", "exits", "fine")]
    runner, _, episodes = play(tok, build_model(len(tok)), ["a"], env_cls=Misbehaves, rows=rows, max_turns=2)
    got = {e.row["prompt"]: (e.ended, e.error) for e in episodes}  # (the 2 episodes of a row agree)
    assert got["hang in reset"] == ("timeout", "reset() ran past the environment's timeout_s=0.5 s")
    unpicklable = got["unpicklable"][1]
    assert "step() returned an object that cannot be sent" in unpicklable and "return plain data" in unpicklable
    assert got["dies"][0] == "error" and "the environment's worker process died" in got["dies"][1]
    assert got["exits"][0] == "error" and got["exits"][1].startswith("step() raised SystemExit: 1")
    assert got["fine"] == ("done", "")
    deadline = time.monotonic() + 5  # the killed workers are gone at once, the closed ones exit as they read it
    while [e for e in episodes if _exists(e.env.pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [e.env.pid for e in episodes if _exists(e.env.pid)]


def test_an_environment_class_its_workers_cannot_import_is_refused_naming_it():
    from oxrl_core.rollout.env_worker import spawn

    in_main = type("InMain", (BusyLoop,), {"__module__": "__main__"})
    with pytest.raises(OxrlError, match="InMain is defined in __main__"):
        spawn(in_main, in_main.Config(), None, 1)


# ---------------------------------------------------------------------------------------------
# 5. An environment that fails in every episode (and 4. through the CLI: half of it busy-loops)
# ---------------------------------------------------------------------------------------------

FAILING_ENV = '''
import os
from pathlib import Path

from oxrl_core.interfaces import Environment

MARKS = Path(MARKS_DIR)


class Failing(Environment):
    """Odd first factors raise; even ones busy-loop, leaving a mark with the worker's pid."""

    name = "failing"
    timeout_s = 0.5

    def reset(self, row):
        for mark in MARKS.glob("*.busy"):  # a worker of an earlier step that busy-looped must be gone by now
            try:
                os.kill(int(mark.stem), 0)
                (MARKS / (mark.stem + ".alive")).touch()
            except ProcessLookupError:
                pass
        return None

    def step(self, messages):
        if int(messages[0]["content"].split()[2].split("*")[0]) % 2:
            raise RuntimeError("the simulator crashed")
        (MARKS / f"{os.getpid()}.busy").touch()
        while True:
            pass
'''


def test_an_environment_failing_in_every_episode_stops_the_run_naming_it_and_its_error(tmp_path):
    from oxrl_core.run_io.checkpoint import latest_checkpoint

    marks = tmp_path / "marks"
    marks.mkdir()
    source = FAILING_ENV.replace("MARKS_DIR", repr(str(marks)))
    env_file = tmp_path / "failing_env.py"
    env_file.write_text(source)
    line = source.splitlines().index('            raise RuntimeError("the simulator crashed")') + 1
    run = tmp_path / "run"
    args = sets(tmp_path, **{"env.name": f"{env_file}:Failing", "train.max_steps": 4, "train.save_every": 1})
    proc = oxrl("run", "--alg", "sgrpo", *args, "--set", "env.error_steps=2", "-o", str(run))
    last = latest_checkpoint(run)
    assert last is not None and last.name == "step-1", proc.stderr  # the step before the stop is kept
    crash = f"step() raised RuntimeError: the simulator crashed (failing_env.py:{line})"
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
    failed = metrics["env/errors"] + metrics["env/timeouts"]
    assert failed > 8 and metrics["env/timeouts"] > 0 and metrics["env/error_share"] == failed / 16
    assert crash in metrics["env/first_error"]  # an exception's text, in preference to a timeout's
    # one line per step, with the error's text (16 episodes a step here, ~1,000 in a real run)
    assert len([line for line in proc.stderr.splitlines() if line.startswith("step ") and crash in line]) == 2
    # 4. each busy-looping worker was killed at its timeout: none was alive when a later episode started, and
    # none is now
    busy = [int(mark.stem) for mark in marks.glob("*.busy")]
    assert busy and not list(marks.glob("*.alive"))
    assert not [pid for pid in busy if _exists(pid)]


def _episode(ended: str = "", error: str = "", prompt: str = "What is 2*3?") -> Episode:
    return Episode({"prompt": prompt}, None, [], [], ended=ended, error=error)


def test_env_failures_keep_the_first_error_and_the_watch_counts_steps_in_a_row(tmp_path):
    timeout = _episode("timeout", "step() ran past the environment's timeout_s=0.5 s")
    error = _episode("error", "step() raised KeyError: 'answr' (env.py:3)", prompt="What is 7*8? " * 20)
    failures = episode_failures("sim", [_episode("done"), timeout, error, _episode("max_turns")])
    assert (failures.samples, failures.errors, failures.timeouts, failures.share) == (4, 1, 1, 0.5)
    # an exception says more than a timeout: it is the first failure shown, with its row and prompt
    assert (
        failures.first().startswith("row 3 (prompt 'What is 7*8? What is") and "KeyError: 'answr'" in failures.first()
    )
    line = failures.describe()
    assert line.startswith("environment 'sim' failed on row 3: step() raised KeyError: 'answr' (env.py:3)")
    assert "2 of 4 episodes failed (50%, 1 raised or returned something malformed, 1 timed out)" in line
    other = episode_failures("sim", [timeout])  # another rank's share
    assert Failures("sim", "environment").merge(other).merge(failures).first() == failures.first()

    def step(failed: int, episodes: int = 10) -> Failures:
        return episode_failures("sim", [error] * failed + [_episode("done")] * (episodes - failed))

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
    assert (
        (cfg.env.max_error_share, cfg.env.error_steps)
        == (
            cfg.rollout.max_reward_error_share,
            cfg.rollout.reward_error_steps,
        )
        == (0.5, 3)
    )
    assert env_options(cfg) == {"level": 2}  # the environment's own options only
    for bad in ({"max_error_share": 1.5}, {"max_error_share": -0.1}, {"error_steps": -1}):
        with pytest.raises(ValidationError):
            RunConfig.model_validate({"algorithm": "sgrpo", "env": {"name": "x", **bad}})


# ---------------------------------------------------------------------------------------------
# 6. Each length message names the setting that caused it
# ---------------------------------------------------------------------------------------------


def test_length_messages_name_env_max_tokens_when_it_is_the_setting_that_cut(tmp_path):
    # the model has 512 positions: an episode of env.max_tokens=512 (the default) does not fit, whatever
    # rollout.max_new_tokens is; the message names env.max_tokens and the largest value that fits
    proc = oxrl("run", "--alg", "sgrpo", *sets(tmp_path, **{"env.name": "calculator", "env.max_tokens": 512}),
                "-o", str(tmp_path / "long"))  # fmt: skip
    text = assert_user_error(proc, "env.max_tokens=512 does not fit the model's context", "set env.max_tokens <= ")
    assert "rollout.max_new_tokens" not in text
    # episodes cut by their token budget: the end-of-run table says to raise env.max_tokens, not max_new_tokens
    run = tmp_path / "cut"
    proc = oxrl(
        "run", "--alg", "sgrpo", *sets(tmp_path, **{"env.name": "calculator", "env.max_tokens": 1,
                                                   "train.max_steps": 1}), "-o", str(run), env={"COLUMNS": "400"},
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (metrics,) = read_metrics(run)
    # one token per episode: every first turn is cut by the budget (unless it is EOS), none by max_new_tokens=8
    assert metrics["env/cut_by_max_tokens"] > 0.9 and metrics["env/cut_by_max_new_tokens"] == 0.0
    text = flat(proc.stderr)
    assert "of episodes ended cut at the end of the run: " in text, text[-3000:]
    assert "% at env.max_tokens (the episode's token budget); they are scored unfinished (raise env.max_tokens)" in text
    assert "raise rollout.max_new_tokens" not in text
    assert (run / "final" / "config.json").is_file()


def test_the_cut_finding_names_each_setting_by_its_share():
    from oxrl_core.observability.health import check_run

    def cut(by_budget: float, by_turn: float) -> list[str]:
        records = [
            {"step": 1, "response/clipped": by_budget + by_turn, "env/cut_by_max_tokens": by_budget,
             "env/cut_by_max_new_tokens": by_turn}
        ]  # fmt: skip
        return [f.message for f in check_run(records, None) if f.code == "clipped"]

    (message,) = cut(0.2, 0.6)
    assert (
        "80% of episodes ended cut" in message
        and "60% at rollout.max_new_tokens (one model turn's limit), 20% at env.max_tokens" in message
    )
    assert message.endswith("(raise rollout.max_new_tokens / env.max_tokens)")
    assert cut(0.3, 0.1) == []  # most episodes finished
    (single,) = [f.message for f in check_run([{"step": 1, "response/clipped": 0.9}], None) if f.code == "clipped"]
    assert "cut at rollout.max_new_tokens" in single and "env.max_tokens" not in single  # single-turn, as before


# ---------------------------------------------------------------------------------------------
# 7. Environment options are checked before any warm start
# ---------------------------------------------------------------------------------------------


def test_a_typo_in_env_options_is_reported_before_the_tool_use_warm_start(tmp_path):
    """On the built-in model the tool-use warm start (170 SFT steps, minutes on 2 cores) comes first in the
    run: a fresh cache shows that none was built, and no run directory is left behind. A reward's own options
    (``reward.*``) are checked as early (the single-turn warm start would come first otherwise)."""
    fresh = {"OXRL_CACHE": str(tmp_path / "fresh-cache")}
    for typo, named in (
        (["env.name=python", "env.wall_sec=3"], "env.wall_sec: unknown field"),  # the environment's own Config
        (["env.name=calculator", "env.tool_parser=hremes"], "env.tool_parser: unknown tool-call parser 'hremes'"),
        (["reward.name=numeric", "reward.tolerence=0.1"], "reward.tolerence"),  # a reward's own options too
    ):
        run = tmp_path / "run"
        args = [x for s in typo for x in ("--set", s)]
        proc = oxrl("run", "--alg", "sgrpo", *args, "-o", str(run), env=fresh, timeout=120)  # minutes if late
        assert_user_error(proc, named)
        assert not run.exists() and not (tmp_path / "fresh-cache").exists()


def test_check_env_refuses_options_an_environment_does_not_take(tmp_path):
    from oxrl_core.config import RunConfig, check_env
    from oxrl_core.plugins import registry

    def check(env: dict) -> None:
        check_env(RunConfig.model_validate({"algorithm": "sgrpo", "env": env}), registry())

    check({"name": "calculator"})
    check({"name": "python", "wall_s": 3, "tool_parser": "mistral"})
    for env, message in (
        ({"name": "calculator", "levle": 1}, "env.levle: environment 'calculator' takes no options of its own"),
        ({"levle": 1}, "env.levle: environment options need an env.name"),
        ({"name": "python", "temp_dir": str(tmp_path / "nope")}, "env: environment 'python' could not start"),
        ({"name": "calculator", "tool_parser": f"{tmp_path}/p.py:P"}, "env.tool_parser: tool-call parser"),
    ):
        with pytest.raises(OxrlError, match=message.replace("(", r"\(")):
            check(env)
