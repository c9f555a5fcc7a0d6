"""Checkpoints and the final model, written atomically.

``checkpoints/step-N/`` holds the HF-format model and tokenizer, ``engine.pt``
(optimizer + scheduler), ``rng.pt`` and ``trainer_state.json`` (step, data
position). Everything is written to a hidden temp directory first and renamed
into place, so a killed run leaves either a complete checkpoint or none.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

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


def save_model(dest: Path, model, tokenizer, extra=None) -> None:
    """HF-format model + tokenizer at `dest`, atomically; `extra(tmp_dir)` may add files before the rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    from oxrl_core.lora import is_peft, save_lora

    if is_peft(model):
        save_lora(tmp, model)  # merged HF weights, and the adapter in adapter/
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if extra is not None:
        extra(tmp)
    _publish(tmp, dest)


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, engine, state: dict, keep: int = 0, extra=None) -> Path:
    """``extra(tmp_dir)`` may add files (e.g. a critic) to the checkpoint before it is published."""
    dest = run_dir / "checkpoints" / f"step-{step}"

    def training_state(tmp: Path) -> None:
        if extra is not None:
            extra(tmp)
        torch.save(engine.state_dict(), tmp / "engine.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))

    save_model(dest, model, tokenizer, extra=training_state)
    if keep > 0:
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


def load_training_state(ckpt: Path, engine) -> dict:
    engine.load_state_dict(torch.load(ckpt / "engine.pt", map_location=engine.device, weights_only=False))
    set_rng_state(torch.load(ckpt / "rng.pt", weights_only=False))
    return json.loads((ckpt / STATE_FILE).read_text())
