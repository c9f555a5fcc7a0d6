"""Tiny random-weight vision-language models of the VLM families oxRL is verified on (issue 28's matrix).

`build_vlm(family, out_dir, seed)` saves an ordinary Hugging Face directory, as a checkpoint on the hub is laid
out: ``config.json`` + weights (0.14-0.22M parameters: a 1- or 2-block vision tower, a 2-layer language model,
fp32, built from the family's own transformers config class), a byte-level BPE tokenizer trained here with `tokenizers`
on the built-in corpus of `archs.py` with the family's special and image tokens, the family's chat template (one
that renders ``{"type": "image"}`` content parts the way the real one does), and the image processor's config,
sized for 32×32 images. Nothing is downloaded; a family builds in well under a second.

The processor, and torchvision. Transformers 5 ships every image processor in a PIL implementation, which
`AutoImageProcessor` picks when torchvision is missing (it is here: its PyPI wheel needs CUDA). The Gemma-3,
LLaVA and Idefics3 processors are a tokenizer + an image processor and build as they are, so their directories
also hold ``processor_config.json`` and load with `AutoProcessor`. A Qwen-VL processor (every family of `QWEN_VL`)
also takes a video processor, and every video processor needs torchvision: `AutoProcessor` fails on it here. Its
directory is therefore saved as a real Qwen-VL checkpoint's is where ``processor_config.json`` is absent -- tokenizer,
``preprocessor_config.json`` (the image processor, which names ``processor_class``) and the chat template --
and `oxrl_core.models.vision.load_processor` builds the processor from the tokenizer and the PIL image processor
with no video processor (images only; see its docstring). The same route serves SmolVLM's processor (Idefics3 +
video), which is why the Idefics3 family here is the SmolVLM layout without the video part.

What each family exercises (the extra inputs its processor makes, beside ``input_ids`` / ``attention_mask``):

=============  ==================================  =======================================================
family         image tokens for one 32×32 image    extra inputs
=============  ==================================  =======================================================
qwen2_vl       grid-based: 4 ``<|image_pad|>``     ``pixel_values`` (16, 384) flattened patches,
               (a 4×4 patch grid merged 2×2)       ``image_grid_thw`` (1, 3), ``mm_token_type_ids``
gemma3         fixed: 4 ``<image_soft_token>``     ``pixel_values`` (1, 3, 32, 32), ``token_type_ids``
               between ``<start_of_image>`` and
               ``<end_of_image>``
llava          fixed: 16 ``<image>`` (4×4 patches)  ``pixel_values`` (1, 3, 32, 32)
idefics3       split: 4 tiles + the global image,   ``pixel_values`` (1, 5, 3, 16, 16),
               4 ``<image>`` each (20 in all)        ``pixel_attention_mask`` (1, 5, 16, 16)
qwen2_5_vl     as qwen2_vl                          as qwen2_vl
qwen3_vl       as qwen2_vl                          as qwen2_vl
qwen3_5        as qwen2_vl                          as qwen2_vl
qwen3_5_moe    as qwen2_vl                          as qwen2_vl
=============  ==================================  =======================================================

The Qwen-VL families share Qwen2-VL's tokenizer, chat template, image processor and images (one processor
layout: `Qwen2_5_VLProcessor`, and `Qwen3VLProcessor` for Qwen3-VL and both Qwen3.5s); their models differ:

=============  ==============================================================================================
family         what the model exercises beyond Qwen2-VL's (a 1-block tower, 3-D rotary sections 4/6/6)
=============  ==============================================================================================
qwen2_5_vl     the windowed vision tower: block 0 attends within windows (``window_size`` 16 pixels: one
               merged 2×2 patch group each, the patches reordered window by window), block 1 over the whole
               image (``fullatt_block_indexes``); RMSNorm and a gated MLP in the tower
qwen3_vl       DeepStack: block 0's features, through their own merger, are added to the hidden states of
               language layer 0 at the image tokens; interleaved 3-D rotary frequencies (``mrope_interleaved``);
               learned vision position embeddings, interpolated to the patch grid
qwen3_5        Gated DeltaNet: language layer 0 is linear attention (a causal convolution and the gated delta
               rule, a recurrent state instead of a KV cache), layer 1 gated full attention whose 3-D rotary
               positions cover half of head_dim 32 (``partial_rotary_factor`` 0.5, sections 2/3/3, interleaved);
               an untied LM head
qwen3_5_moe    qwen3_5's layers with a sparse MoE MLP: 4 experts, top-2 routing, plus a gated shared expert
=============  ==============================================================================================
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from archs import _corpus

FAMILIES: tuple[str, ...] = (
    "qwen2_vl",
    "gemma3",
    "llava",
    "idefics3",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_5_moe",
)

#: the Qwen-VL layout: one processor layout (with a video part), tokenizer, template and image processor; the
#: models differ (Qwen2.5-VL's windowed vision tower, Qwen3-VL's DeepStack, Qwen3.5's Gated DeltaNet layers)
QWEN_VL: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
#: each Qwen-VL family's processor class (what its image processor config names)
QWEN_PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
    "qwen3_5_moe": "Qwen3VLProcessor",
}

#: the side of the square test images every family is sized for
IMAGE_SIZE = 32
BPE_VOCAB = 640
MAX_POSITIONS = 1024

# ----------------------------------------------------------------------------- chat templates
# Each renders a message's ``content`` given as a string or as a list of ``{"type": "text", "text"}`` /
# ``{"type": "image"}`` parts, with the image placeholder the family's processor expands.

#: Qwen2-VL's template (its default system prompt left out): an image is ``<|vision_start|><|image_pad|><|vision_end|>``
_QWEN2_VL = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: Gemma-3's: an image is ``<start_of_image>``, which the processor expands to the soft tokens
_GEMMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
#: llava-hf's LLaVA-1.5 template: ``USER: <image>\n... ASSISTANT: ...``, images before the text of a turn
_LLAVA = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
#: SmolVLM's (Idefics3): ``<|im_start|>User:<image>...<end_of_utterance>\nAssistant: ...``
_IDEFICS3 = (
    "<|im_start|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_utterance>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# ----------------------------------------------------------------------------- tokenizers

#: per family: special tokens (the first ids of the vocabulary, in this order), bos, eos, pad, chat template,
#: whether encoding adds BOS, and the tokenizer's ``extra_special_tokens`` (attributes a processor reads)
_IDEFICS3_TILES = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
_STYLES = {
    "qwen2_vl": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
        + ["<|video_pad|>"],
        None,
        "<|im_end|>",
        "<|endoftext|>",
        _QWEN2_VL,
        False,
        {},
    ),
    "gemma3": (
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
        + ["<end_of_image>", "<image_soft_token>"],
        "<bos>",
        "<end_of_turn>",
        "<pad>",
        _GEMMA3,
        True,
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    ),
    "llava": (["<unk>", "<s>", "</s>", "<pad>", "<image>"], "<s>", "</s>", "<pad>", _LLAVA, True, {}),
    "idefics3": (
        ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>"]
        + ["<global-img>"]
        + _IDEFICS3_TILES,
        "<|im_start|>",
        "<end_of_utterance>",
        "<|endoftext|>",
        _IDEFICS3,
        False,
        {},
    ),
}


def _style(family: str) -> str:
    """The `_STYLES` entry of ``family`` (every Qwen-VL family has Qwen2-VL's tokens and template)."""
    return "qwen2_vl" if family in QWEN_VL else family


@functools.lru_cache(maxsize=None)
def _tokenizer_json(family: str) -> str:
    """Train a byte-level BPE on the built-in corpus (deterministic; milliseconds) -> tokenizer JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    family = _style(family)
    specials, bos, _eos, _pad, _template, add_bos, _extra = _STYLES[family]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus() + ["What colour is the square? It is red, green, blue or yellow."] * 4, trainer)
    if add_bos:
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, core.token_to_id(bos))]
        )
    else:
        core.post_processor = processors.ByteLevel(trim_offsets=False)
    return core.to_str()


def build_tokenizer(family: str):
    """The family's tokenizer: a `PreTrainedTokenizerFast` with its special and image tokens and chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, pad, template, _add_bos, extra = _STYLES[_style(family)]
    named = {bos, eos, pad, "<unk>"}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(family)),
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token="<unk>" if "<unk>" in specials else None,
        additional_special_tokens=[t for t in specials if t not in named],
        extra_special_tokens=extra,
    )
    tokenizer.chat_template = template
    tokenizer.padding_side = "right"
    return tokenizer


