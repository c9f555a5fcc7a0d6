"""The plugin system (hook specs, entry points and interfaces; ``docs/architecture.md``) through the real `oxrl` CLI.

- a third-party package made by `oxrl new-plugin` (an algorithm of each loop), pip-installed, is listed and runs;
- a broken plugin is reported (name, package, version, error) and never stops the CLI;
  it is a hard, clear error only when a run names it; OXRL_STRICT_PLUGINS makes it fatal;
- misspelled hooks (pluggy check_pending), registrations pointing nowhere or at a
  non-Algorithm, the OXRL_PLUGINS allow-list, "did you mean", lazy (torch-free) discovery,
  duplicate names, and `oxrl new-plugin`'s own input checks.

Fake plugins are made without pip: a package plus a hand-written ``*.dist-info``
(METADATA + entry_points.txt) in a directory put on PYTHONPATH for the subprocess,
which importlib.metadata finds exactly as it finds an installed distribution.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import layered_venv, oxrl, read_metrics, write_jsonl

BUILTIN_ALGS = {"sft", "cpt", "kd", "rft"}

# Pass these explicitly so a developer's shell settings cannot change what the tests see
# ("" means unset for both OXRL variables).
CLEAN = {"OXRL_PLUGINS": "", "OXRL_STRICT_PLUGINS": "", "PYTHONPATH": "", "COLUMNS": "200"}


def flat(text: str) -> str:
    """Collapse whitespace: rich wraps long lines on stderr when it is not a terminal."""
    return " ".join(text.split())


def env_with(site: Path | None = None, **extra: str) -> dict:
    env = dict(CLEAN)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    env.update(extra)
    return env


def make_dist(site: Path, dist: str, version: str, files: dict[str, str], entry_points: dict[str, str]) -> Path:
    """A distribution `dist` found by importlib.metadata when `site` is on sys.path."""
    for rel, source in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[oxrl]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return site


def plugins_json(env: dict) -> dict:
    proc = oxrl("plugins", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def names(listing: dict, kind: str = "algorithm") -> set[str]:
    return {row["name"] for row in listing["plugins"] if row["kind"] == kind}


def assert_clean_failure(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Non-zero exit, one readable message containing every fragment, and no traceback."""
    text = flat(proc.stdout + proc.stderr)
    assert proc.returncode != 0, text
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in: {text}"
    return text


@pytest.fixture
def broken_site(tmp_path) -> Path:
    """oxrl-broken 0.1: entry point `broken = oxrl_broken`, whose import raises RuntimeError('boom')."""
    return make_dist(
        tmp_path / "broken-site",
        "oxrl-broken",
        "0.1",
        {"oxrl_broken/__init__.py": 'raise RuntimeError("boom")\n'},
        {"broken": "oxrl_broken"},
    )


# ---------------------------------------------------------------------------------------------
# 1. A third-party package, end to end: scaffold -> pip install -> listed -> runs -> its tests pass
# ---------------------------------------------------------------------------------------------


#: the algorithm scaffold of each loop, as the e2e test makes it: plugin name -> (--loop, a metric only its loss
#: or advantages log, the scaffold's own tests that pass)
SCAFFOLDED = {
    "myalg": ("supervised", "loss/nll", 1),
    "mypref": ("preference", "rewards/margins", 2),
    "myrl": ("rl", "adv/abs_mean", 2),
}


