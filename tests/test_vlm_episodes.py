"""Issue 29, item 4: multi-turn episodes on a vision-language model — image prompts, and an environment whose
messages carry images (`oxrl_core.rl.episodes`, the built-in ``second_look`` environment).

The independent side never sees oxRL's ids or pixels: the whole conversation (the row's image and question, the
model's turns as text, the environment's message with its image) is rendered by the model's own processor and chat
template, and plain transformers scores the sampled tokens on it.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import oxrl, read_metrics, write_jsonl
from vlm_archs import IMAGE_SIZE, build_vlm, encode_rendered, never_sampled_ids, processor_of

from oxrl_core.config import RunConfig
from oxrl_core.data.shapes import SecondLookEnv
from oxrl_core.interfaces import Completion, Environment, RolloutBackend, SamplingParams
from oxrl_core.rl.batch import policy_forward, rollout_batch
from oxrl_core.rl.episodes import Episodes
from oxrl_core.rollout.log import env_images_of, image_data_uri


def _png(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), colour)
    image.paste(Image.new("RGB", (8, 8), (255, 255, 255)), (0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class ScriptedVLM(RolloutBackend):
    """Answers every context with ``turns[k]`` + EOS on generate call k, logprobs from a plain forward of the
    model on the ids with the pixels it was given; records how many images each call's prompts carried."""

    name = "scripted_vlm"

    def __init__(self, model, tokenizer, turns: list[str]):
        self.model, self.tokenizer, self.turns, self.images_per_call = model, tokenizer, turns, []

    @torch.no_grad()
    def generate(self, prompt_token_ids, sampling, images=None):
        from oxrl_core.data.images import collate_pixels

        text = self.turns[min(len(self.images_per_call), len(self.turns) - 1)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        self.images_per_call.append([_image_count(f) for f in images])
        out = []
        for context, fields in zip(prompt_token_ids, images):
            row = torch.tensor([list(context) + ids])  # (1, T)
            logits = self.model(input_ids=row, **collate_pixels([{**fields, "input_ids": row[0]}], row.shape[1])).logits
            logp = torch.log_softmax(logits[0].float(), -1)
            lp = [float(logp[len(context) - 1 + j, t]) for j, t in enumerate(ids)]
            out.append([Completion(list(ids), lp, "stop", 0) for _ in range(sampling.n)])
        return out

    def update_weights(self, state, policy_version):
        pass


#: the tiles of one 32×32 image in the tiny Idefics3 (`vlm_archs`: 2×2 tiles of 16×16 and the whole image)
IDEFICS3_TILES = 5


def _image_count(fields: dict) -> int:
    """How many images a prompt's image inputs hold (Qwen-VL: one grid row each; Idefics3: `IDEFICS3_TILES` tiles
    each, on the row's second dimension; else one pixel entry each)."""
    pixels = fields.get("pixel_inputs", {})
    if fields.get("pixels_by") == "row":
        return pixels["pixel_values"].shape[1] // IDEFICS3_TILES
    return len(pixels.get("image_grid_thw", pixels.get("pixel_values", ())))


def _config(**env) -> RunConfig:
    return RunConfig.model_validate(
        {"algorithm": "sgrpo", "env": {"name": "second_look", "max_turns": 3, **env}, "rollout": {"n": 2}}
    )


#: how SmolVLM's template writes a turn given as a string ("Assistant: red", after the generation prompt
#: "Assistant:"), and how an Idefics3 template whose turns extend its generation prompt exactly writes it
SMOLVLM_TURN, EXTENDING_TURN = "{{ ': ' + message['content'] }}", "{{ ':' + message['content'] }}"


@pytest.fixture(
    scope="module", params=["qwen2_vl", "gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "idefics3", "idefics3_joined"]
)
def vlm(tmp_path_factory, request):
    """A tiny VLM of the family (Qwen2-VL: pixels by patch; Gemma-3: by image, BOS written by its template; Qwen2.5-VL,
    Qwen3-VL and Qwen3.5 -- its Gated DeltaNet layers carry state across the turns -- as Qwen2-VL; Idefics3: by row,
    its tiles on the second dimension), its processing, tokenizer and fp32 model, and one episode batch played on
    it: the row's image prompt, a first answer, the environment's second look (an image), the final answer.

    Idefics3 twice: with SmolVLM's template, whose assistant turn ("Assistant: red") does not extend its generation
    prompt ("Assistant:"), so the second look starts the training sample again from the whole conversation
    (the retemplate fallback, the processor's own encoding of both images); and (``idefics3_joined``) with that
    template writing a turn given as a string right after the colon, so the environment's turn extends the
    sequence and its image's tiles join the row's (`episodes.join_tiles`)."""
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer
    from oxrl_core.models.vision import load_processing

    family = request.param.removesuffix("_joined")
    model_dir = build_vlm(family, tmp_path_factory.mktemp("vlm") / request.param)
    if request.param == "idefics3_joined":
        template = model_dir / "chat_template.jinja"
        assert SMOLVLM_TURN in template.read_text()
        template.write_text(template.read_text().replace(SMOLVLM_TURN, EXTENDING_TURN))
    vision, tokenizer = load_processing(str(model_dir)), load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir)).float().eval()
    backend = ScriptedVLM(model, tokenizer, ["red", "blue"])
    runner = Episodes(SecondLookEnv, SecondLookEnv.Config(), _config(), tokenizer, backend, vision)
    rows = [{"prompt": "<image>What colour is the shape?", "images": [{"bytes": _png((220, 40, 40))}], "answer": "red"}]
    episodes = runner.play(rows, SamplingParams(n=2, max_new_tokens=8))
    return SimpleNamespace(
        family=family, dir=model_dir, vision=vision, tokenizer=tokenizer, model=model, backend=backend, runner=runner,
        rows=rows, episodes=episodes, extends=request.param != "idefics3",
    )  # fmt: skip