# ----------------------------------------------------------------------------- image processors and configs


def build_image_processor(family: str):
    """The family's PIL image processor, sized for `IMAGE_SIZE` × `IMAGE_SIZE` images (no torchvision needed)."""
    import transformers as tf

    if family in QWEN_VL:  # 8-pixel patches merged 2×2: a 32×32 image is a 4×4 grid -> 4 tokens, 64×32 -> 8
        pixels = IMAGE_SIZE * IMAGE_SIZE  # the image's area kept between a quarter and twice a 32×32 image's
        return tf.Qwen2VLImageProcessorPil(
            patch_size=8,
            merge_size=2,
            temporal_patch_size=2,
            size={"shortest_edge": pixels // 4, "longest_edge": 2 * pixels},
        )
    if family == "gemma3":  # resized to 32×32, as the real one resizes to 896×896
        return tf.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    if family == "llava":  # CLIP's preprocessing: shortest edge to 32, centre crop 32×32
        return tf.LlavaImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
    if family == "idefics3":  # a 32×32 image is cut into 2×2 tiles of 16×16, plus the whole image at 16×16
        return tf.Idefics3ImageProcessorPil(
            size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE // 2}, do_image_splitting=True
        )
    raise ValueError(f"unknown VLM family {family!r}; expected one of {', '.join(FAMILIES)}")


def _llama_text(tokenizer) -> dict:
    """The language model of LLaVA and Idefics3: a 2-layer Llama, hidden 64, head_dim 32."""
    return {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _config(family: str, tokenizer):
    """The family's transformers config: a 1-layer vision tower, a 2-layer language model, fp32, 0.14-0.17M
    parameters."""
    import transformers as tf

    ids = tokenizer.convert_tokens_to_ids
    if family == "qwen2_vl":  # (the other Qwen-VL families: `_qwen_config`)
        text = tf.Qwen2VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=MAX_POSITIONS,
            # head_dim 32: 16 rotary frequencies, split over (time, height, width) as the real model's 16/24/24
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        vision = tf.Qwen2VLVisionConfig(
            depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8, spatial_merge_size=2
        )
        return tf.Qwen2VLConfig(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
            tie_word_embeddings=True,
        )
    if family in QWEN_VL:
        return _qwen_config(family, tokenizer)
    if family == "gemma3":
        text = tf.Gemma3TextConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=MAX_POSITIONS,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        vision = tf.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=8,
        )
        return tf.Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,  # the 4×4 patch grid average-pooled to 2×2
            boi_token_index=ids("<start_of_image>"),
            eoi_token_index=ids("<end_of_image>"),
            image_token_index=ids("<image_soft_token>"),
            tie_word_embeddings=True,
        )
    if family == "llava":
        vision = tf.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=8,
            projection_dim=32,
        )
        return tf.LlavaConfig(
            vision_config=vision.to_dict(),
            text_config=_llama_text(tokenizer),
            image_token_index=ids("<image>"),
            vision_feature_select_strategy="default",  # the CLS position dropped: 16 tokens per image
            vision_feature_layer=-1,
            projector_hidden_act="gelu",
            tie_word_embeddings=False,
        )
    if family == "idefics3":
        vision = tf.Idefics3VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IMAGE_SIZE // 2,
            patch_size=4,
        )
        return tf.Idefics3Config(
            vision_config=vision.to_dict(),
            text_config=_llama_text(tokenizer),
            image_token_id=ids("<image>"),
            scale_factor=2,  # (16/4)^2 = 16 patches pixel-shuffled to 4 tokens per tile
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown VLM family {family!r}; expected one of {', '.join(FAMILIES)}")


def _qwen_config(family: str, tokenizer):
    """Qwen2.5-VL, Qwen3-VL, Qwen3.5 and Qwen3.5-MoE: a 1-2 block vision tower (8-pixel patches merged 2×2, as
    Qwen2-VL's here), a 2-layer language model with 3-D rotary positions, 0.17-0.22M parameters."""
    import transformers as tf

    ids = tokenizer.convert_tokens_to_ids
    tokens = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    images = dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    dense = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    # every tower: 8-pixel patches merged 2×2, hidden 32, projected to the language model's 64
    tower = dict(
        hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2, out_hidden_size=64
    )
    if family == "qwen2_5_vl":  # the vision tower: window attention in block 0, full attention in block 1
        text = tf.Qwen2_5_VLTextConfig(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            **dense,
            **tokens,
        )
        vision = tf.Qwen2_5_VLVisionConfig(depth=2, window_size=16, fullatt_block_indexes=[1], **tower)
        return tf.Qwen2_5_VLConfig(
            text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=True, **images
        )
    if family == "qwen3_vl":  # interleaved 3-D rotary frequencies; DeepStack: block 0's features join layer 0
        text = tf.Qwen3VLTextConfig(
            head_dim=32,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
                "mrope_interleaved": True,
            },
            **dense,
            **tokens,
        )
        vision = tf.Qwen3VLVisionConfig(depth=2, num_position_embeddings=16, deepstack_visual_indexes=[0], **tower)
        return tf.Qwen3VLConfig(
            text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=True, **images
        )
    # Qwen3.5: a Gated DeltaNet layer, then gated full attention with partial 3-D rotary positions
    linear = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        **tokens,
    )
    vision = dict(depth=1, num_position_embeddings=16, **tower)
    if family == "qwen3_5":
        text = tf.Qwen3_5TextConfig(intermediate_size=128, **linear)
        return tf.Qwen3_5Config(
            text_config=text.to_dict(),
            vision_config=tf.Qwen3_5VisionConfig(**vision).to_dict(),
            tie_word_embeddings=False,
            **images,
        )
    if family == "qwen3_5_moe":  # 4 experts, top-2, and the shared expert
        text = tf.Qwen3_5MoeTextConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **linear
        )
        return tf.Qwen3_5MoeConfig(
            text_config=text.to_dict(),
            vision_config=tf.Qwen3_5MoeVisionConfig(**vision).to_dict(),
            tie_word_embeddings=False,
            **images,
        )
    raise ValueError(f"unknown Qwen-VL family {family!r}")


