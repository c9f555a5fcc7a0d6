"""`gsm8k`: grade-school maths word problems (``openai/gsm8k``, subset ``main``; train 7,473 / test 1,319).

Source rows: ``{"question", "answer"}``, the answer being worked reasoning with calculator
annotations and the final number after ``####`` (``"…48/2 = <<48/2=24>>24 clips…\\n#### 72"``).

oxRL rows (formats ``prompt`` and ``prompt_response``):

- ``prompt``   = ``question``
- ``response`` = ``answer``, the full text (reasoning and ``#### 72``)
- ``answer``   = the number after the last ``####``, thousands commas removed (``"72"``)

``verify``: the completion's number — the first after its last ``####`` when it has one, else its
last number — equals ``answer`` numerically (``$1,234.00`` = ``1234``).
"""

from __future__ import annotations

from oxrl_core import gsm8k_answer, numbers_equal
from oxrl_datasets.sources import SourceConfig, SourceDataset, SourceRow, hub_id_field, subset_field


class GSM8K(SourceDataset):
    name = "gsm8k"
    formats = ("prompt", "prompt_response")

    class Config(SourceConfig):
        """Where GSM8K is: the hub by default, or a local copy."""

        hub_id: str = hub_id_field("openai/gsm8k")
        subset: str = subset_field("main")

    def map_row(self, row: SourceRow) -> dict:
        question, solution = row.text("question"), row.text("answer")
        final = gsm8k_answer(solution)
        if final is None:
            raise row.error("field 'answer' does not end with '#### <number>'")
        return {"prompt": question, "response": solution, "answer": final}

    def verify(self, completion: str, row: dict) -> bool | None:
        gold = row.get("answer")
        return None if gold is None else numbers_equal(completion, str(gold))
