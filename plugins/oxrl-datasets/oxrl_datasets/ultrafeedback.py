"""`ultrafeedback_binarized`: UltraFeedback preference pairs (``HuggingFaceH4/ultrafeedback_binarized``).

Splits: ``train_prefs`` / ``test_prefs`` (the defaults, 61k / 2k pairs), ``train_sft`` /
``test_sft`` and ``train_gen`` / ``test_gen`` (set ``train_split`` / ``eval_split``).

Source rows: ``{"prompt", "prompt_id", "chosen", "rejected", "messages", "score_chosen",
"score_rejected"}``; ``chosen`` and ``rejected`` are conversations
``[{"role": "user", "content": …}, {"role": "assistant", "content": …}]`` that end with the two
competing assistant replies.

oxRL rows (formats ``preference``, ``prompt_response`` and ``prompt``):

- ``prompt``   = the ``chosen`` conversation without its final assistant message (a list of
  messages: the chat template applies, system turns included)
- ``chosen``   = the content of the final assistant message of ``chosen``
- ``rejected`` = the content of the final assistant message of ``rejected``
- ``response`` = ``chosen`` (so SFT can train on the preferred replies)
- ``prompt_id``, ``score_chosen``, ``score_rejected`` as in the source

A conversation that does not end with an assistant message is an error naming the row and field.
With ``drop_empty`` (the default) a pair whose chosen or rejected reply is blank is dropped: a
preference pair needs two replies to compare.
"""

from __future__ import annotations

from pydantic import Field

from oxrl_datasets.sources import (
    SourceConfig,
    SourceDataset,
    SourceRow,
    eval_split_field,
    hub_id_field,
    train_split_field,
)


def final_reply(row: SourceRow, name: str) -> tuple[list[dict], str]:
    """(the conversation before its final assistant message, that message's content)."""
    messages = row.messages(name)
    if messages[-1]["role"] != "assistant":
        raise row.error(f"field '{name}': the last message must have role 'assistant', not '{messages[-1]['role']}'")
    return messages[:-1], messages[-1]["content"]


class UltraFeedbackBinarized(SourceDataset):
    name = "ultrafeedback_binarized"
    formats = ("preference", "prompt_response", "prompt")

    class Config(SourceConfig):
        """Where UltraFeedback-binarized is: the hub by default, or a local copy."""

        hub_id: str = hub_id_field("HuggingFaceH4/ultrafeedback_binarized")
        train_split: str = train_split_field("train_prefs")
        eval_split: str = eval_split_field("test_prefs")
        drop_empty: bool = Field(True, description="drop pairs whose chosen or rejected reply is blank")

    def map_row(self, row: SourceRow) -> dict | None:
        prompt, chosen = final_reply(row, "chosen")
        _, rejected = final_reply(row, "rejected")
        if not prompt:
            raise row.error("field 'chosen': no message before the final assistant reply")
        if self.config.drop_empty and not (chosen.strip() and rejected.strip()):
            return None
        extra = {key: row.fields[key] for key in ("prompt_id", "score_chosen", "score_rejected") if key in row.fields}
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "response": chosen, **extra}