@torch.no_grad()
def test_an_environment_image_is_in_the_trained_sequence_and_the_trainers_logprobs_equal_plain_transformers(vlm):
    """Episode: row image + question | 'red' | the environment's second look (image + text) | 'blue'. The ids are
    the processor's rendering of the raw conversation, image placeholders expanded as it expands them; the second
    generate call gets both images; the environment's tokens (image tokens included) have mask 0; the trainer's
    log-probabilities of the sampled tokens (rollout batch with each row's pixels, fp32) equal plain transformers'
    on the processor's inputs to 1e-4, over the vocabulary without the tokens a VLM never samples. Where the
    template does not extend (SmolVLM's), the sample starts again at the second look: its prompt is the processor's
    encoding of the whole conversation and the final answer is all it trains on (``env/retemplate_fallbacks``)."""
    from PIL import Image

    q = vlm
    assert q.backend.images_per_call == [[1], [2, 2]]  # turn 1: the row's image (one group of n); turn 2: both
    processor = processor_of(q.family, q.dir)
    picture = Image.open(io.BytesIO(q.rows[0]["images"][0]["bytes"])).convert("RGB")
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Take a second look. Your answer?"}]},
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = encode_rendered(processor, text, [picture, picture])
    final = q.tokenizer("blue", add_special_tokens=False)["input_ids"] + [q.tokenizer.eos_token_id]
    full = torch.cat([inputs["input_ids"][0], torch.tensor(final)])  # (T,)
    kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    for name in [k for k in kwargs if k.endswith("token_type_ids")]:  # one per token: 0 on the final answer
        kwargs[name] = torch.cat([kwargs[name], torch.zeros((1, len(final)), dtype=torch.long)], 1)
    logits = q.model(input_ids=full[None], **kwargs).logits[0].float()  # (T, V)
    logits[:, never_sampled_ids(q.family, q.tokenizer)] = float("-inf")  # the tokens a VLM never samples
    expected = torch.log_softmax(logits, -1)  # (T, V)

    for e in q.episodes:
        assert e.ended == "done" and e.images_shown == 1 and not e.error
        assert e.prompt_ids + e.token_ids == full.tolist()  # the processor's own ids, both images expanded
        image_tokens = torch.tensor(e.token_ids) == q.vision.image_token_id
        if q.extends:
            assert e.fallbacks == 0
            assert image_tokens.sum() > 0 and all(s == 0 for s, img in zip(e.sampled, image_tokens) if img)
        else:  # the fallback: the whole conversation is the prompt, the final answer the only turn trained on
            assert e.fallbacks == 1 and e.token_ids == final and image_tokens.sum() == 0
    assert [m["role"] for m in q.episodes[0].messages] == ["user", "assistant", "user", "assistant"]

    prompts, completions, scores, metrics, images = q.runner.collect(
        q.episodes, None, _failures("r"), _env_failures()
    )  # no reward: the scores are not what this test checks
    batch = rollout_batch(prompts, completions, scores, 2, q.tokenizer.pad_token_id, _Engine(), images)
    logp = policy_forward(q.model, None, batch, temperature=1.0)["logp"]  # (B, T-1)
    assert metrics["env/images_shown"] == 1.0
    # the picture the environment showed, kept for rollouts.jsonl as it logs a prompt's (its turn: after answer 1)
    assert env_images_of(images) == [[{"turn": 1, "image": image_data_uri(picture)}]] * 2
    for fields in images:  # each episode's pixels: the processor's for the whole conversation (Idefics3: 2 × 5 tiles)
        assert fields["pixel_inputs"].keys() <= kwargs.keys()
        assert all(torch.equal(v, kwargs[k]) for k, v in fields["pixel_inputs"].items()), q.family
    for i, c in enumerate(completions):
        start = int(batch["prompt_len"][i]) - 1
        positions = [start + j for j, s in enumerate(c.sampled) if s]  # the model's tokens
        tokens = torch.tensor([c.token_ids[j] for j, s in enumerate(c.sampled) if s])
        ours = logp[i, positions]
        theirs = expected[torch.tensor(positions), tokens]
        assert torch.allclose(ours, theirs, atol=1e-4), (i, ours, theirs)
        assert (batch["mask"][i, start : start + len(c.token_ids)] == torch.tensor(c.sampled, dtype=torch.float)).all()

    # the environment's picture is the one the later turn is scored on: another second picture changes the final
    # answer's log-probabilities and leaves the first answer's (before it) as they were
    other = rollout_batch(prompts, completions, scores, 2, q.tokenizer.pad_token_id, _Engine(), _other_second(images))
    swapped = policy_forward(q.model, None, other, temperature=1.0)["logp"]  # (B, T-1)
    for i, c in enumerate(completions):
        start = int(batch["prompt_len"][i]) - 1
        turns = [start + j for j, s in enumerate(c.sampled) if s]
        n_first = len(q.tokenizer("red", add_special_tokens=False)["input_ids"]) + 1 if q.extends else 0  # 'red' + EOS
        first, final = turns[:n_first], turns[n_first:]
        assert torch.allclose(logp[i, first], swapped[i, first], atol=1e-6)
        assert (logp[i, final] - swapped[i, final]).abs().max() > 1e-4