@pytest.mark.slow
def test_scaffolded_plugin_installs_lists_and_runs(tmp_path, tiny_model_dir, sft_jsonl):
    """`oxrl new-plugin NAME --loop supervised|preference|rl` gives a package that `pip install` makes a working
    algorithm of that loop.

    The three are installed with one pip into one throw-away virtual environment layered on this one
    (`conftest.layered_venv`: oxrl and its dependencies come from here, the new distributions go only into the
    venv), so a concurrently running test never sees them, nothing needs uninstalling from the shared
    environment, and the second and third loops cost only their runs.
    """
    roots = {}
    for name, (loop, _, _) in SCAFFOLDED.items():
        flag = () if loop == "supervised" else ("--loop", loop)  # supervised is the default
        proc = oxrl("new-plugin", name, *flag, "--dir", str(tmp_path), env=CLEAN)
        assert proc.returncode == 0, proc.stderr
        roots[name] = root = tmp_path / f"oxrl-{name}"
        for rel in ("pyproject.toml", "README.md", f"oxrl_{name}/__init__.py", f"oxrl_{name}/algorithm.py"):
            assert (root / rel).is_file(), rel
        assert (root / "tests" / f"test_{name}.py").is_file()
        assert str(root) in flat(proc.stdout)
        assert f'loop = "{loop}"' in (root / f"oxrl_{name}" / "algorithm.py").read_text()
        assert f"for the `{loop}` loop" in (root / "README.md").read_text()

    import setuptools  # noqa: F401  (the scaffold's build backend, used without build isolation; in the test extra)

    venv = tmp_path / "venv"
    py = layered_venv(venv)
    env = {**os.environ, **CLEAN}
    pip = subprocess.run(
        [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-input", "-q", *roots.values()],
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

    # The shared environment is untouched.
    assert not set(SCAFFOLDED) & names(plugins_json(CLEAN))

    # Listed, each with its package and version.
    proc = venv_oxrl("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    assert listing["errors"] == []
    for name in SCAFFOLDED:
        (row,) = [r for r in listing["plugins"] if r["name"] == name]
        assert (row["kind"], row["package"], row["version"]) == ("algorithm", f"oxrl-{name}", "0.1.0")
    assert BUILTIN_ALGS <= names(listing)

    # The installed copies (not the source tree) are what is found, and finding them imports no torch.
    probe = subprocess.run(
        [
            py,
            "-c",
            "import sys, oxrl_core.plugins as p; r = p.discover(); assert {'myalg', 'mypref', 'myrl'} <= "
            "set(r.names('algorithm')); import oxrl_myalg, oxrl_mypref, oxrl_myrl;"
            "print(oxrl_myalg.__file__, oxrl_mypref.__file__, oxrl_myrl.__file__); print('torch' in sys.modules)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    *locations, torch_loaded = probe.stdout.split()
    assert all(Path(location).is_relative_to(venv) for location in locations), locations
    assert torch_loaded == "False"

    # Each trains 3 steps on the tiny model: SFT rows, preference pairs, and RL on the built-in arith task (a
    # one-row held-out set keeps the evaluation short).
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": f"What is {i}+{i % 5}?", "chosen": str(i + i % 5), "rejected": str(i + i % 5 + 1)}
            for i in range(24)
        ],
    )
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "What is 2+3?", "answer": "5"}])
    data = {
        "myalg": ["--set", f"data.train={sft_jsonl}"],
        "mypref": ["--set", f"data.train={pairs}"],
        "myrl": ["--set", "data.train=arith", "--set", f"data.eval={held_out}", "--set", "train.batch_size=4",
                 "--set", "rollout.n=2", "--set", "rollout.max_new_tokens=16"],
    }  # fmt: skip
    for name, (loop, metric, _) in SCAFFOLDED.items():
        run_dir = tmp_path / f"run-{name}"
        proc = venv_oxrl(
            "run", "--alg", name, "--set", f"model.name={tiny_model_dir}", *data[name],
            "--set", "train.max_steps=3", "-o", str(run_dir),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        metrics = read_metrics(run_dir)
        assert [m["step"] for m in metrics] == [1, 2, 3], loop
        assert all(m["loss"] == m["loss"] for m in metrics), (loop, metrics)  # finite
        assert metric in metrics[0], (loop, metrics[0])  # the plugin's own metric reaches metrics.jsonl
        assert (run_dir / "final" / "config.json").is_file()
        assert any((run_dir / "final").glob("*.safetensors"))
    # the supervised loss is an NLL: positive
    assert all(m["loss"] > 0 for m in read_metrics(tmp_path / "run-myalg"))

    # The scaffolds' own tests pass against the installed packages (cwd is not the source tree).
    proc = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(root / "tests") for root in roots.values())],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{sum(n for _, _, n in SCAFFOLDED.values())} passed" in proc.stdout


