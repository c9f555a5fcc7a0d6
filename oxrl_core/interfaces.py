"""The four interfaces a plugin implements: Algorithm, Reward, Dataset, RolloutBackend.

Each carries a pydantic ``Config`` (``extra="forbid"``) so that a typo in the
YAML is an error that names the field. Only interfaces live here; the loops,
engines and data layer that call them are elsewhere in the core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # torch stays out of discovery
    import torch

Family = Literal["rl", "preference", "supervised"]
DataFormat = Literal["prompt", "prompt_response", "text", "preference", "unpaired"]


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Algorithm(ABC):
    """The maths of one post-training method, and nothing else.

    An algorithm declares what it needs and turns tensors into a loss. The loop
    for its ``family`` does the forward passes (policy, reference, teacher)
    and hands the results over in ``batch``; no distributed code, device
    juggling or I/O belongs in an algorithm.

    Supervised algorithms receive ``batch`` with
      ``input_ids`` (B, T), ``labels`` (B, T) with -100 where no loss is taken,
      ``logits`` (B, T, V) from the policy and, when ``needs_teacher``,
      ``teacher_logits`` (B, T, V).

    Algorithms with ``needs_rollouts`` run on the RL loop. B = prompts × n samples, the n
    samples of one prompt contiguous (``batch["group_size"]`` = n); every per-token tensor
    is (B, T) over next-token positions, and ``mask`` (B, T) is 1 on completion tokens:
      ``advantages(batch)`` gets ``rewards`` (B,), ``mask``, ``logp_old`` (the trainer's
      logprobs of the sampled tokens when they were sampled), ``logp_ref`` when
      `uses_ref()`, ``values`` (the critic's, when ``needs_critic``), and returns tensors
      to add to the batch — at least ``adv`` (B, T) — and metrics;
      ``loss(batch)`` then gets a minibatch of all of that plus ``logp`` (B, T) and
      ``entropy`` (B, T) of the current policy (with gradients) and, with a critic,
      ``values_new`` (B, T).
    """

    name: ClassVar[str]
    family: ClassVar[Family]
    data_format: ClassVar[DataFormat]
    needs_ref: ClassVar[bool] = False
    needs_rollouts: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = False
    #: how micro-batches are weighted when gradients are accumulated: by the number
    #: of loss tokens (token-mean over the whole optimiser batch) or by sequences.
    loss_weighting: ClassVar[Literal["tokens", "sequences"]] = "tokens"
    #: RL: samples per prompt the maths needs (group-relative methods compare at least 2)
    min_group_size: ClassVar[int] = 1
    #: RL: the reward used when ``reward.name`` is empty ("" = the dataset plugin's own check)
    default_reward: ClassVar[str] = ""

    class Config(StrictModel):
        """The algorithm's own hyper-parameters (the ``alg:`` section)."""

    def __init__(self, config: "Algorithm.Config | None" = None):
        self.config = config if config is not None else self.Config()

    def uses_ref(self) -> bool:
        """Whether the loop must provide ``logp_ref`` (an algorithm may decide from its config)."""
        return self.needs_ref

    def advantages(self, batch: dict[str, "torch.Tensor"]) -> tuple[dict[str, "torch.Tensor"], dict[str, float]]:
        """RL only: per-token tensors to add to the rollout batch (at least ``adv`` (B, T)), and metrics."""
        raise NotImplementedError(f"{type(self).__name__} needs rollouts but does not define advantages()")

    @abstractmethod
    def loss(self, batch: dict[str, "torch.Tensor"]) -> tuple["torch.Tensor", dict[str, "torch.Tensor | float"]]:
        """Return the scalar loss and detached metrics (names like ``loss/ce``)."""


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


class Dataset(ABC):
    """A named source of rows in one of the formats of DESIGN §5."""

    name: ClassVar[str]
    #: the row format `rows` yields
    formats: ClassVar[tuple[DataFormat, ...]]

    class Config(StrictModel):
        """Options for the source."""

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


class RolloutBackend(ABC):
    """Generates completions for token-id prompts and receives new policy weights."""

    name: ClassVar[str]

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, with per-token logprobs of the sampled tokens."""

    @abstractmethod
    def update_weights(self, state: Any, policy_version: int) -> None:
        """Load new policy weights; later generations report ``policy_version``."""

    @classmethod
    def build(cls, model, tokenizer, model_path: str, config) -> "RolloutBackend":
        """Construct the backend for a run: the trainer's ``model`` and ``tokenizer``, the path the
        policy was loaded from, and the ``rollout:`` config section."""
        return cls(model, tokenizer)

    def close(self) -> None:
        """Release resources."""
