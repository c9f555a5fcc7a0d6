"""`Trainer`: the Python API, and everything `oxrl run` does (the CLI is a thin layer over it).

from oxrl_core import Trainer
Trainer(alg="sft", model="path/or/hub-id", data="train.jsonl", train={"max_steps": 50}).train()

``data`` / ``eval_data`` may also be rows held in memory (a list of row dicts, a `datasets.Dataset`), and
``model`` an already-loaded transformers model given with its ``tokenizer``; they are written into the run
directory when the run starts (`inputs`), so config.yaml names them and --resume finds them.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from oxrl_core import plugins
from oxrl_core.atomic import write_text_atomic
from oxrl_core.config import (
    TINY_DEFAULTS,
    TINY_LOOP_DEFAULTS,
    Defaults,
    RawRunConfig,
    RunConfig,
    check_env,
    dump_yaml,
    read_run_config,
    read_yaml,
    reward_options,
    validate_run_config,
)
from oxrl_core.data.sources import FILE_SUFFIXES, path_kind, source_specs, sources_argument
from oxrl_core.engines import check_engine, engine_record
from oxrl_core.engines.ray_cluster import check_cluster
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Algorithm
from oxrl_core.launcher import launch
from oxrl_core.loops.result import RunResult
from oxrl_core.models.loading import check_model_path, model_options
from oxrl_core.run_io import lifecycle
from oxrl_core.run_io.inputs import (
    INPUTS_DIR,
    PATH_FIELDS,
    Inputs,
    absolute,
    absolute_paths,
    is_loaded_model,
    is_rows,
    rows_as_jsonl,
)


def _section_overrides(sections: dict[str, Any]) -> list[str]:
    """``train={"lr": 1e-3}`` -> ``["train.lr=0.001"]``, so the API goes through the same path as --set."""
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
    """The algorithm class ``name`` names, checked against the Algorithm interface before any model loads."""
    registry = registry or plugins.registry()
    return registry.load_checked("algorithm", name)


#: a config value that imports code (`plugins.Registry.get`): ``path/to/file.py:Class`` or ``package.module:Class``
_CODE_REFERENCE = re.compile(r"^(?P<module>[^\s:]+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+):(?P<attr>[A-Za-z_]\w*)$")


def code_it_runs(raw: dict, prefix: str = "") -> list[str]:
    """What a config imports or executes by design, one entry per key: each ``file.py:Class`` or
    ``package.module:Class`` value (rewards, environments, tool parsers, ...) and the model repositories whose own
    code ``model.trust_remote_code: true`` lets transformers run."""
    found = []
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found += code_it_runs(value, f"{name}.")
        elif isinstance(value, str) and (match := _CODE_REFERENCE.match(value)):
            module = match["module"]
            kind = f"Python file {Path(module).resolve()}" if module.endswith(".py") else f"module {module}"
            found.append(f"{name}={value} ({kind})")
    model = raw.get("model") if not prefix else None
    if isinstance(model, dict) and model.get("trust_remote_code") is True:
        names = [f"model.{k}={model[k]}" for k in ("name", "ref", "teacher") if model.get(k)] or ["the built-in model"]
        found.append(f"model.trust_remote_code=true (the repository code of {', '.join(names)})")
    return found


#: config keys that say what a checkpoint is (the model, the data and its order, the method): --resume keeps them
IDENTITY_KEYS = (
    "algorithm",
    "model.name",
    "model.ref",
    "model.teacher",
    "data.train",
    "data.max_length",
    "data.group_by_length",
    "train.batch_size",
    "train.grad_accum_steps",
    "train.seed",
    "lora",
)


def _dotted(config: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(part)
    return config


def _saved_config(run_dir: Path) -> dict | None:
    """The config a --resume continues under: ``<run>/config.yaml``, else the copy in the newest checkpoint;
    with neither but a checkpoint to resume, a refusal (the defaults would silently train something else)."""
    if (run_dir / "config.yaml").is_file():
        return read_yaml(run_dir / "config.yaml")
    from oxrl_core.run_io.checkpoint import latest_checkpoint  # lazy: torch, only when a run resumes

    ckpt = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if ckpt is None:
        return None
    if (ckpt / lifecycle.CONFIG_FILE).is_file():
        Console(stderr=True, soft_wrap=True).print(
            f"note: {run_dir / 'config.yaml'} is missing; using the copy stored in {ckpt}", highlight=False
        )
        return read_yaml(ckpt / lifecycle.CONFIG_FILE)
    raise OxrlError(
        f"--resume: {run_dir / 'config.yaml'} is missing and {ckpt} stores no copy; pass the run's config "
        f"with --config FILE"
    )


def _make_run_dir(run_dir: Path) -> None:
    """Create the run directory, or say in one line why it cannot be (a file is in the way, no permission...)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise OxrlError(
            f"--output-dir {run_dir}: this is a file, not a directory; choose another path (or remove the file)"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".oxrl-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(run_dir) else ""
        raise OxrlError(
            f"--output-dir {run_dir}: cannot create or write the run directory: {exc.strerror or exc}{where}; "
            f"choose a path you can write to"
        ) from None


def _logged_steps(run_dir: Path) -> int:
    """How many steps metrics.jsonl records (non-blank lines; a torn last line counts, it was a step begun)."""
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines() if line.strip())
    except OSError:
        return 0


