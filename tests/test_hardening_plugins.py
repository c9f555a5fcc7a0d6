"""Hardening, plugins and rewards (issue 15, items 15-17), through the real `oxrl` CLI where a user meets them.

15. Two packages registering one name: both named by `oxrl plugins` (table and --json); a run refuses the
    ambiguous name and says how to choose (``OXRL_PLUGINS`` or ``package:name``); `oxrl new-plugin` warns.
16. A plugin class that breaks its interface (no ``loss``, no ``family``, RL without ``advantages``, a
    ``Config`` that is not a StrictModel, ...) is refused when the run starts, before any model loads.
17. A reward that fails on every row: one summary line per step (not one per row), ``reward/error_share``,
    and the run stops after ``rollout.reward_error_steps`` steps over ``rollout.max_reward_error_share``,
    naming the reward, the exception, a sample row and the newest complete checkpoint.

Fake third-party packages are a package plus a hand-written ``*.dist-info`` (METADATA + entry_points.txt) in a
directory put on PYTHONPATH for the subprocess, as tests/test_plugins.py does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import oxrl, read_metrics, write_jsonl
from test_plugins import make_dist

CLEAN = {"OXRL_PLUGINS": "", "OXRL_STRICT_PLUGINS": "", "PYTHONPATH": "", "COLUMNS": "200"}


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_user_error(proc, *fragments: str) -> str:
    """Exit 2, every fragment in the (whitespace-collapsed) output, no traceback."""
    text = flat(proc.stdout + proc.stderr)
    assert proc.returncode == 2, text
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in: {text}"
    return text


# ---------------------------------------------------------------------------------------------
# 17. A reward that fails on every row
# ---------------------------------------------------------------------------------------------

TYPO_REWARD = """
from oxrl_core import Reward

class Typo(Reward):
    name = "typo"

    def score(self, prompts, completions, examples):
        return [float(ex["answr"] in c) for c, ex in zip(completions, examples)]  # the field is 'answer'
