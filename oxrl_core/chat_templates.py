"""Built-in chat templates for ``model.chat_template``: a tokenizer without a template (a base model), or one
whose template a run should replace, gets one by name; any other value is a path to a Jinja file.

A leaf module (strings only): `config` validates the name here, `models` sets the template on the tokenizer.
Each template renders ``messages`` (``role``/``content``) and, with ``add_generation_prompt``, opens the
assistant's turn; tool calls are left to the model's own template.

A template that does not compile, or fails on a plain user/assistant conversation, is refused before a run
trains (`compile_problem` when the config is read, `render_problem` when a tokenizer loads) and is an error
in `oxrl check-model`: jinja2 would otherwise raise from deep inside the first row's tokenisation. The
message gives the template's line (a `TemplateSyntaxError`'s ``lineno``, or the template frame jinja2
puts into the traceback of an error raised while rendering) and jinja2's own text.
"""

from __future__ import annotations

import difflib
import types
from pathlib import Path

from oxrl_core.errors import OxrlError

TEMPLATES = {
    # ChatML (Qwen, SmolLM2, OLMo 2 and many fine-tunes): <|im_start|>role\ncontent<|im_end|>\n
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Llama 3: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>, after <|begin_of_text|>
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + ((message['content'] or '') | trim) "
        "+ '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # Gemma: <start_of_turn>user|model\ncontent<end_of_turn>\n (a system message is a user turn)
    "gemma": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
        "{{ '<start_of_turn>' + role + '\n' + ((message['content'] or '') | trim) + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    # Phi-3: <|role|>\ncontent<|end|>\n
    "phi3": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
    # Zephyr: <|role|>\ncontent</s>\n
    "zephyr": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + eos_token + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}


def names() -> list[str]:
    return sorted(TEMPLATES)


def check_chat_template(value: str, field: str = "model.chat_template") -> str:
    """``value`` if it is empty, a built-in name or an existing file; else a ValueError naming the names
    (pydantic puts the field in front of it)."""
    if not value or value in TEMPLATES:
        return value
    try:
        is_file = Path(value).expanduser().is_file()
    except (OSError, ValueError):
        is_file = False
    if is_file:
        problem = compile_problem(chat_template_text(value, field))
        if problem:
            raise ValueError(f"the chat template {Path(value).expanduser()} does not compile: {problem}")
        return value
    close = difflib.get_close_matches(value, names(), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ValueError(
        f"'{value}' is neither a built-in chat template{hint} nor a Jinja file; built-in: {', '.join(names())}"
    )


def chat_template_text(value: str, field: str = "model.chat_template") -> str:
    """The Jinja text ``value`` names (a built-in name or a file, read as UTF-8)."""
    if value in TEMPLATES:
        return TEMPLATES[value]
    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise OxrlError(f"{field}: cannot read the chat template {path}: {exc}") from None
    if not text.strip():
        raise OxrlError(f"{field}: the chat template {path} is empty")
    return text


#: what every template must render: each plain-string prompt is this user turn with the generation prompt,
#: and an SFT row the whole conversation (`data.encode_prompt`, `data.tokenise_messages`)
PROBE = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
]


def _template_line(exc: BaseException) -> int | None:
    """The template line an error points at: a syntax error's ``lineno``; for an error raised while
    rendering, the innermost traceback frame jinja2 rewrote to the template's own line (its code is named
    ``<template>`` for a template compiled from a string, as transformers compiles them)."""
    lineno = getattr(exc, "lineno", None)
    if isinstance(lineno, int):
        return lineno
    lines = [line for frame, line in _frames(exc.__traceback__) if frame.f_code.co_filename == "<template>"]
    return lines[-1] if lines else None


def _frames(tb: types.TracebackType | None):
    """(frame, line) of each traceback entry, outermost first."""
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def describe_error(exc: BaseException) -> str:
    """``line 3: unexpected '}' (TemplateSyntaxError)``: where in the template, jinja2's message, its type."""
    from jinja2 import TemplateError  # lazy: jinja2 comes with transformers, needed only once a template is checked

    message = " ".join(str(exc).split()) or "(no message)"
    kind = type(exc).__name__
    if type(exc) is TemplateError and any(
        frame.f_code.co_name == "raise_exception" for frame, _ in _frames(exc.__traceback__)
    ):
        kind = "the template's raise_exception"
    line = _template_line(exc)
    return f"{f'line {line}: ' if line else ''}{message} ({kind})"


def compile_problem(text: str) -> str | None:
    """None if ``text`` compiles in the Jinja environment transformers renders chat templates with
    (its sandbox, ``raise_exception``, the ``{% generation %}`` tag); else where and why it does not."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as exc:
        return describe_error(exc)
    return None


def render_problem(tokenizer) -> str | None:
    """None if the tokenizer's chat template renders `PROBE`'s user turn with the generation prompt and the
    whole conversation (with the tokenizer's own special tokens, as a run renders rows); else which one
    failed and where. A tokenizer without a template has nothing to check."""
    from jinja2 import TemplateSyntaxError

    if not getattr(tokenizer, "chat_template", None):
        return None
    for messages, generation_prompt, what in (
        (PROBE[:1], True, "a user turn with the generation prompt"),
        (PROBE, False, "a user/assistant conversation"),
    ):
        try:
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja2's errors, a filter's TypeError, a template's raise_exception
            verb = "does not compile" if isinstance(exc, TemplateSyntaxError) else f"fails on {what}"
            return f"{verb}: {describe_error(exc)}"
    return None


def template_source(tokenizer_path: str) -> str:
    """Where a tokenizer's own template lives, for a message: ``<dir>/chat_template.jinja`` (transformers 5
    saves it there), ``<dir>/tokenizer_config.json``'s ``chat_template``, or the hub id's."""
    local = Path(tokenizer_path).expanduser()
    if (local / "chat_template.jinja").is_file():
        return str(local / "chat_template.jinja")
    if (local / "tokenizer_config.json").is_file():
        return f"'chat_template' in {local / 'tokenizer_config.json'}"
    return f"the chat template of {tokenizer_path}"
