"""Multi-turn RL through the real CLI: the calculator demo, resume after SIGKILL, a failing environment.

The demo runs on the built-in model after its tool-use warm start (stored: `warm_starts.py`; in the
hermetic cache). The other runs use the built-in model's arithmetic warm start (it answers briefly and stops) with a scripted tool
parser (every episode has tool turns although that model never writes a real tool call), so they do not
need the tool-use warm start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl
from safetensors import safe_open

from oxrl_core.models.tiny import warm_start_dir

PRODUCTS = "{source: arith, task: products}"


def _ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    return out


@pytest.mark.slow
def test_calculator_demo_raises_held_out_accuracy_above_the_model_without_the_tool(tmp_path):
    """`oxrl run --alg sgrpo --set env.name=calculator`: reward and held-out accuracy rise, and the trained
    model with the tool is far above the same model answering without it. Ten steps (measured on 2 cores: held-out
    0.36 -> 0.82 with the tool, 0.00 without it; twenty steps reach 0.90)."""
    run_dir = tmp_path / "calc"
    _ok(
        oxrl("run", "--alg", "sgrpo", "--set", "env.name=calculator", "--set", "train.max_steps=10", "-o", str(run_dir))
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["eval_before"]["eval/accuracy"], summary["eval_after"]["eval/accuracy"]
    metrics = read_metrics(run_dir)
    first, last = metrics[:5], metrics[-5:]
    mean = lambda rows, k: sum(m[k] for m in rows) / len(rows)
    assert after > before, (before, after)
    assert mean(last, "reward/mean") > mean(first, "reward/mean")
    assert all(m["env/tool_calls"] > 0 and m["env/errors"] == 0 for m in metrics)
    assert all(m["rollout/logprob_diff"] < 1e-3 for m in metrics)  # as small as single-turn
    # the same final model, no tool: it cannot multiply two-digit numbers in its head
    out = _ok(oxrl("eval", "--model", str(run_dir / "final"), "--data", PRODUCTS, "--max-new-tokens", "80", "--json"))
    without = json.loads(out.stdout)["metrics"]["pass@1"]
    out = _ok(
        oxrl("eval", "--model", str(run_dir / "final"), "--data", PRODUCTS, "--env", "calculator",
             "--max-new-tokens", "80", "--max-turns", "3", "--json")
    )  # fmt: skip
    with_tool = json.loads(out.stdout)["metrics"]["pass@1"]
    assert with_tool == pytest.approx(after) and with_tool > without + 0.5, (with_tool, without)


#: a tool parser that reads every turn of the untrained test model as one `calc` call, so that every episode
#: has tool turns (the random model never writes a real tool call)
ALWAYS_CALLS = """
from oxrl_core.tool_parsers import ParsedTurn, ToolCall, ToolParser


class AlwaysCalls(ToolParser):
    name = "always_calls"

    def parse(self, text):
        if len(text) % 3 == 0:
            return ParsedTurn(text, [], [])  # a final answer, now and then
        return ParsedTurn("", [ToolCall("calc", {"expr": str(len(text)) + "*7"})], [])

    def format(self, calls):
        return ""
"""

#: a reward that does not ask the model to be right (the arithmetic warm start rarely is on products, and whether
#: one of 16 episodes is depends on the warm start): 1 for an episode that ends in a non-empty answer
ANSWERED = """
from oxrl_core import Reward


class Answered(Reward):
    name = "answered"

    def score(self, prompts, completions, examples):
        return [float(bool(c.strip())) for c in completions]
"""


def _multiturn_sets(tmp_path: Path, model: Path) -> list[str]:
    parser = tmp_path / "always_calls.py"
    parser.write_text(ALWAYS_CALLS)
    rows = write_jsonl(
        tmp_path / "q.jsonl",
        [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(2, 9)],
    )
    sets = {
        "model.name": model, "data.train": rows, "data.eval": rows, "env.name": "calculator",
        "env.tool_parser": f"{parser}:AlwaysCalls", "env.max_turns": 3, "env.max_tokens": 48,
        "train.batch_size": 4, "rollout.n": 4, "rollout.max_new_tokens": 8, "train.lr": 1e-3, "reward.name": "arith",
    }  # fmt: skip
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


@pytest.mark.slow
def test_resume_after_sigkill_in_multi_turn_training_equals_an_uninterrupted_run(tmp_path):
    sets = _multiturn_sets(tmp_path, warm_start_dir()) + ["--set", "train.max_steps=8", "--set", "train.save_every=2"]
    full = tmp_path / "full"
    _ok(oxrl("run", "--alg", "sgrpo", *sets, "-o", str(full)))
    assert all(m["env/tool_calls"] > 0 for m in read_metrics(full))
    killed = tmp_path / "killed"
    exe = Path(sys.executable).with_name("oxrl")
    proc = subprocess.Popen(
        [str(exe), "run", "--alg", "sgrpo", *sets, "-o", str(killed), "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "step-4").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _ok(oxrl("run", "--resume", "-o", str(killed)))
    a, b = read_metrics(full), read_metrics(killed)
    assert [m["step"] for m in b] == list(range(1, 9))
    for key in ("loss", "reward/mean", "env/turns", "env/episode_tokens"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], abs=1e-5), key


BROKEN_ENV = """
from oxrl_core.interfaces import Environment


