"""No state file of a run directory can run code (issue 43, item 1).

A `.pt` file is a pickle: an object whose ``__reduce__`` returns ``(os.system, ("touch MARKER",))`` runs that command
when it is unpickled with ``weights_only=False``. Each file oxRL reads back on ``--resume`` gets such a payload in
turn (the manifest rewritten to match, as someone editing a shared run would): the resume must exit 2 with one
message naming the file, no traceback, no marker, and the checkpoint left as it was.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import oxrl

from oxrl_core.engines.state_files import UnsafeStateFile, load_state_file
from oxrl_core.errors import OxrlError
from oxrl_core.run_io.checkpoint import write_manifest
from oxrl_core.trainer import code_it_runs

requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install 'oxrl[deepspeed]')"
)
SFT = ["run", "--alg", "sft", "--set", "train.max_steps=2", "--set", "train.save_every=1"]


class Payload:
    """Unpickled without the restriction, it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> None:
    """Replace ``path`` with a payload dressed as a state dict, and re-sign its checkpoint's manifest."""
    torch.save({"state": {0: Payload(marker)}, "torch": torch.zeros(3)}, path)
    ckpt = next(p for p in path.parents if p.name.startswith("step-"))
    write_manifest(ckpt)


def unfinished_copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    shutil.rmtree(to / "final")
    (to / "summary.json").unlink()
    return to


def assert_refused(proc, path: Path, marker: Path) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not marker.exists(), "the payload ran"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"{path}: refused" in proc.stderr and "posix.system" in proc.stderr, proc.stderr
    assert "weights_only" not in proc.stderr, proc.stderr  # never advises turning the protection off
    ckpt = next(p for p in path.parents if p.name.startswith("step-"))
    assert not (ckpt.parents[1] / "final").exists() and (ckpt / "manifest.json").is_file()  # nothing lost or made


# ----------------------------------------------------------------------------- the loader itself


def test_the_loader_refuses_a_payload_and_reads_what_oxrl_writes(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "bad.pt"
    torch.save([1, Payload(marker)], bad)
    with pytest.raises(UnsafeStateFile) as refused:
        load_state_file(bad)
    assert not marker.exists()
    assert str(refused.value).startswith(f"{bad}: refused: it asks to build or call `posix.system`")
    assert "weights_only" not in str(refused.value)
    # what a checkpoint holds loads: tensors, numbers, tuples, the python RNG state
    import random

    good = tmp_path / "good.pt"
    torch.save({"python": random.getstate(), "t": torch.arange(3)}, good)
    assert load_state_file(good)["python"] == random.getstate()
    # a truncated file is named too
    good.write_bytes(good.read_bytes()[:40])
    with pytest.raises(OxrlError, match=f"^{good}: not a readable state file"):
        load_state_file(good)


def test_an_inflight_file_with_a_payload_is_refused_without_torchs_advice(tmp_path):
    from oxrl_core.rl.sources import INFLIGHT_FILE, load_in_flight

    marker = tmp_path / "ran"
    torch.save({"max_staleness": 1, "batches": [Payload(marker)]}, tmp_path / INFLIGHT_FILE)
    with pytest.raises(UnsafeStateFile) as refused:
        load_in_flight(tmp_path, 1, 0, 4)
    assert not marker.exists() and str(refused.value).startswith(f"{tmp_path / INFLIGHT_FILE}: refused")
    assert "weights_only" not in str(refused.value)


def test_a_ranks_own_rng_file_with_a_payload_is_refused(tmp_path, monkeypatch):
    """Rank r > 0 of a data-parallel run reads ``rng-rank{r}.pt`` (the two-rank DeepSpeed runs resume through it)."""
    import json
    from types import SimpleNamespace

    from oxrl_core.engines import distributed
    from oxrl_core.run_io.checkpoint import STATE_FILE, load_training_state, rng_state

    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 1, "engine": {"name": "torch"}}))
    torch.save(rng_state(), tmp_path / "rng.pt")  # rank 0's, well-formed
    marker, path = tmp_path / "ran", tmp_path / "rng-rank1.pt"
    torch.save({"python": Payload(marker)}, path)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    engine = SimpleNamespace(describe=lambda: {"name": "torch"}, load_state=lambda directory: None)
    with pytest.raises(UnsafeStateFile, match=f"^{path}: refused"):
        load_training_state(tmp_path, engine)
    assert not marker.exists()
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    assert load_training_state(tmp_path, engine)["step"] == 1  # rank 0's own file loads


