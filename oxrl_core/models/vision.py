"""Vision-language models: the one place that knows how VLM families differ.

A VLM checkpoint is recognised from its config (`is_vlm_config`: an image-text-to-text model type with a vision
tower), loads with its own class through `AutoModelForImageTextToText` (`load_vlm`; `AutoModelForCausalLM` would
give some families their language model alone and refuse others), and its processor through `AutoProcessor`, or,
where that needs torchvision (Qwen-VL's and SmolVLM's processors bundle a video processor, and every video
processor needs torchvision), through the processor class built from the tokenizer and the PIL image processor
with no video part (`load_processor`).

Turning a prompt and its images into model inputs is left to the model's own processor and chat template
(`VLMProcessing.encode`): they know how many tokens an image becomes, which is where hand-written code goes wrong.
What differs between families, and what oxRL needs to know of it, is the table `FAMILIES`:

- the **placeholder**: the text that stands for one image before the processor expands it (what the chat
  template writes for a ``{"type": "image"}`` part; what an ``<image>`` marker becomes without a template);
- the **image token**: the token the processor expands the placeholder into and the model overwrites with image
  features (``config.image_token_id`` or ``image_token_index``); `ImageEncoding.image_mask` marks it;
- **how many** image tokens one image becomes: ``fixed`` (the same for every image: Gemma-3's
  ``mm_tokens_per_image``, LLaVA's patch grid), ``grid`` (from the image's size: Qwen-VL's patch grid merged 2×2)
  or ``tiles`` (Idefics3/SmolVLM: the image cut into tiles plus the whole image, a fixed count per tile);
- the **extra inputs** the processor makes beside ``input_ids`` / ``attention_mask`` and the model reads:
  Qwen-VL ``pixel_values`` (flattened patches, (patches, C·t·p·p)) + ``image_grid_thw`` (images, 3) +
  ``mm_token_type_ids`` (1, T); Gemma-3 ``pixel_values`` (images, C, H, W) + ``token_type_ids`` (1, T) (bidirectional
  attention over image tokens); LLaVA ``pixel_values`` (images, C, H, W); Idefics3 ``pixel_values``
  (1, tiles, C, h, w) + ``pixel_attention_mask`` (1, tiles, h, w);
- what the first dimension of ``pixel_values`` counts (`VisionFamily.pixels_by`), which decides how a batch's
  pixels are cut into micro-batches: ``patch`` (Qwen-VL: every image's patches, image after image, with one
  ``image_grid_thw`` row (t, h, w) per image, t·h·w patches each), ``image`` (Gemma-3, LLaVA: one entry per image,
  image after image) or ``row`` (Idefics3: one entry per row, its tiles on the second dimension, padded with zero
  tiles whose ``pixel_attention_mask`` is 0 when rows have different numbers of tiles).

A family is added with a row here and a tiny model in ``tests/vlm_archs.py`` that ``tests/test_vision.py`` loads,
encodes and runs; a VLM whose family has no row is refused by name (`vision_family`), never guessed at.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from oxrl_core.data.images import IMAGE_MARKER
from oxrl_core.errors import OxrlError
from oxrl_core.hf_env import quiet_transformers

#: the inputs every processor makes for text; everything else it returns is the family's extra inputs
TEXT_INPUTS = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class VisionFamily:
    """How one VLM family represents images (see the module docstring)."""

    #: the family's config ``model_type``
    model_type: str
    #: what stands for one image in the text before the processor expands it (the chat template's rendering of an
    #: image part); an ``<image>`` marker becomes this when a prompt is encoded without a chat template
    placeholder: str
    #: ``fixed`` (the same count for every image), ``grid`` (from the image's size) or ``tiles`` (tiles + global)
    tokens: str
    #: the processor's outputs beside `TEXT_INPUTS` that the model's forward reads, for an encoding with images
    extra_inputs: tuple[str, ...]
    #: what dimension 0 of a batch's ``pixel_values`` counts: ``patch``, ``image`` or ``row`` (module docstring)
    pixels_by: str
    #: the texts of the tokens that open and close an image's run of image tokens (`placeholder_token_ids` adds
    #: them to the config's ids: the family's config does not name them all)
    delimiters: tuple[str, ...] = ()


#: the verified families, by config ``model_type``; each has a tiny model in ``tests/vlm_archs.py``
FAMILIES: dict[str, VisionFamily] = {
    f.model_type: f
    for f in (
        # Qwen2-VL, Qwen2.5-VL (window attention in the vision tower), Qwen3-VL (DeepStack features added to the
        # first decoder layers), Qwen3.5 dense and MoE (Gated DeltaNet layers in the language model): the same
        # processor layout (Qwen3-VL's and Qwen3.5's is `Qwen3VLProcessor`), image tokens and 3-D rotary positions
        *(
            VisionFamily(
                qwen,
                "<|vision_start|><|image_pad|><|vision_end|>",
                "grid",
                ("pixel_values", "image_grid_thw", "mm_token_type_ids"),
                "patch",
                ("<|vision_start|>", "<|vision_end|>"),
            )
            for qwen in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
        ),
        VisionFamily(
            "gemma3",
            "<start_of_image>",
            "fixed",
            ("pixel_values", "token_type_ids"),
            "image",
            ("<start_of_image>", "<end_of_image>"),
        ),
        VisionFamily("llava", "<image>", "fixed", ("pixel_values",), "image"),
        VisionFamily(
            "idefics3",
            "<image>",
            "tiles",
            ("pixel_values", "pixel_attention_mask"),
            "row",
            ("<fake_token_around_image>", "<global-img>"),
        ),
    )
}

#: the model inputs a family's processor adds for images (`data.images.collate_pixels` joins them per micro-batch);
#: every loop passes these to the model beside the text's, so a new family (or audio) is an entry in the table above
MEDIA_INPUTS: tuple[str, ...] = tuple(dict.fromkeys(name for f in FAMILIES.values() for name in f.extra_inputs))


# ----------------------------------------------------------------------------- recognising a VLM


def is_vlm_config(config) -> bool:
    """True for the config of an image-text-to-text model with a vision tower (a text-only config of a family
    that also has VLMs, such as ``gemma3_text``, is not one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (
        getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and getattr(config, "vision_config", None) is not None
    )


def load_config(path: str, field: str = "model.name"):
    """The checkpoint's config (`AutoConfig`); one that cannot be read is an error naming ``field``."""
    quiet_transformers()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise OxrlError(f"{field}: cannot read the model's config from {path} ({exc})") from None


def is_vlm(path: str) -> bool:
    """True when the checkpoint at ``path`` (a directory or hub id) is a vision-language model (`is_vlm_config`)."""
    return is_vlm_config(load_config(path))


def vision_family(config, field: str = "model.name") -> VisionFamily:
    """The family of a VLM config (`FAMILIES`); a VLM of another family is an error naming the verified ones."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise OxrlError(
            f"{field}: '{config.model_type}' is a vision-language model oxRL has not been verified on (verified: "
            f"{', '.join(FAMILIES)}); its images would need a row in oxrl_core/models/vision.py FAMILIES"
        )
    return family


def image_token_id(config) -> int:
    """The token the model overwrites with image features (``image_token_id``; LLaVA and Gemma-3 configs also
    spell it ``image_token_index``)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise OxrlError(f"the {config.model_type} config names no image token (image_token_id / image_token_index)")


#: the config fields naming a token that stands for, opens or closes an image (or video) in the text
PLACEHOLDER_FIELDS = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "video_token_index",
    "vision_start_token_id",
    "vision_end_token_id",
    "boi_token_index",
    "eoi_token_index",
)


