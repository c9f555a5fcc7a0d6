"""The run configuration: one YAML file, validated by pydantic, with ``--set`` overrides.

Top-level keys: ``algorithm`` (the name; ``--alg`` wins), ``model``, ``data``,
``train``, ``engine``, ``rollout``, ``reward``, ``env``, ``logging``, ``lora`` and ``alg`` (the
algorithm's own hyper-parameters, validated by that algorithm's ``Config``).
A plugin's own options sit flat beside the key that names it: ``reward:`` (beside
``reward.name``), ``env:`` (``env.name``), ``rollout:`` (``rollout.backend``) and each
``{source, ratio, ...}`` data source; each is validated by that plugin's ``Config``.
Every validation problem becomes an `OxrlError` that names the file and the
dotted field, so the CLI can print it without a traceback. Renamed keys
(`RENAMED_KEYS`, in `oxrl_core.config_renames`) are still read, with a one-line note naming the new key.
The ``rollout:`` section, grouped by concern but flat in the YAML, is `oxrl_core.config_rollout`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from oxrl_core.chat_templates import check_chat_template
from oxrl_core.config_renames import (
    OLD_ROLLOUT_OPTIONS,
    RENAMED_KEYS,
    both_given,
    core_option,
    deprecation_note,
    renamed_key,
    renamed_section,
)
from oxrl_core.config_rollout import RolloutConfig, rollout_renamed
from oxrl_core.errors import OxrlError
from oxrl_core.schema import StrictModel, format_validation_error, validate_options
from oxrl_core.tool_parsers import parser_for


def rename_keys(raw: dict, source: str, notes: list[str] | None = None) -> dict:
    """``raw`` (a YAML file's or a saved config.yaml's mapping) with the old key names of `RENAMED_KEYS` (and the
    ``rollout.options`` mapping) moved to the new ones; a note per old key is added to ``notes``. An old and a new
    name of the same key both given: an `OxrlError` naming both."""
    out = dict(raw)
    for section in {old.split(".")[0] for old in RENAMED_KEYS}:
        before = out.get(section)
        if not isinstance(before, dict):
            continue
        try:
            out[section] = rollout_renamed(before) if section == "rollout" else renamed_section(before, section)
        except ValueError as exc:
            raise OxrlError(f"invalid config ({source}):\n  {exc}") from None
        for old, new in RENAMED_KEYS.items():
            if old.startswith(f"{section}.") and old.split(".")[1] in before and notes is not None:
                notes.append(deprecation_note(old, new))
        if section == "rollout" and isinstance(before.get("options"), dict) and notes is not None:
            flat = ", ".join(f"rollout.{key}" for key in before["options"]) or "rollout.<option>"
            notes.append(deprecation_note(OLD_ROLLOUT_OPTIONS, flat))
    return out


class ModelConfig(StrictModel):
    name: str = Field("", description="hub id or local directory; empty = the built-in tiny model")
    ref: str = Field("", description="reference model; empty = a frozen copy of the policy")
    teacher: str = Field("", description="teacher model (KD)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    attn_implementation: str = Field("sdpa", description="transformers attention implementation")
    trust_remote_code: bool = False
    freeze_vision: bool = Field(
        True,
        description="a vision-language model's vision tower (its image encoder and the merger/projector inside it) "
        "is not trained; false trains it too",
    )
    revision: str = Field(
        "", description="hub revision of model.name (a branch, tag or commit); empty = the default branch"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype the policy, reference and teacher load in: float32 (master weights; train.precision picks "
        "autocast), bfloat16 / float16 (weights and optimiser in that dtype), auto = the checkpoint's own",
    )
    chat_template: str = Field(
        "",
        description="chat template for the tokenizer: a Jinja file, or a built-in name (chatml, llama3, gemma, "
        "phi3, zephyr); empty = the tokenizer's own",
    )

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str) -> str:
        """A built-in name or an existing file; a typo names the field and lists the names."""
        return check_chat_template(value)


class SourceSpec(StrictModel):
    """One source of a mixture: ``{source: gsm8k, ratio: 3, path: ./gsm8k}``; keys other than
    ``source`` and ``ratio`` are the dataset plugin's options (validated by its ``Config``)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    source: str = Field(
        ...,
        min_length=1,
        description="a file, a directory of data files, a saved `datasets` dir, a dataset plugin name or a hub id",
    )
    ratio: float = Field(1.0, gt=0, description="sampling weight among the sources of data.train")