def test_resume_lists_the_code_a_config_runs(tmp_path):
    reward = tmp_path / "r.py"
    raw = {
        "reward": {"name": f"{reward}:Digits"},
        "env": {"name": "calculator", "tool_parser": "my_pkg.parsers:Parser"},
        "model": {"name": "org/model", "trust_remote_code": True},
        "data": {"train": "arith"},
    }
    assert code_it_runs(raw) == [
        f"reward.name={reward}:Digits (Python file {reward})",
        "env.tool_parser=my_pkg.parsers:Parser (module my_pkg.parsers)",
        "model.trust_remote_code=true (the repository code of model.name=org/model)",
    ]
    assert code_it_runs({"reward": {"name": "math"}, "model": {"trust_remote_code": False}}) == []


# ----------------------------------------------------------------------------- the CLI, each file in turn


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("torch") / "run"
    proc = oxrl(*SFT, "-o", str(run), env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rng.pt", "engine.pt"])
def test_torch_engine_resume_refuses_a_payload_in_each_state_file(torch_run, tmp_path, name):
    run = unfinished_copy(torch_run, tmp_path / "run")
    path, marker = run / "checkpoints" / "step-1" / name, tmp_path / "ran"
    plant(path, marker)
    size = path.stat().st_size
    remote = ["--set", "model.trust_remote_code=true"]  # code that runs by design: listed first, even with -q
    proc = oxrl("run", "--resume", "-o", str(run), *remote, "-q", env={"OMP_NUM_THREADS": "1"})
    assert_refused(proc, path, marker)
    listed = "--resume: this config runs code by design: model.trust_remote_code=true"
    assert listed in proc.stderr and proc.stderr.index(listed) < proc.stderr.index(": refused"), proc.stderr
    assert path.stat().st_size == size  # the file is left for the user to look at


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("deepspeed") / "run"
    proc = oxrl(
        *SFT,
        "--set",
        "engine.name=deepspeed",
        "--set",
        "engine.zero_stage=1",
        "-o",
        str(run),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    return run


@requires_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "rng.pt",
        "deepspeed/state/mp_rank_00_model_states.pt",
        "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ],
)
def test_deepspeed_engine_resume_refuses_a_payload_in_each_state_file(deepspeed_run, tmp_path, name):
    run = unfinished_copy(deepspeed_run, tmp_path / "run")
    path, marker = run / "checkpoints" / "step-1" / name, tmp_path / "ran"
    assert path.is_file()
    plant(path, marker)
    proc = oxrl("run", "--resume", "-o", str(run), env={"OMP_NUM_THREADS": "1"})
    assert_refused(proc, path, marker)


@requires_deepspeed
@pytest.mark.slow
def test_the_allow_list_holds_every_class_deepspeed_writes(deepspeed_run):
    """DeepSpeed's own files (ZeRO-1: the loss scaler, the stage enum, fragment addresses) load through the
    allow-list, so a resume of an untouched checkpoint is not refused (test_deepspeed resumes ZeRO-3 runs)."""
    from oxrl_core.engines.state_files import deepspeed_allowed

    files = sorted((deepspeed_run / "checkpoints" / "step-1" / "deepspeed" / "state").glob("*.pt"))
    assert len(files) == 2
    for path in files:
        assert isinstance(load_state_file(path, deepspeed_allowed()), dict)
