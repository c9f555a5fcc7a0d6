"""The algorithm contract: `Algorithm`, what a post-training method declares and implements, and `PolicyGradient`,
the options every group-based RL algorithm shares. What a reader of one training step needs, apart from the other
plugin contracts (`Reward`, `Dataset`, `RolloutBackend`, `Environment`: `oxrl_core.interfaces`, which re-exports
every name here: plugins import them from there).

The batches the loops hand an algorithm (one `TypedDict` per kind, one key per line with its shape) are in
`oxrl_core.batches`. Shapes: B = rows (RL: prompts × n samples, the n samples of one prompt contiguous), T = token
positions, V = vocabulary size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from oxrl_core.batches import RLAdvantagesBatch
from oxrl_core.schema import StrictModel

if TYPE_CHECKING:  # torch stays out of discovery
    import torch

#: the loop that trains an algorithm (`Algorithm.loop`)
Loop = Literal["supervised", "preference", "rl"]
#: the old name of `Loop` (from the deprecated ``Algorithm.family``), kept for plugins that import it
Family = Loop
DataFormat = Literal["prompt", "prompt_response", "text", "preference", "unpaired"]
#: `PolicyGradient.Config.loss_agg`: how per-token loss terms become one loss (`oxrl_core.ops.aggregate_loss`)
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
#: `PolicyGradient.Config.kl_estimator` (`oxrl_core.ops.kl_estimate`)
KLEstimator = Literal["k1", "k2", "k3"]


class Algorithm(ABC):
    """The maths of one post-training method, and nothing else.

    An algorithm declares what it needs (the class flags below) and turns tensors into a loss. Its
    ``loop`` does the forward passes (policy, reference, teacher, critic) and hands the results over
    in ``batch``; no distributed code, device juggling or I/O belongs in an algorithm. What ``batch``
    holds, by loop:

    - supervised (`SupervisedBatch`): per-token ``logp`` of the labels, optionally ``logp_mean``
      (`uses_logp_mean`) and ``kl_teacher`` (``needs_teacher``, at τ = `distill_temperature`);
    - RL (``loop = "rl"``): `advantages` gets an `RLAdvantagesBatch` and returns tensors to add
      to it (usually ``adv`` (B, T)) and metrics; `loss` then gets minibatches of all of that plus
      the current policy's terms (`RLLossBatch`); ``tis_weight`` multiplies each token's
      policy-gradient term;
    - preference: per-sequence sums over completion tokens, `PairedPreferenceBatch` or
      `UnpairedPreferenceBatch` by data format, `ScoreBatch` with ``head = "score"``.
    """

    # Class flags: what the algorithm declares, and who reads each (plugins.py checks every flag's type
    # when the plugin loads).
    #
    #   flag            default   meaning                                           read by
    #   --------------  --------  ------------------------------------------------  ---------------------------
    #   name            required  the registered name                               registry, logs
    #   loop            required  "supervised" | "preference" | "rl": the loop      trainer: the loop, engine
    #                             that trains it; "rl" = on its own generations     checks, tiny-model defaults;
    #                             (RL, and RFT, online DPO whatever their kind)     launcher: the warm start
    #   data_format     required  the row format loaded (`Dataset.formats` of the   supervised, preference loops
    #                             sources must include it)
    #   needs_ref       False     the reference policy's logprobs are provided      `uses_ref()` (RL, preference)
    #   needs_teacher   False     a teacher is loaded, ``kl_teacher`` computed      supervised loop
    #   needs_critic    False     a critic V(s_t) (`critic_layout`); ``values``     RL loop
    #                             and ``values_new`` are provided
    #   loss_weighting  "tokens"  micro-batches weighted by loss tokens (a token    supervised, RL loops (the
    #                             mean over the optimiser batch) or "sequences"     preference loop weights rows)
    #   min_group_size  1         samples per prompt the maths needs                RL loop: refuses rollout.n below
    #   default_reward  ""        the reward when reward.name is empty ("" = the    RL loop
    #                             dataset plugin's own check)
    #   loss_on_groups  False     minibatches hold whole groups, in order           RL loop
    #   head            "lm"      next-token logits, or "score": one scalar per     preference loop, run skeleton
    #                             sequence (AutoModelForSequenceClassification,
    #                             saved as such in final/)
    #   self_play       False     each prompt_response row's rejected response is   preference loop
    #                             generated by the reference, which becomes a copy
    #                             of the policy at each of `iterations()` parts
    #   rollout_defaults {}       ``rollout.*`` values the method is meant to run   config (under the user's
    #                             with (e.g. several updates per batch), applied    settings; the banner names
    #                             under the user's settings                         them)
    #   tiny_defaults   {}        config sections that suit the built-in tiny       trainer (under the user's
    #                             model, over the loop's own (``{"train":           settings, model.name empty)
    #                             {"lr": 1e-4}}``)
    #   group_relative  False     a prompt group whose rewards are all equal        trainer: refuses
    #                             carries no signal (advantages relative to the     rollout.dynamic_sampling
    #                             group, or pairs within it)                        without it, saying
    #   signal_note     ""        without group_relative: where the signal comes    ``signal_note``
    #                             from (why an equal-reward group still trains)

    #
    #   A plugin class that still declares the old ``family`` / ``needs_rollouts`` (needs_rollouts = True ran
    #   the RL loop whatever the family) keeps working: `__init_subclass__` derives ``loop`` from them and
    #   records them in ``_deprecated_flags``; the run prints `plugins.deprecation_note` once.

    name: ClassVar[str]
    loop: ClassVar[Loop]
    data_format: ClassVar[DataFormat]
    needs_ref: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = False
    loss_weighting: ClassVar[Literal["tokens", "sequences"]] = "tokens"
    min_group_size: ClassVar[int] = 1
    default_reward: ClassVar[str] = ""
    loss_on_groups: ClassVar[bool] = False
    head: ClassVar[Literal["lm", "score"]] = "lm"
    self_play: ClassVar[bool] = False
    rollout_defaults: ClassVar[dict] = {}
    tiny_defaults: ClassVar[dict] = {}
    group_relative: ClassVar[bool] = False
    signal_note: ClassVar[str] = ""

    #: the deprecated flags (``family``, ``needs_rollouts``) the class declares instead of ``loop``
    _deprecated_flags: ClassVar[tuple[str, ...]] = ()

    class Config(StrictModel):
        """The algorithm's own hyper-parameters (the ``alg:`` section)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """``loop`` from the old flags of a class that declares them instead: ``needs_rollouts = True`` ran the
        RL loop, otherwise ``family`` named the loop (an invalid value is reported when the plugin loads)."""
        super().__init_subclass__(**kwargs)
        own = [flag for flag in ("family", "needs_rollouts") if flag in vars(cls)]
        if not own:
            return
        cls._deprecated_flags = tuple(own)
        if "loop" in vars(cls):
            return
        if getattr(cls, "needs_rollouts", False) is True:
            cls.loop = "rl"
        elif hasattr(cls, "family"):
            cls.loop = cls.family

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

    def critic_layout(self) -> Literal["shared", "separate"]:
        """RL with ``needs_critic``: where the critic's value head sits (`oxrl_core.models.critic`):
        ``shared``, on the policy's own last hidden state, or ``separate``, on its own copy of the
        initial policy's backbone. Default: the algorithm config's ``critic`` option when it has
        one (PPO's ``alg.critic``), else ``shared``."""
        return getattr(self.config, "critic", "shared")

    def advantages(self, batch: RLAdvantagesBatch) -> tuple[dict[str, "torch.Tensor"], dict[str, float]]:
        """RL only: per-token tensors to add to the rollout batch (usually ``adv`` (B, T)), and metrics."""
        raise NotImplementedError(f"{type(self).__name__} runs in the RL loop but does not define advantages()")

    @abstractmethod
    def loss(self, batch: dict[str, "torch.Tensor"]) -> tuple["torch.Tensor", dict[str, "torch.Tensor | float"]]:
        """Return the scalar loss and detached metrics (names like ``loss/ce``). ``batch`` is one of
        the batch types above, by loop (an algorithm may annotate it so)."""


class PolicyGradient(Algorithm):
    """The options every group-based RL algorithm shares (SGRPO, CISPO, GSPO, RLOO, REINFORCE++, ...), each
    default equal to the plain objective. The maths is in `oxrl_core.ops` (`shaped_rewards` before the
    advantages, `policy_objective` around the algorithm's own per-token policy term); a subclass's ``Config``
    derives from ``PolicyGradient.Config`` and may change the defaults.

    ``loss_agg`` decides how the loop weights micro-batches: by completion tokens for ``token-mean``, by
    sequences for the others (`ops.aggregate_loss`), so a split batch gives the whole batch's loss.
    """

    loop = "rl"
    data_format = "prompt"

    class Config(StrictModel):
        kl_coeff: float = Field(
            0.0, ge=0, description="β: weight of the KL to the reference model (0 = no reference model)"
        )
        kl_estimator: KLEstimator = Field(
            "k3",
            description="per-token KL estimator: k1 = log π − log π_ref, k2 = ½(log π − log π_ref)², "
            "k3 = exp(Δ) − Δ − 1 (Schulman 2020)",
        )
        kl_in_reward: bool = Field(
            False, description="subtract β·KL from the reward (at the sampling policy) instead of adding it to the loss"
        )
        entropy_coeff: float = Field(0.0, ge=0, description="c_H: weight of the entropy bonus in the loss")
        loss_agg: LossAggregation = Field(
            "token-mean",
            description="how per-token terms become the loss: token-mean (DAPO), seq-mean-token-mean (GRPO), "
            "seq-mean-token-sum, seq-mean-token-sum-norm (÷ rollout.max_new_tokens: Dr. GRPO)",
        )
        overlong_buffer: int = Field(
            0,
            ge=0,
            description="DAPO's overlong shaping: the last this many tokens before rollout.max_new_tokens "
            "cost reward linearly, up to overlong_penalty at the limit (0 = off)",
        )
        overlong_penalty: float = Field(1.0, ge=0, description="the reward lost at rollout.max_new_tokens")

    def __init__(self, config: "PolicyGradient.Config | None" = None):
        super().__init__(config)
        self.loss_weighting = "tokens" if self.config.loss_agg == "token-mean" else "sequences"

    def uses_ref(self) -> bool:
        return self.config.kl_coeff > 0
