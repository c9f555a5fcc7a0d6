"""`oxrl new-plugin NAME [--kind algorithm|environment]`: a third-party plugin package that installs and runs
as it is: an algorithm (the default), or a tools-style environment for multi-turn RL (``env.name``)."""

from __future__ import annotations

import keyword
import re
from pathlib import Path

from oxrl_core.errors import OxrlError
from oxrl_core.plugins import discover

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "oxrl-{name}"
version = "0.1.0"
description = "{description}"
requires-python = ">=3.10"
dependencies = ["oxrl"]

[project.entry-points.oxrl]
{name} = "oxrl_{name}"

[tool.setuptools]
packages = ["oxrl_{name}"]
"""

INIT = '''"""oxRL plugin: registers the `{name}` {kind} (imported lazily, so `oxrl plugins` stays fast)."""

from oxrl_core import hookimpl


@hookimpl
def register_{kind}s(register):
    register("{name}", "oxrl_{name}.{kind}:{cls}")
'''

ALGORITHM = '''"""{cls}: supervised fine-tuning with label smoothing (a starting point; edit the maths).

    L = -(1/N) Σ_t m_t [ (1-ε) log π(y_t | y_<t) + (ε/V) Σ_v log π(v | y_<t) ]

with m_t = 1 on completion tokens, N = Σ_t m_t, ε = `label_smoothing`, V the vocabulary size.
The loop hands over per-token tensors (never logits): ``logp`` (B, T-1), log π of each label
token, ``mask`` (B, T-1), and ``logp_mean`` (B, T-1) = (1/V) Σ_v log π(v) because
`uses_logp_mean` asks for it.
"""

from pydantic import Field

from oxrl_core import Algorithm, StrictModel


class {cls}(Algorithm):
    name = "{name}"
    loop = "supervised"
    data_format = "prompt_response"

    class Config(StrictModel):
        label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="ε: mass spread uniformly over the vocabulary")

    def uses_logp_mean(self) -> bool:
        return self.config.label_smoothing > 0

    def loss(self, batch):
        logp_target, mask = batch["logp"], batch["mask"]  # (B, T-1): position t predicts token t+1
        eps = self.config.label_smoothing
        per_token = -(1 - eps) * logp_target  # (B, T-1)
        if eps > 0:
            per_token = per_token - eps * batch["logp_mean"]
        n_tokens = mask.sum().clamp(min=1)
        loss = (per_token * mask).sum() / n_tokens
        return loss, {{"loss/nll": ((-logp_target * mask).sum() / n_tokens).detach()}}
'''

TEST = """import math

import torch

from oxrl_{name}.algorithm import {cls}


def test_loss_is_nll_without_smoothing():
    # one labelled token with probability 1/4: -log(1/4) = log 4
    batch = {{"logp": torch.tensor([[0.0, math.log(0.25)]]), "mask": torch.tensor([[False, True]])}}
    loss, metrics = {cls}().loss(batch)
    assert torch.isclose(loss, torch.log(torch.tensor(4.0)))
"""

README = """# oxrl-{name}

An oxRL algorithm plugin. Install it next to oxRL and run it:

```bash
pip install -e .
oxrl plugins          # lists `{name}` (package oxrl-{name})
oxrl run --alg {name} --set train.max_steps=20
```

The algorithm lives in `oxrl_{name}/algorithm.py`; its registration in `oxrl_{name}/__init__.py`;
the entry point in `pyproject.toml` under `[project.entry-points.oxrl]`.
"""


ENVIRONMENT = '''"""{cls}: a tools-style environment for multi-turn RL (a starting point; edit the tools).

Every public method with typed arguments and a Google-style docstring (an ``Args:`` section) is a tool
the model may call: the chat template shows it the JSON schema made from the signature and docstring.
A model turn with tool calls gets one ``tool`` message per call, the method's return value; a turn
without a call is the final answer and ends the episode, scored by ``reward.name`` (or the dataset's
own check). A malformed call is answered with an error message; a tool that raises ends the episode
with reward 0. The loop builds one instance per episode, so an instance may keep the episode's state.
For an episode-level reward, define ``reward(self, row, messages) -> float``.
"""

from pydantic import Field

from oxrl_core import StrictModel, ToolEnvironment


class {cls}(ToolEnvironment):
    name = "{name}"
    #: seconds allowed for one call of reset / step / reward (a step runs every tool call of a turn)
    timeout_s = 10.0

    class Config(StrictModel):
        """The ``env:`` options beyond name, max_turns, max_tokens and tool_parser."""

        max_chars: int = Field(10_000, ge=1, description="longest text word_count reads")

    def word_count(self, text: str) -> str:
        """Count the words of a text.

        Args:
            text: the text whose words (separated by whitespace) are counted
        """
        if not isinstance(text, str):
            return f"error: text must be a string, got {{type(text).__name__}}"
        if len(text) > self.config.max_chars:
            return f"error: the text is longer than {{self.config.max_chars}} characters"
        return str(len(text.split()))
'''

ENV_TEST = """from collections import Counter