def placeholder_token_ids(config, tokenizer=None) -> list[int]:
    """The tokens a VLM never samples: the image (and video) token and the tokens that open and close an image's
    run of them (``<|vision_start|>`` / ``<|vision_end|>``, ``<start_of_image>`` / ``<end_of_image>``,
    ``<fake_token_around_image>`` / ``<global-img>``) -- from the config's fields (`PLACEHOLDER_FIELDS`) and, given
    the ``tokenizer``, the family's delimiters (`VisionFamily.delimiters`). [] for a text model.

    Why never: the forward counts a sampled image token against the image features and refuses the row ("image
    features and image tokens do not match"), and a sampled delimiter opens an image no processor put there. So
    the policy oxRL samples from and trains is the model's distribution with these tokens masked (logit -inf),
    on every rollout of a VLM, text rows too (`rollout.hf`), and in every training forward alike
    (`token_head.HeadPath.masked`): the sampler's log-probabilities are the trainer's."""
    if not is_vlm_config(config):
        return []
    ids = {v for name in PLACEHOLDER_FIELDS if isinstance(v := getattr(config, name, None), int)}
    family = FAMILIES.get(config.model_type)
    if tokenizer is not None and family is not None:
        unk = getattr(tokenizer, "unk_token_id", None)
        for text in family.delimiters:
            token = tokenizer.convert_tokens_to_ids(text)
            if isinstance(token, int) and token != unk:
                ids.add(token)
    return sorted(ids)


