"""Tracking sinks in-process: metrics.jsonl on resume, and what the W&B sink hands to wandb."""

import json
import sys
import types

from oxrl_core.config import LoggingConfig
from oxrl_core.tracking import JsonlSink, Tracker


def test_jsonl_resume_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 6):
        sink.log(step, {"loss": float(step)})
    sink.close()
    resumed = JsonlSink(path, resume_step=3)  # killed after step 5, newest checkpoint at step 3
    resumed.log(4, {"loss": 40.0})
    resumed.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_non_finite_values_stay_valid_json(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.log(1, {"loss": float("nan"), "grad_norm": float("inf")})
    sink.close()
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row == {"step": 1, "loss": "nan", "grad_norm": "inf"}


def test_wandb_sink_passes_project_name_config_and_steps(tmp_path, monkeypatch):
    """No W&B account or network here: a stand-in module records what the sink asks of `wandb`."""
    calls = {}

    class FakeRun:
        def log(self, metrics, step):
            calls.setdefault("log", []).append((step, metrics))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    tracker = Tracker(tmp_path, LoggingConfig(wandb=True, wandb_project="proj", run_name="r1"), {"train": {"lr": 0.1}})
    tracker.log(1, {"loss": 0.5})
    tracker.close()
    assert calls["init"] == {"project": "proj", "name": "r1", "dir": str(tmp_path), "config": {"train": {"lr": 0.1}}}
    assert calls["log"] == [(1, {"loss": 0.5})] and calls["finished"]
