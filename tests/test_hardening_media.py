"""Image input that cannot be trained right is refused, naming the row (issue 43, item 3): paths that are not regular
files or are too big, URLs, 16-bit and float images (scaled to 8 bits, not clipped), and a prompt holding the
model's own image-token text (a text row or an image row, whatever else the batch holds)."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import warm_starts
from conftest import write_jsonl
from PIL import Image

from oxrl_core.data import images
from oxrl_core.data.encode import prepare_examples
from oxrl_core.data.images import check_image_row, decode_image, row_images
from oxrl_core.data.sources import load_source
from oxrl_core.errors import OxrlError
from oxrl_core.models import vision


@pytest.fixture
def bounded():
    """A refusal must come at once: a read that blocks (a FIFO) fails the test after 20 s instead of hanging it."""

    def stuck(*_):
        raise AssertionError("decoding blocked")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def row_error(tmp_path, entry) -> str:
    """The error for a data file's second row whose one image is ``entry``; it names the file, row and entry."""
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "ok", "response": "ok"}, {"prompt": "<image>", "response": "r", "images": [entry]}],
    )
    source = load_source(str(path), "train")
    check_image_row(source.rows[1], source.origin)
    with pytest.raises(OxrlError) as exc:
        row_images(source.rows[1], source.origin)
    assert str(exc.value).startswith(f"{path}: row 2: field 'images[0]': "), exc.value
    return str(exc.value)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: (os.mkfifo(d / "pipe.png"), "pipe.png")[1], "pipe.png is a FIFO, not an image file"),
        (lambda d: "/dev/zero", "/dev/zero is a character device, not an image file"),
        (lambda d: ((d / "dir.png").mkdir(), "dir.png")[1], "dir.png is a directory, not an image file"),
        (lambda d: "https://example.com/cat.png", "'https://example.com/cat.png' is a URL, not fetched (oxRL works "
         "offline): give local paths, base64 or bytes"),
    ],
    ids=["fifo", "dev-zero", "directory", "url"],
)  # fmt: skip
def test_a_path_that_is_not_an_image_file_is_refused_at_once(tmp_path, bounded, make, expected):
    message = row_error(tmp_path, make(tmp_path))
    assert expected in message and "Traceback" not in message


def test_an_image_file_over_the_size_bound_is_refused_unread(tmp_path, bounded, monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_MB", 1)
    with open(tmp_path / "huge.png", "wb") as handle:
        handle.truncate(3 * 2**20)  # sparse: 3 MB that cost nothing
    assert "huge.png is larger than 1 MB, the most an image file may be" in row_error(tmp_path, "huge.png")
    assert images.MAX_IMAGE_MB == 1 and "`MAX_IMAGE_MB`" in images.__doc__


def test_16_bit_and_float_images_are_scaled_to_8_bits_not_clipped(tmp_path):
    gradient = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0..65520, 4,096 levels
    Image.fromarray(gradient).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    expected = np.rint(gradient / 257.0)
    for entry in ["g16.png", Image.fromarray(gradient.astype(np.int32))]:  # a file (I;16) and a decoded I image
        rgb = np.asarray(decode_image(entry, tmp_path, "row 1", "images[0]"))
        assert rgb.shape == (64, 64, 3) and np.abs(rgb[..., 0] - expected).max() <= 1
        assert len(np.unique(rgb)) == 256 and abs(rgb.mean() - expected.mean()) < 0.5  # not 5 grey levels near white
    unit = np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
    rgb = np.asarray(decode_image(Image.fromarray(unit), tmp_path, "row 1", "images[0]"))
    assert rgb.min() == 0 and rgb.max() == 255 and len(np.unique(rgb)) == 256
    for bad, what in [
        (unit * 300, "a F image with values 0..300"),
        (gradient.astype(np.int32) - 7, "a I image with values -7.."),
    ]:
        with pytest.raises(OxrlError, match=f"^row 1: field 'images\\[0\\]': {what}"):
            decode_image(Image.fromarray(bad), tmp_path, "row 1", "images[0]")


@pytest.fixture(scope="module")
def qwen2_vl():
    """The processing of the stored tiny Qwen2-VL warm start (read, not built)."""
    [stored] = sorted(warm_starts.STORED.glob("tiny-qwen2vl-*"))
    return vision.load_processing(str(stored))


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"prompt": "Explain the token <|image_pad|> please", "response": "a token"}, "prompt"),
        ({"prompt": "<image>What is <|vision_start|>?", "response": "r", "images": ["sq.png"]}, "prompt"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                       {"role": "assistant", "content": "<|image_pad|>"}]}, "messages[1].content"),
        ({"prompt": "q", "response": "says <|image_pad|>"}, "response"),
    ],
    ids=["text-row", "image-row", "assistant-turn", "response"],
)  # fmt: skip
def test_a_literal_image_token_is_refused_naming_row_and_field(tmp_path, qwen2_vl, bad, field):
    Image.new("RGB", (32, 32), (200, 0, 0)).save(tmp_path / "sq.png")
    image_row = {"prompt": "<image>What colour?", "response": "red", "images": ["sq.png"]}
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (image_row, bad)))
    with pytest.raises(OxrlError) as exc:
        prepare_examples(load_source(str(path), "train"), "prompt_response", qwen2_vl.tokenizer, 256, vision=qwen2_vl)
    found = "<|vision_start|>" if "vision_start" in json.dumps(bad) else "<|image_pad|>"
    assert str(exc.value).startswith(
        f"{path}: row 2: field '{field}': holds '{found}', text this model reads as an image token"
    )
    assert qwen2_vl.reserved_texts == ("<|image_pad|>", "<|video_pad|>", "<|vision_end|>", "<|vision_start|>")
    # the same rows without the literal token load
    path.write_text(json.dumps(image_row) + "\n" + json.dumps({"prompt": "Explain tokens", "response": "ok"}) + "\n")
    assert (
        len(
            prepare_examples(
                load_source(str(path), "train"), "prompt_response", qwen2_vl.tokenizer, 256, vision=qwen2_vl
            ).examples
        )
        == 2
    )