from oxrl_core import HermesParser, ToolCall
from oxrl_{name}.environment import {cls}


def test_word_count():
    assert {cls}().word_count("one two  three") == "3"


def test_a_tool_call_is_answered_and_a_final_answer_ends_the_episode():
    env = {cls}()
    env.tool_parser, env.stats = HermesParser(), Counter()
    call = HermesParser().format([ToolCall("word_count", {{"text": "a b"}})])
    added, reward, done = env.step([{{"role": "assistant", "content": call}}])
    assert added == [{{"role": "tool", "name": "word_count", "content": "2"}}] and not done
    assert env.step([{{"role": "assistant", "content": "2"}}]) == ([], 0.0, True)


def test_the_tool_has_a_schema():
    (schema,) = {cls}().tools()
    assert schema["function"]["name"] == "word_count"
    assert schema["function"]["parameters"]["properties"]["text"]["type"] == "string"
"""

ENV_README = """# oxrl-{name}

An oxRL environment plugin (multi-turn RL with tools). Install it next to oxRL and train with it:

```bash
pip install -e .
oxrl plugins          # lists `{name}` (environment, package oxrl-{name})
oxrl run --alg sgrpo --set env.name={name} --set train.max_steps=20
```

The environment lives in `oxrl_{name}/environment.py` (its public methods are the model's tools);
its registration in `oxrl_{name}/__init__.py`; the entry point in `pyproject.toml` under
`[project.entry-points.oxrl]`.
"""

#: what each kind writes: (relative path -> template), the class name's suffix, the package description
KINDS = {
    "algorithm": (
        {
            "pyproject.toml": PYPROJECT,
            "README.md": README,
            "oxrl_{name}/__init__.py": INIT,
            "oxrl_{name}/algorithm.py": ALGORITHM,
            "tests/test_{name}.py": TEST,
        },
        "",
        "The {name} algorithm for oxRL",
    ),
    "environment": (
        {
            "pyproject.toml": PYPROJECT,
            "README.md": ENV_README,
            "oxrl_{name}/__init__.py": INIT,
            "oxrl_{name}/environment.py": ENVIRONMENT,
            "tests/test_{name}.py": ENV_TEST,
        },
        "Env",
        "The {name} environment for oxRL (multi-turn RL with tools)",
    ),
}


def create(name: str, parent: Path, kind: str = "algorithm") -> Path:
    """Write the package ``oxrl-NAME/`` of a plugin of ``kind`` under ``parent``; nothing when an input is bad."""
    if kind not in KINDS:
        raise OxrlError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise OxrlError(f"plugin name {name!r}: use lower-case letters, digits and '_', starting with a letter")
    root = parent / f"oxrl-{name}"
    if root.exists():
        raise OxrlError(f"{root} already exists; choose another name or directory")
    templates, suffix, description = KINDS[kind]
    fields = {"name": name, "kind": kind, "cls": "".join(part.capitalize() for part in name.split("_")) + suffix}
    fields["description"] = description.format(**fields)
    for rel, template in templates.items():
        path = root / rel.format(**fields)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**fields))
    return root


def next_steps(root: Path, name: str, kind: str, ambiguous: bool) -> str:
    """What to run after scaffolding: install, then train with the new plugin."""
    chosen = f"oxrl-{name}:{name}" if ambiguous else name
    command = f"--alg {chosen}" if kind == "algorithm" else f"--alg sgrpo --set env.name={chosen}"
    return f"created {root}\n  pip install -e {root}\n  oxrl run {command} --set train.max_steps=20"


def name_taken(name: str, kind: str = "algorithm") -> str:
    """A warning when an installed package already registers ``name`` as a ``kind`` (empty when it is free).

    Not a refusal: the scaffold is a starting point and may be renamed. But installed as it is, the name
    becomes ambiguous — every run would have to choose with ``oxrl-NAME:NAME`` — so the warning says who
    has it and suggests a free name.
    """
    registry = discover()
    taken = [r for r in registry.rows() if r["kind"] == kind and r["name"] == name]
    if not taken:
        return ""
    owners = " and ".join(f"{r['package']} {r['version']}" for r in taken)
    free = next(c for c in (f"my_{name}", *(f"{name}{i}" for i in range(2, 1000))) if c not in registry.entries[kind])
    field, option = ("--alg ", "") if kind == "algorithm" else ("--set env.name=", f" --kind {kind}")
    return (
        f"{kind} '{name}' is already registered by {owners}: installed as it is, `{field}{name}` becomes ambiguous "
        f"and runs must choose with `{field}oxrl-{name}:{name}`. Consider a free name, e.g. "
        f"`oxrl new-plugin {free}{option}`"
    )
