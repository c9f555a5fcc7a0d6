"""The LM head, before and after the tiled head: time (one process, alternating) and transient memory (SFT runs).

Two parts, both on the CPU proxies of what a GPU sees (bf16 autocast):

  time    the module path (what oxRL ran for an ``nn.Linear`` head before: 1,024 tokens × the whole
          vocabulary per chunk under activation checkpointing, `token_head._module_stats`) and the
          tiled path (`token_head.head_stats`), one forward + backward each of log π (and the entropy)
          of M tokens, hidden H → V, alternating in one process, best of ``--repeats``; log π of both
          compared. Neither is compiled (nothing to report apart).
  memory  an SFT run (`oxrl_core.Trainer`, ``train.precision=bf16``, 1 step, batch 2) of a Llama with a
          V-token vocabulary (hidden 128, 2 layers, untied), in a fresh process each: the peak resident
          set on 2 rows of ~2,000 tokens minus the same run on rows of ~60 tokens is the transient of
          the long rows — nearly all of it the head's. Per vocabulary and head.

    python benchmarks/lm_head.py                              # both parts, V = 151,936 and 262,208
    python benchmarks/lm_head.py --part time --tokens 3600 --vocab 151936
    python benchmarks/lm_head.py --part memory --heads tiled  # what tests/test_token_head.py asserts

Prints one line per measurement, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- time


def head_time(tokens: int, hidden: int, vocab: int, entropy: bool, repeats: int, tile_tokens: int) -> dict:
    import torch

    from oxrl_core.models import token_head

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    before = token_head.HeadPath(chunk_size=1024)
    tiled = token_head.HeadPath(chunk_size=tile_tokens)

    def module():
        return token_head._module_stats(h, targets, head, before, 0.0, entropy, False, None, None, 1.0)

    def new():
        return token_head.head_stats(h, targets, head, tiled, entropy=entropy)

    def once(fn):
        head.zero_grad(set_to_none=True)
        h.grad = None
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
        (out["logp"].sum() + (out["entropy"].sum() if entropy else 0.0)).backward()
        return time.perf_counter() - start, out["logp"].detach()

    seconds = {"module": [], "tiled": []}
    gap = 0.0
    for _ in range(repeats):
        s_module, logp_module = once(module)
        s_tiled, logp_tiled = once(new)
        seconds["module"].append(s_module)
        seconds["tiled"].append(s_tiled)
        gap = max(gap, float((logp_module - logp_tiled).abs().max()))
    best = {k: min(v) for k, v in seconds.items()}
    return {
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "entropy": entropy,
        "module_s": best["module"],
        "tiled_s": best["tiled"],
        "ratio": best["tiled"] / best["module"],
        "max_logp_gap": gap,
    }


# ----------------------------------------------------------------------------- memory


def _child(args) -> None:
    """SFT runs on each of ``--data``'s files in turn (the short rows first); prints the peak resident set (GB)
    after each as JSON. The short run's model, optimiser and data are freed before the next run builds its own,
    so the growth of the peak is what the longer rows need beyond them."""
    import gc

    import torch

    torch.set_num_threads(args.threads)
    if args.head == "module":
        from oxrl_core.models import token_head

        token_head._tileable = lambda head: None  # every head through the module path: the head before tiling
    from oxrl_core import Trainer

    peaks = []
    for i, data in enumerate(args.data.split(",")):
        Trainer(
            alg="sft",
            model=args.model,
            data={"train": data, "max_length": 4096},
            output_dir=Path(args.out) / str(i),
            quiet=True,
            train={"max_steps": 1, "batch_size": 2, "save_every": 0, "precision": "bf16", "lr": 1e-5},
        ).train()
        gc.collect()
        peaks.append(_peak_gb())
    print(json.dumps({"peak_gb": peaks}))


def _peak_gb() -> float:
    """This process's peak resident set (GB): VmHWM, which starts afresh at exec (``ru_maxrss`` keeps the forking
    parent's, so a child of a big test process would start at its parent's size); ru_maxrss where /proc has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB -> GB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build(workdir: Path, vocab: int) -> tuple[Path, Path, Path]:
    """A V-token Llama (hidden 128, 2 layers) with the built-in character tokenizer, and two data files: 2 rows of
    ~2,000 tokens (a 200-token prompt, masked) and 2 of ~60."""
    import random

    from oxrl_core.models.tiny import build_model, build_tokenizer

    model_dir = workdir / f"model-{vocab}"
    if not model_dir.exists():
        tokenizer = build_tokenizer()
        model = build_model(vocab, hidden_size=128, num_layers=2, max_positions=4096, seed=0)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("abcdefghij ") for _ in range(n))
    long_rows, short_rows = workdir / "long.jsonl", workdir / "short.jsonl"
    long_rows.write_text("".join(json.dumps({"prompt": text(200), "response": text(1800)}) + "\n" for _ in range(2)))
    short_rows.write_text("".join(json.dumps({"prompt": text(20), "response": text(40)}) + "\n" for _ in range(2)))
    return model_dir, long_rows, short_rows


def head_memory(vocab: int, head: str, workdir: Path, threads: int = 1) -> dict:
    """The peak resident set of an SFT step on 2 rows of ~2,000 tokens minus that on 2 rows of ~60 (GB), for
    ``head`` (``tiled`` or ``module``), in one fresh process (the short rows first)."""
    model, long_rows, short_rows = build(workdir, vocab)
    command = [sys.executable, __file__, "--child", "--model", str(model), "--data", f"{short_rows},{long_rows}"]
    command += ["--head", head, "--out", str(workdir / f"run-{vocab}-{head}"), "--threads", str(threads)]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    short_gb, long_gb = json.loads(proc.stdout.strip().splitlines()[-1])["peak_gb"]
    return {"vocab": vocab, "head": head, "long_gb": long_gb, "short_gb": short_gb, "transient_gb": long_gb - short_gb}


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("time", "memory", "both"), default="both")
    parser.add_argument("--tokens", type=int, default=3600)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, nargs="*", default=[151936, 262208])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tile-tokens", type=int, default=2048)
    parser.add_argument("--heads", default="module,tiled")
    parser.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--head", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    import torch

    torch.set_num_threads(args.threads)
    figures = {"time": [], "memory": []}
    if args.part in ("time", "both"):
        for entropy in (False, True):
            row = head_time(args.tokens, args.hidden, args.vocab[0], entropy, args.repeats, args.tile_tokens)
            figures["time"].append(row)
            print(
                f"time   M={row['tokens']} H={row['hidden']} V={row['vocab']} entropy={entropy}: module "
                f"{row['module_s']:.2f} s, tiled {row['tiled_s']:.2f} s, tiled/module {row['ratio']:.2f}x "
                f"(max |Δ log π| {row['max_logp_gap']:.1e})",
                flush=True,
            )
    if args.part in ("memory", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            for vocab in args.vocab:
                for head in args.heads.split(","):
                    row = head_memory(vocab, head, Path(tmp), args.threads)
                    figures["memory"].append(row)
                    print(
                        f"memory V={vocab} {head}: transient {row['transient_gb']:.2f} GB "
                        f"(peak {row['long_gb']:.2f} GB on 2 x ~2,000 tokens, {row['short_gb']:.2f} GB on 2 x ~60)",
                        flush=True,
                    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
