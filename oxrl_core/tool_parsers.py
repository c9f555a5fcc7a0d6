"""Reading tool calls out of a model's turn (multi-turn RL with tools, ``env.tool_parser``).

A `ToolParser` turns the text of one assistant turn into a `ParsedTurn`: the text without the tool-call
markup, the well-formed calls in order, and one message per malformed call (bad JSON, no name, arguments
that are not an object), which the environment shows to the model as that call's tool error. A parser
never raises on what a model wrote. ``format`` writes calls back as the exact text ``parse`` reads, so
``parse(format(calls)).calls == calls`` (SFT transcripts, tests); JSON is written the way the
transformers chat-template filter ``tojson`` writes it (``json.dumps`` with default separators and
``ensure_ascii=False``), so a chat template that renders calls with ``tojson`` renders the same text.

Built-in parsers (`PARSERS`):

- ``hermes`` (Qwen2.5 / Qwen3 / Hermes / ChatML): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the turn;
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole turn, optionally after ``<|python_tag|>``,
  is ``{"name": ..., "parameters": {...}}``, or several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name": ..., "arguments": {...}}``.

`parser_for` picks one by the tokenizer's chat template, by name, or by import path
(``package.module:Class`` / ``path/to/file.py:Class``, a `ToolParser` subclass): the way to plug in a
model's own format.
"""

from __future__ import annotations

import importlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from oxrl_core.errors import OxrlError
from oxrl_core.user_code import import_file

#: how much of a malformed call an error message quotes
QUOTE_CHARS = 120


@dataclass
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedTurn:
    """One assistant turn read by a `ToolParser`."""

    #: the assistant's text with the tool-call markup removed (stripped)
    content: str
    #: the well-formed calls, in order
    calls: list[ToolCall] = field(default_factory=list)
    #: one human-readable message per malformed call, meant to be shown to the model as a tool error
    errors: list[str] = field(default_factory=list)


class ToolParser(ABC):
    """Reads the tool calls of one model turn (`parse`) and writes calls as the model would (`format`)."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The turn's content, well-formed calls and one error message per malformed call; never raises."""

    @abstractmethod
    def format(self, calls: list[ToolCall]) -> str:
        """The exact text `parse` reads back as ``calls`` (``""`` for no calls)."""


def dumps(obj: Any) -> str:
    """JSON as transformers' chat-template ``tojson`` writes it: default separators, non-ASCII kept."""
    return json.dumps(obj, ensure_ascii=False)


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


def _json_error(number: int, exc: json.JSONDecodeError, text: str) -> str:
    return f"tool call {number} is not valid JSON ({exc.msg} at character {exc.pos + 1}): {_quote(text)}"


