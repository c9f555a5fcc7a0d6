"""`oxrl check-model` on vision-language models: the CLI on a tiny VLM of every verified family (tests/vlm_archs.py)
reports its vision section -- family, vision tower and projector, processor, image token, image tokens per image,
extra inputs -- and the image paths, each checked against the model and its processor loaded here; a VLM saved
without its processor is still trainable on text; a VLM of an unverified family is an error naming the verified
ones (the console script: exit 2, no traceback)."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import vlm_archs
from conftest import oxrl
from PIL import Image

from oxrl_core.config import ModelConfig
from oxrl_core.models import vision

#: per family: the vision tower's module, the projector's (None: inside the tower), the processor class and the image
#: tokens of one 32×32 image (vlm_archs' table)
EXPECTED = {
    "qwen2_vl": ("model.visual", None, "Qwen2VLProcessor", 4),
    "gemma3": ("model.vision_tower", "model.multi_modal_projector", "Gemma3Processor", 4),
    "llava": ("model.vision_tower", "model.multi_modal_projector", "LlavaProcessor", 16),
    "idefics3": ("model.vision_model", "model.connector", "Idefics3Processor", 20),
    "qwen2_5_vl": ("model.visual", None, "Qwen2_5_VLProcessor", 4),
    "qwen3_vl": ("model.visual", None, "Qwen3VLProcessor", 4),
    "qwen3_5": ("model.visual", None, "Qwen3VLProcessor", 4),
    "qwen3_5_moe": ("model.visual", None, "Qwen3VLProcessor", 4),
}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """``vlm_dir(family)``: the family's tiny VLM directory, built once per module."""
    root = tmp_path_factory.mktemp("vlms")
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = vlm_archs.build_vlm(family, root / family)
        return built[family]

    return get