class Broken(Environment):
    name = "broken"

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) == 2:
            raise RuntimeError("the simulator crashed")
        return [{"role": "user", "content": "go on"}], 0.0, False
"""


@pytest.mark.slow
def test_a_crashing_environment_is_counted_and_with_env_error_steps_0_never_stops_the_run(tmp_path):
    """With the stop switched off (``env.error_steps=0``) a crashing environment is counted and its first
    failure logged once per step, and the run finishes. (With the defaults it stops:
    tests/test_hardening_envs.py.)"""
    env_file = tmp_path / "broken_env.py"
    env_file.write_text(BROKEN_ENV)
    sets = _multiturn_sets(tmp_path, warm_start_dir()) + [
        "--set",
        f"env.name={env_file}:Broken",
        "--set",
        "train.max_steps=2",
        "--set",
        "env.error_steps=0",
    ]
    run_dir = tmp_path / "broken"
    out = _ok(oxrl("run", "--alg", "sgrpo", *sets, "-o", str(run_dir)))
    metrics = read_metrics(run_dir)
    assert all(m["env/errors"] > 0 for m in metrics) and (run_dir / "final").is_dir()
    crash = "step() raised RuntimeError: the simulator crashed (broken_env.py:"
    assert all(crash in m["env/first_error"] and m["env/error_share"] > 0 for m in metrics)
    lines = [line for line in out.stderr.splitlines() if line.startswith("step ") and crash in line]
    assert len(lines) == 2, out.stderr  # one line per step


@pytest.mark.slow
def test_multi_turn_training_with_lora_trains_the_adapter_and_saves_a_loadable_model(tmp_path):
    run_dir = tmp_path / "lora"
    # seed 1: the stored tool-use warm start gets 2 and then 1 of its 32 episodes right (a gradient at each step)
    sets = ["--set", "env.name=calculator", "--set", "lora.enabled=true", "--set", "train.max_steps=2"]
    sets += ["--set", "train.seed=1"]
    _ok(oxrl("run", "--alg", "sgrpo", *sets, "--set", "train.batch_size=4", "-o", str(run_dir)))
    metrics = read_metrics(run_dir)
    assert all(m["env/tool_calls"] > 0.5 and m["rollout/logprob_diff"] < 1e-4 for m in metrics)
    assert any(m["grad_norm"] > 0 for m in metrics)
    with safe_open(run_dir / "final" / "adapter" / "adapter_model.safetensors", "pt") as adapter:
        trained = [adapter.get_tensor(k).abs().sum().item() for k in adapter.keys() if "lora_B" in k]
    assert trained and all(b > 0 for b in trained)  # PEFT starts every B at zero: each one was trained
    out = _ok(
        oxrl("eval", "--model", str(run_dir / "final"), "--data", PRODUCTS, "--env", "calculator",
             "--max-new-tokens", "80", "--max-turns", "3", "--limit", "8", "--json")
    )  # fmt: skip
    assert json.loads(out.stdout)["metrics"]["env/tool_calls"] > 0.5  # the merged final/ still calls the tool


@pytest.mark.slow
@pytest.mark.parametrize("alg", ["cispo", "ppo", "rlhf", "rft", "online_dpo", "reinforce_pp"])
def test_every_rollout_algorithm_trains_on_multi_turn_episodes(tmp_path, alg):
    """Besides SGRPO (above): each algorithm that uses rollouts takes ``env.name``; on its step it gets a gradient
    from episodes with tool turns, and its logprobs match the backend's over the model's tokens. REINFORCE++ stands
    for the new estimators: its returns-to-go run over the model's tokens only (the environment's carry no
    reward). (RLAIF is RLHF's loop with a judge as the reward: with ``reward.name`` set the two runs are the same,
    so RLAIF is not run again.) The reward is scripted (`ANSWERED`): some episodes end in an answer and some do
    not, whatever the warm start knows."""
    (tmp_path / "answered.py").write_text(ANSWERED)
    sets = _multiturn_sets(tmp_path, warm_start_dir()) + ["--set", "train.max_steps=1", "--set", "train.eval_every=0"]
    sets += ["--set", f"reward.name={tmp_path / 'answered.py'}:Answered"]
    run_dir = tmp_path / alg
    _ok(oxrl("run", "--alg", alg, *sets, "-o", str(run_dir), "-q"))
    (first,) = read_metrics(run_dir)
    assert first["env/tool_calls"] > 1 and first["env/turns"] > 2 and 0 < first["reward/mean"] < 1
    assert first["grad_norm"] > 0 and first["rollout/logprob_diff"] < 1e-4
    assert (run_dir / "final" / "config.json").is_file()
