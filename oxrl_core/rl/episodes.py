"""Multi-turn episodes for the RL loop (``env.name``): the model and an `Environment` take turns.

Per turn, every live episode is sent to the rollout backend in ONE batched ``generate`` call (the
first turn with ``rollout.n`` samples per prompt, later turns one continuation per episode). The
model's turn is parsed for tool calls, the environment answers, and the episode continues until the
environment says ``done``, a final answer (tools style), ``env.max_turns`` model turns, the token
budget ``env.max_tokens`` or a turn cut at ``rollout.max_new_tokens``.

Token-exact by construction. The backend is always given token ids, never re-rendered text: each
turn continues from exactly the ids of the turns before. An episode's training sample is

    prompt ids | model turn 1 (sampled) | environment tokens | model turn 2 (sampled) | ...

where the environment tokens are the chat template's rendering of the new messages (and the next
generation prompt), computed as an exact-prefix extension of the conversation: the template renders
the conversation before and after the new messages, the text after must start with the text before
plus the model's turn as sampled, and what follows is the environment's part (`extension_ids`). The
model's sampled tokens are never re-tokenised. The loss mask is 1 on the model's tokens only, so
logprobs, advantages, KL and TIS apply to them alone; the environment's tokens get logprob 0.

Fallback, when a template breaks the extension (it rewrites earlier turns, as Qwen3's drops past
``<think>`` blocks): the episode's training sample starts again from that turn — its prompt becomes
the template's rendering of the whole conversation so far, the turns before it are not trained on —
and the episode goes on from those ids (``env/retemplate_fallbacks`` counts it). What the model is
trained on is still exactly what it was given and what it sampled.

Images (a vision-language model, `models.vision.VLMProcessing`): an episode may start from an image prompt (the
row's ``images``, placed in its messages as `vision.image_messages` places them), and ``step`` may return messages
whose ``content`` is a list of parts, ``{"type": "text", "text": ...}`` and ``{"type": "image", "image": <path |
base64 string | bytes | {"bytes"|"path": ...}>}`` (the forms rows take, `data.images.decode_image`). The
environment's tokens are still the template's text extension, encoded by the model's processor with the new images,
which expands each image's placeholder exactly as the processor does (`Episodes.encode_text`); the episode keeps the
image inputs of every image in its sequence, in order (`Episode.pixels`), and each later ``generate`` call and the
trainer's forwards get exactly those. Image tokens are environment tokens (mask 0). A text model cannot take an
image: an environment image part ends that episode as an environment error naming why (``env/errors``; the run stops
if it keeps happening, `EnvWatch`), rather than dropping the picture the model was meant to see. A family whose
pixels are one entry per row (Idefics3, ``pixels_by = row``) adds the image's tiles to the row's (`join_pixels`);
SmolVLM's own template writes an assistant turn with a space its generation prompt lacks, so there each environment
turn takes the fallback above (the processor encodes the whole conversation, images and all). The images the
environment showed are kept as rollouts.jsonl logs images (``Episode.env_images``: PNG data URIs with their turn)
and travel in each episode's media record (`Episode.media`) to the RL step's log.

Each episode's environment lives in a worker process of its own (`oxrl_core.rollout.env_worker`: one instance per
episode, forked from a host process that loaded the environment once; about a millisecond each), so a call
that hangs can be stopped: the worker is killed, and nothing of it keeps running. The calls of a turn go to
every live episode's worker at once (at most one per CPU running), each within the environment's ``timeout_s``.
A worker is closed when its episode is over (after `rewards` when the environment defines ``reward``).

Faults end an episode, not the run: an environment call (``reset``, ``step``, ``reward``) that raises or
returns something malformed ends its episode with reward 0 (``env/errors``), one that runs past the
environment's ``timeout_s`` likewise (``env/timeouts``, its worker killed); malformed tool calls are answered
with an error message by `ToolEnvironment` (``env/bad_tool_calls``). What failed is kept per episode
(``Episode.error``) and summarised per step as reward failures are (`episode_failures`: one warning line naming
the first failure, ``env/error_share``, ``env/first_error``); an environment that keeps failing stops the
run as a reward that keeps failing does (`EnvWatch`: ``env.max_error_share`` for ``env.error_steps`` steps
in a row), since episodes that all score 0 train nothing.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import replace

from oxrl_core.data.images import TOKEN_INPUTS, decode_image, image_base_dir, picture_tensors
from oxrl_core.data.rows import row_where
from oxrl_core.data.sources import can_verify
from oxrl_core.engines.distributed import all_gather_object, broadcast_object, is_main, rank, world_size
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Completion, Environment, SamplingParams
from oxrl_core.rl.records import EpisodeBatch, EpisodeShare
from oxrl_core.rl.turns import (  # noqa: F401 - `render`, `extension_ids`: one episode's parts, used here and by tests
    PICTURE_IMAGES,
    PICTURE_SPANS,
    Episode,
    _as_text,
    _check_step,
    encode,
    extension_ids,
    extension_text,
    image_parts,
    render,
)
from oxrl_core.rollout.env_worker import Malformed, call_all, class_tools, spawn
from oxrl_core.scoring.rewards import Failures, RewardWatch, row_number, score_batch
from oxrl_core.seeds import stream_seed
from oxrl_core.tool_parsers import parser_for

#: metrics that are means per episode (the other episode metrics are counts)
EPISODE_MEANS = (
    "env/turns",
    "env/tool_calls",
    "env/episode_tokens",
    "env/cut_by_max_tokens",
    "env/cut_by_max_new_tokens",
    "env/images_shown",
)
#: reward failures, counted over the episodes scored on their final answers
COUNTS = ("reward/errors", "reward/timeouts")


# ----------------------------------------------------------------------------- failures of the environment


def episode_failures(env: str, episodes: list[Episode]) -> Failures:
    """The environment's failures over ``episodes`` (a step, in batch order), as a `Failures` record like a
    reward's: counts of episodes that raised or returned something malformed (``errors``) and that timed out
    (``timeouts``), and the first failure whole (its row, a snippet of its prompt, what failed); a timeout is
    noted as one, so the first error is named in preference to it."""
    failures = Failures(env, "environment", samples=len(episodes))
    rows = [e.row for e in episodes]
    for i, e in enumerate(episodes):
        failures.errors += e.ended == "error"
        failures.timeouts += e.ended == "timeout"
        if e.failed:
            row, prompt = row_number(rows, i), e.row.get("prompt", "")
            failures.note(row, prompt, e.error or e.ended, timed_out=e.ended == "timeout")
    return failures


class EnvWatch(RewardWatch):
    """Stops a run whose environment keeps failing: a failed share of the episodes above ``env.max_error_share``
    for ``env.error_steps`` steps in a row. The streak and the line per step are `RewardWatch`'s; episodes that
    fail score 0, so a run on them learns nothing and stops before training on them, naming the environment,
    its first failure and the newest complete checkpoint. ``steps = 0`` or ``max_share = 1`` never stops."""

    def message(self, step: int, failures: Failures, streak: str, keep: str) -> str:
        return (
            f"step {step}: environment '{failures.name}' failed in {failures.failed} of {failures.samples} episodes "
            f"({failures.share:.0%}) — over env.max_error_share={self.max_share:g} in {streak}; first failure on "
            f"{failures.first()}. The run stops before training on episodes that all score 0 ({keep}). Fix the "
            "environment, or set env.max_error_share=1 to train on anyway"
        )


# ----------------------------------------------------------------------------- the runner


def shard_blocks(rows: list[dict], shards: int) -> list[tuple[int, list[dict]]]:
    """The rows of a rollout batch cut into ``shards`` contiguous shards of whole prompts: (k, rows) each."""
    size = len(rows) // shards
    return [(k, rows[k * size : (k + 1) * size]) for k in range(shards)]


class Episodes:
    """Plays the multi-turn episodes of a rollout batch against the rollout backend, set up once per run."""

    def __init__(self, env_cls, env_config, cfg, tokenizer, backend, vision=None):
        """``vision``: a VLM run's `VLMProcessing` (image prompts, environment images); None for a text model."""
        self.env_cls, self.env_config, self.tokenizer, self.backend = env_cls, env_config, tokenizer, backend
        self.vision = vision
        #: what renders the conversation: a VLM's processor (its template writes image parts), else the tokenizer
        self.renderer = vision.processor if vision is not None else tokenizer
        self.max_turns, self.max_tokens = cfg.env.max_turns, cfg.env.max_tokens
        self.max_new_tokens = cfg.rollout.max_new_tokens
        if not getattr(self.renderer, "chat_template", None) and not getattr(tokenizer, "chat_template", None):
            raise OxrlError(
                f"env.name={cfg.env.name}: the model's tokenizer has no chat template, so the environment's "
                "messages cannot be rendered; use a model with a chat template (oxrl check-model shows it)"
            )
        self.parser = parser_for(tokenizer, cfg.env.tool_parser)
        #: whether `rewards` calls the environment's reward() (the base class's returns None: no call needed)
        self.calls_reward = env_cls.reward is not Environment.reward
        #: the tool schemas when the interface's own tools() gives them (they depend on the class alone)
        self.tools = class_tools(env_cls)

    # ---- images (a VLM run)

    def row_messages(self, row: dict, prompt) -> list[dict]:
        """The first turn's messages: ``prompt`` (the row's, or `reset`'s text) as chat messages; in a VLM run the
        row's ``images`` go into its image parts (`vision.image_messages`: ``<image>`` markers or image parts), as
        given (paths, base64, bytes: plain data for the environment's worker)."""
        if self.vision is not None and row.get("images"):
            from oxrl_core.models.vision import image_messages  # lazy: the runner stays importable without torch

            try:
                return image_messages(prompt, list(row["images"]))
            except ValueError as exc:
                raise Malformed(f"the prompt does not place the row's {len(row['images'])} image(s): {exc}") from None
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def decode(self, e: Episode, values: list, what: str) -> list:
        """Image values of episode ``e`` (a row's or an environment's) -> RGB PIL images; relative paths from the
        row's data file's directory. A bad one is `OxrlError` naming the row and ``what``."""
        origin = e.row.get("_origin", "")
        base, where = image_base_dir(e.row, origin), row_where(e.row, origin)
        return [decode_image(v, base, where, f"{what}[{i}]") for i, v in enumerate(values)]

    def encode_text(self, text: str, images: list) -> tuple[list[int], dict]:
        """Rendered ``text`` -> (token ids, image fields): without images the tokenizer's ids; with ``images`` (PIL,
        in placeholder order) the model's processor's, each placeholder expanded as the processor expands it, and
        the fields in `encode.image_fields`' form (``pixel_inputs``, ``token_inputs``, ``pixels_by``)."""
        if not images:
            return encode(self.tokenizer, text), {}
        out = self.vision.processor(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        pixels = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        tokens = {name: pixels.pop(name)[0].tolist() for name in TOKEN_INPUTS if name in pixels}
        # for a backend that expands images itself (vLLM): this span's text with one placeholder per image, and the
        # pictures (`Episode.image_inputs` puts the episode's whole unexpanded sequence together)
        unexpanded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, {
            "pixel_inputs": pixels,
            "token_inputs": tokens,
            "pixels_by": self.vision.family.pixels_by,
            PICTURE_SPANS: [(0, len(ids), unexpanded)],
            PICTURE_IMAGES: picture_tensors(images),
        }

    def encode_messages(self, e: Episode, messages: list[dict], tools) -> tuple[list[int], dict]:
        """A whole conversation with its generation prompt -> (ids, image fields) (`encode_text`)."""
        images = self.decode(e, image_parts(messages), "images") if self.vision is not None else []
        return self.encode_text(render(self.renderer, messages, tools, True), images)

    def image_refusal(self, added: list[dict]) -> str:
        """Why this run cannot show the environment's images (empty when it can, or when there are none)."""
        if not image_parts(added):
            return ""
        if self.vision is None:
            return (
                "step() returned an image part, but the model is a text model (it has no processor and reads no "
                "pixels); use a vision-language model (model.name) or return text"
            )
        return ""

    @staticmethod
    def join_pixels(e: Episode, fields: dict, offset: int) -> None:
        """Add an environment turn's image fields (its tokens start at ``offset`` in the sequence) to ``e``'s:
        pixel inputs concatenated image after image — on the first dimension where it counts patches or images, on
        the second where it counts rows (Idefics3: (1, tiles, ...), the new image's tiles after the row's, each tile
        the image processor's square, as its encoding of all the images at once gives them) — and per-token inputs
        placed at their tokens."""
        import torch

        if not fields:
            return
        if not e.pixels:
            e.pixels = {"pixel_inputs": {}, "token_inputs": {}, "pixels_by": fields["pixels_by"]}
        old = e.pixels["pixel_inputs"]
        dim = 1 if fields["pixels_by"] == "row" else 0
        spans = [(offset + a, offset + b, u) for a, b, u in fields.get(PICTURE_SPANS, ())]
        e.pixels = {
            **e.pixels,
            PICTURE_SPANS: list(e.pixels.get(PICTURE_SPANS, ())) + spans,
            PICTURE_IMAGES: list(e.pixels.get(PICTURE_IMAGES, ())) + list(fields.get(PICTURE_IMAGES, ())),
            "pixel_inputs": {
                k: torch.cat([old[k], v], dim=dim) if k in old else v for k, v in fields["pixel_inputs"].items()
            },
            "token_inputs": {
                k: list(e.pixels["token_inputs"].get(k, [])) + [0] * (offset - len(e.pixels["token_inputs"].get(k, [])))
                + list(v)
                for k, v in fields["token_inputs"].items()
            },
        }  # fmt: skip

    # ---- one rollout batch

    def play(self, rows: list[dict], sampling: SamplingParams) -> list[Episode]:
        """``sampling.n`` episodes for each row (the n of a row contiguous), played to their end."""
        return self.play_shards([(0, rows)], sampling)

    def play_shards(self, shards: list[tuple[int, list[dict]]], sampling: SamplingParams) -> list[Episode]:
        """The episodes of several shards ``(k, rows)`` of a rollout batch, in shard order. Shard k samples
        with the seed moved to shard k, and each turn with it moved to that turn (`stream_seed`, as single-turn
        shards do), so its episodes do not depend on which process plays it or beside which other shards; each
        turn is one backend call per shard, or one call for all of them with rollout actors (``generate_shards``
        deals them to the actors)."""
        played = []
        for k, rows in shards:
            seed = None if sampling.seed is None else stream_seed(sampling.seed, shard=k)
            played.append((rows, self.start([row for row in rows for _ in range(sampling.n)]), seed))
        for turn in range(self.max_turns):
            requests, lives = [], []
            for rows, episodes, seed in played:
                live = [e for e in episodes if not e.ended]
                if live:
                    requests.append(self.turn_request(live, episodes, rows, replace(sampling, seed=seed), turn))
                    lives.append(live)
            if not requests:
                break
            # (a VLM run: each prompt's image inputs go with it, every image of the episode so far)
            if self.backend.remote:  # rollout actors: the shards of this turn generated in parallel
                results = self.backend.generate_shards(
                    [(prompts, params) if images is None else (prompts, params, images)
                     for prompts, params, _, images in requests]
                )  # fmt: skip
            else:
                results = [
                    self.backend.generate(prompts, params) if images is None
                    else self.backend.generate(prompts, params, images=images)
                    for prompts, params, _, images in requests
                ]  # fmt: skip
            waiting = []
            for live, (_, _, grouped, _), groups in zip(lives, requests, results):
                self.take_turn(live, [c for g in groups for c in g] if grouped else [g[0] for g in groups])
                waiting += [e for e in live if not e.ended]
            self.env_turns(waiting)  # the environments of every shard answer at once, each in its own process
        return [e for _, episodes, _ in played for e in episodes]

    def play_sharded(self, rows: list[dict], sampling: SamplingParams, shards: int, engine):
        """This process's episodes of a rollout batch cut into ``shards`` shards of whole prompts, dealt as
        single-turn rollouts are (`generate_sharded`): with rollout actors rank 0 plays every shard and the
        actors generate them in parallel; else each rank plays its contiguous block of shards on whole
        weights. The episodes depend on ``shards``, not on the world size. `collect` brings them together."""
        blocks = shard_blocks(rows, shards)
        if self.backend is None or self.backend.remote:
            return self.play_shards(blocks, sampling) if is_main() else []
        per_rank = shards // world_size()
        with engine.full_weights():  # ZeRO-3: every rank generates on whole weights
            return self.play_shards(blocks[rank() * per_rank : (rank() + 1) * per_rank], sampling)

    def collect(self, played: list[Episode], reward, failures: Failures, env_failures: Failures) -> EpisodeBatch:
        """Every process's episodes of the step on every process: ``(prompt ids, completions, scores,
        metrics)`` in batch order. Each process scores its own episodes (their environments live there);
        the reward failures of all of them are added to ``failures``, the environment's to ``env_failures``
        (the metrics get ``env/error_share`` and, when any failed, the first failure's text ``env/first_error``).
        A VLM run adds each episode's image inputs (B,) as a fifth item (None for a text model)."""
        mine = self.share(played, reward, failures.name, env_failures.name)
        parts = [broadcast_object(mine)] if self.backend is None or self.backend.remote else all_gather_object(mine)
        return self.merge(parts, failures, env_failures)

    def share(self, played: list[Episode], reward, reward_name: str, env_name: str) -> EpisodeShare:
        """This process's episodes scored, with no collective: (each episode's (prompt ids, completion), scores,
        reward counts, episode metrics, the reward's and the environment's `Failures`, media records: `Episode.media`) —
        plain data that `merge` brings together (and that an asynchronous run keeps in a checkpoint)."""
        local = Failures(reward_name)
        scores, counts = self.rewards(played, reward, local) if played else ([], {})
        return EpisodeShare(
            [(e.prompt_ids, e.as_completion()) for e in played],
            scores,
            {k: v for k, v in counts.items() if k in COUNTS},
            self.metrics(played) if played else {},
            local,
            episode_failures(env_name, played),
            [e.media() for e in played],
        )

    def merge(self, parts: list[EpisodeShare], failures: Failures, env_failures: Failures) -> EpisodeBatch:
        """Every process's `share`, in batch order, as `collect` returns it."""
        samples = [s for part in parts for s in part.samples]
        scores = [s for part in parts for s in part.scores]
        metrics: dict[str, float | str] = defaultdict(float)
        media = [fields for part in parts for fields in part.media]
        for part in parts:
            failures.merge(part.failures)
            env_failures.merge(part.env_failures)
            for k, v in part.counts.items():
                metrics[k] += v
            for k, v in part.metrics.items():  # per-episode means weighted by episodes; counts summed
                metrics[k] += v * len(part.scores) / len(scores) if k in EPISODE_MEANS else v
        mean = sum(scores) / len(scores)
        metrics["reward/mean"] = mean
        metrics["reward/std"] = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
        metrics["env/error_share"] = env_failures.share
        if env_failures.failed:
            metrics["env/first_error"] = env_failures.first()  # text: metrics.jsonl keeps it, trackers skip it
        return EpisodeBatch([p for p, _ in samples], [c for _, c in samples], scores, dict(metrics), media)

    def start(self, rows: list[dict]) -> list[Episode]:
        """One episode per row (the n of a row contiguous), each with its environment in a worker process of its
        own: built, `reset` on the row, its `tools`. An environment that fails to start gets one model turn on the
        row's own prompt and reward 0."""
        workers = spawn(self.env_cls, self.env_config, self.parser, len(rows))
        episodes = [Episode(row, worker, [], []) for row, worker in zip(rows, workers)]
        for e in episodes:
            if e.env.started[0] != "ok":
                self._broken(e, *e.env.started)
        live = [e for e in episodes if not e.start_failure]
        for e, (kind, text) in zip(live, call_all([(e.env, "reset", (e.row,)) for e in live])):
            if kind == "ok" and text is not None and not isinstance(text, str):
                kind, text = "error", f"reset() must return text or None, got {type(text).__name__}"
            if kind != "ok":
                self._broken(e, kind, text)
                continue
            try:
                e.messages = self.row_messages(e.row, e.row["prompt"] if text is None else text)
            except Malformed as exc:
                self._broken(e, "error", f"reset(): {exc}")
        live = [e for e in live if not e.start_failure]
        if self.tools is not None:
            calls = [("ok", list(self.tools))] * len(live)
        else:
            calls = call_all([(e.env, "tools", ()) for e in live])
        for e, (kind, tools) in zip(live, calls):
            if kind != "ok":
                self._broken(e, kind, tools)
                continue
            e.tools = tools
            e.prompt_ids, e.pixels = self.encode_messages(e, e.messages, e.tools)
        return episodes

    def _broken(self, episode: Episode, why: str, error: str) -> None:
        """An episode whose environment failed to start (``why``: error | timeout): the row's own prompt, one
        model turn, reward 0; its worker is gone (killed at a timeout) or closed now."""
        episode.messages = self.row_messages(episode.row, episode.row["prompt"])
        episode.tools = []
        episode.prompt_ids, episode.pixels = self.encode_messages(episode, episode.messages, [])
        episode.start_failure, episode.error = why, error
        episode.env.close()

    def turn_request(self, live, episodes, rows, sampling: SamplingParams, turn: int):
        """One backend call for the live episodes of a shard: ``(prompt ids, sampling, grouped, images)``. On the
        first turn the n episodes of a row share their prompt and are sampled as one group of n. ``images``: in a
        VLM run each prompt's image inputs ({} for a text one: the backend then knows it is an image run), else
        None."""
        budget = max(self.max_tokens - e.used for e in live)
        params = replace(sampling, max_new_tokens=min(self.max_new_tokens, budget))
        if sampling.seed is not None:
            params = replace(params, seed=stream_seed(sampling.seed, turn=turn))
        n = sampling.n
        first = [episodes[i * n : (i + 1) * n] for i in range(len(rows))] if turn == 0 else []
        vlm = self.vision is not None
        if first and all(len({tuple(e.prompt_ids) for e in group}) == 1 for group in first):
            images = [group[0].image_inputs() for group in first] if vlm else None
            return [group[0].prompt_ids for group in first], params, True, images  # n samples per prompt
        images = [e.image_inputs() for e in live] if vlm else None
        return [e.prompt_ids + e.token_ids for e in live], replace(params, n=1), False, images

    def take_turn(self, live: list[Episode], completions: list[Completion]) -> None:
        """Each live episode gets its turn's tokens and logprobs (cut at its own token budget)."""
        for e, c in zip(live, completions):
            room = self.max_tokens - e.used
            ids, logprobs = c.token_ids[:room], c.logprobs[:room]
            e.add(ids, logprobs)
            e.turns += 1
            e.versions.add(c.policy_version)
            eos = c.finish_reason == "stop" and len(ids) == len(c.token_ids)
            e.finish_reason = "stop" if eos else "length"
            text = self.tokenizer.decode(ids[:-1] if eos else ids, skip_special_tokens=False)
            e.turn = {"role": "assistant", "content": text}
            e.ended_eos = eos
            if e.start_failure:
                e.messages.append(e.turn)
                e.end(e.start_failure)
            elif not eos:  # cut: by the episode's budget (the turn reached its room) or by rollout.max_new_tokens
                e.messages.append(e.turn)
                e.end("max_tokens" if len(ids) >= room else "length")
            self.release(e)

    def release(self, e: Episode) -> None:
        """Close an ended episode's worker unless `rewards` still needs it (the environment defines `reward`)."""
        if e.ended and (e.failed or not self.calls_reward):
            e.env.close()

    def env_turns(self, episodes: list[Episode]) -> None:
        """The environments answer the model's turns (`step`, each in its worker process, in parallel)."""
        before = [list(e.messages) for e in episodes]
        for e in episodes:
            e.messages.append(e.turn)
        outcomes = call_all([(e.env, "step", (list(e.messages),)) for e in episodes])
        for e, messages, outcome in zip(episodes, before, outcomes):
            self.env_turn(e, messages, outcome)
            self.release(e)

    def env_turn(self, e: Episode, before: list[dict], outcome: tuple) -> None:
        """One environment's answer: its messages join the sample as template tokens."""
        kind, value = outcome
        if kind == "ok":
            try:
                added, reward, done = _check_step(value)
            except Malformed as exc:
                kind, value = "error", str(exc)
        if kind != "ok":  # a failing environment ends its episode (EnvWatch: maybe the run)
            e.error = value
            return e.end(kind)  # error | timeout
        e.step_rewards.append(reward)
        if done:
            return e.end("done")
        if e.turns >= self.max_turns:
            return e.end("max_turns")
        refusal = self.image_refusal(added)
        if refusal:  # an image this model cannot be shown: the episode's error, never a silently dropped picture
            e.error = refusal
            return e.end("error")
        if self.vision is None:  # a text model's template takes strings: text parts joined
            added = [_as_text(m) for m in added]
        rest = extension_text(self.renderer, self.tokenizer, before, e.turn, added, e.ended_eos, e.tools)
        e.messages += added
        try:
            new = self.decode(e, image_parts(added), "step() image") if self.vision is not None else []
            if rest is None:  # the template rewrote history: a new training sample from this turn
                prompt, pixels = self.encode_messages(e, e.messages, e.tools)
            else:
                ids, fields = self.encode_text(rest, new)
        except Exception as exc:  # noqa: BLE001 - an image that does not decode or encode: the episode's error
            e.error = f"step() returned an image the model's processor cannot take: {exc}"
            return e.end("error")
        if rest is None:
            grown = max(0, len(prompt) - len(e.prompt_ids) - len(e.token_ids))
            if e.used + grown >= self.max_tokens:
                return e.end("max_tokens")
            e.earlier = (e.prompt_ids, e.token_ids, e.logprobs, e.sampled, e.pixels, len(e.env_images))
            e.prompt_ids, e.token_ids, e.logprobs, e.sampled, e.pixels = prompt, [], [], [], pixels
            e.used += grown
            e.fallbacks += 1
            self.shown(e, new)
            return None
        if e.used + len(ids) >= self.max_tokens:
            return e.end("max_tokens")  # no room left for the model's next turn (an image is never cut)
        self.join_pixels(e, fields, len(e.prompt_ids) + len(e.token_ids))
        e.add(ids, None)
        self.shown(e, new)
        return None

    @staticmethod
    def shown(e: Episode, images: list) -> None:
        """The environment's ``images`` (PIL, decoded) are in ``e``'s sequence now: counted (``env/images_shown``) and
        kept for rollouts.jsonl as it logs a prompt's images (`image_data_uri`), with the turn they answered."""
        from oxrl_core.rollout.log import image_data_uri  # lazy: the runner stays importable without torch

        e.images_shown += len(images)
        e.env_images += [{"turn": e.turns, "image": image_data_uri(image)} for image in images]

    # ---- rewards and metrics

    def rewards(self, episodes: list[Episode], reward, failures: Failures) -> tuple[list[float], dict]:
        """R = Σ step rewards + the environment's `reward` (or, where it gives none and scores final answers,
        ``reward`` on the final answer); 0 for an episode whose environment failed. The episodes are over
        afterwards: their workers are closed (score each episode once)."""
        scores = [0.0 if e.failed else sum(e.step_rewards) for e in episodes]
        scored = [i for i, e in enumerate(episodes) if not e.failed]
        # reward() in each episode's worker, when the environment defines one (else its answer is None)
        calls = [(episodes[i].env, "reward", (episodes[i].row, list(episodes[i].messages))) for i in scored]
        outcomes = call_all(calls) if self.calls_reward else [("ok", None)] * len(scored)
        final = []
        for i, (kind, extra) in zip(scored, outcomes):
            e = episodes[i]
            e.env.close()  # the episode is over
            if kind == "ok" and extra is not None and (isinstance(extra, bool) or not isinstance(extra, (int, float))):
                kind, extra = "error", f"reward() returned {extra!r}, not a number or None"
            elif kind == "ok" and extra is not None and not math.isfinite(extra):
                kind, extra = "error", f"reward() returned {extra!r}, not a finite number"
            if kind != "ok":  # counted as the environment's failure, never raised
                e.ended, e.error, scores[i] = kind, extra, 0.0
                continue
            if extra is not None:
                scores[i] += float(extra)
            elif e.env.scores_final_answer:
                final.append(i)
        metrics: dict[str, float] = {}
        if final:
            rows = [episodes[i].row for i in final]
            texts = [episodes[i].final_answer() for i in final]
            got, metrics = score_batch(reward, [r["prompt"] for r in rows], texts, rows, failures)
            for i, s in zip(final, got):
                scores[i] += s
        mean = sum(scores) / len(scores)
        metrics = {k: v for k, v in metrics.items() if k in COUNTS}
        metrics["reward/mean"] = mean
        metrics["reward/std"] = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
        return scores, metrics

    def metrics(self, episodes: list[Episode]) -> dict[str, float]:
        """Per step: means per episode (turns, tool calls, tokens, the shares cut by env.max_tokens and by
        rollout.max_new_tokens) and counts (the rest)."""
        n = len(episodes)
        stats = Counter()
        for e in episodes:
            stats.update(e.env.stats)  # the instance's `Environment.stats`, as of its last call
        return {
            "env/turns": sum(e.turns for e in episodes) / n,
            "env/tool_calls": stats["tool_calls"] / n,
            "env/episode_tokens": sum(e.used for e in episodes) / n,
            "env/bad_tool_calls": float(stats["bad_tool_calls"]),
            "env/errors": float(sum(e.ended == "error" for e in episodes)),
            "env/timeouts": float(sum(e.ended == "timeout" for e in episodes)),
            "env/truncated": float(sum(e.ended in ("max_tokens", "length", "max_turns") for e in episodes)),
            "env/cut_by_max_tokens": sum(e.ended == "max_tokens" for e in episodes) / n,
            "env/cut_by_max_new_tokens": sum(e.ended == "length" for e in episodes) / n,
            "env/retemplate_fallbacks": float(sum(e.fallbacks for e in episodes)),
            "env/images_shown": sum(e.images_shown for e in episodes) / n,
        }

    # ---- held-out evaluation

    def evaluate(self, rows: list[dict], reward, dataset, ro, batch: int = 64, progress=None) -> dict:
        """Held-out episodes, greedy: ``eval/reward``, ``eval/accuracy`` of the final answers when the data can
        check them, ``eval/turns``, ``eval/tool_calls``. (Unlike single-turn evaluation, no sampled pass: n
        episodes per prompt of several turns each would cost more than the training steps between evaluations.)
        ``progress(done, total)`` counts the episodes (a `progress.Reporter.counter` update)."""
        if not rows:
            return {}
        out = {}
        modes = {"": SamplingParams(n=1, max_new_tokens=ro.max_new_tokens, temperature=0.0)}
        if progress is not None:
            progress(0, len(rows))
        for suffix, sampling in modes.items():
            scores, episodes, metrics = [], [], Counter()
            for start in range(0, len(rows), batch):
                played = self.play(rows[start : start + batch], sampling)
                got, _ = self.rewards(played, reward, Failures(getattr(reward, "name", "reward")))
                m = self.metrics(played)
                scores += got
                episodes += played
                metrics.update({k: v * len(played) for k, v in m.items()})
                if progress is not None:
                    progress(len(episodes), len(rows))
            out[f"eval/reward{suffix}"] = sum(scores) / len(scores)
            if not suffix:
                out["eval/turns"] = metrics["env/turns"] / len(episodes)
                out["eval/tool_calls"] = metrics["env/tool_calls"] / len(episodes)
                if can_verify(dataset):
                    right = sum(bool(dataset.verify(e.final_answer(), e.row)) for e in episodes)
                    out["eval/accuracy"] = right / len(episodes)
        return out
