"""A run's life through the real CLI: the run directory (created, locked, reused), checkpoints by default,
Ctrl-C / SIGTERM (a checkpoint, then exit 130 / 143), and what --resume will and will not continue.

Runs that are signalled use an SFT that the test can hold in the middle of step 3 (`HeldSFT` below, loaded
as ``--alg file.py:Class``): the signal lands mid-step, as in a real run, and at a known step whatever the
machine's load.
In-process runs go through `oxrl_core.cli.main` itself (`cli_main`), so the exit status is the real one.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import oxrl, read_metrics

HELD_ALG = '''
import os
import time

from oxrl_algs_supervised.sft import SFT


class HeldSFT(SFT):
    """SFT that waits inside its third loss (step 3) while the file named by $OXRL_TEST_HOLD exists."""

    name = "held_sft"
    calls = 0

    def loss(self, batch):
        HeldSFT.calls += 1
        hold = os.environ.get("OXRL_TEST_HOLD")
        while hold and HeldSFT.calls == 3 and os.path.exists(hold):
            time.sleep(0.02)
        return super().loss(batch)
'''


# ----------------------------------------------------------------------------- helpers


def cli_main(monkeypatch, capsys, *args: str, cwd: Path | None = None) -> tuple[int, str]:
    """`oxrl ARGS` in this process, through the console script's `main()`: (exit status, stdout + stderr)."""
    from oxrl_core import cli

    monkeypatch.setattr(sys, "argv", ["oxrl", *args])
    if cwd is not None:
        monkeypatch.chdir(cwd)
    try:
        cli.main()
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def assert_user_error(status: int, output: str, *parts: str) -> None:
    assert status == 2, f"exit {status}\n{output}"
    assert "Traceback" not in output, output
    for part in parts:
        assert part in output, f"{part!r} not in:\n{output}"


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (the lock file aside: it names its last holder)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".oxrl.lock"
    }


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-6, rtol=0, msg=f"tensor {key} differs")


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model_dir) -> dict:
    """A working directory with the held algorithm, a small SFT file and the shared settings."""
    root = tmp_path_factory.mktemp("lifecycle")
    (root / "held.py").write_text(HELD_ALG)
    rows = [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(6) for b in range(6)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={root / 'sft.jsonl'}",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.lr=1e-3",
        "--set",
        "train.lr_scheduler=constant",
    ]
    return {"root": root, "base": base, "held": f"{root / 'held.py'}:HeldSFT"}


