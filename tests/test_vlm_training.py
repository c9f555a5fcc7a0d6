"""Issue 28: supervised and preference training on image rows, through the real CLI, on tiny VLMs of every verified
family (`vlm_archs.py`), cross-checked against an independent per-sequence computation in plain transformers.

The independent side never sees oxRL's batch: each row is rendered by the model's own processor and chat template
from the raw row (the image file, the question, the answer), the answer's tokens and EOS appended, and the model
called on that one sequence; its log-probabilities are those of the policy oxRL samples from and trains, the
model's distribution with the never-sampled tokens (image and video tokens, their delimiters: the test's own list,
`vlm_archs.never_sampled_ids`) masked before the log-softmax. oxRL's step-1 loss (metrics.jsonl, computed before
the first update) must equal the token mean of those per-sequence losses; a run whose rows differ only in their
images must give another loss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import oxrl, read_metrics, write_jsonl
from vlm_archs import (
    FAMILIES,
    IMAGE_SIZE,
    QWEN_VL,
    build_vlm,
    encode_rendered,
    never_sampled_ids,
    processor_of,
    row_messages,
    with_appended,
)

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}


def _image(path: Path, colour: tuple[int, int, int], corner: tuple[int, int, int] = (0, 0, 0)) -> str:
    from PIL import Image

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), colour)
    image.paste(Image.new("RGB", (8, 8), corner), (0, 0))
    image.save(path)
    return path.name


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {family: build_vlm(family, root / family) for family in FAMILIES}


def _rows(folder: Path, swap: bool = False) -> list[dict]:
    """Four rows: a ``<image>`` prompt, a ``messages`` row with an image part, a second image prompt, and a text
    row; ``swap`` gives the two image prompts each other's image (everything else the same)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [
        _image(folder / f"{c}.png", rgb, corner=(i * 60, 0, 255 - i * 60)) for i, (c, rgb) in enumerate(COLOURS.items())
    ]
    first, third = (names[2], names[0]) if swap else (names[0], names[2])
    return [
        {"prompt": "<image>What colour is it?", "images": [first], "response": "red"},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Name the colour."}]},
                {"role": "assistant", "content": "green"},
            ],
            "images": [names[1]],
        },
        {"prompt": "Look: <image> which colour?", "images": [third], "response": "blue"},
        {"prompt": "What colour is the sky?", "response": "blue"},
    ]


