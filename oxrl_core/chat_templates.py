"""Built-in chat templates for ``model.chat_template``: a tokenizer without a template (a base model), or one
whose template a run should replace, gets one by name; any other value is a path to a Jinja file.

A leaf module (strings only): `config` validates the name here, `models` sets the template on the tokenizer.
Each template renders ``messages`` (``role``/``content``) and, with ``add_generation_prompt``, opens the
assistant's turn; tool calls are left to the model's own template.
"""

from __future__ import annotations

import difflib
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
