"""The ``rollout:`` section of the run configuration, its keys grouped by concern.

The YAML stays flat (``rollout.max_staleness``, ``rollout.dynamic_sampling``, ...), and so does the model:
`RolloutConfig` is one pydantic model whose fields come from the concern groups below by inheritance, so every
key, error location (``rollout.tis_cap: ...``), attribute (``cfg.rollout.n``), config.yaml's ``rollout:``
mapping and the flat ``model_fields`` that the old-name and typo checks read stay as they were. Each group is a
`StrictModel` of its own: it holds its fields with their descriptions and the checks of one field; the rules
that tie keys of two concerns together (dynamic sampling needs n >= 2, asynchronous rollouts need actors and an
importance weight) sit on `RolloutConfig`, which composes the groups. A function that needs one concern only
may take the group as its parameter's type: a `RolloutConfig` is an instance of each.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, field_validator, model_validator

from oxrl_core.config_renames import OLD_ROLLOUT_OPTIONS, both_given, core_option, renamed_section
from oxrl_core.schema import StrictModel

#: rollout.tis_cap when unset in an asynchronous run (rollout.max_staleness >= 1)
ASYNC_TIS_CAP = 2.0


class RolloutSampling(StrictModel):
    """What is generated: by which backend, how many samples per prompt, how long and how random."""

    backend: str = Field("hf", description="rollout backend plugin (`hf` ships in the core)")
    n: int = Field(4, gt=0, description="samples per prompt (the group size of group-relative methods)")
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)


class RolloutUpdates(StrictModel):
    """How the trainer learns from one rollout batch: passes over it, optimiser steps per pass, micro-batches."""

    passes_per_batch: int = Field(
        1, gt=0, description="passes over each rollout batch (each pass: rollout.minibatches optimiser steps)"
    )
    minibatches: int = Field(
        1, gt=0, description="optimiser steps per pass (the rollout batch is split this many ways)"
    )
    micro_batch_size: int = Field(0, ge=0, description="sequences per forward/backward (0 = the whole minibatch)")


class RolloutPlacement(StrictModel):
    """Where the backend runs: in the training process, or in Ray actors of its own on a cluster's nodes."""

    actors: int = Field(
        0,
        ge=0,
        description="run the backend in this many Ray actors of its own, each loading the policy and synced "
        "from the trainer (0 = inside the training process)",
    )
    actor_placement: str = Field(
        "pack",
        description="where the rollout actors run on a Ray cluster: 'pack' (as few nodes as possible, starting with "
        "the node of the rank that drives them), 'spread' (one node after another) or a Ray node id (all on that "
        "node; `oxrl doctor --ray-address ...` lists them)",
    )

    @field_validator("actor_placement")
    @classmethod
    def _placement(cls, value: str) -> str:
        value = value.strip()
        if value in ("pack", "spread") or (len(value) >= 6 and all(c in "0123456789abcdef" for c in value)):
            return value
        raise ValueError(
            f"{value!r} is neither 'pack', 'spread' nor a Ray node id (hex; `oxrl doctor --ray-address ...` lists them)"
        )


