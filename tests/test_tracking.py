"""Tracking sinks in-process: metrics.jsonl on resume, and what the W&B sink hands to wandb."""

import json
import sys
import types

import pytest

from oxrl_core.config import LoggingConfig
from oxrl_core.run_io.tracking import JsonlSink, Tracker


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


def test_a_tracking_uri_mlflow_rejects_is_one_message_and_loses_no_metrics(tmp_path):
    """MLflow refuses the URI (a database scheme it cannot use): one `OxrlError` naming the setting, the
    password redacted, MLflow's exception (which quotes the URI) not chained into error.log, and on a resume
    metrics.jsonl is not cut back to the checkpoint: the run can be resumed again once the URI is fixed."""
    from oxrl_core.errors import OxrlError
    from oxrl_core.run_io import lifecycle

    uri = "postgresql://user:Pw0rd-secret@db.example.com:5432/mlflow"
    metrics = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(metrics)
    logging_cfg = LoggingConfig(mlflow=True, mlflow_tracking_uri=uri)
    with pytest.raises(OxrlError) as caught:
        with lifecycle.error_log(tmp_path):
            Tracker(tmp_path, logging_cfg, {"logging": {"mlflow_tracking_uri": uri}}, resume_step=3)
    message = str(caught.value)
    assert message.startswith("logging.mlflow_tracking_uri: MLflow cannot use 'postgresql://user:<redacted>@db.")
    assert "Pw0rd-secret" not in message and "\n" not in message
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    log = (tmp_path / lifecycle.ERROR_LOG).read_text()
    assert "OxrlError: logging.mlflow_tracking_uri" in log and "Pw0rd-secret" not in log
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
