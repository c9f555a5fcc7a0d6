"""Token ids from checked rows.

Tokenisation convention: the prompt goes through the chat template with the generation prompt when the tokenizer
has one (plain text otherwise); a completion is its tokens without special tokens, then EOS; ``labels`` are -100
on prompt tokens. A multi-turn ``messages`` row (several assistant turns, tool calls, tool results) is rendered whole
by the chat template with labels on every assistant turn (`tokenise_messages`). CPT (`text`) rows are packed into
``max_length`` blocks with labels on every token. A prompt or completion that encodes to no tokens is refused, and
preference pairs whose chosen equals rejected are dropped with a note (`Tokenised.notes`).

Rows with images (a VLM run: ``vision`` is the model's `models.vision.VLMProcessing`): every prompt of the run goes
through the model's own processor, which expands each image placeholder into the image's tokens; the example keeps
the row's pixel inputs beside its tokens (`image_fields`), and the image tokens never carry a label (they are on the
prompt side). A row whose truncation to ``max_length`` would cut through an image is refused, naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field

from oxrl_core.chat_templates import describe_error
from oxrl_core.data.images import RESPONSE_FIELDS, TOKEN_INPUTS, check_image_row, picture_tensors, row_images
from oxrl_core.data.rows import is_multi_turn, normalise_row, row_where
from oxrl_core.data.sources import Source
from oxrl_core.errors import OxrlError

IGNORE = -100

# ----------------------------------------------------------------------------- tokenisation


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if not isinstance(out, list) else out
        return list(ids)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def encode_completion(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def encode_row_prompt(tokenizer, row: dict, origin: str) -> list[int]:
    """`encode_prompt` of a checked row; a prompt of 0 tokens is an error naming the file and row.

    It happens with a tokenizer that has no chat template and adds no BOS (GPT-2/NeoX-style base
    models) and an empty prompt. Nothing would condition the first completion token: a rollout cannot
    start, and packed attention indexes an empty segment. So it is refused when the data loads,
    not when the row is sampled. A chat template that fails on this row (a ``system`` turn it refuses, a
    ``raise_exception``) is an error naming the file, the row and the template's line."""
    try:
        ids = encode_prompt(tokenizer, row["prompt"])
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception, a KeyError in it
        raise OxrlError(
            f"{row_where(row, origin)}: field 'prompt': the tokenizer's chat template cannot render it "
            f"({describe_error(exc)}); change the row (e.g. the roles its messages use) or set model.chat_template"
        ) from None
    if not ids:
        raise OxrlError(
            f"{row_where(row, origin)}: field 'prompt' encodes to no tokens (it is empty, and this tokenizer has no chat "
            "template and adds no BOS token); give the row a prompt or remove it (plain text without a prompt is "
            'the CPT format: {"text": ...})'
        )
    return ids


def image_fields(vision, row: dict, origin: str, max_length: int, pictures: bool = False) -> tuple[list[int], dict]:
    """A VLM run's prompt: (token ids, the example's image fields) through the model's processor (`vision.encode`).

    The fields are ``pixel_inputs`` (the processor's pixel tensors for this row), ``token_inputs`` (its per-token
    inputs as lists, `images.TOKEN_INPUTS`) and ``pixels_by`` (how ``images.collate_pixels`` joins them); none for a
    row without images. ``pictures`` (an RL prompt): also ``pictures``, what a backend that expands the images
    itself takes (vLLM): ``ids``, the prompt with one placeholder per image (`vision.ImageEncoding.prompt_ids`),
    and ``images`` (`images.picture_tensors`). Refused, naming the row: a prompt the processor or its chat
    template cannot render, and an
    image whose tokens would not all fit in ``max_length`` (training on part of an image's tokens is the "image
    features and image tokens do not match" failure, or worse, a silently wrong pairing)."""
    where = row_where(row, origin)
    images = row_images(row, origin)
    try:
        encoding = vision.encode(row["prompt"], images)
    except OxrlError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a processor's ValueError, ...
        raise OxrlError(
            f"{where}: field 'prompt': the model's processor cannot encode it ({describe_error(exc)})"
        ) from None
    ids = encoding.input_ids.tolist()
    if not images:
        return ids, {}
    positions = encoding.image_mask.nonzero().flatten().tolist()
    if positions[-1] >= max_length:
        raise OxrlError(
            f"{where}: field 'images': truncation to data.max_length={max_length} would cut through an image (the "
            f"row's {len(images)} image(s) take {len(positions)} tokens, the last at position {positions[-1] + 1} of "
            f"a {len(ids)}-token prompt); raise data.max_length or give smaller images"
        )
    pixels = dict(encoding.pixel_inputs)
    tokens = {name: pixels.pop(name)[0].tolist() for name in TOKEN_INPUTS if name in pixels}
    fields = {"pixel_inputs": pixels, "token_inputs": tokens, "pixels_by": vision.family.pixels_by}
    if pictures:
        fields["pictures"] = {"ids": list(encoding.prompt_ids), "images": picture_tensors(images)}
    return ids, fields


