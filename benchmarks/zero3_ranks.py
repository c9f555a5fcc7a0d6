"""Wall time and peak memory of the default SFT task under DeepSpeed: ZeRO-3 × 2 ranks beside ZeRO-2 × 2 and ZeRO-3 × 1.

The figures behind the fix of a ZeRO-3 regression: with two ranks, held-out evaluation (rank 0
alone, on whole weights) used to issue a collective from the chunked LM head that paired with rank 1's
parameter gather; the run never finished, rank 0's memory climbing ~13 MB/s. Each configuration is
one real CLI run on the built-in task with its held-out evaluation:

    oxrl run --alg sft --set engine.name=deepspeed --set engine.zero_stage=S --set engine.world_size=N
             --set train.max_steps=4

Measured: the wall time of the whole command (start-up, Ray, evaluation before and after, 4 steps,
final/), and the peak resident set of each training process — the Ray rank actors read from
``/proc/<pid>/status`` (VmHWM) while they live (pids from ``ranks.json``; with one rank, the
``oxrl`` process itself) — summed over ranks. One torch thread per process (a core per rank on 2 cores).

    python benchmarks/zero3_ranks.py                # the three configurations, one run each
    python benchmarks/zero3_ranks.py --repeats 2    # ABBA-style alternation of the order, medians
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"zero3x2": (3, 2), "zero2x2": (2, 2), "zero3x1": (3, 1)}


def _peak_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_one(name: str, root: Path, timeout_s: float) -> dict:
    stage, world = CONFIGS[name]
    out = root / f"{name}-{time.monotonic_ns()}"
    exe = Path(sys.executable).with_name("oxrl")
    cmd = [str(exe), "run", "--alg", "sft", "-q", "-o", str(out), "--set", "train.max_steps=4"]
    cmd += ["--set", "engine.name=deepspeed", "--set", f"engine.zero_stage={stage}"]
    cmd += ["--set", f"engine.world_size={world}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        if time.perf_counter() - start > timeout_s:
            proc.kill()
            return {"config": name, "finished": False, "seconds": timeout_s}
        ranks = out / "ranks.json"
        if world == 1:
            peaks[proc.pid] = max(peaks.get(proc.pid, 0), _peak_kb(proc.pid))
        elif ranks.is_file():
            try:
                for info in json.loads(ranks.read_text()):
                    peaks[info["pid"]] = max(peaks.get(info["pid"], 0), _peak_kb(info["pid"]))
            except (ValueError, KeyError):
                pass
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    stderr = proc.stderr.read()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{stderr[-3000:]}")
    return {"config": name, "finished": True, "seconds": seconds, "peak_gb": sum(peaks.values()) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as not finishing")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="oxrl-zero3-") as tmp:
        for k in range(args.repeats):
            for name in names if k % 2 == 0 else reversed(names):
                results[name].append(run_one(name, Path(tmp), args.timeout))
    rows = []
    for name in names:
        runs = results[name]
        done = [r for r in runs if r["finished"]]
        row = {"config": name, "finished": f"{len(done)}/{len(runs)}"}
        if done:
            row["seconds"] = statistics.median(r["seconds"] for r in done)
            row["peak_gb"] = statistics.median(r["peak_gb"] for r in done)
        rows.append(row)
        seconds = f"{row['seconds']:.1f} s" if done else "did not finish"
        peak = f"{row['peak_gb']:.2f} GB" if done else "-"
        print(f"{name:8s}  finished {row['finished']}  wall {seconds:>14s}  peak RSS (all ranks) {peak}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
