"""Images in rollouts.jsonl and in `oxrl report`'s rollout viewer (issue: "the rollout viewer shows each sample's
images inline, data URIs only").

- `RolloutLog.write` with ``images``: each logged sample's prompt images as PNG data URIs, scaled down to at most
  256 px on the longest side (never up), at most `MAX_IMAGE_BYTES` of them a step (the rest counted); a text run's
  samples unchanged; a run of the image placeholder token written once with its count. With ``env_images`` (issue
  47, item 3: the images an environment showed in each episode, `Episode.env_images`): each sample's, in order,
  with their turns, under the same byte bound as the prompts' (prompt images first, the rest counted apart).
- A hostile rollouts.jsonl (``javascript:``, http URLs, quotes and angle brackets, non-strings as images, the same
  as an environment's images): no such value reaches the page, neither through the file reader nor, for values
  that bypass it, through the viewer's script, checked in a real headless Chromium.
- End to end: one short real image run (``oxrl run --alg sgrpo --set data.train=shapes``), `oxrl report`, and the
  viewer in headless Chromium showing each sample's image, decoded (``naturalWidth`` > 0).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import oxrl, read_metrics
from PIL import Image
from test_hardening_report import Elements, dump_dom, good_run

from oxrl_core.interfaces import Completion
from oxrl_core.observability import run_files
from oxrl_core.observability.report import CSP, VIEWER_SCRIPT, load_run, render_report
from oxrl_core.observability.run_files import IMAGE_SRC, RunData
from oxrl_core.rollout import log as rollout_log
from oxrl_core.rollout.log import MAX_IMAGE_SIDE, RolloutLog, image_data_uri

N = 2  # samples per prompt in the hand-made batches


@pytest.fixture(scope="module")
def tokenizer():
    from oxrl_core.models.tiny_vlm import build_vlm_tokenizer

    return build_vlm_tokenizer()


def decoded(uri: str) -> Image.Image:
    """A data URI's image, after checking that it is a base64 PNG data URI."""
    assert uri.startswith("data:image/png;base64,") and IMAGE_SRC.fullmatch(uri), uri[:60]
    return Image.open(io.BytesIO(base64.b64decode(uri.removeprefix("data:image/png;base64,"))))


