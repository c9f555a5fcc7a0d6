"""`alpaca`: Stanford Alpaca's 52k instruction-following demonstrations (``tatsu-lab/alpaca``).
Train split only: ``rows("eval")`` is empty unless ``eval_path`` is set.

Source rows: ``{"instruction", "input", "output", "text"}``; ``input`` is ``""`` for most rows, and
``text`` is the whole example in the Alpaca prompt template (not used: oxRL applies the model's
chat template instead).

oxRL rows (formats ``prompt_response`` and ``prompt``):

- ``prompt``   = ``instruction``, followed by ``"\\n\\n"`` + ``input`` when ``input`` is not blank
- ``response`` = ``output``
"""

from __future__ import annotations

from oxrl_datasets.sources import SourceConfig, SourceDataset, SourceRow, eval_split_field, hub_id_field


class Alpaca(SourceDataset):
    name = "alpaca"
    formats = ("prompt_response", "prompt")

    class Config(SourceConfig):
        """Where Alpaca is: the hub by default, or a local copy."""

        hub_id: str = hub_id_field("tatsu-lab/alpaca")
        eval_split: str = eval_split_field("")

    def map_row(self, row: SourceRow) -> dict:
        prompt = row.text("instruction")
        context = row.fields.get("input")
        if context is not None and not isinstance(context, str):
            raise row.error(f"field 'input' must be a string, got {type(context).__name__}")
        if context and context.strip():
            prompt = f"{prompt}\n\n{context}"
        return {"prompt": prompt, "response": row.text("output")}
