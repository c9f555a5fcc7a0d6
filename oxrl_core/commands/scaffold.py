"""`oxrl new-plugin NAME [--kind algorithm|environment] [--loop supervised|preference|rl]`: a third-party plugin
package that installs and runs as it is: an algorithm (the default) for one of the three loops (supervised by
default), or a tools-style environment for multi-turn RL (``env.name``).

Every template imports only the public API (``from oxrl_core import ...``), as a plugin should: what it shows is
what a plugin author copies."""

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

SUPERVISED_ALGORITHM = '''"""{cls}: supervised fine-tuning with label smoothing (a starting point; edit the maths).

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

SUPERVISED_TEST = """import math

import torch

from oxrl_{name}.algorithm import {cls}


def test_loss_is_nll_without_smoothing():
    # one labelled token with probability 1/4: -log(1/4) = log 4
    batch = {{"logp": torch.tensor([[0.0, math.log(0.25)]]), "mask": torch.tensor([[False, True]])}}
    loss, metrics = {cls}().loss(batch)
    assert torch.isclose(loss, torch.log(torch.tensor(4.0)))
"""

README = """# oxrl-{name}

An oxRL algorithm plugin for the `{loop}` loop: {about}.
Install it next to oxRL and run it:

```bash
pip install -e .
oxrl plugins          # lists `{name}` (package oxrl-{name})
oxrl run --alg {name} --set train.max_steps=20
```

The algorithm lives in `oxrl_{name}/algorithm.py`; its registration in `oxrl_{name}/__init__.py`;
the entry point in `pyproject.toml` under `[project.entry-points.oxrl]`.
"""


PREFERENCE_ALGORITHM = '''"""{cls}: a DPO-style preference loss (Rafailov et al. 2023; a starting point, edit the maths).

For a prompt x with a chosen response y_w and a rejected one y_l, the implicit reward of a response is
β·log(π_θ(y|x) / π_ref(y|x)), and the Bradley–Terry likelihood that y_w is preferred gives

    h = β·[(log π_θ(y_w|x) − log π_ref(y_w|x)) − (log π_θ(y_l|x) − log π_ref(y_l|x))]
    L = −(1/B) Σ_b log σ(h_b)

The loop hands over per-sequence sums over the completion tokens (never logits): ``logp_chosen``,
``logp_rejected`` (B,) with gradients, and ``ref_logp_chosen``, ``ref_logp_rejected`` (B,) of the frozen
reference policy, because ``needs_ref`` asks for them. At step 0 the policy is its reference: h = 0, L = log 2.
"""

import torch.nn.functional as F
from pydantic import Field

from oxrl_core import Algorithm, PairedPreferenceBatch, StrictModel


class {cls}(Algorithm):
    name = "{name}"
    loop = "preference"
    data_format = "preference"  # rows {{"prompt", "chosen", "rejected"}}
    needs_ref = True

    class Config(StrictModel):
        beta: float = Field(0.1, gt=0, description="β: strength of the pull towards the reference policy")

    def loss(self, batch: PairedPreferenceBatch):
        beta = self.config.beta
        # r(y) = β·(log π_θ(y|x) − log π_ref(y|x)), the implicit reward of each response
        reward_chosen = beta * (batch["logp_chosen"] - batch["ref_logp_chosen"])  # (B,)
        reward_rejected = beta * (batch["logp_rejected"] - batch["ref_logp_rejected"])  # (B,)
        # h = r(y_w) − r(y_l)
        h = reward_chosen - reward_rejected  # (B,)
        # L = −(1/B) Σ_b log σ(h_b)
        loss = -F.logsigmoid(h).mean()
        return loss, {{
            "rewards/margins": h.detach().mean(),
            # a pair counts as ranked right only when the chosen reward is strictly higher
            "rewards/accuracies": (h > 0).float().mean(),
        }}
