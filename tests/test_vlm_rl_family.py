"""Issue 29 (item 2): the rest of the RL family on image prompts -- CISPO, RFT, RLHF and RLAIF -- one or two steps
each through the real CLI on a tiny Qwen2-VL (`vlm_archs.py`).

- CISPO: finite loss, and the rollouts carried the pictures (the rollout log shows each image sample's images);
- RFT: the kept samples are SFT rows that keep their prompt's pixels: the step's loss changes when the pictures
  are exchanged (same prompts, same seed);
- RLHF / RLAIF: the reward model and the judge score the completion's *text*; an image prompt reaches them as its
  text with each image shown as ``<image>``. Checked by scoring the logged (prompt, completion) pairs again with
  the same reward outside the run: the rewards in the rollout log are those scores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl
from vlm_archs import IMAGE_SIZE, VOWELS, build_vlm

COLOURS = {"red": (220, 30, 30), "blue": (30, 40, 220)}
LOOK = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " which colour?"}],
    }
]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return build_vlm("qwen2_vl", tmp_path_factory.mktemp("vlms") / "qwen2_vl")


def _data(folder: Path, swap: bool = False) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, (colour, rgb) in enumerate(COLOURS.items()):
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb)
        image.paste(Image.new("RGB", (8, 8), (40 * i, 0, 255 - 40 * i)), (0, 0))
        image.save(folder / f"{colour}.png")
        names.append(f"{colour}.png")
    first, second = reversed(names) if swap else names
    rows = [
        {"prompt": "<image>What colour is it?", "images": [first], "answer": "red"},
        {"prompt": LOOK, "images": [second], "answer": "blue"},  # chat messages with an image part
    ]
    return write_jsonl(folder / "train.jsonl", rows)


def _run(model: Path, data: Path, run: Path, alg: str, *extra: str) -> list[dict]:
    proc = oxrl(
        "run", "--alg", alg, "--output-dir", str(run),
        "--set", f"model.name={model}", "--set", f"data.train={data}",
        "--set", "train.max_steps=1", "--set", "train.batch_size=2", "--set", "rollout.n=2",
        "--set", "rollout.max_new_tokens=4", "--set", "train.seed=0", *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return read_metrics(run)


def _vowels(folder: Path) -> str:
    path = folder / "vowels.py"
    path.write_text(VOWELS)
    return f"reward.name={path}:Vowels"


def _samples(run: Path) -> list[dict]:
    """The logged samples of the run's first step (`rollouts.jsonl`)."""
    first = json.loads((run / "rollouts.jsonl").read_text().splitlines()[0])
    return first["samples"]


def _row_prompt(sample: dict):
    """The raw row prompt a logged sample was generated from (the log keeps the rendered one)."""
    return "<image>What colour is it?" if "What colour is it?" in sample["prompt"] else LOOK


def _carried_images(samples: list[dict]) -> None:
    assert len(samples) == 4
    for s in samples:  # every sample of an image prompt logged its picture, and the rendered prompt its image tokens
        assert len(s["images"]) == 1 and s["images"][0].startswith("data:image/png;base64,"), s.get("images")
        assert "<|image_pad|>" in s["prompt"], s["prompt"]


def test_cispo_takes_a_step_on_image_prompts(vlm, tmp_path):
    data = _data(tmp_path / "data")
    (m,) = _run(vlm, data, tmp_path / "run", "cispo", "--set", _vowels(tmp_path))
    assert math.isfinite(m["loss"]) and m["loss"] != 0.0 and math.isfinite(m["grad_norm"]), m
    assert m["rollout/logprob_diff"] < 1e-2, m  # the trainer's forward had the rollout's pixels
    _carried_images(_samples(tmp_path / "run"))


def test_rft_trains_on_its_samples_with_their_pictures(vlm, tmp_path):
    """τ = 0 keeps every sample: the SFT step's loss is the mean NLL of all sampled tokens under the trainer's
    forward (the logged per-token logprobs, computed with the pixels); exchanging the two pictures gives another."""
    keep_all = ("--set", _vowels(tmp_path), "--set", "alg.threshold=0")
    (m,) = _run(vlm, _data(tmp_path / "data"), tmp_path / "run", "rft", *keep_all)
    samples = _samples(tmp_path / "run")
    _carried_images(samples)
    assert m["rft/kept"] == 4 and m["rft/kept_tokens"] == sum(len(s["ids"]) for s in samples), m
    logps = [lp for s in samples for lp in s["logp"]]
    assert m["loss"] == pytest.approx(-sum(logps) / len(logps), abs=2e-4), m
    (swapped,) = _run(vlm, _data(tmp_path / "swapped", swap=True), tmp_path / "swapped_run", "rft", *keep_all)
    assert math.isfinite(swapped["loss"]) and abs(swapped["loss"] - m["loss"]) > 1e-4, (swapped["loss"], m["loss"])