def _model_class(family: str):
    import transformers as tf

    return {
        "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
        "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration,
        "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
        "gemma3": tf.Gemma3ForConditionalGeneration,
        "llava": tf.LlavaForConditionalGeneration,
        "idefics3": tf.Idefics3ForConditionalGeneration,
    }[family]


def build_processor(family: str, tokenizer=None, image_processor=None):
    """The family's processor built from its parts, or None for a Qwen-VL family (its processor class needs a video
    processor, which needs torchvision; `oxrl_core.models.vision.load_processor` builds it without one)."""
    import transformers as tf

    tokenizer = tokenizer or build_tokenizer(family)
    image_processor = image_processor or build_image_processor(family)
    template = tokenizer.chat_template
    if family == "gemma3":
        return tf.Gemma3Processor(image_processor, tokenizer, chat_template=template, image_seq_length=4)
    if family == "llava":
        return tf.LlavaProcessor(
            image_processor,
            tokenizer,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP's CLS position, dropped by the "default" strategy
            chat_template=template,
        )
    if family == "idefics3":
        return tf.Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=template)
    if family in QWEN_VL:
        return None
    raise ValueError(f"unknown VLM family {family!r}; expected one of {', '.join(FAMILIES)}")


def build_model(family: str, seed: int = 0, tokenizer=None):
    """The family's tiny VLM with random weights from `seed` (fp32), and its tokenizer."""
    import torch

    tokenizer = tokenizer or build_tokenizer(family)
    config = _config(family, tokenizer)
    torch.manual_seed(seed)
    model = _model_class(family)(config).to(torch.float32)
    if family == "gemma3":  # the projector starts at zero (a real checkpoint's is trained): image features would be 0
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    text = config.get_text_config()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