def _prompt(tokenizer, row: dict, origin: str, vision, max_length: int) -> tuple[list[int], dict]:
    """(prompt ids, image fields): through the processor in a VLM run (`image_fields`), else `encode_row_prompt`."""
    if vision is not None:
        return image_fields(vision, row, origin, max_length)
    return encode_row_prompt(tokenizer, row, origin), {}


def encode_row_completion(tokenizer, row: dict, field: str, origin: str) -> list[int]:
    """`encode_completion` of ``row[field]``; text that encodes to no tokens (before EOS) is an error."""
    ids = encode_completion(tokenizer, row[field])
    if len(ids) < 2:
        raise OxrlError(
            f"{row_where(row, origin)}: field '{field}' encodes to no tokens with this tokenizer "
            f"({row[field]!r}); give it text the tokenizer can represent or remove the row"
        )
    return ids


def rows_text(where: list[tuple[str, object]], limit: int = 5) -> str:
    """``a.jsonl rows 3, 5, 9, ...`` for (file, row) pairs: the first ``limit`` rows, grouped by file."""
    by_file: dict[str, list[str]] = {}
    for origin, row in where[:limit]:
        by_file.setdefault(origin, []).append(str(row))
    more = ", ..." if len(where) > limit else ""
    return (
        "; ".join(f"{origin} row{'s' if len(rows) > 1 else ''} {', '.join(rows)}" for origin, rows in by_file.items())
        + more
    )


@dataclass
class Tokenised:
    examples: list[dict]  # {"input_ids": [...], "labels": [...]}
    dropped: int = 0  # rows whose prompt leaves no room for a completion token in data.max_length
    identical: list[tuple[str, object]] = dataclass_field(
        default_factory=list
    )  # (file, row) of pairs with chosen == rejected
    per_turn: list[tuple[str, object]] = dataclass_field(
        default_factory=list
    )  # (file, row) of conversations trained as one example per assistant turn (`tokenise_messages`)

    def notes(self, max_length: int) -> list[str]:
        """One line per kind of dropped or split row, for the run's start-up output."""
        notes = []
        if self.dropped:
            notes.append(f"{self.dropped} rows dropped: their prompt fills data.max_length={max_length}")
        if self.identical:
            notes.append(
                f"{len(self.identical)} preference pairs dropped: chosen equals rejected (after truncation "
                f"to data.max_length={max_length}), nothing to prefer: {rows_text(self.identical)}"
            )
        if self.per_turn:
            notes.append(
                f"{len(self.per_turn)} multi-turn rows trained as one example per assistant turn: the chat template "
                f"renders earlier turns differently in a longer conversation (e.g. drops their <think>): "
                f"{rows_text(self.per_turn)}"
            )
        return notes


def _render(tokenizer, messages: list[dict], generation_prompt: bool, where: str, tokenize: bool = True):
    """The chat template applied to ``messages``: token ids (or the text); a template error names the row."""
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=tokenize)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception, ...
        raise OxrlError(
            f"{where}: the tokenizer's chat template cannot render this conversation ({type(exc).__name__}: {exc}); "
            "use a model whose chat template takes these roles and tool calls"
        ) from None
    if not tokenize:
        return out
    return list(out if isinstance(out, list) else out["input_ids"])