def test_rlhf_reward_model_scores_the_completion_text(vlm, tmp_path, tiny_model_dir):
    """The reward model (a tiny Llama classifier, its head scaled so scores spread) gets each sample's prompt as
    text, its image as ``<image>``, and the completion's text: the logged rewards are its scores of exactly those."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=32, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(3)
    rm = LlamaForSequenceClassification(config)
    with torch.no_grad():
        rm.score.weight.mul_(300)
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")

    (m,) = _run(vlm, _data(tmp_path / "data"), tmp_path / "run", "rlhf", "--set", f"reward.model={tmp_path / 'rm'}")
    assert math.isfinite(m["loss"]) and m["reward/errors"] == 0, m
    samples = _samples(tmp_path / "run")
    _carried_images(samples)

    from oxrl_core.models.loading import load_tokenizer
    from oxrl_rewards.reward_model import RewardModelReward

    policy_tokenizer = load_tokenizer(str(vlm))
    texts = [policy_tokenizer.decode(s["ids"], skip_special_tokens=True) for s in samples]
    reward = RewardModelReward(RewardModelReward.Config(model=str(tmp_path / "rm"), device="cpu"))
    again = reward.score([_row_prompt(s) for s in samples], texts, [{}] * len(samples))
    assert [s["reward"] for s in samples] == pytest.approx(again, abs=1e-4)
    assert len({round(r, 3) for r in again}) > 1, again  # the scores differ between completions
    other = reward.score([_row_prompt(s) for s in samples], texts[::-1], [{}] * len(samples))
    assert other != pytest.approx(again, abs=1e-3)  # another completion text, another score


def _digit_judge(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny built-in Llama with an LM head that writes digits only (every other token's row zeroed): its greedy
    answer is digits that depend on what it read, so the last one (``reward.pattern=(\\d)``) is a score."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    digits = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    with torch.no_grad():
        weight = torch.zeros_like(model.lm_head.weight)
        weight[digits] = 10 * model.lm_head.weight[digits]
    model.lm_head.weight = torch.nn.Parameter(weight)
    model.config.tie_word_embeddings = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_rlaif_judge_scores_the_completion_text(vlm, tmp_path, tiny_model_dir):
    """The judge reads the template filled with the prompt's text, its image as ``<image>``, and the completion's
    text; its score is the last digit of its greedy answer: the logged rewards are its scores of exactly those."""
    judge = _digit_judge(tiny_model_dir, tmp_path / "judge")
    settings = {"template": "{prompt}|{completion}", "pattern": r"(\d)", "max_new_tokens": 3, "device": "cpu"}
    extra = [a for k, v in settings.items() for a in ("--set", f"reward.{k}={v}")]
    (m,) = _run(vlm, _data(tmp_path / "data"), tmp_path / "run", "rlaif", "--set", f"reward.model={judge}", *extra)
    assert math.isfinite(m["loss"]) and m["reward/errors"] == 0, m
    samples = _samples(tmp_path / "run")
    _carried_images(samples)

    from oxrl_core.models.loading import load_tokenizer
    from oxrl_rewards.llm_judge import LLMJudgeReward

    policy_tokenizer = load_tokenizer(str(vlm))
    texts = [policy_tokenizer.decode(s["ids"], skip_special_tokens=True) for s in samples]
    prompts = [_row_prompt(s) for s in samples]
    reward = LLMJudgeReward(LLMJudgeReward.Config(model=str(judge), **settings))
    assert reward.judge_prompt("<image>What colour is it?", "red") == "<image>What colour is it?|red"
    assert reward.judge_prompt(LOOK, "blue") == "user: Look: <image> which colour?|blue"
    again = reward.score(prompts, texts, [{}] * len(samples))
    assert [s["reward"] for s in samples] == pytest.approx(again, abs=1e-4), reward.last_answers
    assert len(set(again)) > 1, reward.last_answers  # the judge's scores differ between completions


def test_what_the_reward_model_and_the_judge_see_of_an_image_prompt(tiny_model_dir):
    """Chat messages with image parts: the reward model encodes, and the judge renders, the prompt's text with one
    ``<image>`` per image part, as a string prompt's own markers; a text prompt is unchanged."""
    from oxrl_core import encode_prompt, prompt_text
    from oxrl_core.models.loading import load_tokenizer
    from oxrl_rewards.llm_judge import render_prompt

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
    ]
    seen = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>What colour is it?"}]
    assert prompt_text(messages) == seen and prompt_text("<image>Hi") == "<image>Hi"
    assert render_prompt(messages) == "system: Be brief.\nuser: <image>What colour is it?"
    tokenizer = load_tokenizer(str(tiny_model_dir))
    from oxrl_rewards.reward_model import RewardModelReward

    encode = RewardModelReward.encode  # the row encoding alone, on a stand-in with the tokenizer and max_length
    stand_in = type("RM", (), {"tokenizer": tokenizer, "config": RewardModelReward.Config(model="x")})()
    assert encode(stand_in, messages, "red")[: len(encode_prompt(tokenizer, seen))] == encode_prompt(tokenizer, seen)
