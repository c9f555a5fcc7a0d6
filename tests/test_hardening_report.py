"""`oxrl report` on hostile and damaged run directories (issue 24, items 1, 8 and 9).

1. A run directory tampered with HTML and script in every field the report reads (the directory's name,
   metrics keys and values, config keys and values, summary, error.log, rollout steps, prompts, tokens and
   rewards): the report is opened in a real headless Chromium, which must show the payloads as text, create
   no injected element and run no script but the viewer's (which still renders every token). The page's
   Content-Security-Policy is tested on its own: script injected into a report runs not.
8. Damaged files (a step that is a string, null or 1e400; a config that is a list or has ``train: 5``; a
   summary that is a list; lines of the wrong shape in metrics.jsonl and rollouts.jsonl): a report with a
   note naming the file, the line or field, and everything else shown.
9. A finished run whose first start failed: error.log is shown as an earlier failure, as `oxrl bug-report`
   decides (the same function), not as the run's failure.

Every run directory here is written by hand (no training): the whole module takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import oxrl

from oxrl_core.observability.report import CSP, VIEWER_SCRIPT, load_run, render_report, write_report

#: each payload, if it ran or became an element, would leave a mark the DOM dump shows: an element whose id
#: starts with "pwned", a data-pwned attribute on <body>, or the document's title "PWNED"
RUN = "document.body.setAttribute('data-pwned','1');document.title='PWNED'"
PAYLOADS = [
    "<script>" + RUN + "</script>",
    '<img src=x id=pwned-img onerror="' + RUN + '">',
    '<svg id=pwned-svg onload="' + RUN + '"></svg>',
    "\"><b id=pwned-attr>'",
    "</script><script>" + RUN + "</script><!--",
    '</textarea></title></style><iframe id=pwned-frame srcdoc="<script>parent.' + RUN + '</script>">',
]


def payload(i: int) -> str:
    """The i-th payload (a different one for each field: every kind reaches every kind of place)."""
    return PAYLOADS[i % len(PAYLOADS)]


def sample(i: int) -> dict:
    tokens = [payload(i), "\u2028", payload(i + 1), "<!--", "&amp;"]
    n = len(tokens)
    return {
        "prompt": payload(i + 2) + " What is 2+2?", "group": 0, "sample": i, "reward": 1.0, "advantage": 0.5,
        "finish_reason": payload(i + 3), "length": n + 2, "ids": list(range(n)), "tokens": tokens,
        "logp": [-0.5] * n, "logp_rollout": [-0.5] * n, "entropy": [0.3] * n, "adv": [0.5] * n, "mask": [1.0] * n,
    }  # fmt: skip


def tampered_runs(root: Path) -> list[Path]:
    """Two run directories with HTML in every field the report reads: a finished RL run (summary, rollouts)
    and a failed one (error.log, no summary), both named with HTML."""
    finished = root / "<img src=x id=pwned-name onerror=document.title=1>"
    failed = root / '"><b id=pwned-name2>'
    for run in (finished, failed):
        run.mkdir()
        config = {
            "algorithm": payload(0), payload(1): payload(2),
            "model": {"name": payload(3)}, "data": {"train": [{"name": payload(4)}, payload(5)]},
            "train": {"max_steps": 3, "batch_size": payload(0), "lr": payload(1)},
            "rollout": {"n": payload(2), "max_new_tokens": payload(3), "temperature": payload(4), "backend": payload(5)},
            "reward": {"name": payload(0)},
        }  # fmt: skip
        (run / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
        rows = [
            {"step": 1, "loss": 1.0, "reward/mean": 0.5, "reward/std": 0.1, payload(1): 0.2, "eval/" + payload(2): 0.3},
            {"step": 2, "loss": payload(3), "reward/mean": 0.6, "reward/std": 0.1, payload(1): 0.3, "x": payload(4)},
            {"step": payload(5), "loss": 0.5},  # the case: a step holding HTML
        ]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "steps": 2, "train_seconds": 1.5,
        "environment": {payload(0): payload(1), "torch": payload(2)},
        "eval_before": {"eval/" + payload(3): 0.1, "eval/accuracy": payload(4)},
        "eval_after": {"eval/" + payload(3): 0.2},
    }  # fmt: skip
    (finished / "summary.json").write_text(json.dumps(summary))
    rollouts = [
        {"step": 1, "rewards": [1.0, payload(0), None], "samples": [sample(0), sample(1)]},
        {"step": payload(1), "rewards": [], "samples": [sample(2)]},
        {"step": 2, "rewards": [0.0, 1.0], "samples": [sample(3), payload(4)]},
    ]
    (finished / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    (failed / "error.log").write_text(
        f"oxrl run failed at now\ncommand: oxrl run {payload(0)}\nerror: OxrlError: {payload(1)}\n\nTraceback\n"
        f"{payload(2)}\n"
    )
    return [finished, failed]


# ---------------------------------------------------------------------------------------------- reading a page


class Elements(HTMLParser):
    """Every element of a page: (tag, attributes), and the text of <title> and of each <script>."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict]] = []
        self.title = ""
        self.scripts: list[tuple[dict, str]] = []
        self._in: str | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        if tag in ("title", "script"):
            self._in = tag
            if tag == "script":
                self.scripts.append((dict(attrs), ""))

    def handle_endtag(self, tag):
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in == "title":
            self.title += data
        elif self._in == "script":
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)