'''

PREFERENCE_TEST = """import math

import torch

from oxrl_{name}.algorithm import {cls}


def _batch(chosen, rejected):
    # per-pair log-ratios log π_θ(y|x) − log π_ref(y|x): the reference at 0, the policy at the given values
    zeros = torch.zeros(len(chosen))
    return {{
        "logp_chosen": torch.tensor(chosen),
        "logp_rejected": torch.tensor(rejected),
        "ref_logp_chosen": zeros,
        "ref_logp_rejected": zeros,
    }}


def test_at_the_reference_the_loss_is_log_2():
    # h = 0: −log σ(0) = log 2, whatever β
    loss, metrics = {cls}().loss(_batch([-3.0, -1.0], [-3.0, -1.0]))
    assert torch.isclose(loss, torch.tensor(math.log(2.0)))
    assert metrics["rewards/accuracies"] == 0.0


def test_the_loss_of_two_pairs_by_hand():
    # β = 0.5; pair 1: h = 0.5·(2 − 0) = 1, pair 2: h = 0.5·(0 − 2) = −1
    # L = ½[−log σ(1) − log σ(−1)] = ½[log(1 + e^−1) + log(1 + e)]
    algorithm = {cls}({cls}.Config(beta=0.5))
    loss, metrics = algorithm.loss(_batch([2.0, 0.0], [0.0, 2.0]))
    expected = 0.5 * (math.log(1 + math.exp(-1)) + math.log(1 + math.e))
    assert torch.isclose(loss, torch.tensor(expected))
    assert metrics["rewards/margins"] == 0.0 and metrics["rewards/accuracies"] == 0.5
"""

RL_ALGORITHM = '''"""{cls}: a group-relative policy gradient (GRPO-style, Shao et al. 2024; a starting point, edit the maths).

For a prompt x the loop samples a group of n completions o_1..o_n and scores them, r_1..r_n:

    A_i     = (r_i − mean(r)) / (std(r) + eps)                            group z-score advantage
    ρ_{{i,t}} = π_θ(o_{{i,t}} | x, o_{{i,<t}}) / π_old(o_{{i,t}} | x, o_{{i,<t}})   importance ratio
    L       = −(1/Σ_i|o_i|) Σ_i Σ_t min(ρ_{{i,t}} A_i, clip(ρ_{{i,t}}, 1−ε, 1+ε) A_i)

A group whose rewards are all equal gets A = 0: it carries no signal, hence ``group_relative``. The options every
group-based algorithm shares (`PolicyGradient.Config`: ``kl_coeff``, ``kl_estimator``, ``kl_in_reward``,
``entropy_coeff``, ``loss_agg``, ``overlong_buffer``) act through ``ops.shaped_rewards`` (before the advantages)
and ``ops.policy_objective`` (around the policy term); their defaults give exactly L above.
"""

import torch
from pydantic import Field

from oxrl_core import PolicyGradient, RLAdvantagesBatch, RLLossBatch, ops


class {cls}(PolicyGradient):
    name = "{name}"
    loop = "rl"
    data_format = "prompt"  # the loop samples the completions; the reward scores them
    group_relative = True
    #: samples compared within a group (rollout.n must be at least this)
    min_group_size = 2

    class Config(PolicyGradient.Config):
        clip_eps: float = Field(0.2, gt=0, le=1, description="ε: the ratio is clipped to [1 − ε, 1 + ε]")
        eps: float = Field(1e-4, gt=0, description="added to the group std")

    def advantages(self, batch: RLAdvantagesBatch):
        rewards, metrics = ops.shaped_rewards(batch, self.config)  # (B,): the defaults leave the rewards as they are
        # A_i = (r_i − mean_g) / (std_g + eps), the same for every token of sample i
        adv_seq = ops.group_advantages(rewards, batch["group_size"], eps=self.config.eps)  # (B,)
        adv = adv_seq[:, None] * batch["mask"]  # (B, T)
        return {{"adv": adv}}, {{"adv/abs_mean": adv_seq.abs().mean(), **metrics}}

    def loss(self, batch: RLLossBatch):
        c = self.config
        # ρ = π_θ / π_old
        ratio = torch.exp(batch["logp"] - batch["logp_old"])  # (B, T)
        # min(ρ A, clip(ρ, 1−ε, 1+ε) A)
        surrogate, clipped = ops.clipped_surrogate(ratio, batch["adv"], c.clip_eps, c.clip_eps)  # (B, T)
        # w = min(π_old / π_rollout, C) corrects for the rollout engine's sampling (rollout.tis_cap; 1 when off)
        policy_term = -surrogate * batch.get("tis_weight", 1.0)  # (B, T)
        # aggregated by loss_agg (token-mean: (1/Σ|o_i|) Σ_i Σ_t), + β·KL and − c_H·H when those are on
        loss, metrics = ops.policy_objective(policy_term, batch, c)
        return loss, {{**metrics, **ops.policy_metrics(policy_term, ratio, clipped, batch, c)}}
