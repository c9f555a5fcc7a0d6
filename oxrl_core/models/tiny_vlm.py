"""The built-in offline vision-language model: a tiny Qwen2-VL with the built-in character-level tokenizer.

The VLM counterpart of `oxrl_core.models.tiny`, sized for the built-in ``shapes`` task (`oxrl_core.data.shapes`,
32×32 pictures): randomly initialised from a seed (fp32), nothing downloaded, cached under the same root as the
text model (`tiny.cache_dir`) in a directory keyed by a hash of its whole recipe (`RECIPE`, the tokenizer's
definition and the chat template), written to a temporary sibling and renamed.

- **Language model**: Qwen2-VL's, as the built-in text model: hidden 128, 4 layers, 2 heads of 64 (head_dim 64, as
  vLLM's CPU kernels want), MLP 512; M-RoPE sections (8, 12, 12) over the 32 rotary frequencies (the real model's
  16/24/24 halved); untied output head.
- **Vision tower**: 2 blocks, embed dim 64 (2 heads), 8-pixel patches (×2 frames, Qwen2-VL's temporal patch),
  merged 2×2 into the language model's width: a 32×32 picture is a 4×4 patch grid, **4 image tokens**; its
  ``pixel_values`` are (16, 384), ``image_grid_thw`` (1, 3) = [[1, 4, 4]].
- **Tokenizer**: `tiny.build_tokenizer` (one token per printable character, the chat roles) plus Qwen2-VL's image
  tokens `VISION_TOKENS` (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, and ``<|video_pad|>``, which
  the processor looks up: without it every unknown character would be taken for a video token), ids 104-107; the
  config's ``image_token_id`` etc. name them and its vocabulary is the tokenizer's (108).
- **Chat template** (`CHAT_TEMPLATE`): the text model's (``<|user|>...<|end|>``, generation prompt
  ``<|assistant|>``, tool calls alike) with list content rendered part by part: a ``{"type": "image"}`` part is
  ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor repeats ``<|image_pad|>`` once per image token),
  a ``{"type": "text"}`` part its text.
- **Image processor**: the PIL ``Qwen2VLImageProcessorPil`` (no torchvision), patch 8, merge 2, pictures kept
  between 16×16 and 64×64 pixels of area (``min_pixels`` 256, ``max_pixels`` 4096): a 32×32 picture stays 32×32.

Saved as a Qwen2-VL checkpoint without ``processor_config.json`` (as ``tests/vlm_archs.py`` saves its qwen2_vl
family): the model, the tokenizer with its chat template, and ``preprocessor_config.json`` naming
``processor_class``; the processor's video part needs torchvision, so `oxrl_core.models.vision.load_processor` builds
it from the tokenizer and the image processor. It loads with `vision.load_vlm` / `vision.load_processing` and
`AutoTokenizer`. 1.27M parameters (0.19M in the vision tower); building and saving it takes about 0.1 s once torch
and transformers are imported (about 5 s in a fresh process, the imports included).

Learnable: 150 steps of plain SFT on the shapes colour question (16 rows a step, AdamW at 1.5e-3; about 20 s on
one CPU core) answer 31 of 40 held-out colour questions right, where chance is 8 (``tests/test_shapes.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from oxrl_core.data.encode import tokenise_prompt_response
from oxrl_core.hf_env import quiet_transformers
from oxrl_core.models.tiny import CHARACTERS, SPECIAL_TOKENS, build_tokenizer, cache_dir, publish_dir, sft_warm_start
from oxrl_core.models.tiny import CHAT_TEMPLATE as TEXT_CHAT_TEMPLATE
from oxrl_core.models.vision import load_processing, load_vlm

#: Qwen2-VL's image tokens, added after the character tokenizer's vocabulary in this order
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
#: what the chat template writes for one image (the `qwen2_vl` family's placeholder in `vision.FAMILIES`)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

_TEXT_CONTENT = "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
_PART_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
assert _TEXT_CONTENT in TEXT_CHAT_TEMPLATE, "tiny.CHAT_TEMPLATE's content rendering changed: update tiny_vlm"
#: the text model's template, list content rendered part by part (images as `IMAGE_PLACEHOLDER`)
CHAT_TEMPLATE = TEXT_CHAT_TEMPLATE.replace(_TEXT_CONTENT, _PART_CONTENT)

#: the picture side the model is sized for (`oxrl_core.data.shapes.IMAGE_SIZE`)
IMAGE_SIZE = 32
#: everything the build depends on besides the tokenizer and template (the cache key hashes it)
RECIPE = {
    "v": 1,
    "text": {
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
    },
    "vision": {
        "depth": 2,
        "embed_dim": 64,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 8,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    },
    "image": {"min_pixels": (IMAGE_SIZE // 2) ** 2, "max_pixels": (IMAGE_SIZE * 2) ** 2},
}


def build_vlm_tokenizer():
    """`tiny.build_tokenizer` with `VISION_TOKENS` added as special tokens and `CHAT_TEMPLATE`."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"extra_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor():
    """The PIL Qwen2-VL image processor for `IMAGE_SIZE` pictures (`RECIPE`'s patch, merge and pixel bounds)."""
    from transformers import Qwen2VLImageProcessorPil  # lazy: transformers only when the model is built

    vision, image = RECIPE["vision"], RECIPE["image"]
    processor = Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        size={"shortest_edge": image["min_pixels"], "longest_edge": image["max_pixels"]},
    )
    processor.processor_class = "Qwen2VLProcessor"  # what `vision.load_processor` builds it into
    return processor