def noise(width: int, height: int, seed: int) -> Image.Image:
    """An RGB image that PNG cannot compress: its data URI's length is about 4/3 of its raw bytes."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def write_step(tmp_path: Path, tokenizer, prompts_text: list[str], images, env_images=None) -> list[dict]:
    """`RolloutLog.write` for one step of ``len(prompts_text)`` prompts × `N` samples (each completion "ab"), with
    the images each sample's environment showed in its media record where ``env_images`` (B) is given; returns the
    logged samples."""
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts_text]
    prompts = [ids for ids in prompt_ids for _ in range(N)]
    completion = tokenizer("ab", add_special_tokens=False)["input_ids"]
    completions = [Completion(list(completion), [-0.5] * len(completion), "stop", 0) for _ in prompts]
    width = max(map(len, prompts)) + len(completion)
    batch = {key: torch.zeros(len(prompts), width) for key in ("logp_old", "logp_rollout", "entropy_old")}
    batch["mask"] = torch.ones(len(prompts), width)
    batch["media"] = [{"env_images": shown} if shown else {} for shown in env_images or [[]] * len(prompts)]
    tmp_path.mkdir(exist_ok=True)
    log = RolloutLog(tmp_path, every=1, max_steps=1, tokenizer=tokenizer)
    log.write(1, prompts, completions, [1.0] * len(prompts), batch, N, images)
    log.close()
    (line,) = (tmp_path / "rollouts.jsonl").read_text().splitlines()
    return json.loads(line)["samples"]


# ---------------------------------------------------------------------------------------------- rollouts.jsonl


def test_each_logged_sample_records_its_prompts_images_as_png_data_uris_scaled_down_never_up(tmp_path, tokenizer):
    wide, small = Image.new("RGB", (600, 300), (200, 30, 30)), Image.new("RGB", (40, 20), (10, 200, 10))
    cmyk = Image.new("CMYK", (300, 900), (0, 255, 0, 0))  # a mode PNG has not: converted
    images = [[wide, small]] * N + [[cmyk]] * N
    samples = write_step(tmp_path, tokenizer, ["first?", "second?"], images)
    assert [(s["group"], s["sample"]) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for s in samples:
        assert "images_left_out" not in s
        pictures = [decoded(uri) for uri in s["images"]]
        if s["group"] == 0:
            assert [p.size for p in pictures] == [(MAX_IMAGE_SIDE, 128), (40, 20)]  # aspect kept; 40×20 not upscaled
            assert pictures[0].convert("RGB").getpixel((5, 5)) == (200, 30, 30)
            assert pictures[1].convert("RGB").getpixel((5, 5)) == (10, 200, 10)
        else:
            assert [p.size for p in pictures] == [(85, MAX_IMAGE_SIDE)]
            assert pictures[0].mode == "RGB"
    assert wide.size == (600, 300) and cmyk.mode == "CMYK"  # the caller's images are not changed


def test_past_the_steps_byte_bound_images_are_left_out_and_counted_first_samples_first(
    tmp_path, tokenizer, monkeypatch
):
    first, second = noise(200, 150, seed=1), noise(180, 160, seed=2)
    sizes = [len(image_data_uri(first)), len(image_data_uri(second))]
    assert min(sizes) > 100_000  # noise: the bound below is what stops the third image, not compression
    monkeypatch.setattr(rollout_log, "MAX_IMAGE_BYTES", sum(sizes) + min(sizes) // 2)
    samples = write_step(tmp_path, tokenizer, ["first?", "second?"], [[first]] * N + [[second]] * N)
    # each prompt's first sample gets its image; the second samples, past the bound, say how many are missing
    got = {(s["group"], s["sample"]): (len(s["images"]), s.get("images_left_out")) for s in samples}
    assert got == {(0, 0): (1, None), (1, 0): (1, None), (0, 1): (0, 1), (1, 1): (0, 1)}
    logged = sum(len(uri) for s in samples for uri in s["images"])
    assert logged == sum(sizes) <= rollout_log.MAX_IMAGE_BYTES
    assert samples[0]["images"][0] == image_data_uri(first)
    # the real bound holds the largest image a sample can have (256×256 of noise, with an alpha band)
    assert len(image_data_uri(noise(900, 900, seed=3).convert("RGBA"))) < rollout_log.MAX_IMAGE_BYTES


def shown(turn: int, image: Image.Image) -> dict:
    """An environment's image as an episode keeps it (`Episode.env_images`)."""
    return {"turn": turn, "image": image_data_uri(image)}


def test_an_episodes_environment_images_are_logged_in_order_with_their_turns(tmp_path, tokenizer):
    """Each sample gets its own episode's environment images (the samples of a prompt differ), in order, each the
    data URI the episode kept with its turn, beside its prompt's images; a sample whose environment showed none has
    an empty list; and a step in which no environment showed one logs no such key."""
    row = Image.new("RGB", (32, 32), (200, 30, 30))
    first, second = Image.new("RGB", (32, 32), (1, 2, 3)), Image.new("RGB", (300, 600), (9, 9, 9))
    env = [[shown(1, first), shown(2, second)], [], [shown(1, second)], []]
    samples = write_step(tmp_path, tokenizer, ["first?", "second?"], [[row]] * 2 * N, env)
    assert [[e["turn"] for e in s["env_images"]] for s in samples] == [[1, 2], [], [1], []]
    assert samples[0]["env_images"] == env[0] and samples[2]["env_images"] == env[2]
    assert [decoded(e["image"]).size for e in samples[0]["env_images"]] == [(32, 32), (128, MAX_IMAGE_SIDE)]
    assert all(len(s["images"]) == 1 and not [k for k in s if k.endswith("_left_out")] for s in samples)
    # a multi-turn run without prompt images: only the environment's; none shown this step: neither key
    text_prompts = write_step(tmp_path / "text", tokenizer, ["first?", "second?"], None, env)
    assert [len(s["env_images"]) for s in text_prompts] == [2, 0, 1, 0] and "images" not in text_prompts[0]
    quiet = write_step(tmp_path / "quiet", tokenizer, ["first?", "second?"], [[row]] * 2 * N, None)
    assert all("env_images" not in s and "env_images_left_out" not in s for s in quiet)