class RolloutMismatch(StrictModel):
    """The gap between the backend's numerics and the trainer's: the verified weight sync, the mismatch alarm,
    and the importance weight that corrects each token for it (and, asynchronous, for an older policy)."""

    sync_check: bool = Field(
        True,
        description="verified weight sync: at the start and after every sync the backend scores a fixed probe "
        "sequence; a gap to the trainer's logprobs above sync_tolerance stops the run (needs a backend with score())",
    )
    sync_tolerance: float = Field(
        0.0,
        ge=0,
        description="largest allowed |logprob gap| on the probe, in nats; 0 = by the trainer's precision: "
        "1e-3 in float32, 1.0 under bf16 autocast (bf16 rounding alone reaches ~0.2)",
    )
    max_logprob_diff: Optional[float] = Field(
        None,
        ge=0,
        description="mismatch alarm: a step whose rollout/logprob_diff (mean |trainer − rollout| logprob of the "
        "sampled tokens) exceeds this stops the run, checkpoints kept; unset = by the trainer's precision: "
        "0.01 nats in float32, 0.25 under bf16/fp16 autocast; 0 = off",
    )
    tis_cap: Optional[float] = Field(
        None,
        ge=0,
        description="truncated importance sampling (Yao et al. 2025): each token's policy-gradient term is "
        "weighted by min(π_old/π_rollout, tis_cap) against the rollout engine's numerics and, with max_staleness, "
        "the samples' older policy; 0 = off, e.g. 2; unset = off, or 2.0 with max_staleness >= 1",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="what the importance weight does outside its range: truncate = min(w, tis_cap); mask = the "
        "token is dropped (weight 0) when w is outside [is_low, tis_cap]",
    )
    is_low: float = Field(
        0.0, ge=0, le=1, description="is_mode=mask: the lower bound of the kept importance weights (0 = none)"
    )

    @field_validator("tis_cap")
    @classmethod
    def _tis_cap(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < 1:
            raise ValueError("must be 0 (off) or at least 1: a cap below 1 scales down even on-policy tokens")
        return value


class RolloutAsync(StrictModel):
    """Which policy version a sample may come from: the on-policy check, and how many steps ahead the actors
    generate in an asynchronous run."""

    strict_on_policy: bool = Field(True, description="refuse to train on a sample generated by another policy version")
    max_staleness: int = Field(
        0,
        ge=0,
        description="asynchronous rollouts: the rollout actors generate the batches of the next k steps while the "
        "trainer trains; the batch of step s comes from policy version max(0, s-1-k), checked; 0 = one step after "
        "the other (needs rollout.actors >= 1 when above 0)",
    )


class RolloutRewardErrors(StrictModel):
    """When failing rewards stop the run."""

    max_reward_error_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="a step whose share of samples the reward failed on (raised, timed out or returned a non-number: "
        "reward/error_share) is above this counts toward stopping the run; 1 = never stop",
    )
    reward_error_steps: int = Field(
        3,
        ge=0,
        description="stop the run (checkpoints kept) after this many steps in a row over max_reward_error_share; "
        "0 = never stop",
    )


class RolloutDynamicSampling(StrictModel):
    """DAPO's dynamic sampling: groups without a learning signal dropped, and refilled."""

    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (Yu et al. 2025): drop prompt groups whose rewards are all equal (zero "
        "variance, no learning signal for group-relative advantages) and generate more prompts until the batch has "
        "train.batch_size groups (metrics sampling/*; reward/* stay the step's scheduled prompts'); only for "
        "algorithms whose signal is relative to the group (not RFT, PPO, REINFORCE++: refused, saying why)",
    )
    max_sampling_rounds: int = Field(
        4,
        ge=1,
        description="dynamic_sampling: refill rounds of train.batch_size more prompts a step may play after its own; "
        "a step still short after them is filled up with equal-reward groups (advantage 0; sampling/short = 1)",
    )


def rollout_renamed(data: Any) -> Any:
    """The ``rollout:`` mapping with its old names read as the new ones: `RENAMED_KEYS` and the old
    ``rollout.options`` mapping, flattened beside rollout.backend (an option named like one of oxRL's own rollout
    keys, or given both ways, is refused). Used by `RolloutConfig` itself and by `oxrl_core.config.rename_keys`."""
    data = renamed_section(data, "rollout")
    if not isinstance(data, dict) or "options" not in data:
        return data
    options = data.pop("options")
    if not isinstance(options, dict):
        raise ValueError(
            f"{OLD_ROLLOUT_OPTIONS} must be a mapping of the backend's options (or write them "
            f"flat under rollout:), got {type(options).__name__}"
        )
    for key, value in options.items():
        if key in RolloutConfig.model_fields:
            raise ValueError(core_option(key))
        if key in data:
            raise ValueError(both_given(f"{OLD_ROLLOUT_OPTIONS}.{key}", f"rollout.{key}"))
        data[key] = value
    return data