def build_vlm(tokenizer, seed: int = 0):
    """The tiny Qwen2-VL (random weights from ``seed``, fp32) for ``tokenizer`` (`build_vlm_tokenizer`)."""
    import torch  # lazy: torch and transformers only when the model is built
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
    special["eos_token_id"] = tokenizer.eos_token_id
    text = {"vocab_size": len(tokenizer), **RECIPE["text"], **special}
    vision = {**RECIPE["vision"], "hidden_size": RECIPE["text"]["hidden_size"]}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_vlm(path: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny VLM, its tokenizer and image processor and save them as an ordinary HF directory (written to
    a temporary sibling and renamed; when another process saved ``path`` first, theirs is kept)."""
    path = Path(path)
    quiet_transformers()  # no "Writing model shards" bar
    tokenizer = build_vlm_tokenizer()
    model = build_vlm(tokenizer, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        build_image_processor().save_pretrained(tmp)

    return publish_dir(path, write)


def recipe_key(seed: int = 0) -> str:
    """The hash of everything the built model depends on: `RECIPE`, the tokenizer's definition, the template."""
    key = {"recipe": RECIPE, "s": seed, "chars": CHARACTERS, "specials": SPECIAL_TOKENS, "vision": VISION_TOKENS}
    key["template"] = CHAT_TEMPLATE
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]


def default_vlm_dir(seed: int = 0) -> Path:
    """Path of the built-in tiny VLM, created on first use (seeded, so identical everywhere)."""
    path = cache_dir() / f"tiny-qwen2vl-{recipe_key(seed)}"
    if not (path / "config.json").exists():
        save_tiny_vlm(path, seed=seed)
    return path


#: SFT steps of the warm start that preference (and RL) runs on the built-in visual task begin from
VLM_WARM_START_STEPS = 200


def vlm_warm_start_path(steps: int = VLM_WARM_START_STEPS, seed: int = 0) -> Path:
    """Where `vlm_warm_start_dir` keeps that warm start in the cache (built or not)."""
    base = default_vlm_dir(seed)
    return base.with_name(f"{base.name}-warm{steps}-s{seed}")


def vlm_warm_start_dir(steps: int = VLM_WARM_START_STEPS, seed: int = 0, log=None, reporter=None) -> Path:
    """The built-in tiny VLM after a short SFT on the ``shapes`` train split (cached): where a preference run on
    images starts with ``model.name`` empty (a random model never answers right, so there is nothing to prefer).

    The same plain masked-NLL loop as `tiny.warm_start_dir` (written out so the core depends on no algorithm
    package), with each row's picture going through the model's own processor (`vision.load_processing`),
    deterministic on CPU, run once per cache."""
    base = default_vlm_dir(seed)
    path = vlm_warm_start_path(steps, seed)
    if (path / "config.json").exists():
        return path
    quiet_transformers()
    log = log or (reporter.info if reporter is not None else None)
    if log is not None:
        log(f"first run on the built-in visual task: a {steps}-step SFT warm start of the tiny VLM (cached in {path})")
    vision = load_processing(str(base))
    tokenizer = vision.tokenizer
    model = load_vlm(str(base))
    from oxrl_core.data import shapes  # lazy: loading a model never imports the demo task; its warm start reads it

    examples = tokenise_prompt_response(shapes.rows("train")[:2000], tokenizer, 64, vision=vision).examples
    sft_warm_start(model, examples, steps, seed, tokenizer.pad_token_id, reporter)
    return publish_dir(path, lambda tmp: (model.save_pretrained(tmp), vision.processor.save_pretrained(tmp)))