Sources = Union[str, SourceSpec, list[Union[str, SourceSpec]]]


class DataConfig(StrictModel):
    train: Sources = Field(
        "arith",
        description="a JSONL/Parquet/JSON/CSV file, a directory of such files (one type), a saved `datasets` dir, "
        "a dataset plugin name or a hub id; "
        "or {source, ratio, <plugin options>}; or a list of those, mixed by ratio",
    )
    eval: Sources = Field(
        "",
        description="held-out data (same forms, all rows); empty = the eval splits of the dataset plugins in data.train",
    )

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _sources(cls, value: Any, info) -> Any:
        """One clear message per bad source instead of pydantic's attempt at every branch of the union."""

        def spec(item: Any, where: str) -> Any:
            if isinstance(item, str):
                return item
            if not isinstance(item, dict):
                raise ValueError(
                    f"{where}{': ' if where else ''}expected a source string or a {{source, ratio, ...}} mapping, got {type(item).__name__}"
                )
            try:
                return SourceSpec.model_validate(item)
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ValueError(
                    f"{where}{'.' if where else ''}{'.'.join(map(str, first['loc']))}: {first['msg']}"
                ) from None

        if isinstance(value, list):
            if not value and info.field_name == "train":
                raise ValueError("the list of sources is empty")
            return [spec(item, f"[{i}]") for i, item in enumerate(value)]
        return spec(value, "")

    max_length: int = Field(1024, gt=0, description="longer rows are truncated (completion side)")
    group_by_length: bool = Field(
        False, description="batch rows of similar length together (less padding; changes the sample order)"
    )
    packing: Union[bool, Literal["auto"]] = Field(
        "auto",
        description="padding-free packing of a micro-batch into one row (block-diagonal attention); auto: on where "
        "a packed row of the loaded model equals its sequences' separate forwards (measured at load), else padded",
    )