def _call_from(number: int, obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A decoded call -> a `ToolCall`, or the message saying what is wrong with it."""
    shape = '{"name": ..., "' + argument_keys[0] + '": {...}}'
    if not isinstance(obj, dict):
        return f"tool call {number} must be a JSON object {shape}, got {type(obj).__name__} {_quote(dumps(obj))}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'tool call {number} has no "name" (a non-empty string): {_quote(dumps(obj))}'
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if not isinstance(arguments, dict):
        return (
            f'tool call {number} ({name}): "{key}" must be a JSON object of argument names to values, '
            f"got {type(arguments).__name__} {_quote(dumps(arguments))}"
        )
    return ToolCall(name, arguments)


def _collect(turn: ParsedTurn, result: ToolCall | str) -> None:
    if isinstance(result, ToolCall):
        turn.calls.append(result)
    else:
        turn.errors.append(result)


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes, ChatML).

    Whitespace around the JSON is allowed; a last block left open (generation stopped at
    ``</tool_call>``, which stop strings drop) is read as if closed."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(content="")
        pieces, last = [], 0
        for number, match in enumerate(self._BLOCK.finditer(text), 1):
            pieces.append(text[last : match.start()])
            last = match.end()
            body = match.group(1)
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                turn.errors.append(_json_error(number, exc, body))
                continue
            _collect(turn, _call_from(number, obj, ("arguments",)))
        pieces.append(text[last:])
        turn.content = "".join(pieces).strip()
        return turn

    def format(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{self.OPEN}{dumps({'name': c.name, 'arguments': c.arguments})}{self.CLOSE}" for c in calls)


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: the whole turn (optionally after ``<|python_tag|>``) is
    ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is accepted too), or several separated by ``;``.

    A turn that does not start with ``{`` is plain content. One that does but is not JSON is a malformed
    call; text after the last call that does not continue with ``;`` is content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ParsedTurn(content=text.strip())
        turn = ParsedTurn(content="")
        decoder, pos, number = json.JSONDecoder(), 0, 0
        while True:
            number += 1
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                turn.errors.append(_json_error(number, exc, body[pos:]))
                return turn
            _collect(turn, _call_from(number, obj, ("parameters", "arguments")))
            rest = body[end:].lstrip()
            if not rest.startswith(";"):
                turn.content = rest.strip()
                return turn
            rest = rest[1:].lstrip()
            if not rest:  # a trailing ";"
                return turn
            pos = len(body) - len(rest)

    def format(self, calls: list[ToolCall]) -> str:
        return "; ".join(dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list of ``{"name": ..., "arguments": {...}}`` (a single object is
    taken as a list of one); text before it, and after the list, is content."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(content="")
        decoder, pieces, pos, number = json.JSONDecoder(), [], 0, 0
        while (start := text.find(self.TAG, pos)) >= 0:
            pieces.append(text[pos:start])
            pos = start + len(self.TAG)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                number += 1
                turn.errors.append(_json_error(number, exc, text[pos:]))
                following = text.find(self.TAG, pos)  # the rest of a broken list is markup, not content
                pos = following if following >= 0 else len(text)
                continue
            for item in obj if isinstance(obj, list) else [obj]:
                number += 1
                _collect(turn, _call_from(number, item, ("arguments",)))
        pieces.append(text[pos:])
        turn.content = "\n".join(p.strip() for p in pieces if p.strip())
        return turn

    def format(self, calls: list[ToolCall]) -> str:
        if not calls:
            return ""
        return self.TAG + dumps([{"name": c.name, "arguments": c.arguments} for c in calls])


#: the built-in parsers by name
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}

#: chat-template text that marks a family's tool-call format (checked in this order; otherwise hermes)
_TEMPLATE_MARKS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("[TOOL_CALLS]", "[INST]"), "mistral"),
    (("<|start_header_id|>", "<|python_tag|>"), "llama3_json"),
)


def _template_text(tokenizer_or_template: Any) -> str:
    """The chat template's text: a string as is, a tokenizer's ``chat_template`` (every named one of a dict)."""
    template = (
        tokenizer_or_template
        if tokenizer_or_template is None or isinstance(tokenizer_or_template, (str, dict))
        else getattr(tokenizer_or_template, "chat_template", None)
    )
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def detect(tokenizer_or_template: Any) -> str:
    """The built-in parser's name for a chat template (or a tokenizer's): mistral, llama3_json, else hermes."""
    text = _template_text(tokenizer_or_template)
    for marks, name in _TEMPLATE_MARKS:
        if any(mark in text for mark in marks):
            return name
    return "hermes"


def _load_path(name: str) -> Any:
    """``package.module:Class`` or ``path/to/file.py:Class`` -> the object it names."""
    module_name, _, attr = name.partition(":")
    if module_name.endswith(".py") and not Path(module_name).is_file():
        raise OxrlError(f"env.tool_parser: tool-call parser '{name}': file not found: {module_name}")
    try:
        obj = import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # any failure in the user's code is one message naming it
        raise OxrlError(
            f"env.tool_parser: tool-call parser '{name}' failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    return obj


def parser_for(tokenizer_or_template: Any, name: str = "auto") -> ToolParser:
    """The tool-call parser for a model: ``name`` is ``auto`` (by the chat template of ``tokenizer_or_template``,
    a tokenizer or the template's text: ``[TOOL_CALLS]`` or ``[INST]`` -> mistral, ``<|start_header_id|>`` or
    ``<|python_tag|>`` -> llama3_json, otherwise hermes), a built-in name, or an import path
    ``package.module:Class`` / ``path/to/file.py:Class`` naming a `ToolParser` subclass."""
    if name == "auto":
        name = detect(tokenizer_or_template)
    if name in PARSERS:
        return PARSERS[name]()
    module_name, _, attr = name.partition(":")
    if not (module_name and attr):
        raise OxrlError(
            f"env.tool_parser: unknown tool-call parser '{name}'; built-in: {', '.join(PARSERS)}, or module:Class"
        )
    cls = _load_path(name)
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise OxrlError(
            f"env.tool_parser: '{name}' is not a ToolParser subclass (it is {cls!r}); "
            "subclass oxrl_core.tool_parsers.ToolParser and implement parse() and format()"
        )
    try:
        return cls()
    except Exception as exc:  # noqa: BLE001 - e.g. parse() left abstract: one message naming the class
        raise OxrlError(f"env.tool_parser: tool-call parser '{name}' could not start: {type(exc).__name__}: {exc}")
