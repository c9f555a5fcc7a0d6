"""Training tokens/s and MFU of `oxrl run` for SFT and SGRPO, `torch` vs `deepspeed` engine.

For the README's performance section on a GPU (bf16): each (algorithm, engine) pair is one real
`oxrl run` on the built-in Llama architecture at `--hidden-size` × `--layers` (random weights,
character tokenizer, head_dim 64) and the built-in task's data; the first `--warmup` steps are
skipped and the median of the rest of `perf/tokens_per_s` and `perf/mfu` (oxrl_core/models/perf.py:
(4 + 2f)·N·tokens + 12·L·H·Σᵢ Tᵢ² FLOPs a step, each packed sequence on its own, over the device's dense
bf16 peak) is printed. SGRPO's
figure is its update phase (`perf/train_s`); its generation runs on the `hf` backend.

    python benchmarks/engine_throughput.py --hidden-size 2048 --layers 16     # ~1B parameters, GPU
    OXRL_PEAK_TFLOPS=0.2 python benchmarks/engine_throughput.py               # CPU, with a stated peak
    python benchmarks/engine_throughput.py --arch qwen2 --algs sft            # Qwen2.5-0.5B's shape (494M), GPU

`--arch qwen2` builds a Qwen2 (`Qwen2ForCausalLM`, random weights) instead, by default in
Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, a
151,936-token vocabulary, tied embeddings (494M parameters); the character tokenizer uses only
its first ids. `--hidden-size`, `--layers`, `--heads`, `--kv-heads`, `--intermediate-size` and
`--vocab-size` change the shape. `--set KEY=VALUE` adds an `oxrl run` override (after the
script's own, so it wins: e.g. `data.train=rows.jsonl`, `train.precision=bf16`); `--json-out`
also writes the JSON line to a file.

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
    for item in args.set:  # the caller's overrides come last: they win
        cmd += ["--set", item]
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


#: --arch qwen2's default shape: Qwen2.5-0.5B's (config.json of Qwen/Qwen2.5-0.5B)
QWEN2_05B = {
    "hidden_size": 896,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151_936,
}


def save_qwen2_model(path: Path, args) -> Path:
    """A random-weight Qwen2 (tied embeddings, rope θ 1e6 as Qwen2.5) with the built-in character tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oxrl_core.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    if args.vocab_size < len(tokenizer):
        raise SystemExit(f"--vocab-size must be at least the tokenizer's {len(tokenizer)} tokens")
    config = Qwen2Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.max_length, 4096),
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama", help="the model built (see above)")
    parser.add_argument("--hidden-size", type=int, default=None, help="default: 256 (llama), 896 (qwen2)")
    parser.add_argument("--layers", type=int, default=None, help="default: 4 (llama), 24 (qwen2)")
    parser.add_argument("--heads", type=int, default=None, help="qwen2: attention heads (default 14)")
    parser.add_argument("--kv-heads", type=int, default=None, help="qwen2: key/value heads (default 2)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="qwen2: MLP width (default 4864)")
    parser.add_argument("--vocab-size", type=int, default=None, help="qwen2: vocabulary rows (default 151936)")
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
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an extra `oxrl run` override (repeatable)"
    )
    parser.add_argument("--json-out", default="", help="also write the JSON line to this file")
    args = parser.parse_args()
    if args.arch == "llama":
        if any(getattr(args, k) is not None for k in ("heads", "kv_heads", "intermediate_size", "vocab_size")):
            parser.error("--heads, --kv-heads, --intermediate-size and --vocab-size go with --arch qwen2")
        args.hidden_size = 256 if args.hidden_size is None else args.hidden_size
        args.layers = 4 if args.layers is None else args.layers
    else:
        for key, value in QWEN2_05B.items():
            if getattr(args, key) is None:
                setattr(args, key, value)

    import torch
    from safetensors.torch import load_file

    from oxrl_core.models.tiny import save_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.arch == "qwen2":
            model_dir = save_qwen2_model(Path(tmp) / "model", args)
        else:
            model_dir = save_tiny_model(
                Path(tmp) / "model", hidden_size=args.hidden_size, num_layers=args.layers, seed=0
            )
        params = sum(t.numel() for f in model_dir.glob("*.safetensors") for t in load_file(str(f)).values())
        for alg in args.algs.split(","):
            for engine in args.engines.split(","):
                results[f"{alg}/{engine}"] = run(Path(tmp), model_dir, alg, engine, args)
                print(f"{alg:<6} {engine:<10} {results[f'{alg}/{engine}']}", flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    figures = {
        "device": device,
        "params": params,
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "peak_override_tflops": os.environ.get("OXRL_PEAK_TFLOPS"),
        "results": results,
    }
    if args.arch != "llama":  # the default JSON line stays as it was
        figures.update(
            arch=args.arch,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
        )
    print(json.dumps(figures))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures) + "\n")


if __name__ == "__main__":
    main()