@torch.no_grad()
def independent_sft_loss(family: str, model_dir: Path, rows: list[dict], folder: Path) -> float:
    """Token-mean NLL of the responses, one sequence at a time, from the raw rows (module docstring)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    processor = processor_of(family, model_dir)
    tokenizer = processor.tokenizer
    total, count = 0.0, 0
    for row in rows:
        messages, response = row_messages(row)
        images = [Image.open(folder / name).convert("RGB") for name in row.get("images", [])]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = encode_rendered(processor, text, images)
        answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        prompt_len = inputs["input_ids"].shape[1]
        full = with_appended(inputs, answer)
        ids = full["input_ids"]  # (1, T)
        logits = model(**full).logits[0]  # (T, V)
        logits[:, never_sampled_ids(family, tokenizer)] = float("-inf")  # the policy: never-sampled tokens masked
        logp = torch.log_softmax(logits.float(), dim=-1)
        for t in range(prompt_len - 1, ids.shape[1] - 1):  # position t predicts token t+1
            total -= float(logp[t, ids[0, t + 1]])
            count += 1
    return total / count


def _sft(model_dir: Path, data: Path, run: Path, *extra: str):
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={model_dir}",
        "--set",
        f"data.train={data}",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.batch_size=4",
        "--output-dir",
        str(run),
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sft_loss_equals_an_independent_per_sequence_computation(family, vlms, tmp_path):
    folder = tmp_path / "data"
    rows = _rows(folder)
    data = write_jsonl(folder / "train.jsonl", rows)
    proc = _sft(vlms[family], data, tmp_path / "run", "--set", "data.packing=true")
    loss = read_metrics(tmp_path / "run")[0]["loss"]
    expected = independent_sft_loss(family, vlms[family], rows, folder)
    assert math.isclose(loss, expected, rel_tol=1e-4), (family, loss, expected)
    # with data.packing, Qwen-VL rows pack (each with its own rotary positions: the loss above is the packed one);
    # the other families' rows step aside to padding, and the run says so
    out = proc.stdout + proc.stderr
    assert ("image rows are padded, not packed" in out) == (family not in QWEN_VL), out
    assert "vision tower frozen" in out
    # final/ reloads with the model's own class, with its processor beside it
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["model_type"] == family
    if family in QWEN_VL:  # the vision tower frozen by default: its weights are the initial ones, the LM's moved
        initial_vision, initial_text = _split(_tensors(vlms[family]))
        vision, text = _split(_tensors(tmp_path / "run" / "final"))
        assert set(vision) == set(initial_vision) and vision
        assert all(torch.equal(vision[k], initial_vision[k]) for k in vision)
        assert any(not torch.equal(text[k], initial_text[k]) for k in text)
    if family in QWEN_VL:  # packed (full logits) = padded with the chunked LM head
        chunked = ("--set", "train.logits_chunk_min_mb=0", "--set", "train.logits_chunk_size=8")
        out = _sft(vlms[family], data, tmp_path / "padded", "--set", "data.packing=false", *chunked)
        assert "full-vocabulary logits for" not in out.stdout + out.stderr  # the chunked head's probe passed
        padded = read_metrics(tmp_path / "padded")[0]
        assert math.isclose(padded["loss"], loss, rel_tol=1e-5), (padded["loss"], loss)
        assert math.isclose(padded["grad_norm"], read_metrics(tmp_path / "run")[0]["grad_norm"], rel_tol=1e-4)
    if family not in ("llava", "idefics3"):  # the same rows with two images swapped: another loss
        swapped_folder = tmp_path / "swapped"
        swapped = _rows(swapped_folder, swap=True)
        _sft(vlms[family], write_jsonl(swapped_folder / "train.jsonl", swapped), tmp_path / "run2")
        other = read_metrics(tmp_path / "run2")[0]["loss"]
        assert math.isclose(other, independent_sft_loss(family, vlms[family], swapped, swapped_folder), rel_tol=1e-4)
        assert abs(other - loss) > 1e-4, (family, loss, other)


# ----------------------------------------------------------------------------- DPO on images


def _pairs(folder: Path) -> list[dict]:
    """Three image pairs and a text pair (the text pair's rejected answer differs, its prompt has no image)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [_image(folder / f"{c}.png", rgb, corner=(0, i * 70, 0)) for i, (c, rgb) in enumerate(COLOURS.items())]
    return [
        {"prompt": "<image>What colour is it?", "images": [names[0]], "chosen": "red", "rejected": "green"},
        {
            "prompt": [{"role": "user", "content": [{"type": "text", "text": "Colour?"}, {"type": "image"}]}],
            "images": [names[1]],
            "chosen": "green",
            "rejected": "yellow",
        },
        {"prompt": "<image>Which colour?", "images": [names[3]], "chosen": "yellow", "rejected": "blue"},
        {"prompt": "What colour is grass?", "chosen": "green", "rejected": "red"},
    ]


@torch.no_grad()
def independent_logps(family: str, model_dir: Path, rows: list[dict], folder: Path) -> list[tuple[float, float]]:
    """(log π(chosen | x), log π(rejected | x)) per row, summed over the answer's tokens and EOS, each sequence
    on its own from the raw row."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    processor = processor_of(family, model_dir)
    tokenizer = processor.tokenizer
    out = []
    for row in rows:
        messages, _ = row_messages({**row, "response": ""}) if isinstance(row["prompt"], str) else (row["prompt"], "")
        images = [Image.open(folder / name).convert("RGB") for name in row.get("images", [])]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = encode_rendered(processor, text, images)
        pair = []
        for answer_text in (row["chosen"], row["rejected"]):
            answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            prompt_len = inputs["input_ids"].shape[1]
            full = with_appended(inputs, answer)
            ids = full["input_ids"]  # (1, T)
            logits = model(**full).logits[0]  # (T, V)
            logits[:, never_sampled_ids(family, tokenizer)] = float("-inf")  # never-sampled tokens masked
            logp = torch.log_softmax(logits, -1)
            pair.append(sum(float(logp[t, ids[0, t + 1]]) for t in range(prompt_len - 1, ids.shape[1] - 1)))
        out.append(tuple(pair))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_dpo_loss_with_a_separate_reference_equals_an_independent_computation(family, vlms, tmp_path):
    folder = tmp_path / "data"
    rows = _pairs(folder)
    data = write_jsonl(folder / "pairs.jsonl", rows)
    ref_dir = build_vlm(family, tmp_path / "ref", seed=1)  # initialised apart from the policy
    proc = oxrl(
        "run",
        "--alg",
        "dpo",
        "--set",
        f"model.name={vlms[family]}",
        "--set",
        f"model.ref={ref_dir}",
        "--set",
        f"data.train={data}",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.batch_size=4",
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loss = read_metrics(tmp_path / "run")[0]["loss"]
    policy = independent_logps(family, vlms[family], rows, folder)
    ref = independent_logps(family, ref_dir, rows, folder)
    beta = 0.1
    h = [beta * ((pc - rc) - (pr - rr)) for (pc, pr), (rc, rr) in zip(policy, ref)]
    expected = sum(-math.log(1 / (1 + math.exp(-x))) for x in h) / len(h)
    assert math.isclose(loss, expected, rel_tol=1e-4, abs_tol=1e-6), (family, loss, expected)


# ----------------------------------------------------------------------------- bad image rows


def _refused(proc, *needles: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for needle in needles:
        assert needle in out, (needle, out[-3000:])


def _bad_rows(folder: Path) -> tuple[dict, dict]:
    """A good image row, and per case (a bad row, the phrases its message must hold)."""
    good = _rows(folder)[0]
    png = (folder / good["images"][0]).read_bytes()
    (folder / "broken.png").write_bytes(png[: len(png) // 3])
    long_prompt = "x " * 200 + "<image> What colour?"
    return good, {
        "missing": ({**good, "images": ["nowhere.png"]}, ("row 2", "images[0]", "no such file")),
        "undecodable": ({**good, "images": ["broken.png"]}, ("row 2", "images[0]", "cannot decode")),
        "too_many_images": ({**good, "images": [good["images"][0]] * 2}, ("row 2", "'images'", "2 image(s) but 1")),
        "too_few_images": ({**good, "prompt": "<image><image>Two?"}, ("row 2", "'images'", "1 image(s) but 2")),
        "response_image": ({**good, "response": "<image> red"}, ("row 2", "field 'response'", "prompt side only")),
        "assistant_image": (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                    {"role": "assistant", "content": [{"type": "image"}]},
                ],
                "images": [good["images"][0], good["images"][0]],
            },
            ("row 2", "messages[1].content[0]", "assistant turn"),
        ),
        "truncation": (
            {**good, "prompt": long_prompt},
            ("row 2", "field 'images'", "data.max_length=128 would cut through an image"),
        ),
    }


def test_bad_image_rows_are_refused_when_the_data_loads(vlms, tmp_path):
    """Every bad image row, through the data layer a run uses: one `OxrlError` naming the file, the row and the
    field (the CLI turns it into one line and exit status 2: the CLI test below)."""
    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_data
    from oxrl_core.errors import OxrlError
    from oxrl_core.models.loading import load_tokenizer
    from oxrl_core.models.vision import load_processing

    folder = tmp_path / "data"
    good, cases = _bad_rows(folder)
    vision, tokenizer = load_processing(str(vlms["qwen2_vl"])), load_tokenizer(str(vlms["qwen2_vl"]))
    assert prepare_examples(
        load_data(str(write_jsonl(folder / "ok.jsonl", [good])), "train"),
        "prompt_response",
        tokenizer,
        128,
        vision=vision,
    ).examples[0]["pixel_inputs"]
    for name, (row, needles) in cases.items():
        source = load_data(str(write_jsonl(folder / f"{name}.jsonl", [good, row])), "train")
        with pytest.raises(OxrlError) as caught:
            prepare_examples(source, "prompt_response", tokenizer, 128, vision=vision)
        for needle in (f"{name}.jsonl", *needles):
            assert needle in str(caught.value), (name, needle, str(caught.value))


@pytest.mark.slow
def test_bad_image_rows_stop_the_cli_with_one_line_and_no_checkpoint(vlms, tmp_path, tiny_model_dir):
    folder = tmp_path / "data"
    good, cases = _bad_rows(folder)
    for name in ("truncation", "response_image"):
        row, needles = cases[name]
        data = write_jsonl(folder / f"{name}.jsonl", [good, row])
        proc = oxrl(
            "run",
            "--alg",
            "sft",
            "--set",
            f"model.name={vlms['qwen2_vl']}",
            "--set",
            f"data.train={data}",
            "--set",
            "data.max_length=128",
            "--set",
            "train.max_steps=1",
            "--output-dir",
            str(tmp_path / name),
        )
        _refused(proc, f"{name}.jsonl", *needles)
        assert not (tmp_path / name / "final").exists(), name
    # images for a text-only model; CPT's text rows; a reward model
    data = write_jsonl(folder / "text_model.jsonl", [good])
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={data}",
        "--set",
        "train.max_steps=1",
        "--output-dir",
        str(tmp_path / "text_model"),
    )
    _refused(proc, "text_model.jsonl: row 1", "cannot read images (a text-only model")
    cpt = write_jsonl(folder / "cpt.jsonl", [{"text": "red squares", "images": [good["images"][0]]}])
    proc = oxrl(
        "run",
        "--alg",
        "cpt",
        "--set",
        f"model.name={vlms['qwen2_vl']}",
        "--set",
        f"data.train={cpt}",
        "--set",
        "train.max_steps=1",
        "--output-dir",
        str(tmp_path / "cpt"),
    )
    _refused(proc, "cpt.jsonl: row 1", "CPT trains on plain text")
    pairs = write_jsonl(folder / "rm.jsonl", [{**_pairs(folder)[0]}])
    proc = oxrl(
        "run",
        "--alg",
        "rm",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={pairs}",
        "--set",
        "train.max_steps=1",
        "--output-dir",
        str(tmp_path / "rm"),
    )
    _refused(proc, "rm.jsonl: row 1", "reads no images")


# ----------------------------------------------------------------------------- the vision tower, LoRA


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _split(state: dict) -> tuple[dict, dict]:
    vision = {k: v for k, v in state.items() if ".visual." in f".{k}"}
    return vision, {k: v for k, v in state.items() if k not in vision}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5", "qwen3_5_moe"])
def test_vision_tower_frozen_by_default_trained_when_asked_and_lora_merges_exactly(family, vlms, tmp_path):
    """3 steps at a high learning rate. Qwen2-VL with ``model.freeze_vision: false``: the vision tower's weights in
    final/ moved as the language model's did (frozen, the default: the SFT test above checks they stay). Under LoRA
    (language model only) on Qwen2-VL, on Qwen3.5, whose language model starts with a Gated DeltaNet layer (its
    projections adapted and merged too), and on Qwen3.5-MoE (fused experts and router frozen, the shared expert
    adapted): the vision tower in final/ is the initial one, and final/ (merged) loads with the model's own class
    and gives the logits of the base model with final/adapter/ on an image prompt."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    folder = tmp_path / "data"
    data = write_jsonl(folder / "train.jsonl", _rows(folder))
    initial_vision, initial_text = _split(_tensors(vlms[family]))
    common = ("--set", "train.max_steps=3", "--set", "train.lr=0.01", "--set", "train.warmup_steps=0")
    runs = {"lora": ("--set", "lora.enabled=true", "--set", "lora.r=4")}
    if family == "qwen2_vl":
        runs["trained"] = ("--set", "model.freeze_vision=false")
    for name, extra in runs.items():
        _sft(vlms[family], data, tmp_path / name, *common, *extra)
    # frozen by default: test_sft_loss_equals_an_independent_per_sequence_computation checks its final/
    if family == "qwen2_vl":
        vision, text = _split(_tensors(tmp_path / "trained" / "final"))
        assert set(vision) == set(initial_vision) and vision
        assert any(not torch.equal(vision[k], initial_vision[k]) for k in vision)
        assert any(not torch.equal(text[k], initial_text[k]) for k in text)
    lora_vision, lora_text = _split(_tensors(tmp_path / "lora" / "final"))
    assert set(lora_vision) == set(initial_vision) and lora_vision
    assert all(torch.equal(lora_vision[k], initial_vision[k]) for k in lora_vision)  # LoRA adapts the LM only
    adapter = _tensors(tmp_path / "lora" / "final" / "adapter")
    if family != "qwen2_vl":  # the Gated DeltaNet layer's projections were adapted, and merged into final/
        assert any(".linear_attn." in k for k in adapter)
        deltanet = [k for k in lora_text if ".linear_attn." in k and k.endswith("proj.weight")]
        assert deltanet and any(not torch.equal(lora_text[k], initial_text[k]) for k in deltanet)
    if family == "qwen3_5_moe":  # the shared expert adapted; the fused experts and the router as they were
        assert any(".shared_expert." in k for k in adapter)
        assert not any(".experts." in k or ".mlp.gate." in k for k in adapter)
        frozen = [k for k in lora_text if ".mlp.experts." in k or k.endswith(".mlp.gate.weight")]
        assert frozen and all(torch.equal(lora_text[k], initial_text[k]) for k in frozen)

    from peft import PeftModel

    merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "lora" / "final")).eval()
    assert type(merged).__name__ == json.loads((vlms[family] / "config.json").read_text())["architectures"][0]
    base = AutoModelForImageTextToText.from_pretrained(str(vlms[family]))
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "lora" / "final" / "adapter")).eval()
    processor = processor_of(family, tmp_path / "lora" / "final")  # final/ keeps the processor
    image = Image.open(folder / "red.png").convert("RGB")
    messages, _ = row_messages(_rows(folder)[0])
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        want, got = adapted(**inputs).logits, merged(**inputs).logits
        plain = AutoModelForImageTextToText.from_pretrained(str(vlms[family])).eval()(**inputs).logits
    assert not torch.allclose(want, plain, atol=1e-4)  # the adapter did something
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


