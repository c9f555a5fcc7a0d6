"""The `python` environment of `oxrl-envs` (multi-turn RL with tools; `oxrl_core.interfaces.ToolEnvironment`).

- discovery (`oxrl-envs`, entry point ``python``), its one tool ``run_python`` and the tool's JSON schema;
- the tool runs code in the ``code`` reward's sandbox and answers with its output (``print(2+3)`` -> ``5``),
  tracebacks without the sandbox runner's frames, exit statuses, long output cut at both ends;
- bad code is an answer, never an exception: syntax errors, NUL bytes, lone surrogates, a non-string argument;
- what the sandbox claims to prevent, attempted through the tool: an infinite loop (a timeout message within
  the limit), memory bombs, a fork bomb and a detached ``setsid`` child (nothing survives), subprocesses,
  writing or deleting outside its directory, reading a trainer file or the trainer's environment secrets,
  connecting to a loopback listener, printing 100 MB; no sandbox directory is left behind;
- the loop's path: `step` in the episode's worker process under the environment's own ``timeout_s``
  (`oxrl_core.rollout.env_worker`) answers every call, runs at most ``max_calls_per_turn`` programs, a final answer
  ends it;
- its options (``env.*``) default to the sandbox's limits and are validated;
- `oxrl run --alg sgrpo --set env.name=python`: two steps whose turns call the tool (slow).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl

from oxrl_core.errors import OxrlError
from oxrl_core.plugins import discover
from oxrl_core.rollout.env_worker import call_all, spawn
from oxrl_core.tool_parsers import HermesParser, ToolCall
from oxrl_envs.python import START_UP_S, PythonEnv
from oxrl_rewards.sandbox import Limits

#: short limits so the file stays fast
LIMITS = {"wall_s": 2.0, "cpu_s": 2, "memory_mb": 256}
#: a string in this file that no program can print unless it reads the file
NEVER_PRINTED = "oxrl-python-env-file-marker"


def build(**options) -> PythonEnv:
    """The environment as a run builds it: by name, through the plugin registry, options as ``env.*``."""
    return discover().build("environment", "python", {**LIMITS, **options}, field="env")


@pytest.fixture(scope="module")
def sandbox_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sandboxes")
    yield root
    assert list(root.iterdir()) == [], "a sandbox directory was left behind"


@pytest.fixture(scope="module")
def env(sandbox_root) -> PythonEnv:
    return build(temp_dir=str(sandbox_root))


def processes_mentioning(needle: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle.encode() in text:
            found.append(f"{pid}: {text[:120]!r}")
    return found


# --------------------------------------------------------------------------------------------
# discovery and the tool
# --------------------------------------------------------------------------------------------


def test_python_is_an_environment_of_oxrl_envs():
    registry = discover()
    (row,) = [r for r in registry.rows() if r["kind"] == "environment" and r["name"] == "python"]
    assert (row["package"], row["plugin"]) == ("oxrl-envs", "python")
    assert registry.load("environment", "python") is PythonEnv
    assert PythonEnv.scores_final_answer is True  # the final answer is scored by reward.name


def test_the_one_tool_is_run_python_with_a_schema():
    assert PythonEnv.tool_names() == ["run_python"]
    (schema,) = PythonEnv().tools()
    function = schema["function"]
    assert function["name"] == "run_python"
    assert function["parameters"]["properties"]["code"]["type"] == "string"
    assert function["parameters"]["required"] == ["code"]
    assert "Python program" in function["description"]


def test_the_tool_answers_with_what_the_program_prints(env):
    assert env.run_python("print(2+3)") == "5"
    assert env.run_python("import math\nfor n in (3, 4):\n    print(math.factorial(n))") == "6\n24"
    assert env.run_python("x = 1") == "(no output)"
    # a fresh program per call: nothing carries over
    assert "NameError" in env.run_python("print(x)")


def test_errors_are_answers_for_the_model(env):
    out = env.run_python("print('before')\n1/0")
    assert out.startswith("before\nTraceback") and out.endswith("ZeroDivisionError: division by zero"), out
    assert "SyntaxError" in env.run_python("def f(:\n    pass")
    assert env.run_python("import sys\nsys.exit(3)") == "error: exit status 3"
    assert "bye" in env.run_python("raise SystemExit('bye')")
    out = env.run_python("open('/etc/oxrl-test', 'w')")
    assert "not allowed" in out and "sandbox_runner" not in out, out  # the runner's frames are not shown
    for hostile in ("", "\x00", "print('\ud800')", "x = 1\n" * 50_000, "import os\nos._exit(0)", "lambda: (yield)"):
        assert isinstance(env.run_python(hostile), str)
    assert env.run_python(5) == "error: run_python(): code must be a string, got int"
    assert env.run_python(None).startswith("error:")


def test_long_output_is_cut_keeping_both_ends(env):
    out = env.run_python("print('START' + 'x' * 10_000 + 'END')")
    assert out.startswith("START") and out.endswith("END")
    assert "characters cut" in out and len(out) < 2100


# --------------------------------------------------------------------------------------------
# what the sandbox prevents, through the tool
# --------------------------------------------------------------------------------------------


def test_an_infinite_loop_is_stopped_at_the_limit(env):
    started = time.monotonic()
    out = env.run_python("while True:\n    pass")
    elapsed = time.monotonic() - started
    assert "timed out" in out and "2 s" in out, out
    assert elapsed < LIMITS["wall_s"] + START_UP_S, elapsed
    out = env.run_python("import time\nprint('slow', flush=True)\ntime.sleep(60)")  # wall clock, not CPU
    assert out.startswith("slow") and "timed out" in out, out


@pytest.mark.parametrize(
    "bomb",
    ["x = bytearray(10 * 2**30)", "x = []\nwhile True:\n    x.append(' ' * 10**7)", "x = ' ' * 2**40"],
    ids=["10GB", "growing", "string"],
)
def test_a_memory_bomb_is_stopped(env, bomb):
    out = env.run_python(bomb)
    assert "MemoryError" in out and "out of memory" in out and "256 MB" in out, out


def test_printing_100MB_is_cut_at_the_output_limit(env):
    started = time.monotonic()
    out = env.run_python("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)")
    assert time.monotonic() - started < LIMITS["wall_s"] + START_UP_S
    assert out.endswith("error: output limit reached: the program was stopped") and len(out) < 2200


def test_a_fork_bomb_and_a_detached_child_do_not_survive(env):
    marker = f"oxrl-marker-{secrets.token_hex(6)}"
    out = env.run_python(
        "import os, time\nforked = 0\nfor _ in range(2000):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
        "    forked += 1\nprint('forked', forked)"
    )
    assert "forked 2000" not in out, out
    out = env.run_python(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv('/bin/sh', ['sh', '-c', 'sleep 30; : {marker}'])\ntime.sleep(0.5)"
    )
    assert isinstance(out, str)
    out = env.run_python(f"import subprocess\nprint(subprocess.run(['echo', '{marker}'], capture_output=True))")
    assert "not allowed" in out and "returncode" not in out, out
    deadline = time.monotonic() + 3
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(marker) == []


def test_files_outside_its_directory_are_out_of_reach(env, tmp_path):
    outside, sentinel = tmp_path / "outside.txt", tmp_path / "tree" / "sentinel.txt"
    sentinel.parent.mkdir()
    sentinel.write_text("keep me")
    out = env.run_python(f"open({str(outside)!r}, 'w').write('pwned')")
    assert "Error" in out and not outside.exists(), out
    out = env.run_python(f"import os, shutil\nos.remove({str(sentinel)!r})\nshutil.rmtree({str(sentinel.parent)!r})")
    assert "Error" in out and sentinel.read_text() == "keep me", out
    out = env.run_python(f"print(open({__file__!r}).read())")
    assert NEVER_PRINTED not in out and "Error" in out, out
    # its own directory is its to use
    assert env.run_python("open('notes.txt', 'w').write('hi')\nprint(open('notes.txt').read())") == "hi"


def test_the_trainers_environment_secrets_are_out_of_reach(env, monkeypatch):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("OXRL_TEST_SECRET", secret)
    out = env.run_python(
        "import os\nprint(dict(os.environ))\n"
        "paths = ['/proc/%d/environ' % os.getppid(), '/proc/1/environ', '/proc/self/environ']\n"
        "try:\n    paths += ['/proc/%s/environ' % p for p in os.listdir('/proc') if p.isdigit()]\n"
        "except OSError as e:\n    print(e)\n"
        "for path in paths:\n    try:\n        print(open(path, 'rb').read())\n"
        "    except OSError as e:\n        print(e)"
    )
    assert secret not in out and "OXRL_TEST_SECRET" not in out, out
    assert "PATH" in out  # it did print its own (clean) environment


def test_no_network(env):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    try:
        port = listener.getsockname()[1]
        out = env.run_python(
            f"import socket\nwith socket.create_connection(('127.0.0.1', {port}), timeout=1):\n    print('connected')"
        )
        assert "connected" not in out and "Error" in out, out
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


# --------------------------------------------------------------------------------------------
# the loop's path: step under the environment's time limit
# --------------------------------------------------------------------------------------------


def turn(*codes: str) -> list[dict]:
    text = HermesParser().format([ToolCall("run_python", {"code": c}) for c in codes])
    return [{"role": "user", "content": "go"}, {"role": "assistant", "content": text}]


def test_step_answers_every_call_within_the_environments_time_limit(sandbox_root):
    env = build(temp_dir=str(sandbox_root), max_calls_per_turn=2)
    env.tool_parser, env.stats = HermesParser(), Counter()
    # the environment's limit covers every program of a turn at the sandbox's own limit
    assert env.timeout_s > 2 * LIMITS["wall_s"] and PythonEnv.timeout_s > Limits().wall_s
    hang = "while True:\n    pass"
    (worker,) = spawn(PythonEnv, env.config, HermesParser(), 1)  # as the loop runs an episode's environment
    assert worker.timeout_s == env.timeout_s  # the instance's own limit
    ((kind, result),) = call_all([(worker, "step", (turn(hang, hang, "print(1)"),))])
    worker.close()
    assert kind == "ok", result  # never a timeout
    assert worker.stats["tool_calls"] == 2  # counted in the worker, reported with its answer
    added, reward, done = result
    assert (reward, done) == (0.0, False)
    assert [m["role"] for m in added] == ["tool"] * 3 and {m["name"] for m in added} == {"run_python"}
    assert "timed out" in added[0]["content"] and "timed out" in added[1]["content"]
    assert added[2]["content"] == "error: not run: at most 2 run_python calls per turn"
    added, _, _ = env.step(turn("print(2+3)"))  # the count is per turn
    assert added[0]["content"] == "5"
    unknown = '<tool_call>{"name": "run_shell", "arguments": {"cmd": "ls"}}</tool_call>'
    added, _, done = env.step([{"role": "assistant", "content": unknown}])
    assert added[0]["content"].startswith("error: unknown tool 'run_shell'") and not done
    assert env.stats["bad_tool_calls"] == 1 and env.stats["tool_calls"] == 1
    assert env.step([{"role": "assistant", "content": "The answer is 5."}]) == ([], 0.0, True)


# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------


def test_options_default_to_the_sandboxs_limits_and_are_validated(sandbox_root):
    config, limits = PythonEnv.Config(), Limits()
    assert (config.wall_s, config.cpu_s, config.memory_mb) == (limits.wall_s, limits.cpu_s, limits.memory_mb)
    env = build(temp_dir=str(sandbox_root), wall_s=1.5, memory_mb=128, namespaces=True)  # YAML `on` is True
    assert (env.sandbox.limits.wall_s, env.sandbox.limits.memory_mb) == (1.5, 128)
    assert env.config.namespaces == "on"
    with pytest.raises(OxrlError, match=r"env\.wal_s"):
        build(wal_s=1)
    with pytest.raises(OxrlError, match=r"env\.memory_mb"):
        build(memory_mb=1)


# --------------------------------------------------------------------------------------------
# a run
# --------------------------------------------------------------------------------------------


EVERY_TURN_RUNS_PYTHON = """
from oxrl_core.tool_parsers import ParsedTurn, ToolCall, ToolParser


