"""Asynchronous rollouts against the synchronous step, side by side in one run:

    python benchmarks/async_rl.py                          # built-in-size model, CPU, k = 0 and k = 1
    python benchmarks/async_rl.py --ks 0 1 2 --steps 12 --device cuda --hidden-size 1024 --layers 16 --max-new-tokens 256

SGRPO with one rollout actor (the `hf` backend in a Ray actor) on the built-in arithmetic task, one seed, one
model: each side runs `rollout.max_staleness` = k for ``--steps`` steps (every side one run of the same length, in
the order given). Reported per side: the training wall time (`summary.json` train_seconds, no
held-out evaluation), steps/s, the mean phase seconds — `perf/gen_s` (generation and scoring; in an async run the
worker's), `perf/gen_wait_s` (the trainer waiting for its batch), `perf/train_s` — the trainer's idle share, the
share of generation hidden behind training, the speedup against k = 0 and against the sum of its own phases, and
the reward per step. Figures are reported, never asserted. Overlap can hide at most the smaller of generation
and training time, and on a CPU the actor and the trainer share the same cores, so expect little there; on a GPU
the actor and the trainer share one device unless Ray sees more.

The last line of stdout is one JSON object (benchmarks/gpu_check.py reads it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def run_side(k: int, model_dir: Path, data_file: Path, args, workdir: Path) -> dict:
    from oxrl_core import Trainer

    start = time.perf_counter()
    result = Trainer(
        alg="sgrpo", model=str(model_dir), data={"train": str(data_file)}, output_dir=workdir / f"k{k}",
        quiet=True, engine={"device": args.device}, reward={"name": f"{BENCH / 'grpo_step.py'}:BenchReward"},
        train={"max_steps": args.steps, "batch_size": args.batch_size, "seed": 0, "eval_every": 0, "save_every": 0,
               "save_minutes": 0, "lr": 1e-4},
        rollout={"actors": 1, "max_staleness": k, "n": args.n, "max_new_tokens": args.max_new_tokens},
    ).train()  # fmt: skip
    wall = time.perf_counter() - start
    summary = json.loads((workdir / f"k{k}" / "summary.json").read_text())
    m = result.metrics

    def mean(key: str) -> float:
        values = [r[key] for r in m if key in r]
        return round(statistics.fmean(values), 4) if values else 0.0

    # generation inside the steps only (batches made during start-up fall in none); sync runs generate in train
    phases = sum(
        r.get("perf/gen_in_step_s", r.get("perf/gen_s", 0)) + r.get("perf/reward_s", 0) + r["perf/train_s"] for r in m
    )
    steps_s = sum(r["perf/step_s"] for r in m)
    return {
        "k": k,
        "train_seconds": round(summary["train_seconds"], 2),
        "run_seconds": round(wall, 2),
        "steps_per_s": round(len(m) / summary["train_seconds"], 3),
        "gen_s": mean("perf/gen_s"),
        "gen_wait_s": mean("perf/gen_wait_s"),
        "train_s": mean("perf/train_s"),
        "idle_share": round(sum(r.get("perf/gen_wait_s", r.get("perf/gen_s", 0)) for r in m) / steps_s, 3),
        "overlap_share": mean("perf/overlap_share"),
        "speedup_vs_phases": round(phases / steps_s, 3),
        "staleness_mean": mean("policy/staleness_mean"),
        "rewards": [round(r["reward/mean"], 4) for r in m],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1], help="rollout.max_staleness of each side")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dry-run", action="store_true", help="toy size (3 steps), for the command's own test")
    args = parser.parse_args()
    if args.dry_run:
        # the tiny model's hidden size: a multiple of 64 (head_dim 64)
        args.steps, args.batch_size, args.n, args.max_new_tokens, args.hidden_size, args.layers = 3, 2, 2, 4, 64, 1

    from oxrl_core.data.task import rows as task_rows
    from oxrl_core.hf_env import quiet_transformers
    from oxrl_core.models.tiny import save_tiny_model

    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="oxrl-async-bench-") as tmp:
        workdir = Path(tmp)
        model_dir = save_tiny_model(workdir / "model", hidden_size=args.hidden_size, num_layers=args.layers, seed=0)
        data_file = workdir / "prompts.jsonl"  # the arithmetic task's prompts, no held-out split (no evaluation)
        rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in task_rows("train")[:256]]
        data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        import ray

        from oxrl_core.engines.ray_cluster import join_ray

        # one Ray cluster for every side (each run joins it and leaves it running): no side pays for its start
        join_ray("", log_to_driver=False)
        try:
            sides = [run_side(k, model_dir, data_file, args, workdir) for k in args.ks]
        finally:
            ray.shutdown()
    base = next((s for s in sides if s["k"] == 0), None)
    for s in sides:
        s["speedup_vs_k0"] = round(base["train_seconds"] / s["train_seconds"], 3) if base else None
        print(
            f"k={s['k']}: {s['train_seconds']:.1f} s ({s['steps_per_s']:.2f} steps/s), gen {s['gen_s']:.3f} s, "
            f"wait {s['gen_wait_s']:.3f} s, train {s['train_s']:.3f} s per step; idle {s['idle_share']:.0%}, "
            f"overlap {s['overlap_share']:.0%}; speedup vs k=0 {s['speedup_vs_k0']}, vs its phases "
            f"{s['speedup_vs_phases']}",
            file=sys.stderr,
        )
    setup = {k: getattr(args, k) for k in ("steps", "batch_size", "n", "max_new_tokens", "hidden_size", "layers")}
    print(json.dumps({"setup": {**setup, "device": args.device}, "sides": sides}))


if __name__ == "__main__":  # Ray workers import this file's module; nothing runs on import
    main()
