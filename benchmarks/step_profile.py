"""One SFT step profiled: wall time beside kernel time (`torch.profiler`), host–device syncs, MFU.

SFT of a Qwen2 in Qwen2.5-0.5B's shape (`engine_throughput.save_qwen2_model`, random weights, the built-in
character tokenizer) through `oxrl_core.Trainer` on rows of ~2,000 tokens, ``data.packing``, bf16, the torch
engine. After ``--warmup`` optimiser steps, the next whole step (from one update to the next: collation,
forwards, backward, the step's one read, the update) runs under `torch.profiler`, and the one after it under
``torch.cuda.set_sync_debug_mode("warn")``, whose warnings (one per sync) are counted by the line that made
them. Prints one JSON line:

  step_wall_s     the profiled step's wall time (the profiler's own overhead included)
  kernel_s        the device time of its kernels (CUDA; None on a CPU), kernel_share = kernel_s / step_wall_s
  top_kernels     the 8 kernels with the most device time (CPU: the 8 ops with the most self CPU time)
  syncs           the synchronising calls of the next step (CUDA; None on a CPU, where tests/test_host_syncs.py
                  counts the same calls), sync_sources the lines that made them
  tokens_per_s, mfu   of the steps after the warm-up, from metrics.jsonl (``perf/mfu``: the run's own count)

    python benchmarks/step_profile.py --device cuda                      # Qwen2.5-0.5B shape, 4 x 2,048 tokens
    python benchmarks/step_profile.py --device cpu --toy                 # the code path at toy size
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--toy", action="store_true", help="a toy model and short rows (the CPU check)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    import torch
    from engine_throughput import save_qwen2_model
    from sft_throughput import _filler

    from oxrl_core import Trainer
    from oxrl_core.engines.torch_engine import TorchEngine

    shape = argparse.Namespace(
        vocab_size=1024 if args.toy else 151936,
        hidden_size=64 if args.toy else 896,
        intermediate_size=128 if args.toy else 4864,
        layers=1 if args.toy else 24,
        heads=2 if args.toy else 14,
        kv_heads=1 if args.toy else 2,
        max_length=2048,
    )
    work = Path(tempfile.mkdtemp(prefix="oxrl-step-profile-"))
    model_dir = save_qwen2_model(work / "model", shape)
    rng = random.Random(0)
    prompt, response = (20, 40) if args.toy else (200, 1800)
    rows = [{"prompt": "Continue. " + _filler(rng, prompt), "response": _filler(rng, response)} for _ in range(64)]
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    cuda = args.device == "cuda"
    profiled, syncs = {}, Counter()
    step, updates = TorchEngine.step, []
    state: dict = {}

    def watched(self, *a, **k):
        out = step(self, *a, **k)
        updates.append(time.perf_counter())
        n = len(updates)
        if n == args.warmup:  # the next step runs under the profiler
            state["profiler"] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            )
            state["profiler"].__enter__()
        elif n == args.warmup + 1:
            if cuda:
                torch.cuda.synchronize()
            state["profiler"].__exit__(None, None, None)
            profiled["wall_s"] = updates[-1] - updates[-2]
            profiled["events"] = state["profiler"].key_averages()
            if cuda:  # the step after it: every sync warns once
                state["warnings"] = warnings.catch_warnings(record=True)
                state["caught"] = state["warnings"].__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
        elif n == args.warmup + 2 and cuda:
            torch.cuda.set_sync_debug_mode(0)
            state["warnings"].__exit__(None, None, None)
            for w in state["caught"]:
                if "synchroniz" in str(w.message):
                    syncs[f"{Path(w.filename).name}:{w.lineno}"] += 1
        return out

    TorchEngine.step = watched
    try:
        result = Trainer(
            alg="sft",
            model=str(model_dir),
            data={"train": str(data), "max_length": 2048, "packing": True},
            output_dir=work / "run",
            quiet=True,
            train={"max_steps": args.warmup + 3, "batch_size": 4, "save_every": 0, "precision": "bf16", "lr": 1e-5},
            engine={"device": args.device},
        ).train()
    finally:
        TorchEngine.step = step
    events = profiled["events"]
    if cuda:
        kernel_s = sum(e.self_device_time_total for e in events) / 1e6
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        top_rows = [{"name": e.key, "device_ms": e.self_device_time_total / 1e3, "calls": e.count} for e in top]
    else:
        kernel_s = None
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        top_rows = [{"name": e.key, "cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in top]
    later = result.metrics[args.warmup :]
    print(
        json.dumps(
            {
                "model": f"Qwen2, hidden {shape.hidden_size}, {shape.layers} layers, vocabulary {shape.vocab_size:,}",
                "work": f"4 rows of ~{prompt + response} characters packed, bf16, torch engine",
                "step_wall_s": profiled["wall_s"],
                "kernel_s": kernel_s,
                "kernel_share": None if kernel_s is None else kernel_s / profiled["wall_s"],
                "top_kernels": top_rows,
                "syncs": sum(syncs.values()) if cuda else None,
                "sync_sources": dict(syncs.most_common(8)) if cuda else {},
                "tokens_per_s": sum(r["perf/tokens"] for r in later) / sum(r["perf/step_s"] for r in later),
                "mfu": later[-1].get("perf/mfu"),
            }
        )
    )


if __name__ == "__main__":
    main()
