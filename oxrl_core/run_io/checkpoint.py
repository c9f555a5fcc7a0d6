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

Three more guarantees (issue 15):
- Non-finite weights are never written: the state dict being saved (the merged weights under LoRA, the
  gathered ones under ZeRO-3) is checked in one pass first, and a NaN/inf stops the run naming the
  parameters and the newest checkpoint to resume from (`NonFiniteWeights`).
- A write that fails (disk full, I/O error) removes the temp dir and stops with one message naming the
  path, MB needed and free, and the last complete checkpoint (`atomic.write_error`).
- Each checkpoint ends with ``manifest.json`` (every file and its size), written last; resume trusts only
  checkpoints whose files match it and falls back to the newest complete one, saying what it skipped.
  Sizes, not hashes: what kills and full disks do is truncate, empty or drop files, which sizes catch,
  while hashing would read every byte of a multi-GB checkpoint on each save and each resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import torch

from oxrl_core.atomic import fsync_dir, is_disk_full, write_error
from oxrl_core.engines import distributed
from oxrl_core.engines.state_files import load_state_file
from oxrl_core.errors import OxrlError
from oxrl_core.models.lora import is_peft, save_lora

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
#: how many non-finite parameter names a message lists before "... and N more"
_NAMES_SHOWN = 5


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


def _publish(tmp: Path, dest: Path) -> None:
    """Rename a finished temp dir into place (replacing an older `dest`)."""
    if dest.exists():
        old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    fsync_dir(dest.parent)


class NonFiniteWeights(OxrlError):
    """The weights about to be saved hold NaN/inf: nothing is written and the run stops."""


def _run_dir_of(dest: Path) -> Path:
    """The run directory of a ``checkpoints/step-N`` or ``final`` destination."""
    return dest.parent.parent if dest.parent.name == "checkpoints" else dest.parent


def _resume_hint(run_dir: Path) -> str:
    last = latest_checkpoint(run_dir)
    if last is None:
        return f"no earlier checkpoint exists in {run_dir}"
    return f"the newest complete checkpoint is {last}; resume from it with: oxrl run --resume -o {run_dir}"


def check_finite(state: dict, dest: Path) -> None:
    """Refuse to write `state` (name -> tensor) if any tensor holds NaN/inf: one pass over the weights
    being saved. A poisoned checkpoint would make every later --resume fail, a poisoned final/ would be
    published as the trained model."""
    bad = [
        name
        for name, t in state.items()
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if not bad:
        return
    more = f" and {len(bad) - _NAMES_SHOWN} more" if len(bad) > _NAMES_SHOWN else ""
    what = f"step {STEP_DIR.match(dest.name).group(1)}" if STEP_DIR.match(dest.name) else "the end of training"
    raise NonFiniteWeights(
        f"the weights hold NaN/inf at {what} ({', '.join(bad[:_NAMES_SHOWN])}{more}), so {dest} was not written; "
        f"{_resume_hint(_run_dir_of(dest))}. The update diverged: lower train.lr, or enable gradient clipping "
        f"(train.max_grad_norm > 0)"
    )


def _bytes_needed(model, dest: Path) -> int:
    """What a save needs: the newest checkpoint's size if there is one, else the weights' size
    (times 3 for a checkpoint: weights and Adam's two moments)."""
    last = latest_checkpoint(_run_dir_of(dest))
    if last is not None:
        return sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights * (3 if STEP_DIR.match(dest.name) else 1)


def _write_failed(exc: BaseException, tmp: Path, dest: Path, model) -> OxrlError:
    """Remove the half-written temp dir and say what failed, what is intact and how to go on."""
    _discard(tmp, distributed.is_main())
    run_dir = _run_dir_of(dest)
    last = latest_checkpoint(run_dir)
    intact = f"the last complete checkpoint {last} is intact" if last else "no earlier checkpoint was written"
    return write_error(
        dest, exc, needed_bytes=_bytes_needed(model, dest), intact=intact, resume_dir=run_dir if last else None
    )


def _write_model(tmp: Path, model, tokenizer, dest: Path) -> None:
    """HF weights (checked finite first) and tokenizer into `tmp`."""
    if is_peft(model):
        save_lora(tmp, model, check=lambda state: check_finite(state, dest))  # checks the merged weights
    else:
        check_finite(model.state_dict(), dest)
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def save_model(dest: Path, model, tokenizer, extra=None, engine=None, every_rank=None) -> None:
    """HF-format model + tokenizer at `dest`, atomically; `extra(tmp_dir)` may add files before the rename.

    With ``engine`` (a data-parallel run calls this on every rank) the parameters are whole while rank 0
    writes the model and runs ``extra``; ``every_rank(tmp_dir)`` runs on every rank before the rename.
    Non-finite weights are refused before anything is written; a failed write (disk full, I/O error)
    removes the temp dir and raises one `OxrlError`.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{dest.name}-{distributed.main_pid()}")  # the same directory on every rank
    main = distributed.is_main()
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        with engine.full_weights() if engine is not None else contextlib.nullcontext():
            if main:
                tmp.mkdir()
                _write_model(tmp, model, tokenizer, dest)
                if extra is not None:
                    extra(tmp)
            else:  # the weights are whole and equal on every rank: each refuses them as rank 0 does
                check_finite(model.state_dict(), dest)
        distributed.barrier()  # the directory exists before the other ranks write into it
        if every_rank is not None:
            every_rank(tmp)
        distributed.barrier()  # ... and every rank has finished before it is published
        if main:
            write_manifest(tmp)
            _publish(tmp, dest)
    except (OSError, RuntimeError) as exc:  # torch and safetensors report a full disk as RuntimeError
        if isinstance(exc, OSError) or _looks_like_io(exc):
            raise _write_failed(exc, tmp, dest, model) from None
        _discard(tmp, main)
        raise
    except BaseException:  # non-finite weights, a plugin's extra files failing, Ctrl-C: nothing half-written stays
        _discard(tmp, main)
        raise
    distributed.barrier()


def _discard(tmp: Path, main: bool) -> None:
    if main:
        shutil.rmtree(tmp, ignore_errors=True)


def _looks_like_io(exc: RuntimeError) -> bool:
    text = str(exc).lower()
    return is_disk_full(exc) or "write" in text or "i/o error" in text or "ioerror" in text


def write_manifest(directory: Path) -> None:
    """Flush every file in `directory` to disk and record it with its size in ``manifest.json`` — last,
    so a directory with a manifest had all its files complete when it was written."""
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            files[str(path.relative_to(directory))] = path.stat().st_size
    with open(directory / MANIFEST, "w") as handle:
        json.dump({"version": 1, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed (a short reason), or None if it is complete.

    With a manifest: every listed file exists with its recorded size. Without one (written before
    manifests existed): accepted if its own files look whole — trainer_state.json parses, rng.pt and the
    weights exist, and every ``.pt`` is a readable zip (torch's format; a truncated one has no central
    directory, found without reading the file).
    """
    manifest = ckpt / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, TypeError, OSError):
            return f"{MANIFEST} is unreadable"
        for name, size in files.items():
            path = ckpt / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} is truncated ({path.stat().st_size} of {size} bytes)"
        return _state_problem(ckpt)
    return _legacy_problem(ckpt)


