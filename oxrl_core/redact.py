"""Secrets out of text that a person may share: `oxrl bug-report`'s issue body and the one-line messages of
errors that quote a setting (a tracking URI that MLflow rejects). One function, `redact`, used by both, so
whatever one of them hides the other hides too.

Secrets are replaced by ``<redacted>`` in five passes over the whole text:

1. values whose *name* says they are secret — the last part of a YAML / JSON key, a Python dict's key or a
   ``NAME=value`` pair (``hf_token``, ``WANDB_API_KEY``, ``reward.api_key``, ``db_password``, a URL's
   ``?token=`` / ``&sig=``; not ``max_new_tokens`` or ``pad_token_id``), a YAML value on the lines below
   its key included (``db_password: |`` and its indented block);
2. credentials inside URLs: the password of ``scheme://user:password@host`` (the user name is kept: it
   says which account failed);
3. HTTP header values that authenticate: ``Authorization`` / ``Proxy-Authorization`` (``Basic …``,
   ``Bearer …``, ``Token …``), ``Cookie``, and headers named like a secret (``X-Api-Key``, ``Private-Token``)
   wherever they are written (a curl command line, a dict, an error message);
4. every literal occurrence of a value found by passes 1 and 2, in the text or in the environment
   (``secret_values``): a password the run also put into an error message or a path, percent-encoded or not;
5. anything shaped like a known token, wherever it is: Hugging Face ``hf_…``, OpenAI / Anthropic ``sk-…``,
   GitHub ``ghp_…`` / ``github_pat_…``, Slack ``xox…-``, AWS ``AKIA…``, W&B's 40-hex-digit keys, and
   ``Bearer …`` headers.

With ``home`` the home directory is written as ``~`` as well. Only the standard library: this is a leaf
that the tracking sinks (L3) and the commands (L6) both use.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Iterator

__all__ = ["REDACTED", "is_secret_name", "redact", "redact_config", "redact_url", "secret_values"]

REDACTED = "<redacted>"

#: the last part of a name (split at ``.``, ``_``, ``-``, lower-cased) that marks its value secret
SECRET_WORDS = (
    "token", "key", "secret", "password", "passwd", "credential", "credentials", "auth", "authorization",
    "cookie",
)  # fmt: skip
#: ... or a suffix of it (``apikey``, ``hftoken``, ``accesstoken``)
SECRET_SUFFIXES = ("token", "key", "secret", "password")
#: URL query parameters that carry a credential though their name alone would not say so in a config
#: (``?sig=`` of an Azure SAS URL, ``X-Amz-Signature``, ``?pwd=``)
QUERY_SECRET_WORDS = ("sig", "signature", "pwd", "pass", "apikey", "access_token", "sessionid")

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
#: ``name: value`` (YAML), ``"name": "value"`` (JSON), ``name=value`` (env, --set, command lines, URL queries)
_PAIRS = [
    re.compile(rf"^(?P<head>\s*-?\s*(?P<name>{_NAME})\s*:[ \t]+)(?P<value>[^\s#|>][^\n]*?)\s*$", re.M),
    re.compile(rf"(?P<head>\"(?P<name>{_NAME})\"\s*:\s*)(?P<value>\"(?:[^\"\\]|\\.)*\")"),
    re.compile(rf"(?P<head>'(?P<name>{_NAME})'\s*:\s*)(?P<value>'(?:[^'\\]|\\.)*')"),  # a Python dict's repr
    re.compile(rf"(?P<head>(?<![\w.\-])(?P<name>{_NAME})=)(?P<value>\"[^\"]*\"|'[^']*'|[^\s,;&|'\"]+)"),
]

#: a YAML key with nothing after it on its line but perhaps a block indicator (``key: |``, ``key: >-``) or a
#: comment: its value is on the lines below, indented deeper than the key (a block scalar, a plain scalar
#: continued on the next line, or a mapping under the key)
_BLOCK_HEAD = re.compile(
    rf"^(?P<head>[ \t]*(?:-[ \t]+)?(?P<name>{_NAME})[ \t]*:)(?:[ \t]+[|>][0-9+\-]*)?[ \t]*(?:#.*)?$"
)

#: ``scheme://user:password@host``: the password is everything after the first ``:`` of the user info, up
#: to the last ``@`` before the host (an unencoded ``@`` in a password is common)
_URL_USERINFO = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@'\"<>`]*:)(?P<password>[^\s/?#'\"<>`]*)(?=@[^\s@/?#'\"<>`]+)"
)

#: a parameter of a URL's query string: ``?name=value`` or ``&name=value``
_URL_QUERY = re.compile(r"(?P<head>[?&;](?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)=)(?P<value>[^&#\s'\"<>`]*)")

#: an authenticating header written inline: ``Authorization: Basic dXNlcjpw``, ``"X-Api-Key": "..."``,
#: ``-H 'Private-Token: ...'``; ``scheme`` (Basic, Bearer, ...) is kept
_HEADER = re.compile(
    r"(?P<head>(?<![\w\-])(?P<name>[A-Za-z][A-Za-z0-9\-]*)[\"']?[ \t]*:[ \t]*[\"']?"
    r"(?P<scheme>(?:basic|bearer|token|digest|negotiate|ntlm|apikey)[ \t]+)?)"
    r"(?P<value>[^\s\"',;]+)",
    re.I,
)
#: header names redacted whatever their shape (the others: a name with a ``-`` whose last part is secret)
_HEADER_NAMES = ("authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key")


def is_secret_name(name: str) -> bool:
    """Whether a key or variable name says its value is secret (judged by its last part)."""
    last = re.split(r"[._\-]", name.lower())[-1] if name else ""
    if last in SECRET_WORDS:
        return True
    if last.endswith(SECRET_SUFFIXES) and not last.endswith(("tokens", "keys")):
        return True
    return False


def _is_secret_query(name: str) -> bool:
    return is_secret_name(name) or name.lower() in QUERY_SECRET_WORDS or name.lower().endswith("-signature")


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _url_passwords(text: str) -> set[str]:
    """The passwords of every ``scheme://user:password@host`` in ``text``, as written and percent-decoded."""
    found = set()
    for match in _URL_USERINFO.finditer(text):
        password = match.group("password")
        found |= {password, urllib.parse.unquote(password)}
    return found