# ---------------------------------------------------------------------------------------------
# 2. A plugin that raises on import
# ---------------------------------------------------------------------------------------------


def test_broken_plugin_is_reported_and_does_not_stop_the_cli(broken_site):
    env = env_with(broken_site)

    proc = oxrl("plugins", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    table = proc.stdout
    for name in (*BUILTIN_ALGS, "arith"):
        assert name in table, table
    report = flat(proc.stderr)
    for fragment in ("broken", "oxrl-broken", "0.1", "RuntimeError: boom"):
        assert fragment in report, report

    listing = plugins_json(env)
    assert BUILTIN_ALGS <= names(listing)
    assert "arith" in names(listing, "dataset")
    (error,) = listing["errors"]
    assert error == {"plugin": "broken", "package": "oxrl-broken", "version": "0.1", "error": "RuntimeError: boom"}

    proc = oxrl("doctor", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    report = flat(proc.stdout + proc.stderr)
    assert "broken" in report and "oxrl-broken" in report and "RuntimeError: boom" in report, report

    # Naming it is a hard, clear error.
    proc = oxrl("run", "--alg", "broken", env=env)
    assert_clean_failure(proc, "broken", "oxrl-broken", "RuntimeError: boom")

    # CI mode: any load error is fatal, and says which plugin.
    proc = oxrl("plugins", env=env_with(broken_site, OXRL_STRICT_PLUGINS="1"))
    assert_clean_failure(proc, "broken", "oxrl-broken", "RuntimeError: boom", "OXRL_STRICT_PLUGINS")
    proc = oxrl("plugins", env=env_with(broken_site, OXRL_STRICT_PLUGINS="0"))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_run_that_does_not_use_the_broken_plugin_succeeds(broken_site, tmp_path, tiny_model_dir, sft_jsonl):
    run_dir = tmp_path / "run"
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={sft_jsonl}",
        "--set",
        "train.max_steps=2",
        "-o",
        str(run_dir),
        env=env_with(broken_site),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "final" / "config.json").is_file()


# ---------------------------------------------------------------------------------------------
# 3. Misspelled hooks, registrations that point nowhere, registrations that are not Algorithms
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def odd_site(tmp_path) -> Path:
    site = tmp_path / "odd-site"
    make_dist(
        site,
        "oxrl-typo",
        "0.2",
        {
            "oxrl_typo/__init__.py": """
            from oxrl_core import hookimpl

            @hookimpl
            def register_algorithm(register):  # misspelled: the hook is register_algorithms
                register("typo", "oxrl_typo:Nothing")
            """
        },
        {"typo": "oxrl_typo"},
    )
    make_dist(
        site,
        "oxrl-x",
        "0.3",
        {
            "oxrl_x/__init__.py": """
            from oxrl_core import hookimpl

            @hookimpl
            def register_algorithms(register):
                register("nope", "oxrl_x.nope:Alg")  # there is no oxrl_x/nope.py
            """
        },
        {"nope": "oxrl_x"},
    )
    make_dist(
        site,
        "oxrl-notalg",
        "0.4",
        {
            "oxrl_notalg/__init__.py": """
            from oxrl_core import hookimpl


            class NotAnAlgorithm:
                name = "notalg"
                loop = "supervised"


            @hookimpl
            def register_algorithms(register):
                register("notalg", "oxrl_notalg:NotAnAlgorithm")
            """
        },
        {"notalg": "oxrl_notalg"},
    )
    return site


def test_misspelled_hook_is_a_load_error_that_stops_nothing(odd_site):
    listing = plugins_json(env_with(odd_site))
    errors = {e["plugin"]: e for e in listing["errors"]}
    assert set(errors) == {"typo"}, listing["errors"]
    assert errors["typo"]["package"] == "oxrl-typo" and errors["typo"]["version"] == "0.2"
    assert "PluginValidationError" in errors["typo"]["error"]
    assert "register_algorithm" in errors["typo"]["error"]
    algs = names(listing)
    assert "typo" not in algs
    assert BUILTIN_ALGS | {"nope", "notalg"} <= algs

    proc = oxrl("run", "--alg", "typo", env=env_with(odd_site))
    assert_clean_failure(proc, "typo", "oxrl-typo", "PluginValidationError")


def test_registration_of_a_missing_module_lists_but_fails_clearly_when_run(
    odd_site, tmp_path, tiny_model_dir, sft_jsonl
):
    (row,) = [r for r in plugins_json(env_with(odd_site))["plugins"] if r["name"] == "nope"]
    assert (row["package"], row["version"]) == ("oxrl-x", "0.3")
    proc = oxrl(
        "run",
        "--alg",
        "nope",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={sft_jsonl}",
        "--set",
        "train.max_steps=1",
        "-o",
        str(tmp_path / "run"),
        env=env_with(odd_site),
        timeout=300,
    )
    assert_clean_failure(proc, "nope", "oxrl-x", "oxrl_x.nope:Alg", "ModuleNotFoundError")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_registration_of_a_non_algorithm_fails_clearly_when_run(odd_site, tmp_path, tiny_model_dir, sft_jsonl):
    assert "notalg" in names(plugins_json(env_with(odd_site)))
    proc = oxrl(
        "run",
        "--alg",
        "notalg",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={sft_jsonl}",
        "--set",
        "train.max_steps=1",
        "-o",
        str(tmp_path / "run"),
        env=env_with(odd_site),
        timeout=300,
    )
    assert_clean_failure(
        proc, "notalg", "oxrl-notalg", "oxrl_notalg:NotAnAlgorithm", "not an oxrl_core.Algorithm subclass"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_one_module_behind_two_entry_points_is_not_an_error(tmp_path):
    """`a = pkg` and `b = pkg` (one entry point per name, one module) is a valid layout.

    pluggy refuses to register the same object twice; that must not surface as a load
    error (which OXRL_STRICT_PLUGINS would turn into a CI failure).
    """
    site = make_dist(
        tmp_path / "two-site",
        "oxrl-two",
        "0.5",
        {
            "oxrl_two/__init__.py": """
            from oxrl_core import hookimpl

            @hookimpl
            def register_algorithms(register):
                register("twoalg", "oxrl_two.alg:TwoAlg")

            @hookimpl
            def register_rewards(register):
                register("tworew", "oxrl_two.reward:TwoReward")
            """
        },
        {"twoalg": "oxrl_two", "tworew": "oxrl_two"},
    )
    listing = plugins_json(env_with(site, OXRL_STRICT_PLUGINS="1"))
    assert listing["errors"] == []
    rows = {(r["kind"], r["name"]): r for r in listing["plugins"]}
    assert rows[("algorithm", "twoalg")]["package"] == "oxrl-two"
    assert rows[("reward", "tworew")]["package"] == "oxrl-two"


# ---------------------------------------------------------------------------------------------
# 4-6. Allow-list, unknown names, lazy discovery
# ---------------------------------------------------------------------------------------------


def test_allow_list_by_entry_point_name(broken_site):
    # The broken plugin is on the path but not allowed: it is not even imported, so no error.
    listing = plugins_json(env_with(broken_site, OXRL_PLUGINS="sft,arith"))
    # `arith` names two entry points: the core's dataset and oxrl-rewards' reward.
    expected = {("algorithm", "sft"), ("dataset", "arith"), ("reward", "arith")}
    assert {(r["kind"], r["name"]) for r in listing["plugins"]} == expected
    assert listing["errors"] == []

    proc = oxrl("plugins", env=env_with(OXRL_PLUGINS=" sft , arith "))
    assert proc.returncode == 0, proc.stderr
    assert "sft" in proc.stdout and "arith" in proc.stdout
    assert "cpt" not in proc.stdout and "kd" not in proc.stdout


def test_allow_list_by_package_name():
    listing = plugins_json(env_with(OXRL_PLUGINS="oxrl-algs-supervised"))
    assert {(r["kind"], r["name"]) for r in listing["plugins"]} == {("algorithm", n) for n in BUILTIN_ALGS}


def test_unknown_algorithm_suggests_the_close_name():
    proc = oxrl("run", "--alg", "sfft", env=CLEAN)
    text = assert_clean_failure(proc, "sfft", "Did you mean 'sft'")
    assert "unknown algorithm" in text.lower()

    proc = oxrl("run", "--alg", "zzzzzz", env=CLEAN)
    text = assert_clean_failure(proc, "zzzzzz")
    assert "did you mean" not in text.lower()
    assert all(name in text for name in BUILTIN_ALGS)  # lists what is installed instead


def test_discovery_and_plugins_command_do_not_import_torch(broken_site):
    code = textwrap.dedent(
        """
        import sys
        import oxrl_core.cli, oxrl_core.plugins
        registry = oxrl_core.plugins.discover()
        assert {"sft", "cpt", "kd"} <= set(registry.names("algorithm")), registry.names("algorithm")
        assert [e.plugin for e in registry.errors] == ["broken"], registry.errors
        assert "torch" not in sys.modules, "discover() imported torch"
        sys.argv = ["oxrl", "plugins", "--json"]
        try:
            oxrl_core.cli.app()
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        assert "torch" not in sys.modules, "`oxrl plugins` imported torch"
        print("LIGHT")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env_with(broken_site)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("LIGHT")


def test_help_works():
    proc = oxrl("--help", env=CLEAN)
    assert proc.returncode == 0, proc.stderr
    for command in ("run", "plugins", "doctor", "new-plugin"):
        assert command in proc.stdout


# ---------------------------------------------------------------------------------------------
# 7. In process: extra plugins, objects registered directly, duplicate names
# ---------------------------------------------------------------------------------------------


def test_in_process_plugin_registering_a_class_and_a_duplicate(monkeypatch):
    from oxrl_algs_supervised.sft import SFT
    from oxrl_core import Algorithm, hookimpl
    from oxrl_core.errors import PluginError
    from oxrl_core.plugins import discover
    from oxrl_core.trainer import load_algorithm

    monkeypatch.delenv("OXRL_PLUGINS", raising=False)
    monkeypatch.delenv("OXRL_STRICT_PLUGINS", raising=False)

    class Direct(SFT):
        name = "direct"

    assert issubclass(Direct, Algorithm)

    class Mine:
        @hookimpl
        def register_algorithms(self, register):
            register("direct", Direct)  # the class itself, not an import path
            register("sft", Direct)  # already taken by oxrl-algs-supervised

    class Second:
        @hookimpl
        def register_algorithms(self, register):
            register("direct", SFT)  # already taken by the first in-process plugin

    registry = discover(extra_plugins={"mine": Mine(), "second": Second()})

    # A name two plugins register is ambiguous (neither wins by discovery order): a lookup says who has it
    # and how to choose; `package:name` or `entry-point:name` picks one (issue 15, item 15).
    for name, who in (("sft", "oxrl-algs-supervised"), ("direct", "(in-process)")):
        with pytest.raises(PluginError, match=f"algorithm '{name}' is registered by 2 packages: .*{who}.*OXRL_PLUGINS"):
            registry.get("algorithm", name)
    assert registry.load("algorithm", "mine:direct") is Direct and registry.load("algorithm", "second:direct") is SFT
    assert load_algorithm("mine:direct", registry) is Direct
    rows = [r for r in registry.rows() if r["name"] == "direct"]
    assert [(r["plugin"], r["package"], r["ambiguous"]) for r in rows] == [
        ("mine", "(in-process)", True),
        ("second", "(in-process)", True),
    ]

    assert registry.get("algorithm", "oxrl-algs-supervised:sft").package == "oxrl-algs-supervised"
    assert registry.get("algorithm", "oxrl_algs_supervised:sft").package == "oxrl-algs-supervised"  # pip's name rules
    assert (
        load_algorithm("oxrl-algs-supervised:sft", registry) is SFT and load_algorithm("mine:sft", registry) is Direct
    )
    assert {(c["kind"], c["name"]) for c in registry.clash_rows()} == {("algorithm", "sft"), ("algorithm", "direct")}
    assert registry.errors == [], registry.errors  # a clash is not a load error: both plugins loaded


def test_in_process_misspelled_hook_and_bad_register_call(monkeypatch):
    from oxrl_core import hookimpl
    from oxrl_core.errors import PluginError
    from oxrl_core.plugins import discover

    monkeypatch.delenv("OXRL_PLUGINS", raising=False)
    monkeypatch.delenv("OXRL_STRICT_PLUGINS", raising=False)

    class Typo:
        @hookimpl
        def register_algorithm(self, register):
            register("typo", "nowhere:Nothing")

    class NoName:
        @hookimpl
        def register_algorithms(self, register):
            register("", "nowhere:Nothing")

    class Fine:
        @hookimpl
        def register_algorithms(self, register):
            register("fine", "nowhere:Nothing")

    registry = discover(extra_plugins={"typo": Typo(), "noname": NoName(), "fine": Fine()})
    errors = {e.plugin: e.error for e in registry.errors}
    assert set(errors) == {"typo", "noname"}, errors
    assert "PluginValidationError" in errors["typo"] and "register_algorithm" in errors["typo"]
    assert "non-empty name" in errors["noname"]
    assert "fine" in registry.names("algorithm") and BUILTIN_ALGS <= set(registry.names("algorithm"))
    assert "typo" not in registry.names("algorithm")
    # A later plugin is not blamed for the earlier one's misspelling.
    assert registry.manager.get_plugin("(in-process):typo") is None

    with pytest.raises(PluginError, match="typo.*failed to load.*PluginValidationError"):
        registry.get("algorithm", "typo")
    with pytest.raises(PluginError, match="ModuleNotFoundError"):
        registry.load("algorithm", "fine")

    monkeypatch.setenv("OXRL_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="typo"):
        discover(extra_plugins={"typo": Typo()})


# ---------------------------------------------------------------------------------------------
# 8. `oxrl new-plugin` input checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["My-Alg", "my-alg", "1alg", "class", "MyAlg"])
def test_new_plugin_rejects_bad_names(tmp_path, bad):
    proc = oxrl("new-plugin", bad, "--dir", str(tmp_path), env=CLEAN)
    assert_clean_failure(proc, repr(bad), "lower-case")
    assert list(tmp_path.iterdir()) == []  # nothing half-created


@pytest.mark.parametrize("loop", ["supervised", "preference", "rl"])
def test_new_plugin_writes_the_algorithm_of_its_loop(tmp_path, loop):
    proc = oxrl("new-plugin", "my_alg", "--loop", loop, "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 0, proc.stderr
    assert "oxrl run --alg my_alg --set train.max_steps=20" in proc.stdout
    root = tmp_path / "oxrl-my_alg"
    algorithm = (root / "oxrl_my_alg" / "algorithm.py").read_text()
    assert "class MyAlg(" in algorithm and f'loop = "{loop}"' in algorithm
    assert f"for the `{loop}` loop" in (root / "README.md").read_text()
    for path in root.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--loop", "ppo"], "error: --loop 'ppo': expected one of supervised, preference, rl"),
        (["--loop", "RL"], "error: --loop 'RL': expected one of supervised, preference, rl"),
        (["--loop", ""], "error: --loop '': expected one of supervised, preference, rl"),
        # an explicit loop with another kind is refused even when it is the default one
        (
            ["--kind", "environment", "--loop", "supervised"],
            "error: --loop applies only to --kind algorithm, not --kind environment",
        ),
    ],
)
def test_new_plugin_rejects_a_bad_loop_in_one_line(tmp_path, args, message):
    proc = oxrl("new-plugin", "my_alg", *args, "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert flat(proc.stderr) == message
    assert list(tmp_path.iterdir()) == []  # nothing half-created


def test_new_plugin_refuses_to_overwrite(tmp_path):
    proc = oxrl("new-plugin", "my_alg", "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "oxrl-my_alg"
    init = root / "oxrl_my_alg" / "__init__.py"
    assert 'register("my_alg", "oxrl_my_alg.algorithm:MyAlg")' in init.read_text()
    init.write_text("# my edits\n")

    proc = oxrl("new-plugin", "my_alg", "--dir", str(tmp_path), env=CLEAN)
    assert_clean_failure(proc, "already exists")
    assert init.read_text() == "# my edits\n"


# ---------------------------------------------------------------------------------------------
# The README's example plugin, exactly as printed there
# ---------------------------------------------------------------------------------------------


def _readme_plugin_blocks() -> tuple[dict[str, str], dict[str, str]]:
    """The README's example plugin: its files (each ```python block headed ``# oxrl_myalg/...``) and its
    entry points (the ```toml block)."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Writing and publishing a plugin", 1)[1].split("\n## ", 1)[0]
    files, entry_points = {}, {}
    for lang, body in re.findall(r"```(python|toml)\n(.*?)```", section, flags=re.S):
        first = body.splitlines()[0]
        if lang == "python" and first.startswith("# oxrl_myalg/"):
            files[first[2:].split(" ")[0]] = body
        elif lang == "toml" and "[project.entry-points.oxrl]" in body:
            entry_points.update(re.findall(r'^(\w+) = "([\w.]+)"$', body, flags=re.M))
    return files, entry_points


def test_the_readme_example_plugin_installs_lists_and_trains(tmp_path, tiny_model_dir, sft_jsonl):
    """The README's example plugin, unchanged, is a distribution `oxrl plugins` lists and `oxrl run` trains
    with; and the same plugin written in the old vocabulary (``family`` instead of ``loop``) still trains,
    with a deprecation note naming ``loop``."""
    files, entry_points = _readme_plugin_blocks()
    assert set(files) == {"oxrl_myalg/__init__.py", "oxrl_myalg/algorithm.py"} and entry_points == {
        "myalg": "oxrl_myalg"
    }
    site = make_dist(tmp_path / "site", "oxrl-myalg", "0.1.0", files, entry_points)
    (row,) = [r for r in plugins_json(env_with(site))["plugins"] if r["name"] == "myalg"]
    assert (row["kind"], row["package"]) == ("algorithm", "oxrl-myalg")
    old = {
        **files,
        "oxrl_myalg/algorithm.py": files["oxrl_myalg/algorithm.py"].replace(
            'loop = "supervised"', 'family = "supervised"'
        ),
    }
    assert old != files
    old_site = make_dist(tmp_path / "old", "oxrl-myalg", "0.1.0", old, entry_points)
    for where, site_dir in (("new", site), ("old", old_site)):
        run_dir = tmp_path / f"run-{where}"
        proc = oxrl("run", "--alg", "myalg", "--set", f"model.name={tiny_model_dir}", "--set", f"data.train={sft_jsonl}",
                    "--set", "train.max_steps=2", "--set", "alg.my_coeff=0.5", "-o", str(run_dir), env=env_with(site_dir))  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        records = read_metrics(run_dir)
        assert [m["step"] for m in records] == [1, 2]
        # the loss is (1 + my_coeff) × the NLL it logs: the plugin's own loss and its alg: option were used
        assert records[0]["loss"] == pytest.approx(1.5 * records[0]["loss/nll"], rel=1e-5)
        assert ("deprecated" in flat(proc.stdout + proc.stderr)) == (where == "old")
        if where == "old":
            assert "loop" in flat(proc.stdout + proc.stderr)


def test_the_layered_venv_sees_this_environments_packages_not_the_base_interpreters(tmp_path):
    """The throw-away venv the install tests use exposes the packages of the environment running the suite
    (a virtualenv's, when the suite runs in one), after its own site-packages; never the base interpreter's."""
    import ast
    import site

    py = layered_venv(tmp_path / "venv")
    probe = "import sys, sysconfig, pytest; print(sysconfig.get_paths()['purelib']); print(pytest.__file__); print(sys.path)"
    own, pytest_file, path = subprocess.run(
        [py, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    here = [p for p in site.getsitepackages() if Path(p).is_dir()]
    assert any(Path(pytest_file).is_relative_to(p) for p in here), (pytest_file, here)
    sys_path = ast.literal_eval(path)
    assert sys_path.index(own) < min(sys_path.index(p) for p in here if p in sys_path)
