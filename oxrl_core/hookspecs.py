"""The hooks a plugin implements (pluggy, project name ``oxrl``).

Each hook receives a ``register`` callback, in the style of simonw/llm's
``register_models(register)``. ``register(name, target)`` takes a name and
either the object itself or, preferably, an import path ``"pkg.module:Attr"``
that is imported only when a run uses it, so discovery stays fast and never
imports torch::

    from oxrl_core import hookimpl

    @hookimpl
    def register_algorithms(register):
        register("myalg", "oxrl_myalg.algorithm:MyAlg")
"""

import pluggy

hookspec = pluggy.HookspecMarker("oxrl")
hookimpl = pluggy.HookimplMarker("oxrl")


@hookspec
def register_algorithms(register):
    """Register `Algorithm` subclasses: ``register(name, "module:Class")``."""


@hookspec
def register_rewards(register):
    """Register `Reward` subclasses: ``register(name, "module:Class")``."""


@hookspec
def register_datasets(register):
    """Register `Dataset` subclasses: ``register(name, "module:Class")``."""


@hookspec
def register_rollout_backends(register):
    """Register `RolloutBackend` subclasses: ``register(name, "module:Class")``."""


class Registers:
    """An entry-point target that registers one import path of one kind, e.g. in a registration module::

        sft = Registers("algorithm", "sft", "oxrl_algs_supervised.sft:SFT")

    with ``[project.entry-points.oxrl] sft = "oxrl_algs_supervised.registration:sft"``: one entry
    point per algorithm/reward/..., and nothing heavy is imported until a run asks for the name.
    """

    def __init__(self, kind: str, name: str, target: str):
        self.kind, self.name, self.target = kind, name, target

    def _register(self, kind: str, register) -> None:
        if kind == self.kind:
            register(self.name, self.target)

    @hookimpl
    def register_algorithms(self, register):
        self._register("algorithm", register)

    @hookimpl
    def register_rewards(self, register):
        self._register("reward", register)

    @hookimpl
    def register_datasets(self, register):
        self._register("dataset", register)

    @hookimpl
    def register_rollout_backends(self, register):
        self._register("rollout_backend", register)
