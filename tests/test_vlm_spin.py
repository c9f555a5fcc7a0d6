"""SPIN on image rows: the rejected answers are generated from each prompt with its picture, and the pairs train.

- `generate_rejected` hands the backend each row's own image inputs (a recording backend: the very dicts of the
  examples, in row order; a text batch calls ``generate`` without ``images``, as a backend written before image
  prompts expects);
- with a real tiny Qwen2-VL (`vlm_archs.py`) behind the hf backend, the same prompt tokens under the same seed give
  other rejected answers when the rows' pictures are exchanged: the generation read the pixels;
- one short SPIN run through the real CLI on a tiny Qwen2-VL and a tiny Gemma-3 (two iterations, so the reference
  is reloaded from the policy once): finite losses, and final/ saved as a VLM with its processor.

Measured at OMP_NUM_THREADS=1 on 2 shared cores: the CLI runs 17 s (Qwen2-VL) and 11 s (Gemma-3), the
generation check 7 s, the recording backend 6 s (the first import of torch).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl
from vlm_archs import IMAGE_SIZE, build_vlm

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
PROMPT = "<image>What colour is it?"


def _rows(folder: Path) -> list[dict]:
    """Four ``prompt_response`` rows asking the same question about four pictures of one colour each."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (colour, rgb) in enumerate(COLOURS.items()):
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb)
        image.paste(Image.new("RGB", (8, 8), (0, i * 60, 255 - i * 60)), (0, 0))
        image.save(folder / f"{colour}.png")
        rows.append({"prompt": PROMPT, "images": [f"{colour}.png"], "response": colour})
    return rows


class RecordingBackend:
    """A rollout backend that answers every prompt with one fixed token and records what it was given."""

    def __init__(self):
        self.calls: list[dict] = []

    def generate(self, prompt_token_ids, sampling, **kwargs):
        from oxrl_core.interfaces import Completion

        self.calls.append({"prompts": prompt_token_ids, "sampling": sampling, **kwargs})
        return [[Completion([7], [0.0], "length", 0)] for _ in prompt_token_ids]


def test_generate_rejected_gives_the_backend_each_rows_image_inputs():
    from oxrl_core.config import RolloutConfig
    from oxrl_core.loops.preference import generate_rejected

    pixels = [{"pixel_values": object()}, {"pixel_values": object()}]
    examples = [
        {"prompt_ids": [1, 2], "chosen_ids": [3], "pixel_inputs": pixels[0], "token_inputs": {}, "pixels_by": "patch"},
        {"prompt_ids": [4], "chosen_ids": [5]},  # a text row of the same micro-batch
        {"prompt_ids": [6], "chosen_ids": [5], "pixel_inputs": pixels[1], "token_inputs": {}, "pixels_by": "patch"},
    ]
    backend = RecordingBackend()
    ro = RolloutConfig(max_new_tokens=5, temperature=0.7, top_p=0.9)
    assert generate_rejected(backend, examples, ro, seed=11) == [[7], [7], [7]]
    [call] = backend.calls
    assert call["prompts"] == [[1, 2], [4], [6]]
    assert [fields.get("pixel_inputs") for fields in call["images"]] == [pixels[0], None, pixels[1]]
    assert call["images"][0]["pixel_inputs"] is pixels[0] and call["images"][1] == {}  # the row's own, no copy
    assert (call["sampling"].n, call["sampling"].max_new_tokens, call["sampling"].seed) == (1, 5, 11)
    assert (call["sampling"].temperature, call["sampling"].top_p) == (0.7, 0.9)

    text_only = RecordingBackend()
    generate_rejected(text_only, [examples[1]], ro, seed=11)
    assert "images" not in text_only.calls[0]  # a text batch: generate(prompts, sampling), as before images


def test_rejected_answers_are_generated_from_the_picture(tmp_path):
    """Same prompt tokens, same seed, same batch: exchanging the rows' pictures changes what the reference
    generates. A generation that ignored the pixels would give the same tokens both times."""
    from oxrl_core.config import RolloutConfig
    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_data
    from oxrl_core.loops.preference import generate_rejected
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer
    from oxrl_core.models.vision import load_processing, placeholder_token_ids
    from oxrl_core.rollout.hf import HFRolloutBackend

    model_dir = build_vlm("qwen2_vl", tmp_path / "qwen2_vl")
    data = write_jsonl(tmp_path / "data" / "spin.jsonl", _rows(tmp_path / "data"))
    tokenizer = load_tokenizer(str(model_dir))
    examples = prepare_examples(
        load_data(str(data), "train"),
        "prompt_response",
        tokenizer,
        512,
        self_play=True,
        vision=load_processing(str(model_dir)),
    ).examples
    assert len({tuple(ex["prompt_ids"]) for ex in examples}) == 1  # the rows differ in their pictures only
    model = load_causal_lm(str(model_dir)).eval()
    backend = HFRolloutBackend(model, tokenizer)
    ro = RolloutConfig(max_new_tokens=8, temperature=1.0)

    rejected = generate_rejected(backend, examples, ro, seed=3)
    assert generate_rejected(backend, examples, ro, seed=3) == rejected  # seeded: the comparison below is fair
    fields = ("pixel_inputs", "token_inputs", "pixels_by")
    swapped = [{**ex, **{k: examples[(i + 1) % 4][k] for k in fields}} for i, ex in enumerate(examples)]
    assert generate_rejected(backend, swapped, ro, seed=3) != rejected
    placeholders = set(placeholder_token_ids(model.config))
    assert not placeholders & {t for r in rejected for t in r}  # never an image token in an answer


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_spin_trains_on_image_rows_through_the_cli(family, tmp_path):
    model_dir = build_vlm(family, tmp_path / family)
    data = write_jsonl(tmp_path / "data" / "spin.jsonl", _rows(tmp_path / "data"))
    run = tmp_path / "run"
    proc = oxrl(
        "run", "--alg", "spin", "--set", f"model.name={model_dir}", "--set", f"data.train={data}",
        "--set", "train.max_steps=2", "--set", "train.batch_size=4", "--set", "rollout.max_new_tokens=6",
        "-o", str(run), cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert "vision tower frozen" in proc.stderr  # loaded as a VLM: its rows went through its processor
    steps = read_metrics(run)
    assert [s["iteration"] for s in steps] == [1, 2]  # step 2 plays against the policy after step 1
    for s in steps:
        assert math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]), s
        assert s["time/generate_s"] > 0, s
    # before any update the policy is its reference: every log-ratio is 0 and the loss is log 2
    assert math.isclose(steps[0]["loss"], math.log(2), rel_tol=1e-4), steps[0]
    from oxrl_core.models.vision import load_processing

    assert load_processing(str(run / "final")).family.model_type == family  # final/ is a VLM with its processor
