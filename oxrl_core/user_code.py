"""Importing a user's Python file (``--set reward.name=my_reward.py:MyReward``, ``env.tool_parser=file.py:Class``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def import_file(path: str):
    """Import a Python file as a module (its directory is not added to sys.path); imported once per path."""
    module_name = f"oxrl_user_{Path(path).stem}_{abs(hash(str(Path(path).resolve()))) % 10**8}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