def _state_problem(ckpt: Path) -> str | None:
    try:
        json.loads((ckpt / STATE_FILE).read_text())["step"]
    except FileNotFoundError:
        return f"{STATE_FILE} is missing"
    except (ValueError, KeyError, TypeError, OSError):
        return f"{STATE_FILE} is empty or unreadable"
    return None


def _legacy_problem(ckpt: Path) -> str | None:
    import zipfile

    problem = _state_problem(ckpt)
    if problem:
        return problem
    if not (ckpt / "rng.pt").is_file():
        return "rng.pt is missing"
    if not any(ckpt.glob("*.safetensors")) and not any(ckpt.glob("*.bin")):
        return "the model weights are missing"
    for path in sorted(ckpt.rglob("*.pt")):
        if path.stat().st_size == 0 or not zipfile.is_zipfile(path):
            return f"{path.relative_to(ckpt)} is truncated or unreadable"
    for path in sorted(ckpt.glob("*.safetensors")):
        if path.stat().st_size < 8:
            return f"{path.name} is truncated"
    return None


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


#: skipped checkpoints already reported in this process (each is said once, not at every lookup)
_REPORTED: set[tuple[str, str]] = set()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first. Half-written temp dirs are never listed; a published one whose
    files do not match its manifest (truncated, missing, empty) is skipped with a note on stderr."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if not match or not child.is_dir():
            continue
        problem = checkpoint_problem(child)
        if problem is None:
            found.append((int(match.group(1)), child))
        else:
            _report_skip(child, problem)
    return [path for _, path in sorted(found)]


def _report_skip(ckpt: Path, problem: str) -> None:
    if (str(ckpt), problem) not in _REPORTED:
        _REPORTED.add((str(ckpt), problem))
        if distributed.is_main():
            print(f"note: skipping checkpoint {ckpt}: {problem}", file=sys.stderr, flush=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (older ones stand in for a damaged newer one), or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def clean_partial(run_dir: Path) -> None:
    """Remove temp dirs a killed run left behind. A kill between `_publish`'s two renames leaves the
    previous `final/` (or checkpoint) only as `.old-NAME-PID`: it is put back, not deleted."""
    for root in (Path(run_dir), Path(run_dir) / "checkpoints"):
        if not root.is_dir():
            continue
        for child in sorted(root.iterdir()):
            match = re.fullmatch(r"\.old-(.+)-\d+", child.name)
            if match and child.is_dir() and not (root / match.group(1)).exists():
                os.replace(child, root / match.group(1))
        for child in root.iterdir():
            if child.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(child, ignore_errors=True)


def check_engine_matches(ckpt: Path, expected: dict) -> None:
    """A checkpoint resumes only under the engine that wrote it (DeepSpeed's optimizer state is
    partitioned per rank and stage); checkpoints without a record were written by the torch engine."""
    saved = json.loads((Path(ckpt) / STATE_FILE).read_text()).get("engine", {"name": "torch"})
    if saved != expected:
        named = "optimizer" in saved or "optimizer" in expected  # train.optimizer differs: name it on both sides

        def show(d: dict) -> str:  # (a torch engine's record holds train.optimizer unless it is adamw)
            d = {**d, "optimizer": d.get("optimizer", "adamw")} if named and d.get("name") == "torch" else d
            return ", ".join(f"{'train' if k == 'optimizer' else 'engine'}.{k}={v}" for k, v in d.items())

        raise OxrlError(
            f"{ckpt} was written with {show(saved)} but this run has {show(expected)}; resume with the same "
            "engine settings (the optimizer state is stored per engine, ZeRO stage and rank), or start a new run"
        )


def load_training_state(ckpt: Path, engine) -> dict:
    check_engine_matches(ckpt, engine.describe())
    engine.load_state(ckpt)
    rank = distributed.rank()
    rng = ckpt / f"rng-rank{rank}.pt" if rank > 0 else ckpt / "rng.pt"
    set_rng_state(load_state_file(rng if rng.is_file() else ckpt / "rng.pt"))
    return json.loads((ckpt / STATE_FILE).read_text())
