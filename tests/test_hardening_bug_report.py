"""Bug reports leak no credential, and a tracking URI MLflow rejects is one message (issue 24, items 2 and 3).

Each secret a run directory can hold — a password in a URL, an ``Authorization: Basic`` / ``Bearer`` header,
a YAML block scalar under a secret-named key, a URL query token, a password in an environment variable's URL
— is planted into a hand-written run directory's config, command line, error text and traceback, and the
whole `oxrl bug-report` (the real CLI) is searched for each literal. One real run with a tracking URI that
MLflow rejects shows the message, exit 2 and no traceback on the terminal, and its bug report is searched too.
"""

from __future__ import annotations

import base64
import json
import os

import pytest
from conftest import oxrl

from oxrl_core.redact import REDACTED, redact, redact_config, secret_values
from oxrl_core.run_io import lifecycle

URL_PASSWORD = "URLPASS-1a2b3c"
BASIC = base64.b64encode(b"judge:BASIC-SECRET-1234").decode()
BEARER = "BEARER-TOKEN-9a0b8c7d"
BLOCK = "BLOCK-SECRET-5c6d7e"
QUERY_TOKEN = "QUERYTOK-7e8f9a"
SIG = "SASSIG-0b1c2d3e"
ENV_PASSWORD = "ENVPASS-4f5a6b"
SECRETS = (URL_PASSWORD, BASIC, BEARER, BLOCK, QUERY_TOKEN, SIG, ENV_PASSWORD)

DB_URI = f"postgresql://user:{URL_PASSWORD}@db.example.com:5432/mlflow"
JUDGE = f"https://judge.example.com/score?token={QUERY_TOKEN}&mode=fast&sig={SIG}"

CONFIG = f"""algorithm: sgrpo
logging:
  mlflow: true
  mlflow_tracking_uri: {DB_URI}
reward:
  name: judge
  endpoint: {JUDGE}
  headers: "Authorization: Basic {BASIC}"
  fallback_headers: {{"Authorization": "Bearer {BEARER}"}}
  db_password: |
    {BLOCK}
  notes: >-
    the judge answers in 2 s
"""

COMMAND = (
    f"oxrl run --alg sgrpo --set logging.mlflow_tracking_uri={DB_URI} --set reward.endpoint={JUDGE} "
    f"--set 'reward.headers=Authorization: Basic {BASIC}' -H 'Authorization: Bearer {BEARER}' "
    f"--set reward.db_password={BLOCK}"
)

ERROR_LOG = f"""{lifecycle.ERROR_LOG_HEADER} at 2026-11-26T03:00:00+00:00 (pid 1 on host)
command: {COMMAND}
error: OxrlError: reward 'judge' could not start: ConnectionError: 401 from {JUDGE} with headers \
{{'Authorization': 'Basic {BASIC}'}}; retried with Authorization: Bearer {BEARER}

Traceback (most recent call last):
  File "judge.py", line 12, in __init__
    self.db = connect("{DB_URI}", password="{BLOCK}")
  File "judge.py", line 30, in connect
    raise OperationalError(f"password authentication failed: {URL_PASSWORD} / {ENV_PASSWORD}")
OperationalError: password authentication failed for {DB_URI} (tried {URL_PASSWORD}, then {ENV_PASSWORD})
the request was:
  headers:
    X-Api-Key: {QUERY_TOKEN}
  db_password: >
    {BLOCK}
"""


