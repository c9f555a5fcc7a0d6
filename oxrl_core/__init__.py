"""oxRL core: hook specs, interfaces, config, loops, engines and the `oxrl` CLI.

Importing this package is cheap (no torch); heavy pieces load on first use.
"""

from oxrl_core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "Trainer", "Algorithm", "Reward", "Dataset", "RolloutBackend", "__version__"]

_LAZY = {
    "Trainer": "oxrl_core.trainer",
    "Algorithm": "oxrl_core.interfaces",
    "Reward": "oxrl_core.interfaces",
    "Dataset": "oxrl_core.interfaces",
    "RolloutBackend": "oxrl_core.interfaces",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'oxrl_core' has no attribute {name!r}")