@torch.no_grad()
def test_an_episode_with_the_environments_image_and_one_without_share_a_batch_as_if_alone(vlm):
    """A rollout batch of an episode with two images (the second look) and one with the row's alone (``offer`` off:
    Idefics3's rows then have 10 and 5 tiles, the shorter padded with zero tiles): each row's log-probabilities
    equal those of a batch of that row alone."""
    q = vlm
    lone = Episodes(SecondLookEnv, SecondLookEnv.Config(offer=False), _config(), q.tokenizer,
                    ScriptedVLM(q.model, q.tokenizer, ["red"]), q.vision)  # fmt: skip
    episodes = [q.episodes[0], lone.play(q.rows, SamplingParams(n=1, max_new_tokens=8))[0]]
    assert [_image_count(e.image_inputs()) for e in episodes] == [2, 1]
    prompts, completions, scores, _, media = q.runner.collect(episodes, None, _failures("r"), _env_failures())
    pad = q.tokenizer.pad_token_id
    both = policy_forward(q.model, None, rollout_batch(prompts, completions, scores, 1, pad, _Engine(), media), 1.0)
    for i in range(2):
        alone = rollout_batch(prompts[i : i + 1], completions[i : i + 1], scores[i : i + 1], 1, pad, _Engine(),
                              media[i : i + 1])  # fmt: skip
        logp = policy_forward(q.model, None, alone, temperature=1.0)["logp"][0]  # (T-1,)
        assert torch.allclose(both["logp"][i, : len(logp)], logp, atol=1e-5), (q.family, i)