def build_vlm(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Save the family's tiny random-weight VLM, tokenizer, chat template and image processor (and, where it
    builds without torchvision, its processor) into `out_dir`, a plain HF directory; returns it.

    Written to a temporary sibling and renamed, so a concurrent or killed build never leaves half a model."""
    if family not in FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; expected one of {', '.join(FAMILIES)}")
    model, tokenizer = build_model(family, seed=seed)
    image_processor = build_image_processor(family)
    processor = build_processor(family, tokenizer, image_processor)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if processor is not None:  # processor_config.json + the tokenizer + preprocessor_config.json + the template
        processor.save_pretrained(tmp)
    else:  # as a hub checkpoint without processor_config.json: the parts, the image processor naming its processor
        tokenizer.save_pretrained(tmp)
        image_processor.processor_class = QWEN_PROCESSORS[family]
        image_processor.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


# ----------------------------------------------------------------------------- the independent side


def processor_of(family: str, model_dir: Path):
    """The model's own processor (the independent side of `test_vlm_training` and `test_vlm_rl`); a Qwen-VL one
    without its video part (torchvision is not installed), as `tests/test_vision.py` checks gives the processor's
    own ids and pixels."""
    from transformers import AutoProcessor

    if family in QWEN_VL:
        from oxrl_core.models.vision import load_processor

        return load_processor(str(model_dir))
    return AutoProcessor.from_pretrained(str(model_dir))


def encode_rendered(processor, text: str, images: list) -> dict:
    """The processor on the rendered prompt; BOS added unless the template wrote it (as transformers does)."""
    bos = processor.tokenizer.bos_token
    return processor(
        text=[text],
        images=[images] if images else None,
        add_special_tokens=not (bos and text.startswith(bos)),
        return_tensors="pt",
    )


def row_messages(row: dict) -> tuple[list[dict], str | None]:
    """A raw row as chat messages up to the answer, and the answer (None for a prompt-only row): ``<image>`` markers
    become image parts, as the model's own chat template expects them."""
    if "messages" in row:
        return row["messages"][:-1], row["messages"][-1]["content"]
    parts = []
    for k, piece in enumerate(row["prompt"].split("<image>")):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return [{"role": "user", "content": parts if row.get("images") else row["prompt"]}], row.get("response")


