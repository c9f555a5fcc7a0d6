"""The built-in visual task, ``shapes``: questions about small generated pictures, for the built-in tiny VLM.

Every row is one 32×32 RGB picture (PNG bytes, in ``images`` as ``[{"bytes": ...}]``) of coloured shapes on a dark
grey background, and one question about it, asked in a prompt with one ``<image>`` marker. Three kinds of
question, each with a small vocabulary of one-word answers:

=========  ======================================  ==================================  ==========================
kind       prompt                                  picture                             answers
=========  ======================================  ==================================  ==========================
colour     ``<image>What colour is the shape?``    one square, circle or triangle,     red, green, blue, yellow,
                                                   10-18 pixels, anywhere              white
count      ``<image>How many squares?``            1-3 squares of 6-9 pixels, apart,   1, 2, 3
                                                   each of any colour
position   ``<image>Is the square left or          one square of 8-12 pixels wholly    left, right / top, bottom
           right?`` or ``<image>Is the square at   inside one half of the picture
           the top or bottom?``
=========  ======================================  ==================================  ==========================

The colour question is the easy one (the colour of the few pixels that are not background): the built-in tiny VLM
(`oxrl_core.models.tiny_vlm`) answers 31 of 40 held-out ones right after 150 SFT steps (chance: 8). Counting and
position need the layout of the picture, which leaves reinforcement learning something to learn. The ``task``
option picks one kind (``{source: shapes, task: colour}``); the default, ``all``, asks colour, count, colour,
position in turn (half of the rows are colour questions).

Rows look like the text task's (`oxrl_core.data.task`), so every loop finds its format: ``prompt``, ``images``,
``response`` = ``answer`` = ``chosen`` (the right answer), ``rejected`` (a wrong answer from the same question's
vocabulary), ``completion`` and ``label`` (unpaired KTO rows: the right or the wrong answer), and ``kind`` (the
question's kind). A completion is correct when its first word, lower-cased and stripped of punctuation, is the
answer (`is_correct`): ``"Red."`` answers red, ``"It is red"`` does not.

The pictures are generated from fixed seeds (one per split, kind and index), so the splits are the same
everywhere: eval has `EVAL_SIZE` rows, train `TRAIN_SIZE` (the ``train_size`` option), and no train row repeats an
eval row's picture and question (a train picture that happens to equal one of the first `EVAL_SIZE` eval pictures of
its kind is skipped). A split is drawn and PNG-encoded on first use and kept (about 0.2 ms a picture: 0.9 s for the
default train split, then free); PIL is imported only then, never when the plugin is discovered.
"""

from __future__ import annotations

import functools
import io
import random
import string
from typing import Literal

from pydantic import Field

from oxrl_core.data.images import decode_image
from oxrl_core.interfaces import Dataset, StrictModel, ToolEnvironment

#: the side of every picture, in pixels
IMAGE_SIZE = 32
EVAL_SIZE = 100
TRAIN_SIZE = 4000
#: the shapes' colours: name -> RGB (each channel jittered by up to `JITTER` per picture)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 235),
    "yellow": (235, 215, 40),
    "white": (240, 240, 240),
}
JITTER = 15
#: the background is a grey of this level or darker
MAX_BACKGROUND = 60
COUNTS = ("1", "2", "3")
KINDS = ("colour", "count", "position")
#: the kinds of the ``all`` task, row after row
CYCLE = ("colour", "count", "colour", "position")

COLOUR_PROMPT = "<image>What colour is the shape?"
COUNT_PROMPT = "<image>How many squares?"
#: the position questions: axis -> (prompt, the two answers)
POSITION_PROMPTS = {
    "horizontal": ("<image>Is the square left or right?", ("left", "right")),
    "vertical": ("<image>Is the square at the top or bottom?", ("top", "bottom")),
}


# ----------------------------------------------------------------------------- pictures


def _jittered(rng: random.Random, name: str) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[name])


