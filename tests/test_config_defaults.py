"""The defaults a run's config is validated under come from five sources, merged in one place in one order
(`Defaults`, `with_defaults`): the loop's, the environment's, the algorithm's and the dataset's for the built-in
model, then the algorithm's rollout defaults; each overrides the ones before it, and the user's config (the
YAML file, then --set) overrides them all."""

from __future__ import annotations

import pytest

from oxrl_core import plugins
from oxrl_core.config import Defaults, RawRunConfig, load_run_config, validate_run_config
from oxrl_core.data.task import ArithDataset, CalculatorEnv

#: the sources, in the order they apply
SOURCES = ("loop", "environment", "algorithm", "dataset", "rollout")


def temperature_from(place: int) -> dict:
    """What source number ``place`` (of `SOURCES`) sets rollout.temperature with: a value of its own."""
    value = 0.1 * (place + 1)
    return {"temperature": value} if SOURCES[place] == "rollout" else {"rollout": {"temperature": value}}


def validated(raw: dict, defaults: Defaults) -> float:
    return validate_run_config(RawRunConfig(raw, "test.yaml", []), defaults).rollout.temperature


@pytest.mark.parametrize("later", range(1, len(SOURCES)), ids=SOURCES[1:])
def test_of_two_sources_that_set_one_key_the_later_wins_and_the_users_value_wins_over_both(later):
    for earlier in range(later):
        defaults = Defaults(**{SOURCES[earlier]: temperature_from(earlier), SOURCES[later]: temperature_from(later)})
        assert validated({"algorithm": "sgrpo"}, defaults) == pytest.approx(0.1 * (later + 1)), SOURCES[earlier]
        mine = {"algorithm": "sgrpo", "rollout": {"temperature": 0.95}}
        assert validated(mine, defaults) == 0.95, SOURCES[earlier]


def test_a_named_model_takes_only_the_algorithms_rollout_defaults():
    for place, source in enumerate(SOURCES):
        expected = 0.1 * (place + 1) if source == "rollout" else 1.0  # 1.0: RolloutConfig's own default
        config = {"algorithm": "sgrpo", "model": {"name": "org/some-model"}}
        assert validated(config, Defaults(**{source: temperature_from(place)})) == pytest.approx(expected), source


def test_without_defaults_the_built_in_model_gets_the_generic_ones():
    assert load_run_config(algorithm="sft").train.lr == 1e-3  # TINY_DEFAULTS
    assert load_run_config(algorithm="sft", overrides=["model.name=org/some-model"]).train.lr == 1e-5


class OrderEnv(CalculatorEnv):
    name = "order_env"
    tiny_defaults = {"rollout": {"max_new_tokens": 11}, "train": {"lr": 2e-4}}


class OrderData(ArithDataset):
    name = "order_data"
    tiny_defaults = {"rl": {"train": {"max_steps": 44}, "rollout": {"n": 5, "minibatches": 2}}}


@pytest.fixture
def registry(monkeypatch):
    """The process-wide registry with the test's environment and dataset, restored afterwards."""
    monkeypatch.setattr(plugins, "_REGISTRY", plugins.discover())
    registry = plugins.registry()
    for kind, cls in (("environment", OrderEnv), ("dataset", OrderData)):
        registry.prefer(plugins.Registration(kind, cls.name, cls, plugin=cls.name, package=__name__, version=""))
    return registry


def test_the_trainer_puts_each_plugins_defaults_in_its_place(registry):
    from oxrl_algs_rl.sgrpo import SGRPO
    from oxrl_core.trainer import Trainer

    class OrderAlg(SGRPO):
        name = "order_alg"
        tiny_defaults = {"train": {"lr": 3e-4, "max_steps": 33}}
        rollout_defaults = {"minibatches": 4, "temperature": 0.5}

    sets = {"env": {"name": "order_env"}, "data": {"train": "order_data"}, "rollout": {"temperature": 0.9}}
    config = Trainer(alg=OrderAlg, quiet=True, **sets).config
    assert config.rollout.max_new_tokens == 11  # the environment's over the RL loop's 8
    assert config.train.lr == 3e-4  # the algorithm's over the environment's
    assert config.train.max_steps == 44  # the dataset's over the algorithm's
    assert config.rollout.n == 5  # the dataset's over the RL loop's 8
    assert config.rollout.minibatches == 4  # the algorithm's rollout defaults over the dataset's 2
    assert config.rollout.temperature == 0.9  # the user's over the algorithm's rollout defaults
    assert config.train.batch_size == 16  # the RL loop's, set by no later source
    assert config.algorithm_defaults == {"rollout.minibatches": 4}