def test_an_environments_images_share_the_steps_byte_bound_prompt_images_first(tmp_path, tokenizer, monkeypatch):
    """One bound for the step's image data: the prompt's images of a sample before its environment's, every
    prompt's first sample before any second; what does not fit is counted under ``env_images_left_out``."""
    prompt, env_a, env_b = noise(200, 150, seed=1), noise(180, 160, seed=2), noise(150, 150, seed=3)
    sizes = [len(image_data_uri(image)) for image in (prompt, env_a, env_b)]
    monkeypatch.setattr(rollout_log, "MAX_IMAGE_BYTES", sizes[0] + sizes[1] + sizes[2] // 2)
    env = [[shown(1, env_a), shown(1, env_b)], [shown(1, env_b)]]
    (first, second) = write_step(tmp_path, tokenizer, ["first?"], [[prompt]] * N, env)
    assert (len(first["images"]), len(first["env_images"]), first.get("env_images_left_out")) == (1, 1, 1)
    assert first["env_images"][0]["image"] == image_data_uri(env_a)
    assert (second["images"], second.get("images_left_out")) == ([], 1)
    assert (second["env_images"], second.get("env_images_left_out")) == ([], 1)


def test_a_text_run_logs_no_image_keys(tmp_path, tokenizer):
    samples = write_step(tmp_path, tokenizer, ["What is 2+2?"], None)
    assert samples and all(not [k for k in s if "images" in k] for s in samples)
    assert samples[0]["prompt"] == "What is 2+2?" and samples[0]["tokens"] == ["a", "b"]


def test_a_run_of_the_image_placeholder_is_one_placeholder_with_its_count(tmp_path, tokenizer):
    text = "<|vision_start|>" + "<|image_pad|>" * 64 + "<|vision_end|>Which? aaa <|image_pad|> end"
    samples = write_step(tmp_path, tokenizer, [text], [[Image.new("RGB", (8, 8))]] * N)
    # a repeated special token collapses; a single one and repeated characters stay as they are
    assert samples[0]["prompt"] == "<|vision_start|><|image_pad|>×64<|vision_end|>Which? aaa <|image_pad|> end"


# ---------------------------------------------------------------------------------------------- a hostile file

GOOD = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()
BAD = [
    "javascript:document.title='PWNED'",
    "https://example.com/x.png",
    "//example.com/x.png",
    'data:image/png;base64,AAAA" onerror="document.title=1',
    "data:image/png;base64,AAAA><b id=pwned-b>",
    "data:image/svg+xml;base64,PHN2ZyBvbmxvYWQ9YWxlcnQoMSk+",
    "data:image/png;base64,AAAA\n",
    " data:image/png;base64,AAAA",
    "DATA:image/png;base64,AAAA",
    5,
    None,
    {"src": GOOD},
    [GOOD],
]


#: an environment's images of the wrong shape, beside the bad image values of `BAD`: a bare string (a prompt image's
#: form), a turn that is markup (shown without it), an extra attribute (dropped), no ``image``, a list, non-objects
BAD_SHOWN = [
    GOOD,
    {"turn": "<b id=pwned-turn>", "image": GOOD},
    {"turn": 1, "image": GOOD, "onerror": "document.title='PWNED'"},
    {"turn": 1, "src": GOOD},
    [GOOD],
    None,
    5,
    True,
]


def hostile_samples() -> list[dict]:
    """Samples whose images (the prompt's and the environment's) hold every bad kind of value beside good ones, and
    other wrong shapes."""
    tokens = ["4", "<|end|>"]
    base = {
        "prompt": "What is 2+2?", "group": 0, "reward": 1.0, "advantage": 0.5, "finish_reason": "stop", "length": 2,
        "ids": [1, 2], "tokens": tokens, "logp": [-0.5] * 2, "logp_rollout": [-0.5] * 2, "mask": [1.0] * 2,
    }  # fmt: skip
    bad_shown = [{"turn": 2, "image": bad} for bad in BAD] + BAD_SHOWN
    return [
        {**base, "sample": 0, "images": [GOOD, *BAD], "env_images": [{"turn": 1, "image": GOOD}, *bad_shown]},
        {**base, "sample": 1, "images": "javascript:document.title='PWNED'", "images_left_out": "<b id=pwned-count>",
         "env_images": "javascript:document.title='PWNED'", "env_images_left_out": "<b id=pwned-env-count>"},
        {**base, "sample": 2, "images": [BAD[1], GOOD], "images_left_out": 2,
         "env_images": [{"turn": 3, "image": BAD[1]}, {"turn": 3, "image": GOOD}], "env_images_left_out": 1},
    ]  # fmt: skip


def test_a_hostile_rollouts_jsonl_puts_no_bad_image_source_in_the_page(tmp_path, monkeypatch):
    """Read through `load_run` (the file reader drops the bad values, with a note), and as raw data that bypasses
    it (the viewer's script drops them): in both, the page's only images are the good data URIs, an environment's
    each labelled with its turn where that is a count."""
    monkeypatch.setattr(run_files, "MAX_NOTES", 100)  # every note in the page, to check each
    run = good_run(tmp_path)
    (run / "rollouts.jsonl").write_text(json.dumps({"step": 1, "rewards": [1.0], "samples": hostile_samples()}) + "\n")
    loaded = load_run(run)
    cleaned = loaded.rollouts[0]["samples"]
    assert [s["images"] for s in cleaned] == [[GOOD], [], [GOOD]]
    assert [s.get("images_left_out") for s in cleaned] == [None, None, 2]
    # an environment's: the good image objects, as just their turn (null where it is not a count) and image
    kept = [{"turn": 1, "image": GOOD}, {"turn": None, "image": GOOD}, {"turn": 1, "image": GOOD}]
    assert [s["env_images"] for s in cleaned] == [kept, [], [{"turn": 3, "image": GOOD}]]
    assert [s.get("env_images_left_out") for s in cleaned] == [None, None, 1]
    notes = " ".join(loaded.notes)
    assert f"sample 1: {len(BAD)} of the images are not a data: URI" in notes and "images is " in notes
    assert "images_left_out is " in notes
    assert f"sample 1: {len(BAD) + len(BAD_SHOWN) - 2} of the env_images are not" in notes
    assert "env_images is " in notes and "env_images_left_out is " in notes and "turn is not a count" in notes
    raw = RunData(tmp_path / "raw", "raw", {}, loaded.records, None, [{"step": 1, "samples": hostile_samples()}])
    html = tmp_path / "report.html"
    html.write_text(render_report([loaded, raw]))
    text = html.read_text()
    page = Elements(text)
    # the file reader dropped them: run 0's viewer data holds none (a note quotes them, escaped)
    loaded_data = next(body for attrs, body in page.scripts if attrs.get("id") == "rollouts-0")
    assert [s["images"] for s in json.loads(loaded_data)[0]["samples"]] == [[GOOD], [], [GOOD]]
    assert [len(s["env_images"]) for s in json.loads(loaded_data)[0]["samples"]] == [3, 0, 1]
    for bad in ("javascript:", "example.com", "onerror", "svg+xml", "pwned"):
        assert bad not in loaded_data, bad
    assert not [a for tag, a in page.elements if tag == "img" or "src" in a]  # only the viewer's script makes them
    dom, console = dump_dom(html, tmp_path)
    assert console == [], console
    elements = Elements(dom).elements
    sources = [a.get("src") for tag, a in elements if tag == "img"]
    # in each of the two viewers: two samples' one good prompt image, and the environment's good ones (3 + 1)
    assert sources == [GOOD] * 12, sources
    alts = [a.get("alt") for tag, a in elements if tag == "img" and "environment" in a.get("alt", "")]
    turns = ["shown by the environment, turn 1", "shown by the environment", "shown by the environment, turn 1"]
    assert alts == (turns + ["shown by the environment, turn 3"]) * 2, alts
    assert dom.count("<figcaption>shown by the environment, turn 3</figcaption>") == 2
    assert not [a for tag, a in elements if any(str(v).startswith("pwned") for v in a.values())]
    assert not [a for tag, a in elements if tag == "body" and "data-pwned" in a]
    assert Elements(dom).title.startswith("oxRL report: ") and "PWNED" not in Elements(dom).title
    assert "2 more image(s) not logged" in dom and "1 more image(s) shown by the environment not logged" in dom
    # the script's check is the file reader's
    assert f"/^{IMAGE_SRC.pattern.replace('/', chr(92) + '/')}$/" in VIEWER_SCRIPT


# ---------------------------------------------------------------------------------------------- end to end

#: run after the viewer's script, on the load event (every image decoded): each sample's images'
#: (complete, naturalWidth, naturalHeight), written into the page for --dump-dom
PROBE = """
window.addEventListener("load", function () {
  var boxes = document.querySelectorAll(".viewer .sample"), out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(Array.prototype.map.call(boxes, function (box) {
    return Array.prototype.map.call(box.querySelectorAll("img"), function (img) {
      return [img.complete, img.naturalWidth, img.naturalHeight, img.getAttribute("src")];
    });
  }));
  document.body.appendChild(out);
});
"""


def with_probe(report: str) -> str:
    """The report with `PROBE` added, its hash allowed by the page's Content-Security-Policy beside the viewer's."""
    probe_hash = "'sha256-" + base64.b64encode(hashlib.sha256(PROBE.encode()).digest()).decode() + "'"
    csp = CSP.replace("script-src ", f"script-src {probe_hash} ")
    escaped = [value.replace("'", "&#x27;") for value in (CSP, csp)]
    assert escaped[0] in report
    return report.replace(escaped[0], escaped[1]).replace("</body>", f"<script>{PROBE}</script></body>")


@pytest.fixture(scope="module")
def image_run(tmp_path_factory) -> Path:
    """One short real RL run on the built-in shapes dataset (the tiny Qwen2-VL), and its `oxrl report`."""
    root = tmp_path_factory.mktemp("image-run")
    run = root / "run"
    sets = ["data.train=shapes", "train.max_steps=1", "train.batch_size=4", "rollout.n=2"]
    proc = oxrl("run", "--alg", "sgrpo", *[a for s in sets for a in ("--set", s)], "-q", "-o", str(run), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = oxrl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.mark.slow
def test_an_image_run_logs_each_samples_image(image_run):
    assert [m["step"] for m in read_metrics(image_run)] == [1]
    (line,) = (image_run / "rollouts.jsonl").read_text().splitlines()
    samples = json.loads(line)["samples"]
    assert len(samples) == 2 * 2  # batch_size 4 > PROMPTS (2), n 2 < SAMPLES (4)
    for s in samples:
        assert [decoded(uri).size for uri in s["images"]] == [(32, 32)] and "images_left_out" not in s
        assert "env_images" not in s  # a single-turn run: no environment
        # the tiny Qwen2-VL's 32×32 picture is 4 image tokens, written once with their count
        assert "<|vision_start|><|image_pad|>×4<|vision_end|>" in s["prompt"], s["prompt"]


@pytest.mark.slow
def test_the_report_viewer_shows_each_samples_image_in_a_real_browser(image_run, tmp_path):
    report = (image_run / "report.html").read_text()
    (line,) = (image_run / "rollouts.jsonl").read_text().splitlines()
    samples = json.loads(line)["samples"]
    probed = tmp_path / "probed.html"
    probed.write_text(with_probe(report))
    dom, console = dump_dom(probed, tmp_path)
    assert console == [], console
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    shown = json.loads(found[1].replace("&quot;", '"').replace("&amp;", "&"))
    assert len(shown) == len(samples)
    for images, s in zip(shown, samples):
        assert [(complete, width, height) for complete, width, height, _ in images] == [(True, 32, 32)], images
        assert [src for *_, src in images] == s["images"]