"""


def _rl(tmp_path, model_dir, *args):
    return oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={model_dir}",
        "--set",
        "train.batch_size=4",
        "--set",
        "rollout.n=2",
        "--set",
        "rollout.max_new_tokens=4",
        "--set",
        "train.eval_every=0",
        *args,
        cwd=tmp_path,
        env=CLEAN,
    )


def _failure_lines(stderr: str, prefix: str = "") -> list[str]:
    return [line for line in stderr.splitlines() if "failed on row" in line and line.startswith(prefix)]


def test_reward_failing_on_every_row_stops_the_run_naming_reward_exception_row_and_checkpoint(tmp_path, tiny_model_dir):
    from oxrl_core.run_io.checkpoint import latest_checkpoint

    (tmp_path / "typo.py").write_text(TYPO_REWARD)
    run = tmp_path / "run"
    proc = _rl(
        tmp_path,
        tiny_model_dir,
        "--set",
        f"reward.name={tmp_path / 'typo.py'}:Typo",
        "--set",
        "train.max_steps=8",
        "--set",
        "train.save_every=1",
        "-o",
        str(run),
    )
    last = latest_checkpoint(run)
    assert last is not None, proc.stderr  # the checkpoints of the steps before the stop are kept
    text = assert_user_error(
        proc,
        "step 3: reward 'typo' failed on 8 of 8 samples (100%)",
        "KeyError: 'answr'",
        "row ",
        "(prompt '",
        "rollout.max_reward_error_share=0.5",
        "each of the last 3 steps",
        f"last complete checkpoint: {last}",
        "--resume",
    )
    assert "done" not in text and not (run / "final").exists()
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]  # step 3 stopped before training on zero rewards
    assert all(m["reward/error_share"] == 1.0 and m["reward/errors"] == 8.0 for m in metrics)
    # one summary line per step scored, not one per sample (8 a step here, ~1,000 in a real run)
    assert len(_failure_lines(proc.stderr, "step ")) == 3, proc.stderr


@pytest.mark.slow
def test_reward_error_stop_can_be_switched_off_and_still_logs_one_line_per_step(tmp_path, tiny_model_dir):
    (tmp_path / "typo.py").write_text(TYPO_REWARD)
    run = tmp_path / "run"
    proc = _rl(
        tmp_path,
        tiny_model_dir,
        "--set",
        f"reward.name={tmp_path / 'typo.py'}:Typo",
        "--set",
        "train.max_steps=2",
        "--set",
        "rollout.reward_error_steps=0",
        "-q",
        "-o",
        str(run),
    )
    assert proc.returncode == 0, proc.stderr
    assert [m["reward/error_share"] for m in read_metrics(run)] == [1.0, 1.0]
    assert len(_failure_lines(proc.stderr, "step ")) == 2, proc.stderr


def test_reward_watch_counts_consecutive_steps_and_its_off_switches(tmp_path):
    from oxrl_core.errors import OxrlError
    from oxrl_core.scoring.rewards import Failures, RewardWatch

    def step(errors: int, rows: int = 10) -> Failures:
        failures = Failures("r", samples=rows, errors=errors)
        if errors:
            failures.note(4, [{"role": "user", "content": "What is 2+2? " * 20}], "KeyError: 'answr'")
        return failures

    watch = RewardWatch(0.5, 3)
    for errors in (10, 6, 5, 10, 10):  # 5 of 10 is not above 0.5: the streak starts again
        watch.after_scoring(1, step(errors), tmp_path)
    with pytest.raises(OxrlError) as info:
        watch.after_scoring(6, step(7), tmp_path)
    message = str(info.value)
    assert "step 6: reward 'r' failed on 7 of 10 samples (70%)" in message and "no checkpoint was saved yet" in message
    assert "row 4 (prompt 'What is 2+2? What is" in message and "…'" in message and "KeyError: 'answr'" in message

    for watch in (RewardWatch(0.5, 0), RewardWatch(1.0, 1)):  # off: 0 steps, or a share that cannot be exceeded
        for _ in range(5):
            watch.after_scoring(1, step(10), tmp_path)
    with pytest.raises(OxrlError, match="in this step"):
        RewardWatch(0.0, 1).after_scoring(1, step(1), tmp_path)  # 0: any failure stops at once


def test_reward_error_keys_are_validated():
    from pydantic import ValidationError

    from oxrl_core.config import RunConfig

    cfg = RunConfig.model_validate({"algorithm": "sgrpo"})
    assert (cfg.rollout.max_reward_error_share, cfg.rollout.reward_error_steps) == (0.5, 3)
    for bad in ({"max_reward_error_share": 1.5}, {"max_reward_error_share": -0.1}, {"reward_error_steps": -1}):
        with pytest.raises(ValidationError):
            RunConfig.model_validate({"algorithm": "sgrpo", "rollout": bad})


def test_score_summarises_failures_in_one_line(tmp_path):
    """`oxrl score` on 300 rows (two chunks) that all fail: one summary line, and every row's error in the output."""
    (tmp_path / "typo.py").write_text(TYPO_REWARD)
    data = write_jsonl(
        tmp_path / "rows.jsonl", [{"prompt": f"q{i}", "completion": "4", "answer": "4"} for i in range(300)]
    )
    proc = oxrl(
        "score",
        "--reward",
        f"{tmp_path / 'typo.py'}:Typo",
        "--data",
        str(data),
        "-o",
        str(tmp_path / "out.jsonl"),
        env=CLEAN,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = _failure_lines(proc.stderr)
    assert "failed on row 1: KeyError: 'answr' (prompt 'q0')" in line and "300 of 300 samples failed (100%" in line
    out = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 300 and all(r["error"] == "KeyError: 'answr'" for r in out)


def test_score_batch_logs_one_line_per_call(caplog):
    """Everything that scores without a step (eval, a run's held-out eval) gets one line per call too."""
    from oxrl_core.scoring.rewards import Failures, score_batch

    class Typo:
        name, timeout_s = "typo", 5.0

        def score(self, prompts, completions, examples):
            return [float(ex["answr"] in c) for c, ex in zip(completions, examples)]

    rows = [{"answer": "4"}] * 50
    with caplog.at_level(logging.WARNING, logger="oxrl.rewards"):
        scores, metrics = score_batch(Typo(), ["q"] * 50, ["4"] * 50, rows)
    assert scores == [0.0] * 50 and metrics["reward/error_share"] == 1.0
    assert (
        len(caplog.records) == 1 and "50 of 50 samples failed" in caplog.text and "rows 1, 2, 3, 4, 5, …" in caplog.text
    )
    caplog.clear()
    failures = Failures("typo")
    with caplog.at_level(logging.WARNING, logger="oxrl.rewards"):
        score_batch(Typo(), ["q"] * 50, ["4"] * 50, rows, failures)
    assert not caplog.records and (failures.samples, failures.errors, failures.first_row) == (50, 50, 1)


# ---------------------------------------------------------------------------------------------
# 15. Two packages registering one name
# ---------------------------------------------------------------------------------------------

# oxrl-evil 0.1 registers the built-in names `sft` (algorithm) and `arith` (dataset); its entry point sorts
# before every built-in one, which is how it used to win silently.
EVIL_FILES = {
    "oxrl_evil/__init__.py": """
        from oxrl_core import hookimpl


        @hookimpl
        def register_algorithms(register):
            register("sft", "oxrl_evil.alg:EvilSFT")


        @hookimpl
        def register_datasets(register):
            register("arith", "oxrl_evil.alg:EvilArith")
    """,
    "oxrl_evil/alg.py": """
        from oxrl_algs_supervised.sft import SFT
        from oxrl_core.data.task import ArithDataset


        class EvilSFT(SFT):
            def loss(self, batch):
                raise RuntimeError("the third-party sft ran")


        class EvilArith(ArithDataset):
            def rows(self, split):
                raise RuntimeError("the third-party arith ran")
    """,
}


@pytest.fixture(scope="module")
def evil_site(tmp_path_factory) -> Path:
    return make_dist(
        tmp_path_factory.mktemp("evil") / "site", "oxrl-evil", "0.1", EVIL_FILES, {"aaa_evil": "oxrl_evil"}
    )


def test_name_clash_is_listed_with_both_packages_not_as_a_load_failure(evil_site):
    env = {**CLEAN, "PYTHONPATH": str(evil_site)}
    proc = oxrl("plugins", "--json", env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    listing = json.loads(proc.stdout)
    assert listing["errors"] == []  # the built-in package is not "failed to load ... ignored"
    clashes = {(c["kind"], c["name"]): c for c in listing["clashes"]}
    assert set(clashes) == {("algorithm", "sft"), ("dataset", "arith")}
    assert clashes["algorithm", "sft"]["packages"] == ["oxrl-evil", "oxrl-algs-supervised"]
    assert clashes["algorithm", "sft"]["choose"] == ["oxrl-evil:sft", "oxrl-algs-supervised:sft"]
    sft_rows = [
        (r["package"], r["ambiguous"]) for r in listing["plugins"] if r["kind"] == "algorithm" and r["name"] == "sft"
    ]
    assert sft_rows == [("oxrl-evil", True), ("oxrl-algs-supervised", True)]

    table = oxrl("plugins", env=env)
    assert table.returncode == 0 and "failed to load" not in table.stderr, table.stderr
    text = flat(table.stdout + table.stderr)
    assert "sft (ambiguous)" in text
    assert "name clash: algorithm 'sft' is registered by 2 packages: oxrl-evil 0.1 (entry point 'aaa_evil'" in text
    assert "'oxrl-algs-supervised:sft'" in text and "OXRL_PLUGINS" in text


def test_run_refuses_an_ambiguous_name_naming_both_packages_and_how_to_choose(evil_site, tmp_path, tiny_model_dir):
    env = {**CLEAN, "PYTHONPATH": str(evil_site)}
    run = tmp_path / "run"
    proc = oxrl("run", "--alg", "sft", "--set", f"model.name={tiny_model_dir}", "-o", str(run), cwd=tmp_path, env=env)
    assert_user_error(
        proc,
        "algorithm 'sft' is registered by 2 packages: oxrl-evil 0.1",
        "oxrl-algs-supervised",
        "--alg 'oxrl-evil:sft' or 'oxrl-algs-supervised:sft'",
        "OXRL_PLUGINS",
    )
    assert not run.exists()  # refused before the run directory (and any model)

    # the algorithm chosen; the default data set is ambiguous too, and is refused naming its own field
    proc = oxrl(
        "run",
        "--alg",
        "oxrl-algs-supervised:sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "-o",
        str(run),
        cwd=tmp_path,
        env=env,
    )
    assert_user_error(
        proc, "dataset 'arith' is registered by 2 packages", "data.train 'oxrl-evil:arith' or 'oxrl:arith'"
    )
    assert not run.exists()


def test_package_name_form_runs_the_chosen_packages_algorithm_and_data(evil_site, tmp_path, tiny_model_dir):
    env = {**CLEAN, "PYTHONPATH": str(evil_site)}
    run = tmp_path / "run"
    held_out = write_jsonl(
        tmp_path / "eval.jsonl", [{"prompt": f"What is {a}+1?", "response": str(a + 1)} for a in range(4)]
    )
    proc = oxrl(
        "run",
        "--alg",
        "oxrl-algs-supervised:sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "data.train=oxrl:arith",
        "--set",
        f"data.eval={held_out}",
        "--set",
        "train.max_steps=2",
        "-q",
        "-o",
        str(run),
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr  # the built-in loss and data ran (the third party's raise)
    assert "third-party" not in proc.stderr and (run / "final").is_dir() and len(read_metrics(run)) == 2


def test_allow_list_and_entry_point_names_resolve_a_clash_in_process(evil_site, monkeypatch):
    from oxrl_core.errors import PluginError
    from oxrl_core.plugins import discover
    from oxrl_core.trainer import load_algorithm

    monkeypatch.syspath_prepend(str(evil_site))
    monkeypatch.setenv("OXRL_STRICT_PLUGINS", "")
    monkeypatch.setenv("OXRL_PLUGINS", "")
    registry = discover()
    with pytest.raises(PluginError, match="registered by 2 packages"):
        load_algorithm("sft", registry)
    assert load_algorithm("aaa_evil:sft", registry).__name__ == "EvilSFT"  # an entry-point name picks too
    assert load_algorithm("oxrl-algs-supervised:sft", registry).__name__ == "SFT"
    assert registry.has("dataset", "oxrl:arith") and not registry.has("dataset", "oxrl-nope:arith")
    with pytest.raises(PluginError, match="unknown algorithm 'oxrl-nope:sft'|ModuleNotFoundError"):
        load_algorithm("oxrl-nope:sft", registry)  # neither a package's registration nor an importable path

    monkeypatch.setenv("OXRL_PLUGINS", "oxrl-algs-supervised,oxrl")  # the allow-list: oxrl-evil is not loaded
    registry = discover()
    assert registry.clash_rows() == [] and load_algorithm("sft", registry).__name__ == "SFT"


def test_new_plugin_warns_that_the_name_is_taken_and_suggests_a_free_one(tmp_path):
    proc = oxrl("new-plugin", "dpo", "--dir", str(tmp_path), env=CLEAN)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    text = flat(proc.stderr)
    assert "warning: algorithm 'dpo' is already registered by oxrl-algs-preference" in text
    assert "--alg oxrl-dpo:dpo" in text and "oxrl new-plugin my_dpo" in text
    assert "oxrl run --alg oxrl-dpo:dpo" in proc.stdout and (tmp_path / "oxrl-dpo").is_dir()
    free = oxrl("new-plugin", "zzfree", "--dir", str(tmp_path), env=CLEAN)
    assert free.returncode == 0 and "warning" not in free.stderr and "--alg zzfree " in free.stdout


# ---------------------------------------------------------------------------------------------
# 16. A plugin class that breaks its interface
# ---------------------------------------------------------------------------------------------

BROKEN_CLASSES = """
from pydantic import BaseModel

from oxrl_core import Algorithm, Reward
from oxrl_core.interfaces import Dataset


class NoLoss(Algorithm):
    name, family, data_format = "no_loss", "supervised", "prompt_response"


class NoFamily(Algorithm):
    name, data_format = "no_family", "prompt_response"

    def loss(self, batch):
        return batch["logp"].sum(), {}


class NoAdvantages(Algorithm):
    name, family, data_format, needs_rollouts = "no_adv", "rl", "prompt", True

    def loss(self, batch):
        return batch["logp"].sum(), {}


class WrongTypes(Algorithm):
    name, family, data_format, needs_ref, head = "wrong", "reinforce", "prompt", "yes", "lm"

    class Config(BaseModel):
        beta: float = 0.1

    def loss(self, batch):
        return batch["logp"].sum(), {}


class NotAnAlgorithm:
    name = "plain"


class NoScore(Reward):
    name = "no_score"
    timeout_s = 0


class NoRows(Dataset):
    name, formats = "no_rows", ("prompt", "tweets")
"""


@pytest.mark.parametrize(
    ("cls", "fragments"),
    [
        ("NoLoss", ["it does not define loss()"]),
        ("NoFamily", ["it has no `loop` (one of 'supervised', 'preference', 'rl')"]),
        ("NoAdvantages", ["needs_rollouts = True but it does not define advantages()"]),
        (
            "WrongTypes",
            [
                "family = 'reinforce' must be one of",
                "needs_ref = 'yes' must be one of True, False",
                "Config = <class",
                "must be a subclass of oxrl_core.interfaces.StrictModel",
            ],
        ),
        ("NotAnAlgorithm", ["is not an oxrl_core.Algorithm subclass"]),
    ],
)
def test_broken_algorithm_classes_are_refused_with_what_is_missing(tmp_path, cls, fragments):
    from oxrl_core.errors import PluginError
    from oxrl_core.plugins import discover
    from oxrl_core.trainer import load_algorithm

    (tmp_path / "broken.py").write_text(BROKEN_CLASSES)
    with pytest.raises(PluginError) as info:
        load_algorithm(f"{tmp_path / 'broken.py'}:{cls}", discover())
    for fragment in [f"algorithm '{tmp_path / 'broken.py'}:{cls}'", *fragments]:
        assert fragment in str(info.value), str(info.value)


def test_broken_reward_and_dataset_classes_are_refused(tmp_path):
    from oxrl_core.errors import PluginError
    from oxrl_core.plugins import discover

    (tmp_path / "broken.py").write_text(BROKEN_CLASSES)
    registry = discover()
    with pytest.raises(
        PluginError, match=r"breaks the oxrl_core.Reward interface: it does not define score\(\); timeout_s = 0"
    ):
        registry.load_checked("reward", f"{tmp_path / 'broken.py'}:NoScore")
    with pytest.raises(PluginError, match=r"it does not define rows\(\); formats = \('prompt', 'tweets'\) must be"):
        registry.load_checked("dataset", f"{tmp_path / 'broken.py'}:NoRows")


def test_every_installed_plugin_keeps_its_interface():
    """The contract is what the shipped plugins already do: checking it refuses none of them."""
    from oxrl_core.plugins import discover

    registry = discover()
    for kind in registry.entries:
        for name in registry.names(kind):
            registry.load_checked(kind, name)


def test_plugin_without_advantages_is_refused_before_any_model_loads(tmp_path, tiny_model_dir):
    """Through the CLI, from an installed package: the message names the package; no run directory is made
    (it used to fail only after the models loaded and the first rollout ran)."""
    site = make_dist(
        tmp_path / "site",
        "oxrl-halfdone",
        "0.3",
        {
            "oxrl_halfdone/__init__.py": """
            from oxrl_core import hookimpl


            @hookimpl
            def register_algorithms(register):
                register("halfdone", "oxrl_halfdone.alg:NoAdvantages")
        """,
            "oxrl_halfdone/alg.py": BROKEN_CLASSES,
        },
        {"halfdone": "oxrl_halfdone"},
    )
    run = tmp_path / "run"
    proc = oxrl(
        "run",
        "--alg",
        "halfdone",
        "--set",
        f"model.name={tiny_model_dir}",
        "-o",
        str(run),
        cwd=tmp_path,
        env={**CLEAN, "PYTHONPATH": str(site)},
    )
    assert_user_error(
        proc,
        "algorithm 'halfdone' from oxrl-halfdone 0.3 (entry point 'halfdone', target "
        "'oxrl_halfdone.alg:NoAdvantages') breaks the oxrl_core.Algorithm interface",
        "does not define advantages()",
        "Fix the class oxrl_halfdone.alg.NoAdvantages",
    )
    assert not run.exists()
