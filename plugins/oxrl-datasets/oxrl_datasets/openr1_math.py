"""`openr1_math`: NuminaMath 1.5 problems with DeepSeek-R1 traces (``open-r1/OpenR1-Math-220k``,
subset ``default``, 94k rows; ``extended`` and ``all`` are the other configs). Train split only:
``rows("eval")`` is empty unless ``eval_path`` is set.

Source rows: ``problem``, ``solution`` (the reference solution), ``answer``, ``problem_type``
(``"Algebra"``…), ``question_type`` (``"math-word-problem"``, ``"MCQ"``, ``"proof"``), ``source``,
``uuid``, ``is_reasoning_complete``, ``generations`` (the R1 traces), ``correctness_math_verify``,
``correctness_llama``, ``finish_reasons``, ``correctness_count``, ``messages``.

oxRL rows (formats ``prompt`` and ``prompt_response``):

- ``prompt``   = ``problem``
- ``response`` = ``solution``
- ``answer``   = ``answer``
- ``problem_type``, ``question_type``, ``source``, ``uuid``, ``correctness_count`` as in the source
  (when present). The traces (``generations``, ``messages``) and the per-trace lists are not
  carried: they are most of the dataset's size, and no oxRL format reads them.

``verify``: math-verify equivalence of the completion's final answer (its last ``\\boxed`` when it
has one) and ``answer``, as the ``math`` reward of oxrl-rewards checks it.
"""

from __future__ import annotations

from oxrl_core import math_equivalent
from oxrl_datasets.sources import (
    SourceConfig,
    SourceDataset,
    SourceRow,
    eval_split_field,
    hub_id_field,
    subset_field,
)

METADATA = ("problem_type", "question_type", "source", "uuid", "correctness_count")


class OpenR1Math(SourceDataset):
    name = "openr1_math"
    formats = ("prompt", "prompt_response")
    source_columns = ("problem", "solution", "answer", *METADATA)

    class Config(SourceConfig):
        """Where OpenR1-Math-220k is: the hub by default, or a local copy."""

        hub_id: str = hub_id_field("open-r1/OpenR1-Math-220k")
        subset: str = subset_field("default")
        eval_split: str = eval_split_field("")

    def map_row(self, row: SourceRow) -> dict:
        mapped = {"prompt": row.text("problem"), "response": row.text("solution"), "answer": row.text("answer")}
        mapped.update({key: row.fields[key] for key in METADATA if row.fields.get(key) is not None})
        return mapped

    def verify(self, completion: str, row: dict) -> bool | None:
        gold = row.get("answer")
        return None if gold is None else math_equivalent(completion, str(gold))
