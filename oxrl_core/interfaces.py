"""The four interfaces a plugin implements: Algorithm, Reward, Dataset, RolloutBackend.

Each carries a pydantic ``Config`` (``extra="forbid"``) so that a typo in the
YAML is an error that names the field. Only interfaces live here; the loops,
engines and data layer that call them are elsewhere in the core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator

if TYPE_CHECKING:  # torch stays out of discovery
    import torch

Family = Literal["rl", "preference", "supervised"]
DataFormat = Literal["prompt", "prompt_response", "text", "preference", "unpaired"]


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, and so is a float that is NaN or infinite
    (``train.lr=.inf``): a non-finite hyper-parameter only shows up later as NaN weights. Plugin configs
    subclass this, so their floats are checked the same way."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_in_64_bits(cls, value: Any) -> Any:
        """An integer field (any section, any plugin) must fit in 64 bits: torch, numpy and the OS take no
        more, and a larger one (``train.max_steps=1e30`` as an int) would fail deep inside them."""
        if type(value) is int and not -(2**63) <= value < 2**63:
            raise ValueError("must fit in a signed 64-bit integer (|value| < 2^63)")
        return value


class Algorithm(ABC):
    """The maths of one post-training method, and nothing else.

    An algorithm declares what it needs and turns tensors into a loss. The loop
    for its ``family`` does the forward passes (policy, reference, teacher)
    and hands the results over in ``batch``; no distributed code, device
    juggling or I/O belongs in an algorithm.

    Supervised algorithms receive per-token tensors over next-token positions (position t
    scores token t+1), never a (B, T, V) tensor — the loop computes them chunk by chunk:
      ``input_ids`` (B, T), ``labels`` (B, T) with -100 where no loss is taken,
      ``mask`` (B, T-1) bool, True where ``labels[:, 1:]`` is scored,
      ``logp`` (B, T-1) log π_θ(labels[:, t+1] | ≤ t) with gradients (0 where not scored),
      ``logp_mean`` (B, T-1) (1/V) Σ_v log π_θ(v | ≤ t), only when `uses_logp_mean()`
      (label smoothing), and when ``needs_teacher``
      ``kl_teacher`` (B, T-1) KL(p_T^τ ‖ p_S^τ) per position, p^τ = softmax(logits / τ) of the
      teacher (no gradient) and the student, at τ = `distill_temperature()`.

    Algorithms with ``needs_rollouts`` run on the RL loop. B = prompts × n samples, the n
    samples of one prompt contiguous (``batch["group_size"]`` = n); every per-token tensor
    is (B, T) over next-token positions, and ``mask`` (B, T) is 1 on completion tokens:
      ``advantages(batch)`` gets ``rewards`` (B,), ``mask``, ``logp_old`` (the trainer's
      logprobs of the sampled tokens when they were sampled), ``logp_ref`` when
      `uses_ref()`, ``values`` (the critic's, when ``needs_critic``), and returns tensors
      to add to the batch — at least ``adv`` (B, T) — and metrics;
      ``loss(batch)`` then gets a minibatch of all of that plus ``logp`` (B, T) and
      ``entropy`` (B, T) of the current policy (with gradients; like ``logp_old`` and
      ``logp_ref``, computed where ``mask`` is 1 only, 0 elsewhere) and, with a critic,
      ``values_new`` (B, T); and ``tis_weight`` (B, T), the truncated importance weight
      min(π_old / π_rollout, C) that corrects for the rollout engine's numerics (detached;
      ones when ``rollout.tis_cap`` is 0), which multiplies each token's policy-gradient term.

    Preference algorithms (the preference loop) receive per-sequence tensors, summed over
    completion tokens (the prompt is never scored), with gradients for the policy's:
      paired rows (``preference`` data; ``prompt_response`` data with ``self_play``, where the
      rejected response is generated): ``logp_chosen``, ``logp_rejected`` (B,) log π(y|x),
      ``n_chosen``, ``n_rejected`` (B,) completion lengths |y|, and when `uses_ref()`
      ``ref_logp_chosen``, ``ref_logp_rejected`` (B,) (no gradient);
      unpaired rows (``unpaired`` data): ``logp``, ``n_tokens``, ``label`` (B,) (1. desirable,
      0. undesirable), and when `uses_ref()` ``ref_logp`` (B,) plus ``kl_logp``, ``ref_kl_logp``
      (B,): policy (no gradient) and reference logprobs of mismatched pairs, prompt i with
      completion i−1 (cyclically) of the same batch;
      ``head = "score"`` (a scalar head, e.g. a reward model): ``rewards_chosen``,
      ``rewards_rejected`` (B,), the head's output at each sequence's last token (its EOS).
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
    #: RL: minibatches hold whole groups, in order (the loss compares the samples of one prompt)
    loss_on_groups: ClassVar[bool] = False
    #: what the model outputs: next-token logits (``lm``) or one scalar per sequence (``score``,
    #: an ``AutoModelForSequenceClassification`` with one label, saved as such in ``final/``)
    head: ClassVar[Literal["lm", "score"]] = "lm"
    #: preference: the rejected response of each ``prompt_response`` row is generated by the
    #: reference model, and the reference becomes a copy of the policy at the start of each of
    #: `iterations()` equal parts of the run (self-play, SPIN)
    self_play: ClassVar[bool] = False

    class Config(StrictModel):
        """The algorithm's own hyper-parameters (the ``alg:`` section)."""

    def __init__(self, config: "Algorithm.Config | None" = None):
        self.config = config if config is not None else self.Config()

    def uses_ref(self) -> bool:
        """Whether the loop must provide ``logp_ref`` (an algorithm may decide from its config)."""
        return self.needs_ref

    def uses_logp_mean(self) -> bool:
        """Supervised: whether `loss` reads ``logp_mean`` (label smoothing); computed only when asked."""
        return False

    def distill_temperature(self) -> float:
        """Supervised with ``needs_teacher``: the temperature τ of ``kl_teacher``."""
        return 1.0

    def iterations(self) -> int:
        """Self-play: how many iterations the run's `train.max_steps` are split into."""
        return 1

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

    def score_details(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[dict]:
        """One dict per completion with at least ``score`` (what `score` returns) plus whatever the
        reward can say about it (``oxrl score`` writes these). Default: ``{"score": s}``."""
        return [{"score": s} for s in self.score(prompts, completions, examples)]


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

    class Config(StrictModel):
        """The backend's own options (``rollout.options``); none by default."""

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, with per-token logprobs of the sampled tokens."""

    @abstractmethod
    def update_weights(self, state: Any, policy_version: int) -> None:
        """Load new policy weights; later generations report ``policy_version``."""

    def score(self, token_ids: list[int]) -> list[float]:
        """Optional: ``log p(token_ids[i] | token_ids[:i])`` for i = 1..len-1 under the backend's current
        weights, from the raw logits (temperature 1, nothing truncated). The RL loop compares it with
        the trainer's own on a fixed probe after every weight sync (``rollout.sync_check``)."""
        raise NotImplementedError(f"rollout backend '{self.name}' cannot score a sequence")

    @classmethod
    def can_score(cls) -> bool:
        """Whether `score` is implemented (the weight-sync check needs it)."""
        return cls.score is not RolloutBackend.score

    @classmethod
    def parse_options(cls, config) -> "RolloutBackend.Config":
        """``rollout.options`` validated by this backend's `Config` (an error names the field)."""
        from pydantic import ValidationError

        from oxrl_core.config import format_validation_error
        from oxrl_core.errors import OxrlError

        options = dict(getattr(config, "options", None) or {})
        if options and not cls.Config.model_fields:
            raise OxrlError(
                f"rollout.options: the '{cls.name}' rollout backend takes no options, got {sorted(options)}"
            )
        try:
            return cls.Config.model_validate(options)
        except ValidationError as exc:
            raise format_validation_error(
                exc, cls.Config, f"rollout backend '{cls.name}'", prefix="rollout.options."
            ) from None

    @classmethod
    def build(cls, model, tokenizer, model_path: str, config) -> "RolloutBackend":
        """Construct the backend for a run: the trainer's ``model`` and ``tokenizer``, the path the
        policy was loaded from, and the ``rollout:`` config section (its ``options`` are this
        backend's, see `parse_options`)."""
        cls.parse_options(config)
        return cls(model, tokenizer)

    def close(self) -> None:
        """Release resources."""