def _other_second(images: list[dict]) -> list[dict]:
    """Each episode's image inputs with its second image's pixels negated (another picture, same size)."""
    out = []
    for fields in images:
        pixels = dict(fields["pixel_inputs"])
        grid = pixels.get("image_grid_thw")
        first = int(grid[0].prod()) if grid is not None else 1  # patches (Qwen-VL) or one entry of the first image
        values = pixels["pixel_values"].clone()
        if fields["pixels_by"] == "row":  # Idefics3: the second image's tiles, on the row's second dimension
            values[:, IDEFICS3_TILES:] = -values[:, IDEFICS3_TILES:]
        else:
            values[first:] = -values[first:]
        out.append({**fields, "pixel_inputs": {**pixels, "pixel_values": values}})
    return out


def test_the_hf_backend_continues_an_episode_with_every_image_of_it(vlm):
    """The real `generate` takes a later turn's context with both images (placeholder counts match the pixels)."""
    from oxrl_core.rollout.hf import HFRolloutBackend

    q = vlm
    e = q.episodes[0]
    context = e.prompt_ids + e.token_ids[: -len(q.tokenizer("blue", add_special_tokens=False)["input_ids"]) - 1]
    fields = e.image_inputs()
    fields["token_inputs"] = {k: v[: len(context)] for k, v in fields["token_inputs"].items()}
    backend = HFRolloutBackend(q.model, q.tokenizer)
    out = backend.generate([context], SamplingParams(n=1, max_new_tokens=2, temperature=0.0), images=[fields])
    assert len(out[0][0].token_ids) >= 1


def test_a_look_tool_call_is_answered_with_an_image_the_next_turn_is_generated_with(vlm):
    """second_look's tool: a ``look`` call gets a tool message with the picture's left half (an image part); the
    next generate call carries both images; env/tool_calls and env/images_shown count it."""
    q = vlm
    call = '<tool_call>\n{"name": "look", "arguments": {"region": "left"}}\n</tool_call>'
    backend = ScriptedVLM(q.model, q.tokenizer, [call, "red"])
    runner = Episodes(SecondLookEnv, SecondLookEnv.Config(offer=False), _config(), q.tokenizer, backend, q.vision)
    episodes = runner.play(q.rows, SamplingParams(n=2, max_new_tokens=64))
    assert backend.images_per_call == [[1], [2, 2]]
    for e in episodes:
        assert e.ended == "done" and e.images_shown == 1, (e.ended, e.error)
        tool = e.messages[2]
        assert tool["role"] == "tool" and [p["type"] for p in tool["content"]] == ["image", "text"]
        assert tool["content"][1]["text"] == "the picture (left)"
        assert [shown["turn"] for shown in e.env_images] == [1]  # the tool's answer to the first turn
    metrics = runner.metrics(episodes)
    assert metrics["env/tool_calls"] == 1.0 and metrics["env/images_shown"] == 1.0


