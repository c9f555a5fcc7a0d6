"""`math`: the MATH competition problems of Hendrycks et al. (2021) (``EleutherAI/hendrycks_math``;
train 7,500 / test 5,000).

The hub id: the original ``hendrycks/competition_math`` is no longer downloadable; EleutherAI's
copy (the one lm-evaluation-harness reads) holds the same rows as Parquet, one config per subject
(``algebra``, ``counting_and_probability``, ``geometry``, ``intermediate_algebra``,
``number_theory``, ``prealgebra``, ``precalculus``). ``subset: all`` (the default) reads the seven
and concatenates them in that order; a subject name reads one. For a mirror that keeps every
subject in one config, set ``hub_id`` and ``subset`` (e.g. ``subset: default``, or ``""`` for a
dataset with a single config).

Source rows: ``{"problem", "level", "type", "solution"}`` (``"level": "Level 3"``,
``"type": "Algebra"``); the solution's final answer is in its last ``\\boxed{…}``.

oxRL rows (formats ``prompt`` and ``prompt_response``):

- ``prompt``   = ``problem``
- ``response`` = ``solution``
- ``answer``   = the content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) of the solution, braces
  balanced (``\\boxed{\\frac{1}{9}}`` -> ``\\frac{1}{9}``); a solution without one is an error
- ``level``, ``type`` as in the source

``verify``: math-verify equivalence of the completion's final answer (its last ``\\boxed`` when it
has one) and ``answer``, as the ``math`` reward of oxrl-rewards checks it.
"""

from __future__ import annotations

from oxrl_core import last_boxed, math_equivalent
from oxrl_datasets.sources import SourceConfig, SourceDataset, SourceRow, hub_id_field, subset_field

SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


class HendrycksMath(SourceDataset):
    name = "math"
    formats = ("prompt", "prompt_response")

    class Config(SourceConfig):
        """Where MATH is: the hub by default (all seven subjects), or a local copy."""

        hub_id: str = hub_id_field("EleutherAI/hendrycks_math")
        subset: str = subset_field("all")

    def subsets(self) -> list[str]:
        return list(SUBJECTS) if self.config.subset == "all" else [self.config.subset]

    def map_row(self, row: SourceRow) -> dict:
        solution = row.text("solution")
        answer = last_boxed(solution)
        if answer is None:
            raise row.error("field 'solution' has no \\boxed{...} final answer (or its braces do not balance)")
        return {
            "prompt": row.text("problem"),
            "response": solution,
            "answer": answer,
            "level": row.text("level"),
            "type": row.text("type"),
        }

    def verify(self, completion: str, row: dict) -> bool | None:
        gold = row.get("answer")
        return None if gold is None else math_equivalent(completion, str(gold))
