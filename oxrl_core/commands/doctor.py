"""`oxrl doctor`: what this environment can do. It only looks; it installs nothing, and it never starts a Ray
cluster: given an address (`--ray-address`, else ``$RAY_ADDRESS``) it joins that cluster for a moment and lists
its nodes (`cluster_rows`)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform

from oxrl_core.engines.distributed import resolve_ray_address
from oxrl_core.engines.ray_cluster import Unreachable, probe_nodes

#: how long `oxrl doctor` waits for a Ray cluster to answer (a wrong address can otherwise hang for minutes)
CONNECT_TIMEOUT_S = 30.0

Row = tuple[str, bool, str]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - reported in the torch row
        return False


def checks() -> list[Row]:
    """(component, ok, detail) rows."""
    rows: list[tuple[str, bool, str]] = [("python", True, platform.python_version())]
    try:
        import torch

        cuda = torch.cuda.is_available()
        detail = f"{torch.__version__}; CUDA {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available (CPU only)'}"
        if cuda:
            detail += f"; bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}"
        rows.append(("torch", True, detail))
    except Exception as exc:  # noqa: BLE001 - a broken install fails in any way; doctor reports it as a row
        rows.append(("torch", False, f"cannot import: {exc}"))
    for label, module, dist, why in [
        ("transformers", "transformers", "transformers", "models and tokenizers"),
        ("datasets", "datasets", "datasets", "hub and saved datasets"),
        ("deepspeed", "deepspeed", "deepspeed", "engine.name: deepspeed"),
        ("ray", "ray", "ray", "multi-process / multi-node runs"),
        ("vllm", "vllm", None, "rollout.backend: vllm"),
        ("peft", "peft", "peft", "LoRA"),
        ("torchao", "torchao", "torchao", "train.optimizer: adamw_8bit"),
        ("tensorboard", "tensorboard", "tensorboard", "logging.tensorboard"),
        ("mlflow", "mlflow", None, "logging.mlflow"),
        ("wandb", "wandb", "wandb", "logging.wandb"),
    ]:
        version = (
            _version(dist) if dist else (_version(module) or _version(f"{module}-cpu") or _version(f"{module}-skinny"))
        )
        if version is None:
            rows.append((label, False, f"not installed (needed for {why})"))
            continue
        if module in ("deepspeed", "vllm"):  # heavy imports that fail in interesting ways: try them
            try:
                if module == "deepspeed" and not _cuda():
                    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it here, not in DeepSpeed's import warning
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - a heavy import fails in any way; doctor reports it as a row
                rows.append((label, False, f"{version} installed but import fails: {type(exc).__name__}: {exc}"))
                continue
            if module == "deepspeed":
                from deepspeed.accelerator import get_accelerator

                accelerator = get_accelerator()
                version += f" (accelerator {accelerator.device_name()}, training collectives over {'nccl' if _cuda() else 'gloo'})"
        rows.append((label, True, version))
    return rows


def table_rows(registry) -> list[Row]:
    """`checks` and a last row for the plugins (how many of each kind; not ok on a load error or a name
    clash): the table `oxrl doctor` prints and `oxrl bug-report` pastes."""
    counts = {kind: len(names) for kind, names in registry.entries.items()}
    ok = not (registry.errors or registry.clash_rows())
    return [*checks(), ("plugins", ok, ", ".join(f"{n} {k}s" for k, n in counts.items()))]


# ----------------------------------------------------------------------------- the Ray cluster


def _count(n: float, what: str) -> str:
    n = int(n) if float(n).is_integer() else n
    return f"{n:g} {what}{'' if n == 1 else 's'}"


def cluster_rows(option: str | None = None) -> list[Row]:
    """The Ray cluster at ``option`` (``--ray-address``), else at ``$RAY_ADDRESS``: a summary row ("ray cluster")
    and one row per alive node (its full node id, for ``rollout.actor_placement``; host, IP, CPUs, GPUs; the head
    marked). Without an address: one row that says so (information, not a failure). The cluster is asked from a
    child process, bounded by `CONNECT_TIMEOUT_S`: an address where nothing answers is one not-ok row."""
    address, source = resolve_ray_address(option or "")
    if not source:
        return [
            (
                "ray cluster",
                True,
                "no cluster address given (set RAY_ADDRESS or pass --ray-address); "
                "a run with engine.world_size > 1 or rollout.actors starts a local one",
            )
        ]
    where = f"{address} (from {'--ray-address' if option else source})"
    if address == "local":
        return [
            (
                "ray cluster",
                True,
                f"{where}: 'local' means a new Ray cluster that a run starts for itself, not a cluster to inspect "
                "(pass the address of a running one, or 'auto' for the one started on this machine)",
            )
        ]
    if _version("ray") is None:
        return [("ray cluster", False, f"cannot join {where}: ray is not installed (pip install 'oxrl[ray]')")]
    try:
        nodes = probe_nodes(address, where, CONNECT_TIMEOUT_S)
    except Unreachable as exc:
        return [("ray cluster", False, str(exc))]
    cpus, gpus = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
    rows: list[Row] = [
        ("ray cluster", True, f"{_count(len(nodes), 'node')}, {_count(cpus, 'CPU')}, {_count(gpus, 'GPU')} at {where}")
    ]
    for n in nodes:
        host = f"{n.host} ({n.ip})" if n.host and n.host != n.ip else n.ip
        detail = f"{n.node_id}: {host}, {_count(n.cpus, 'CPU')}, {_count(n.gpus, 'GPU')}"
        rows.append(("ray node (head)" if n.head else "ray node", True, detail))
    return rows