@pytest.mark.slow
def test_the_vlm_example_yaml_runs(vlms, tmp_path):
    """`examples/sft_images.yaml` (the built-in visual task's SFT) on a tiny Qwen2-VL and four rows, two steps. The
    checkpoint has a video processor config, as real Qwen2-VL checkpoints do: its processor is built without the
    video part here (no torchvision), and final/ keeps the file so it loads wherever torchvision is installed."""
    import shutil

    folder = tmp_path / "data"
    data = write_jsonl(folder / "train.jsonl", _rows(folder))
    model_dir = tmp_path / "qwen2_vl"
    shutil.copytree(vlms["qwen2_vl"], model_dir)
    video_config = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 8, "merge_size": 2}
    (model_dir / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    example = Path(__file__).resolve().parents[1] / "examples" / "sft_images.yaml"
    proc = oxrl(
        "run",
        "--config",
        str(example),
        "--set",
        f"model.name={model_dir}",
        "--set",
        f"data.train={data}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.batch_size=2",
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
    from oxrl_core.models.vision import load_processing

    final = tmp_path / "run" / "final"
    assert (final / "processor_config.json").is_file()  # the processor is saved too, and loads again
    assert load_processing(str(final)).family.model_type == "qwen2_vl"
    assert json.loads((final / "video_preprocessor_config.json").read_text()) == video_config


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_zero3_on_two_ranks_trains_image_rows_as_one_process_does(family, vlms, tmp_path):
    """DeepSpeed ZeRO-3, 2 ranks (gloo, CPU): each rank's rows bring their own pixels; the losses and gradient norms
    of two steps equal the one-process run's. On Qwen2-VL and the Qwen-VL models whose code differs most from it
    (each 20-30 s on 2 cores): Qwen2.5-VL's windowed vision tower, Qwen3-VL's DeepStack (a second merger whose
    features join language layer 0), Qwen3.5's Gated DeltaNet layer; Qwen3.5-MoE is Qwen3.5's layers with experts,
    left to the SFT and LoRA tests."""
    folder = tmp_path / "data"
    data = write_jsonl(folder / "train.jsonl", _rows(folder))
    _sft(vlms[family], data, tmp_path / "one", "--set", "train.max_steps=2")
    zero3 = ("--set", "engine.name=deepspeed", "--set", "engine.zero_stage=3", "--set", "engine.world_size=2")
    _sft(vlms[family], data, tmp_path / "z3", "--set", "train.max_steps=2", *zero3)
    one, z3 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "z3")
    assert [m["step"] for m in z3] == [1, 2]
    for a, b in zip(one, z3):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])


