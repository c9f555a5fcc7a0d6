"""`oxrl report RUN_DIR [RUN_DIR ...] -o report.html`: one self-contained HTML file about one or more runs.

Read from each run directory: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line a step;
a torn line skipped), ``summary.json`` (held-out before / after, versions; absent when the run stopped
early) and, for RL runs, ``rollouts.jsonl`` (a sample of rollouts, `rollout_log`). Written:

- the config and environment of each run, and the warnings `health.check_run` finds in its metrics;
- the curves of its algorithm family, drawn here as inline SVG (no plotting library, no script, no
  network): loss, reward mean ± std and its distribution over time, reward against wall-clock time, the samples'
  staleness (asynchronous rollouts), KL, entropy, response length and
  share clipped, trainer–rollout logprob gap, grad norm, lr, tokens/s, MFU, every held-out metric at
  every evaluation; then every other logged metric. Two or more runs overlay their curves;
- for RL runs, the rollout viewer: the logged steps' prompts (with their images, in an image run) and completions
  (with the images an environment showed in a multi-turn episode, under it, each with its turn)
  with their rewards and advantages, each completion's tokens coloured by a per-token quantity picked in a select
  box (a small inline script reads the samples from an inline JSON block).

Nothing in the file points outside it: it opens from disk, offline.

Every file of a run directory is treated as hostile (a tampered or damaged run directory, a name chosen by
anyone): every value read from it reaches the page escaped (`esc`; in the viewer's JSON block `<`, `>`, `&`
are escaped, `_json_for_script`; the viewer's script puts data into the page as text only, and an image only as
an ``<img>`` whose ``src`` is a base64 ``data:image/...`` URI — `run_files.IMAGE_SRC` drops any other value when
the file is read, and the script checks each again), and the page's Content-Security-Policy (`CSP`) runs no script
but the viewer's own, identified by its hash, and loads images from data: URIs only. A file of the
wrong shape (a step that is not a number, a config that is a list, a summary that is not an object) is a
note in the report ("Damaged files"), never a crash; an error.log that the run outlived (it finished
later, e.g. after ``--resume``) is shown as an earlier failure, as `oxrl bug-report` decides.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from oxrl_core.atomic import write_text_atomic
from oxrl_core.errors import OxrlError
from oxrl_core.observability.charts import Line, esc, heatmap, line_chart
from oxrl_core.observability.health import HEADLINE, Finding, check_run, is_finite, pipeline_text, series
from oxrl_core.observability.health import versions as current_versions
from oxrl_core.observability.run_files import RunData, load_run
from oxrl_core.redact import redact, secret_values

__all__ = ["RunData", "load_run", "render_report", "write_report"]

#: the most rollout steps the viewer embeds (evenly spaced, first and last kept): the report's size is bounded
MAX_VIEWER_STEPS = 20

#: colours of the series (one per run when several runs overlay, else one per metric)
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")


# ---------------------------------------------------------------------------------------------- which curves


@dataclass(frozen=True)
class Plot:
    id: str
    title: str
    keys: tuple[str, ...]  # metric keys; a key ending in "/" means every key with that prefix
    note: str = ""
    ylog: bool = False
    band: str = ""  # the key of a ± band around the first key (reward/std around reward/mean)
    x: str = ""  # the key of the x axis (perf/elapsed_s: wall-clock time); "" = the step


PLOTS = (
    Plot("loss", "Loss", ("loss", "loss/"), "the training loss and its parts"),
    Plot("reward", "Reward (mean ± std over the rollout batch)", ("reward/mean",), band="reward/std"),
    Plot("reward_time", "Reward against wall-clock time (mean ± std)", ("reward/mean",),
         "x = perf/elapsed_s, time since training began (a resumed run's clock goes on from its last step)",
         band="reward/std", x="perf/elapsed_s"),
    Plot("staleness", "Staleness of the trained samples (policy updates)", ("policy/staleness_mean", "policy/staleness_max"),
         "asynchronous rollouts (rollout.max_staleness): updates between generating a sample and training on it"),
    Plot("heldout", "Held-out metrics", ("eval/",), "every evaluation (train.eval_every) and the last step"),
    Plot("rewards_pref", "Implicit rewards (preference)", ("rewards/chosen", "rewards/rejected", "rewards/margins")),
    Plot("pair_acc", "Pair accuracy (chosen scored above rejected)", ("rewards/accuracies",)),
    Plot("logps", "Log-probabilities of chosen / rejected", ("logps/",)),
    Plot("kl", "KL to the reference", ("kl/",)),
    Plot("entropy", "Entropy (nats / token)", ("entropy",)),
    Plot("length", "Response length (tokens)", ("response/length",)),
    Plot("clipped", "Share of completions cut at max_new_tokens", ("response/clipped",)),
    Plot("logprob_diff", "Trainer–rollout logprob gap", ("rollout/logprob_diff", "rollout/logprob_diff_max"), ylog=True),
    Plot("reward_failures", "Reward errors / timeouts (rows)", ("reward/errors", "reward/timeouts", "env/errors", "env/timeouts")),
    Plot("grad_norm", "Gradient norm (before clipping)", ("grad_norm",)),
    Plot("lr", "Learning rate", ("lr",)),
    Plot("tokens_per_s", "Throughput (tokens / s)", ("perf/tokens_per_s",)),
    Plot("mfu", "MFU (model FLOPs utilisation)", ("perf/mfu",)),
)  # fmt: skip


def _keys_of(plot: Plot, runs: list[RunData]) -> list[str]:
    present: list[str] = []
    for run in runs:
        for r in run.records:
            for key in r:
                if key in present or key == "step" or isinstance(r[key], (bool, list, dict)):
                    continue
                if any(key == k or (k.endswith("/") and key.startswith(k)) for k in plot.keys):
                    present.append(key)
    order = {k: i for i, k in enumerate(plot.keys)}
    return sorted(present, key=lambda k: (order.get(k, len(order)), k))


#: the most points a curve draws: a longer run keeps each bucket's lowest and highest value (spikes stay visible)
MAX_POINTS = 1200


def thin(points: list[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most about ``limit`` points of a curve: per bucket of steps its min and max, in step order, and
    every non-finite point."""
    if len(points) <= limit:
        return points
    size = -(-2 * len(points) // limit)
    out = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        finite = [p for p in bucket if math.isfinite(p[1])]
        keep = {min(finite, key=lambda p: p[1]), max(finite, key=lambda p: p[1])} if finite else set()
        out += sorted(keep | {p for p in bucket if not math.isfinite(p[1])})
    return out


def elapsed(run: RunData) -> dict[int, float]:
    """Each step's wall-clock seconds since training began (``perf/elapsed_s``; steps without a finite one left
    out), never going back: a resumed run's clock restarts at 0, so its steps go on from the last step logged
    before (the time between that step and the restart is not counted)."""
    out: dict[int, float] = {}
    offset = last = 0.0
    for step, seconds in series(run.records, "perf/elapsed_s"):
        if not math.isfinite(seconds):
            continue
        if seconds + offset < last:
            offset = last
        out[step] = last = seconds + offset
    return out


def _time_axis(runs: list[RunData]) -> tuple[list[dict[int, float]], str]:
    """Each run's x values of a wall-clock chart and the axis' label: minutes past 10 minutes, else seconds."""
    clocks = [elapsed(run) for run in runs]
    if max((t for clock in clocks for t in clock.values()), default=0.0) > 600:
        return [{s: t / 60 for s, t in clock.items()} for clock in clocks], "wall-clock time (min)"
    return clocks, "wall-clock time (s)"


def _lines(
    keys: list[str], runs: list[RunData], band: str = "", with_before: bool = False, xs: list[dict] | None = None
) -> list[Line]:
    """The curves of ``keys`` for each run; ``xs`` (one {step: x} per run) puts them on another x axis than the
    step, a step without an x left out."""
    lines = []
    dashes = ("", "5,3", "2,2", "8,3,2,3")
    for r, run in enumerate(runs):
        for k, key in enumerate(keys):
            points = [(float(s), v) for s, v in series(run.records, key)]
            if with_before and run.summary and key in (run.summary.get("eval_before") or {}):
                before = run.summary["eval_before"][key]
                points = [(0.0, float(before) if is_finite(before) else math.nan)] + points
            if xs is not None:
                points = [(xs[r][int(s)], v) for s, v in points if int(s) in xs[r]]
            if not points:
                continue
            if len(runs) > 1:  # a colour per run, a dash per metric
                color, dash = PALETTE[r % len(PALETTE)], dashes[k % len(dashes)]
                label = f"{run.name}: {key}"
            else:
                color, dash, label = PALETTE[k % len(PALETTE)], "", key
            spread = None
            if band and k == 0:
                std = dict(series(run.records, band))
                if xs is not None:  # the band's std by the x of its step
                    std = {xs[r][s]: v for s, v in std.items() if s in xs[r]}
                spread = [(x, y - std.get(x, math.nan), y + std.get(x, math.nan)) for x, y in points]
            sparse = len(points) < 0.5 * max(len(run.records), 1) or len(points) <= 3
            if spread is not None and len(spread) > MAX_POINTS:
                spread = spread[:: -(-len(spread) // MAX_POINTS)]
            lines.append(Line(label, color, thin(points), dash, markers=sparse, band=spread))
    return lines


def _colour_class(colour: str) -> str:
    """The CSS class of a palette colour (``c0``, ``c1``, ...): the page has no ``style`` attribute, so that
    its Content-Security-Policy can allow only the one stylesheet."""
    return f"c{PALETTE.index(colour)}"


def _figure(title: str, svg: str, lines: list[Line], note: str = "", fid: str = "", eid: str = "") -> str:
    """One plot: ``fid`` names its kind (``data-plot``), ``eid`` (default ``fid``) its element id."""
    legend = "".join(
        f'<span class="key"><span class="swatch {_colour_class(ln.color)}"></span>{esc(ln.label)}'
        f"{' (dashed)' if ln.dash else ''}</span>"
        for ln in lines
    )
    note = f'<div class="note">{esc(note)}</div>' if note else ""
    return (
        f'<figure class="plot" id="plot-{esc(eid or fid)}" data-plot="{esc(fid)}"><figcaption>{esc(title)}</figcaption>'
        f'{svg}<div class="legend">{legend}</div>{note}</figure>'
    )


def _plots(runs: list[RunData]) -> tuple[str, list[str]]:
    """The family's curves, then every other numeric metric; returns the HTML and the plot ids drawn."""
    shown, parts, ids = set(), [], []
    for plot in PLOTS:
        keys = _keys_of(plot, runs)
        if not keys:
            continue
        shown.update(keys)
        if plot.band:
            shown.add(plot.band)
        if plot.id == "heldout":  # one plot per held-out metric: their scales differ (a loss, an accuracy)
            headline = [k for k, _ in HEADLINE]
            for key in sorted(keys, key=lambda k: (headline.index(k) if k in headline else len(headline), k)):
                lines = _lines([key], runs, with_before=True)
                title = f"Held-out {key.removeprefix('eval/')} (step 0 = before training)"
                parts.append(_figure(title, line_chart(lines), lines, plot.note, plot.id, f"heldout-{key}"))
                ids.append(plot.id)
            continue
        xs, xlabel = _time_axis(runs) if plot.x == "perf/elapsed_s" else (None, "step")
        lines = _lines(keys, runs, plot.band, xs=xs)
        if not lines:  # (a wall-clock chart of runs that logged no perf/elapsed_s)
            continue
        positive = all(y > 0 for ln in lines for _, y in ln.points if math.isfinite(y))
        svg = line_chart(lines, ylog=plot.ylog and positive, xlabel=xlabel)
        parts.append(
            _figure(plot.title + (" (log scale)" if plot.ylog and positive else ""), svg, lines, plot.note, plot.id)
        )
        ids.append(plot.id)
        if plot.id == "reward":
            dist = _reward_distribution(runs)
            if dist:
                parts.append(dist)
                ids.append("reward_distribution")
    rest = sorted(
        {
            k
            for run in runs
            for r in run.records
            for k, v in r.items()
            if k != "step"
            and k not in shown
            and isinstance(v, (int, float, str))
            and not isinstance(v, bool)
            and (not isinstance(v, str) or not is_finite(v))
        }
    )
    others = []
    for key in rest:
        lines = _lines([key], runs)
        if lines:
            others.append(_figure(key, line_chart(lines), lines, fid="other-" + key))
            ids.append("other-" + key)
    html_out = '<div class="grid">' + "".join(parts) + "</div>"
    if others:
        html_out += (
            f"<details><summary>Every other logged metric ({len(others)})</summary>"
            f'<div class="grid">{"".join(others)}</div></details>'
        )
    return html_out, ids


def _reward_distribution(runs: list[RunData]) -> str:
    """Each RL run's reward distribution over the steps rollouts.jsonl logged (every sample of the batch)."""
    figures = []
    for run in runs:
        columns = [(int(r["step"]), r["rewards"]) for r in run.rollouts if isinstance(r.get("rewards"), list)]
        svg = heatmap(columns) if columns else ""
        if svg:
            title = "Reward distribution over time" + (f" — {run.name}" if len(runs) > 1 else "")
            note = "shade = share of the rollout batch's samples with that reward, at each step rollouts.jsonl logged"
            figures.append(_figure(title, svg, [], note, "reward_distribution"))
    return "".join(figures)


# ---------------------------------------------------------------------------------------------- the page


def _data_text(run: RunData) -> str:
    train = run.section("data").get("train")
    if not train:
        return "the built-in arithmetic task"
    items = train if isinstance(train, list) else [train]
    return ", ".join(
        str(item.get("name") or item.get("path") or item) if isinstance(item, dict) else str(item) for item in items
    )


def _overview(run: RunData) -> str:
    cfg = run.config
    model = run.section("model").get("name") or "the built-in tiny model"
    train = run.section("train")
    last = run.records[-1]
    steps = f"{last.get('step')} of {run.max_steps}" if run.max_steps else str(last.get("step"))
    env = (run.summary or {}).get("environment")
    versions = env or current_versions()
    where = "recorded by the run" if env else "at report time (the run recorded none)"
    rows = [
        ("run directory", str(run.path.resolve())),
        ("algorithm", f"{cfg.get('algorithm', '?')} ({run.family})"),
        ("model", model),
        ("data", _data_text(run)),
        ("steps", steps),
        ("batch size · lr", f"{train.get('batch_size', '?')} · {train.get('lr', '?')}"),
    ]
    if run.family == "rl":
        ro = run.section("rollout")
        rows.append(("rollouts", f"n={ro.get('n')} · max_new_tokens={ro.get('max_new_tokens')} · "
                                 f"temperature={ro.get('temperature')} · backend={ro.get('backend')}"))  # fmt: skip
        rows.append(("reward", str(run.section("reward").get("name") or "the dataset's default")))
    if pipeline := pipeline_text(run.records):  # asynchronous rollouts: what overlapping bought
        rows.append(("async rollouts", pipeline))
    if run.summary and "train_seconds" in run.summary:  # (a number: `_read_summary` checked it)
        rows.append(("training time", f"{run.summary['train_seconds']:.1f} s"))
    rows.append((f"versions ({where})", " · ".join(f"{k} {v}" for k, v in versions.items())))
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _held_out_table(run: RunData) -> str:
    if not run.summary:
        return ""
    before, after = run.summary.get("eval_before") or {}, run.summary.get("eval_after") or {}
    keys = list(dict.fromkeys([*before, *after]))
    if not keys:
        return ""

    def cell(d: dict, k: str) -> str:
        v = d.get(k)
        return "–" if v is None else (f"{v:.4f}" if isinstance(v, (int, float)) else esc(v))

    body = "".join(f"<tr><td>{esc(k)}</td><td>{cell(before, k)}</td><td>{cell(after, k)}</td></tr>" for k in keys)
    return '<table class="heldout"><tr><th>held-out metric</th><th>before</th><th>after</th></tr>' + body + "</table>"


def _error_log(run: RunData) -> str:
    """error.log's last lines: the run's failure, or — when the run finished after it (`error_superseded`, as
    `oxrl bug-report` decides) — an earlier failure, said to be one."""
    if not run.error_log:
        return ""
    tail = redact("\n".join(run.error_log.splitlines()[-60:]), secret_values(_config_text(run, redacted=False)))
    what = (
        "an earlier failure: the run finished after it (summary.json is newer), e.g. after --resume"
        if run.error_superseded
        else "the run's failure"
    )
    return (
        f'<details class="error-log"><summary>error.log ({what})</summary>'
        f"<pre class='config'>{esc(tail)}</pre></details>"
    )


def _notes(run: RunData) -> str:
    """What was damaged in the run directory (`RunData.notes`): the report shows the rest."""
    if not run.notes:
        return ""
    items = "".join(f'<li class="warning damaged">{esc(note)}</li>' for note in run.notes)
    return (
        '<h3>Damaged files</h3><p class="note">These parts of the run directory could not be read as oxRL writes '
        f'them; the report shows everything else.</p><ul class="findings notes">{items}</ul>'
    )


def _config_text(run: RunData, redacted: bool = True) -> str:
    """config.yaml as shown: credentials redacted (a report is made to be shared), as `oxrl bug-report` does."""
    try:
        text = yaml.safe_dump(run.config, sort_keys=False, allow_unicode=True)
    except (yaml.YAMLError, RecursionError, ValueError, TypeError):  # a shape safe_load made but safe_dump refuses
        text = json.dumps(run.config, indent=2, default=repr)
    return redact(text) if redacted else text


def _findings(findings: list[Finding]) -> str:
    if not findings:
        return '<p class="ok">No warnings: nothing in the metrics looks wrong.</p>'
    items = "".join(
        f'<li class="{esc(f.level)}" data-code="{esc(f.code)}"><b>{esc(f.level)}</b> {esc(f.message)}</li>'
        for f in findings
    )
    return f'<ul class="findings">{items}</ul>'


def _viewer_data(run: RunData) -> list[dict]:
    """The logged rollout steps the viewer embeds: at most MAX_VIEWER_STEPS, evenly spaced, first and last kept."""
    logged = [r for r in run.rollouts if isinstance(r.get("samples"), list) and r["samples"]]
    if len(logged) > MAX_VIEWER_STEPS:
        picks = sorted({round(i * (len(logged) - 1) / (MAX_VIEWER_STEPS - 1)) for i in range(MAX_VIEWER_STEPS)})
        logged = [logged[i] for i in picks]
    return [{"step": r["step"], "samples": r["samples"]} for r in logged]


def _json_for_script(value) -> str:
    """JSON safe inside a ``<script type="application/json">`` element: no NaN (null instead), and no ``<``,
    ``>`` or ``&`` (written ``\\u003c`` ...), so that no value (``</script>``, ``<!--``) can close the element or
    change how the HTML parser reads it; ``ensure_ascii`` writes U+2028 / U+2029 escaped too. ``JSON.parse``
    reads the same values back."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    text = json.dumps(clean(value), ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


VIEWER_SCRIPT = r"""
(function () {
  "use strict";
  var QUANTITIES = {
    logp: {label: "logprob (trainer)", kind: "seq"},
    gap: {label: "trainer − rollout logprob gap", kind: "div"},
    entropy: {label: "entropy", kind: "seq"},
    adv: {label: "advantage", kind: "div"},
    mask: {label: "loss mask", kind: "mask"},
    kl: {label: "KL to the reference (k3)", kind: "seq"}
  };
  // data reaches the page only as text (textContent, title, value): never as HTML; an image only as img.src, and
  // only a base64 data: URI of a raster image (run_files.IMAGE_SRC, checked again here): never a URL or script
  var IMAGE_SRC = /^data:image\/(png|jpeg|gif|webp);base64,[A-Za-z0-9+\/=]+$/;
  function at(list, i) {
    var v = list ? list[i] : null;
    return typeof v === "number" && isFinite(v) ? v : null;
  }
  function values(s, q) {
    var n = s.tokens.length, out = [], i;
    for (i = 0; i < n; i++) {
      var v = null, lp = at(s.logp, i);
      if (q === "gap") { v = (lp === null || at(s.logp_rollout, i) === null) ? null : lp - at(s.logp_rollout, i); }
      else if (q === "kl") {
        if (lp !== null && at(s.logp_ref, i) !== null) {
          var d = at(s.logp_ref, i) - lp; v = Math.exp(d) - d - 1;
        }
      }
      else { v = at(s[q], i); }
      out.push(v);
    }
    return out;
  }
  function colour(v, kind, scale) {
    if (v === null || v === undefined) { return "#eee"; }
    if (kind === "mask") { return v > 0 ? "rgba(44,160,44,0.35)" : "rgba(150,150,150,0.35)"; }
    var t = scale > 0 ? Math.min(Math.abs(v) / scale, 1) : 0;
    if (kind === "div") { return v >= 0 ? "rgba(44,160,44," + (0.08 + 0.8 * t).toFixed(3) + ")" : "rgba(214,39,40," + (0.08 + 0.8 * t).toFixed(3) + ")"; }
    return "rgba(31,119,180," + (0.08 + 0.8 * t).toFixed(3) + ")";
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function fmt(v) { return typeof v !== "number" || !isFinite(v) ? "–" : (Math.abs(v) < 1e-3 && v !== 0 ? v.toExponential(2) : v.toFixed(4)); }
  function ordinal(v) { return typeof v === "number" ? String(v + 1) : "?"; }
  function pictures(s) {
    var box = el("div", "images"), shown = 0, left = s.images_left_out;
    (Array.isArray(s.images) ? s.images : []).forEach(function (src) {
      if (typeof src !== "string" || !IMAGE_SRC.test(src)) { return; }
      var img = el("img", "image");
      shown += 1;
      img.alt = "the prompt's image " + shown;
      img.src = src;
      box.appendChild(img);
    });
    if (typeof left === "number" && left > 0) {
      box.appendChild(el("span", "more", left + " more image(s) not logged: past rollouts.jsonl's bound on image data per step"));
    }
    return box.firstChild ? box : null;
  }
  function shownImages(s) {
    // the images an environment showed in a multi-turn episode, in order, each labelled with its turn
    var box = el("div", "images env"), left = s.env_images_left_out;
    (Array.isArray(s.env_images) ? s.env_images : []).forEach(function (shown) {
      if (!shown || typeof shown !== "object" || typeof shown.image !== "string" || !IMAGE_SRC.test(shown.image)) { return; }
      var turn = typeof shown.turn === "number" && isFinite(shown.turn) && shown.turn >= 0 && Math.floor(shown.turn) === shown.turn
        ? ", turn " + shown.turn : "";
      var figure = el("figure", "shown"), img = el("img", "image");
      img.alt = "shown by the environment" + turn;
      img.src = shown.image;
      figure.appendChild(img);
      figure.appendChild(el("figcaption", "", "shown by the environment" + turn));
      box.appendChild(figure);
    });
    if (typeof left === "number" && left > 0) {
      box.appendChild(el("span", "more", left + " more image(s) shown by the environment not logged: past rollouts.jsonl's bound on image data per step"));
    }
    return box.firstChild ? box : null;
  }
  function render(viewer, runData) {
    var step = viewer.querySelector("select.step").value;
    var q = viewer.querySelector("select.quantity").value;
    var out = viewer.querySelector(".samples");
    while (out.firstChild) { out.removeChild(out.firstChild); }
    var entry = null, i;
    for (i = 0; i < runData.length; i++) { if (String(runData[i].step) === step) { entry = runData[i]; } }
    if (!entry) { return; }
    var all = [];
    entry.samples.forEach(function (s) { values(s, q).forEach(function (v) { if (v !== null) { all.push(Math.abs(v)); } }); });
    var scale = all.length ? Math.max.apply(null, all) : 1;
    if (q === "logp") { scale = Math.max(scale, 1e-6); }
    var kind = QUANTITIES[q].kind;
    viewer.querySelector(".scale").textContent = QUANTITIES[q].label + ": " + (kind === "mask"
      ? "green = trained on (the model's tokens), grey = not (an environment's tokens)"
      : (kind === "div" ? "green = positive, red = negative" : "blue") + ", the darker the larger |value| (largest here " + fmt(scale) + ")");
    entry.samples.forEach(function (s) {
      var box = el("div", "sample");
      var head = el("div", "head", "prompt " + ordinal(s.group) + ", sample " + ordinal(s.sample) + " · reward " + fmt(s.reward) +
        " · advantage " + fmt(s.advantage) + " · " + s.length + " tokens (" + s.finish_reason + ")");
      box.appendChild(head);
      var images = pictures(s);
      if (images) { box.appendChild(images); }
      box.appendChild(el("pre", "prompt", s.prompt));
      var comp = el("div", "completion");
      var vals = values(s, q);
      s.tokens.forEach(function (piece, j) {
        var t = el("span", "tok", piece);
        t.style.background = colour(vals[j], QUANTITIES[q].kind, scale);
        t.title = "token " + at(s.ids, j) + " " + JSON.stringify(piece) + "\n" + QUANTITIES[q].label + ": " + fmt(vals[j]) +
          "\nlogprob " + fmt(at(s.logp, j)) + " · rollout " + fmt(at(s.logp_rollout, j)) + " · entropy " + fmt(at(s.entropy, j)) +
          " · mask " + (at(s.mask, j) === null ? "–" : String(at(s.mask, j)));
        comp.appendChild(t);
      });
      if (typeof s.length === "number" && s.length > s.tokens.length) { comp.appendChild(el("span", "more", " … " + (s.length - s.tokens.length) + " more tokens not logged")); }
      box.appendChild(comp);
      var shown = shownImages(s);
      if (shown) { box.appendChild(shown); }
      out.appendChild(box);
    });
  }
  document.querySelectorAll(".viewer").forEach(function (viewer) {
    var runData = JSON.parse(document.getElementById(viewer.getAttribute("data-source")).textContent);
    var qs = viewer.querySelector("select.quantity");
    Object.keys(QUANTITIES).forEach(function (k) {
      if (k === "kl" && !(runData.length && runData[0].samples.length && runData[0].samples[0].logp_ref)) { return; }
      if (k === "adv" && !(runData.length && runData[0].samples.length && runData[0].samples[0].adv)) { return; }
      var o = el("option", "", QUANTITIES[k].label); o.value = k; qs.appendChild(o);
    });
    viewer.querySelectorAll("select").forEach(function (s) { s.addEventListener("change", function () { render(viewer, runData); }); });
    render(viewer, runData);
  });
})();
"""


def _viewer(run: RunData, index: int, several: bool) -> str:
    data = _viewer_data(run)
    if not data:
        return ""
    source = f"rollouts-{index}"
    steps = "".join(f'<option value="{esc(d["step"])}">step {esc(d["step"])}</option>' for d in data)
    return (
        f'<section class="viewer" data-source="{source}"><h3>Rollouts{" — " + esc(run.name) if several else ""}</h3>'
        '<p class="note">Prompts (with their images, scaled down) and completions rollouts.jsonl logged '
        "(logging.rollout_samples_every), with the images an environment showed under its episode: each token "
        "coloured by the quantity chosen below; hover a token for all its values.</p>"
        f'<label>step <select class="step">{steps}</select></label> '
        '<label>colour by <select class="quantity"></select></label>'
        '<div class="scale note"></div><div class="samples"></div>'
        f'<script type="application/json" id="{source}">{_json_for_script(data)}</script></section>'
    )


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em auto;max-width:1400px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}th,td{text-align:left;padding:.2em .8em;border-bottom:1px solid #eee;
vertical-align:top}table.kv th{width:14em;color:#555;font-weight:600}
.grid{display:flex;flex-wrap:wrap;gap:12px}.plot{margin:0;width:422px;border:1px solid #e5e5e5;border-radius:6px;padding:6px;
background:#fafafa}.plot figcaption{font-weight:600;font-size:.9em;margin-bottom:4px}
.legend{font-size:.75em}.key{margin-right:.8em;white-space:nowrap}
.swatch{display:inline-block;width:10px;height:10px;margin-right:3px;border-radius:2px}
.note{font-size:.75em;color:#666;max-width:440px}
ul.findings{padding-left:1.2em}li.error{color:#b00}li.warning{color:#a60}p.ok{color:#080}
details{margin-top:1em}summary{cursor:pointer;font-weight:600}
.sample{border:1px solid #ddd;border-radius:6px;margin:.6em 0;padding:.5em;background:#fff}
.sample .head{font-size:.85em;color:#444;margin-bottom:.3em}
.images img{height:128px;width:auto;margin:.2em .4em .2em 0;border:1px solid #ddd;image-rendering:pixelated}
.images figure{display:inline-block;margin:.2em .4em .2em 0}.images figcaption{font-size:.75em;color:#666}
pre.prompt{white-space:pre-wrap;background:#f4f4f4;margin:.2em 0;padding:.3em;font-size:.8em;max-height:12em;overflow:auto}
.completion{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85em;white-space:pre-wrap;line-height:1.7}
.tok{border-radius:2px;padding:1px 0;margin-right:1px}.more{color:#888}
pre.config{background:#f6f6f6;padding:.6em;font-size:.8em;max-height:30em;overflow:auto}
""" + "".join(f".swatch.c{i}{{background:{colour}}}" for i, colour in enumerate(PALETTE))


def _sha256_source(text: str) -> str:
    """A CSP source that allows exactly the inline element whose content is ``text``."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


#: what the page may load and run: its own stylesheet and script (by hash), images only as data: URLs, and
#: nothing else — no other script (an injected <script>, an onerror= attribute, a javascript: URL), no
#: network, no form, no <base>. Set by a <meta> tag: the file opens from disk, with no server to send a header.
CSP = "; ".join(
    [
        "default-src 'none'",
        f"script-src {_sha256_source(VIEWER_SCRIPT)}",
        f"style-src {_sha256_source(STYLE)}",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
    ]
)


def render_report(runs: list[RunData]) -> str:
    """The whole HTML page (a string) for one or more runs."""
    names = ", ".join(run.name for run in runs)
    sections = []
    for i, run in enumerate(runs):
        findings = check_run(run.records, run.summary, run.max_steps, run.error)
        title = f"{run.name}" if len(runs) > 1 else "The run"
        sections.append(
            f'<section class="run" id="run-{i}"><h2>{esc(title)}</h2>{_overview(run)}'
            f"{_notes(run)}<h3>Warnings</h3>{_findings(findings)}"
            f"{_held_out_table(run)}"
            f"{_error_log(run)}"
            f"<details><summary>Resolved config (config.yaml)</summary><pre class='config'>"
            f"{esc(_config_text(run))}</pre></details></section>"
        )
    plots, _ = _plots(runs)
    viewers = "".join(_viewer(run, i, len(runs) > 1) for i, run in enumerate(runs))
    viewer_part = f"<h2>Rollout viewer</h2>{viewers}<script>{VIEWER_SCRIPT}</script>" if viewers else ""
    overlay = f" ({len(runs)} runs overlaid: a colour per run)" if len(runs) > 1 else ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">'
        f"<title>oxRL report: {esc(names)}</title><style>{STYLE}</style></head><body>"
        f"<h1>oxRL report: {esc(names)}</h1>"
        + "".join(sections)
        + f"<h2>Curves{overlay}</h2>{plots}"
        + viewer_part
        + "</body></html>\n"
    )


def write_report(run_dirs: list[Path], output: Path) -> Path:
    """Read the run directories (an `OxrlError` for a bad one), write the report atomically, return its path.
    What a damaged file left out is said on stderr too (a ``note:`` line per file), not only in the page."""
    runs = [load_run(Path(d)) for d in run_dirs]
    output = Path(output)
    if output.parent and not output.parent.exists():
        raise OxrlError(f"-o {output}: the folder {output.parent} does not exist")
    write_text_atomic(output, render_report(runs))
    for run in runs:
        for note in run.notes:
            print(f"note: {run.path}/{note}", file=sys.stderr, flush=True)
    return output