def _secret_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """``(head, end)`` line ranges of the YAML values that start below a secret-named key: line ``head`` is
    the key, lines ``head+1 .. end-1`` its value (each indented deeper than the key, or blank)."""
    blocks, i = [], 0
    while i < len(lines):
        match = _BLOCK_HEAD.match(lines[i])
        if not match or not is_secret_name(match.group("name")):
            i += 1
            continue
        column, end = match.start("name"), i + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip(" \t")) > column):
            end += 1
        while end > i + 1 and not lines[end - 1].strip():  # trailing blank lines belong to what follows
            end -= 1
        if end > i + 1:
            blocks.append((i, end))
        i = end
    return blocks


def _block_values(text: str) -> set[str]:
    """The lines of each YAML value that starts below its secret-named key (``db_password: |`` and its block)."""
    lines, found = text.splitlines(), set()
    for head, end in _secret_blocks(lines):
        body = [line.strip() for line in lines[head + 1 : end] if line.strip()]
        # each line, and the value as a folded or plain scalar reads it (its lines joined by a space)
        found |= {*body, " ".join(body)}
    return found


def _redact_blocks(text: str) -> str:
    """Each value below a secret-named key (see `_secret_blocks`) becomes ``key: <redacted>`` on one line."""
    lines = text.splitlines(keepends=True)
    blocks = _secret_blocks([line.rstrip("\r\n") for line in lines])
    for head, end in reversed(blocks):
        key = _BLOCK_HEAD.match(lines[head].rstrip("\r\n")).group("head")
        lines[head:end] = [f"{key} {REDACTED}\n"]
    return "".join(lines)


def _secret_pair(match: re.Match) -> bool:
    """Whether a `_PAIRS` match names a secret: a ``name=value`` pair may be a URL's query (``&sig=``)."""
    name = match.group("name")
    return _is_secret_query(name) if match.group("head").endswith("=") else is_secret_name(name)