#: where each family's vision tower sits under the model's inner ``model`` (transformers 5 names)
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def vision_tower(model):
    """The VLM's vision tower: ``model.model.visual`` (Qwen-VL, with its patch merger), ``.vision_tower`` (Gemma-3,
    LLaVA) or ``.vision_model`` (Idefics3); under PEFT, the base model's. A VLM without one is an error (a bug)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for holder in (getattr(inner, "model", None), inner):
        for name in VISION_TOWER_NAMES:
            tower = getattr(holder, name, None) if holder is not None else None
            if tower is not None:
                return tower
    raise OxrlError(f"{type(inner).__name__}: no vision tower found (looked for {', '.join(VISION_TOWER_NAMES)})")


def freeze_vision(model) -> int:
    """Stop training the vision tower (`vision_tower`): its parameters get no gradient. Returns how many
    parameters that froze."""
    params = list(vision_tower(model).parameters())
    for param in params:
        param.requires_grad_(False)
    return sum(p.numel() for p in params)


# ----------------------------------------------------------------------------- packing (Qwen-VL)

#: families whose packed rows are exact: the loop gives each row its own rotary positions (`packed_position_ids`)
PACKS = tuple(name for name, f in FAMILIES.items() if f.tokens == "grid")


def packed_position_ids(model, batch: dict):
    """Qwen-VL's ``position_ids`` for a packed micro-batch (`data.batching.collate` with ``packing``): (4, 1, ΣL).

    Row 0 restarts at 0 for every packed sequence: from it transformers builds the block-diagonal causal mask
    (Qwen2-VL reads a 4-row ``position_ids`` as text positions + its three rotary rows; given 3 rows or 2-D
    positions it builds no such mask, and the second sequence attends into the first). Rows 1-3 are each
    sequence's own 3-D rotary positions, from the model's ``get_rope_index`` on that sequence alone with its own
    images' grids (a text-only sequence: 0..L-1 on all three), exactly what the padded row gets.

    Which grids belong to which sequence follows from the image tokens each holds (``mm_token_type_ids`` is 1 on
    them; an image is t·h·w / merge² tokens): the images are in row order, as `collate_pixels` joins them."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    rope_index = inner.model.get_rope_index
    merge = inner.config.vision_config.spatial_merge_size
    bounds = batch["cu_seq_lens_q"].tolist()
    ids, types = batch["input_ids"][0], batch["mm_token_type_ids"][0]  # (ΣL,), (ΣL,)
    grids = batch.get("image_grid_thw")  # (images, 3)
    per_image = (grids.prod(-1) // merge**2).tolist() if grids is not None else []
    rows, g = [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        n_tokens, k, count = int((types[a:b] == 1).sum()), g, 0
        while count < n_tokens and k < len(per_image):
            count, k = count + per_image[k], k + 1
        if count != n_tokens:
            raise ValueError(f"packed row: {n_tokens} image tokens do not match the images' grids {per_image[g:k]}")
        text = torch.arange(b - a, device=ids.device).view(1, 1, -1)  # (1, 1, L)
        if k == g:
            rope = text.expand(3, 1, -1)
        else:
            rope, _ = rope_index(
                ids[a:b][None], mm_token_type_ids=types[a:b][None], image_grid_thw=grids[g:k], attention_mask=None
            )
        rows.append(torch.cat([text, rope.to(ids.device)], dim=0))  # (4, 1, L)
        g = k
    return torch.cat(rows, dim=2)  # (4, 1, ΣL)


# ----------------------------------------------------------------------------- loading


def load_vlm(path: str, dtype=None, field: str = "model.name"):
    """The VLM at ``path`` with its own class (``Qwen2VLForConditionalGeneration``, ...) through
    `AutoModelForImageTextToText`, in ``dtype`` (float32 by default), in eval mode as `from_pretrained` leaves it.
    A checkpoint that is not a VLM is an error naming ``field``."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = load_config(path, field)
    if not is_vlm_config(config):
        raise OxrlError(f"{field}: {path} is not a vision-language model (model_type '{config.model_type}')")
    vision_family(config, field)
    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype or torch.float32)


def images_only(processor_class: type) -> type:
    """``processor_class`` without its video processor: a subclass whose ``__init__`` takes the image processor and
    the tokenizer only and passes ``None`` for the video processor.

    Why this works: `ProcessorMixin` reads a processor's parts from its ``__init__`` signature and pairs the
    positional arguments with them in order, so with two parts the ``None`` its parent passes third is never
    stored; the parent's ``__call__`` processes videos only ``if hasattr(self, "video_processor")``. Everything
    for images -- placeholder expansion, ``mm_token_type_ids``, the chat template -- is the library's own code.

    For processors whose ``__init__`` starts ``(image_processor, tokenizer, video_processor, ...)`` and passes
    them on positionally (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM in transformers 5.19). Its ``save_pretrained``
    writes no video processor: a directory saved from it loads again through `load_processor`, but `AutoProcessor`
    with torchvision would look for ``video_preprocessor_config.json``, so a saver should copy that file (when
    the checkpoint has one) beside it."""

    def __init__(self, image_processor, tokenizer, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(processor_class.__name__, (processor_class,), {"__init__": __init__, "__module__": __name__})


def _processor_class_name(path: str, field: str) -> str | None:
    """The processor class a checkpoint names (``processor_class`` in its processor, image processor or
    tokenizer config), else transformers' processor for its model type."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    root = Path(path)
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = root / name
        if file.is_file():
            value = json.loads(file.read_text()).get("processor_class")
            if isinstance(value, str):
                return value
    return PROCESSOR_MAPPING_NAMES.get(load_config(path, field).model_type)


def load_processor(path: str, field: str = "model.name"):
    """The checkpoint's processor: `AutoProcessor`, or where that fails for want of torchvision (a processor with a
    video part) or of the video processor's config (a processor saved by `images_only`'s class), its processor
    class built by `images_only` from `AutoTokenizer` and `AutoImageProcessor` (which picks the PIL image processor
    without torchvision), with the checkpoint's processor options and chat template.

    The second route is the first's code without videos: `tests/test_vision.py` checks it gives the same input
    ids and pixel values as the processor called directly."""
    quiet_transformers()
    import transformers
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except (ImportError, OSError) as exc:  # a video processor needs torchvision, or its config is not there
        if not re.search(r"torchvision|video processor", str(exc), re.IGNORECASE):
            raise
    name = _processor_class_name(path, field)
    processor_class = getattr(transformers, name, None) if name else None
    if processor_class is None:
        raise OxrlError(f"{field}: {path} names no processor class transformers has ({name!r})")
    return images_only(processor_class).from_pretrained(path)


# ----------------------------------------------------------------------------- encoding


@dataclass
class ImageEncoding:
    """One prompt (or conversation) with its images, as the model's processor encodes it."""

    #: (T,) the token ids, each image placeholder expanded to the image's tokens
    input_ids: object
    #: (T,) bool: True at the image tokens (those the model overwrites with image features)
    image_mask: object
    #: the family's extra inputs (`VisionFamily.extra_inputs`), as the processor returns them for one row:
    #: e.g. Qwen2-VL ``pixel_values`` (patches, C·t·p·p), ``image_grid_thw`` (images, 3), ``mm_token_type_ids`` (1, T)
    pixel_inputs: dict = field(default_factory=dict)
    #: the text the chat template rendered, placeholders not yet expanded
    text: str = ""
    #: that text's token ids, one placeholder per image, special tokens as the processor adds them: the prompt a
    #: backend that expands the images itself (vLLM) is given; its expansion must give ``input_ids``
    prompt_ids: list[int] = field(default_factory=list)


def image_messages(prompt, images: list) -> list[dict]:
    """A prompt (a string, or chat messages) as chat messages whose image parts carry the images, in order.

    A string is one user turn; ``<image>`` markers in it (or in a message's string content or text part) become
    ``{"type": "image"}`` parts where they stand, and the i-th image part gets ``images[i]``. The count is
    `data.images.check_image_row`'s to enforce; here a mismatch is an error (`ValueError`, a bug if reached).
    Without images the prompt is left as it is, markers and all (a text row, as `check_image_row` counts it)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not images:
        return [dict(m) for m in messages]
    pending = iter(images)
    out = []
    for message in messages:
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        new_parts = []
        for part in parts:
            part = {k: v for k, v in part.items() if v is not None}  # Parquet gives every part every key
            if part.get("type") == "text" and IMAGE_MARKER in part.get("text", ""):
                pieces = part["text"].split(IMAGE_MARKER)
                for k, piece in enumerate(pieces):
                    if k:
                        new_parts.append({"type": "image"})
                    if piece:
                        new_parts.append({"type": "text", "text": piece})
            else:
                new_parts.append(part)
        for part in new_parts:
            if part.get("type") in ("image", "image_url"):
                image = next(pending, None)
                if image is None:
                    raise ValueError("more image placeholders than images")
                part.pop("image_url", None)
                part.update(type="image", image=image)
        keep_string = isinstance(content, str) and all(p.get("type") == "text" for p in new_parts)
        out.append({**message, "content": content if keep_string else new_parts})
    if next(pending, None) is not None:
        raise ValueError("more images than image placeholders")
    return out


@dataclass
class VLMProcessing:
    """What oxRL needs to turn rows with images into a VLM's inputs: the model's processor, its `VisionFamily` and
    the image token id. Built by `load_processing` from a checkpoint."""

    processor: object
    family: VisionFamily
    image_token_id: int
    #: the checkpoint it was loaded from (`save_pretrained` copies what the processor cannot write itself)
    source: str = ""
    #: the tokens never sampled: image and video tokens and their delimiters (`placeholder_token_ids`)
    placeholder_ids: tuple[int, ...] = ()

    @property
    def reserved_texts(self) -> tuple[str, ...]:
        """The texts that encode to the tokens standing for an image -- the image (and video) tokens and the pieces
        of the family's placeholder, e.g. ``<|image_pad|>``, ``<|vision_start|>`` -- other than the ``<image>``
        marker (counted as a placeholder). Written literally in a row, the tokenizer turns them into image tokens
        with no image behind them (`data.encode.check_row_images` refuses such a row, naming it)."""
        ids = {self.image_token_id, *self.placeholder_ids}
        texts = set(self.tokenizer.convert_ids_to_tokens(sorted(ids))) | set(
            re.findall(r"<[^<>]+>", self.family.placeholder)
        )
        return tuple(sorted(t for t in texts if t and t != IMAGE_MARKER))

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def save_pretrained(self, path) -> None:
        """Save the processor (tokenizer, image processor, chat template) into ``path``, plus the checkpoint's
        video processor config when the processor was built without its video part (`images_only`), so the saved
        directory loads with `AutoProcessor` wherever torchvision is installed, as the checkpoint did."""
        self.processor.save_pretrained(path)
        video = Path(self.source) / "video_preprocessor_config.json" if self.source else None
        if video is not None and video.is_file() and not (Path(path) / video.name).exists():
            shutil.copyfile(video, Path(path) / video.name)

    def encode(self, prompt, images: list, add_generation_prompt: bool = True) -> ImageEncoding:
        """``prompt`` (a string with ``<image>`` markers, or chat messages with ``{"type": "image"}`` parts) and its
        RGB PIL ``images`` -> the token ids with each image's tokens expanded, where they are, and the pixel inputs.

        With a chat template, the processor's own `apply_chat_template` renders and encodes it (which also decides
        BOS as the library does: added unless the rendered text starts with it); without one, the markers become
        the family's placeholder and the processor encodes the text."""
        messages = image_messages(prompt, images)
        if getattr(self.processor, "chat_template", None):
            out = self.processor.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
            )
            text = self.processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            bos = self.tokenizer.bos_token
            specials = not (bos and text.startswith(bos))  # as the processor encodes a rendered template
        else:
            text = prompt if isinstance(prompt, str) else "\n".join(_plain(m["content"]) for m in prompt)
            text = text.replace(IMAGE_MARKER, self.family.placeholder)
            out = self.processor(text=[text], images=[images] if images else None, return_tensors="pt")
            specials = True
        encoding = self._encoding(out, text, with_images=bool(images))
        encoding.prompt_ids = self.tokenizer(text, add_special_tokens=specials)["input_ids"]
        return encoding

    def _encoding(self, out, text: str, with_images: bool) -> ImageEncoding:
        input_ids = out["input_ids"][0]  # (T,)
        extra = {k: v for k, v in out.items() if k not in TEXT_INPUTS}
        unexpected = sorted(set(extra) - set(self.family.extra_inputs))
        missing = sorted(set(self.family.extra_inputs) - set(extra)) if with_images else []
        if unexpected or missing:  # the processor and FAMILIES disagree: say so rather than drop an input
            raise OxrlError(
                f"the {self.family.model_type} processor returned {sorted(out)}; oxRL expects "
                f"{list(TEXT_INPUTS) + list(self.family.extra_inputs)} (oxrl_core/models/vision.py FAMILIES)"
            )
        return ImageEncoding(input_ids, input_ids == self.image_token_id, extra, text)

    def tokens_per_image(self, image) -> int:
        """How many image tokens ``image`` becomes: the processor's own count, read from encoding the placeholder
        alone (the same for every image of a ``fixed`` family, size-dependent for ``grid`` and ``tiles``)."""
        out = self.processor(text=[self.family.placeholder], images=[[image]], return_tensors="pt")
        return int((out["input_ids"][0] == self.image_token_id).sum())


def _plain(content) -> str:
    """A message's content as text: a string, or its text parts joined with an ``<image>`` marker per image."""
    if isinstance(content, str):
        return content
    return "".join(IMAGE_MARKER if p.get("type") == "image" else p.get("text", "") for p in content)


def load_processing(path: str, field: str = "model.name") -> VLMProcessing:
    """The `VLMProcessing` of the VLM checkpoint at ``path``: its processor (`load_processor`), family and image
    token. A checkpoint that is not a VLM of a verified family is an error naming ``field``."""
    config = load_config(path, field)
    if not is_vlm_config(config):
        raise OxrlError(f"{field}: {path} is not a vision-language model (model_type '{config.model_type}')")
    family = vision_family(config, field)
    processor = load_processor(path, field)
    ids = tuple(placeholder_token_ids(config, processor.tokenizer))
    return VLMProcessing(processor, family, image_token_id(config), str(path), ids)
