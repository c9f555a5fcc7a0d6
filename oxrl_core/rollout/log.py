"""`rollouts.jsonl`: a bounded sample of what an RL run generated, for `oxrl report`'s rollout viewer.

Every ``logging.rollout_samples_every`` steps (and at the first and the last step) one JSON line:

    {"step": 10,
     "rewards": [...],                 every sample's reward in the rollout batch (the distribution)
     "samples": [{"prompt": "...", "group": 0, "sample": 1, "reward": 1.0, "advantage": 0.53,
                  "finish_reason": "stop", "length": 7,
                  "ids": [...], "tokens": [...],          the completion's token ids and their text
                  "logp": [...], "logp_rollout": [...], "entropy": [...], "adv": [...], "mask": [...],
                  "logp_ref": [...]}]}                    (with a reference model)

The per-token values are the trainer's logprob of each sampled token, the rollout backend's, the
policy's entropy there, the advantage, the loss mask (0 on an environment's tokens in a multi-turn
episode) — read off the rollout batch the update trained on, at the completion's next-token positions.

An image run (a VLM's image prompts) adds to each sample its prompt's images, ``"images": ["data:image/png;base64,
...", ...]`` (`image_data_uri`: PNG, scaled down to at most `MAX_IMAGE_SIDE` pixels on the longest side), and, when
the step's bound on image data was reached, ``"images_left_out": 2`` (how many of the sample's images were not
recorded). A text run's samples have neither key. In the prompt's text a run of one special token (a VLM's image
placeholder, repeated once per image token) is written once with its count: ``<|image_pad|>×64``.

A multi-turn run whose environment showed images (`rl.episodes`) adds to each sample the images the environment
showed in its episode, in order, ``"env_images": [{"turn": 1, "image": "data:image/png;base64,..."}, ...]`` (``turn``
k: the environment's answer to the model's k-th turn; each image scaled down as a prompt's is), and where the step's
bound was reached ``"env_images_left_out": 1``. A sample's ``images`` and ``env_images`` are then every image of its
logged sequence. A step in which no environment showed an image, and a single-turn run, add neither key.

Bounded: the first `PROMPTS` prompts of the batch, the first `SAMPLES` samples of each, the first
`MAX_TOKENS` tokens of each completion (``length`` keeps the full count), the prompt's text cut to
`MAX_PROMPT_CHARS`, at most `MAX_IMAGE_BYTES` bytes of image data URIs a step, the prompts' and the environment's
together (every prompt's first sample gets its images, its prompt's then its environment's, before any prompt's
second sample does; an image past the bound is left out and counted).
Written as metrics.jsonl is (`tracking.JsonlSink`: appended line by line, cut back to the checkpoint on resume,
a torn line skipped), on rank 0 only.
"""

from __future__ import annotations

import base64
import io
import itertools
import math
from pathlib import Path

from oxrl_core.data.images import ENV_IMAGES
from oxrl_core.engines.distributed import is_main
from oxrl_core.run_io.tracking import JsonlSink

PROMPTS, SAMPLES, MAX_TOKENS, MAX_PROMPT_CHARS = 2, 4, 1024, 2000
#: a logged image's longest side in pixels, at most: a larger image is scaled down (never up) to keep the log small
MAX_IMAGE_SIDE = 256
#: the most bytes of image data URIs (ASCII) one logged step records: room for the largest 256×256 PNG (about
#: 350 kB as base64) and a bound on the report (`oxrl report` embeds up to 20 steps); past it an image is left
#: out and counted (``images_left_out``)
MAX_IMAGE_BYTES = 512 * 1024
#: the image modes PNG stores as they are; any other is converted to RGB (RGBA where it has an alpha band)
PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")


def _num(value: float, digits: int = 4):
    """JSON-safe: a non-finite value is null (JSON has no NaN)."""
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