class TrainConfig(StrictModel):
    max_steps: int = Field(100, gt=0, description="optimiser steps (or set train.epochs instead)")
    epochs: Optional[float] = Field(
        None,
        gt=0,
        description="passes over the training data instead of max_steps: max_steps = ⌈epochs × ⌈rows / batch_size⌉ "
        "/ grad_accum_steps⌉ (RL: ⌈epochs × ⌈prompts / batch_size⌉⌉), computed when the data has loaded and shown "
        "in the run banner; fractions allowed (0.5); unset = max_steps decides",
    )
    lr: float = Field(1e-5, gt=0, description="peak learning rate (finite, > 0)")
    batch_size: int = Field(8, gt=0, description="rows per micro-batch")
    grad_accum_steps: int = Field(1, gt=0, description="micro-batches per optimiser step")
    max_tokens_per_micro_batch: int = Field(
        0,
        ge=0,
        description="token-budget batching: the optimiser batch (batch_size × grad_accum_steps rows; RL: each "
        "minibatch) is regrouped into micro-batches of at most this many tokens (padded width × rows, or the sum of "
        "lengths when packed), longest rows first; the gradient is the same, the peak memory bounded (0 = off)",
    )
    logits_chunk_size: int = Field(
        1024,
        ge=0,
        description="per-token log-probabilities, entropy and KD's KL computed from the last hidden state in tiles "
        "of this many scored tokens × train.logits_vocab_tile vocabulary entries (one tile buffer, float32 online "
        "folds, each tile recomputed in backward), so no (tokens, vocabulary) tensor is built; 0 = the model's full "
        "logits",
    )
    logits_vocab_tile: int = Field(
        8192,
        gt=0,
        description="vocabulary entries per tile of the LM head (with train.logits_chunk_size tokens): the head's "
        "transient memory is one tile in the compute dtype and two in float32, whatever the vocabulary",
    )
    logits_chunk_min_mb: float = Field(
        64.0,
        ge=0,
        description="the chunked head is used only where it saves memory: when one micro-batch's full float32 "
        "logits (the most tokens it can score × the vocabulary × 4 bytes) would exceed this many MB; below it the "
        "model's own full logits are faster (tiny vocabularies); 0 = chunk whenever logits_chunk_size > 0",
    )
    save_every: int = Field(
        500,
        ge=0,
        description="checkpoint every N steps, or every train.save_minutes, whichever comes first "
        "(0 = not by steps); Ctrl-C / SIGTERM always save one",
    )
    save_minutes: float = Field(
        30.0, ge=0, description="checkpoint when this many minutes passed since the last one (0 = not by time)"
    )
    save_total_limit: int = Field(2, ge=0, description="keep only the newest N checkpoints (0 = keep all)")
    seed: int = Field(
        42,
        ge=0,
        lt=2**32,
        description="0 <= seed < 2^32 (what every random generator oxRL seeds accepts, with room "
        "for the per-step seeds derived from it)",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="steps over which the learning rate rises from 0 to train.lr; a value you set must be shorter "
        "than the run (the built-in model's default of 20 is cut to 10% of a shorter run)",
    )
    #: train.warmup_steps came from the built-in model's defaults (`TINY_DEFAULTS`), not from the user: fitted to a
    #: shorter run rather than refused (`fit_warmup`), and left out of config.yaml (`dump_yaml`)
    _warmup_from_defaults: bool = PrivateAttr(False)
    lr_scheduler: Literal["linear", "cosine", "constant"] = "linear"
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["adamw", "adamw_bf16", "adamw_8bit"] = Field(
        "adamw",
        description="adamw (fp32 moment estimates, 8 bytes per parameter), adamw_bf16 (bf16 moment estimates with "
        "stochastic rounding, 4 bytes; torch engine) or adamw_8bit (torchao's block-wise 8-bit estimates, about 2 "
        "bytes; torch engine, needs torchao)",
    )
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto = bf16 autocast on a GPU that supports it"
    )
    log_every: int = Field(
        10, gt=0, description="progress line every N steps when not on a terminal (metrics.jsonl gets every step)"
    )
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0 = before and after training only)")
    precompute_ref_logps: bool = Field(
        False,
        description="preference: reference log-probabilities of every pair once before training, then free the reference model",
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict:
        """With train.epochs the steps follow from the data: the saved config (config.yaml) leaves max_steps out,
        so that a --resume reads it back without a conflict."""
        out = handler(self)
        if self.epochs is not None:
            out.pop("max_steps", None)
        return out

    @property
    def warmup_from_defaults(self) -> bool:
        return self._warmup_from_defaults

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """Old key names given to the model directly (``TrainConfig(save_steps=1)``) read as the new ones; a YAML
        file or --set goes through `rename_keys` / `apply_overrides`, which also print the deprecation note."""
        return renamed_section(data, "train")


class EngineConfig(StrictModel):
    """Where the model trains. ``torch``: one process, CPU or one GPU (the default). ``deepspeed``: ZeRO,
    in one process or, with ``world_size`` > 1, as Ray actors that each own one rank (one GPU each when
    there are GPUs); every optimiser step sees the same rows as a single-process run."""

    name: Literal["torch", "deepspeed"] = Field(
        "torch", description="torch (one process) or deepspeed (ZeRO, data parallel over Ray actors)"
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0,
        description="deepspeed: what is partitioned over the ranks: 0 nothing (plain data parallel), 1 optimizer states, "
        "2 + gradients, 3 + parameters",
    )
    world_size: int = Field(1, ge=1, description="deepspeed: training ranks; > 1 starts one Ray actor per rank")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = CUDA when available (one GPU per rank)")
    offload_optimizer: bool = Field(
        False, description="deepspeed, zero_stage >= 1: optimizer states and the update in CPU memory"
    )
    offload_params: bool = Field(
        False, description="deepspeed, zero_stage 3: partitioned parameters in CPU memory between uses"
    )
    rollout_shards: int = Field(
        0,
        ge=0,
        description="RL: the rollout batch is sampled in this many seeded shards of whole prompts, dealt to the "
        "ranks (0 = one per rank); runs with the same value draw the same samples whatever their world size",
    )
    ray_address: str = Field(
        "",
        description="world_size > 1 or rollout.actors: the Ray cluster to join (e.g. 'auto'); empty = $RAY_ADDRESS "
        "when set (Ray's convention: `ray job submit`, a cluster's nodes), else start a local one",
    )
    timeout_s: float = Field(
        1800.0,
        gt=0,
        description="seconds a collective (torch.distributed) or a remote call (Ray) may wait before the run "
        "stops with an error instead of hanging",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "EngineConfig":
        problems = []
        if self.name == "torch":
            if self.zero_stage:
                problems.append(
                    f"engine.zero_stage={self.zero_stage} needs engine.name: deepspeed (the torch engine partitions nothing)"
                )
            if self.world_size > 1:
                problems.append(
                    f"engine.world_size={self.world_size} needs engine.name: deepspeed (the torch engine is one process; "
                    "data parallelism runs DeepSpeed ranks as Ray actors)"
                )
            if self.offload_optimizer or self.offload_params:
                problems.append(
                    "engine.offload_optimizer / engine.offload_params need engine.name: deepspeed with ZeRO"
                )
        else:
            if self.offload_optimizer and self.zero_stage == 0:
                problems.append("engine.offload_optimizer needs ZeRO (engine.zero_stage 1, 2 or 3; got 0)")
            if self.offload_params and self.zero_stage != 3:
                problems.append(
                    f"engine.offload_params needs engine.zero_stage: 3 (only ZeRO-3 partitions parameters; got {self.zero_stage})"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RewardConfig(StrictModel):
    """``name`` picks the reward plugin; any other key is that reward's own option (validated by its Config)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = Field(
        "", description="reward plugin, or `file.py:Class` / `module:Class`; empty = the algorithm's default"
    )
    timeout_s: float | None = Field(None, gt=0, description="seconds per scoring call (default: the reward's own)")


class EnvConfig(StrictModel):
    """``name`` picks the environment plugin (multi-turn RL); any key beyond the six below is that
    environment's own option (validated by its Config)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = Field(
        "", description="environment plugin, or `file.py:Class` / `module:Class`; empty = single-turn rollouts"
    )
    max_turns: int = Field(4, gt=0, description="model turns per episode at most")
    max_tokens: int = Field(
        512, gt=0, description="tokens after the prompt in one episode at most (the model's and the environment's)"
    )
    tool_parser: str = Field(
        "auto",
        description="how tool calls are read from the model's turns: auto (by the chat template), hermes, "
        "llama3_json, mistral, or `module:Class` / `file.py:Class`",
    )
    max_error_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="a step whose share of episodes the environment failed in (raised, timed out or returned "
        "something malformed: env/error_share) is above this counts toward stopping the run; 1 = never stop",
    )
    error_steps: int = Field(
        3,
        ge=0,
        description="stop the run (checkpoints kept) after this many steps in a row over max_error_share; "
        "0 = never stop",
    )


class LoraConfig(StrictModel):
    """LoRA adapters through PEFT for the policy (any algorithm); `final/` holds merged weights and `final/adapter/`."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    r: int = Field(16, gt=0, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scaling: the update is (alpha / r) · B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: Union[str, list[str]] = Field(
        "all-linear",
        description="module names to adapt (e.g. [q_proj, v_proj]), or `all-linear` (every linear layer but the output head)",
    )


class LoggingConfig(StrictModel):
    tensorboard: bool = Field(False, description="write TensorBoard events to <run>/tensorboard")
    mlflow: bool = Field(False, description="log to MLflow")
    mlflow_tracking_uri: str = Field("", description="empty = a local file store in <run>/mlruns")
    wandb: bool = False
    wandb_project: str = "oxrl"
    run_name: str = ""
    rollout_samples_every: int = Field(
        10,
        ge=0,
        description="RL: every N steps (and the first and last) a sample of rollouts with per-token values goes "
        "to <run>/rollouts.jsonl for `oxrl report`'s viewer (2 prompts × 4 samples; 0 = off)",
    )


class RunConfig(StrictModel):
    algorithm: str = ""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvConfig = EnvConfig()
    logging: LoggingConfig = LoggingConfig()
    lora: LoraConfig = LoraConfig()
    alg: dict[str, Any] = Field(default_factory=dict)
    #: deprecation notes of the old key names the config was read with (`read_run_config`)
    _notes: list[str] = PrivateAttr(default_factory=list)
    #: the algorithm's own defaults in use (``{"rollout.minibatches": 4}``): not set by the user
    _algorithm_defaults: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _async_episodes_sample_once(self) -> "RunConfig":
        ro = self.rollout
        if ro.dynamic_sampling and ro.max_staleness and self.env.name:
            raise ValueError(
                f"rollout.dynamic_sampling with rollout.max_staleness={ro.max_staleness} and env.name={self.env.name}: "
                "asynchronous rollouts support dynamic sampling for single-turn completions only; for multi-turn "
                "episodes set rollout.max_staleness=0 (dynamic sampling works there) or rollout.dynamic_sampling=false"
            )
        return self

    @property
    def notes(self) -> list[str]:
        return self._notes

    @property
    def algorithm_defaults(self) -> dict[str, Any]:
        return self._algorithm_defaults


#: Hyper-parameters that suit the built-in tiny model; applied under the user's
#: settings when `model.name` is empty (a real model keeps the generic defaults).
TINY_DEFAULTS = {"train": {"lr": 1e-3, "max_steps": 600, "batch_size": 32, "warmup_steps": 20}}
#: ... and for algorithms that learn from rollouts (batch_size = prompts per step).
TINY_RL_DEFAULTS = {
    "train": {"lr": 3e-4, "max_steps": 300, "batch_size": 16, "warmup_steps": 0},
    "rollout": {"n": 8, "max_new_tokens": 8},
}


#: ... and for preference algorithms (batch_size = pairs per step), which start from the warm start.
TINY_PREF_DEFAULTS = {
    "train": {"lr": 1e-4, "max_steps": 100, "batch_size": 16, "warmup_steps": 0},
    "rollout": {"max_new_tokens": 8},
}
#: the built-in model's defaults by the algorithm's loop (`Algorithm.loop`); any other loop: `TINY_DEFAULTS`
TINY_LOOP_DEFAULTS = {"rl": TINY_RL_DEFAULTS, "preference": TINY_PREF_DEFAULTS}


@dataclass(frozen=True)
class Defaults:
    """The defaults a run's config is validated under, one field per source in the order they apply: each
    overrides the ones above it, and the user's config (the YAML file, then each --set) overrides them all
    (`with_defaults`). The first four suit the built-in model and apply only with model.name empty; ``rollout``
    applies whatever the model. `Trainer` gathers them from the algorithm's loop and the plugins the config
    names; a source that does not apply to the run is empty."""

    #: the loop's (`TINY_LOOP_DEFAULTS`): the built-in model's learning rate, steps, batch size, ...
    loop: dict = dataclass_field(default_factory=lambda: TINY_DEFAULTS)
    #: an RL run's environment (env.name): `Environment.tiny_defaults`
    environment: dict = dataclass_field(default_factory=dict)
    #: the algorithm's `Algorithm.tiny_defaults` (a smaller learning rate, ...)
    algorithm: dict = dataclass_field(default_factory=dict)
    #: the dataset plugin data.train names: its `Dataset.tiny_defaults` for the algorithm's loop
    dataset: dict = dataclass_field(default_factory=dict)
    #: an RL algorithm's `Algorithm.rollout_defaults` (rollout keys: how the method is meant to run)
    rollout: dict = dataclass_field(default_factory=dict)

    def tiny(self) -> dict:
        """The built-in model's defaults merged: loop, environment, algorithm, dataset, each over the ones before."""
        merged: dict = {}
        for source in (self.loop, self.environment, self.algorithm, self.dataset):
            merged = merge_config(merged, source)
        return merged


def merge_config(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, section by section (neither is changed)."""
    return _merge(base, over)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise OxrlError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise OxrlError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OxrlError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def apply_overrides(raw: dict, overrides: list[str], notes: list[str] | None = None) -> dict:
    """Apply ``a.b=c`` strings; the value is parsed as YAML (``1e-5``, ``true``, ``[1, 2]``). An old key name
    (`RENAMED_KEYS`) sets the new key, with a note added to ``notes``; the old and the new name of one key both
    among the overrides is an error naming both."""
    raw = copy.deepcopy(raw)
    spelled: dict[str, str] = {}  # new key -> the name an override gave it by
    pending: list[tuple[str, str, Any]] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OxrlError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=1e-5")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        if key == OLD_ROLLOUT_OPTIONS and isinstance(value, dict):  # --set rollout.options={a: 1}: each flat
            pending += [(item, f"{key}.{option}", option_value) for option, option_value in value.items()]
        else:
            pending.append((item, key, value))
    for item, given, value in pending:
        key, old = renamed_key(given)
        if key != given and key.removeprefix("rollout.") in RolloutConfig.model_fields and old == OLD_ROLLOUT_OPTIONS:
            raise OxrlError(f"--set {item!r}: {core_option(key.removeprefix('rollout.'))}")
        if spelled.setdefault(key, given) != given:
            raise OxrlError(f"--set {item!r}: {both_given(*sorted((spelled[key], given), key=lambda k: k == key))}")
        if old is not None and notes is not None:
            notes.append(deprecation_note(old, key))
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise OxrlError(f"--set {item!r}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


@dataclass
class RawRunConfig:
    """A run's config as read (YAML or a saved config, old key names renamed, --set applied), not yet validated:
    `read_run_config` makes it once per run, `validate_run_config` turns it into the `RunConfig`."""

    raw: dict
    source: str
    #: one deprecation note per old key name read (without the ``note:`` prefix), in order, no repeats
    notes: list[str] = dataclass_field(default_factory=list)

    @property
    def algorithm(self) -> str:
        value = self.raw.get("algorithm")
        return value if isinstance(value, str) else ""

    def section(self, name: str) -> dict:
        value = self.raw.get(name)
        return value if isinstance(value, dict) else {}


def read_run_config(
    config_path: str | Path | None = None,
    overrides: list[str] | None = None,
    algorithm: str | None = None,
    base: dict | None = None,
) -> RawRunConfig:
    """Read YAML (or `base`, e.g. a saved config.yaml), rename old keys (with notes), apply overrides."""
    source = str(config_path) if config_path else "--set / defaults"
    notes: list[str] = []
    raw = read_yaml(config_path) if config_path else copy.deepcopy(base or {})
    raw = rename_keys(raw, source, notes)
    raw = apply_overrides(raw, overrides or [], notes)
    if algorithm:
        raw["algorithm"] = algorithm
    return RawRunConfig(raw, source, list(dict.fromkeys(notes)))


def load_run_config(
    config_path: str | Path | None = None,
    overrides: list[str] | None = None,
    algorithm: str | None = None,
    base: dict | None = None,
    defaults: Defaults | None = None,
) -> RunConfig:
    """Read YAML (or `base`), apply overrides, fill the defaults (`Defaults`), validate."""
    return validate_run_config(read_run_config(config_path, overrides, algorithm, base), defaults)


def _section(raw: dict, name: str) -> dict:
    value = raw.get(name)
    return value if isinstance(value, dict) else {}


def with_defaults(raw: dict, defaults: Defaults) -> tuple[dict, dict, dict]:
    """``raw`` (the user's config: the YAML file, then each --set) over ``defaults``: the one place a run's
    defaults are merged, in `Defaults`' order, each source over the ones before it and ``raw`` over them all. With
    train.epochs set the built-in model's train.max_steps yields (the steps follow from the data). Returns the
    merged mapping, the built-in model's defaults in use ({} with model.name set) and the rollout defaults applied
    (those of ``defaults.rollout`` the user left unset)."""
    tiny: dict = {}
    if not _section(raw, "model").get("name"):
        tiny = defaults.tiny()
        if _section(raw, "train").get("epochs") is not None:
            tiny = {**tiny, "train": {k: v for k, v in tiny.get("train", {}).items() if k != "max_steps"}}
    own_rollout = _section(raw, "rollout")
    applied = {k: v for k, v in defaults.rollout.items() if k not in own_rollout}
    merged = merge_config(tiny, {"rollout": applied}) if applied else tiny
    return merge_config(merged, raw), tiny, applied


def validate_run_config(read: RawRunConfig, defaults: Defaults | None = None) -> RunConfig:
    """``read`` over its defaults (`with_defaults`; none given: `TINY_DEFAULTS` for the built-in model), validated
    once; the deprecation notes travel in `RunConfig.notes`, the algorithm's rollout defaults in use in
    `RunConfig.algorithm_defaults` (the banner names them)."""
    source, train = read.source, _section(read.raw, "train")
    if train.get("epochs") is not None and "max_steps" in train:  # one thing said two ways (the config's own keys)
        raise OxrlError(
            f"invalid config ({source}):\n  train.epochs={train['epochs']} and train.max_steps={train['max_steps']} "
            "are both set; set one of them (with train.epochs the steps follow from the data size; "
            "--set train.epochs=null unsets it)"
        )
    raw, tiny, applied = with_defaults(read.raw, defaults or Defaults())
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise format_validation_error(exc, RunConfig, source) from None
    config.train._warmup_from_defaults = "warmup_steps" in tiny.get("train", {}) and "warmup_steps" not in train
    if config.train.epochs is None and not config.train.warmup_from_defaults:  # the run's length is known: now
        try:
            fit_warmup(config.train, f"train.max_steps={config.train.max_steps}")
        except OxrlError as exc:
            raise OxrlError(f"invalid config ({source}):\n  {exc}") from None
    if not config.algorithm:
        raise OxrlError("no algorithm given: pass --alg NAME or set `algorithm:` in the config (see `oxrl plugins`)")
    config._notes = list(read.notes)
    config._algorithm_defaults = {f"rollout.{k}": v for k, v in applied.items()}
    return config


def validate_alg_section(config: RunConfig, config_cls, source: str = "config") -> Any:
    """Validate the ``alg:`` section with the algorithm's own Config; store the resolved values back."""
    alg_config = validate_options(config_cls, config.alg, field="alg", source=source)
    config.alg = alg_config.model_dump()
    return alg_config


def fit_warmup(train: TrainConfig, length: str) -> str | None:
    """A warm-up at least as long as the run (``length`` says how long it is and why) would run every step below
    train.lr, the first at 0 (a run of the built-in model shorter than its 20-step default trained nothing).
    The built-in default is cut to 10% of the run's steps (the note to show is returned); a warm-up the user
    set is refused, naming both values. Called when the config is read if train.max_steps is known, else
    once the data has loaded (`Run.steps_from_epochs`), before the learning-rate schedule is built."""
    warmup, steps = train.warmup_steps, train.max_steps
    if warmup < steps:
        return None
    cut = steps // 10
    if train.warmup_from_defaults:
        train.warmup_steps = cut
        return (
            f"the built-in model's default warm-up of {warmup} steps (train.warmup_steps) is at least as long as the "
            f"run ({length}): cut to {cut} steps (10% of the run) so that it trains at train.lr"
        )
    raise OxrlError(
        f"train.warmup_steps={warmup} is at least as long as the run ({length}): every step would train below "
        f"train.lr, the first at a learning rate of 0; set train.warmup_steps below {steps} (e.g. {cut})"
    )


def dump_yaml(config: RunConfig) -> str:
    """config.yaml's text. A warm-up that came from the built-in model's defaults is left out, as max_steps is under
    train.epochs: read back (--resume, a data-parallel rank) the defaults supply it again and `fit_warmup` treats
    it as theirs, where a written number would read as the user's own and be refused instead of fitted."""
    data = config.model_dump(mode="json")
    if config.train.warmup_from_defaults:
        data["train"].pop("warmup_steps", None)
    return yaml.safe_dump(data, sort_keys=False)


def validate_reward_section(config: RunConfig, config_cls, source: str = "config") -> Any:
    """Validate the reward's own options (the ``reward:`` keys other than ``name``/``timeout_s``)."""
    return validate_options(config_cls, reward_options(config), field="reward", source=source)


def reward_options(config: RunConfig) -> dict:
    """The reward plugin's own options: the ``reward:`` keys other than ``name``/``timeout_s``."""
    return dict(config.reward.model_extra or {})


def env_options(config: RunConfig) -> dict:
    """The environment plugin's own options: the ``env:`` keys beyond name, max_turns, max_tokens, tool_parser,
    max_error_share and error_steps."""
    return dict(config.env.model_extra or {})


def check_env(config: RunConfig, registry) -> None:
    """Everything of ``env:`` that needs no model, checked when a run starts (before any warm start or model
    load, which can take minutes on the built-in model): the environment plugin, its own options (its Config:
    a typo names ``env.<key>``), its constructor (one instance, discarded), and ``env.tool_parser`` when it
    names a parser (``auto`` follows the model's chat template, known once the tokenizer loads). Options
    without an ``env.name`` would be ignored, so they are refused."""
    options = env_options(config)
    if not config.env.name:
        if options:
            raise OxrlError(f"env.{next(iter(options))}: environment options need an env.name")
        return
    if options and not registry.load_checked("environment", config.env.name).Config.model_fields:
        raise OxrlError(
            f"env.{next(iter(options))}: environment '{config.env.name}' takes no options of its own; the env keys "
            f"are {', '.join(EnvConfig.model_fields)}"
        )
    registry.build("environment", config.env.name, options, field="env")
    if config.env.tool_parser != "auto":
        parser_for(None, config.env.tool_parser)