@pytest.fixture
def planted_run(tmp_path):
    """A run directory written by hand: every kind of secret in its config, command line, error and summary."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(CONFIG)
    (run / lifecycle.ERROR_LOG).write_text(ERROR_LOG)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "judge": JUDGE}) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 1, "tracking": DB_URI}))
    os.utime(run / lifecycle.ERROR_LOG, (0, 0))  # older than summary.json: the report notes it
    return run


def test_bug_report_redacts_every_planted_credential(planted_run, tmp_path):
    env = {"DATABASE_URL": f"postgresql://app:{ENV_PASSWORD}@db/app"}  # a password no config holds
    out = tmp_path / "issue.md"
    proc = oxrl("bug-report", str(planted_run), "-o", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    report = out.read_text()
    leaked = [secret for secret in SECRETS if secret in report]
    assert not leaked, leaked
    assert "BASIC-SECRET-1234" not in report  # not even decoded
    # what is kept says what failed: the URL without its password, the header's scheme, the key
    assert "postgresql://user:<redacted>@db.example.com:5432/mlflow" in report
    assert f"token={REDACTED}&mode=fast&sig={REDACTED}" in report
    assert f"Authorization: Basic {REDACTED}" in report and f"Authorization: Bearer {REDACTED}" in report
    assert f"  db_password: {REDACTED}\n  notes: >-\n    the judge answers in 2 s" in report
    assert "Traceback (most recent call last)" in report and "## Last error" in report
    # nothing of the run directory changed
    assert (planted_run / "config.yaml").read_text() == CONFIG
    assert (planted_run / lifecycle.ERROR_LOG).read_text() == ERROR_LOG


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("uri: mysql://root:p@ss@word!@db:3306/x", "p@ss@word!"),  # an unencoded @ in the password
        ("redis://:onlypassword@cache:6379/0", "onlypassword"),
        ("https://user:pa%40ssword@host/", "pa%40ssword"),
        ("GET https://s.blob.core.windows.net/c?sv=2024&sig=abcDEF123%3D&se=1", "abcDEF123%3D"),
        ("https://bucket.s3.amazonaws.com/k?X-Amz-Signature=0badc0ffee99&X-Amz-Date=1", "0badc0ffee99"),
        ("curl -H 'Proxy-Authorization: Basic dXNlcjpwYXNz' https://x", "dXNlcjpwYXNz"),
        ('{"headers": {"Authorization": "Token tok-123456"}}', "tok-123456"),
        ("curl -H 'Private-Token: glpat-abcdef' https://gitlab", "glpat-abcdef"),
        ("Cookie: session=s3ss10n-value", "s3ss10n-value"),
        ("auth:\n  client_secret:\n    multi-line-secret\n  user: x\n", "multi-line-secret"),
        ("- db_password: |-\n    list-item-secret\n- next: 1\n", "list-item-secret"),
    ],
)
def test_redact_finds_each_credential_shape(text, secret):
    assert secret not in redact(text, secret_values(text))


def test_redact_keeps_what_is_not_secret():
    text = (
        "model:\n  name: Qwen/Qwen2.5-0.5B\n  revision: 0123456789abcdef0123456789abcdef01234567\n"
        "reward:\n  notes: |\n    basic arithmetic, 2 s per call\n"
        "rollout:\n  max_new_tokens: 64\ndata: https://host/data.jsonl?split=train&format=json\n"
        "ssh://git@github.com/org/repo and user@example.com\n"
    )
    out = redact(text, secret_values(text))
    for kept in ("basic arithmetic, 2 s per call", "max_new_tokens: 64", "split=train&format=json"):
        assert kept in out
    assert "ssh://git@github.com/org/repo" in out and "user@example.com" in out
    # a tracking server's parameters: secrets go, a commit hash (40 hex digits, like a W&B key) stays
    config = {
        "logging": {"mlflow_tracking_uri": DB_URI},
        "reward": {"api_key": "k" * 8, "url": JUDGE},
        "model": {"revision": "a" * 40},
    }
    shared = redact_config(config)
    assert shared["reward"]["url"] == f"https://judge.example.com/score?token={REDACTED}&mode=fast&sig={REDACTED}"
    assert shared["logging"]["mlflow_tracking_uri"] == "postgresql://user:<redacted>@db.example.com:5432/mlflow"
    assert shared["reward"]["api_key"] == REDACTED and shared["model"]["revision"] == "a" * 40
    assert config["logging"]["mlflow_tracking_uri"] == DB_URI  # a copy: the run's own config is untouched


@pytest.mark.slow
def test_a_tracking_uri_mlflow_rejects_is_one_message_and_its_bug_report_has_no_password(tmp_path, tiny_model_dir):
    """The issue's case: an 82-line traceback holding the password. Now one line, exit 2, run directory kept."""
    run = tmp_path / "run"
    proc = oxrl(
        "run", "--alg", "sft", "-q", "-o", str(run), "--set", f"model.name={tiny_model_dir}",
        "--set", "train.max_steps=2", "--set", "train.eval_every=0", "--set", "logging.mlflow=true",
        "--set", f"logging.mlflow_tracking_uri={DB_URI}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and URL_PASSWORD not in proc.stderr + proc.stdout
    assert "logging.mlflow_tracking_uri: MLflow cannot use 'postgresql://user:<redacted>@db.example.com" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr
    assert (run / "config.yaml").is_file()  # the run directory is kept, with its config
    log = (run / lifecycle.ERROR_LOG).read_text()
    assert "error: OxrlError: logging.mlflow_tracking_uri" in log
    assert "raised while handling" not in log  # MLflow's own exception (its text holds the URI) is not chained
    report = oxrl("bug-report", str(run))
    assert report.returncode == 0, report.stderr
    assert URL_PASSWORD not in report.stdout and "postgresql://user:<redacted>@" in report.stdout
    assert "logging.mlflow_tracking_uri: MLflow cannot use" in report.stdout
