"""`hf`: any `datasets` dataset or local file, with its columns mapped to oxRL's fields.

Options: ``hub_id`` or ``path`` (one is required), ``subset``, ``data_dir``, ``train_split``
(default ``train``), ``eval_split`` (default empty: no eval split; set it, e.g. to ``test``, to hold
one out), ``eval_path``, and ``fields``: oxRL field -> source column, e.g.
``{prompt: question, response: answer}``.

oxRL rows: every source column as it is, plus each mapped field set to its column's value
(``row[field] = source[column]``; a mapped field replaces a source column of the same name). So
unmapped columns (e.g. ``answer``) still reach the rewards. A mapped column missing from a row is
an error naming the row and the column. Whether the rows fit the algorithm's format
(``prompt``, ``prompt_response``, ``text``, ``preference``, ``unpaired``) is checked by the core.

    data:
      train: {source: hf, hub_id: openai/gsm8k, subset: main, fields: {prompt: question}}
"""

from __future__ import annotations

from pydantic import Field, model_validator

from oxrl_datasets.sources import SourceConfig, SourceDataset, SourceRow, eval_split_field


class MappedDataset(SourceDataset):
    name = "hf"
    formats = ("prompt", "prompt_response", "text", "preference", "unpaired")

    class Config(SourceConfig):
        """A hub dataset or local copy, and how its columns map to oxRL's fields."""

        eval_split: str = eval_split_field("")
        fields: dict[str, str] = Field(
            default_factory=dict,
            description="oxRL field -> source column, e.g. {prompt: question, response: answer}; "
            "every source column is kept as well",
        )

        @model_validator(mode="after")
        def _has_source(self):
            if not (self.path or self.hub_id):
                raise ValueError("set `path` (a local file or directory) or `hub_id` (a hub dataset)")
            return self

    def map_row(self, row: SourceRow) -> dict:
        mapped = {key: value for key, value in row.fields.items() if key != "_row"}
        for field, column in self.config.fields.items():
            if row.fields.get(column) is None:
                raise row.error(f"missing field '{column}' (mapped to '{field}' by `fields`)")
            mapped[field] = row.fields[column]
        return mapped
