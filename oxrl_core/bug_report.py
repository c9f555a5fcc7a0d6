"""`oxrl bug-report [RUN_DIR]`: a ready-to-paste markdown issue body. It reads and prints; it uploads nothing.

The sections: what happened (for the reporter to fill in), versions (`oxrl doctor`'s table), the installed
plugins, and with a run directory the run's resolved ``config.yaml``, its last error with the traceback
(``error.log``, which `lifecycle.error_log` writes when a run fails), the last ``metrics.jsonl`` lines and
``summary.json``.

Secrets are redacted before anything is shown, in three passes over the whole text:

1. values whose *name* says they are secret — the last part of a YAML / JSON key or a ``NAME=value`` pair
   (``hf_token``, ``WANDB_API_KEY``, ``reward.api_key``, ``db_password``; not ``max_new_tokens`` or
   ``pad_token_id``);
2. every literal occurrence of such a value found in the config or in the environment (a token the run put
   into an error message or a path);
3. anything shaped like a known token, wherever it is: Hugging Face ``hf_…``, OpenAI / Anthropic ``sk-…``,
   GitHub ``ghp_…`` / ``github_pat_…``, Slack ``xox…-``, AWS ``AKIA…``, W&B's 40-hex-digit keys, and
   ``Bearer …`` headers.

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

__all__ = ["REDACTED", "bug_report", "redact"]

REDACTED = "<redacted>"

#: the last part of a name (split at ``.``, ``_``, ``-``, lower-cased) that marks its value secret
SECRET_WORDS = ("token", "key", "secret", "password", "passwd", "credential", "credentials", "auth")
#: ... or a suffix of it (``apikey``, ``hftoken``, ``accesstoken``)
SECRET_SUFFIXES = ("token", "key", "secret", "password")

#: token shapes redacted wherever they appear
TOKEN_PATTERNS = [
    re.compile(r"\bhf_[A-Za-z0-9]{16,}"),  # Hugging Face
    re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"),  # OpenAI (sk-..., sk-proj-...), Anthropic (sk-ant-...)
    re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}"),  # GitHub
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),  # Slack
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\b[0-9a-f]{40}\b"),  # W&B API key (40 hex digits)
    re.compile(r"(?i)(?<=\bbearer )[A-Za-z0-9._~+/\-]{8,}=*"),  # Authorization: Bearer ...
]

_NAME = r"[A-Za-z_][A-Za-z0-9_.\-]*"
#: ``name: value`` (YAML), ``"name": "value"`` (JSON), ``name=value`` (env, --set, command lines)
_PAIRS = [
    re.compile(rf"^(?P<head>\s*-?\s*(?P<name>{_NAME})\s*:[ \t]+)(?P<value>[^\s#][^\n]*?)\s*$", re.M),
    re.compile(rf"(?P<head>\"(?P<name>{_NAME})\"\s*:\s*)(?P<value>\"(?:[^\"\\]|\\.)*\")"),
    re.compile(rf"(?P<head>'(?P<name>{_NAME})'\s*:\s*)(?P<value>'(?:[^'\\]|\\.)*')"),  # a Python dict's repr
    re.compile(rf"(?P<head>(?<![\w.\-])(?P<name>{_NAME})=)(?P<value>\"[^\"]*\"|'[^']*'|[^\s,;&|]+)"),
]


def is_secret_name(name: str) -> bool:
    """Whether a key or variable name says its value is secret (judged by its last part)."""
    last = re.split(r"[._\-]", name.lower())[-1] if name else ""
    if last in SECRET_WORDS:
        return True
    if last.endswith(SECRET_SUFFIXES) and not last.endswith(("tokens", "keys")):
        return True
    return False


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def secret_values(text: str, environ: dict[str, str] | None = None) -> set[str]:
    """The values of secret-named keys in ``text`` and of secret-named variables of ``environ``."""
    found: set[str] = set()
    for pattern in _PAIRS:
        for match in pattern.finditer(text):
            if is_secret_name(match.group("name")):
                found.add(_unquote(match.group("value")))
    for name, value in (environ or {}).items():
        if is_secret_name(name):
            found.add(value.strip())
    return {v for v in found if len(v) >= 6 and v not in (REDACTED, "null", "None", "true", "false")}


def redact(text: str, secrets: Iterable[str] = (), home: str | None = None) -> str:
    """``text`` with every secret of the three passes (see the module's docstring) replaced by ``<redacted>``,
    and, with ``home``, that directory written as ``~``."""

    def by_name(match: re.Match) -> str:
        if not is_secret_name(match.group("name")) or _unquote(match.group("value")) in ("", REDACTED):
            return match.group(0)
        value = match.group("value").strip()
        quote = value[0] if value[:1] in "\"'" and len(value) > 1 else ""
        return f"{match.group('head')}{quote}{REDACTED}{quote}"

    for pattern in _PAIRS:
        text = pattern.sub(by_name, text)
    for value in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    for pattern in TOKEN_PATTERNS:
        text = pattern.sub(REDACTED, text)
    if home and home not in ("/", ""):
        text = re.sub(rf"{re.escape(home.rstrip('/'))}(?=/|\b|$)", "~", text)
    return text


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
    from oxrl_core.doctor import table_rows

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
    from oxrl_core.lifecycle import ERROR_LOG

    log = run_dir / ERROR_LOG
    if not log.is_file():
        return (
            f"No `{ERROR_LOG}` in the run directory: the run has not failed since it started writing one "
            "(an error before the run directory was created is only on the terminal; paste it here)."
        )
    text = log.read_text(errors="replace")
    note = ""
    summary = run_dir / "summary.json"
    if summary.is_file() and summary.stat().st_mtime > log.stat().st_mtime:
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
    secrets = secret_values(text, environ)
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
