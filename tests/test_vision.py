"""Vision-language models, the foundation (issue 28): tiny VLMs of every verified family (`vlm_archs`) load through
`oxrl_core.models.vision` with their own class and processor, encode a prompt with images exactly as the model's
processor does, mark the image tokens, and train on the result; image rows decode and are checked
(`oxrl_core.data.images`) with errors naming the file, the row and the field."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
import vlm_archs
from conftest import write_jsonl
from PIL import Image

from oxrl_core.data.images import check_image_row, is_image_row, row_images
from oxrl_core.data.sources import load_source
from oxrl_core.errors import OxrlError
from oxrl_core.models import vision

#: per family: the model class, the processor class, image tokens for one 32×32 image, and whether it is a fixed count
EXPECTED = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", 4, False),
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor", 4, True),
    "llava": ("LlavaForConditionalGeneration", "LlavaProcessor", 16, True),
    "idefics3": ("Idefics3ForConditionalGeneration", "Idefics3Processor", 20, False),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", 4, False),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", 4, False),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor", 4, False),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "Qwen3VLProcessor", 4, False),
}
FAMILIES = vlm_archs.FAMILIES
QUESTION = "What colour is the square?"


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


def square(colour=(255, 0, 0), size=(32, 32)) -> Image.Image:
    """A coloured square on grey, ``size`` = (width, height)."""
    image = Image.new("RGB", size, (128, 128, 128))
    w, h = size
    image.paste(colour, (w // 4, h // 4, 3 * w // 4, 3 * h // 4))
    return image


def conversation(n_images: int = 1) -> list[dict]:
    """A system turn and a user turn with ``n_images`` image parts around the question."""
    parts = [{"type": "image"}, {"type": "text", "text": QUESTION}] + [{"type": "image"}] * (n_images - 1)
    return [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": parts}]


# ----------------------------------------------------------------------------- loading


def test_the_families_are_the_verified_ones():
    assert set(FAMILIES) == set(vision.FAMILIES) == set(EXPECTED)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_vlm_loads_with_its_own_class_and_processor(family, vlm_dir):
    model_class, processor_class, _, _ = EXPECTED[family]
    path = str(vlm_dir(family))
    assert vision.is_vlm(path)
    model = vision.load_vlm(path)
    assert type(model).__name__ == model_class
    assert next(model.parameters()).dtype == torch.float32
    processing = vision.load_processing(path)
    assert type(processing.processor).__name__ == processor_class
    assert processing.family is vision.FAMILIES[family]
    assert processing.image_token_id == vision.image_token_id(model.config)
    assert processing.processor.chat_template == processing.tokenizer.chat_template


@pytest.mark.parametrize("family", vlm_archs.QWEN_VL)
def test_qwen_vl_processor_is_built_without_its_video_part(family, vlm_dir):
    """`AutoProcessor` needs torchvision for a Qwen-VL processor's video processor; `load_processor` builds the
    processor from the tokenizer and the PIL image processor instead, an instance of the real class (the one the
    checkpoint names: Qwen3-VL and Qwen3.5 share `Qwen3VLProcessor`) without the video part."""
    import transformers
    from transformers import AutoProcessor

    path = str(vlm_dir(family))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="(?i)torchvision"):
            AutoProcessor.from_pretrained(path)
    processor = vision.load_processor(path)
    processor_class = getattr(transformers, vlm_archs.QWEN_PROCESSORS[family])
    assert isinstance(processor, processor_class) and not hasattr(processor, "video_processor")
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert processor.image_processor.patch_size == 8


@pytest.mark.parametrize("family", vlm_archs.QWEN_VL)
def test_qwen_vl_without_video_encodes_as_its_parts_do(family, vlm_dir):
    """Independent of the processor class: the template's text with each ``<|image_pad|>`` repeated once per merged
    patch (grid t·h·w / 2²), tokenized by the tokenizer alone, and the pixels of the PIL image processor alone."""
    from transformers import AutoImageProcessor, AutoTokenizer

    path = str(vlm_dir(family))
    images = [square(), square((0, 0, 255), (64, 32))]
    encoding = vision.load_processing(path).encode(conversation(2), images)
    tokenizer, image_processor = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    pixels = image_processor(images, return_tensors="pt")
    counts = [int(n) // 4 for n in pixels["image_grid_thw"].prod(-1)]  # 4 and 8 tokens
    pieces = tokenizer.apply_chat_template(conversation(2), tokenize=False, add_generation_prompt=True).split(
        "<|image_pad|>"
    )
    text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    assert encoding.input_ids.tolist() == tokenizer(text)["input_ids"]
    assert torch.equal(encoding.pixel_inputs["pixel_values"], pixels["pixel_values"])
    assert torch.equal(encoding.pixel_inputs["image_grid_thw"], pixels["image_grid_thw"])
    assert encoding.pixel_inputs["mm_token_type_ids"][0].tolist() == encoding.image_mask.long().tolist()


def test_the_processor_without_video_loads_from_transformers_5s_layout_too(vlm_dir, tmp_path):
    """A checkpoint saved by transformers 5 keeps both sub-processors in ``processor_config.json``; the video
    processor's entry is not read (it would need torchvision) and the image processor's is."""
    import shutil

    path = tmp_path / "qwen2_vl"
    shutil.copytree(vlm_dir("qwen2_vl"), path)
    image_processor = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").unlink()
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 8, "merge_size": 2}
    (path / "processor_config.json").write_text(
        json.dumps(
            {"processor_class": "Qwen2VLProcessor", "image_processor": image_processor, "video_processor": video}
        )
    )
    processing = vision.load_processing(str(path))
    assert not hasattr(processing.processor, "video_processor")
    assert processing.tokens_per_image(square()) == EXPECTED["qwen2_vl"][2]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_processor_loads_again_and_encodes_the_same(family, vlm_dir, tmp_path):
    """What ``final/`` will do: the loaded processor saved and loaded again (Qwen2-VL's without its video part)."""
    processing = vision.load_processing(str(vlm_dir(family)))
    processing.processor.save_pretrained(tmp_path / "saved")
    again = vision.load_processor(str(tmp_path / "saved"))
    assert type(again).__name__ == EXPECTED[family][1]
    images = [square(), square((0, 0, 255), (64, 32))]
    first = processing.encode(conversation(2), images)
    second = vision.VLMProcessing(again, processing.family, processing.image_token_id).encode(conversation(2), images)
    assert torch.equal(first.input_ids, second.input_ids) and first.text == second.text
    assert all(torch.equal(first.pixel_inputs[k], second.pixel_inputs[k]) for k in first.pixel_inputs)


def test_a_text_model_is_not_a_vlm(tmp_path):
    from archs import build_arch

    path = str(build_arch("qwen3", tmp_path / "qwen3"))
    assert not vision.is_vlm(path)
    with pytest.raises(OxrlError, match="model.name: .* is not a vision-language model"):
        vision.load_vlm(path)


def test_a_vlm_of_an_unverified_family_is_refused_by_name():
    from transformers import PaliGemmaConfig

    config = PaliGemmaConfig()
    assert vision.is_vlm_config(config)
    with pytest.raises(OxrlError, match="'paligemma' is a vision-language model oxRL has not been verified on"):
        vision.vision_family(config)


# ----------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_gives_what_the_processor_gives_called_directly(family, vlm_dir):
    """The chat template rendered to text, then the processor on the text and the images (BOS added unless the
    template wrote it): the same ids and pixel inputs as `VLMProcessing.encode`."""
    processing = vision.load_processing(str(vlm_dir(family)))
    processor, images = processing.processor, [square(), square((0, 0, 255), (48, 32))]
    encoding = processing.encode(conversation(2), images)

    text = processor.tokenizer.apply_chat_template(conversation(2), tokenize=False, add_generation_prompt=True)
    assert encoding.text == text
    bos = processor.tokenizer.bos_token
    direct = processor(
        text=[text], images=[images], return_tensors="pt", add_special_tokens=not (bos and text.startswith(bos))
    )
    assert torch.equal(encoding.input_ids, direct["input_ids"][0])
    assert set(encoding.pixel_inputs) == set(direct) - {"input_ids", "attention_mask"}
    assert set(encoding.pixel_inputs) == set(vision.FAMILIES[family].extra_inputs)
    for key, value in encoding.pixel_inputs.items():
        assert torch.equal(value, direct[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_marker_in_a_prompt_string_is_an_image_part(family, vlm_dir):
    processing = vision.load_processing(str(vlm_dir(family)))
    marked = processing.encode(f"<image>{QUESTION}", [square()])
    parts = processing.encode(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], [square()]
    )
    assert torch.equal(marked.input_ids, parts.input_ids)
    assert marked.text == parts.text


@pytest.mark.parametrize("family", FAMILIES)
def test_image_tokens_are_marked(family, vlm_dir):
    _, _, per_image, fixed = EXPECTED[family]
    processing = vision.load_processing(str(vlm_dir(family)))
    encoding = processing.encode(conversation(2), [square(), square((0, 255, 0))])
    ids, mask = encoding.input_ids, encoding.image_mask
    assert mask.dtype == torch.bool and mask.shape == ids.shape
    assert int(mask.sum()) == 2 * per_image
    assert (ids[mask] == processing.image_token_id).all() and not (ids[~mask] == processing.image_token_id).any()
    question = processing.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    assert not mask[-len(question) - 8 :].all()  # the text after the images is not marked
    assert processing.tokens_per_image(square()) == per_image
    if fixed:
        assert processing.tokens_per_image(square(size=(64, 32))) == per_image
    text_only = processing.encode(QUESTION, [])
    assert not text_only.image_mask.any() and "pixel_values" not in text_only.pixel_inputs


def test_qwen2_vl_tokens_per_image_follow_the_patch_grid(vlm_dir):
    processing = vision.load_processing(str(vlm_dir("qwen2_vl")))
    assert processing.tokens_per_image(square(size=(32, 32))) == 4  # a 4×4 grid of 8-pixel patches, merged 2×2
    assert processing.tokens_per_image(square(size=(64, 32))) == 8  # 8×4
    encoding = processing.encode(f"<image>{QUESTION}", [square(size=(64, 32))])
    assert encoding.pixel_inputs["image_grid_thw"].tolist() == [[1, 4, 8]]
    assert encoding.pixel_inputs["pixel_values"].shape == (32, 3 * 2 * 8 * 8)  # (patches, C·t·p·p)


@pytest.mark.parametrize("family", FAMILIES)
def test_pixels_batch_by_what_the_family_says(family, vlm_dir):
    """Two rows (one image; two images, one of them 64×32) through the processor as one batch: dimension 0 of
    ``pixel_values`` counts what `VisionFamily.pixels_by` says -- what cutting a batch into micro-batches must
    follow."""
    processing = vision.load_processing(str(vlm_dir(family)))
    spec, placeholder = processing.family, processing.family.placeholder
    images = [[square()], [square(), square(size=(64, 32))]]
    out = processing.processor(
        text=[f"{placeholder}a", f"{placeholder}{placeholder}b"], images=images, padding=True, return_tensors="pt"
    )
    pixels = out["pixel_values"]
    if spec.pixels_by == "patch":  # 16 + 16 + 32 patches, one grid row per image
        grid = out["image_grid_thw"]
        assert grid.shape == (3, 3) and pixels.shape[0] == int(grid.prod(-1).sum()) == 64
    elif spec.pixels_by == "image":
        assert pixels.shape[:2] == (3, 3)
    else:  # one entry per row, tiles padded: 5 (2×2 + global) and 5 + 3 (2×1 + global)
        assert spec.pixels_by == "row" and pixels.shape[:2] == (2, 8)
        assert out["pixel_attention_mask"][0, 5:].sum() == 0 and out["pixel_attention_mask"][1].flatten(1).any(-1).all()


def test_a_marker_without_images_is_text(vlm_dir):
    processing = vision.load_processing(str(vlm_dir("gemma3")))
    encoding = processing.encode("What is <image> in HTML?", [])
    assert "<image>" in encoding.text and not encoding.image_mask.any()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forward_on_the_encoding_trains_and_generates(family, vlm_dir):
    """Loss over the text after the images (image tokens never count): finite, different for another image (the
    pixels are read), with gradients in the vision tower; and generation runs on the same inputs."""
    path = str(vlm_dir(family))
    processing, model = vision.load_processing(path), vision.load_vlm(path)
    torch.manual_seed(0)

    def loss_of(image):
        encoding = processing.encode(f"<image>{QUESTION}", [image])
        ids = encoding.input_ids[None]  # (1, T)
        labels = ids.masked_fill(encoding.image_mask[None], -100)  # (1, T)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, **encoding.pixel_inputs)
        return out.loss, encoding

    loss, encoding = loss_of(square())
    assert torch.isfinite(loss)
    loss.backward()
    vision_grads = [
        p.grad for n, p in model.named_parameters() if ("vision" in n or "visual" in n) and p.grad is not None
    ]
    assert vision_grads and any(g.abs().sum() > 0 for g in vision_grads)
    with torch.no_grad():
        assert abs(loss_of(square((0, 0, 255)))[0].item() - loss.item()) > 1e-6
        ids = encoding.input_ids[None]
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **encoding.pixel_inputs,
            max_new_tokens=3,
            do_sample=False,
        )
    assert out.shape == (1, ids.shape[1] + 3)


# ----------------------------------------------------------------------------- image rows: decoding


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_parquet(path, rows: list[dict]):
    """Rows as a Parquet file, the way `datasets` stores an ``Image`` feature: ``{"bytes", "path"}`` structs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_paths_and_base64_strings_decode_to_rgb(tmp_path):
    (tmp_path / "img").mkdir()
    square().save(tmp_path / "img" / "red.png")
    encoded = base64.b64encode(_png(square((0, 0, 255)))).decode()
    urlsafe = base64.urlsafe_b64encode(_png(square((0, 0, 255)))).decode().rstrip("=")
    row = {
        "prompt": "<image>" * 5,
        "response": "red",
        "images": [
            "img/red.png",  # relative to the data file
            str(tmp_path / "img" / "red.png"),  # absolute
            encoded,  # base64
            "data:image/png;base64," + encoded,  # a data URI
            urlsafe,  # the URL-safe alphabet, unpadded
        ],
    }
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    source = load_source(str(path), "train")
    images = row_images(source.rows[0], source.origin)
    assert [im.mode for im in images] == ["RGB"] * 5
    assert images[0].size == (32, 32) and images[0].getpixel((16, 16)) == (255, 0, 0) == images[1].getpixel((16, 16))
    assert images[2].getpixel((16, 16)) == (0, 0, 255) == images[3].getpixel((16, 16)) == images[4].getpixel((16, 16))
    assert check_image_row(source.rows[0], source.origin) == 5
    assert row_images({"prompt": "hi"}, "d.jsonl") == []


def test_image_structs_from_parquet_and_decoded_images_decode_to_rgb(tmp_path):
    """A Parquet file of a `datasets` Image feature (``bytes`` set, or only ``path``), raw bytes, a PIL image."""
    square((0, 255, 0)).save(tmp_path / "green.png")
    rgba = Image.new("RGBA", (8, 8), (0, 255, 0, 128))
    structs = [{"bytes": _png(rgba), "path": None}, {"bytes": None, "path": "green.png"}]
    rows = [{"prompt": "<image><image>", "response": "r", "images": structs}]
    source = load_source(str(write_parquet(tmp_path / "d.parquet", rows)), "train")
    images = row_images(source.rows[0], source.origin)
    assert [(im.mode, im.size) for im in images] == [("RGB", (8, 8)), ("RGB", (32, 32))]
    assert images[1].getpixel((16, 16)) == (0, 255, 0)
    direct = row_images({"images": [_png(rgba), rgba], "_row": 1}, "mem")
    assert [(im.mode, im.size) for im in direct] == [("RGB", (8, 8))] * 2


def _row_error(tmp_path, row: dict) -> str:
    """The error `check_image_row` then `row_images` give for ``row``, the second row of a data file (Parquet where
    the row holds bytes, JSON Lines otherwise); it must name the file and the row."""
    first = {**row, "images": None, "prompt": "ok", "response": "ok"}
    if isinstance(row["images"], list) and "bytes" in repr(row["images"]):
        path = write_parquet(tmp_path / "d.parquet", [first, row])
    else:
        path = write_jsonl(tmp_path / "d.jsonl", [first, row])
    source = load_source(str(path), "train")
    with pytest.raises(OxrlError) as exc:
        check_image_row(source.rows[1], source.origin)
        row_images(source.rows[1], source.origin)
    message = str(exc.value)
    assert message.startswith(f"{path}: row 2: field '"), message
    return message


@pytest.mark.parametrize(
    "images, expected",
    [
        (["missing.png"], "field 'images[0]': no such file"),
        ([{"bytes": None, "path": "nowhere/missing.png"}], "field 'images[0]': no such file"),
        (["data:image/png;base64,bm90IGFuIGltYWdl"], "field 'images[0]': cannot decode the base64 string as an image"),
        ([{"bytes": b"not an image", "path": None}], "field 'images[0]': cannot decode the bytes as an image"),
        ([{"path": ""}], "field 'images[0]': an image object needs 'bytes' or 'path'"),
        ([3], "field 'images[0]' must be a local path, a base64 string"),
        ("one.png", "field 'images' must be a list of images"),
    ],
)
def test_a_bad_images_entry_is_named(tmp_path, images, expected):
    prompt = "<image>" * (len(images) if isinstance(images, list) else 1)
    assert expected in _row_error(tmp_path, {"prompt": prompt, "response": "r", "images": images})


def test_the_second_undecodable_image_is_named(tmp_path):
    square().save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    message = _row_error(tmp_path, {"prompt": "<image><image>", "response": "r", "images": ["ok.png", "broken.png"]})
    assert "field 'images[1]': cannot decode" in message and "broken.png" in message


# ----------------------------------------------------------------------------- image rows: placement and counts


@pytest.mark.parametrize("field", ["response", "chosen", "rejected", "completion"])
def test_an_image_marker_on_the_response_side_is_refused(tmp_path, field):
    row = {"prompt": "<image>Which colour?", field: "It is <image> red", "images": [_b64()]}
    message = _row_error(tmp_path, row)
    assert f"field '{field}': holds an <image> marker; images go on the prompt side only" in message


def test_an_image_in_an_assistant_turn_is_refused(tmp_path):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]},
        {"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "red"}]},
    ]
    message = _row_error(tmp_path, {"messages": messages, "images": [_b64(), _b64()]})
    assert "field 'messages[1].content[0]': an image in an assistant turn" in message


def test_an_image_marker_in_an_assistant_turn_is_refused(tmp_path):
    messages = [{"role": "user", "content": "<image>Which colour?"}, {"role": "assistant", "content": "<image> red"}]
    message = _row_error(tmp_path, {"messages": messages, "images": [_b64()]})
    assert "field 'messages[1]': an <image> marker in an assistant turn" in message


@pytest.mark.parametrize(
    "row, images, placeholders",
    [
        ({"prompt": "<image>Which colour?", "response": "red"}, 2, 1),
        ({"prompt": "<image><image>Which colour?", "response": "red"}, 1, 2),
        ({"prompt": [{"role": "user", "content": [{"type": "image"}]}], "chosen": "a", "rejected": "b"}, 0, 1),
        ({"messages": conversation(2) + [{"role": "assistant", "content": "red"}]}, 3, 2),
    ],
)
def test_placeholders_and_images_must_match_in_number(tmp_path, row, images, placeholders):
    row = {**row, "images": [_b64()] * images}
    message = _row_error(tmp_path, row)
    assert f"field 'images': {images} image(s) but {placeholders} image placeholder(s) in the prompt" in message


def test_image_rows_that_are_right_pass():
    one = _b64()
    rows = [
        {"prompt": "<image>Which colour?", "response": "red", "images": [one]},
        {"prompt": "<image> or <image>?", "chosen": "a", "rejected": "b", "images": [one, one]},
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}]}],
            "completion": "x",
            "label": True,
            "images": [one],
        },
        {"messages": conversation(2) + [{"role": "assistant", "content": "red"}], "images": [one, one]},
    ]
    assert [check_image_row(r, "d.jsonl") for r in rows] == [1, 2, 1, 2]
    assert all(is_image_row(r) for r in rows)
    text = {"prompt": "What is <image> in HTML?", "response": "a tag"}  # no images: a text row, markers and all
    assert check_image_row(text, "d.jsonl") == 0 and not is_image_row(text)


@pytest.mark.parametrize(
    "part, expected",
    [
        (
            {"type": "audio"},
            'field \'messages[0].content[1]\' must be {"type": "text", "text": ...} or {"type": "image"}, got type \'audio\'',
        ),
        (
            "an image",
            'field \'messages[0].content[1]\' must be {"type": "text", "text": ...} or {"type": "image"}, got str',
        ),
        ({"type": "text", "text": 3}, "field 'messages[0].content[1].text' must be a string, got int"),
    ],
)
def test_a_bad_content_part_is_named(tmp_path, part, expected):
    messages = [{"role": "user", "content": [{"type": "image"}, part]}, {"role": "assistant", "content": "red"}]
    assert expected in _row_error(tmp_path, {"messages": messages, "images": [_b64()]})


def test_parts_with_null_keys_as_parquet_gives_them(vlm_dir):
    """`datasets` and Parquet give every part every key (``{"type": "image", "text": None}``): counted and encoded
    as the parts without them."""
    padded = [
        {
            "role": "user",
            "content": [{"type": "image", "text": None}, {"type": "text", "text": QUESTION, "image": None}],
        }
    ]
    clean = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    assert check_image_row({"prompt": padded, "response": "red", "images": [_b64()]}, "d.jsonl") == 1
    processing = vision.load_processing(str(vlm_dir("qwen2_vl")))
    assert torch.equal(processing.encode(padded, [square()]).input_ids, processing.encode(clean, [square()]).input_ids)


def _b64() -> str:
    return base64.b64encode(_png(square())).decode()


def test_a_row_with_images_encodes_end_to_end(tmp_path, vlm_dir):
    """A JSONL row with a relative image path: decoded, checked, encoded by the family's processor."""
    square((0, 255, 0)).save(tmp_path / "green.png")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": f"<image>{QUESTION}", "response": "green", "images": ["green.png"]}) + "\n")
    source = load_source(str(path), "train")
    row = source.rows[0]
    assert check_image_row(row, source.origin) == 1
    processing = vision.load_processing(str(vlm_dir("qwen2_vl")))
    encoding = processing.encode(row["prompt"], row_images(row, source.origin))
    assert int(encoding.image_mask.sum()) == EXPECTED["qwen2_vl"][2]
