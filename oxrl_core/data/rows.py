"""Rows checked against the format the algorithm consumes, completely, when the data loads.

The row formats are listed in ``docs/architecture.md``. A bad row is an `OxrlError` naming the file, the row number
(1-based; the line number for JSONL) and the field; it is never found first when a row is batched or sampled.
"""

from __future__ import annotations

import json

from oxrl_core.errors import OxrlError

# ----------------------------------------------------------------------------- validation

REQUIRED = {
    "prompt": ("prompt",),
    "prompt_response": ("prompt", "response"),
    "text": ("text",),
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
}
#: completions that must not be empty (compared or judged, an empty one says nothing; an empty SFT
#: response teaches the model to answer nothing, which is almost always a broken field mapping)
COMPLETIONS = {"preference": ("chosen", "rejected"), "unpaired": ("completion",), "prompt_response": ("response",)}


def _check_messages(value, where: str, field: str) -> None:
    if not isinstance(value, list) or not value:
        raise OxrlError(f"{where}: field '{field}' must be a non-empty list of {{role, content}} messages")
    for j, msg in enumerate(value):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(content, (str, list)):
            raise OxrlError(
                f"{where}: field '{field}[{j}]' must be an object with string 'role' and 'content' (a string, or a "
                'list of {"type": "text", "text": ...} / {"type": "image"} parts)'
            )


def row_where(row: dict, origin: str) -> str:
    """``file: row N`` (1-based; the line number for JSONL) for messages about one row."""
    return f"{row.get('_origin', origin)}: row {row.get('_row', '?')}"


#: the roles a multi-turn conversation may use (`check_conversation`)
ROLES = ("system", "user", "assistant", "tool")


def is_multi_turn(messages) -> bool:
    """True for a ``messages`` list that one prompt and one response cannot hold: several assistant turns,
    an assistant message with ``tool_calls``, or a ``tool`` message. Such a row is trained on every assistant
    turn (`tokenise_messages`); any other ``messages`` row is a prompt (all but the last message) and a response."""
    if not isinstance(messages, list):
        return False
    assistants = 0
    for msg in messages:
        if isinstance(msg, dict):
            if msg.get("role") == "tool" or msg.get("tool_calls"):
                return True
            assistants += msg.get("role") == "assistant"
    return assistants > 1


TOOL_CALL_SHAPE = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'


def _check_tool_calls(calls, where: str, field: str) -> list[dict]:
    """An assistant message's ``tool_calls`` checked; ``arguments`` given as a JSON string become the object it
    encodes (chat templates expect an object: most write it with ``tojson``, which would quote a string again)."""
    if not isinstance(calls, list):
        raise OxrlError(f"{where}: field '{field}' must be a list of {TOOL_CALL_SHAPE}, got {type(calls).__name__}")
    checked = []
    for k, call in enumerate(calls):
        here = f"{field}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise OxrlError(f"{where}: field '{here}' must be an object {TOOL_CALL_SHAPE}")
        if call.get("type", "function") != "function":
            raise OxrlError(f"{where}: field '{here}.type' must be 'function', got {call['type']!r}")
        if not isinstance(function.get("name"), str) or not function["name"].strip():
            raise OxrlError(f"{where}: field '{here}.function.name' must be a non-empty string")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise OxrlError(
                    f"{where}: field '{here}.function.arguments' is a string but not JSON ({exc.msg}, column "
                    f"{exc.colno}); give an object or a JSON string of one"
                ) from None
        if not isinstance(arguments, dict):
            raise OxrlError(
                f"{where}: field '{here}.function.arguments' must be an object (or a JSON string of one), "
                f"got {type(arguments).__name__}"
            )
        checked.append({**call, "function": {**function, "arguments": arguments}})
    return checked