def _assistant_turn(
    tokenizer, messages: list[dict], i: int, whole: list[int], where: str
) -> tuple[list[int], list[int]]:
    """(prefix, span) of assistant message i: prefix = the template of ``messages[:i]`` with the generation prompt;
    span = what ``messages[: i + 1]`` adds to it, up to and including its first EOS."""
    prefix = _render(tokenizer, messages[:i], True, where)
    full = whole if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False, where)
    if full[: len(prefix)] == prefix:
        span = full[len(prefix) :]
    else:  # a token spans the boundary (e.g. a generation prompt ending in a space): split the text instead
        prefix_text = _render(tokenizer, messages[:i], True, where, tokenize=False)
        full_text = _render(tokenizer, messages[: i + 1], False, where, tokenize=False)
        if not full_text.startswith(prefix_text):
            raise OxrlError(
                f"{where}: the chat template renders 'messages[{i}]' (an assistant turn) without its generation "
                "prompt in front, so its tokens cannot be told apart; use a model with a standard chat template"
            )
        span = tokenizer(full_text[len(prefix_text) :], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos in span:  # what follows the EOS (ChatML's newline) is not generated: no loss on it
        span = span[: span.index(eos) + 1]
    if not span:
        raise OxrlError(f"{where}: the chat template renders 'messages[{i}]' (an assistant turn) as no tokens")
    shown = tokenizer.decode(span)
    for k, call in enumerate(messages[i].get("tool_calls", [])):
        if call["function"]["name"] not in shown:
            raise OxrlError(
                f"{where}: the tokenizer's chat template does not render 'messages[{i}].tool_calls[{k}]' (a call to "
                f"'{call['function']['name']}'), so the model would learn to answer without it; use a model whose "
                "chat template renders tool_calls (tool-use instruct models' do)"
            )
    return prefix, span


def tokenise_messages(tokenizer, messages: list[dict], max_length: int, where: str = "row") -> tuple[list[dict], bool]:
    """A conversation (`check_conversation`) as SFT examples with the loss on every assistant turn and nowhere else.

    Incremental rendering with the tokenizer's chat template: for assistant message i, ``prefix_i`` is the
    template of ``messages[:i]`` with the generation prompt, and the turn's tokens are what the template of
    ``messages[: i + 1]`` adds to it, up to and including the first EOS (what follows, e.g. ChatML's newline after
    ``<|im_end|>``, is not generated, so it gets no loss; a template that closes turns without EOS trains the
    whole span). A tool call is trained as the template renders it; tool results, user and system messages are
    context only.

    One sequence (the usual case): ``input_ids`` is the template of the whole conversation, which starts with
    every ``prefix_i`` and holds turn i's tokens right after it; ``labels`` are those tokens on the turns and
    IGNORE everywhere else. Where the template renders an earlier turn differently inside a longer conversation
    (Qwen3 drops the ``<think>`` of earlier assistant turns), one example per assistant turn instead: prompt
    ``prefix_i``, completion turn i's tokens -- exactly what the model sees and generates at that turn.

    Examples are cut to ``max_length`` tokens; one that keeps no token of its (first) turn is left out, so a row
    whose first assistant turn starts past ``max_length`` gives no example.

    Returns ``(examples, one_sequence)``: ``{"input_ids", "labels"}`` dicts, and False when the conversation was
    split per turn. A tokenizer without a chat template, a template that fails on the conversation or does not
    show a tool call is an `OxrlError` naming ``where`` (the file and row).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise OxrlError(
            f"{where}: a multi-turn conversation (several assistant turns, tool calls or tool results) needs the "
            "tokenizer's chat template to mark its turns, and this tokenizer has none; use a model with a chat "
            "template (an instruct or chat model), or give the row as {prompt, response}"
        )
    whole = _render(tokenizer, messages, False, where)
    turns = [
        _assistant_turn(tokenizer, messages, i, whole, where)
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
    ]
    one_sequence = all(whole[: len(p)] == p and whole[len(p) : len(p) + len(s)] == s for p, s in turns)
    if one_sequence:
        labels = [IGNORE] * len(whole)
        for prefix, span in turns:
            labels[len(prefix) : len(prefix) + len(span)] = span
        candidates = [(whole, labels, len(turns[0][0]))]
    else:
        candidates = [(prefix + span, [IGNORE] * len(prefix) + span, len(prefix)) for prefix, span in turns]
    examples = [
        {"input_ids": ids[:max_length], "labels": labels[:max_length]}
        for ids, labels, start in candidates
        if start < max_length  # at least one token of the turn fits
    ]
    return examples, one_sequence


def tokenise_prompt_response(rows: list[dict], tokenizer, max_length: int, origin: str = "", vision=None) -> Tokenised:
    """SFT examples of checked rows (`normalise_row`): the prompt's tokens with IGNORE labels, then the response's
    tokens and EOS; a row that keeps no response token within ``max_length`` is dropped. A multi-turn
    conversation (a row with ``messages`` and no ``prompt``) goes through `tokenise_messages`. ``vision``: a VLM
    run's processing (`image_fields`)."""
    examples, dropped, per_turn = [], 0, []
    for row in rows:
        if "prompt" not in row:  # a multi-turn conversation
            out, one_sequence = tokenise_messages(tokenizer, row["messages"], max_length, row_where(row, origin))
            examples += out
            dropped += not out
            if out and not one_sequence:
                per_turn.append((row.get("_origin", origin), row.get("_row", "?")))
            continue
        prompt_ids, image = _prompt(tokenizer, row, origin, vision, max_length)
        completion_ids = encode_row_completion(tokenizer, row, "response", origin)
        input_ids = (prompt_ids + completion_ids)[:max_length]
        if len(input_ids) <= len(prompt_ids):
            dropped += 1  # nothing of the completion fits
            continue
        labels = [IGNORE] * len(prompt_ids) + completion_ids
        examples.append({"input_ids": input_ids, "labels": labels[: len(input_ids)], **image})
    return Tokenised(examples, dropped, per_turn=per_turn)


def tokenise_text_packed(rows: list[dict], tokenizer, max_length: int) -> Tokenised:
    """Concatenate `text + EOS` of every row and cut into `max_length` blocks (the last one may be shorter)."""
    stream: list[int] = []
    for row in rows:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        stream.extend(ids + [tokenizer.eos_token_id])
    blocks = [stream[i : i + max_length] for i in range(0, len(stream), max_length)]
    blocks = [b for b in blocks if len(b) > 1]
    return Tokenised([{"input_ids": b, "labels": list(b)} for b in blocks])


def _last_turn(row: dict, origin: str) -> dict:
    """A conversation as self-play reads it: the prompt is every message but the last, the response the last
    assistant message's text. Self-play generates plain text, so a conversation with tool calls is refused."""
    messages = row["messages"]
    if any(m["role"] == "tool" or "tool_calls" in m for m in messages):
        raise OxrlError(
            f"{row_where(row, origin)}: field 'messages': self-play compares one generated text answer with the "
            "last assistant message, and this conversation has tool calls; train it with sft"
        )
    return {**row, "prompt": messages[:-1], "response": messages[-1]["content"]}


def tokenise_preference(
    rows: list[dict], fmt: str, tokenizer, max_length: int, origin: str = "", vision=None
) -> Tokenised:
    """Preference-loop examples: ``prompt_ids`` plus completion ids that each end with EOS.

    ``preference`` -> ``chosen_ids``, ``rejected_ids``; ``unpaired`` -> ``completion_ids``,
    ``label``; ``prompt_response`` (self-play) -> ``chosen_ids`` (the rejected one is generated).
    A completion is cut so that prompt + completion fits ``max_length``; a row whose prompt
    leaves no room for a completion token is dropped. A pair whose chosen and rejected are the
    same tokens after that cut is dropped and listed in ``identical``: its loss has no gradient
    towards either side (DPO's stays at log 2), so training on it only dilutes the batch.
    """
    fields = {"preference": ("chosen", "rejected"), "unpaired": ("completion",), "prompt_response": ("response",)}[fmt]
    examples, dropped, identical = [], 0, []
    for row in rows:
        if "prompt" not in row:  # a multi-turn conversation: self-play's chosen answer is its last turn
            row = _last_turn(row, origin)
        prompt_ids, image = _prompt(tokenizer, row, origin, vision, max_length)
        room = max_length - len(prompt_ids)
        if room < 1:
            dropped += 1
            continue
        ex = {"prompt_ids": prompt_ids, "_row": row.get("_row"), **image}
        for name in fields:
            key = "chosen_ids" if name == "response" else f"{name}_ids"
            ex[key] = encode_row_completion(tokenizer, row, name, origin)[:room]
        if fmt == "preference" and ex["chosen_ids"] == ex["rejected_ids"]:
            identical.append((row.get("_origin", origin), row.get("_row", "?")))
            continue
        if fmt == "unpaired":
            ex["label"] = row["label"]
        examples.append(ex)
    return Tokenised(examples, dropped, identical)


def _texts(value, field: str):
    """(field path, text) for every string a row's text field holds: a string, or messages' contents and parts."""
    if isinstance(value, str):
        yield field, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _texts(item, f"{field}[{i}]")
    elif isinstance(value, dict):
        for key in ("content", "text"):
            if key in value:
                yield from _texts(value[key], f"{field}.{key}")


def check_no_image_token_text(row: dict, where: str, reserved: tuple[str, ...]) -> None:
    """A VLM run: no text of the row holds a token that stands for an image (``<|image_pad|>``...; `VLMProcessing.
    reserved_texts`): the tokenizer would make it an image token without an image, which the model's forward refuses
    at the step ("Image features and image tokens do not match") or, in a text-only batch, trains on silently."""
    for name in ("prompt", "messages", *RESPONSE_FIELDS):
        for field, text in _texts(row.get(name), name):
            found = next((t for t in reserved if t in text), None)
            if found is not None:
                raise OxrlError(
                    f"{where}: field '{field}': holds {found!r}, text this model reads as an image token (with no "
                    "image behind it); remove it, or give the row its image in 'images' with an <image> marker or an "
                    '{"type": "image"} part'
                )


def check_row_images(row: dict, fmt: str, origin: str, vision, n_images: int) -> dict:
    """Whether this run can train on a checked row with ``n_images`` images (`images.check_image_row` counted and
    placed them): a text model, CPT (``text`` rows) and multi-turn conversations refuse image rows, naming the row.
    In a text run, a prompt message given as text parts only becomes its text (the OpenAI message shape)."""
    where = row_where(row, origin)
    if fmt == "text":
        if row.get("images"):
            raise OxrlError(f"{where}: field 'images': CPT trains on plain text ({{\"text\": ...}} rows), not images")
        return row
    if n_images and vision is None:
        raise OxrlError(
            f"{where}: field 'images': this row has {n_images} image(s) and model.name cannot read images (a "
            "text-only model, or a vision-language model saved without its image processor); use a vision-language "
            "model with its processor (e.g. Qwen2-VL, Gemma-3) or leave the images out"
        )
    if n_images and "prompt" not in row and is_multi_turn(row.get("messages")):
        raise OxrlError(
            f"{where}: field 'messages': a multi-turn conversation with images is not supported yet; give it as "
            "a prompt (the messages up to the last user turn) and a response"
        )
    if vision is not None:
        check_no_image_token_text(row, where, vision.reserved_texts)
    if vision is None and isinstance(row.get("prompt"), list):
        prompt = [
            {**m, "content": "".join(p.get("text") or "" for p in m["content"])}
            if isinstance(m["content"], list)
            else m
            for m in row["prompt"]
        ]
        row = {**row, "prompt": prompt}
    return row


def prepare_examples(
    source: Source, fmt: str, tokenizer, max_length: int, self_play: bool = False, vision=None
) -> Tokenised:
    """Validated, tokenised examples; each carries ``_source`` (its part of a mixture; 0 otherwise).

    Every row check happens here, when the data loads: the fields (`normalise_row`), a prompt or a
    completion that encodes to no tokens, pairs with nothing to prefer. The parts of a mixture are
    tokenised one by one, so CPT blocks never span two sources. ``vision``: a VLM run's processing (image rows
    are checked by `check_row_images` and encoded by `image_fields`).
    """
    if not source.rows:
        raise OxrlError(f"{source.origin}: no rows")
    by_part: dict[int, list[dict]] = {}
    for r in source.rows:
        # an image where none may be (an assistant turn) is named before the row's other fields
        n_images = check_image_row(r, source.origin) if fmt != "text" else 0
        row = check_row_images(normalise_row(r, fmt, source.origin), fmt, source.origin, vision, n_images)
        by_part.setdefault(r.get("_source", 0), []).append(row)
    examples, dropped, identical, per_turn = [], 0, [], []
    for part, rows in by_part.items():
        if fmt in ("preference", "unpaired") or self_play:
            out = tokenise_preference(rows, fmt, tokenizer, max_length, source.origin, vision)
        elif fmt == "prompt_response":
            out = tokenise_prompt_response(rows, tokenizer, max_length, source.origin, vision)
        elif fmt == "text":
            out = tokenise_text_packed(rows, tokenizer, max_length)
        else:
            raise OxrlError(f"the supervised and preference loops cannot train on '{fmt}' rows")
        if not out.examples:
            raise _nothing_left(rows[0].get("_origin", source.origin), out, max_length)
        examples += [{**ex, "_source": part} for ex in out.examples]
        dropped += out.dropped
        identical += out.identical
        per_turn += out.per_turn
    return Tokenised(examples, dropped, identical, per_turn)


def _nothing_left(origin: str, out: Tokenised, max_length: int) -> OxrlError:
    """Why a source has no usable row left, and what to change."""
    if not out.identical:
        return OxrlError(f"{origin}: every row was longer than data.max_length={max_length} in its prompt")
    same = (
        f"{len(out.identical)} pairs have chosen equal to rejected (after truncation to data.max_length={max_length}: "
    )
    reasons = [f"{same}{rows_text(out.identical)})"]
    if out.dropped:
        reasons.append(f"{out.dropped} prompts fill data.max_length")
    return OxrlError(
        f"{origin}: no usable preference pair: {'; '.join(reasons)}. Check the chosen/rejected fields "
        f"(a pair needs two different answers), or raise data.max_length if they differ only past it"
    )