def _holds_a_run(run_dir: Path) -> bool:
    """Whether any step was done in `run_dir`: a metrics line, a checkpoint (even a half one) or final/."""
    checkpoints = run_dir / "checkpoints"
    return (
        _logged_steps(run_dir) > 0
        or (run_dir / "final").exists()
        or (checkpoints.is_dir() and any(checkpoints.iterdir()))
    )


class Trainer:
    """Resolve the config, the plugins and the run directory; `train()` runs the algorithm's loop."""

    def __init__(
        self,
        alg: str | type[Algorithm] | None = None,
        model: Any = None,
        data: Any = None,
        *,
        config: str | Path | None = None,
        overrides: list[str] | None = None,
        output_dir: str | Path | None = None,
        resume: bool = False,
        quiet: bool = False,
        force_config: bool = False,
        tokenizer: Any = None,
        eval_data: Any = None,
        **sections: Any,
    ):
        self.resume = resume
        self.force_config = force_config
        self.quiet = quiet
        model, data = self._in_memory(model, data, tokenizer, eval_data)
        named: dict[str, Any] = {}
        for section, value, key in (("model", model, "name"), ("data", data, "train")):
            if isinstance(value, dict):  # model={"name": ..., "ref": ...}: the whole section
                named[section] = value
            elif section == "data" and isinstance(value, (list, tuple)):  # sources to mix (rows are refused)
                named[section] = {key: sources_argument(value)}
            elif value is not None:
                named[section] = {key: str(value)}
        sets = _section_overrides(named) + _section_overrides(sections) + list(overrides or [])
        self.registry = plugins.registry()
        if isinstance(alg, type) and issubclass(alg, Algorithm):  # the Python API may pass a class
            self.registry.prefer(
                plugins.Registration("algorithm", alg.name, alg, plugin=alg.name, package=alg.__module__, version="")
            )
            alg = alg.name
        if alg:
            alg = self._alias(alg)
        self.run_dir, base = self._run_dir(alg, config, output_dir, resume)
        source = config if config else (self.run_dir / "config.yaml" if base else None)
        read = read_run_config(config, sets, algorithm=alg, base=base)
        if resume:  # a shared run directory's config.yaml may name code: say what, before any of it is imported
            declared = code_it_runs(read.raw)
            if declared:  # shown with --quiet too: it is what runs on this machine
                Console(stderr=True, soft_wrap=True).print(
                    "[yellow]note:[/yellow] --resume: this config runs code by design: "
                    + escape("; ".join(declared))
                    + " (resume only run directories you trust)",
                    highlight=False,
                )
        self.config: RunConfig = self._load_config(read, alg)
        self.algorithm = self.registry.build(
            "algorithm", self.config.algorithm, self.config.alg, field="alg", source=str(source or "--set / defaults")
        )
        for note in [*self.config.notes, plugins.deprecation_note(type(self.algorithm))]:  # old keys, old flags
            if note:
                self._note(f"[yellow]note:[/yellow] {escape(note)}")
        self.config.alg = self.algorithm.config.model_dump()  # the resolved values, as the run directory records them
        if self.algorithm.needs_teacher and not self.config.model.teacher:
            raise OxrlError(
                f"algorithm '{self.config.algorithm}' needs a teacher: set model.teacher (a hub id or local dir)"
            )
        check_engine(self.config, self.algorithm.loop == "rl")
        absolute_paths(self.config)  # config.yaml's paths read the same from any working directory (--resume)
        self._preflight()
        if self.run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.run_dir = Path("runs") / f"{_dir_name(self.config.algorithm)}-{stamp}"

    def _load_config(self, read: RawRunConfig, alg: str | None) -> RunConfig:
        """The run's config, read once (`read_run_config`) and validated once under the defaults `_defaults`
        gathers. A config error is reported first: before an unknown algorithm or environment (whose error is
        raised once the config is known to be valid) and before an alias's note."""
        alias = ""
        if not alg and read.algorithm:  # `algorithm: grpo` in a YAML: the algorithm the alias runs
            resolved = self._alias(read.algorithm, note=False)
            if resolved != read.algorithm:
                alias, read.raw["algorithm"] = read.algorithm, resolved
        defaults, unavailable = self._defaults(read)
        config = validate_run_config(read, defaults)  # names the problem: a bad config, or no algorithm given
        if alias:
            self._alias(alias)  # its note
        if unavailable is not None:
            raise unavailable
        return config

    def _defaults(self, read: RawRunConfig) -> tuple[Defaults, OxrlError | None]:
        """The run's defaults (`Defaults` holds them in the order they apply: the loop's, the environment's, the
        algorithm's and the dataset's for the built-in model, then the algorithm's rollout defaults; the user's
        config over them all), from the algorithm ``read`` names and the plugins it uses. An algorithm or
        environment that does not load comes back as the error, with the defaults known without it."""
        if not read.algorithm:
            return Defaults(), None
        try:
            algorithm_cls = load_algorithm(read.algorithm, self.registry)
        except OxrlError as exc:
            return Defaults(), exc
        loop = algorithm_cls.loop
        environment: dict = {}
        env_name = read.section("env").get("name")
        if loop == "rl" and env_name and isinstance(env_name, str):  # an RL run's environment
            try:
                environment = self.registry.load_checked("environment", env_name).tiny_defaults
            except OxrlError as exc:
                return Defaults(loop=TINY_LOOP_DEFAULTS[loop]), exc
        return Defaults(
            loop=TINY_LOOP_DEFAULTS.get(loop, TINY_DEFAULTS),
            environment=environment,
            algorithm=algorithm_cls.tiny_defaults,
            dataset=self._dataset_defaults(read, algorithm_cls),
            rollout=algorithm_cls.rollout_defaults if loop == "rl" else {},
        ), None

    def _dataset_defaults(self, read: RawRunConfig, algorithm_cls: type[Algorithm]) -> dict:
        """The built-in model's defaults of the dataset ``data.train`` names (`Dataset.tiny_defaults` for this
        loop; its ``alg`` keys only where the algorithm's Config has them); {} for any other data."""
        name = read.section("data").get("train")
        if not isinstance(name, str) or name not in self.registry.names("dataset"):
            return {}
        try:
            dataset_cls = self.registry.load_checked("dataset", name)
        except OxrlError:
            return {}  # the data loader says what is wrong with it, where it loads
        extra = dict(getattr(dataset_cls, "tiny_defaults", {}).get(algorithm_cls.loop, {}))
        if not extra:
            return {}
        fields = getattr(getattr(algorithm_cls, "Config", None), "model_fields", {})
        extra["alg"] = {k: v for k, v in extra.get("alg", {}).items() if k in fields}
        return extra

    def _in_memory(self, model, data, tokenizer, eval_data) -> tuple[Any, Any]:
        """Rows held in memory (a list of row dicts, a `datasets.Dataset`) as data / eval_data, and a loaded model
        with its tokenizer: kept in `self.inputs` and named by a placeholder until the run directory exists
        (`_write_inputs` writes them there and the config names those files)."""
        self.inputs = Inputs()
        if is_loaded_model(model):
            if tokenizer is None:
                raise OxrlError(
                    f"model=<{type(model).__name__}>: a loaded model needs its tokenizer too: Trainer(model=model, "
                    "tokenizer=tokenizer, ...)"
                )
            self.inputs.model, self.inputs.tokenizer = model, tokenizer
            model = {"name": self.inputs.placeholder("model")}
        elif tokenizer is not None:
            raise OxrlError(
                "tokenizer= goes with a loaded model (model=<a transformers model>); with a model name or directory "
                "the tokenizer loads from it (model.chat_template sets its template)"
            )
        if is_rows(data) and isinstance(data, dict):  # a DatasetDict: refused by rows_as_jsonl, naming its splits
            rows_as_jsonl(data, "data")
        if not (is_rows(data) or isinstance(data, dict) or eval_data is not None):
            return model, data
        section = dict(data) if isinstance(data, dict) else ({} if data is None else {"train": data})
        if eval_data is not None:
            section["eval"] = eval_data
        for key in ("train", "eval"):
            value = section.get(key)
            if is_rows(value):
                label = "eval_data" if key == "eval" and eval_data is not None else f"data.{key}"
                self.inputs.rows[key] = rows_as_jsonl(value, label)
                section[key] = self.inputs.placeholder(key)
            elif isinstance(value, (list, tuple)):
                section[key] = sources_argument(value)
            elif isinstance(value, Path):
                section[key] = str(value)
        return model, section

    def _write_inputs(self) -> None:
        """In-memory rows and model into ``<run>/inputs/``; the config (and config.yaml) names those files."""
        if not (self.inputs.rows or self.inputs.model is not None):
            return
        for section, path in self.inputs.write(self.run_dir, self.resume).items():
            if section == "model":
                self.config.model.name = path
            else:
                setattr(self.config.data, section, path)
        self._note(f"in-memory inputs written to {self.run_dir / INPUTS_DIR}")
        self.inputs = Inputs()  # nothing held in memory travels on (data-parallel ranks read the files)

    def _alias(self, name: str, note: bool = True) -> str:
        """The algorithm an alias such as `grpo` runs (`plugins.ALIASES`), with a one-line note on the difference."""
        resolved, why = self.registry.resolve_alias("algorithm", name)
        if why and note:
            self._note(f"[yellow]note:[/yellow] {why}")
        return resolved

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
        if resume and not config:
            return run_dir, _saved_config(run_dir)
        return run_dir, None

    def _preflight(self) -> None:
        """What can fail cheaply is checked before the run directory exists, so a bad start leaves no directory
        behind: trackers, local model paths, data files, the rollout backend and reward plugins."""
        cfg = self.config
        for flag, module, install in (
            ("tensorboard", "torch.utils.tensorboard", "pip install 'oxrl[tracking]'"),
            ("mlflow", "mlflow", "pip install 'oxrl[tracking]'"),
            ("wandb", "wandb", "pip install wandb"),
        ):
            if getattr(cfg.logging, flag):
                try:
                    __import__(module)
                except ImportError as exc:
                    raise OxrlError(
                        f"logging.{flag}: the {flag} package is not installed ({exc}); {install}, "
                        f"or set logging.{flag}=false"
                    ) from None
        for field_name in ("name", "ref", "teacher"):
            if getattr(cfg.model, field_name):  # exists, config + readable weights; a name too long is one line
                check_model_path(getattr(cfg.model, field_name), f"model.{field_name}")
        for field_name in ("train", "eval"):
            for spec, _, _, label in source_specs(getattr(cfg.data, field_name), f"data.{field_name}"):
                path = Path(spec).expanduser()
                missing = (
                    bool(spec) and path_kind(spec, label) is None
                )  # an OS error (name too long...) names the field
                if missing and (path.suffix.lower() in FILE_SUFFIXES or spec.startswith((".", "/", "~"))):
                    raise OxrlError(f"{label}: data file not found: {spec}")
                if missing and self.registry.has("dataset", spec):  # an ambiguous or broken dataset plugin
                    self.registry.load_checked("dataset", spec)
        if cfg.env.name:
            if self.algorithm.loop != "rl":
                raise OxrlError(
                    f"env.name={cfg.env.name}: environments drive the RL loop's rollouts, and '{cfg.algorithm}' "
                    "does not use rollouts (sgrpo, cispo, ppo, rlhf, rlaif, rft, online_dpo do)"
                )
        check_env(cfg, self.registry)  # env.* and the environment's own options, before any warm start
        if "OXRL_LAUNCHED" not in os.environ:  # the driver (a launched rank's cluster was checked by it)
            check_cluster(cfg.engine, cfg.rollout, self.algorithm.loop == "rl")  # joinable, actor_placement's node
        if self.algorithm.loop == "rl" and cfg.rollout.dynamic_sampling and not self.algorithm.group_relative:
            note = self.algorithm.signal_note or "it does not declare group-relative advantages (group_relative)"
            raise OxrlError(
                f"rollout.dynamic_sampling: '{cfg.algorithm}' cannot use it: dynamic sampling drops the prompt groups "
                f"whose rewards are all equal because a group-relative advantage gives them no signal, but {note}, so "
                "dropping them would change what it trains on; set rollout.dynamic_sampling=false"
            )
        if self.algorithm.loop == "rl":  # the backend's class checked, and its options (rollout.<option>)
            self.registry.check("rollout_backend", cfg.rollout.backend, cfg.rollout, field="rollout")
            if cfg.reward.name:  # the class and its own options (reward.*), before any warm start
                self.registry.check("reward", cfg.reward.name, reward_options(cfg), field="reward")

    def train(self) -> RunResult:
        """Lock the run directory, decide where the run starts (step 0, a checkpoint, or nothing to do) and run it.

        Ctrl-C / SIGTERM during the loop save a checkpoint and end with `lifecycle.Interrupted`."""
        run_dir = self.run_dir
        lifecycle.STATE.reset(run_dir)
        with lifecycle.handle_signals():
            if not self.resume:
                self._refuse_existing_run()  # before the lock, whose holder record a refused run should not rewrite
            _make_run_dir(run_dir)
            with lifecycle.RunLock(run_dir):
                done = self._completed() if self.resume else None
                if done is not None:
                    return done
                if not self.resume:
                    self._fresh_start()
                self._write_inputs()  # in-memory rows / model into <run>/inputs/ (after a refusal could come)
                ckpt = self._resume_point() if self.resume else None
                write_text_atomic(run_dir / "config.yaml", dump_yaml(self.config))
                stop_file = run_dir / lifecycle.STOP_FILE  # a data-parallel run's stop request (see launcher)
                stop_file.unlink(missing_ok=True)
                try:  # a failure of the run (not a refusal above) keeps its traceback in error.log
                    with lifecycle.error_log(run_dir):
                        if self.config.engine.world_size > 1:  # one Ray actor per rank, each running `run_loop`
                            return lifecycle.finished(launch(self, ckpt))
                        return lifecycle.finished(self.run_loop(ckpt))
                finally:
                    stop_file.unlink(missing_ok=True)

    def _completed(self) -> RunResult | None:
        """--resume of a run that already reached train.max_steps: nothing to do."""
        summary, run_dir = self.run_dir / "summary.json", self.run_dir
        if not (summary.is_file() and (run_dir / "final").is_dir()):
            return None
        try:
            done = json.loads(summary.read_text())
        except (OSError, ValueError):
            return None  # unreadable: judged by the checkpoints below
        if self.config.train.epochs is not None:  # the steps follow from the data: complete if epochs did not change
            saved = read_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
            if _dotted(saved, "train.epochs") != self.config.train.epochs:
                return None
        elif done.get("steps", 0) < self.config.train.max_steps:
            return None
        Console(stderr=True, soft_wrap=True).print(
            f"{run_dir} is already complete ({done['steps']} steps); nothing to resume", highlight=False
        )
        return RunResult(
            run_dir, run_dir / "final", done["steps"], [], done.get("eval_before", {}), done.get("eval_after", {})
        )

    def _fresh_start(self) -> None:
        """A new run: refused where steps were done already; a directory where none was done is reused."""
        from oxrl_core.run_io.checkpoint import clean_partial  # lazy: torch (Trainer is built before any run)

        run_dir = self.run_dir
        self._refuse_existing_run()  # again under the lock: another run may have started in between
        if (run_dir / "config.yaml").exists() or (run_dir / "metrics.jsonl").exists():
            self._note(f"reusing {run_dir}: an earlier start there did no step")
        clean_partial(run_dir)

    def _refuse_existing_run(self) -> None:
        if self.run_dir.is_dir() and _holds_a_run(self.run_dir):
            lifecycle.RunLock(self.run_dir).refuse_if_in_use()  # the more useful message while another run is on
            raise OxrlError(
                f"output directory {self.run_dir} already holds a run; pass --resume to continue it or choose another --output-dir"
            )

    def _resume_point(self) -> Path | None:
        """The checkpoint --resume continues from, after checking it belongs to this config; or a refusal that
        says why nothing can be resumed. Never a silent restart from step 0 over logged steps or final/."""
        from oxrl_core.run_io.checkpoint import (  # lazy: torch
            STEP_DIR,
            check_engine_matches,
            clean_partial,
            latest_checkpoint,
        )

        run_dir = self.run_dir
        clean_partial(run_dir)
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            steps = _logged_steps(run_dir)
            if (run_dir / "final").is_dir():
                raise OxrlError(
                    f"--resume: {run_dir} finished ({steps or 'all'} steps) without keeping a checkpoint, so there is no "
                    f"optimizer state to continue from (final/ holds only the weights). To train further, start a new run "
                    f"from those weights: oxrl run --alg {self.config.algorithm} --set model.name={run_dir / 'final'} "
                    f"-o NEW_DIR (train.save_every / train.save_minutes keep checkpoints)"
                )
            if steps:
                raise OxrlError(
                    f"--resume: {run_dir} logged {steps} steps but holds no checkpoint to continue from (it stopped before "
                    f"the first one); resuming would start over at step 0 and overwrite its metrics.jsonl. Start again with "
                    f"another --output-dir, or delete {run_dir} and run without --resume"
                )
            self._note(f"--resume: {run_dir} has no step done yet; starting from step 0")
            return None
        step = int(STEP_DIR.match(ckpt.name).group(1))
        if self.config.train.epochs is None and self.config.train.max_steps < step:
            raise OxrlError(
                f"--resume: train.max_steps={self.config.train.max_steps} is below step {step} of {ckpt}; "
                f"set train.max_steps to at least {step + 1} to train further"
            )
        self._check_identity(ckpt)
        check_engine_matches(ckpt, engine_record(self.config.engine, self.config.train.optimizer))
        return ckpt

    def _check_identity(self, ckpt: Path) -> None:
        """A resumed run must continue the run the checkpoint came from: the keys that say what was trained on
        what (`IDENTITY_KEYS`) may not change unless --force-config; others (max_steps, logging, lr...) may."""
        saved_file = (
            ckpt / lifecycle.CONFIG_FILE if (ckpt / lifecycle.CONFIG_FILE).is_file() else self.run_dir / "config.yaml"
        )
        if not saved_file.is_file():
            return
        saved, now = read_yaml(saved_file), self.config.model_dump(mode="json")

        def was(key: str):  # a relative path in an older run's config.yaml, read as this run reads it
            value = _dotted(saved, key)
            return absolute(key, value) if key in PATH_FIELDS and value is not None else value

        changed = [
            (key, _dotted(saved, key), _dotted(now, key))
            for key in IDENTITY_KEYS
            if _dotted(saved, key) is not None and was(key) != _dotted(now, key)
        ]
        if not changed:
            return
        listing = "; ".join(f"{key}: {old!r} → {new!r}" for key, old, new in changed)
        if self.force_config:
            Console(stderr=True, soft_wrap=True).print(
                f"[yellow]note:[/yellow] --force-config: resuming {ckpt} with {listing}", highlight=False
            )
            return
        raise OxrlError(
            f"--resume: this command changes what {ckpt} was trained as ({listing}). Drop those --set / --config "
            f"changes to continue the run; or start a new run from its weights with another --output-dir "
            f"(--set model.name={ckpt}); or pass --force-config to resume with the changes anyway"
        )

    def _note(self, message: str) -> None:
        if not self.quiet:
            Console(stderr=True, soft_wrap=True).print(message, highlight=False)

    def run_loop(self, ckpt: Path | None) -> RunResult:
        """The algorithm's loop, in this process (one rank of a data-parallel run, or the whole run);
        models and tokenizers load with the run's ``model.revision`` / ``dtype`` / ``chat_template``."""
        with model_options(self.config.model):
            return self._run_loop(ckpt)

    def _run_loop(self, ckpt: Path | None) -> RunResult:
        loop = self.algorithm.loop
        if loop == "rl":
            from oxrl_core.loops.rl import run_rl  # lazy: the loops import torch

            return run_rl(self, ckpt)
        if loop == "supervised":
            from oxrl_core.loops.supervised import run_supervised  # lazy: the loops import torch

            return run_supervised(self, ckpt)
        if loop == "preference":
            from oxrl_core.loops.preference import run_preference  # lazy: the loops import torch

            return run_preference(self, ckpt)
        raise OxrlError(f"algorithm '{self.config.algorithm}' runs in a '{loop}' loop; this oxrl core has no such loop")