def test_a_text_model_shown_an_image_ends_the_episode_as_an_environment_error(tiny_model_dir):
    """A text model cannot be shown an image: the episode ends with error (counted in env/errors), naming why."""
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer

    tokenizer, model = load_tokenizer(str(tiny_model_dir)), load_causal_lm(str(tiny_model_dir)).eval()
    backend = _TextScripted(tokenizer)
    runner = Episodes(SecondLookEnv, SecondLookEnv.Config(), _config(), tokenizer, backend)
    rows = [{"prompt": "What colour is the shape?", "images": [{"bytes": _png((40, 40, 220))}], "answer": "blue"}]
    episodes = runner.play(rows, SamplingParams(n=2, max_new_tokens=8))
    for e in episodes:
        assert e.ended == "error" and "text model" in e.error and "image" in e.error
        assert e.images_shown == 0 and e.pixels == {} and e.env_images == [] and e.media() == {}
    assert runner.metrics(episodes)["env/errors"] == 2.0
    del model


class TextParts(Environment):
    """Step style: answers the first turn with a user message of two text parts, then ends."""

    name = "text_parts"

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) > 1:
            return [], 1.0, True
        return (
            [{"role": "user", "content": [{"type": "text", "text": "try "}, {"type": "text", "text": "again"}]}],
            0.0,
            False,
        )


def test_a_text_model_takes_text_parts_as_one_string(tiny_model_dir):
    """Content parts without images reach a text model's template as one string (its template may take none)."""
    from oxrl_core.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    runner = Episodes(TextParts, TextParts.Config(), _config(), tokenizer, _TextScripted(tokenizer))
    episodes = runner.play([{"prompt": "What colour?", "answer": "red"}], SamplingParams(n=2, max_new_tokens=8))
    for e in episodes:
        assert e.ended == "done" and not e.error
        assert e.messages[2]["content"] == "try again"
        environment = [t for t, s in zip(e.token_ids, e.sampled) if not s]
        assert "try again" in tokenizer.decode(environment)


