"""`Trainer`: the Python API, and everything `oxrl run` does (the CLI is a thin layer over it).

    from oxrl_core import Trainer
    Trainer(alg="sft", model="path/or/hub-id", data="train.jsonl", train={"max_steps": 50}).train()
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from oxrl_core import plugins
from oxrl_core.config import TINY_PREF_DEFAULTS, TINY_RL_DEFAULTS, RunConfig, dump_yaml, load_run_config, read_yaml, validate_alg_section
from oxrl_core.errors import OxrlError, PluginError
from oxrl_core.interfaces import Algorithm


@dataclass
class RunResult:
    run_dir: Path
    final_dir: Path
    steps: int
    metrics: list[dict] = field(default_factory=list)
    eval_before: dict = field(default_factory=dict)
    eval_after: dict = field(default_factory=dict)


def _section_overrides(sections: dict[str, Any]) -> list[str]:
    """``train={"lr": 1e-3}`` -> ``["train.lr=0.001"]``, so the API goes through the same path as --set."""
    import json

    out = []
    for section, value in sections.items():
        if isinstance(value, dict):
            out += [f"{section}.{k}={json.dumps(v)}" for k, v in value.items()]
        else:
            out.append(f"{section}={json.dumps(value)}")
    return out


def _dir_name(alg: str) -> str:
    """``my_alg.py:MyAlg`` -> ``my_alg_MyAlg`` (a run directory name)."""
    return alg.replace(".py:", "_").replace("/", "_").replace(":", "_")


def load_algorithm(name: str, registry=None) -> type[Algorithm]:
    registry = registry or plugins.registry()
    cls = registry.load("algorithm", name)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        reg = registry.get("algorithm", name)
        raise PluginError(f"algorithm '{name}' from {reg.package}: {reg.target!r} is not an oxrl_core.Algorithm subclass")
    return cls


class Trainer:
    """Resolve the config, the plugins and the run directory; `train()` runs the algorithm's loop."""

    def __init__(
        self,
        alg: str | type[Algorithm] | None = None,
        model: str | dict | None = None,
        data: str | dict | None = None,
        *,
        config: str | Path | None = None,
        overrides: list[str] | None = None,
        output_dir: str | Path | None = None,
        resume: bool = False,
        quiet: bool = False,
        **sections: Any,
    ):
        self.resume = resume
        self.quiet = quiet
        named: dict[str, Any] = {}
        for section, value, key in (("model", model, "name"), ("data", data, "train")):
            if isinstance(value, dict):  # model={"name": ..., "ref": ...}: the whole section
                named[section] = value
            elif value is not None:
                named[section] = {key: str(value)}
        sets = _section_overrides(named) + _section_overrides(sections) + list(overrides or [])
        self.registry = plugins.registry()
        if isinstance(alg, type) and issubclass(alg, Algorithm):  # the Python API may pass a class
            self.registry.entries["algorithm"][alg.name] = plugins.Registration(
                "algorithm", alg.name, alg, plugin=alg.name, package=alg.__module__, version=""
            )
            alg = alg.name
        self.run_dir, base = self._run_dir(alg, config, output_dir, resume)
        source = config if config else (self.run_dir / "config.yaml" if base else None)
        self.config: RunConfig = load_run_config(config, sets, algorithm=alg, base=base)
        self.algorithm_cls = load_algorithm(self.config.algorithm, self.registry)
        if self.algorithm_cls.needs_rollouts:  # tiny-model defaults of the RL loop
            self.config = load_run_config(config, sets, algorithm=alg, base=base, tiny_defaults=TINY_RL_DEFAULTS)
        elif self.algorithm_cls.family == "preference":  # ... and of the preference loop
            self.config = load_run_config(config, sets, algorithm=alg, base=base, tiny_defaults=TINY_PREF_DEFAULTS)
        alg_config = validate_alg_section(self.config, self.algorithm_cls.Config, str(source or "--set / defaults"))
        self.algorithm = self.algorithm_cls(alg_config)
        if self.algorithm_cls.needs_teacher and not self.config.model.teacher:
            raise OxrlError(f"algorithm '{self.config.algorithm}' needs a teacher: set model.teacher (a hub id or local dir)")
        from oxrl_core.engines import check_engine

        check_engine(self.config, self.algorithm_cls.family, self.algorithm_cls.needs_rollouts)
        if self.run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.run_dir = Path("runs") / f"{_dir_name(self.config.algorithm)}-{stamp}"

    @staticmethod
    def _run_dir(alg, config, output_dir, resume) -> tuple[Path | None, dict | None]:
        """The run directory, and on --resume the saved config to start from (when no --config is given)."""
        if output_dir is not None:
            run_dir = Path(output_dir)
        elif resume:
            if not alg:
                raise OxrlError("--resume without --output-dir needs --alg to find the newest runs/<alg>-* directory")
            runs = sorted(Path("runs").glob(f"{_dir_name(alg)}-*"), key=lambda p: p.stat().st_mtime)
            runs = [r for r in runs if (r / "config.yaml").is_file()]
            if not runs:
                raise OxrlError(f"--resume: no earlier run of '{alg}' under runs/ (pass --output-dir)")
            run_dir = runs[-1]
        else:
            return None, None
        if resume and not config and (run_dir / "config.yaml").is_file():
            return run_dir, read_yaml(run_dir / "config.yaml")
        return run_dir, None

    def train(self) -> RunResult:
        from oxrl_core.checkpoint import check_engine_matches, clean_partial, latest_checkpoint

        run_dir = self.run_dir
        ckpt = None
        if self.resume:
            summary = run_dir / "summary.json"
            if summary.is_file() and (run_dir / "final").is_dir():
                done = json.loads(summary.read_text())
                if done.get("steps", 0) >= self.config.train.max_steps:
                    Console(stderr=True, soft_wrap=True).print(f"{run_dir} is already complete ({done['steps']} steps); nothing to resume")
                    return RunResult(run_dir, run_dir / "final", done["steps"], [], done.get("eval_before", {}), done.get("eval_after", {}))
            clean_partial(run_dir)
            ckpt = latest_checkpoint(run_dir)
        elif any((run_dir / name).exists() for name in ("metrics.jsonl", "checkpoints", "final")):
            raise OxrlError(f"output directory {run_dir} already holds a run; pass --resume to continue it or choose another --output-dir")
        if ckpt is not None:
            from oxrl_core.engines import engine_record

            check_engine_matches(ckpt, engine_record(self.config.engine))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(self.config))
        if self.config.engine.world_size > 1:  # one Ray actor per rank, each running `run_loop`
            from oxrl_core.launcher import launch

            return launch(self, ckpt)
        return self.run_loop(ckpt)

    def run_loop(self, ckpt: Path | None) -> RunResult:
        """The algorithm family's loop, in this process (one rank of a data-parallel run, or the whole run)."""
        family = self.algorithm_cls.family
        if self.algorithm_cls.needs_rollouts:
            from oxrl_core.loops.rl import run_rl

            return run_rl(self, ckpt)
        if family == "supervised":
            from oxrl_core.loops.supervised import run_supervised

            return run_supervised(self, ckpt)
        if family == "preference":
            from oxrl_core.loops.preference import run_preference

            return run_preference(self, ckpt)
        raise OxrlError(f"algorithm '{self.config.algorithm}' is a '{family}' algorithm; this oxrl core has no '{family}' loop yet")
