"""The contracts between oxRL's parts: the five interfaces a plugin implements (`Algorithm`,
`Reward`, `Dataset`, `RolloutBackend`, `Environment`). `Algorithm` and `PolicyGradient` are defined in
`oxrl_core.algorithm` (what a reader of one training step needs, without the other contracts) and importable from
here, as are the batches the loops hand an algorithm (one `TypedDict` per kind, one key per line with its shape,
in `oxrl_core.batches`); the `Engine` the loops train through is in `oxrl_core.engines`.

Each plugin interface carries a pydantic ``Config`` (a `StrictModel`: ``extra="forbid"``) so that a
typo in the YAML is an error that names the field. Only contracts live here; the loops, engines and
data layer that fulfil them are elsewhere in the core (the layers: ``docs/architecture.md``).

Shapes: B = rows (RL: prompts × n samples, the n samples of one prompt contiguous), T = token
positions, V = vocabulary size.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from oxrl_core.algorithm import Algorithm, DataFormat, Family, KLEstimator, Loop, LossAggregation, PolicyGradient
from oxrl_core.batches import (
    PairedPreferenceBatch,
    RLAdvantagesBatch,
    RLLossBatch,
    ScoreBatch,
    SupervisedBatch,
    UnpairedPreferenceBatch,
)
from oxrl_core.errors import OxrlError
from oxrl_core.schema import StrictModel, validate_options

if TYPE_CHECKING:
    from oxrl_core.tool_parsers import ToolParser

__all__ = [
    "Loop",
    "Family",
    "DataFormat",
    "LossAggregation",
    "KLEstimator",
    "StrictModel",
    "SupervisedBatch",
    "RLAdvantagesBatch",
    "RLLossBatch",
    "PairedPreferenceBatch",
    "UnpairedPreferenceBatch",
    "ScoreBatch",
    "Algorithm",
    "PolicyGradient",
    "Reward",
    "Dataset",
    "SamplingParams",
    "Completion",
    "RolloutBackend",
    "Environment",
    "ToolEnvironment",
]

# ---------------------------------------------------------------------------------------------------
# Plugin interfaces
# ---------------------------------------------------------------------------------------------------


class Reward(ABC):
    """Scores completions. An exception or timeout scores 0 and is counted, never crashes a run."""

    name: ClassVar[str]
    #: seconds allowed for one call of `score`
    timeout_s: ClassVar[float] = 30.0

    class Config(StrictModel):
        """The reward's own options (the ``reward:`` section beyond ``name``)."""

    def __init__(self, config: "Reward.Config | None" = None):
        self.config = config if config is not None else self.Config()

    @abstractmethod
    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        """One float per completion; ``examples`` are the dataset rows (extra fields such as ``answer``)."""

    def score_details(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[dict]:
        """One dict per completion with at least ``score`` (what `score` returns) plus whatever the
        reward can say about it (``oxrl score`` writes these). Default: ``{"score": s}``."""
        return [{"score": s} for s in self.score(prompts, completions, examples)]


class Dataset(ABC):
    """A named source of rows in one of the `DataFormat` row formats (``prompt``, ``prompt_response``,
    ``text``, ``preference``, ``unpaired``; the fields of each: ``docs/architecture.md``)."""

    name: ClassVar[str]
    #: the row format `rows` yields
    formats: ClassVar[tuple[DataFormat, ...]]

    class Config(StrictModel):
        """Options for the source."""

    #: per loop (``supervised``, ``preference``, ``rl``): config values that suit the built-in tiny model on this
    #: data, applied under the user's own settings when ``model.name`` is empty and ``data.train`` names this
    #: dataset (over the loop's own tiny-model defaults); ``alg`` keys only for algorithms whose Config has them
    tiny_defaults: ClassVar[dict] = {}

    def __init__(self, config: "Dataset.Config | None" = None):
        self.config = config if config is not None else self.Config()

    @abstractmethod
    def rows(self, split: str) -> list[dict]:
        """All rows of ``split`` (``train`` or ``eval``)."""

    def verify(self, completion: str, row: dict) -> bool | None:
        """Whether a completion solves ``row`` (None when the dataset cannot tell)."""
        return None


@dataclass
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_version: int
    #: 1 where the model sampled the token, 0 where an environment added it (multi-turn episodes);
    #: None: every token was sampled (what a backend returns)
    sampled: list[int] | None = None


class RolloutBackend(ABC):
    """Generates completions for token-id prompts and receives new policy weights."""

    name: ClassVar[str]
    #: True when generation runs in other processes (`oxrl_core.rollout.actors.RolloutActors`): the RL
    #: loop then hands over every shard of a step at once (``generate_shards``) instead of calling
    #: `generate` once per shard in the trainer's process. A plugin backend leaves it False.
    remote: ClassVar[bool] = False
    #: the torch module it generates with, when that is the very module being trained (the built-in
    #: ``hf`` backend: `update_weights` has nothing to copy); None for a backend that holds its own copy
    #: of the weights (vLLM). The RL loop skips re-scoring the weight-sync probe after every sync when it
    #: is the trained module, since such a sync cannot leave it stale.
    model: Any = None

    class Config(StrictModel):
        """The backend's own options (the ``rollout:`` keys beside ``rollout.backend``); none by default."""

    @abstractmethod
    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, images: list[dict] | None = None
    ) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, with per-token logprobs of the sampled tokens.

        ``images`` (a vision-language model's run): one entry per prompt, the image inputs the model's processor
        made for it with its tokens ({} for a text prompt; see `image_support`): ``pixel_inputs`` (tensors),
        ``token_inputs`` (one value per prompt token) and ``pixels_by``; and ``pictures`` (``ids``: the prompt with
        each image back to one placeholder; ``images``: the pictures, (H, W, 3) uint8 tensors), for a backend that
        expands images itself (an episode's later turn: every image of it so far). None: every prompt is text."""

    @abstractmethod
    def update_weights(self, state: Any, policy_version: int) -> None:
        """Load new policy weights; later generations report ``policy_version``."""

    def score(self, token_ids: list[int]) -> list[float]:
        """Optional: ``log p(token_ids[i] | token_ids[:i])`` for i = 1..len-1 under the backend's current
        weights, from the raw logits (temperature 1, nothing truncated). The RL loop compares it with
        the trainer's own on a fixed probe after every weight sync (``rollout.sync_check``)."""
        raise NotImplementedError(f"rollout backend '{self.name}' cannot score a sequence")

    @classmethod
    def image_support(cls, model_path: str) -> str | None:
        """Why this backend cannot generate from image prompts for the model at ``model_path`` (a sentence the RL
        loop shows when the run starts, before anything is generated), or None when it can. A backend that
        ignores `generate`'s ``images`` keeps this default."""
        return f"the '{cls.name}' rollout backend takes no images"

    @classmethod
    def can_score(cls) -> bool:
        """Whether `score` is implemented (the weight-sync check needs it)."""
        return cls.score is not RolloutBackend.score

    @classmethod
    def parse_options(cls, config) -> "RolloutBackend.Config":
        """The backend's options (the ``rollout:`` keys beyond oxRL's own, written flat beside ``rollout.backend``)
        validated by this backend's `Config` (an error names the field, ``rollout.<option>``)."""
        options = dict(getattr(config, "options", None) or {})
        if options and not cls.Config.model_fields:
            raise OxrlError(
                f"rollout.{sorted(options)[0]}: the '{cls.name}' rollout backend takes no options, got "
                f"{sorted(options)} (the rollout keys are {', '.join(type(config).model_fields)})"
                if hasattr(type(config), "model_fields")
                else f"rollout: the '{cls.name}' rollout backend takes no options, got {sorted(options)}"
            )
        return validate_options(cls.Config, options, field="rollout", source=f"rollout backend '{cls.name}'")

    @classmethod
    def build(cls, model, tokenizer, model_path: str, config) -> "RolloutBackend":
        """Construct the backend for a run: the trainer's ``model`` and ``tokenizer``, the path the
        policy was loaded from, and the ``rollout:`` config section (its keys beyond oxRL's own are this
        backend's options, see `parse_options`)."""
        cls.parse_options(config)
        return cls(model, tokenizer)

    def close(self) -> None:
        """Release resources."""


def generate_from(
    backend: RolloutBackend, prompt_token_ids: list[list[int]], sampling: SamplingParams, images: list[dict] | None
) -> list[list[Completion]]:
    """``backend.generate``, given ``images`` only when a prompt has some: a text run calls every backend (a plugin
    written before image prompts existed included) exactly as before."""
    if images and any(images):
        return backend.generate(prompt_token_ids, sampling, images=images)
    return backend.generate(prompt_token_ids, sampling)


class Environment(ABC):
    """A multi-turn task for the RL loop (``env.name``): the conversation grows by the model's turns and
    the environment's messages until `step` says ``done``, ``env.max_turns`` model turns, or the
    episode's token budget ``env.max_tokens``. One instance per episode: the loop builds a fresh one for
    every sample, so an instance may keep the episode's state.

    Two ways to write one, through this interface:

    - *step style* (games, simulators, user simulators): implement `step`;
    - *tools style*: subclass `ToolEnvironment`; its public, typed, documented methods are the tools.

    The loop never re-renders what the model sampled: the trained sequence is the sampled tokens plus
    the chat template's rendering of the messages `step` returns (``docs/architecture.md``, multi-turn).
    Before `reset`, the loop sets the instance's `tool_parser` and a fresh `stats`, and it reads `stats` after
    every call (the two attributes below). Every call is limited to `timeout_s`; one that raises or hangs
    ends its episode with reward 0 and is counted (``env/errors``, ``env/timeouts``), and a run whose
    environment keeps failing stops (``env.max_error_share``, ``env.error_steps``).

    Each episode's instance lives in a worker process of its own (`oxrl_core.rollout.env_worker`), killed when a call
    runs past `timeout_s`, so a hang never keeps running. Hence: the class must be importable (a module, or
    ``env.name=file.py:Class``; not ``__main__``); the arguments and what `reset`, `step`, `tools` and `reward`
    return are pickled — return plain data (str, numbers, lists, dicts), anything else is that episode's
    error; and state outside the instance (module or class variables) is each episode's own copy, never
    shared between episodes.
    """

    name: ClassVar[str]
    #: seconds allowed for one call of `reset`, `step` or `reward`
    timeout_s: ClassVar[float] = 30.0
    #: when `reward` returns None: also score the final answer (the last assistant message) with
    #: ``reward.name`` (or the algorithm's / dataset's default) and add it to the step rewards
    scores_final_answer: ClassVar[bool] = False
    #: config values that suit the built-in tiny model (e.g. its data), applied under the user's own
    #: settings when ``model.name`` is empty, as the RL loop's tiny-model defaults are
    tiny_defaults: ClassVar[dict] = {}

    # What the loop sets on each instance (`oxrl_core.rollout.env_worker`, in the episode's worker process), right
    # after building it and before `reset`; `__init__` gives both a default for an instance built by hand (a test).
    #: the `ToolParser` for the model's chat template (``env.tool_parser``: ``auto`` picks it from the template):
    #: `ToolEnvironment.step` parses every model turn with it; a step-style environment may use it too
    #: (``tool_parser.parse(text)`` -> the turn's tool calls and malformed calls). None until the loop sets it.
    tool_parser: ToolParser | None
    #: the episode's counts, a fresh `collections.Counter`: the environment adds to ``tool_calls`` and
    #: ``bad_tool_calls`` (`ToolEnvironment` does); the loop reads it with the reply to every call and logs, per
    #: step, ``env/tool_calls`` (the mean per episode) and ``env/bad_tool_calls`` (the sum). Other keys are ignored.
    stats: Counter

    class Config(StrictModel):
        """The environment's own options (the ``env:`` keys beyond name, max_turns, max_tokens, tool_parser,
        max_error_share, error_steps)."""

    def __init__(self, config: "Environment.Config | None" = None):
        self.config = config if config is not None else self.Config()
        self.tool_parser = None
        self.stats = Counter()

    def reset(self, row: dict) -> str | None:
        """Start an episode on a dataset row: the text of the first user turn, or None for the row's prompt."""
        return None

    def tools(self) -> list[dict]:
        """JSON schemas of the tools the model may call, passed to the chat template as ``tools``."""
        return []

    @abstractmethod
    def step(self, messages: list[dict]) -> tuple[list[dict], float, bool]:
        """The conversation so far, ending with the model's turn (``{"role": "assistant", "content": text}``,
        the text as sampled) -> (the messages the environment adds, e.g. ``tool`` or ``user`` messages;
        this turn's reward; whether the episode is over)."""

    def reward(self, row: dict, messages: list[dict]) -> float | None:
        """Optional reward of the whole episode, added to the step rewards; None: see `scores_final_answer`."""
        return None


class ToolEnvironment(Environment):
    """An environment whose public methods are its tools (tools style).

    Every public method other than the `Environment` ones is a tool: typed arguments and a Google-style
    docstring with an ``Args:`` section (its JSON schema comes from transformers' ``get_json_schema``).
    A turn with tool calls gets one ``tool`` message per call; a turn without one is the final answer and
    ends the episode, scored by ``reward.name`` unless `reward` is defined. A malformed call (bad JSON, an
    unknown tool, wrong arguments) is answered with an error message in its ``tool`` message, as a real
    agent would see it, and counted in ``bad_tool_calls``; a tool that raises ends the episode.
    """

    scores_final_answer: ClassVar[bool] = True

    @classmethod
    def tool_names(cls) -> list[str]:
        """The public methods that are tools (not the `Environment` interface, not ``_private``)."""
        own = set(dir(Environment)) | {"tool_names", "call_tool", "tool_parser", "stats", "config"}
        return sorted(n for n in dir(cls) if not n.startswith("_") and n not in own and callable(getattr(cls, n)))

    def tools(self) -> list[dict]:
        from transformers.utils import get_json_schema  # lazy: transformers stays out of plugin discovery

        return [get_json_schema(getattr(self, name)) for name in self.tool_names()]

    def step(self, messages: list[dict]) -> tuple[list[dict], float, bool]:
        parsed = self.tool_parser.parse(messages[-1]["content"])
        if not parsed.calls and not parsed.errors:
            return [], 0.0, True  # a final answer
        out = [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in parsed.errors]
        self.stats["bad_tool_calls"] += len(parsed.errors)
        for call in parsed.calls:
            out.append({"role": "tool", "name": call.name, "content": self.call_tool(call.name, call.arguments)})
        return out, 0.0, False

    def call_tool(self, name: str, arguments: dict) -> str | list[dict]:
        """One tool call's result as text, or as the list of content parts the tool returned (``{"type": "text",
        "text": ...}``, ``{"type": "image", "image": <path | base64 | bytes>}``: a vision-language model is shown
        the image); a call the tool cannot take is an error message for the model."""
        if name not in self.tool_names():
            self.stats["bad_tool_calls"] += 1
            return f"error: unknown tool '{name}' (tools: {', '.join(self.tool_names())})"
        method = getattr(self, name)
        try:
            bound = inspect.signature(method).bind(**arguments)
        except TypeError as exc:
            self.stats["bad_tool_calls"] += 1
            return f"error: {name}(): {exc}"
        self.stats["tool_calls"] += 1
        result = method(*bound.args, **bound.kwargs)  # a tool that raises ends the episode (the loop counts it)
        # content parts (text and images, for a vision-language model) as they are; anything else as text
        is_parts = isinstance(result, list) and all(
            isinstance(p, dict) and p.get("type") in ("text", "image") for p in result
        )
        return result if is_parts and result else str(result)
