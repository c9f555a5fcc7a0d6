"""Checkpoint integrity (issue 15, items 1, 8, 9, 10): nothing non-finite is saved, every file is written
atomically or read tolerantly, a full disk stops the run cleanly, and resume skips damaged checkpoints.

One small SFT run with a checkpoint at every step (`base_run`) is made once; each test copies it and
damages or resumes the copy.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import oxrl, read_metrics

from oxrl_core.errors import OxrlError
from oxrl_core.run_io.checkpoint import MANIFEST, checkpoint_problem, latest_checkpoint, list_checkpoints

FAST = ["--set", "train.save_every=1", "--set", "train.save_total_limit=0"]


def cli(*args: str):
    """The real CLI in-process (fast); returns (exit code, everything it printed). An OxrlError is what
    `oxrl_core.cli.main` prints as one line with exit status 2."""
    from typer.testing import CliRunner

    from oxrl_core.cli import app

    result = CliRunner().invoke(app, list(args))
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    if isinstance(result.exception, OxrlError):
        return 2, text + f"error: {result.exception}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, text


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """An SFT run of 3 steps with checkpoints step-1 and step-2 (the last step writes final/)."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    code, out = cli("run", "--alg", "sft", "--set", "train.max_steps=3", *FAST, "-o", str(run))
    assert code == 0, out
    assert [c.name for c in list_checkpoints(run)] == ["step-1", "step-2"]
    return run


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy)
    return copy


def unfinish(run: Path) -> Path:
    """Make the copy a run stopped after step 2 (final/ and summary.json gone), so --resume continues it."""
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    return run


def resume(run: Path, steps: int = 4):
    return cli("run", "--alg", "sft", "--resume", "--set", f"train.max_steps={steps}", *FAST, "-o", str(run))


# ---- item 1: non-finite weights are never written ----------------------------------------------------------


@pytest.mark.slow
def test_nonfinite_weights_are_never_saved(tmp_path):
    """lr=1e38: step 1 (lr 0 in warm-up) is saved; step 2's update makes the weights inf/NaN; that
    checkpoint and final/ are never written and the message names step, parameters, checkpoint, fix."""
    run = tmp_path / "run"
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        "train.lr=1e38",
        "--set",
        "train.max_steps=3",
        "--set",
        "train.warmup_steps=1",
        *FAST,
        "-o",
        str(run),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "NaN/inf at step 2" in out and "model.embed_tokens.weight" in out, out
    assert f"newest complete checkpoint is {run / 'checkpoints' / 'step-1'}" in out and "--resume" in out
    assert "lower train.lr" in out
    assert not (run / "final").exists()
    assert [c.name for c in list_checkpoints(run)] == ["step-1"]
    assert not any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())
    weights = _load_weights(run / "checkpoints" / "step-1")
    assert all(torch.isfinite(t).all() for t in weights.values())


def _load_weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(ckpt / "model.safetensors")


def test_nonfinite_check_refuses_before_writing(base_run, tmp_path):
    """The check itself, on a model with one NaN: the message names the parameter and the newest checkpoint."""
    from transformers import AutoModelForCausalLM

    from oxrl_core.models.tiny import build_tokenizer
    from oxrl_core.run_io.checkpoint import NonFiniteWeights, save_model

    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    shutil.rmtree(run / "final")
    with pytest.raises(NonFiniteWeights) as err:
        save_model(run / "final", model, build_tokenizer())
    assert "lm_head.weight" in str(err.value) and str(run / "checkpoints" / "step-2") in str(err.value)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".tmp", "final"))) == []