class _TextScripted(RolloutBackend):
    name = "scripted_text"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompt_token_ids, sampling):
        ids = self.tokenizer("red", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [
            [Completion(list(ids), [0.0] * len(ids), "stop", 0) for _ in range(sampling.n)] for _ in prompt_token_ids
        ]

    def update_weights(self, state, policy_version):
        pass


class _Engine:
    device = torch.device("cpu")


def _failures(name):
    from oxrl_core.scoring.rewards import Failures

    return Failures(name)


def _env_failures():
    from oxrl_core.scoring.rewards import Failures

    return Failures("second_look", "environment")


# ----------------------------------------------------------------------------- through the real CLI


@pytest.mark.slow
def test_sgrpo_with_the_second_look_environment_on_the_built_in_vlm(tmp_path):
    """`oxrl run --alg sgrpo --set env.name=second_look` (the built-in VLM on shapes, its tiny defaults): two
    steps, exit 0, and the environment showed images (its second look: every episode's first answer ends with EOS
    on the warm start); `oxrl eval --env second_look` on image rows with its final/. Held out: 4 of the shapes
    eval rows (the default 100 take 3 s an evaluation). The warm start of the built-in VLM (about 40 s) is built
    once per test session (the visual demos share it).

    rollouts.jsonl logs each sample's second look beside its prompt's image (the same picture, at turn 1), and
    `oxrl report`'s viewer shows both, decoded, in headless Chromium (issue 47, item 3)."""
    import base64
    import json
    import re

    from test_report_images import decoded, dump_dom, with_probe

    from oxrl_core.data.shapes import rows as shapes_rows

    held_out = [
        {"prompt": r["prompt"], "images": [base64.b64encode(r["images"][0]["bytes"]).decode()], "answer": r["answer"]}
        for r in shapes_rows("eval")[:4]
    ]
    eval_file = write_jsonl(tmp_path / "eval.jsonl", held_out)
    run = tmp_path / "run"
    proc = oxrl(
        "run", "--alg", "sgrpo", "--output-dir", str(run), "--set", "env.name=second_look",
        "--set", "train.max_steps=2", "--set", "train.batch_size=2", "--set", "rollout.n=2", "--set", "train.seed=0",
        "--set", f"data.eval={eval_file}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    metrics = read_metrics(run)
    assert len(metrics) == 2
    assert sum(m["env/images_shown"] for m in metrics) > 0, metrics
    assert all(m["env/errors"] == 0 for m in metrics), metrics
    assert metrics[-1]["eval/turns"] >= 2.0  # held-out episodes got their second look too
    assert Path(run, "final", "config.json").exists()
    # rollouts.jsonl: each logged sample's prompt image and the environment's second look at it, after turn 1
    logged = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    for s in logged[0]["samples"]:
        (prompt_image,) = s["images"]
        assert [shown["turn"] for shown in s["env_images"]] == [1], s.get("env_images")
        again = decoded(s["env_images"][0]["image"])
        assert again.size == (32, 32) and again.tobytes() == decoded(prompt_image).tobytes()
    # ... and the report's viewer shows both images of each sample, decoded
    proc = oxrl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    probed = tmp_path / "probed.html"
    probed.write_text(with_probe((run / "report.html").read_text()))
    dom, console = dump_dom(probed, tmp_path)
    assert console == [], console
    shown = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)[1].replace("&quot;", '"'))
    assert [[(ok, w, h) for ok, w, h, _ in images] for images in shown] == [[(True, 32, 32)] * 2] * len(shown)
    assert len(shown) == len(logged[0]["samples"]) and "shown by the environment, turn 1" in dom
    # the trained VLM's held-out episodes through `oxrl eval --env`, from image rows
    proc = oxrl("eval", "--model", str(run / "final"), "--data", str(eval_file), "--env", "second_look",
                "--reward", "exact_match", "--max-new-tokens", "16")  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "env/images_shown" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_image_episodes_under_a_rollout_actor_and_zero3_give_the_first_step_of_one_process(tmp_path):
    """SGRPO with the ``second_look`` environment on the built-in VLM (image prompts, and an image the environment
    shows mid-episode): with a rollout actor (Ray: every turn's generation, its pixels included, runs there) and
    with DeepSpeed ZeRO-3 on two ranks (each rank plays and trains its own episodes with their images), the first
    step's rewards, images shown, loss and gradient norm equal the one-process run's (two seeded rollout shards
    everywhere, so one process samples what two ranks do)."""
    import base64
    import math

    from oxrl_core.data.shapes import rows as shapes_rows

    held_out = [  # two held-out rows: the runs' evaluations stay short
        {"prompt": r["prompt"], "images": [base64.b64encode(r["images"][0]["bytes"]).decode()], "answer": r["answer"]}
        for r in shapes_rows("eval")[:2]
    ]
    common = (
        "--set", "env.name=second_look", "--set", "train.max_steps=1", "--set", "train.batch_size=4",
        "--set", "rollout.n=2", "--set", "train.seed=0", "--set", "engine.rollout_shards=2",
        "--set", f"data.eval={write_jsonl(tmp_path / 'eval.jsonl', held_out)}",
    )  # fmt: skip
    zero3 = ("--set", "engine.name=deepspeed", "--set", "engine.zero_stage=3", "--set", "engine.world_size=2")
    runs = {}
    for name, extra in (("one", ()), ("actor", ("--set", "rollout.actors=1")), ("z3", zero3)):
        proc = oxrl("run", "--alg", "sgrpo", "--output-dir", str(tmp_path / name), *common, *extra)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        (runs[name],) = read_metrics(tmp_path / name)
    one = runs["one"]
    assert one["env/images_shown"] > 0, one
    for name in ("actor", "z3"):
        other = runs[name]
        assert other["reward/mean"] == one["reward/mean"] and other["env/images_shown"] == one["env/images_shown"]
        assert math.isclose(other["loss"], one["loss"], rel_tol=1e-5, abs_tol=1e-7), (name, other["loss"], one["loss"])
        assert math.isclose(other["grad_norm"], one["grad_norm"], rel_tol=1e-4), (name, other, one)
