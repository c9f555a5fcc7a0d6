"""One config vocabulary: renamed keys (train.save_every / eval_every / log_every, rollout.passes_per_batch, the
rollout backend's options flat under rollout:) and `Algorithm.loop`, with the old names still read, each with a
one-line note naming the new one; both names at once is an error naming both; an older run's config.yaml with the
old names resumes and is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import oxrl

from oxrl_core.config import RENAMED_KEYS, RolloutConfig, TrainConfig, dump_yaml, load_run_config
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Algorithm
from oxrl_core.plugins import deprecation_note

#: old dotted key -> (new dotted key, a valid value)
RENAMED = {
    "train.save_steps": ("train.save_every", 7),
    "train.eval_steps": ("train.eval_every", 5),
    "train.log_steps": ("train.log_every", 3),
    "rollout.epochs": ("rollout.passes_per_batch", 2),
}


def nested(dotted: str, value) -> dict:
    section, key = dotted.split(".")
    return {section: {key: value}}


def field(config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def test_the_table_holds_every_renamed_key():
    assert {old: new for old, (new, _) in RENAMED.items()}.items() <= RENAMED_KEYS.items()


@pytest.mark.parametrize("old", RENAMED)
def test_an_old_key_in_a_yaml_file_lands_in_the_new_field_with_a_note(tmp_path, old):
    new, value = RENAMED[old]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(nested(old, value)))
    config = load_run_config(path, algorithm="sgrpo")
    assert field(config, new) == value
    assert config.notes == [f"{old} is deprecated; use {new}"]
    saved = yaml.safe_load(dump_yaml(config))  # config.yaml is written with the new names
    section, key = new.split(".")
    assert saved[section][key] == value and old.split(".")[1] not in saved[section]


@pytest.mark.parametrize("old", RENAMED)
def test_an_old_key_via_set_lands_in_the_new_field_with_a_note(old):
    new, value = RENAMED[old]
    config = load_run_config(overrides=[f"{old}={value}", f"{old}={value}"], algorithm="sgrpo")
    assert field(config, new) == value
    assert config.notes == [f"{old} is deprecated; use {new}"]  # once per key, however often it is given


@pytest.mark.parametrize("old", RENAMED)
def test_an_old_key_read_from_a_saved_config_base(old):
    new, value = RENAMED[old]
    config = load_run_config(base=nested(old, value), algorithm="sgrpo", overrides=["train.lr=1e-4"])
    assert field(config, new) == value and config.notes == [f"{old} is deprecated; use {new}"]
    # a --set of the new name over a saved config with the old one: the override wins, as any --set does
    config = load_run_config(base=nested(old, value), algorithm="sgrpo", overrides=[f"{new}={value + 1}"])
    assert field(config, new) == value + 1


@pytest.mark.parametrize("old", RENAMED)
def test_old_and_new_names_both_given_is_an_error_naming_both(tmp_path, old):
    new, value = RENAMED[old]
    section, key = new.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: {old.split(".")[1]: value, key: value}}))
    with pytest.raises(OxrlError, match=rf"{old} and {new} are both set.*keep only {new}") as exc:
        load_run_config(path, algorithm="sgrpo")
    assert str(path) in str(exc.value)
    with pytest.raises(OxrlError, match=rf"{old} and {new} are both set"):
        load_run_config(overrides=[f"{new}={value}", f"{old}={value}"], algorithm="sgrpo")
    with pytest.raises(OxrlError, match=rf"{old} and {new} are both set"):
        load_run_config(overrides=[f"{old}={value}", f"{new}={value}"], algorithm="sgrpo")


def test_the_models_read_the_old_names():
    train = TrainConfig(save_steps=3, eval_steps=2, log_steps=4, save_limit=1)
    assert (train.save_every, train.eval_every, train.log_every, train.save_total_limit) == (3, 2, 4, 1)
    rollout = RolloutConfig(epochs=3, options={"tp": 2})
    assert rollout.passes_per_batch == 3 and rollout.options == {"tp": 2}
    assert "epochs" not in rollout.model_dump() and "save_steps" not in train.model_dump()


def test_the_old_save_limit_name_still_works_with_a_note():
    config = load_run_config(overrides=["train.save_limit=1"], algorithm="sft")
    assert config.train.save_total_limit == 1
    assert config.notes == ["train.save_limit is deprecated; use train.save_total_limit"]


# ----------------------------------------------------------------------------- the rollout backend's options


def test_backend_options_sit_flat_under_rollout(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  backend: hf\n  n: 2\n  tensor_parallel_size: 2\n")
    config = load_run_config(path, algorithm="sgrpo")
    assert config.rollout.options == {"tensor_parallel_size": 2} and config.notes == []
    assert yaml.safe_load(dump_yaml(config))["rollout"]["tensor_parallel_size"] == 2


def test_the_old_rollout_options_mapping_is_read_flat_with_a_note(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  backend: hf\n  options:\n    tensor_parallel_size: 2\n")
    config = load_run_config(path, algorithm="sgrpo")
    assert config.rollout.options == {"tensor_parallel_size": 2}
    assert config.notes == [
        "rollout.options is deprecated; write the rollout backend's options flat under rollout: "
        "(rollout.tensor_parallel_size)"
    ]
    saved = yaml.safe_load(dump_yaml(config))["rollout"]
    assert "options" not in saved and saved["tensor_parallel_size"] == 2

    config = load_run_config(overrides=["rollout.options.tensor_parallel_size=4"], algorithm="sgrpo")
    assert config.rollout.options == {"tensor_parallel_size": 4} and len(config.notes) == 1
    assert "rollout.options is deprecated" in config.notes[0]


def test_rollout_options_both_ways_or_clashing_with_a_rollout_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  tensor_parallel_size: 1\n  options:\n    tensor_parallel_size: 2\n")
    with pytest.raises(OxrlError, match="rollout.options.tensor_parallel_size and rollout.tensor_parallel_size"):
        load_run_config(path, algorithm="sgrpo")
    with pytest.raises(OxrlError, match="rollout.options.tensor_parallel_size and rollout.tensor_parallel_size"):
        load_run_config(
            overrides=["rollout.tensor_parallel_size=1", "rollout.options.tensor_parallel_size=2"], algorithm="sgrpo"
        )
    with pytest.raises(OxrlError, match="rollout.options.n: .*oxRL's own rollout.n"):
        load_run_config(overrides=["rollout.options.n=2"], algorithm="sgrpo")


def test_a_typo_of_a_rollout_key_names_the_key_it_means():
    with pytest.raises(OxrlError, match="'temprature' is not a rollout key \\(did you mean 'temperature'\\?\\)"):
        load_run_config(overrides=["rollout.temprature=0.5"], algorithm="sgrpo")


def test_a_backend_option_typo_names_the_flat_field():
    from oxrl_core.rollout.hf import HFRolloutBackend

    with pytest.raises(OxrlError, match=r"rollout.tp: the 'hf' rollout backend takes no options"):
        HFRolloutBackend.parse_options(RolloutConfig(tp=2))


# ----------------------------------------------------------------------------- Algorithm.loop


def _legacy(name: str, **flags) -> type[Algorithm]:
    def loss(self, batch):  # pragma: no cover - never trained here
        raise NotImplementedError

    def advantages(self, batch):  # pragma: no cover
        raise NotImplementedError

    return type(
        name, (Algorithm,), {"name": name, "data_format": "prompt", "loss": loss, "advantages": advantages, **flags}
    )


@pytest.mark.parametrize(
    ("flags", "loop"),
    [
        ({"family": "supervised"}, "supervised"),
        ({"family": "preference"}, "preference"),
        ({"family": "rl", "needs_rollouts": True}, "rl"),
        ({"family": "supervised", "needs_rollouts": True}, "rl"),  # RFT's old declaration: the RL loop
        ({"family": "preference", "needs_rollouts": True}, "rl"),  # online DPO's
        ({"family": "preference", "needs_rollouts": False}, "preference"),
    ],
)
def test_a_class_with_the_old_flags_routes_to_the_same_loop(flags, loop):
    from oxrl_core.plugins import _algorithm_problems

    cls = _legacy("legacy_alg", **flags)
    assert cls.loop == loop and _algorithm_problems(cls) == []
    assert deprecation_note(cls) == (f"algorithm 'legacy_alg': {' / '.join(flags)} is deprecated; use loop = '{loop}'")


def test_every_algorithm_in_the_repo_declares_loop():
    from oxrl_core import plugins

    expected = {
        "sft": "supervised",
        "cpt": "supervised",
        "kd": "supervised",
        "rft": "rl",
        "dpo": "preference",
        "ipo": "preference",
        "simpo": "preference",
        "orpo": "preference",
        "kto": "preference",
        "rm": "preference",
        "spin": "preference",
        "online_dpo": "rl",
        "sgrpo": "rl",
        "cispo": "rl",
        "gspo": "rl",
        "rloo": "rl",
        "reinforce_pp": "rl",
        "reinforce_pp_baseline": "rl",
        "ppo": "rl",
    }
    registry = plugins.registry()
    for name, loop in expected.items():
        cls = registry.load_checked("algorithm", name)
        assert (cls.loop, cls._deprecated_flags, deprecation_note(cls)) == (loop, (), ""), name
        assert "family" not in vars(cls) and "needs_rollouts" not in vars(cls), name


def test_the_trainer_runs_an_old_style_class_in_its_loop_with_one_note(capsys):
    from oxrl_core.trainer import Trainer

    cls = _legacy("legacy_rft", family="supervised", needs_rollouts=True)
    trainer = Trainer(alg=cls, train={"save_steps": 2, "max_steps": 3}, rollout={"epochs": 2})
    assert trainer.algorithm.loop == "rl"
    assert trainer.config.rollout.n == 8  # the RL loop's tiny-model defaults, as before
    assert (trainer.config.train.save_every, trainer.config.rollout.passes_per_batch) == (2, 2)
    err = capsys.readouterr().err
    for note in (
        "note: algorithm 'legacy_rft': family / needs_rollouts is deprecated; use loop = 'rl'",
        "note: train.save_steps is deprecated; use train.save_every",
        "note: rollout.epochs is deprecated; use rollout.passes_per_batch",
    ):
        assert err.count(note) == 1, err


def test_the_config_is_read_once_per_run(monkeypatch, tmp_path):
    from oxrl_core import config as config_module
    from oxrl_core import trainer as trainer_module

    reads = []
    real = config_module.read_yaml
    monkeypatch.setattr(trainer_module, "read_yaml", real)
    monkeypatch.setattr(config_module, "read_yaml", lambda path: reads.append(path) or real(path))
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: sgrpo\nenv:\n  name: calculator\ntrain:\n  max_steps: 3\n")
    trainer = trainer_module.Trainer(config=path, quiet=True)
    assert reads == [path] and trainer.algorithm.loop == "rl"


# ----------------------------------------------------------------------------- an older run's config.yaml


OLD_NAMES = {"save_every": "save_steps", "eval_every": "eval_steps", "log_every": "log_steps"}


def test_a_run_whose_config_yaml_has_the_old_keys_resumes_and_is_reported(tmp_path, tiny_model_dir, sft_jsonl):
    run = tmp_path / "run"
    sets = ["--set", f"model.name={tiny_model_dir}", "--set", f"data.train={sft_jsonl}", "--set", "train.batch_size=4"]
    first = oxrl(
        "run",
        "--alg",
        "sft",
        *sets,
        "--set",
        "train.max_steps=2",
        "--set",
        "train.save_every=1",
        "-q",
        "-o",
        str(run),
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["save_every"] == 1 and saved["rollout"]["passes_per_batch"] == 1
    # as an older oxRL wrote it
    saved["train"] = {OLD_NAMES.get(k, k): v for k, v in saved["train"].items()}
    saved["rollout"] = {("epochs" if k == "passes_per_batch" else k): v for k, v in saved["rollout"].items()}
    saved["rollout"]["options"] = {}
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    # (a checkpoint's own config.yaml is checked against its manifest: left as written)

    resumed = oxrl("run", "--resume", "-o", str(run), "--set", "train.max_steps=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("note: train.save_steps is deprecated; use train.save_every") == 1, resumed.stderr
    assert "note: rollout.epochs is deprecated; use rollout.passes_per_batch" in resumed.stderr
    assert "rollout.options is deprecated" in resumed.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(steps) == 3

    saved["train"]["max_steps"] = 3  # as the resumed run left it, but with the old names again (oxrl report)
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    report = oxrl("report", str(run), "-o", str(tmp_path / "r.html"), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "save_steps" in Path(tmp_path / "r.html").read_text()
    bug = oxrl("bug-report", str(run), cwd=tmp_path)
    assert bug.returncode == 0, bug.stderr
    assert "save_steps" in bug.stdout