class EveryTurnRunsPython(ToolParser):
    name = "every_turn"

    def parse(self, text):
        return ParsedTurn("", [ToolCall("run_python", {"code": "print(6 * 7)"})])

    def format(self, calls):
        return ""
"""


@pytest.mark.slow
def test_sgrpo_runs_with_the_python_environment(tmp_path, tiny_model_dir):
    """Two SGRPO steps with ``env.name=python``. The untrained model never writes a tool call, so a parser
    (``env.tool_parser``, a file) reads each of its turns as one: the sandbox runs inside a real run."""
    parser = tmp_path / "every_turn.py"
    parser.write_text(EVERY_TURN_RUNS_PYTHON)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "What is 2+3?", "answer": "5"}])
    run_dir = tmp_path / "run"
    proc = oxrl(
        "run", "--alg", "sgrpo", "--set", f"model.name={tiny_model_dir}", "--set", "data.train=arith",
        "--set", f"data.eval={held_out}", "--set", "env.name=python",
        "--set", f"env.tool_parser={parser}:EveryTurnRunsPython", "--set", "env.wall_s=2",
        "--set", "env.max_turns=2", "--set", "env.max_tokens=96", "--set", "rollout.max_new_tokens=16",
        "--set", "rollout.n=2", "--set", "train.batch_size=4", "--set", "train.max_steps=2", "-o", str(run_dir),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["env/errors"] == 0 and m["env/timeouts"] == 0 for m in metrics), metrics
    assert sum(m["env/tool_calls"] for m in metrics) > 0, metrics
    assert (run_dir / "final" / "config.json").is_file()
