"""`oxrl doctor`: what this environment can do. It only looks; it installs nothing."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform


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


def checks() -> list[tuple[str, bool, str]]:
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


def table_rows(registry) -> list[tuple[str, bool, str]]:
    """`checks` and a last row for the plugins (how many of each kind; not ok on a load error or a name
    clash): the table `oxrl doctor` prints and `oxrl bug-report` pastes."""
    counts = {kind: len(names) for kind, names in registry.entries.items()}
    ok = not (registry.errors or registry.clash_rows())
    return [*checks(), ("plugins", ok, ", ".join(f"{n} {k}s" for k, n in counts.items()))]
