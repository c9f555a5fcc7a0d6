"""Checkpoints and the final model, written atomically.

``checkpoints/step-N/`` holds the HF-format model and tokenizer, ``engine.pt``
(optimizer + scheduler), ``rng.pt`` and ``trainer_state.json`` (step, data
position, the engine that wrote it). Everything is written to a hidden temp directory first and
renamed into place, so a killed run leaves either a complete checkpoint or none.

Data-parallel runs (the `deepspeed` engine with ``engine.world_size`` > 1) call these functions on
every rank: ZeRO-3 parameters are gathered (`engine.full_weights()`), rank 0 writes the model and
the shared files, every rank writes its own engine state (DeepSpeed's partitions of the optimizer
state under ``deepspeed/``) and ``rng-rank{r}.pt``, and rank 0 renames the directory into place
only after all ranks have finished (a barrier), so a published checkpoint is always complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from oxrl_core import distributed
from oxrl_core.errors import OxrlError

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, dest: Path) -> None:
    """Rename a finished temp dir into place (replacing an older `dest`)."""
    if dest.exists():
        old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    _fsync_dir(dest.parent)


def save_model(dest: Path, model, tokenizer, extra=None, engine=None, every_rank=None) -> None:
    """HF-format model + tokenizer at `dest`, atomically; `extra(tmp_dir)` may add files before the rename.

    With ``engine`` (a data-parallel run calls this on every rank) the parameters are whole while rank 0
    writes the model and runs ``extra``; ``every_rank(tmp_dir)`` runs on every rank before the rename.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{dest.name}-{distributed.main_pid()}")  # the same directory on every rank
    main = distributed.is_main()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    from oxrl_core.lora import is_peft, save_lora

    with engine.full_weights() if engine is not None else contextlib.nullcontext():
        if main:
            if is_peft(model):
                save_lora(tmp, model)  # merged HF weights, and the adapter in adapter/
            else:
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if extra is not None:
                extra(tmp)
    distributed.barrier()  # the directory exists before the other ranks write into it
    if every_rank is not None:
        every_rank(tmp)
    distributed.barrier()  # ... and every rank has finished before it is published
    if main:
        _publish(tmp, dest)
    distributed.barrier()


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, engine, state: dict, keep: int = 0, extra=None) -> Path:
    """``extra(tmp_dir)`` may add files (e.g. a critic) to the checkpoint before it is published."""
    dest = run_dir / "checkpoints" / f"step-{step}"

    def training_state(tmp: Path) -> None:
        if extra is not None:
            extra(tmp)
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "engine": engine.describe()}, indent=2))

    def rank_state(tmp: Path) -> None:
        engine.save_state(tmp)  # the torch engine: engine.pt; DeepSpeed: this rank's partition
        if distributed.rank() > 0:
            torch.save(rng_state(), tmp / f"rng-rank{distributed.rank()}.pt")

    save_model(dest, model, tokenizer, extra=training_state, engine=engine, every_rank=rank_state)
    if keep > 0 and distributed.is_main():
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return dest


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (half-written temp dirs are never listed)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def clean_partial(run_dir: Path) -> None:
    """Remove temp dirs a killed run left behind."""
    for root in (Path(run_dir), Path(run_dir) / "checkpoints"):
        if root.is_dir():
            for child in root.iterdir():
                if child.name.startswith((".tmp-", ".old-")):
                    shutil.rmtree(child, ignore_errors=True)


def check_engine_matches(ckpt: Path, expected: dict) -> None:
    """A checkpoint resumes only under the engine that wrote it (DeepSpeed's optimizer state is
    partitioned per rank and stage); checkpoints without a record were written by the torch engine."""
    saved = json.loads((Path(ckpt) / STATE_FILE).read_text()).get("engine", {"name": "torch"})
    if saved != expected:
        def show(d: dict) -> str:
            return ", ".join(f"engine.{k}={v}" for k, v in d.items())

        raise OxrlError(
            f"{ckpt} was written with {show(saved)} but this run has {show(expected)}; resume with the same "
            "engine settings (the optimizer state is stored per engine, ZeRO stage and rank), or start a new run"
        )


def load_training_state(ckpt: Path, engine) -> dict:
    check_engine_matches(ckpt, engine.describe())
    engine.load_state(ckpt)
    rank = distributed.rank()
    rng = ckpt / f"rng-rank{rank}.pt" if rank > 0 else ckpt / "rng.pt"
    set_rng_state(torch.load(rng if rng.is_file() else ckpt / "rng.pt", weights_only=False))
    return json.loads((ckpt / STATE_FILE).read_text())