def assert_nothing_injected(page: Elements) -> None:
    """No element, attribute or script that a payload would make; the only script is the viewer's."""
    injected = [(tag, a) for tag, a in page.elements if any(str(v).startswith("pwned") for v in a.values())]
    assert not injected, injected
    handlers = [(tag, a) for tag, a in page.elements if any(k.startswith("on") for k in a)]
    assert not handlers, handlers
    assert not [tag for tag, _ in page.elements if tag in ("img", "iframe", "textarea")]
    assert not [a for tag, a in page.elements if tag == "body" and "data-pwned" in a]
    assert "PWNED" not in page.title and page.title.startswith("oxRL report: ")
    code = [text for attrs, text in page.scripts if attrs.get("type") != "application/json"]
    assert code == [VIEWER_SCRIPT], [c[:80] for c in code]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert exe, "no Chromium: apt-get install -y chromium (.ci/run installs it)"  # CI must not skip this
    return exe


def dump_dom(html: Path, tmp: Path) -> tuple[str, list[str]]:
    """The DOM after the page's scripts ran, in headless Chromium (offline), and every console message."""
    proc = subprocess.run(
        [
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-extensions", "--no-first-run", "--enable-logging=stderr", "--v=0",
            f"--user-data-dir={tmp / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND", "--dump-dom",
            html.resolve().as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "<body" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout, [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


# ---------------------------------------------------------------------------------------------- item 1


def test_a_tampered_run_directory_injects_nothing_and_runs_no_script_in_a_real_browser(tmp_path):
    runs = tampered_runs(tmp_path)
    out = tmp_path / "report.html"
    proc = oxrl("report", *map(str, runs), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    text = out.read_text()
    # the file as written: every payload escaped, the only script the viewer's
    assert_nothing_injected(Elements(text))
    assert "</script><script>" not in text and "\u2028" not in text
    data = [json.loads(body) for attrs, body in Elements(text).scripts if attrs.get("type") == "application/json"]
    assert data[0][0]["samples"][0]["tokens"][0] == payload(0)  # JSON.parse reads each payload back as it was
    # the page as Chromium builds it, after the viewer's script ran
    dom, console = dump_dom(out, tmp_path)
    page = Elements(dom)
    assert_nothing_injected(page)
    assert console == [], console  # no script refused (none was tried) and no error in the viewer's
    # ... and the viewer rendered: each token of the first logged step's samples, as text
    assert dom.count('class="tok"') >= 2 * len(sample(0)["tokens"])
    assert html_text(payload(0)) in dom and "prompt 1, sample 1" in dom
    # the payloads are shown as text where they were (names, config, metrics, error.log)
    for value in (html_text(payload(i)) for i in range(len(PAYLOADS))):
        assert value in dom, value
    assert "rollouts.jsonl: line 2 has step " in dom and "metrics.jsonl: line 3 has step " in dom  # damaged: notes


def html_text(value: str) -> str:
    """How Chromium's DOM dump writes a text node's content."""
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_the_content_security_policy_runs_no_injected_script(tmp_path):
    """As if a value had reached the page unescaped: an inline <script>, an onerror= handler and a
    javascript: URL put into a real report do not run; the viewer's own script (allowed by its hash) does."""
    run = tampered_runs(tmp_path)[0]
    report = write_report([run], tmp_path / "report.html").read_text()
    assert f'content="{CSP}"'.replace("'", "&#x27;") in report
    assert "default-src 'none'" in CSP and "img-src data:" in CSP and "unsafe" not in CSP
    injected = (
        f'<script>{RUN}</script><img id=probe src=x onerror="{RUN}">'
        f'<a id=link href="javascript:{RUN}">x</a><img src="https://example.com/x.png">'
    )
    hacked = tmp_path / "hacked.html"
    hacked.write_text(report.replace("<body>", "<body>" + injected, 1))
    dom, console = dump_dom(hacked, tmp_path)
    page = Elements(dom)
    assert not [a for tag, a in page.elements if tag == "body" and "data-pwned" in a]
    assert "PWNED" not in page.title and page.title.startswith("oxRL report: ")
    assert any("Content Security Policy" in line for line in console), console  # refused, and said so
    assert dom.count('class="tok"') >= 2 * len(sample(0)["tokens"])  # the viewer still ran


# ---------------------------------------------------------------------------------------------- item 8


def good_run(root: Path, name: str = "run") -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("algorithm: sgrpo\ntrain:\n  max_steps: 3\n  lr: 0.001\n")
    rows = [{"step": s, "loss": 1.0 / s, "reward/mean": 0.1 * s, "reward/std": 0.1} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": 3, "train_seconds": 2.0, "eval_before": {}}))
    rollouts = [{"step": 1, "rewards": [1.0, 0.0], "samples": [sample(0)]}]
    (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    return run


def append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")


#: (what is damaged, how, the note's words); each on an otherwise good run directory
DAMAGE = {
    "step is a string": ("metrics.jsonl", lambda p: append(p, '{"step": "four", "loss": 1}'), 'line 4 has step "four"'),
    "step is null": ("metrics.jsonl", lambda p: append(p, '{"step": null, "loss": 1}'), "line 4 has step null"),
    "step is 1e400": ("metrics.jsonl", lambda p: append(p, '{"step": 1e400, "loss": 1}'), "line 4 has step Infinity"),
    "step is huge": ("metrics.jsonl", lambda p: append(p, '{"step": 1' + "0" * 400 + "}"), "line 4 has step 1000"),
    "step is true": ("metrics.jsonl", lambda p: append(p, '{"step": true}'), "line 4 has step true"),
    "no step": ("metrics.jsonl", lambda p: append(p, '{"loss": 1}'), "line 4 has no step"),
    "line is a list": ("metrics.jsonl", lambda p: append(p, "[1, 2]"), "line 4 is a JSON list, not an object"),
    "line is deep": ("metrics.jsonl", lambda p: append(p, "[" * 100_000), "line 4 is not JSON"),
    "values of every shape": (
        "metrics.jsonl",
        lambda p: append(p, '{"step": 4, "loss": {"a": 1}, "lr": [1], "grad_norm": 1e400, "x": 1' + "0" * 400 + "}"),
        None,
    ),
    "a log-scale curve with no finite point": (
        "metrics.jsonl",
        lambda p: append(p, '{"step": 4, "rollout/logprob_diff": "nan", "rollout/logprob_diff_max": "inf"}'),
        None,
    ),
    "config is a list": ("config.yaml", lambda p: p.write_text("- a\n- b\n"), "holds a list, not a mapping"),
    "train is 5": ("config.yaml", lambda p: p.write_text("algorithm: sft\ntrain: 5\n"), "train is 5, not a mapping"),
    "rollout is text": ("config.yaml", lambda p: p.write_text("rollout: fast\n"), 'rollout is "fast", not a mapping'),
    "config not YAML": ("config.yaml", lambda p: p.write_text("a: [\n"), "not readable YAML"),
    "config not UTF-8": ("config.yaml", lambda p: p.write_bytes(b"algorithm: \xff\xfe\n"), None),
    "summary is a list": ("summary.json", lambda p: p.write_text("[1, 2]"), "holds a JSON list, not an object"),
    "summary not JSON": ("summary.json", lambda p: p.write_text("{"), "not JSON"),
    "summary fields": (
        "summary.json",
        lambda p: p.write_text('{"train_seconds": "soon", "environment": [1], "eval_before": {"eval/accuracy": "x"}}'),
        "train_seconds is \"soon\", not a number",
    ),
    "eval_after is text": ("summary.json", lambda p: p.write_text('{"eval_after": "none"}'), "eval_after is \"none\""),
    "rollout step is HTML": ("rollouts.jsonl", lambda p: append(p, '{"step": "<b>", "samples": []}'), 'has step "<b>"'),
    "rollout shapes": (
        "rollouts.jsonl",
        lambda p: append(p, '{"step": 2, "rewards": 5, "samples": [7, {"tokens": "abc", "ids": 3, "reward": "x"}]}'),
        "step 2: rewards is 5, not a list",
    ),
    "samples is a dict": ("rollouts.jsonl", lambda p: append(p, '{"step": 2, "samples": {}}'), "samples is {}, not a list"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_file_is_a_note_in_the_report_never_a_crash(case, tmp_path):
    file, damage, note = DAMAGE[case]
    run = good_run(tmp_path)
    damage(run / file)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    loaded = load_run(run)
    page = render_report([loaded])
    if note is not None:
        assert any(n.startswith(f"{file}: ") and note in n for n in loaded.notes), loaded.notes
        assert "Damaged files" in page
    assert_nothing_injected(Elements(page))
    assert len(loaded.records) >= 3  # the good lines are all there
    assert "<svg" in page and "Resolved config" in page
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # the report changes nothing it reads


def test_oxrl_report_on_a_run_directory_damaged_everywhere(tmp_path):
    """The issue's cases at once, through the CLI: exit 0, a report naming each damaged file and field."""
    run = good_run(tmp_path)
    append(run / "metrics.jsonl", '{"step": "four", "loss": 1}')
    append(run / "metrics.jsonl", '{"step": null}')
    append(run / "metrics.jsonl", '{"step": 1e400}')
    (run / "config.yaml").write_text("algorithm: sgrpo\ntrain: 5\n")
    (run / "summary.json").write_text("[1, 2]")
    append(run / "rollouts.jsonl", '{"step": 3, "rewards": ["x"], "samples": [[1]]}')
    proc = oxrl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "report written to" in proc.stdout
    for file in ("metrics.jsonl", "config.yaml", "summary.json", "rollouts.jsonl"):  # said on the terminal too
        assert f"note: {run}/{file}: " in proc.stderr, proc.stderr
    text = (run / "report.html").read_text()
    for note in (
        "metrics.jsonl: line 4 has step &quot;four&quot;, not a whole number; skipped; line 5 has step null",
        "line 6 has step Infinity",
        "config.yaml: train is 5, not a mapping",
        "summary.json: holds a JSON list, not an object",
        "rollouts.jsonl: step 3: 1 of the rewards are not numbers; left out of the distribution; step 3, sample 1 is "
        "[1], not an object",
    ):
        assert note in text, note
    assert 'data-plot="loss"' in text and 'data-plot="reward"' in text  # the readable steps are drawn


def test_a_metrics_file_with_no_readable_step_is_one_message(tmp_path):
    run = good_run(tmp_path)
    (run / "metrics.jsonl").write_text('{"step": "one"}\n[1]\n')
    proc = oxrl("report", str(run), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no metrics" in proc.stderr and 'metrics.jsonl: line 1 has step "one"' in proc.stderr
    assert not (tmp_path / "r.html").exists()


# ---------------------------------------------------------------------------------------------- item 9


def test_an_error_the_run_outlived_is_an_earlier_failure_as_bug_report_says(tmp_path):
    """A first start failed (error.log), a --resume then finished (summary.json, newer): the report shows
    error.log as an earlier failure and no failure finding; bug-report adds its note. Without the newer
    summary (the run failed), both show it as the run's failure."""
    run = good_run(tmp_path)
    (run / "summary.json").unlink()
    (run / "error.log").write_text(
        "oxrl run failed at then\ncommand: oxrl run\nerror: OxrlError: model.name: cannot load 'typo'\n"
    )
    failed = load_run(run)
    assert failed.error == "model.name: cannot load 'typo'" and not failed.error_superseded
    assert "error.log (the run's failure)" in render_report([failed])
    (run / "summary.json").write_text(json.dumps({"steps": 3, "train_seconds": 2.0}))
    os.utime(run / "error.log", (0, 0))  # the failed start came first
    proc = oxrl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    text = (run / "report.html").read_text()
    assert "error.log (an earlier failure: the run finished after it" in text
    assert "the run's failure" not in text and 'data-code="stopped"' not in text
    assert "cannot load &#x27;typo&#x27;" in text  # still shown, for the record
    bug = oxrl("bug-report", str(run))
    assert bug.returncode == 0 and "the run finished after this error" in bug.stdout
    assert re.search(r"error\.log \(an earlier failure", text)


def test_the_report_redacts_credentials_in_the_config_and_error_log(tmp_path):
    """A report is made to be shared: a password in a tracking URI, a token, and their copies in error.log are
    redacted as `oxrl bug-report` redacts them; the rest of the config is shown."""
    run = good_run(tmp_path)
    (run / "config.yaml").write_text(
        "algorithm: sgrpo\ntrain:\n  max_steps: 3\nlogging:\n  mlflow_tracking_uri: postgresql://ana:Pw0rd-9x@db/ml\n"
        "reward:\n  name: llm_judge\n  api_key: sk-abcdefghijklmnopqrstuvwx\n"
    )
    (run / "error.log").write_text(
        "oxrl run failed at then\ncommand: oxrl run --set logging.mlflow_tracking_uri=postgresql://ana:Pw0rd-9x@db/ml\n"
        "error: OxrlError: could not connect with key sk-abcdefghijklmnopqrstuvwx\n"
    )
    proc = oxrl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    text = (run / "report.html").read_text()
    assert "Pw0rd-9x" not in text and "sk-abcdefghijklmnopqrstuvwx" not in text
    assert "postgresql://ana:" in text and "llm_judge" in text and "max_steps: 3" in text