def check_json(path) -> tuple[int, dict]:
    """The real CLI in-process with ``--json`` (as tests/test_check_model.py runs it): (exit status, report)."""
    from typer.testing import CliRunner

    from oxrl_core.cli import app

    result = CliRunner().invoke(app, ["check-model", str(path), "--json"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, json.loads(result.stdout)


def image_tokens(processor, image_id: int, size: tuple[int, int]) -> tuple[int, list[str]]:
    """(image tokens, extra inputs) of one image, found independently of oxRL: the chat template's rendering of a user
    turn with one image part, encoded by the processor with a ``size`` RGB image."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[[Image.new("RGB", size, (200, 30, 30))]], return_tensors="pt")
    return int((out["input_ids"][0] == image_id).sum()), sorted(set(out) - {"input_ids", "attention_mask"})


@pytest.mark.parametrize("family", vlm_archs.FAMILIES)
def test_check_model_reports_a_vlm(family, vlm_dir):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = vlm_dir(family)
    status, report = check_json(path)
    assert status == 0 and report["ok"], report["problems"]

    config = AutoConfig.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    processor = vision.load_processor(str(path))
    tower, projector, processor_class, per_image = EXPECTED[family]
    vis = report["vision"]

    # the family, and the parts of the model, counted on an independent load
    assert vis["family"] == family == config.model_type and vis["verified"]
    assert vis["verified_families"] == list(vision.FAMILIES)
    assert report["architecture"] == type(model).__name__ == config.architectures[0]
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert vis["tower"]["module"] == tower
    assert vis["tower"]["class"] == type(model.get_submodule(tower)).__name__
    assert vis["tower"]["parameters"] == sum(p.numel() for p in model.get_submodule(tower).parameters()) > 0
    assert vis["tower"]["config_model_type"] == config.vision_config.model_type
    if projector is None:
        assert vis["projector"] is None
    else:
        assert vis["projector"]["module"] == projector
        assert vis["projector"]["parameters"] == sum(p.numel() for p in model.get_submodule(projector).parameters())
    language = model.get_decoder()
    assert vis["language_model"]["parameters"] == sum(p.numel() for p in language.parameters())

    # the processor, the image token, and the image tokens the processor makes of a 32×32 and a 64×64 image
    assert vis["processor"]["class"] == type(processor).__name__ == processor_class
    assert vis["processor"]["without_video"] is (
        family in vlm_archs.QWEN_VL and not hasattr(processor, "video_processor")
    )
    image_id = config.image_token_id if hasattr(config, "image_token_id") else config.image_token_index
    assert vis["image_token"]["id"] == image_id == vision.image_token_id(config)
    assert vis["image_token"]["token"] == processor.tokenizer.convert_ids_to_tokens(image_id)
    count, extra = image_tokens(processor, image_id, (32, 32))
    assert vis["tokens_per_image"]["32x32"] == count == per_image
    assert vis["tokens_per_image"]["64x64"] == image_tokens(processor, image_id, (64, 64))[0]
    assert sorted(vis["extra_inputs"]) == extra
    assert vis["tokens"] == (
        "fixed" if family in ("gemma3", "llava") else "grid" if family in vlm_archs.QWEN_VL else "tiles"
    )
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    assert vis["placeholder"] in text

    # the language model's parts, from its text config
    text_config = config.get_text_config()
    assert report["attention"]["num_layers"] == text_config.num_hidden_layers == 2
    assert report["attention"]["head_dim"] == 32 and report["paths"]["vllm_cpu"]["applies"]
    assert report["vocab"]["embedding_rows"] == model.get_input_embeddings().weight.shape[0]
    assert report["tokens"]["eos"]["id"] == processor.tokenizer.eos_token_id is not None
    assert report["chat_template"]["present"] and report["chat_template"]["renders_conversation"]

    # the paths: images trained, their rows padded or packed, the vision tower frozen by default, LoRA on the
    # language model
    paths = report["paths"]
    assert paths["images"]["applies"] and "SFT, KD and preference" in paths["images"]["detail"]
    packing = paths["image_packing"]
    if family in vlm_archs.QWEN_VL:  # every Qwen-VL family packs: packed rows get their own rotary positions
        assert packing["applies"] and "exactly" in packing["detail"]
    else:
        assert not packing["applies"] and "padding" in packing["detail"] and "Qwen-VL" not in packing["detail"]
    assert paths["freeze_vision"]["applies"] is getattr(ModelConfig(), "freeze_vision", False)
    assert paths["lora"]["applies"] and "the language model only" in paths["lora"]["detail"]
    assert tower.rsplit(".", 1)[-1] in paths["lora"]["detail"].split("left out: ")[1]
    assert {"q_proj", "o_proj"} <= set(report["lora_targets"]) and "lm_head" not in report["lora_targets"]

    # the table shows the vision section
    from rich.console import Console

    from oxrl_core.commands.check_model_render import render

    console = Console(file=io.StringIO(), width=200)
    render(report, console)
    table = console.file.getvalue()
    assert f"{family} (verified)" in table and tower in table and processor_class in table
    assert f"{per_image} for 32×32" in table and f"({image_id})" in table
    assert ("built without its video processor" in table) is vis["processor"]["without_video"]


def test_check_model_vlm_without_its_processor(vlm_dir, tmp_path):
    """A VLM saved without its processor (no processor or image processor config): still trainable on text rows
    (exit 0), a warning that rows with images cannot be encoded, the images path off; the model still reported."""
    path = shutil.copytree(vlm_dir("gemma3"), tmp_path / "noproc")
    for name in ("processor_config.json", "preprocessor_config.json"):
        (path / name).unlink(missing_ok=True)
    status, report = check_json(path)
    assert status == 0 and report["ok"], report["problems"]
    vis = report["vision"]
    assert vis["processor"] is None and vis["tokens_per_image"] is None
    assert vis["tower"]["module"] == "model.vision_tower" and vis["image_token"]["token"] == "<image_soft_token>"
    (warning,) = [p for p in report["problems"] if "processor" in p["problem"]]
    assert warning["severity"] == "warning" and "rows with images cannot be encoded" in warning["problem"]
    assert "preprocessor_config.json" in warning["fix"]
    assert not report["paths"]["images"]["applies"] and "no processor" in report["paths"]["images"]["detail"]


def test_check_model_refuses_an_unverified_vlm_family(vlm_dir, tmp_path):
    """A tiny PaliGemma (an image-text-to-text model oxRL has not been verified on), through the console script: an
    error naming the verified families, exit status 2, the report still printed, no traceback."""
    import transformers as tf

    path = shutil.copytree(vlm_dir("gemma3"), tmp_path / "paligemma")  # its tokenizer; model and config replaced
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    text = tf.GemmaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    vision_config = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = tf.PaliGemmaConfig(
        text_config=text.to_dict(),
        vision_config=vision_config.to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
    )
    assert vision.is_vlm_config(config) and config.model_type not in vision.FAMILIES
    tf.PaliGemmaForConditionalGeneration(config).save_pretrained(path)

    done = oxrl("check-model", str(path), "--json", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    assert not report["ok"] and report["model_type"] == "paligemma"
    assert report["vision"] == {"family": "paligemma", "verified": False, "verified_families": list(vision.FAMILIES)}
    (error,) = [p for p in report["problems"] if p["severity"] == "error"]
    assert "'paligemma' is a vision-language model oxRL has not been verified on" in error["problem"]
    assert all(family in error["problem"] for family in vision.FAMILIES)
    assert report["parameters"] is None and report["tokens"]["eos"]["id"] is not None  # not loaded; tokenizer read

    # the table says so too (rendered from the report, without a second run)
    from rich.console import Console

    from oxrl_core.commands.check_model_render import render

    console = Console(file=io.StringIO(), width=200)
    render(report, console)
    table = console.file.getvalue()
    assert "paligemma: not verified" in table and "cannot train this model" in table