# ---- item 8: atomic writes, tolerant reads ---------------------------------------------------------------


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    """A write that fails before the rename (a kill, a full disk) leaves the old summary.json whole."""
    import oxrl_core.atomic as atomic

    target = tmp_path / "summary.json"
    atomic.write_text_atomic(target, json.dumps({"steps": 2}))

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full_disk)
    with pytest.raises(OxrlError, match=f"disk full at {target}"):
        atomic.write_text_atomic(target, json.dumps({"steps": 3}))
    assert json.loads(target.read_text()) == {"steps": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_loops_write_summary_atomically(base_run):
    """The three loops write summary.json through the atomic helper (an in-place write could be left empty);
    they share one writer, the run skeleton's `Run.finish`."""
    root = Path(__file__).resolve().parents[1] / "oxrl_core" / "loops"
    for loop in ("run.py",):
        source = (root / loop).read_text()
        assert 'write_text_atomic(run_dir / "summary.json"' in source, loop
        assert '"summary.json").write_text' not in source, loop
    assert json.loads((base_run / "summary.json").read_text())["steps"] == 3


def test_resume_drops_a_torn_metrics_line(run_copy):
    """A kill or full disk mid-append leaves a partial last line: resume drops it with a note."""
    unfinish(run_copy)
    with open(run_copy / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "loss": 1.2')
    code, out = resume(run_copy)
    assert code == 0, out
    assert "dropped 1 unreadable line" in out
    assert [r["step"] for r in read_metrics(run_copy)] == [1, 2, 3, 4]


def test_metrics_append_failure_is_cut_back_and_reported(tmp_path, run_copy):
    """ENOSPC while appending metrics.jsonl: no partial line stays, one message names the file and the checkpoint."""
    from oxrl_core.run_io.tracking import JsonlSink

    sink = JsonlSink(run_copy / "metrics.jsonl", resume_step=2)
    real = sink.handle

    class FullDisk:
        def __init__(self):
            self.closed = False

        def tell(self):
            return real.tell()

        def write(self, text):
            real.write(text[:7])  # a partial line reaches the file, then the disk is full
            real.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.closed = True
            real.close()

    sink.handle = FullDisk()
    with pytest.raises(OxrlError) as err:
        sink.log(3, {"loss": 1.0})
    message = str(err.value)
    assert f"disk full at {run_copy / 'metrics.jsonl'}" in message
    assert f"the last complete checkpoint {run_copy / 'checkpoints' / 'step-2'} is intact" in message
    assert "oxrl run --resume -o" in message
    assert [r["step"] for r in read_metrics(run_copy)] == [1, 2]


# ---- item 9: disk full while saving ----------------------------------------------------------------------


def test_disk_full_while_saving_checkpoint_patched(run_copy, monkeypatch):
    """torch.save failing with ENOSPC inside the checkpoint: one message, temp dir gone, step-2 intact;
    after "freeing space" the same --resume continues."""
    import oxrl_core.engines.torch_engine as torch_engine

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("engine.pt"):
            Path(f).write_bytes(b"PK\x03\x04partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    unfinish(run_copy)
    monkeypatch.setattr(torch_engine.torch, "save", full_disk)
    code, out = resume(run_copy)
    assert code == 2, out
    assert f"disk full at {run_copy / 'checkpoints' / 'step-3'}" in out and "MB needed" in out and "MB free" in out
    assert f"the last complete checkpoint {run_copy / 'checkpoints' / 'step-2'} is intact" in out
    assert f"oxrl run --resume -o {run_copy}" in out
    assert not any(p.name.startswith(".tmp-") for p in (run_copy / "checkpoints").iterdir())
    assert latest_checkpoint(run_copy).name == "step-2"
    monkeypatch.setattr(torch_engine.torch, "save", real_save)
    code, out = resume(run_copy)
    assert code == 0, out
    assert (run_copy / "final").is_dir() and latest_checkpoint(run_copy).name == "step-3"


def _mount_tmpfs(path: Path, size_kb: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
            check=True,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {getattr(exc, 'stderr', exc)}")


@pytest.mark.slow
def test_disk_full_for_real_on_tmpfs(base_run, tmp_path):
    """A real full disk: the run directory on a tmpfs with room for what exists plus less than a checkpoint."""
    mount = tmp_path / "small"
    used_kb = sum(f.stat().st_size for f in base_run.rglob("*") if f.is_file()) // 1024
    ckpt_kb = sum(f.stat().st_size for f in (base_run / "checkpoints" / "step-2").rglob("*") if f.is_file()) // 1024
    _mount_tmpfs(mount, used_kb + ckpt_kb // 2)
    try:
        run = mount / "run"
        shutil.copytree(base_run, run)
        unfinish(run)
        proc = oxrl("run", "--alg", "sft", "--resume", "--set", "train.max_steps=4", *FAST, "-o", str(run))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert "Traceback" not in out and "unexpected pos" not in out
        assert "disk full at" in out and "MB needed" in out, out
        assert f"the last complete checkpoint {run / 'checkpoints' / 'step-2'} is intact" in out
        assert [c.name for c in list_checkpoints(run)] == ["step-1", "step-2"]
        assert not any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())
        subprocess.run(["mount", "-o", f"remount,size={used_kb * 3}k", str(mount)], check=True)
        proc = oxrl("run", "--alg", "sft", "--resume", "--set", "train.max_steps=4", *FAST, "-o", str(run))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert latest_checkpoint(run).name == "step-3" and (run / "final").is_dir()
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


# ---- item 10: manifests, fallback to the newest complete checkpoint --------------------------------------


def test_checkpoints_carry_a_manifest(base_run):
    ckpt = base_run / "checkpoints" / "step-2"
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    on_disk = {
        str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST
    }
    assert files == on_disk and {"engine.pt", "rng.pt", "trainer_state.json", "model.safetensors"} <= set(files)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c: (c / "engine.pt").write_bytes((c / "engine.pt").read_bytes()[:100]), "engine.pt is truncated"),
        (lambda c: (c / "rng.pt").unlink(), "rng.pt is missing"),
        (lambda c: (c / "trainer_state.json").write_text(""), "trainer_state.json is truncated"),
    ],
)
def test_damaged_checkpoint_is_skipped(run_copy, damage, reason):
    damage(run_copy / "checkpoints" / "step-2")
    assert reason in checkpoint_problem(run_copy / "checkpoints" / "step-2")
    assert [c.name for c in list_checkpoints(run_copy)] == ["step-1"]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (None, None),
        (
            lambda c: (c / "engine.pt").write_bytes((c / "engine.pt").read_bytes()[:100]),
            "engine.pt is truncated or unreadable",
        ),
        (lambda c: (c / "rng.pt").unlink(), "rng.pt is missing"),
        (lambda c: (c / "trainer_state.json").write_text(""), "trainer_state.json is empty or unreadable"),
    ],
)
def test_checkpoint_without_manifest_is_judged_by_its_files(run_copy, damage, reason):
    """Checkpoints from before manifests: complete if their own files are whole."""
    ckpt = run_copy / "checkpoints" / "step-2"
    (ckpt / MANIFEST).unlink()
    if damage is not None:
        damage(ckpt)
    assert checkpoint_problem(ckpt) == reason


