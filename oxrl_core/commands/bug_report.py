"""`oxrl bug-report [RUN_DIR]`: a ready-to-paste markdown issue body. It reads and prints; it uploads nothing.

The sections: what happened (for the reporter to fill in), versions (`oxrl doctor`'s table), the installed
plugins, and with a run directory the run's resolved ``config.yaml``, its last error with the traceback
(``error.log``, which `lifecycle.error_log` writes when a run fails), the last ``metrics.jsonl`` lines and
``summary.json``.

Secrets are redacted before anything is shown, over the whole text (every section: the config, the
command line and the traceback in ``error.log``, the metrics, the plugins' errors) and with the literal
values of the environment's secret variables: values of secret-named keys (a YAML block scalar on the lines
below its key included), passwords in URLs, authenticating HTTP headers, URL query tokens and known token
shapes — `oxrl_core.redact` says how; the run's one-line errors use the same function.

With ``redact_paths`` the home directory is written as ``~`` as well.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from oxrl_core.errors import OxrlError
from oxrl_core.observability.health import error_superseded
from oxrl_core.redact import REDACTED, is_secret_name, redact, secret_values

__all__ = [
    "REDACTED", "bug_report", "is_secret_name", "redact", "secret_values",
]  # fmt: skip


# ---------------------------------------------------------------- the sections


def fence(text: str, lang: str = "") -> str:
    """A markdown code block that the text cannot close (a fence longer than any run of backticks in it)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def _table(header: tuple[str, ...], rows: Iterable[tuple]) -> str:
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _versions(registry) -> str:
    # lazy: the doctor imports torch (and tries DeepSpeed and vLLM) only when a report is written
    from oxrl_core.commands.doctor import table_rows

    rows = [(name, "ok" if ok else "missing", detail) for name, ok, detail in table_rows(registry)]
    rows.insert(1, ("platform", "ok", f"{platform.platform()} ({platform.machine()})"))
    rows.insert(0, ("oxrl", "ok", _oxrl_version()))
    return _table(("component", "status", "detail"), rows)


def _oxrl_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("oxrl")
    except md.PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def _plugins(registry) -> str:
    rows = [
        (r["kind"], r["name"] + (" (ambiguous)" if r["ambiguous"] else ""), r["package"], r["version"])
        for r in registry.rows()
    ]
    text = _table(("kind", "name", "package", "version"), rows)
    problems = [f"- failed to load: plugin '{e.plugin}' ({e.package} {e.version}): {e.error}" for e in registry.errors]
    problems += [f"- name clash: {registry.describe_clash(c['kind'], c['name'])}" for c in registry.clash_rows()]
    return text + ("\n\n" + "\n".join(problems) if problems else "")


def _read(path: Path) -> str:
    """A run file's text ('' when it is not there or cannot be read)."""
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def _tail_lines(path: Path, count: int) -> list[str]:
    """The last ``count`` complete lines of a JSONL file (a torn last line is skipped)."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    complete = []
    for line in reversed(lines):
        try:
            json.loads(line)
        except ValueError:
            continue
        complete.append(line)
        if len(complete) >= count:
            break
    return complete[::-1]


def _shorten(text: str, head: int = 8, tail: int = 250) -> str:
    lines = text.splitlines()
    if len(lines) <= head + tail:
        return text
    return "\n".join([*lines[:head], f"... ({len(lines) - head - tail} lines left out) ...", *lines[-tail:]])


def _error_section(run_dir: Path) -> str:
    # lazy: the lifecycle module is the error log's writer; imported only for a run directory
    from oxrl_core.run_io.lifecycle import ERROR_LOG

    log = run_dir / ERROR_LOG
    if not log.is_file():
        return (
            f"No `{ERROR_LOG}` in the run directory: the run has not failed since it started writing one "
            "(an error before the run directory was created is only on the terminal; paste it here)."
        )
    text = log.read_text(errors="replace")
    note = ""
    if error_superseded(run_dir):
        note = "Note: the run finished after this error (`summary.json` is newer), e.g. after `--resume`.\n\n"
    return f"{note}From `{ERROR_LOG}`:\n\n{fence(_shorten(text), 'text')}"


def _run_sections(run_dir: Path, metrics: int) -> list[tuple[str, str]]:
    sections: list[tuple[str, str]] = []
    config = run_dir / "config.yaml"
    if config.is_file():
        sections.append(("Resolved config (`config.yaml`)", fence(config.read_text(errors="replace"), "yaml")))
    else:
        sections.append(("Resolved config", "No `config.yaml` in the run directory."))
    sections.append(("Last error", _error_section(run_dir)))
    log = run_dir / "metrics.jsonl"
    if metrics and log.is_file():
        tail = _tail_lines(log, metrics)
        title = f"Last {len(tail)} metrics lines (`metrics.jsonl`)"
        sections.append((title, fence("\n".join(tail), "json") if tail else "`metrics.jsonl` holds no complete line."))
    elif metrics:
        sections.append(("Last metrics lines", "No `metrics.jsonl`: the run did no step."))
    summary = run_dir / "summary.json"
    if summary.is_file():
        sections.append(("Summary (`summary.json`)", fence(summary.read_text(errors="replace"), "json")))
    return sections


def bug_report(
    run_dir: Path | None = None, redact_paths: bool = False, metrics: int = 5, environ: dict | None = None
) -> str:
    """The markdown issue body: versions and plugins, and with ``run_dir`` that run's config, last error,
    last ``metrics`` metrics lines and summary; every secret redacted (see the module's docstring)."""
    # lazy: plugin discovery reads entry points only when a report is written
    from oxrl_core.plugins import discover

    environ = dict(os.environ if environ is None else environ)
    if run_dir is not None and not Path(run_dir).is_dir():
        raise OxrlError(f"RUN_DIR: {run_dir} is not a directory (a run directory, e.g. runs/sgrpo-20261125-101500)")
    registry = discover()
    command = " ".join(["oxrl bug-report", *([str(run_dir)] if run_dir is not None else [])])
    happened = "<!-- What you ran, what you expected, what happened instead. -->"
    if run_dir is not None:
        happened += f"\n\nRun directory: `{run_dir}`"
    sections: list[tuple[str, str]] = [
        ("What happened", happened),
        ("Versions (`oxrl doctor`)", _versions(registry)),
        ("Plugins (`oxrl plugins`)", _plugins(registry)),
    ]
    if run_dir is not None:
        sections += _run_sections(Path(run_dir), metrics)
    body = "\n\n".join(f"## {title}\n\n{text}" for title, text in sections)
    footer = (
        f"<sub>Written by `{command}`: secrets (tokens, keys, passwords) are redacted"
        f"{', paths under the home directory shown as ~' if redact_paths else ''}; nothing was uploaded. "
        "Read it through before posting.</sub>"
    )
    text = f"# oxRL bug report\n\n{body}\n\n{footer}\n"
    # the run's files whole, not only the parts shown: a block scalar's key may be in the lines left out
    whole = [text, *(_read(Path(run_dir) / name) for name in ("config.yaml", "error.log"))] if run_dir else [text]
    secrets = secret_values("\n".join(whole), environ)
    home = str(Path.home()) if redact_paths else None
    text = redact(text, secrets, home)
    if redact_paths and home and os.path.realpath(home) != home:
        text = redact(text, (), os.path.realpath(home))
    return text


def write(text: str, output: Path | None) -> None:
    """To ``output`` (atomically), or to stdout."""
    if output is None:
        sys.stdout.write(text)
        return
    # lazy: only writing a file needs it
    from oxrl_core.atomic import write_text_atomic

    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, text)
