"""`python`: a tools-style environment whose one tool, ``run_python``, runs the model's code in the sandbox
of the ``code`` reward and answers with what the code printed.

The sandbox is `oxrl_rewards.sandbox` itself (imported, not copied): a separate process per program with
wall-clock, CPU, memory, output-size, open-file and process limits, namespaces where the machine allows
them (no network, its own root and pid space) and the Python guard (no process creation, no sockets, no
files outside its directory, no reading the trainer's files or environment); that module lists the
layers and their honest limits. ``env.wall_s``, ``env.cpu_s`` and ``env.memory_mb`` are its limits, with
its defaults; ``env.namespaces`` and ``env.temp_dir`` are the ``code`` reward's options of the same name.

Each call is a fresh program with the standard library only, in a temporary directory removed afterwards:
nothing carries over from one call to the next. The answer is stdout, then stderr (a traceback, without
the sandbox runner's own frames), then one line saying why the program was stopped (time, memory, output
limit) or its exit status when it failed silently; cut to ``max_output_chars`` (its start and its end
kept). Bad code — a syntax error, an exception, an infinite loop, a memory or fork bomb, writing outside
its directory, reading secrets, opening a socket — is an answer for the model, never an exception. Only a
failure of the sandbox itself (its setup) raises, which ends the episode with reward 0 (``env/errors``).

The final answer (a turn without a tool call) is scored by ``reward.name`` (or the algorithm's /
dataset's default), as every `ToolEnvironment`'s.

Time: a turn runs at most ``max_calls_per_turn`` programs, one after the other, each stopped at
``wall_s``; further calls of that turn are answered "not run". The environment's ``timeout_s`` covers
all of them plus their start-up, so it always exceeds the sandbox's own limit: a program that hangs is
the model's answer ("timed out"), never a timed-out environment.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from oxrl_core import StrictModel, ToolEnvironment
from oxrl_rewards import sandbox as _sandbox
from oxrl_rewards.sandbox import RUNNER, Limits, RunResult, Sandbox

#: seconds allowed on top of ``wall_s`` for each program's start-up and clean-up, and once per turn
START_UP_S = 5.0


def _own_uids() -> None:
    """In a forked process: a block of sandbox uids of its own. Each episode's environment runs in a worker
    forked from one host process (`oxrl_core.rollout.env_worker`); without this every worker would hand its programs the
    uids the host's pool would have, and programs of two episodes could share a uid (and its process limit)."""
    _sandbox._UIDS = _sandbox._UidPool()


os.register_at_fork(after_in_child=_own_uids)


def turn_time_limit(config: PythonEnv.Config) -> float:
    """Seconds one `step` may take: every program of the turn at its wall-clock limit, plus start-up."""
    return config.max_calls_per_turn * (config.wall_s + START_UP_S) + START_UP_S


class PythonEnv(ToolEnvironment):
    """`python`: one tool, ``run_python(code)``, run in the ``code`` reward's sandbox (module docstring)."""

    name = "python"

    class Config(StrictModel):
        """The ``env:`` options (beyond name, max_turns, max_tokens, tool_parser)."""

        wall_s: float = Field(Limits.wall_s, gt=0, le=600, description="wall-clock seconds per program")
        cpu_s: int = Field(Limits.cpu_s, ge=1, le=600, description="CPU seconds per program (RLIMIT_CPU)")
        memory_mb: int = Field(
            Limits.memory_mb, ge=64, description="address space per process, MiB (RLIMIT_AS): more is a MemoryError"
        )
        max_output_chars: int = Field(2000, ge=100, description="what the model sees of one program's output, at most")
        max_calls_per_turn: int = Field(4, ge=1, le=64, description="programs one model turn may run")
        namespaces: Literal["auto", "on", "off"] = Field(
            "auto",
            description="namespace isolation: `auto` where this machine allows it, `on` requires it, `off` never",
        )
        temp_dir: str = Field("", description="where each program's temporary directory is made; empty = the system's")

        @field_validator("namespaces", mode="before")
        @classmethod
        def _yaml_booleans(cls, value: Any) -> Any:
            """``--set env.namespaces=on`` arrives as True (YAML 1.1 reads on/off as booleans)."""
            return {True: "on", False: "off"}[value] if isinstance(value, bool) else value

    #: with the default options; an instance sets its own from its config (`turn_time_limit`)
    timeout_s: ClassVar[float] = turn_time_limit(Config())
    #: on the built-in tiny model: two-digit products, which one program can compute
    tiny_defaults: ClassVar[dict] = {
        "data": {"train": [{"source": "arith", "task": "products"}]},  # a list: replaced, never merged
        "rollout": {"max_new_tokens": 64},
        "env": {"max_turns": 3, "max_tokens": 192},
    }

    def __init__(self, config: PythonEnv.Config | None = None):
        super().__init__(config)
        c = self.config
        self.timeout_s = turn_time_limit(c)
        limits = replace(Limits(), wall_s=c.wall_s, cpu_s=c.cpu_s, memory_mb=c.memory_mb)
        self.sandbox = Sandbox(limits, namespaces=c.namespaces, temp_dir=c.temp_dir or None)
        self._calls = 0  # programs run in this turn

    def step(self, messages: list[dict]) -> tuple[list[dict], float, bool]:
        self._calls = 0
        return super().step(messages)

    def call_tool(self, name: str, arguments: dict) -> str:
        if name == "run_python":
            self._calls += 1
            if self._calls > self.config.max_calls_per_turn:
                return f"error: not run: at most {self.config.max_calls_per_turn} run_python calls per turn"
        return super().call_tool(name, arguments)

    def run_python(self, code: str) -> str:
        """Run a Python program and return what it prints (stdout, then any error).

        Each call is a new program with the standard library only: nothing is kept from earlier calls.
        It has a few seconds and a limited amount of memory, no network, and no files outside its own
        working directory.

        Args:
            code: the whole program, e.g. "print(sum(range(10)))"; print() what you want to see
        """
        if not isinstance(code, str):
            return f"error: run_python(): code must be a string, got {type(code).__name__}"
        return describe(self.sandbox.run(code), self.config)


def describe(result: RunResult, config: PythonEnv.Config) -> str:
    """What the model sees of one run: output, traceback, why it stopped; cut to ``max_output_chars``."""
    runner_frame = f'  File "{RUNNER}"'
    stderr = "".join(line for line in result.stderr.splitlines(True) if not line.startswith(runner_frame))
    text = result.stdout
    if stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + stderr
    text = cut(text.rstrip(), config.max_output_chars)
    if result.status == "timeout":
        why = f"error: timed out: the program was stopped at its time limit ({config.wall_s:g} s)"
    elif result.status == "memory":
        why = f"error: out of memory: the program was stopped at its memory limit ({config.memory_mb} MB)"
    elif result.status == "output_limit":
        why = "error: output limit reached: the program was stopped"
    elif result.status != "ok" and not stderr:
        why = f"error: exit status {result.exit_code}"
    else:
        why = ""
    if why:
        return f"{text}\n{why}" if text else why
    return text or "(no output)"


def cut(text: str, limit: int) -> str:
    """``text`` of at most ``limit`` characters, else its start and end with a note of what was cut."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[len(text) - (limit - head) :]}"