def check_conversation(messages: list, where: str) -> list[dict]:
    """A multi-turn ``messages`` list (`is_multi_turn`) checked and ready for a chat template.

    Roles are ``system``, ``user``, ``assistant`` or ``tool``; every message has string ``content``, except an
    assistant message with ``tool_calls`` (a list of `TOOL_CALL_SHAPE`), whose content may be empty or absent;
    an assistant message without calls needs content; the last message is the assistant's and at least one
    message comes before the first. A field that is null counts as absent (Parquet files and `datasets` give
    every message every field). Errors name ``where`` (the file and row) and the field."""
    checked = []
    for j, msg in enumerate(messages):
        field = f"messages[{j}]"
        if not isinstance(msg, dict):
            raise OxrlError(f"{where}: field '{field}' must be an object with 'role' and 'content'")
        msg = {key: value for key, value in msg.items() if value is not None}
        role = msg.get("role")
        if role not in ROLES:
            raise OxrlError(f"{where}: field '{field}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        calls = msg.pop("tool_calls", [])
        if calls != []:
            if role != "assistant":
                raise OxrlError(f"{where}: field '{field}.tool_calls': only assistant messages make tool calls")
            msg["tool_calls"] = _check_tool_calls(calls, where, f"{field}.tool_calls")
            msg.setdefault("content", "")
        if not isinstance(msg.get("content"), str):
            raise OxrlError(
                f"{where}: field '{field}.content' must be a string ({role} message), "
                f"got {type(msg.get('content')).__name__}"
            )
        if role == "assistant" and "tool_calls" not in msg and not msg["content"].strip():
            raise OxrlError(f"{where}: field '{field}': an assistant message needs content or tool_calls")
        if not isinstance(msg.get("name", ""), str):
            raise OxrlError(f"{where}: field '{field}.name' must be a string, got {type(msg['name']).__name__}")
        checked.append(msg)
    if checked[-1]["role"] != "assistant":
        raise OxrlError(f"{where}: field 'messages': the last message must have role 'assistant'")
    if checked[0]["role"] == "assistant":
        raise OxrlError(f"{where}: field 'messages': needs at least one message before the first assistant's")
    return checked


def normalise_row(row: dict, fmt: str, origin: str) -> dict:
    """Check `row` against `fmt`; return it with `prompt` (str or messages) and the format's fields.

    A multi-turn ``messages`` row (`is_multi_turn`) is returned with its checked ``messages`` and no ``prompt``:
    it is trained on every assistant turn (`tokenise_messages`)."""
    where = row_where(row, origin)
    if fmt == "prompt_response" and "messages" in row and "prompt" not in row:
        msgs = row["messages"]
        if is_multi_turn(msgs):
            return {**row, "messages": check_conversation(msgs, where)}
        _check_messages(msgs, where, "messages")
        if msgs[-1]["role"] != "assistant":
            raise OxrlError(f"{where}: field 'messages': the last message must have role 'assistant'")
        if len(msgs) < 2:
            raise OxrlError(f"{where}: field 'messages': needs at least one message before the assistant's")
        row = {**row, "prompt": msgs[:-1], "response": msgs[-1]["content"]}
    for field in REQUIRED[fmt]:
        if field not in row or row[field] is None:
            raise OxrlError(f"{where}: missing field '{field}' (format '{fmt}' needs {', '.join(REQUIRED[fmt])})")
    if "prompt" in REQUIRED[fmt]:
        if isinstance(row["prompt"], list):
            _check_messages(row["prompt"], where, "prompt")
        elif not isinstance(row["prompt"], str):
            raise OxrlError(
                f"{where}: field 'prompt' must be a string or a list of messages, got {type(row['prompt']).__name__}"
            )
    for field in REQUIRED[fmt]:
        if field in ("prompt", "label"):
            continue
        if not isinstance(row[field], str):
            raise OxrlError(f"{where}: field '{field}' must be a string, got {type(row[field]).__name__}")
    if fmt == "unpaired" and isinstance(row["label"], str) and row["label"].strip().lower() in ("true", "false"):
        row = {**row, "label": row["label"].strip().lower() == "true"}  # a CSV cell is text
    if fmt == "unpaired" and not isinstance(row["label"], bool):
        raise OxrlError(f"{where}: field 'label' must be true or false, got {row['label']!r}")
    for field in COMPLETIONS.get(fmt, ()):
        if not row[field].strip():
            raise OxrlError(f"{where}: field '{field}' is empty (a completion needs at least one token besides EOS)")
    return row