def _canvas(rng: random.Random):
    from PIL import Image, ImageDraw  # lazy: PIL only when pictures are drawn, never at plugin discovery

    level = rng.randint(0, MAX_BACKGROUND)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (level, level, level))
    return image, ImageDraw.Draw(image)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _colour_scene(rng: random.Random) -> tuple[bytes, str, str, tuple[str, ...]]:
    """One shape of one colour: (PNG, prompt, answer, the question's vocabulary)."""
    image, draw = _canvas(rng)
    name, shape = rng.choice(list(COLOURS)), rng.choice(("square", "circle", "triangle"))
    side = rng.randint(10, 18)
    x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
    box, fill = (x, y, x + side - 1, y + side - 1), _jittered(rng, name)
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([(x + (side - 1) / 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=fill)
    return _png(image), COLOUR_PROMPT, name, tuple(COLOURS)


def _count_scene(rng: random.Random) -> tuple[bytes, str, str, tuple[str, ...]]:
    """1-3 squares that neither touch nor overlap (at least 2 pixels apart)."""
    image, draw = _canvas(rng)
    n, boxes = rng.randint(1, 3), []
    while len(boxes) < n:
        side = rng.randint(6, 9)
        x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
        box = (x, y, x + side, y + side)  # exclusive corner
        if all(x >= b[2] + 2 or b[0] >= box[2] + 2 or y >= b[3] + 2 or b[1] >= box[3] + 2 for b in boxes):
            boxes.append(box)
    for x0, y0, x1, y1 in boxes:
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=_jittered(rng, rng.choice(list(COLOURS))))
    return _png(image), COUNT_PROMPT, str(n), COUNTS


def _position_scene(rng: random.Random) -> tuple[bytes, str, str, tuple[str, ...]]:
    """One square wholly inside the left or right (top or bottom) half."""
    image, draw = _canvas(rng)
    axis = rng.choice(("horizontal", "vertical"))
    prompt, answers = POSITION_PROMPTS[axis]
    answer = rng.choice(answers)
    side, half = rng.randint(8, 12), IMAGE_SIZE // 2
    along = rng.randint(0, half - side) + (half if answer == answers[1] else 0)
    across = rng.randint(0, IMAGE_SIZE - side)
    x, y = (along, across) if axis == "horizontal" else (across, along)
    draw.rectangle((x, y, x + side - 1, y + side - 1), fill=_jittered(rng, rng.choice(list(COLOURS))))
    return _png(image), prompt, answer, answers


SCENES = {"colour": _colour_scene, "count": _count_scene, "position": _position_scene}


def _scene(split: str, kind: str, index: int) -> tuple[bytes, str, str, tuple[str, ...]]:
    return SCENES[kind](random.Random(f"shapes:{split}:{kind}:{index}"))


@functools.lru_cache(maxsize=None)
def _scenes(split: str, kind: str, size: int) -> tuple[tuple[bytes, str, str, tuple[str, ...]], ...]:
    """The first ``size`` scenes of one kind in one split; train skips any scene of the kind's first `EVAL_SIZE` eval
    scenes (same picture, same question). Kept: a split is drawn once per process."""
    if split == "eval":
        return tuple(_scene("eval", kind, i) for i in range(size))
    held_out = {(png, prompt) for png, prompt, _, _ in _scenes("eval", kind, EVAL_SIZE)}
    out, index = [], 0
    while len(out) < size:
        scene = _scene("train", kind, index)
        index += 1
        if scene[:2] not in held_out:
            out.append(scene)
    return tuple(out)


def _row(scene: tuple[bytes, str, str, tuple[str, ...]], kind: str, split: str, index: int) -> dict:
    png, prompt, answer, vocabulary = scene
    rng = random.Random(f"shapes:{split}:{kind}:{index}:pair")  # the wrong answer and the KTO label, fixed per row
    wrong = rng.choice([a for a in vocabulary if a != answer])
    label = rng.random() < 0.5
    return {
        "prompt": prompt,
        "images": [{"bytes": png}],
        "response": answer,
        "answer": answer,
        "chosen": answer,
        "rejected": wrong,
        "completion": answer if label else wrong,
        "label": label,
        "kind": kind,
    }


def rows(split: str, task: str = "all", train_size: int = TRAIN_SIZE) -> list[dict]:
    """``train`` or ``eval`` rows of the shapes task (deterministic); ``task`` = ``all`` or one kind (`KINDS`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r} (expected 'train' or 'eval')")
    if task != "all" and task not in KINDS:
        raise ValueError(f"unknown shapes task {task!r} (expected 'all' or one of {', '.join(KINDS)})")
    size = EVAL_SIZE if split == "eval" else train_size
    kinds = [task] * size if task != "all" else [CYCLE[i % len(CYCLE)] for i in range(size)]
    per_kind = {k: kinds.count(k) for k in set(kinds)}
    scenes = {k: _scenes(split, k, n) for k, n in per_kind.items()}
    taken = dict.fromkeys(per_kind, 0)
    out = []
    for kind in kinds:
        j = taken[kind]
        taken[kind] += 1
        out.append(_row(scenes[kind][j], kind, split, j))
    return out


def first_word(completion: str) -> str:
    """The completion's first word, lower-cased, punctuation stripped from both ends (``" Red."`` -> ``red``)."""
    words = completion.split()
    return words[0].strip(string.punctuation).lower() if words else ""


def is_correct(completion: str, answer: str) -> bool:
    """The completion is correct when its first word (`first_word`) is the answer."""
    return first_word(completion) == answer.lower()


class ShapesDataset(Dataset):
    """`shapes`: questions about generated 32×32 pictures of coloured shapes (colour, count, position), one image
    per row; single-word answers checked by the first word of the completion (``oxrl_core.data.shapes``)."""

    name = "shapes"
    formats = ("prompt", "prompt_response", "preference", "unpaired")

    class Config(StrictModel):
        task: Literal["all", "colour", "count", "position"] = Field(
            "all", description="the question kind: colour, count, position, or all of them in turn"
        )
        train_size: int = Field(TRAIN_SIZE, ge=1, le=100_000, description="rows of the train split")

    #: the built-in VLM's preference runs: plain DPO lowers greedy accuracy here (its rejected answers are one word
    #: of the same small vocabulary, and both log-likelihoods fall: 0.51 -> 0.22 at lr 3e-4), so DPO adds its NLL
    #: term on the chosen answers (RPO, TRL's ``rpo_alpha``; 0.51 -> 0.67 held-out)
    #: and its RL runs: more prompts a step with fewer samples each, sampled at 0.7 (at the defaults, 16 prompts × 8 at
    #: temperature 1, SGRPO moved held-out accuracy 0.51 -> 0.56 in 150 steps; this way 0.51 -> 0.69 in 100)
    tiny_defaults = {
        "preference": {"train": {"lr": 3e-4}, "alg": {"nll_alpha": 1.0}},
        "rl": {"train": {"max_steps": 100, "batch_size": 32}, "rollout": {"n": 4, "temperature": 0.7}},
    }

    def rows(self, split: str) -> list[dict]:
        return rows(split, self.config.task, self.config.train_size)

    def verify(self, completion: str, row: dict) -> bool | None:
        return is_correct(completion, row["answer"])


# ----------------------------------------------------------------------------- the "second look" environment

#: the parts of the picture `SecondLookEnv.look` can show: the whole of it, or one half enlarged to the full size
REGIONS = ("all", "left", "right", "top", "bottom")


class SecondLookEnv(ToolEnvironment):
    """``second_look``: the built-in example of an environment that shows the model an image (multi-turn RL on a
    vision-language model, ``oxrl run --alg sgrpo --set env.name=second_look``; the ``shapes`` task by default).

    The model may call ``look(region)`` for the row's picture again, whole or one half of it enlarged to the full
    32×32 (a tool message whose content is an image part and a line of text). Its first turn without a tool call
    is not yet final when ``offer`` is on: the environment answers as a user with the picture again and "Take a
    second look. Your answer?", and the next turn without a tool call is the final answer, scored by the dataset's
    check (``reward.name``). So every episode that is not cut shows at least one image (``env/images_shown``), even
    from a model that never learnt to call tools."""

    name = "second_look"
    #: the built-in VLM on the shapes task (its warm start answers in one word and EOS)
    tiny_defaults = {
        "data": {"train": [{"source": "shapes"}]},  # a list: replaced, never merged
        "rollout": {"max_new_tokens": 16},
        "env": {"max_turns": 3, "max_tokens": 256},
    }

    class Config(StrictModel):
        """`SecondLookEnv`'s options (``env:`` keys)."""

        offer: bool = Field(True, description="show the picture again after the first answer, before the final one")

    def __init__(self, config=None):
        super().__init__(config)
        self.picture = None  # the row's first image, as the row gives it
        self.offered = False

    def reset(self, row: dict) -> str | None:
        images = row.get("images") or []
        self.picture = images[0] if images else None
        return None

    def look(self, region: str = "all") -> list[dict]:
        """Look at the picture again, whole or one half of it enlarged.

        Args:
            region: all, left, right, top or bottom
        """
        if self.picture is None:
            return [{"type": "text", "text": "error: this question has no picture"}]
        if region not in REGIONS:
            self.stats["bad_tool_calls"] += 1
            return [{"type": "text", "text": f"error: region must be one of {', '.join(REGIONS)}, got {region!r}"}]
        return [
            {"type": "image", "image": self._region_png(region)},
            {"type": "text", "text": f"the picture ({region})"},
        ]

    def step(self, messages: list[dict]) -> tuple[list[dict], float, bool]:
        added, reward, done = super().step(messages)
        if done and self.config.offer and not self.offered and self.picture is not None:
            self.offered = True  # a final answer, once: a second look before it counts
            again = [{"type": "image", "image": self._region_png("all")},
                     {"type": "text", "text": "Take a second look. Your answer?"}]  # fmt: skip
            return [{"role": "user", "content": again}], reward, False
        return added, reward, done

    def _region_png(self, region: str) -> bytes:
        """The picture, or one half of it scaled back to `IMAGE_SIZE`, as PNG bytes."""
        from PIL import Image  # lazy: PIL in the episode's worker only

        picture = decode_image(self.picture, None, "second_look", "images[0]")
        half = IMAGE_SIZE // 2
        box = {"all": None, "left": (0, 0, half, IMAGE_SIZE), "right": (half, 0, IMAGE_SIZE, IMAGE_SIZE),
               "top": (0, 0, IMAGE_SIZE, half), "bottom": (0, half, IMAGE_SIZE, IMAGE_SIZE)}[region]  # fmt: skip
        if box is not None:
            picture = picture.crop(box).resize((IMAGE_SIZE, IMAGE_SIZE), Image.NEAREST)
        return _png(picture)