def test_resume_falls_back_past_a_damaged_checkpoint(run_copy):
    """--resume with step-2's engine.pt truncated: says so and continues from step-1."""
    ckpt = run_copy / "checkpoints" / "step-2"
    (ckpt / "engine.pt").write_bytes((ckpt / "engine.pt").read_bytes()[:100])
    unfinish(run_copy)
    code, out = resume(run_copy)
    assert code == 0, out
    assert f"skipping checkpoint {ckpt}: engine.pt is truncated" in out
    assert [r["step"] for r in read_metrics(run_copy)] == [1, 2, 3, 4]
    assert (run_copy / "final").is_dir()


def test_resume_refuses_when_no_checkpoint_is_intact(run_copy):
    unfinish(run_copy)
    for ckpt in list_checkpoints(run_copy):
        (ckpt / "rng.pt").unlink()
    proc = oxrl("run", "--alg", "sft", "--resume", "--set", "train.max_steps=4", *FAST, "-o", str(run_copy))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "rng.pt is missing" in out and "no checkpoint to continue from" in out


# ---- a real SIGKILL timed inside a write -------------------------------------------------------------------

KILL_INSIDE = r"""
import os, signal, sys
import oxrl_core.atomic as atomic
import torch

where = os.environ["OXRL_TEST_KILL_IN"]
if where == "summary":  # after the new summary.json is on disk under its temp name, before the rename
    real_replace = atomic.os.replace
    def replace(src, dst):
        if str(dst).endswith("summary.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    atomic.os.replace = replace
else:  # half-way through writing the optimizer state of checkpoint step-2
    real_save = torch.save
    def save(obj, f, *args, **kwargs):
        if str(f).endswith("engine.pt") and "step-2" in str(f):
            with open(f, "wb") as handle:
                handle.write(b"PK\x03\x04 half of a zip")
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)
    torch.save = save
from oxrl_core.cli import main
sys.argv = ["oxrl", *sys.argv[1:]]
main()
"""


def killed_run(tmp_path: Path, where: str, *args: str) -> subprocess.CompletedProcess:
    import os
    import sys

    script = tmp_path / "kill_inside.py"
    script.write_text(KILL_INSIDE)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OXRL_TEST_KILL_IN": where},
    )


@pytest.mark.slow
def test_sigkill_inside_a_write_loses_nothing_and_resume_goes_on(tmp_path, run_copy):
    """A kill between writing the new summary.json and renaming it leaves the old one whole; a kill while
    engine.pt of a checkpoint is half written leaves no checkpoint that resume would trust. Both resume."""
    import signal

    # summary.json: the run finished at step 3; resuming it to 4 is killed as the new summary lands
    before = json.loads((run_copy / "summary.json").read_text())
    proc = killed_run(
        tmp_path, "summary", "run", "--alg", "sft", "--resume", "--set", "train.max_steps=4", *FAST, "-o", str(run_copy)
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert json.loads((run_copy / "summary.json").read_text()) == before
    code, out = resume(run_copy, steps=4)
    assert code == 0, out
    assert json.loads((run_copy / "summary.json").read_text())["steps"] == 4

    # engine.pt: a fresh run is killed while checkpoint step-2's optimizer state is half written
    run = tmp_path / "fresh"
    proc = killed_run(tmp_path, "engine", "run", "--alg", "sft", "--set", "train.max_steps=3", *FAST, "-o", str(run))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [c.name for c in list_checkpoints(run)] == ["step-1"]
    code, out = resume(run, steps=3)
    assert code == 0, out
    assert "Traceback" not in out and "resum" in out.lower()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert (run / "final" / "config.json").is_file()
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_a_kill_between_the_two_renames_of_final_puts_the_old_final_back(run_copy):
    """Publishing over an existing final/ renames it aside, then renames the new one in: a kill between
    the two leaves only `.old-final-PID`; the next start puts it back instead of deleting it."""
    from oxrl_core.run_io.checkpoint import clean_partial

    weights = sorted(p.name for p in (run_copy / "final").iterdir())
    (run_copy / "final").rename(run_copy / ".old-final-4242")
    (run_copy / ".tmp-final-4242").mkdir()
    clean_partial(run_copy)
    assert sorted(p.name for p in (run_copy / "final").iterdir()) == weights
    assert not [p for p in run_copy.iterdir() if p.name.startswith((".old-", ".tmp-"))]
