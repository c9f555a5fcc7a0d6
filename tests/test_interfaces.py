"""The contracts of `oxrl_core.interfaces` hold for the code that fulfils them: the engines have every
member of the `Engine` protocol, the batch types name every key the algorithms read, the rollout
backend's attributes the loops read have their documented defaults, and `StrictModel` stays
importable from where plugins import it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from oxrl_core import interfaces
from oxrl_core.engines import Engine
from oxrl_core.interfaces import (
    Algorithm,
    PairedPreferenceBatch,
    RLLossBatch,
    RolloutBackend,
    ScoreBatch,
    SupervisedBatch,
    UnpairedPreferenceBatch,
)

ROOT = Path(__file__).resolve().parents[1]


def test_strict_model_is_one_class_wherever_it_is_imported_from():
    from oxrl_core import config, schema

    assert interfaces.StrictModel is schema.StrictModel is config.StrictModel


@pytest.mark.parametrize(
    "engine", ["oxrl_core.engines.torch_engine:TorchEngine", "oxrl_core.engines.deepspeed_engine:DeepSpeedEngine"]
)
def test_engines_have_every_member_of_the_engine_protocol(engine):
    module, _, name = engine.partition(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    members = [m for m in vars(Engine) if not m.startswith("_")] + list(Engine.__annotations__)
    missing = [m for m in members if not (hasattr(cls, m) or m in getattr(cls, "__annotations__", {}))]
    # device / autocast_dtype are set in __init__; PrecisionAndDevice declares them
    missing = [m for m in missing if m not in {c for k in cls.__mro__ for c in getattr(k, "__annotations__", {})}]
    assert not missing, f"{name} lacks {missing}"


def _keys_read(path: Path, method: str) -> set[str]:
    """String keys ``batch["..."]`` / ``batch.get("...")`` read inside ``method`` of the file's classes."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == method:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Subscript) and getattr(sub.value, "id", None) == "batch":
                    if isinstance(sub.slice, ast.Constant):
                        keys.add(sub.slice.value)
    return keys


LOSS_BATCHES = {
    "oxrl_algs_rl/sgrpo.py": RLLossBatch,
    "oxrl_algs_rl/cispo.py": RLLossBatch,
    "oxrl_algs_rl/gspo.py": RLLossBatch,
    "oxrl_algs_rl/rloo.py": RLLossBatch,
    "oxrl_algs_rl/reinforce_pp.py": RLLossBatch,
    "oxrl_algs_rl/ppo.py": RLLossBatch,
    "plugins/oxrl-algs-supervised/oxrl_algs_supervised/sft.py": SupervisedBatch,
    "plugins/oxrl-algs-supervised/oxrl_algs_supervised/cpt.py": SupervisedBatch,
    "plugins/oxrl-algs-supervised/oxrl_algs_supervised/kd.py": SupervisedBatch,
    "oxrl_algs_preference/dpo.py": PairedPreferenceBatch,
    "oxrl_algs_preference/ipo.py": PairedPreferenceBatch,
    "oxrl_algs_preference/orpo.py": PairedPreferenceBatch,
    "oxrl_algs_preference/simpo.py": PairedPreferenceBatch,
    "oxrl_algs_preference/spin.py": PairedPreferenceBatch,
    "oxrl_algs_preference/kto.py": UnpairedPreferenceBatch,
    "oxrl_algs_preference/rm.py": ScoreBatch,
}

#: keys an RL algorithm's own `advantages` adds (not part of the core's contract)
OWN_KEYS = {"adv", "returns", "role"}


@pytest.mark.parametrize("path", sorted(LOSS_BATCHES))
def test_batch_types_name_every_key_the_algorithms_read(path):
    declared = set(LOSS_BATCHES[path].__required_keys__) | set(LOSS_BATCHES[path].__optional_keys__)
    unknown = _keys_read(ROOT / path, "loss") - declared - OWN_KEYS
    assert not unknown, f"{path} reads {sorted(unknown)}, which {LOSS_BATCHES[path].__name__} does not declare"


def test_rollout_backend_attributes_the_loops_read_have_defaults():
    class Minimal(RolloutBackend):
        name = "minimal"

        def generate(self, prompt_token_ids, sampling):
            return []

        def update_weights(self, state, policy_version):
            pass

    backend = Minimal()
    assert backend.remote is False and backend.model is None


def test_critic_layout_reads_the_algorithm_config():
    class Plain(Algorithm):
        name, family, data_format = "plain", "rl", "prompt"

        def loss(self, batch):
            raise NotImplementedError

    assert Plain().critic_layout() == "shared"
    from oxrl_algs_rl.ppo import PPO

    assert PPO(PPO.Config(critic="separate")).critic_layout() == "separate"
    assert PPO().critic_layout() == PPO.Config().critic


def test_algorithm_flags_are_all_in_the_table():
    """Every class flag of `Algorithm` appears in the table comment above them (and nothing else does)."""
    source = inspect.getsource(Algorithm)
    table = [line.split()[1] for line in source.splitlines() if line.strip().startswith("#   ") and "  " in line]
    flags = [n for n, v in vars(Algorithm).items() if not n.startswith("_") and not callable(v) and n != "Config"]
    flags += [n for n in Algorithm.__annotations__ if n not in flags and not n.startswith("_")]
    assert set(flags) <= set(table), sorted(set(flags) - set(table))