def start_held(work: dict, run: Path, *sets: str) -> tuple[subprocess.Popen, Path]:
    """A run in the background that will wait inside step 3 until the returned hold file is removed."""
    hold = run.with_name(run.name + ".hold")
    hold.touch()
    exe = Path(sys.executable).with_name("oxrl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "oxrl_core.cli"]
    proc = subprocess.Popen(
        cmd + ["run", "--alg", work["held"], *work["base"], *sets, "-o", str(run)],
        cwd=work["root"],
        env={**os.environ, "OXRL_TEST_HOLD": str(hold)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, hold


def wait_for_steps(proc: subprocess.Popen, run: Path, steps: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not ((run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= steps):
        assert proc.poll() is None, f"the run ended early:\n{proc.stderr.read()}"
        assert time.time() < deadline, "the run did not reach its steps in time"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- 3: -o that cannot be a run directory


def test_output_dir_that_is_a_file_or_cannot_be_created_is_one_message(tmp_path, tiny_model_dir, monkeypatch, capsys):
    (tmp_path / "taken").write_text("not a directory\n")
    args = ["run", "--alg", "sft", "--set", f"model.name={tiny_model_dir}", "--set", "train.max_steps=1"]
    status, output = cli_main(monkeypatch, capsys, *args, "-o", "taken", cwd=tmp_path)
    assert_user_error(status, output, "--output-dir taken", "is a file, not a directory", "choose another path")
    status, output = cli_main(monkeypatch, capsys, *args, "-o", "taken/run", cwd=tmp_path)
    assert_user_error(status, output, "--output-dir taken/run", "cannot create", "Not a directory", "choose a path")
    assert (tmp_path / "taken").read_text() == "not a directory\n"

    proc = oxrl(*args, "-o", "/proc/oxrl-run", cwd=tmp_path)  # a real process: exit status and no traceback
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--output-dir /proc/oxrl-run: cannot create" in proc.stderr


# ----------------------------------------------------------------------------- 11, 12, 20: lock, SIGTERM, resume


@pytest.fixture(scope="module")
def uninterrupted(work) -> Path:
    from oxrl_core import Trainer

    run = work["root"] / "full"
    overrides = [item for item in work["base"] if item != "--set"] + ["train.max_steps=12", "train.save_every=0"]
    Trainer(alg=work["held"], overrides=overrides, output_dir=run, quiet=True).train()
    return run


@pytest.mark.slow
def test_second_run_in_the_same_dir_is_refused_then_sigterm_saves_and_resume_equals_an_uninterrupted_run(
    work, uninterrupted
):
    """Item 11 (the lock), 12 and 20 (SIGTERM: a checkpoint, exit 143; --resume = an uninterrupted run)."""
    run = work["root"] / "cut"
    first, hold = start_held(
        work, run, "--set", "train.max_steps=12", "--set", "train.save_every=0", "--set", "train.save_minutes=0"
    )
    wait_for_steps(first, run, 2)  # ... and now it waits inside step 3
    before = (run / "config.yaml").read_text()

    second = oxrl("run", "--alg", "sft", *work["base"], "--set", "train.max_steps=3", "-o", str(run), cwd=work["root"])
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert f"{run} is in use by another oxrl run (pid {first.pid} on" in second.stderr
    assert "choose another --output-dir" in second.stderr
    assert (run / "config.yaml").read_text() == before  # the second run wrote nothing

    first.send_signal(signal.SIGTERM)  # mid-step 3: the step finishes, then a checkpoint, then exit 143
    time.sleep(0.2)
    hold.unlink()
    stderr = first.communicate(timeout=120)[1]
    assert first.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert len(read_metrics(run)) == 3
    assert f"interrupted at step 3; checkpoint step-3 saved; resume with: oxrl run --resume -o {run}" in stderr
    assert (run / "checkpoints" / "step-3" / "config.yaml").is_file()  # the config travels with the checkpoint
    assert not (run / "final").exists()

    resumed = oxrl("run", "--resume", "-o", str(run), cwd=work["root"])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {run / 'checkpoints' / 'step-3'}" in resumed.stderr
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 13))
    assert [m["loss"] for m in read_metrics(run)] == pytest.approx(
        [m["loss"] for m in read_metrics(uninterrupted)], abs=1e-6
    )
    assert_same_weights(run / "final", uninterrupted / "final")


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_a_second_ctrl_c_stops_at_once(work, monkeypatch, capsys):
    """Item 20: SIGINT -> checkpoint + 130; SIGINT twice -> out at once, 130, nothing published half-written."""
    run = work["root"] / "ctrl-c"
    proc, hold = start_held(work, run, "--set", "train.max_steps=50", "--set", "train.save_every=0")
    wait_for_steps(proc, run, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    hold.unlink()
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert "interrupted at step 3; checkpoint step-3 saved" in stderr and len(read_metrics(run)) == 3

    twice = work["root"] / "twice"
    proc, hold = start_held(work, twice, "--set", "train.max_steps=50", "--set", "train.save_every=2")
    wait_for_steps(proc, twice, 2)
    while not (twice / "checkpoints" / "step-2").is_dir():  # published by a rename: complete once it exists
        time.sleep(0.02)
    saved = snapshot(twice / "checkpoints" / "step-2")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # still held inside step 3: only an immediate stop ends the process
    stderr = proc.communicate(timeout=60)[1]
    hold.unlink()
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert (
        "stopped at once (Ctrl-C again) during step 3" in stderr
        and f"resume with: oxrl run --resume -o {twice}" in stderr
    )
    assert snapshot(twice / "checkpoints" / "step-2") == saved  # the complete checkpoint is untouched
    assert len(read_metrics(twice)) == 2
    # --resume continues from the complete checkpoint
    status, output = cli_main(
        monkeypatch, capsys, "run", "--resume", "-o", str(twice), "--set", "train.max_steps=4", "-q"
    )
    assert status == 0, output
    assert [m["step"] for m in read_metrics(twice)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_sigterm_to_the_driver_of_a_data_parallel_run_saves_on_every_rank(work):
    """Item 20 on the Ray path: the driver passes the stop to the ranks, which save together at the step's end."""
    run = work["root"] / "dp"
    proc, hold = start_held(
        work,
        run,
        "--set",
        "train.max_steps=50",
        "--set",
        "engine.name=deepspeed",
        "--set",
        "engine.world_size=2",
        "--set",
        "engine.timeout_s=120",
    )
    wait_for_steps(proc, run, 2)  # both ranks now wait inside step 3
    proc.send_signal(signal.SIGTERM)
    while not (run / ".oxrl-stop").exists():  # the driver's request to the ranks (it polls Ray once a second)
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    hold.unlink()
    stderr = proc.communicate(timeout=180)[1]
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr
    assert f"interrupted at step 3; checkpoint step-3 saved; resume with: oxrl run --resume -o {run}" in stderr
    assert (run / "checkpoints" / "step-3" / "trainer_state.json").is_file() and not (run / "final").exists()


def test_signal_before_the_first_step_ends_at_once_and_the_directory_is_reused(work, monkeypatch, capsys):
    """Item 20 (before any step there is nothing to save) and 14 (the retry reuses the directory)."""
    from oxrl_core.run_io import lifecycle

    run = work["root"] / "early"
    monkeypatch.setattr("oxrl_core.run_io.checkpoint.clean_partial", _raise_sigint)  # inside train(), before the loop
    status, output = cli_main(
        monkeypatch, capsys, "run", "--alg", "sft", *work["base"], "--set", "train.max_steps=2", "-o", str(run)
    )
    assert status == 130 and "interrupted before the first step (Ctrl-C); nothing to save" in output, output
    assert "Traceback" not in output
    assert lifecycle.STATE.phase == "setup"
    monkeypatch.undo()
    status, output = cli_main(
        monkeypatch, capsys, "run", "--alg", "sft", *work["base"], "--set", "train.max_steps=2", "-o", str(run)
    )
    assert status == 0, output
    assert [m["step"] for m in read_metrics(run)] == [1, 2]


def _raise_sigint(run_dir):
    os.kill(os.getpid(), signal.SIGINT)


# ----------------------------------------------------------------------------- 12: what --resume refuses


def test_resume_of_a_finished_run_without_checkpoint_refuses_and_keeps_everything(work, monkeypatch, capsys):
    run = work["root"] / "finished"
    args = ["run", "--alg", "sft", *work["base"], "--set", "train.save_every=0", "-q", "-o", str(run)]
    status, output = cli_main(monkeypatch, capsys, *args, "--set", "train.max_steps=2")
    assert status == 0, output
    before = snapshot(run)
    status, output = cli_main(monkeypatch, capsys, "run", "--resume", "-o", str(run), "--set", "train.max_steps=4")
    assert_user_error(
        status, output, f"--resume: {run} finished", "no optimizer state", f"--set model.name={run / 'final'}"
    )
    assert snapshot(run) == before  # final/, metrics.jsonl, summary.json untouched

    # steps logged, then killed before any checkpoint: --resume would start over on top of them
    (run / "final").rename(run / "final-moved")
    (run / "summary.json").unlink()
    status, output = cli_main(monkeypatch, capsys, "run", "--resume", "-o", str(run), "--set", "train.max_steps=4")
    assert_user_error(status, output, "logged 2 steps but holds no checkpoint", "overwrite its metrics.jsonl")
    assert len(read_metrics(run)) == 2


# ----------------------------------------------------------------------------- 13: --resume keeps what the checkpoint is


@pytest.fixture(scope="module")
def checkpointed(work) -> Path:
    """A 3-step run with a checkpoint at step 2 (its own data, not the default task)."""
    from oxrl_core import Trainer

    run = work["root"] / "ckpt-run"
    overrides = [item for item in work["base"] if item != "--set"] + ["train.max_steps=3", "train.save_every=2"]
    Trainer(alg="sft", overrides=overrides, output_dir=run, quiet=True).train()
    return run


def test_resume_without_config_yaml_uses_the_checkpoints_copy(work, checkpointed, tmp_path, monkeypatch, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(checkpointed, run)
    (run / "config.yaml").unlink()
    status, output = cli_main(
        monkeypatch, capsys, "run", "--resume", "-o", str(run), "--set", "train.max_steps=4", "-q"
    )
    assert status == 0, output
    assert f"using the copy stored in {run / 'checkpoints' / 'step-2'}" in output
    config = (run / "config.yaml").read_text()
    assert f"train: {work['root'] / 'sft.jsonl'}" in config and "max_steps: 4" in config  # the run's data, not arith
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]


def test_resume_refuses_a_set_that_changes_what_the_checkpoint_is(work, checkpointed, tmp_path, monkeypatch, capsys):
    import shutil

    run = tmp_path / "identity"
    shutil.copytree(checkpointed, run)
    before = snapshot(run)
    other = work["root"] / "other.jsonl"
    other.write_text('{"prompt": "Hi", "response": "there"}\n' * 8)
    status, output = cli_main(
        monkeypatch,
        capsys,
        "run",
        "--resume",
        "-o",
        str(run),
        "--set",
        f"data.train={other}",
        "--set",
        "train.max_steps=4",
    )
    assert_user_error(
        status,
        output,
        f"changes what {run / 'checkpoints' / 'step-2'} was trained as",
        f"data.train: '{work['root'] / 'sft.jsonl'}' → '{other}'",
        "--force-config",
    )
    assert snapshot(run) == before

    status, output = cli_main(
        monkeypatch,
        capsys,
        "run",
        "--resume",
        "--force-config",
        "-o",
        str(run),
        "--set",
        f"data.train={other}",
        "--set",
        "train.max_steps=4",
        "-q",
    )
    assert status == 0, output
    assert "--force-config: resuming" in output
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- 14: check first, then create; reuse


def test_start_up_failures_happen_before_the_run_directory_exists(work, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    run = tmp_path / "tb"
    args = ["run", "--alg", "sft", *work["base"], "--set", "train.max_steps=2", "-q", "-o", str(run)]
    status, output = cli_main(monkeypatch, capsys, *args, "--set", "logging.tensorboard=true")
    assert_user_error(status, output, "logging.tensorboard", "not installed", "logging.tensorboard=false")
    assert not run.exists()

    # an older oxRL's failed start left config.yaml and an empty metrics.jsonl: the same command reuses the directory
    run.mkdir()
    (run / "config.yaml").write_text("algorithm: sft\n")
    (run / "metrics.jsonl").write_text("")
    status, output = cli_main(monkeypatch, capsys, *args)
    assert status == 0, output
    assert [m["step"] for m in read_metrics(run)] == [1, 2]

    proc = oxrl("run", "--alg", "sft", "--set", "model.name=./no-such-model", "-o", "never", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.name: model directory not found: ./no-such-model" in proc.stderr
    assert not (tmp_path / "never").exists()


# ----------------------------------------------------------------------------- 19: checkpoints by default


def test_checkpoints_by_default_by_steps_or_minutes_newest_kept(work, tmp_path, monkeypatch, capsys):
    from oxrl_core.config import TrainConfig

    defaults = TrainConfig()
    assert (defaults.save_every, defaults.save_minutes, defaults.save_total_limit) == (500, 30.0, 2)
    assert TrainConfig(save_limit=5).save_total_limit == 5  # the old name still works

    run = tmp_path / "minutes"  # save_minutes tiny: every step is due by time, and only the newest 2 stay
    status, output = cli_main(
        monkeypatch,
        capsys,
        "run",
        "--alg",
        "sft",
        *work["base"],
        "--set",
        "train.max_steps=5",
        "--set",
        "train.save_every=0",
        "--set",
        "train.save_minutes=1e-9",
        "-o",
        str(run),
    )
    assert status == 0, output
    assert f"checkpoints every 1e-09 min → {run / 'checkpoints'}, newest 2 kept" in output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3", "step-4"]

    run = tmp_path / "steps"
    status, output = cli_main(
        monkeypatch,
        capsys,
        "run",
        "--alg",
        "sft",
        *work["base"],
        "--set",
        "train.max_steps=5",
        "--set",
        "train.save_every=1",
        "--set",
        "train.save_limit=1",
        "-o",
        str(run),
    )
    assert status == 0, output
    assert f"checkpoints every step or 30 min → {run / 'checkpoints'}, newest 1 kept" in output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]
    assert "save_total_limit: 1" in (run / "config.yaml").read_text()