def image_data_uri(image) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URI, scaled down (aspect kept) so that its longest side is
    at most `MAX_IMAGE_SIDE`: what the report's rollout viewer shows inline, with nothing outside the file.
    ``image`` itself is not changed."""
    mode = image.mode if image.mode in PNG_MODES else ("RGBA" if "A" in image.getbands() else "RGB")
    small = image.convert(mode)  # a copy: thumbnail() works in place
    small.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class RolloutLog:
    """``due(step)`` says whether ``step`` is logged; ``write(...)`` logs it; ``close()`` at the end."""

    def __init__(self, run_dir: Path, every: int, max_steps: int, tokenizer, resume_step: int | None = None):
        self.every, self.max_steps, self.tokenizer = every, max_steps, tokenizer
        self.sink = JsonlSink(run_dir / "rollouts.jsonl", resume_step) if every > 0 and is_main() else None
        # the tokenizer's added tokens (special tokens, a VLM's image placeholder): a run of one is written compactly
        self.special_ids = set(tokenizer.get_added_vocab().values()) if self.sink is not None else set()

    def due(self, step: int) -> bool:
        """Every process agrees (the loop gathers extra values on a logged step)."""
        return self.every > 0 and (step == 1 or step % self.every == 0 or step == self.max_steps)

    def write(self, step: int, prompts, completions, scores, batch: dict, n: int, images=None) -> None:
        """``prompts`` (B lists of ids), ``completions`` (B), ``scores`` (B), ``batch`` the rollout batch
        after the update (``logp_old``, ``logp_rollout``, ``mask``, ``adv``, ``entropy_old``, optional
        ``logp_ref``; (B, T) over next-token positions; ``media`` (B) each sample's media record, which holds the
        images its environment showed, `env_images_of`), ``n`` samples per prompt; ``images`` (B) each sample's
        prompt's images (lists of PIL images) in an image run, None in a text run."""
        if self.sink is None:
            return
        names = {"logp": "logp_old", "logp_rollout": "logp_rollout", "entropy": "entropy_old", "mask": "mask"}
        names.update(adv="adv", logp_ref="logp_ref")  # an advantage and a reference where the algorithm has them
        keys = {name: key for name, key in names.items() if batch.get(key) is not None}
        rows = [g * n + s for g in range(min(PROMPTS, len(completions) // n)) for s in range(min(SAMPLES, n))]
        env_images = env_images_of(batch.get("media") or [])
        no_images = images is None and env_images is None
        image_fields = {} if no_images else _image_fields(rows, images, n, env_images)
        samples = []
        for i in rows:
            c, start = completions[i], len(prompts[i]) - 1  # position start + j predicts completion token j
            ids = list(c.token_ids[:MAX_TOKENS])
            end = start + len(ids)
            values = {}
            for name, key in keys.items():
                tensor = batch[key][i]
                if tensor.dim() == 0:  # a per-sequence quantity (an advantage per row): the same at every token
                    tensor = tensor.expand(batch["mask"].shape[1])
                values[name] = [_num(v) for v in tensor[start:end].float().tolist()]
            adv = None
            if "adv" in values:  # the sample's advantage: the mean over its trained tokens
                trained = [a for a, m in zip(values["adv"], values["mask"]) if m and a is not None]
                adv = _num(sum(trained) / len(trained)) if trained else None
            samples.append(
                {
                    "prompt": self._prompt_text(prompts[i]),
                    "group": i // n,
                    "sample": i % n,
                    "reward": _num(scores[i]),
                    "advantage": adv,
                    "finish_reason": c.finish_reason,
                    "length": len(c.token_ids),
                    "ids": ids,
                    "tokens": [self.tokenizer.decode([t]) for t in ids],
                    **values,
                    **image_fields.get(i, {}),
                }
            )
        self.sink.log(step, {"rewards": [_num(s) for s in scores], "samples": samples})

    def _prompt_text(self, ids: list[int]) -> str:
        """The prompt's text, a run of one special token written once with its count (`_decode_compact`), cut
        to `MAX_PROMPT_CHARS` in the middle."""
        text = self._decode_compact(ids)
        if len(text) > MAX_PROMPT_CHARS:
            half = MAX_PROMPT_CHARS // 2
            text = f"{text[:half]} … [{len(text) - MAX_PROMPT_CHARS} characters left out] … {text[-half:]}"
        return text

    def _decode_compact(self, ids: list[int]) -> str:
        """``ids`` decoded, each run of two or more of the same special token as the token once and its count
        (``<|image_pad|>×64``): a VLM's prompt repeats its image placeholder once per image token, which would
        otherwise fill the prompt's text (and its `MAX_PROMPT_CHARS`)."""
        pieces, plain = [], []
        for token_id, run in itertools.groupby(ids):
            count = len(list(run))
            if count > 1 and token_id in self.special_ids:
                pieces += [self.tokenizer.decode(plain), f"{self.tokenizer.decode([token_id])}×{count}"]
                plain = []
            else:
                plain += [token_id] * count
        return "".join(pieces) + self.tokenizer.decode(plain)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def env_images_of(media: list[dict]) -> list[list[dict]] | None:
    """The images each sample's environment showed (B,), from the rollout batch's media records (`Episode.media`):
    ``[{"turn", "image"}, ...]`` each; None where no sample's environment showed one (a text or single-turn run)."""
    shown = [fields.get(ENV_IMAGES, []) for fields in media]
    return shown if any(shown) else None


def _image_fields(rows: list[int], images: list | None, n: int, env_images: list | None = None) -> dict[int, dict]:
    """The image keys of each logged sample (batch index in ``rows``): ``images``, its prompt's images as data
    URIs (`image_data_uri`), and ``images_left_out``, how many did not fit in the step's `MAX_IMAGE_BYTES`; where
    ``env_images`` is given, ``env_images``, the images its environment showed (already data URIs, with their turn),
    and ``env_images_left_out`` likewise. Every prompt's first sample is filled (its prompt's images, then its
    environment's) before any prompt's second, so that each prompt's images are shown once before any are repeated;
    each prompt's images are encoded once (the samples of a prompt share them)."""
    encoded: dict[int, list[str]] = {}
    left, out = MAX_IMAGE_BYTES, {i: {} for i in rows}

    def fit(i: int, key: str, entries: list, size) -> None:
        nonlocal left
        out[i][key] = []
        for entry in entries:
            if size(entry) <= left:
                out[i][key].append(entry)
                left -= size(entry)
            else:
                out[i][f"{key}_left_out"] = out[i].get(f"{key}_left_out", 0) + 1

    for i in sorted(rows, key=lambda i: (i % n, i // n)):
        if images is not None:
            if i // n not in encoded:
                encoded[i // n] = [image_data_uri(image) for image in images[i] or []]
            fit(i, "images", encoded[i // n], len)
        if env_images is not None:
            fit(i, ENV_IMAGES, env_images[i] or [], lambda shown: len(shown["image"]))
    return out