def _pair_matches(pattern: re.Pattern, text: str) -> Iterator[re.Match]:
    """Every match of a `_PAIRS` pattern, a pair inside another's value included: after a pair that is not
    secret the search goes on from its value (``--set uri=https://host/?token=...`` has two pairs)."""
    pos = 0
    while (match := pattern.search(text, pos)) is not None:
        yield match
        pos = match.end() if _secret_pair(match) else max(match.start("value"), match.start() + 1)


def _sub_pairs(pattern: re.Pattern, text: str, replace) -> str:
    """``pattern.sub(replace, text)`` over `_pair_matches` (a pair inside another's value is replaced too)."""
    out, pos = [], 0
    for match in _pair_matches(pattern, text):
        if _secret_pair(match):
            out += [text[pos : match.start()], replace(match)]
            pos = match.end()
    return "".join([*out, text[pos:]])


def secret_values(text: str, environ: dict[str, str] | None = None) -> set[str]:
    """The values of secret-named keys in ``text`` and of secret-named variables of ``environ``, and the
    passwords of the URLs in either: each is then redacted wherever it appears (`redact`'s pass 4)."""
    found: set[str] = set()
    for pattern in _PAIRS:
        found |= {_unquote(m.group("value")) for m in _pair_matches(pattern, text) if _secret_pair(m)}
    found |= _block_values(text) | _url_passwords(text)
    for name, value in (environ or {}).items():
        if is_secret_name(name):
            found.add(value.strip())
        found |= _url_passwords(value)  # DATABASE_URL, MLFLOW_TRACKING_URI: a password in a URL, whatever the name
    # an Authorization header's value without its scheme (``Basic dXNl...`` -> ``dXNl...``) may appear alone
    found |= {m.group(1) for v in found if (m := re.fullmatch(r"(?i)(?:basic|bearer|token)\s+(\S+)", v))}
    return {v for v in found if len(v) >= 6 and v not in (REDACTED, "null", "None", "true", "false")}


def redact(text: str, secrets: Iterable[str] = (), home: str | None = None) -> str:
    """``text`` with every secret of the five passes (see the module's docstring) replaced by ``<redacted>``,
    and, with ``home``, that directory written as ``~``. ``secrets``: literal values to redact as well
    (`secret_values` of the whole text and the environment)."""

    def by_name(match: re.Match) -> str:
        if not _secret_pair(match) or _unquote(match.group("value")) in ("", REDACTED):
            return match.group(0)
        value = match.group("value").strip()
        quote = value[0] if value[:1] in "\"'" and len(value) > 1 else ""
        return f"{match.group('head')}{quote}{REDACTED}{quote}"

    def header(match: re.Match) -> str:
        name = match.group("name").lower()
        if name not in _HEADER_NAMES and not ("-" in name and is_secret_name(name)):
            return match.group(0)
        if match.group("value") == REDACTED:
            return match.group(0)
        return f"{match.group('head')}{REDACTED}"

    text = _redact_blocks(text)
    for pattern in _PAIRS:
        text = _sub_pairs(pattern, text, by_name)
    text = redact_url(text)
    text = _HEADER.sub(header, text)
    for value in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    for pattern in TOKEN_PATTERNS:
        text = pattern.sub(REDACTED, text)
    if home and home not in ("/", ""):
        text = re.sub(rf"{re.escape(home.rstrip('/'))}(?=/|\b|$)", "~", text)
    return text


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``<redacted>``: the password of
    ``scheme://user:password@host`` and the value of a secret query parameter (``?token=``, ``&sig=``) —
    what a URL shown back to its user, or sent to a tracking server, must lose."""

    def query(match: re.Match) -> str:
        secret = _is_secret_query(match.group("name")) and match.group("value") not in ("", REDACTED)
        return f"{match.group('head')}{REDACTED}" if secret else match.group(0)

    return _URL_QUERY.sub(query, _URL_USERINFO.sub(lambda m: m.group("head") + REDACTED, text))


def redact_config(value):
    """A copy of a config (nested dicts and lists) for the world outside the run directory (a tracking
    server's parameters, a W&B run's config): a secret-named key's value is ``<redacted>``, and so is the
    credentials of a URL in any string (`redact_url`: ``logging.mlflow_tracking_uri``). Nothing else changes: a 40-hex-digit
    ``model.revision`` is a commit, not a W&B key, and stays."""
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(k, str) and is_secret_name(k) and v not in (None, "") else redact_config(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_config(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value