def with_appended(inputs: dict, appended: list[int]) -> dict:
    """The model's inputs for the processor's prompt ``inputs`` followed by the tokens ``appended`` (an answer or a
    sampled completion): the ids joined, full attention, per-token inputs (``*token_type_ids``) 0 on the appended
    tokens, the pixel inputs as they are."""
    import torch

    ids = torch.cat([inputs["input_ids"], torch.tensor([appended])], dim=1)  # (1, T)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for name, value in inputs.items():
        if name in ("input_ids", "attention_mask"):
            continue
        if name.endswith("token_type_ids"):  # one per token: 0 on the appended tokens
            value = torch.cat([value, value.new_zeros((1, len(appended)))], dim=1)
        out[name] = value
    return out


#: per family, the tokens a VLM never samples, spelled out here (the test side's own list, not oxRL's): the image
#: (and video) token and the tokens that open and close an image's run of them
NEVER_SAMPLED = {
    **{qwen: ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>") for qwen in QWEN_VL},
    "gemma3": ("<image_soft_token>", "<start_of_image>", "<end_of_image>"),
    "llava": ("<image>",),
    "idefics3": ("<image>", "<fake_token_around_image>", "<global-img>"),
}


def never_sampled_ids(family: str, tokenizer) -> list[int]:
    """The ids of `NEVER_SAMPLED` in ``tokenizer``'s vocabulary, sorted."""
    return sorted(tokenizer.convert_tokens_to_ids(list(NEVER_SAMPLED[family])))


#: a reward (a plugin file's source) that varies inside every group of a random model's samples (so the losses and gradients are not zero)
VOWELS = """
from oxrl_core import Reward


class Vowels(Reward):
    name = "vowels"

    def score(self, prompts, completions, examples):
        return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]
"""
