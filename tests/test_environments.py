"""The Environment plugin kind: discovery, interface checks, config (env.*), the built-in calculator."""

from __future__ import annotations

import json

import pytest
from conftest import oxrl

from oxrl_core.data.task import CalculatorEnv, calculate, product_rows
from oxrl_core.errors import OxrlError, PluginError
from oxrl_core.interfaces import Environment, StrictModel, ToolEnvironment
from oxrl_core.plugins import Registration, check_contract, discover


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculate("47*38") == "1786"
    assert calculate(" (2+3)*-4 ") == "-20"
    assert calculate("7/2") == "3.5" and calculate("8/2") == "4"
    for hostile in ("__import__('os').system('true')", "2**999999", "a+1", "[1]*9", "open('x')", "1" * 201):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(hostile)
    env = CalculatorEnv()
    assert env.calc("2**999999").startswith("error:")  # the tool answers with an error, it never raises
    assert env.calc("1/0").startswith("error:")


def test_tools_come_from_the_public_typed_methods():
    assert CalculatorEnv.tool_names() == ["calc"]
    (schema,) = CalculatorEnv().tools()
    assert schema["function"]["name"] == "calc"
    assert schema["function"]["parameters"]["properties"]["expr"]["type"] == "string"
    assert "arithmetic" in schema["function"]["description"]


def test_the_interface_declares_what_the_loop_sets_and_reads():
    """``tool_parser`` and ``stats`` are members of the interface (the loop sets them before `reset` and reads
    ``stats`` after every call), with defaults on an instance built by hand; they are never tools."""
    from collections import Counter

    import oxrl_core
    from oxrl_core.tool_parsers import HermesParser, ToolCall

    hints = Environment.__annotations__
    assert {"tool_parser", "stats"} <= set(hints), hints
    assert oxrl_core.Environment is Environment and oxrl_core.ToolEnvironment is ToolEnvironment
    env = CalculatorEnv()
    assert env.tool_parser is None and env.stats == Counter() and env.stats is not CalculatorEnv().stats
    env.tool_parser = HermesParser()
    added, _, done = env.step(
        [{"role": "assistant", "content": HermesParser().format([ToolCall("calc", {"expr": "6*7"})])}]
    )
    assert added[0]["content"] == "42" and not done and env.stats == Counter(tool_calls=1)
    assert not {"tool_parser", "stats"} & set(CalculatorEnv.tool_names())


def test_products_rows_are_disjoint_and_their_transcripts_call_the_tool():
    train, held_out = product_rows("train"), product_rows("eval")
    assert len(held_out) == 100 and len(train) == 90 * 90 - 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    row = held_out[0]
    a, b = map(int, row["prompt"][len("What is ") : -1].split("*"))
    assert row["answer"] == str(a * b) and 10 <= a < 100 and 10 <= b < 100
    call = row["messages"][1]["tool_calls"][0]["function"]
    assert call == {"name": "calc", "arguments": {"expr": f"{a}*{b}"}}
    assert row["messages"][2] == {"role": "tool", "name": "calc", "content": row["answer"]}


def _reg(obj) -> Registration:
    return Registration("environment", "x", obj, plugin="x", package="pkg", version="1")


def test_the_interface_is_checked_when_a_run_loads_the_plugin():
    class NoStep(Environment):
        name = "nostep"

    class NoTools(ToolEnvironment):
        name = "notools"

    class BadTimeout(CalculatorEnv):
        timeout_s = 0

    class BadConfig(CalculatorEnv):
        Config = dict

    for cls, problem in (
        (NoStep, "does not define step()"),
        (NoTools, "without a tool"),
        (BadTimeout, "timeout_s = 0"),
        (BadConfig, "Config"),
        (int, "is not an oxrl_core.Environment subclass"),
    ):
        with pytest.raises(PluginError, match="environment 'x'") as err:
            check_contract("environment", cls, _reg(cls))
        assert problem in str(err.value)
    check_contract("environment", CalculatorEnv, _reg(CalculatorEnv))


class Options(Environment):
    name = "options"

    class Config(StrictModel):
        level: int = 1

    def step(self, messages):
        return [], 0.0, True


def test_env_options_are_validated_by_the_environments_config():
    registry = discover({"opts": type("M", (), {})})
    registry.prefer(Registration("environment", "options", Options, plugin="options", package="t", version=""))
    env = registry.build("environment", "options", {"level": 3}, field="env")
    assert env.config.level == 3
    with pytest.raises(OxrlError, match=r"env\.levle"):
        registry.build("environment", "options", {"levle": 3}, field="env")


def test_an_environment_needs_an_rl_algorithm_and_valid_env_keys(tmp_path):
    out = oxrl("run", "--alg", "sft", "--set", "env.name=oxrl_core.data.task:CalculatorEnv", "-o", str(tmp_path / "a"))
    assert out.returncode == 2 and "does not use rollouts" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "a").exists()
    out = oxrl("run", "--alg", "sgrpo", "--set", "env.name=nope", "-o", str(tmp_path / "c"))
    assert out.returncode == 2 and "environment 'nope'" in out.stderr and "Traceback" not in out.stderr
    out = oxrl("run", "--alg", "sgrpo", "--set", "env.max_turns=0", "-o", str(tmp_path / "d"))
    assert out.returncode == 2 and "env.max_turns" in out.stderr and "Traceback" not in out.stderr


def test_oxrl_plugins_lists_the_calculator_as_an_environment():
    out = oxrl("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    rows = rows["plugins"] if isinstance(rows, dict) else rows
    assert {"kind": "environment", "name": "calculator", "package": "oxrl"}.items() <= next(
        r for r in rows if r["name"] == "calculator"
    ).items()
