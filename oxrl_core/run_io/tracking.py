"""Where metrics go: `metrics.jsonl` always; TensorBoard, MLflow and W&B when configured."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

from oxrl_core.atomic import write_error, write_text_atomic
from oxrl_core.engines.distributed import is_main
from oxrl_core.errors import OxrlError
from oxrl_core.redact import redact, redact_config
from oxrl_core.run_io.checkpoint import latest_checkpoint


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


class JsonlSink:
    """One JSON object per optimiser step, appended (metrics.jsonl is never rewritten during a run).

    On resume, lines past the checkpoint are dropped, and so is a torn line (a kill or a full disk in the
    middle of an append), with a note: a partial line never stops a resume. An append that fails (disk
    full, I/O error) is cut back to the last whole line and stops the run with one message.
    """

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            write_text_atomic(path, "".join(line + "\n" for line in _kept_lines(path, resume_step)))
        elif resume_step is None:
            write_text_atomic(path, "")
        self.handle = path.open("a")

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in metrics.items()}
        start = self.handle.tell()
        try:
            self.handle.write(json.dumps({"step": step, **clean}) + "\n")
            self.handle.flush()
        except OSError as exc:
            self._cut_back(start)
            last = latest_checkpoint(self.path.parent)
            intact = f"the last complete checkpoint {last} is intact" if last else "no checkpoint was written yet"
            raise write_error(self.path, exc, intact=intact, resume_dir=self.path.parent if last else None) from None

    def _cut_back(self, size: int) -> None:
        """Drop a partial line a failed append left (best effort: the disk may refuse even this)."""
        try:
            self.handle.close()
        except OSError:
            pass  # close flushes the buffered rest of the line, which fails again on a full disk
        try:
            os.truncate(self.path, size)
        except OSError:
            pass  # the resume drops a torn last line anyway

    def close(self) -> None:
        if not self.handle.closed:
            self.handle.close()


def _kept_lines(path: Path, resume_step: int) -> list[str]:
    """metrics.jsonl's lines up to `resume_step`; unreadable lines (a torn last append) dropped with a note."""
    kept, torn = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            torn.append(number)
            continue
        if step <= resume_step:
            kept.append(line)
    if torn:
        print(
            f"note: {path}: dropped {len(torn)} unreadable line(s) (line {', '.join(map(str, torn))}; a write cut "
            "short by a kill or a full disk)",
            file=sys.stderr,
            flush=True,
        )
    return kept


class TensorBoardSink:
    def __init__(self, run_dir: Path, config: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise OxrlError(
                f"logging.tensorboard needs the tensorboard package (pip install 'oxrl[tracking]'): {exc}"
            ) from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _metric_key(key: str) -> str:
    """MLflow's file store keeps a metric per file, so 'loss' and 'loss/nll' would clash: use '_'."""
    return key.replace("/", "_").replace("@", "_at_")


class MLflowSink:
    def __init__(self, run_dir: Path, config: dict, tracking_uri: str, run_name: str):
        try:
            import mlflow
        except ImportError as exc:
            raise OxrlError(f"logging.mlflow needs mlflow (pip install 'oxrl[tracking]'): {exc}") from None
        self.mlflow = mlflow
        user_uri = bool(tracking_uri)
        if not tracking_uri:
            # a local file store next to the run: no server, nothing to set up. MLflow 3 wants an explicit opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            tracking_uri = (run_dir / "mlruns").resolve().as_uri()
        params = {k: str(v)[:500] for k, v in _flatten(config).items()}
        reason = ""
        try:
            mlflow.set_tracking_uri(tracking_uri)
            mlflow.set_experiment("oxrl")
            self.run = mlflow.start_run(run_name=run_name or run_dir.name)
            mlflow.log_params(params)
        except Exception as exc:  # noqa: BLE001 - an unsupported scheme, a refused connection, a missing database driver
            reason = _first_line(exc)
        if reason:
            # raised here, outside the handler: MLflow's exception (whose text holds the URI, password and all)
            # is not chained to ours, so error.log's traceback does not carry it either
            with contextlib.suppress(Exception):
                mlflow.end_run(status="FAILED")
            raise OxrlError(_mlflow_error(tracking_uri, user_uri, reason))

    def log(self, step: int, metrics: dict) -> None:
        numeric = {
            _metric_key(k): float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self.mlflow.log_metrics(numeric, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _first_line(exc: BaseException, limit: int = 240) -> str:
    """An exception's first line, its credentials redacted and its length bounded (for a one-line message):
    a long one is cut after its first sentence (MLflow's go on with a list of schemes and a link)."""
    lines = str(exc).strip().splitlines()
    text = redact(f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": "))
    if len(text) <= limit:
        return text
    end = text.find(". ")
    return text[:end] if 0 < end < limit else text[: limit - 1] + "…"


def _mlflow_error(tracking_uri: str, user_uri: bool, reason: str) -> str:
    """The one message a tracking store MLflow cannot use ends the run with: the setting, the URI without its
    password, MLflow's reason, and what to do."""
    if not user_uri:
        return (
            f"logging.mlflow: MLflow cannot use the local store {tracking_uri} ({reason}); set "
            "logging.mlflow_tracking_uri to a tracking server, or logging.mlflow=false"
        )
    return (
        f"logging.mlflow_tracking_uri: MLflow cannot use {redact(tracking_uri)!r} ({reason}); give a tracking "
        "server (http://host:5000), a local folder (file:///path/mlruns) or nothing (a store in "
        "RUN_DIR/mlruns), or set logging.mlflow=false"
    )


class WandbSink:
    def __init__(self, run_dir: Path, config: dict, project: str, run_name: str):
        try:
            import wandb
        except ImportError as exc:
            raise OxrlError(f"logging.wandb needs wandb (pip install wandb): {exc}") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, name=run_name or run_dir.name, dir=str(run_dir), config=config)

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """Fans one metrics dict out to every configured sink (on rank 0 only in a data-parallel run).

    The config the trackers get has its secrets redacted (`redact_config`): a tracking server shows its
    parameters to everyone who can read the experiment."""

    def __init__(self, run_dir: Path, logging_cfg, config: dict, resume_step: int | None = None):
        self.sinks = []
        if not is_main():  # the other ranks' metrics are reduced into rank 0's
            return
        shared = redact_config(config)  # what leaves the run directory carries no password or key
        try:
            if logging_cfg.tensorboard:
                self.sinks.append(TensorBoardSink(run_dir, shared))
            if logging_cfg.mlflow:
                uri = logging_cfg.mlflow_tracking_uri
                self.sinks.append(MLflowSink(run_dir, shared, uri, logging_cfg.run_name))
            if logging_cfg.wandb:
                self.sinks.append(WandbSink(run_dir, shared, logging_cfg.wandb_project, logging_cfg.run_name))
        except BaseException:
            self.close()
            raise
        # metrics.jsonl last: a tracker that cannot start leaves it as it was (on --resume it is not cut back)
        self.sinks.insert(0, JsonlSink(run_dir / "metrics.jsonl", resume_step))

    def log(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
