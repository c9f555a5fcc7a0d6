"""One episode of a multi-turn RL run (`rl.episodes` plays them): the chat template's rendering of its messages, the
token-exact extension of a conversation by the environment's messages (`extension_ids`), and the `Episode` record
— the conversation, the training sample's ids and who wrote each token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oxrl_core.data.images import ENV_IMAGES
from oxrl_core.interfaces import Completion
from oxrl_core.rollout.env_worker import EnvWorker, Malformed

# ----------------------------------------------------------------------------- rendering


def render(tokenizer, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
    """The chat template's text of ``messages`` (``tokenizer``: a tokenizer, or a VLM's processor, whose template
    writes each image part as the family's placeholder; the images themselves are not read here)."""
    return tokenizer.apply_chat_template(
        [_without_pixels(m) for m in messages], tools=tools or None, add_generation_prompt=generation_prompt,
        tokenize=False,
    )  # fmt: skip


def _without_pixels(message: dict) -> dict:
    """``message`` with its image parts as bare ``{"type": "image"}`` (the template writes the placeholder)."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return message
    return {**message, "content": [{"type": "image"} if _is_image(p) else p for p in content]}


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _as_text(message: dict) -> dict:
    """A message whose content is text parts only, as one string (a text model's template may take no parts)."""
    content = message["content"]
    return message if isinstance(content, str) else {**message, "content": "".join(p["text"] for p in content)}


def image_parts(messages: list[dict]) -> list:
    """The image values of ``messages``' image parts, in order."""
    return [
        p.get("image") for m in messages if isinstance(m.get("content"), list) for p in m["content"] if _is_image(p)
    ]


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def extension_ids(tokenizer, before: list[dict], turn: dict, added: list[dict], ended_eos: bool, tools) -> list | None:
    """The environment's tokens after the model's ``turn``: the template's rendering of ``added`` and the next
    generation prompt, as an exact-prefix extension of the conversation; None when the template breaks it.

    ``before`` is the conversation the model answered, ``turn`` its answer as sampled (``ended_eos``: the
    sampled tokens ended with EOS, which the template's end of turn may repeat and is then not added twice)."""
    rest = extension_text(tokenizer, tokenizer, before, turn, added, ended_eos, tools)
    return None if rest is None else encode(tokenizer, rest)


def extension_text(renderer, tokenizer, before, turn, added, ended_eos: bool, tools) -> str | None:
    """`extension_ids`' text (placeholders not yet expanded): ``renderer`` renders (a tokenizer or a VLM's
    processor), ``tokenizer`` names EOS. None when the template breaks the extension."""
    prompt = render(renderer, before, tools, True)  # what the model answered, as the template writes it
    full = render(renderer, before + [turn] + added, tools, True)
    if not full.startswith(prompt):
        return None  # the template rewrote the conversation before the model's turn
    rest = full[len(prompt) :]
    if not rest.startswith(turn["content"]):
        return None  # ... or the model's turn itself
    rest = rest[len(turn["content"]) :]
    eos = tokenizer.eos_token or ""
    if ended_eos and eos and rest.startswith(eos):
        rest = rest[len(eos) :]  # the model sampled the template's end of turn
    return rest


# ----------------------------------------------------------------------------- one episode


#: `Episode.pixels` keys: each image-bearing span of the sequence as (start, end, its ids with one placeholder per
#: image), and the pictures (H, W, 3) uint8, in order: what `Episode.image_inputs` gives a backend as ``pictures``
PICTURE_SPANS = "picture_spans"
PICTURE_IMAGES = "picture_images"


@dataclass
class Episode:
    """One sample: the conversation, the training sample's ids and who wrote each token."""

    row: dict
    env: EnvWorker | None  # the episode's environment, in its worker process (`oxrl_core.rollout.env_worker`)
    messages: list[dict]
    prompt_ids: list[int]  # the training sample's prompt (re-rendered after a fallback)
    token_ids: list[int] = field(default_factory=list)  # after prompt_ids: the model's and the environment's
    logprobs: list[float] = field(default_factory=list)  # the backend's, 0 at environment tokens
    sampled: list[int] = field(default_factory=list)  # 1 at the model's tokens
    step_rewards: list[float] = field(default_factory=list)
    versions: set = field(default_factory=set)
    turns: int = 0
    used: int = 0  # episode tokens so far (model + environment), against env.max_tokens
    fallbacks: int = 0
    #: done | max_turns | error | timeout, or cut: max_tokens (the episode's budget env.max_tokens), length (a
    #: model turn cut at rollout.max_new_tokens); each cut names its own setting (the end-of-run findings)
    ended: str = ""
    finish_reason: str = "stop"
    earlier: tuple | None = None  # the sample before the last fallback (kept if the new one gets no model token)
    tools: list[dict] = field(default_factory=list)  # the environment's tool schemas (rendered by the template)
    turn: dict | None = None  # the model's latest turn, as sampled
    ended_eos: bool = False  # ... and whether it ended with EOS
    start_failure: str = ""  # error | timeout: the environment failed to start (one model turn, reward 0)
    error: str = ""  # what failed, when ended is error | timeout (`describe_failure`)
    #: a VLM's image inputs of every image in prompt_ids + token_ids, in order (`encode.image_fields`' form:
    #: ``pixel_inputs``, ``token_inputs`` lists as long as the ids up to the last image, ``pixels_by``); {} for none
    pixels: dict = field(default_factory=dict)
    images_shown: int = 0  # images the environment added (``env/images_shown``)
    #: the images of prompt_ids + token_ids that the environment showed, in order, for rollouts.jsonl: ``{"turn": k
    #: (its answer to the model's k-th turn), "image": a PNG data URI}`` (`rollout.log.image_data_uri`)
    env_images: list[dict] = field(default_factory=list)

    def image_inputs(self) -> dict:
        """`pixels` with each per-token input as long as the whole sequence (0 after the last image), as
        `images.collate_pixels` lines them up with the ids ({} for an episode without images); and ``pictures``, the
        sequence with each image span back in its unexpanded form and the pictures (`encode.image_fields`' form,
        for a backend that expands images itself)."""
        if not self.pixels:
            return {}
        sequence = self.prompt_ids + self.token_ids
        tokens = {k: list(v) + [0] * (len(sequence) - len(v)) for k, v in self.pixels["token_inputs"].items()}
        fields = {k: v for k, v in self.pixels.items() if k not in (PICTURE_SPANS, PICTURE_IMAGES)}
        spans = self.pixels.get(PICTURE_SPANS)
        if spans:
            ids, last = [], 0
            for start, end, unexpanded in spans:  # each image-bearing span, in order
                ids += sequence[last:start] + list(unexpanded)
                last = end
            fields["pictures"] = {"ids": ids + sequence[last:], "images": list(self.pixels[PICTURE_IMAGES])}
        return {**fields, "token_inputs": tokens}

    def media(self) -> dict:
        """The episode's media record for the rollout batch: `image_inputs`, and the images the environment showed
        as rollouts.jsonl logs them (``env_images``, which `images.collate_pixels` does not read) where it showed
        any; {} for a text episode."""
        fields = self.image_inputs()
        return {**fields, ENV_IMAGES: list(self.env_images)} if self.env_images else fields

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.token_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.sampled += [1 if logprobs is not None else 0] * len(ids)
        self.used += len(ids)

    def end(self, why: str) -> None:
        self.ended = why
        if not any(self.sampled) and self.earlier is not None:  # nothing of the model since the fallback
            self.prompt_ids, self.token_ids, self.logprobs, self.sampled, self.pixels, shown = self.earlier
            del self.env_images[shown:]  # those of the sample kept

    @property
    def failed(self) -> bool:
        return self.ended in ("error", "timeout")

    def final_answer(self) -> str:
        turns = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return turns[-1] if turns else ""

    def as_completion(self) -> Completion:
        return Completion(
            list(self.token_ids), list(self.logprobs), self.finish_reason, min(self.versions), list(self.sampled)
        )


def _check_step(result) -> tuple[list[dict], float, bool]:
    """An environment's ``step`` output, checked: (messages with string role/content, a finite reward, done)."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise Malformed(f"step() must return (messages, reward, done), got {type(result).__name__}")
    messages, reward, done = result
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _content_ok(m.get("content")) for m in messages
    ):
        raise Malformed(
            "step() must return a list of {role, content} messages, content a string or a list of parts "
            '{"type": "text", "text": str} / {"type": "image", "image": path | base64 string | bytes}'
        )
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise Malformed(f"step() returned reward {reward!r}, not a finite number")
    if not isinstance(done, bool):
        raise Malformed(f"step() returned done={done!r}, not True/False")
    return messages, float(reward), done


def _content_ok(content) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict)
        and (
            (p.get("type") == "text" and isinstance(p.get("text"), str))
            or (p.get("type") == "image" and p.get("image") is not None)
        )
        for p in content
    )
