"""The table of contents of oxRL: every way to extend it is one hook below (pluggy, project name ``oxrl``).

=============================  ================================================  =============================
hook                           registers                                         built by (YAML field)
=============================  ================================================  =============================
register_algorithms(register)  `oxrl_core.interfaces.Algorithm` subclasses       --alg / ``algorithm`` (``alg.*``)
register_rewards(register)     `oxrl_core.interfaces.Reward` subclasses          ``reward.name`` (``reward.*``)
register_datasets(register)    `oxrl_core.interfaces.Dataset` subclasses         ``data.train`` / ``data.eval``
register_rollout_backends(..)  `oxrl_core.interfaces.RolloutBackend` subclasses  ``rollout.backend`` (``rollout.options``)
=============================  ================================================  =============================

Every plugin, whatever its kind, is built by one function, `oxrl_core.plugins.Registry.build`: look up the
name (``package:name`` picks one of a clash), check the class against its interface, validate the options
against its ``Config`` (an error names the YAML field) and instantiate it. How the pieces fit:
``docs/architecture.md``.

**One registration style.** Each distribution has one small hook module (``registration.py`` here, the
package's ``__init__`` in what ``oxrl new-plugin`` scaffolds). A hook receives a ``register`` callback, in the
style of simonw/llm's ``register_models(register)``; ``register(name, target)`` takes a name and either the
object itself or, preferably, an import path ``"pkg.module:Attr"`` that is imported only when a run uses it,
so discovery stays fast and never imports torch::

    from oxrl_core import hookimpl

    @hookimpl
    def register_algorithms(register):
        register("myalg", "oxrl_myalg.algorithm:MyAlg")
        register("myalg2", "oxrl_myalg.algorithm:MyAlg2")

**One entry point per name**, every one naming the package's hook module::

    [project.entry-points.oxrl]
    myalg = "oxrl_myalg"
    myalg2 = "oxrl_myalg"

The plugin manager registers a hook module once, however many entry points name it, and files each name
under the entry point of the same name (a name with no entry point of its own: under the entry point that
loaded the module). So `oxrl plugins` still says which package provides which name, the ``OXRL_PLUGINS``
allow-list still picks single names (``OXRL_PLUGINS=sft`` files ``sft`` and not its siblings), and a name
two packages register is still a clash. Why entry points name the module rather than one object per name:
the module is what a plugin author writes anyway (the scaffold's form), so the built-ins and third-party
packages read the same, and adding a name is one ``register`` line plus one entry-point line.
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
