"""The table of contents of oxRL: every way to extend it is one hook below (pluggy, project name ``oxrl``).

=============================  ================================================  =============================
hook                           registers                                         built by (YAML field)
=============================  ================================================  =============================
register_algorithms(register)  `oxrl_core.interfaces.Algorithm` subclasses       --alg / ``algorithm`` (``alg.*``)
register_rewards(register)     `oxrl_core.interfaces.Reward` subclasses          ``reward.name`` (``reward.*``)
register_datasets(register)    `oxrl_core.interfaces.Dataset` subclasses         ``data.train`` / ``data.eval``
register_rollout_backends(..)  `oxrl_core.interfaces.RolloutBackend` subclasses  ``rollout.backend`` (``rollout.*``)
register_environments(..)      `oxrl_core.interfaces.Environment` subclasses     ``env.name`` (``env.*``)
=============================  ================================================  =============================

Every plugin, whatever its kind, is built by one function, `oxrl_core.plugins.Registry.build`: look up the
name (``package:name`` picks one of a clash), check the class against its interface, validate the options
against its ``Config`` (an error names the YAML field) and instantiate it.

One registration style: each distribution has one hook module whose hooks call ``register(name,
"pkg.module:Attr")`` (an import path, imported only when a run uses it: discovery never imports torch),
and one entry point per name, each naming that module::

    @hookimpl                                       # oxrl_myalg/__init__.py
    def register_algorithms(register):
        register("myalg", "oxrl_myalg.algorithm:MyAlg")

    [project.entry-points.oxrl]                     # pyproject.toml
    myalg = "oxrl_myalg"

How the pieces fit, and why entry points name the module: ``docs/architecture.md``.
"""

import pluggy

hookspec = pluggy.HookspecMarker("oxrl")
hookimpl = pluggy.HookimplMarker("oxrl")


@hookspec
def register_algorithms(register):
    """Register `oxrl_core.interfaces.Algorithm` subclasses: ``register(name, "module:Class")``."""


@hookspec
def register_rewards(register):
    """Register `oxrl_core.interfaces.Reward` subclasses: ``register(name, "module:Class")``."""


@hookspec
def register_datasets(register):
    """Register `oxrl_core.interfaces.Dataset` subclasses: ``register(name, "module:Class")``."""


@hookspec
def register_rollout_backends(register):
    """Register `oxrl_core.interfaces.RolloutBackend` subclasses: ``register(name, "module:Class")``."""


@hookspec
def register_environments(register):
    """Register `oxrl_core.interfaces.Environment` subclasses: ``register(name, "module:Class")``."""
