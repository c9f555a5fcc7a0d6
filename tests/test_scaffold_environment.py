"""`oxrl new-plugin NAME --kind environment`: a tools-style environment package, through the real CLI.

- end to end (slow): scaffold -> pip install into a throw-away venv -> listed as an environment of its
  package -> `oxrl run --alg sgrpo --set env.name=NAME` exits 0 -> the package's own tests pass;
- the files it writes, the printed next steps (the env command), the hook and entry point;
- a name another package registers as an environment: a warning naming the owner and `--kind environment`;
- an unknown ``--kind``: one message, exit 2, no traceback, nothing created; ``--kind algorithm`` is the default.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import layered_venv, oxrl, read_metrics, write_jsonl

# Pass these explicitly so a developer's shell settings cannot change what the tests see.
CLEAN = {"OXRL_PLUGINS": "", "OXRL_STRICT_PLUGINS": "", "PYTHONPATH": "", "COLUMNS": "200"}
FILES = ("pyproject.toml", "README.md", "oxrl_lookup/__init__.py", "oxrl_lookup/environment.py", "tests/test_lookup.py")


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_environment_scaffold_writes_a_package_and_prints_the_env_command(tmp_path):
    proc = oxrl("new-plugin", "lookup", "--kind", "environment", "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "oxrl-lookup"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(FILES)
    assert f"pip install -e {root}" in proc.stdout
    assert "oxrl run --alg sgrpo --set env.name=lookup --set train.max_steps=20" in proc.stdout
    assert proc.stderr == ""  # the name is free: no warning

    pyproject = (root / "pyproject.toml").read_text()
    assert 'name = "oxrl-lookup"' in pyproject
    assert '[project.entry-points.oxrl]\nlookup = "oxrl_lookup"\n' in pyproject
    init = (root / "oxrl_lookup" / "__init__.py").read_text()
    assert "@hookimpl\ndef register_environments(register):" in init
    assert 'register("lookup", "oxrl_lookup.environment:LookupEnv")' in init
    assert "env.name=lookup" in (root / "README.md").read_text()
    for rel in FILES:
        if rel.endswith(".py"):
            compile((root / rel).read_text(), rel, "exec")


def test_an_environment_name_already_registered_is_a_warning_naming_its_owner(tmp_path):
    proc = oxrl("new-plugin", "calculator", "--kind", "environment", "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 0, proc.stderr
    text = flat(proc.stderr)
    assert "environment 'calculator' is already registered by oxrl" in text, text
    assert "oxrl new-plugin my_calculator --kind environment" in text, text
    assert "oxrl run --alg sgrpo --set env.name=oxrl-calculator:calculator" in proc.stdout


@pytest.mark.parametrize("kind", ["bogus", "Environment", ""])
def test_an_unknown_kind_is_one_message_and_creates_nothing(tmp_path, kind):
    proc = oxrl("new-plugin", "lookup", "--kind", kind, "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert flat(proc.stderr) == f"error: --kind {kind!r}: expected one of algorithm, environment"
    assert list(tmp_path.iterdir()) == []


def test_the_default_kind_is_an_algorithm(tmp_path):
    proc = oxrl("new-plugin", "myalg2", "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "oxrl-myalg2" / "oxrl_myalg2" / "algorithm.py").is_file()
    assert "oxrl run --alg myalg2 --set train.max_steps=20" in proc.stdout


@pytest.mark.slow
def test_scaffolded_environment_installs_lists_and_trains(tmp_path, tiny_model_dir):
    """As the algorithm scaffold's end-to-end test: installed with pip into a throw-away venv layered on this
    environment (`conftest.layered_venv`), so nothing is installed into the shared one."""
    proc = oxrl("new-plugin", "lookup", "--kind", "environment", "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "oxrl-lookup"

    import setuptools  # noqa: F401  (the scaffold's build backend, used without build isolation; in the test extra)

    py = layered_venv(tmp_path / "venv")
    env = {**os.environ, **CLEAN}
    pip = subprocess.run(
        [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-input", "-q", "-e", str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr

    def venv_oxrl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [py, "-m", "oxrl_core.cli", *args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600
        )

    # Listed as an environment of its package; the shared environment does not see it.
    proc = venv_oxrl("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    assert listing["errors"] == []
    (row,) = [r for r in listing["plugins"] if r["name"] == "lookup"]
    assert (row["kind"], row["package"], row["version"]) == ("environment", "oxrl-lookup", "0.1.0")
    shared = json.loads(oxrl("plugins", "--json", env=CLEAN).stdout)
    assert "lookup" not in {r["name"] for r in shared["plugins"]}

    # It trains: the printed command, on a small saved model and a short run.
    run_dir = tmp_path / "run"
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "What is 2+3?", "answer": "5"}])
    proc = venv_oxrl(
        "run", "--alg", "sgrpo", "--set", "env.name=lookup", "--set", "train.max_steps=2",
        "--set", f"model.name={tiny_model_dir}", "--set", "data.train=arith", "--set", f"data.eval={held_out}",
        "--set", "train.batch_size=4", "--set", "rollout.n=2", "--set", "rollout.max_new_tokens=16",
        "--set", "env.max_turns=2", "--set", "env.max_tokens=64", "-o", str(run_dir),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("env/turns" in m and m["env/errors"] == 0 for m in metrics), metrics
    assert (run_dir / "final" / "config.json").is_file()

    # The scaffold's own tests pass against the installed package (cwd is not the source tree).
    proc = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout
