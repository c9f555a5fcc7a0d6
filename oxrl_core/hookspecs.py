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