'''

RL_TEST = """import math

import torch

from oxrl_{name}.algorithm import {cls}


def test_group_advantages_by_hand():
    # one group of two, rewards 1 and 0: mean 0.5, sample std √(2·0.5² / 1) = √0.5, A = ±0.5 / (√0.5 + eps)
    algorithm = {cls}()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    batch = {{"rewards": torch.tensor([1.0, 0.0]), "mask": mask, "group_size": 2, "max_new_tokens": 3}}
    tensors, _ = algorithm.advantages(batch)
    a = 0.5 / (math.sqrt(0.5) + algorithm.config.eps)
    assert torch.allclose(tensors["adv"], torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0]]))


def test_clipped_loss_by_hand():
    # ε = 0.2; token 1: ρ = 1.5, A = +1 -> min(1.5, 1.2) = 1.2; token 2: ρ = 0.5, A = −1 -> min(−0.5, −0.8) = −0.8
    # L = −(1.2 − 0.8) / 2 = −0.2, and the clip binds on both tokens
    batch = {{
        "logp": torch.log(torch.tensor([[1.5], [0.5]])),
        "logp_old": torch.zeros(2, 1),
        "adv": torch.tensor([[1.0], [-1.0]]),
        "mask": torch.ones(2, 1),
        "max_new_tokens": 1,
    }}
    loss, metrics = {cls}().loss(batch)
    assert torch.isclose(loss, torch.tensor(-0.2))
    assert metrics["clip/frac"] == 1.0
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

#: what each kind writes: (relative path -> template), the class name's suffix, the package description;
#: an algorithm adds the two files of its loop (`LOOPS`)
KINDS = {
    "algorithm": (
        {
            "pyproject.toml": PYPROJECT,
            "README.md": README,
            "oxrl_{name}/__init__.py": INIT,
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

#: an algorithm's loop (``--loop``) -> its file, its hand-derived test and what the README calls it
LOOPS = {
    "supervised": (SUPERVISED_ALGORITHM, SUPERVISED_TEST, "supervised fine-tuning with label smoothing"),
    "preference": (PREFERENCE_ALGORITHM, PREFERENCE_TEST, "a DPO-style sigmoid loss on preference pairs"),
    "rl": (RL_ALGORITHM, RL_TEST, "a group-relative policy gradient (GRPO-style) on its own samples"),
}


def create(name: str, parent: Path, kind: str = "algorithm", loop: str | None = None) -> Path:
    """Write the package ``oxrl-NAME/`` of a plugin of ``kind`` under ``parent``; nothing when an input is bad.

    ``loop`` picks an algorithm's template (``supervised`` when None); it is an error for any other kind rather
    than ignored, so that ``--kind environment --loop rl`` does not quietly write something else than asked."""
    if kind not in KINDS:
        raise OxrlError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    if loop is not None and kind != "algorithm":
        raise OxrlError(f"--loop applies only to --kind algorithm, not --kind {kind}")
    loop = loop if loop is not None else "supervised"
    if kind == "algorithm" and loop not in LOOPS:
        raise OxrlError(f"--loop {loop!r}: expected one of {', '.join(LOOPS)}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise OxrlError(f"plugin name {name!r}: use lower-case letters, digits and '_', starting with a letter")
    root = parent / f"oxrl-{name}"
    if root.exists():
        raise OxrlError(f"{root} already exists; choose another name or directory")
    templates, suffix, description = KINDS[kind]
    fields = {"name": name, "kind": kind, "cls": "".join(part.capitalize() for part in name.split("_")) + suffix}
    fields["description"] = description.format(**fields)
    if kind == "algorithm":
        algorithm, test, fields["about"] = LOOPS[loop]
        fields["loop"] = loop
        templates = {**templates, "oxrl_{name}/algorithm.py": algorithm, "tests/test_{name}.py": test}
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
