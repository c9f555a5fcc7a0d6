"""`hh_rlhf`: Anthropic's helpful/harmless preference pairs (``Anthropic/hh-rlhf``; train 161k /
test 8.6k over all parts; ``data_dir`` reads one part: ``harmless-base``, ``helpful-base``,
``helpful-online``, ``helpful-rejection-sampled``).

Source rows: ``{"chosen", "rejected"}``, each a whole transcript
``"\\n\\nHuman: …\\n\\nAssistant: …\\n\\nHuman: …\\n\\nAssistant: …"``; the two share every turn
but the last.

Parsing: the transcript is split at each ``Human:`` / ``Assistant:`` that starts the text or
follows a blank line; ``Human`` turns become ``user`` messages, ``Assistant`` turns ``assistant``
messages, each content stripped of surrounding whitespace. A transcript that does not start with a
Human turn or does not end with an Assistant turn is an error naming the dataset, row and field.

oxRL rows (formats ``preference``, ``prompt_response`` and ``prompt``):

- ``prompt``   = the ``chosen`` conversation before its final assistant turn (a list of messages)
- ``chosen``   = the final assistant turn of ``chosen``
- ``rejected`` = the final assistant turn of ``rejected``
- ``response`` = ``chosen``

With ``drop_empty`` (the default) a pair whose chosen or rejected final turn is blank (a few
hh-rlhf transcripts end with an empty ``Assistant:``) is dropped.
"""

from __future__ import annotations

import re

from pydantic import Field

from oxrl_datasets.sources import SourceConfig, SourceDataset, SourceRow, hub_id_field

TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):")
ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_transcript(text: str) -> list[dict] | None:
    """``"\\n\\nHuman: a\\n\\nAssistant: b"`` -> user/assistant messages; None when it does not parse."""
    pieces = TURN.split(text)  # [before, role, content, role, content, ...]
    if pieces[0].strip() or len(pieces) < 5:
        return None
    messages = [{"role": ROLES[role], "content": content.strip()} for role, content in zip(pieces[1::2], pieces[2::2])]
    if messages[0]["role"] != "user" or messages[-1]["role"] != "assistant":
        return None
    return messages


def conversation(row: SourceRow, name: str) -> list[dict]:
    messages = parse_transcript(row.text(name))
    if messages is None:
        raise row.error(
            f"field '{name}' does not parse as a '\\n\\nHuman: …\\n\\nAssistant: …' transcript "
            "that starts with a Human turn and ends with an Assistant turn"
        )
    return messages


class HHRLHF(SourceDataset):
    name = "hh_rlhf"
    formats = ("preference", "prompt_response", "prompt")

    class Config(SourceConfig):
        """Where hh-rlhf is: the hub by default (all parts, or the one in `data_dir`), or a local copy."""

        hub_id: str = hub_id_field("Anthropic/hh-rlhf")
        drop_empty: bool = Field(True, description="drop pairs whose chosen or rejected final turn is blank")

    def map_row(self, row: SourceRow) -> dict | None:
        chosen, rejected = conversation(row, "chosen"), conversation(row, "rejected")
        reply_chosen, reply_rejected = chosen[-1]["content"], rejected[-1]["content"]
        if self.config.drop_empty and not (reply_chosen and reply_rejected):
            return None
        return {"prompt": chosen[:-1], "chosen": reply_chosen, "rejected": reply_rejected, "response": reply_chosen}