# The bases are listed last group first: pydantic takes the fields of the last base first, so the keys keep the
# order of the groups above (in config.yaml, in `model_fields`).
class RolloutConfig(
    RolloutDynamicSampling,
    RolloutRewardErrors,
    RolloutAsync,
    RolloutMismatch,
    RolloutPlacement,
    RolloutUpdates,
    RolloutSampling,
):
    """``backend`` picks the rollout backend plugin; any key beyond oxRL's own (the fields of the groups above)
    is that backend's own option (validated by its Config: vllm's tensor_parallel_size, dtype,
    gpu_memory_utilization, kv_cache_gb, ...; hf takes none). The old ``rollout.options: {...}`` mapping is still
    read (flattened, with a note)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """Old names given to the model directly (``RolloutConfig(epochs=2, options={...})``); see `rename_keys`."""
        return rollout_renamed(data)

    @model_validator(mode="after")
    def _dynamic_sampling(self) -> "RolloutConfig":
        if self.dynamic_sampling and self.n < 2:
            raise ValueError(
                f"rollout.dynamic_sampling needs rollout.n >= 2, got n={self.n}: a group of one sample always has "
                "equal rewards (zero variance), so every group would be dropped; set rollout.n to 2 or more"
            )
        return self

    @model_validator(mode="after")
    def _typo_of_own_key(self) -> "RolloutConfig":
        """A key beside oxRL's own is the backend's option, validated when the backend loads; one that is a near
        miss of oxRL's own rollout keys (``temprature``) is refused here, naming the key it means."""
        for key in self.model_extra or {}:
            close = difflib.get_close_matches(key, [k for k in type(self).model_fields if k != key], n=1, cutoff=0.8)
            if close:
                raise ValueError(
                    f"'{key}' is not a rollout key (did you mean '{close[0]}'?); keys other than oxRL's own "
                    f"rollout keys are the rollout backend's options"
                )
        return self

    @property
    def options(self) -> dict[str, Any]:
        """The backend's own options: the ``rollout:`` keys beyond oxRL's own (`rollout_options`)."""
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _staleness(self) -> "RolloutConfig":
        """What asynchronous rollouts (max_staleness >= 1) cannot do without, refused with the reason."""
        if self.is_low and self.is_mode != "mask":
            raise ValueError(
                "rollout.is_low is the lower bound of rollout.is_mode=mask (truncation has no lower bound)"
            )
        if self.is_mode == "mask" and not self.importance_cap:
            raise ValueError("rollout.is_mode=mask needs an importance weight: set rollout.tis_cap (e.g. 2)")
        k = self.max_staleness
        if k == 0:
            return self
        if self.actors == 0:
            raise ValueError(
                f"rollout.max_staleness={k} needs rollout.actors >= 1: without actors the rollout backend generates "
                "with the very module being trained, so generation cannot overlap training (set rollout.actors: 1)"
            )
        if self.tis_cap == 0:
            raise ValueError(
                f"rollout.tis_cap=0 with rollout.max_staleness={k}: samples up to {k} policy versions old need the "
                "importance weight that corrects for their older policy; leave tis_cap unset (2.0) or set it >= 1"
            )
        if not self.strict_on_policy:
            raise ValueError(
                f"rollout.strict_on_policy=false with rollout.max_staleness={k}: asynchronous runs check every "
                "sample's policy version against the schedule max(0, step-1-k); the check cannot be turned off"
            )
        return self

    @property
    def importance_cap(self) -> float:
        """The importance weight's cap in use: `tis_cap`, or when unset 2.0 with max_staleness >= 1, else 0 (off)."""
        if self.tis_cap is not None:
            return self.tis_cap
        return ASYNC_TIS_CAP if self.max_staleness else 0.0
