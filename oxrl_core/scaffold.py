"""`oxrl new-plugin NAME`: a third-party algorithm package that installs and runs as it is."""

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
description = "The {name} algorithm for oxRL"
requires-python = ">=3.10"
dependencies = ["oxrl"]

[project.entry-points.oxrl]
{name} = "oxrl_{name}"

[tool.setuptools]
packages = ["oxrl_{name}"]
"""

INIT = '''"""oxRL plugin: registers the `{name}` algorithm (imported lazily, so `oxrl plugins` stays fast)."""

from oxrl_core import hookimpl


@hookimpl
def register_algorithms(register):
    register("{name}", "oxrl_{name}.algorithm:{cls}")
'''

ALGORITHM = '''"""{cls}: supervised fine-tuning with label smoothing (a starting point; edit the maths).

    L = -(1/N) Σ_t m_t [ (1-ε) log π(y_t | y_<t) + (ε/V) Σ_v log π(v | y_<t) ]

with m_t = 1 on completion tokens, N = Σ_t m_t, ε = `label_smoothing`, V the vocabulary size.
The loop hands over per-token tensors (never logits): ``logp`` (B, T-1), log π of each label
token, ``mask`` (B, T-1), and ``logp_mean`` (B, T-1) = (1/V) Σ_v log π(v) because
`uses_logp_mean` asks for it.
"""

from pydantic import Field

from oxrl_core import Algorithm
from oxrl_core.interfaces import StrictModel


class {cls}(Algorithm):
    name = "{name}"
    family = "supervised"
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


def create(name: str, parent: Path) -> Path:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise OxrlError(f"plugin name {name!r}: use lower-case letters, digits and '_', starting with a letter")
    root = parent / f"oxrl-{name}"
    if root.exists():
        raise OxrlError(f"{root} already exists; choose another name or directory")
    cls = "".join(part.capitalize() for part in name.split("_")) or name
    package = root / f"oxrl_{name}"
    (root / "tests").mkdir(parents=True)
    package.mkdir()
    fields = {"name": name, "cls": cls}
    (root / "pyproject.toml").write_text(PYPROJECT.format(**fields))
    (root / "README.md").write_text(README.format(**fields))
    (package / "__init__.py").write_text(INIT.format(**fields))
    (package / "algorithm.py").write_text(ALGORITHM.format(**fields))
    (root / "tests" / f"test_{name}.py").write_text(TEST.format(**fields))
    return root


def name_taken(name: str) -> str:
    """A warning when an installed package already registers algorithm ``name`` (empty when it is free).

    Not a refusal: the scaffold is a starting point and may be renamed. But installed as it is, the name
    becomes ambiguous — every run would have to choose with ``--alg oxrl-NAME:NAME`` — so the warning says
    who has it and suggests a free name.
    """
    registry = discover()
    taken = [r for r in registry.rows() if r["kind"] == "algorithm" and r["name"] == name]
    if not taken:
        return ""
    owners = " and ".join(f"{r['package']} {r['version']}" for r in taken)
    free = next(
        c for c in (f"my_{name}", *(f"{name}{i}" for i in range(2, 1000))) if c not in registry.entries["algorithm"]
    )
    return (
        f"algorithm '{name}' is already registered by {owners}: installed as it is, `--alg {name}` becomes ambiguous "
        f"and runs must choose with `--alg oxrl-{name}:{name}`. Consider a free name, e.g. `oxrl new-plugin {free}`"
    )
