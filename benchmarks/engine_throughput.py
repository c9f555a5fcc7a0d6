"""Training tokens/s and MFU of `oxrl run` for SFT and SGRPO, `torch` vs `deepspeed` engine.

For the README's performance section on a GPU (bf16): each (algorithm, engine) pair is one real
`oxrl run` on the built-in Llama architecture at `--hidden-size` × `--layers` (random weights,
character tokenizer, head_dim 64) and the built-in task's data; the first `--warmup` steps are
skipped and the median of the rest of `perf/tokens_per_s` and `perf/mfu` (oxrl_core/models/perf.py:
(4 + 2f)·N + 12·L·H·T FLOPs per token over the device's dense bf16 peak) is printed. SGRPO's
figure is its update phase (`perf/train_s`); its generation runs on the `hf` backend.

    python benchmarks/engine_throughput.py --hidden-size 2048 --layers 16     # ~1B parameters, GPU
    OXRL_PEAK_TFLOPS=0.2 python benchmarks/engine_throughput.py               # CPU, with a stated peak

Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(workdir: Path, model_dir: Path, alg: str, engine: str, args) -> dict:
    out = workdir / f"{alg}-{engine}"
    sets = {
        "model.name": model_dir,
        "train.max_steps": args.warmup + args.steps,
        "train.batch_size": args.batch_size,
        "train.eval_every": 0,
        "train.save_every": 0,
        "data.max_length": args.max_length,
        "engine.name": engine,
        "model.gradient_checkpointing": str(args.checkpointing).lower(),
    }
    if engine == "deepspeed":
        sets["engine.zero_stage"] = args.zero_stage
    if alg == "sgrpo":
        sets.update({"rollout.n": args.n, "rollout.max_new_tokens": args.max_new_tokens})
    cmd = [sys.executable, "-m", "oxrl_core.cli", "run", "--alg", alg, "-q", "-o", str(out)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    if alg == "sgrpo":  # the update phase only
        rates = [m["perf/tokens"] / m["perf/train_s"] for m in metrics]
    else:
        rates = [m["perf/tokens_per_s"] for m in metrics]
    mfus = [m["perf/mfu"] for m in metrics if "perf/mfu" in m]
    return {"tokens_per_s": statistics.median(rates), "mfu": statistics.median(mfus) if mfus else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--n", type=int, default=4, help="SGRPO samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true", help="model.gradient_checkpointing")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--engines", default="torch,deepspeed")
    parser.add_argument("--algs", default="sft,sgrpo")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from oxrl_core.models.tiny import save_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / "model", hidden_size=args.hidden_size, num_layers=args.layers, seed=0)
        params = sum(t.numel() for f in model_dir.glob("*.safetensors") for t in load_file(str(f)).values())
        for alg in args.algs.split(","):
            for engine in args.engines.split(","):
                results[f"{alg}/{engine}"] = run(Path(tmp), model_dir, alg, engine, args)
                print(f"{alg:<6} {engine:<10} {results[f'{alg}/{engine}']}", flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(
        json.dumps(
            {
                "device": device,
                "params": params,
                "hidden_size": args.hidden_size,
                "layers": args.layers,
                "peak_override_tflops": os.environ.get("OXRL_PEAK_TFLOPS"),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
