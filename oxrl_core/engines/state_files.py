"""Tensor and state files of a run directory, read without running any code they hold.

A ``.pt`` file is a pickle, and a pickle can name any Python callable to be called on load (an object whose
``__reduce__`` returns ``(os.system, ("...",))``). Run directories are shared ("resume my run"), so every file
oxRL reads back — ``rng.pt``, ``rng-rank{r}.pt``, ``engine.pt``, ``inflight.pt``, ``critic.pt``, the reference
model's state and the DeepSpeed engine's ``deepspeed/state/*.pt`` — goes through `load_state_file`: torch's
restricted unpickler (``weights_only=True``: tensors, containers, numbers, strings) plus an allow-list of exactly
the classes that file type holds (DeepSpeed's optimiser files keep three). Anything else is refused with one
message naming the file and what it asked for; nothing of it runs.

What runs by design is declared, not hidden in these files: ``config.yaml`` may name Python files (rewards,
environments, tool parsers) and ``model.trust_remote_code``; ``oxrl run --resume`` lists those before importing
them (`oxrl_core.run_io.lifecycle`).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from oxrl_core.errors import OxrlError

#: what torch's restricted unpickler names when it refuses (``GLOBAL posix.system``, ``... was not an allowed global``)
_REFUSED_NAME = re.compile(r"GLOBAL ([\w.]+)|global ([\w.]+)|Unsupported operand (\d+)")


class UnsafeStateFile(OxrlError):
    """A state file asks to build or call something oxRL never writes into it: it is not loaded."""


def _refused_name(message: str) -> str:
    match = _REFUSED_NAME.search(message)
    if match is None:
        return "an object outside tensors, numbers, strings and containers"
    name, other, opcode = match.groups()
    return f"`{name or other}`" if (name or other) else f"pickle opcode {opcode}"


def load_state_file(path: Path, allowed: Iterable[type | Callable] = (), map_location=None):
    """``path`` read back as tensors, containers, numbers and strings, plus instances of the ``allowed`` classes
    (the exact ones that file type holds). A file asking for anything else is refused naming it and that thing;
    an unreadable one (truncated, not a torch file) is refused naming it too."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeStateFile(
            f"{path}: refused: it asks to build or call {_refused_name(str(exc))}, which oxRL never writes into this "
            "file; state files are read without running any code they hold, so this one was not loaded. The run "
            "directory was changed by something other than oxRL: resume only run directories you trust, from a "
            "checkpoint without this file's change, or start a new run"
        ) from None
    except FileNotFoundError:
        raise OxrlError(f"{path}: missing (the checkpoint is incomplete)") from None
    except Exception as exc:  # noqa: BLE001 - truncated, empty or not a torch file: one message naming it
        raise OxrlError(f"{path}: not a readable state file ({type(exc).__name__}: {_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


def deepspeed_allowed() -> list[type]:
    """The classes DeepSpeed 0.19 pickles into its ``*_optim_states.pt`` (ZeRO 1-3, bf16/fp16): the loss scaler,
    the ZeRO stage enum and the fragment addresses of the universal-checkpoint mappings. Its model-state files need
    none."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: DeepSpeed engine only
    from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: as above
    from deepspeed.utils.tensor_fragment import fragment_address  # lazy: as above

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
