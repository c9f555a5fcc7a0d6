"""`oxrl eval` on image rows: a vision-language model answers each prompt from its picture; a text model refuses.

The VLM case, through the real CLI on a tiny random Gemma-3 (`vlm_archs.py`; its greedy answers differ from one
picture to the next, where the tiny Qwen2-VL's are all newlines): a JSONL of image rows in every way a row gives its
picture (a relative path, a ``data:`` URI, a bare base64 string with a ``{"type": "image"}`` part) and a text row.
Each row's ``answer`` is the greedy completion of the training loops' held-out evaluation
(`evaluation.greedy_completions(..., vision=...)`, transformers' ``generate`` given the pixels) for that row, except
one row whose answer was generated from another picture: ``exact_match`` then scores every row but that one, so
pass@1 is 4/5 only when `oxrl eval` generated each answer from its own picture.

Measured at OMP_NUM_THREADS=1 on 2 shared cores: 13 s for the evaluation (its answers included), 10 s for the
refused one, well under 1 s for the rest.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from conftest import oxrl, write_jsonl
from vlm_archs import IMAGE_SIZE, build_vlm

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
QUESTION = "What colour is it?"
MAX_NEW_TOKENS = 6


def _pictures(folder: Path) -> dict[str, Path]:
    """One 32×32 PNG a colour, each with a differently coloured corner."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, (colour, rgb) in enumerate(COLOURS.items()):
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb)
        image.paste(Image.new("RGB", (8, 8), (i * 60, 0, 255 - i * 60)), (0, 0))
        image.save(folder / f"{colour}.png")
        paths[colour] = folder / f"{colour}.png"
    return paths


def _rows(folder: Path) -> list[dict]:
    """A text row first, then image rows giving their picture as a path, a data URI and bare base64 (with an image
    part in a messages prompt)."""
    pictures = _pictures(folder)
    b64 = {c: base64.b64encode(p.read_bytes()).decode() for c, p in pictures.items()}
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return [
        {"prompt": "What colour is the sky?"},
        {"prompt": f"<image>{QUESTION}", "images": ["red.png"]},
        {"prompt": f"Look: <image> {QUESTION}", "images": [f"data:image/png;base64,{b64['green']}"]},
        {"prompt": parts, "images": [b64["blue"]]},
        {"prompt": f"<image>{QUESTION}", "images": ["yellow.png"]},
    ]


def _held_out_answers(model_dir: Path, data: Path) -> list[str]:
    """The training loops' greedy held-out completions of the rows of ``data`` (their images through the processor,
    pixels given to ``generate``)."""
    import torch

    from oxrl_core.data.rows import normalise_row
    from oxrl_core.data.sources import load_data
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer
    from oxrl_core.models.vision import load_processing
    from oxrl_core.scoring.evaluation import greedy_completions

    source = load_data(str(data), "eval")
    # `_origin`: greedy_completions reads a relative image path from the row's file only when the row names it
    rows = [{**normalise_row(r, "prompt", source.origin), "_origin": source.origin} for r in source.rows]
    model = load_causal_lm(str(model_dir)).eval()
    tokenizer, vision = load_tokenizer(str(model_dir)), load_processing(str(model_dir))
    return greedy_completions(model, tokenizer, rows, MAX_NEW_TOKENS, len(rows), torch.device("cpu"), vision=vision)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return build_vlm("gemma3", tmp_path_factory.mktemp("vlm") / "gemma3")


@pytest.fixture
def image_rows(gemma3, tmp_path) -> Path:
    """The rows of `_rows` with their answers; the last row's answer is the one for the first image row's picture."""
    folder = tmp_path / "data"
    rows = _rows(folder)
    answers = _held_out_answers(gemma3, write_jsonl(folder / "rows.jsonl", rows))
    swapped = _held_out_answers(gemma3, write_jsonl(folder / "swapped.jsonl", [{**rows[4], "images": ["red.png"]}]))
    assert answers[4] != swapped[0], "the tiny model answers both pictures alike: the test would show nothing"
    assert len(set(answers[1:])) == 4, answers  # each picture its own answer
    return write_jsonl(folder / "eval.jsonl", [{**r, "answer": a} for r, a in zip(rows, answers[:4] + swapped)])


@pytest.mark.slow
def test_eval_generates_each_answer_from_its_picture(gemma3, image_rows, tmp_path):
    report_file = tmp_path / "report.json"
    proc = oxrl(
        "eval", "--model", str(gemma3), "--data", str(image_rows), "--reward", "exact_match",
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--json", "--output", str(report_file), cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    metrics = json.loads(proc.stdout)["metrics"]
    assert metrics["prompts"] == 5 and metrics["samples"] == 5
    assert metrics["pass@1"] == pytest.approx(0.8) and metrics["reward/mean"] == pytest.approx(0.8), metrics
    report = json.loads(report_file.read_text())
    assert [s["scores"] for s in report["samples"]] == [[1.0], [1.0], [1.0], [1.0], [0.0]], report["samples"]
    assert [s["row"] for s in report["samples"]] == [1, 2, 3, 4, 5]


def test_image_rows_with_a_text_model_are_refused_naming_the_row(image_rows, tiny_model_dir, tmp_path):
    proc = oxrl(
        "eval", "--model", str(tiny_model_dir), "--data", str(image_rows), "--reward", "exact_match", cwd=tmp_path
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    message = " ".join(proc.stderr.split())  # the error line, as wrapped on the terminal
    for needle in ("eval.jsonl: row 2: field 'images'", "--model", "text-only model", "vision-language model"):
        assert needle in message, (needle, message)


def test_image_rows_refuse_a_backend_without_images():
    """Before any model loads: a backend whose `image_support` gives a reason, naming the first image row.
    (``--env`` on image rows runs: multi-turn episodes start from image prompts, tests/test_vlm_episodes.py.)"""
    from oxrl_core.commands.eval_command import check_image_rows
    from oxrl_core.errors import OxrlError
    from oxrl_core.rollout.hf import HFRolloutBackend

    class TextOnlyBackend(HFRolloutBackend):
        name = "text_only"

        @classmethod
        def image_support(cls, model_path: str) -> str | None:
            return "it has no vision encoder"

    row = {"prompt": "<image>?", "images": ["red.png"], "_row": 7}
    with pytest.raises(OxrlError) as refused:
        check_image_rows(row, "d.jsonl", "", TextOnlyBackend, "m")
    assert str(refused.value).startswith("--backend text_only: d.jsonl: row 7: field 'images'")
    assert "it has no vision encoder" in str(refused.value) and "--backend hf" in str(refused.value)
    check_image_rows(row, "d.jsonl", "", HFRolloutBackend, "m")  # hf generates with the pixels