@pytest.mark.slow
def test_dpo_under_zero3_on_two_ranks_trains_image_pairs_as_one_process_does(vlms, tmp_path):
    """DPO on image pairs (three with a picture, one text pair), the reference a frozen copy of the policy: DeepSpeed
    ZeRO-3 on 2 ranks (each rank's pairs bring their own pixels, to the policy's forward and the reference's) gives
    the one-process run's losses, chosen/rejected log-probabilities and gradient norms over two steps."""
    folder = tmp_path / "data"
    data = write_jsonl(folder / "pairs.jsonl", _pairs(folder))
    zero3 = ("--set", "engine.name=deepspeed", "--set", "engine.zero_stage=3", "--set", "engine.world_size=2")
    for name, extra in (("one", ()), ("z3", zero3)):
        proc = oxrl(
            "run", "--alg", "dpo", "--output-dir", str(tmp_path / name), "--set", f"model.name={vlms['qwen2_vl']}",
            "--set", f"data.train={data}", "--set", "train.max_steps=2", "--set", "train.batch_size=4",
            "--set", "train.lr=1e-3", *extra,
        )  # fmt: skip
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:])
    one, z3 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "z3")
    assert [m["step"] for m in z3] == [1, 2]
    assert one[1]["loss"] != one[0]["loss"]  # the second step trains on an updated policy
    for a, b in zip(one, z3):
        for key in ("loss", "logps/chosen", "logps/rejected"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], b[key])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])
