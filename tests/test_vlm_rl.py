"""Issue 29: RL on image prompts — rollouts with pixels, the trainer's log-probabilities of what was sampled, and the
RL algorithms through the real CLI on tiny VLMs (`vlm_archs.py`).

The independent side never sees oxRL's batch: each sample's prompt is rendered from the raw row (the image file,
the question) by the model's own processor and chat template, the sampled completion appended, and the model
called on that one sequence.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import oxrl, read_metrics, write_jsonl
from vlm_archs import (
    FAMILIES,
    IMAGE_SIZE,
    VOWELS,
    build_vlm,
    encode_rendered,
    never_sampled_ids,
    processor_of,
    row_messages,
    with_appended,
)

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {family: build_vlm(family, root / family) for family in FAMILIES}


def _picture(path: Path, colour: tuple[int, int, int], corner: int) -> str:
    from PIL import Image

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), colour)
    image.paste(Image.new("RGB", (8, 8), (corner, 0, 255 - corner)), (0, 0))
    image.save(path)
    return str(path)


def _rows(folder: Path, swap: bool = False) -> list[dict]:
    """Two image prompts (``answer`` for the reward) and one text prompt; ``swap`` exchanges the two images."""
    folder.mkdir(parents=True, exist_ok=True)
    red, blue = (_picture(folder / f"{c}.png", COLOURS[c], 40 * i) for i, c in enumerate(("red", "blue")))
    first, second = (blue, red) if swap else (red, blue)
    return [
        {"prompt": "<image>What colour is it?", "images": [first], "answer": "red"},
        {"prompt": "Look: <image> which colour?", "images": [second], "answer": "blue"},
        {"prompt": "What colour is the sky?", "answer": "blue"},
    ]


def _rollout(model_dir: Path, rows: list[dict], n: int = 2, completions=None):
    """oxRL's path: prompts through the processor (`prepare_prompts`), samples from the hf backend with each prompt's
    pixels, the rollout batch and the trainer's forward (`policy_forward`). ``completions``: score these instead
    of sampling (the same tokens on other images)."""
    from oxrl_core.interfaces import SamplingParams
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer
    from oxrl_core.models.vision import load_processing
    from oxrl_core.rl.batch import policy_forward, prepare_prompts, rollout_batch
    from oxrl_core.rollout.hf import HFRolloutBackend

    torch.manual_seed(0)
    vision, tokenizer = load_processing(str(model_dir)), load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir)).float().eval()
    prompts = prepare_prompts(SimpleNamespace(rows=rows, origin="rows.jsonl"), tokenizer, 512, vision)
    if completions is None:
        backend = HFRolloutBackend(model, tokenizer)
        sampling = SamplingParams(n=n, max_new_tokens=6, temperature=1.0, seed=3)
        completions = [c for group in backend.generate(prompts.ids, sampling, images=prompts.media) for c in group]
    per_sample = [i for i in range(len(rows)) for _ in range(n)]
    batch = rollout_batch(
        [prompts.ids[i] for i in per_sample],
        completions,
        [0.0] * len(completions),
        n,
        tokenizer.pad_token_id,
        SimpleNamespace(device=torch.device("cpu")),
        prompts.media_of(per_sample),
    )
    with torch.no_grad():
        logp = policy_forward(model, None, batch, temperature=1.0)["logp"]  # (B, L-1)
    return completions, batch, logp, model


@torch.no_grad()
def _independent(family: str, model_dir: Path, model, row: dict, completion: list[int]) -> torch.Tensor:
    """log p of each completion token (C,) from one plain transformers forward on the raw row rendered by the model's
    own processor, over the vocabulary without the tokens a VLM never samples (`vlm_archs.never_sampled_ids`, the
    family's image tokens and delimiters named in the test, not taken from oxRL): log_softmax of the other columns."""
    from PIL import Image

    processor = processor_of(family, model_dir)
    messages, _ = row_messages(row)
    images = [Image.open(p).convert("RGB") for p in row.get("images", [])]
    inputs = encode_rendered(processor, processor.apply_chat_template(messages, add_generation_prompt=True), images)
    prompt_len = inputs["input_ids"].shape[1]
    logits = model(**with_appended(inputs, completion)).logits[0].float()  # (T, V)
    never = set(never_sampled_ids(family, processor.tokenizer))
    kept = torch.tensor([v for v in range(logits.shape[-1]) if v not in never])  # (V',)
    logp = torch.log_softmax(logits[:, kept], dim=-1)[prompt_len - 1 : -1]  # (C, V'): position t predicts t+1
    where = {int(v): i for i, v in enumerate(kept)}
    return logp.gather(-1, torch.tensor([where[t] for t in completion])[:, None]).squeeze(-1)  # (C,)


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_and_sampler_score_one_policy_on_every_vlm_family(family, vlms, tmp_path):
    """One policy for sampler and trainer: on every VLM family, image prompts and a text prompt (fp32, CPU), the
    trainer's log-probabilities of the sampled tokens (padded rows with their pixels) equal the rollout's to 1e-4 --
    the SGRPO trainer/rollout gap, `rollout/logprob_diff` (9.5e-3 nats on LLaVA before the trainer masked what the
    sampler never draws) -- and both equal an independent per-sequence computation over the vocabulary without the
    never-sampled tokens; giving the prompts each other's image changes them (Qwen2-VL and Gemma-3)."""
    rows = _rows(tmp_path / "data")
    completions, batch, logp, model = _rollout(vlms[family], rows)
    assert sum(bool(f) for f in batch["media"]) == 4  # two image prompts × n=2
    gaps = []
    for i, c in enumerate(completions):
        expected = _independent(family, vlms[family], model, rows[i // 2], c.token_ids)
        start = int(batch["prompt_len"][i]) - 1
        ours = logp[i, start : start + len(c.token_ids)]
        assert torch.allclose(ours, expected, atol=1e-4), (i, ours, expected)
        gaps.append((ours - torch.tensor(c.logprobs)).abs())
    gap = torch.cat(gaps)
    assert float(gap.max()) < 1e-4, (family, gap)  # the text prompt's samples (4, 5) included
    if family not in ("qwen2_vl", "gemma3"):
        return
    _, swapped_batch, swapped, _ = _rollout(
        vlms[family], _rows(tmp_path / "swapped", swap=True), completions=completions
    )
    mask = batch["mask"][:4] > 0  # the two image prompts' samples
    assert torch.equal(batch["input_ids"][:4], swapped_batch["input_ids"][:4])  # the same tokens, other pixels
    assert (logp[:4][mask] - swapped[:4][mask]).abs().max() > 1e-3
    text = batch["mask"][4:] > 0  # the text prompt's samples do not depend on the other rows' images
    assert torch.allclose(logp[4:][text], swapped[4:][text], atol=1e-6)


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_the_never_sampled_tokens_get_probability_zero_in_sampler_and_trainer(family, vlms):
    """The image token and its delimiters have probability 0 in the distribution the hf backend samples from (its
    processed scores, text prompt and image prompt alike) and in the trainer's (token_stats with every target one
    of them: exp(logp) = 0), on every path of the LM head; the other tokens' probabilities sum to 1."""
    from PIL import Image

    from oxrl_core.interfaces import SamplingParams
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer
    from oxrl_core.models.token_head import choose_path, token_stats
    from oxrl_core.models.vision import load_processing, placeholder_token_ids
    from oxrl_core.rollout.hf import HFRolloutBackend

    tokenizer, vision = load_tokenizer(str(vlms[family])), load_processing(str(vlms[family]))
    model = load_causal_lm(str(vlms[family])).float().eval()
    never = never_sampled_ids(family, tokenizer)
    assert placeholder_token_ids(model.config, tokenizer) == sorted(never)  # oxRL's set is the family's
    backend = HFRolloutBackend(model, tokenizer)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), COLOURS["red"])
    prompts = [vision.encode("What colour is the sky?", []), vision.encode("<image>What colour is it?", [image])]
    seen = []

    def record(batch_scores):  # the scores generate sampled from, after its processors
        seen.append(batch_scores)

    original = model.generate

    def generate(*args, **kwargs):
        out = original(*args, **kwargs)
        record(torch.stack(out.scores, 1).float())
        return out

    model.generate = generate
    for encoding in prompts:
        sampling = SamplingParams(n=1, max_new_tokens=3, temperature=1.0, seed=0)
        backend.generate([encoding.input_ids.tolist()], sampling, images=[encoding.pixel_inputs])
    for scores in seen:  # (1, steps, V)
        p = torch.softmax(scores, -1)
        assert float(p[..., never].sum()) == 0.0
        assert torch.allclose(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5)

    ids = prompts[1].input_ids[None]  # (1, T)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **prompts[1].pixel_inputs}
    T = ids.shape[1]
    rows = torch.zeros(len(never), dtype=torch.long)
    pos = torch.full((len(never),), T - 1)
    for chunk in (0, 4):  # the full logits, the chunked head
        choose_path(model, chunk, masked=tuple(placeholder_token_ids(model.config, tokenizer)))
        with torch.no_grad():
            logp = token_stats(model, inputs, rows, pos, torch.tensor(never))["logp"]
        assert float(logp.exp().sum()) == 0.0, chunk


# ----------------------------------------------------------------------------- through the real CLI


def _rl(model_dir: Path, data: Path, run: Path, alg: str, *extra: str):
    reward = data.parent / "vowels.py"
    reward.write_text(VOWELS)
    proc = oxrl(
        "run", "--alg", alg, "--output-dir", str(run),
        "--set", f"model.name={model_dir}", "--set", f"data.train={data}", "--set", f"reward.name={reward}:Vowels",
        "--set", "train.max_steps=1", "--set", "train.batch_size=2", "--set", "rollout.n=2",
        "--set", "rollout.max_new_tokens=4", "--set", "train.seed=0", *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return read_metrics(run)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, alg", [*((f, "sgrpo") for f in FAMILIES), ("qwen2_vl", "ppo"), ("qwen2_vl", "online_dpo")]
)
def test_rl_algorithms_take_a_step_on_image_prompts(family, alg, vlms, tmp_path):
    """One step through the real CLI on an image prompt and a text prompt, SGRPO on every VLM family: finite loss,
    the trainer's and the rollout's logprobs of the sampled tokens agree to 1e-4 (`rollout/logprob_diff`, mean and
    max: one policy for sampler and trainer; 9.5e-3 nats on LLaVA when only the sampler masked the never-sampled
    tokens), and final/ keeps the processor."""
    folder = tmp_path / "data"
    rows = _rows(folder)
    rows = [{**rows[0], "images": [Path(rows[0]["images"][0]).name]}, rows[2]]  # an image prompt, a text prompt
    data = write_jsonl(folder / "train.jsonl", rows)
    (m,) = _rl(vlms[family], data, tmp_path / "run", alg)
    assert math.isfinite(m["loss"]), m
    assert m["rollout/logprob_diff"] < 1e-4 and m["rollout/logprob_diff_max"] < 1e-4, m
    saved = {p.name for p in (tmp_path / "run" / "final").iterdir()}
    assert saved & {"preprocessor_config.json", "processor_config.json"}, saved  # the image processor's settings


@pytest.mark.slow
def test_actors_and_zero3_on_two_ranks_give_the_first_step_of_one_process(vlms, tmp_path):
    """SGRPO on image prompts: with a rollout actor (Ray; the pixels go to it with the prompts) and with DeepSpeed
    ZeRO-3 on two ranks (each rank's rows bring their own pixels) the first step's loss, rewards and grad norm equal
    the one-process run's."""
    folder = tmp_path / "data"
    rows = _rows(folder)[:2] * 2
    data = write_jsonl(folder / "train.jsonl", [{**r, "images": [Path(p).name for p in r["images"]]} for r in rows])
    # two seeded rollout shards everywhere: one process samples what two ranks do
    common = ("--set", "train.batch_size=4", "--set", "engine.rollout_shards=2")
    (one,) = _rl(vlms["qwen2_vl"], data, tmp_path / "one", "sgrpo", *common)
    (actor,) = _rl(vlms["qwen2_vl"], data, tmp_path / "actor", "sgrpo", *common, "--set", "rollout.actors=1")
    zero3 = ("--set", "engine.name=deepspeed", "--set", "engine.zero_stage=3", "--set", "engine.world_size=2")
    (z3,) = _rl(vlms["qwen2_vl"], data, tmp_path / "z3", "sgrpo", *common, *zero3)
    for other in (actor, z3):
        assert other["reward/mean"] == one["reward/mean"], (other, one)
        assert math.isclose(other["loss"], one["loss"], rel_tol=1e-5, abs_tol=1e-7), (other["loss"], one["loss"])
        assert math.isclose(other["grad_norm"], one["grad_norm"], rel_tol=1e-4), (other["grad_norm"], one["grad_norm"])


def test_image_prompts_are_refused_where_they_cannot_be_trained(vlms, tmp_path, tiny_model_dir):
    """Before any step, one line naming the field: image prompts for a text-only model, a backend that takes no
    images (vllm, with its reason and the hf fallback), PPO's separate critic. (Multi-turn episodes on
    image prompts run: tests/test_vlm_episodes.py.)"""
    folder = tmp_path / "data"
    data = write_jsonl(
        folder / "train.jsonl", [{**r, "images": [Path(r["images"][0]).name]} for r in _rows(folder)[:2]]
    )

    def refused(run: str, *extra: str, model: Path = vlms["qwen2_vl"], alg: str = "sgrpo") -> str:
        proc = oxrl("run", "--alg", alg, "--output-dir", str(tmp_path / run), "--set", f"model.name={model}",
                    "--set", f"data.train={data}", "--set", "train.max_steps=1", "--set", "reward.name=exact_match",
                    *extra)  # fmt: skip
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / run / "checkpoints").exists()
        return proc.stderr

    assert "field 'images'" in refused("text", model=tiny_model_dir)
    err = refused("vllm", "--set", "rollout.backend=vllm")
    assert "rollout.backend=vllm" in err and "rollout.backend=hf" in err and "torchvision" in err
    assert "alg.critic=separate" in refused("critic", "--set", "alg.critic=separate", alg="ppo")


def test_flops_per_token_of_a_vlm_come_from_its_language_model(vlms):
    """perf/mfu on a GPU: a VLM's layers and hidden size are its text config's (the top-level config has none; the
    first GPU run stopped on it)."""
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.models.perf import count_parameters, train_flops

    model = load_causal_lm(str(vlms["gemma3"]))
    text = model.config.get_text_config()
    n = count_parameters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # one sequence of 100 tokens: (4 + 2f)·N·100 + 12·L·H·100²
    expected = (4 + 2 * trainable / n) * n * 100 + 12 * text.num_hidden_layers * text.hidden_size * 100**2
    assert train_flops(model, 100, 100**2) == pytest.approx(expected)
