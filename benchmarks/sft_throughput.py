"""SFT throughput: `oxrl run --alg sft` vs a plain PyTorch loop vs TRL's SFTTrainer.

The same SFT work three ways, in one run, on the CPU:

  (a) oxrl   the real CLI (`oxrl run --alg sft`) in a subprocess, read back from the
             run's metrics.jsonl (`perf/tokens` / `perf/step_s` per step); once with
             `data.packing: true` and once with it off (dynamic padding)
  (b) plain  a hand-written loop: dynamic padding to the longest row of the batch,
             HF loss (`model(labels=...)`), clip-grad-norm 1.0, AdamW
  (c) trl    `trl.SFTTrainer` on the same tokenised rows (`input_ids` + `completion_mask`,
             so the prompt is masked), packing and padding-free off, gradient
             checkpointing off (TRL turns it on by default; oxrl and the plain loop do
             not recompute activations), report_to none, no eval, use_cpu

Workload: the built-in tiny Llama at hidden size 256 with 4 layers (4.25M parameters,
character tokenizer), batch 8, prompt-masked arithmetic chat rows whose token length is
uniform on [60, 250] (a system message of chained arithmetic of random length, the
built-in task question, and a worked answer). All three see the same rows in the same
micro-batches (oxrl's own deterministic order, `BatchPlan(..., group_by_length=False)`),
the same initial weights, lr (constant, no warm-up), weight decay 0, grad clipping 1.0,
fp32, and the same thread count. Throughput counts real (non-pad) tokens only and
skips the first `--warmup` steps. The step-by-step losses of the three are compared
as a check that the work is the same.

Variants (`--only`): oxrl-packed, plain, trl, oxrl-padded (the default set, run in that
order), plus oxrl-grouped (`data.group_by_length: true`, padded; it draws differently
composed micro-batches, so it is reported but not used for the headline) and trl-gc
(TRL with its default gradient checkpointing on). The headline `oxrl` figure is the
faster of oxrl-packed and oxrl-padded.

Noise: on a shared host another job can slow a 2-thread run several-fold for a while.
With `--rounds N` the variants are repeated in alternating order (ABBA) and two figures
are printed: `mean` (Σ tokens / Σ step seconds, median over rounds) and `best` (step k
is the same micro-batch in every round, so Σ tokens / Σ_k min over rounds of step k's
seconds filters out stolen seconds); the headline uses `best` when N > 1.

    python benchmarks/sft_throughput.py                       # 5 + 40 steps, 2 rounds (~3 min on 2 idle cores)
    python benchmarks/sft_throughput.py --rounds 3 --steps 12 --warmup 2   # noisy host
    python benchmarks/sft_throughput.py --only oxrl-packed,oxrl-padded,oxrl-grouped,plain,trl,trl-gc

TRL is a benchmark-only dependency (`pip install trl`); without it the TRL variants are
skipped. Prints tokens/s per variant, `oxrl / plain`, `oxrl / trl`, packing on/off and a
JSON line with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IGNORE = -100
VARIANTS = ("oxrl-packed", "plain", "trl", "oxrl-padded", "oxrl-grouped", "trl-gc")
DEFAULT_VARIANTS = ("oxrl-packed", "plain", "trl", "oxrl-padded")


# ----------------------------------------------------------------------------- workload


def _filler(rng: random.Random, n_chars: int) -> str:
    """Chained arithmetic ('Context: 3+4=7, 7+12=19, 19-5=14, ...') cut to exactly n_chars characters."""
    parts, value = ["Context: "], rng.randint(0, 19)
    while sum(map(len, parts)) < n_chars:
        b = rng.randint(0, 19)
        if rng.random() < 0.5 or value < b:
            parts.append(f"{value}+{b}={value + b}, ")
            value += b
        else:
            parts.append(f"{value}-{b}={value - b}, ")
            value -= b
        if value > 200:
            value = rng.randint(0, 19)
    return "".join(parts)[:n_chars]


def encode_row(tokenizer, row: dict) -> dict:
    """Tokenise one prompt-response row independently of oxrl (checked against oxrl's own tokenisation)."""
    out = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    prompt_ids = list(out if isinstance(out, list) else out["input_ids"])
    completion_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return {
        "input_ids": prompt_ids + completion_ids,
        "labels": [IGNORE] * len(prompt_ids) + completion_ids,
        "completion_mask": [0] * len(prompt_ids) + [1] * len(completion_ids),
    }


def build_rows(tokenizer, n: int, seed: int, lo: int = 60, hi: int = 250) -> list[dict]:
    """Arithmetic chat rows with token lengths uniform on [lo, hi] (char tokenizer: one token per character)."""
    from oxrl_core.data.task import rows as task_rows

    rng = random.Random(seed)
    rows = []
    for base in task_rows("train")[:n]:
        expr = base["prompt"][len("What is ") : -1]
        response = f"{expr} = {base['answer']}. The answer is {base['answer']}."
        target = rng.randint(lo, hi)
        row = {
            "prompt": [{"role": "system", "content": ""}, {"role": "user", "content": base["prompt"]}],
            "response": response,
        }
        need = target - len(encode_row(tokenizer, row)["input_ids"])
        if need < 0:
            raise RuntimeError(f"row too long for the minimum length {lo}")
        row["prompt"][0]["content"] = _filler(rng, need)
        rows.append(row)
    return rows


def setup(workdir: Path, n_rows: int, seed: int, hidden: int, layers: int):
    from transformers import AutoTokenizer

    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_source
    from oxrl_core.models.tiny import save_tiny_model

    model_dir = workdir / "model"
    if not (model_dir / "config.json").exists():
        save_tiny_model(model_dir, hidden_size=hidden, num_layers=layers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = build_rows(tokenizer, n_rows, seed)
    data_file = workdir / "train.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = [encode_row(tokenizer, r) for r in rows]
    # the rows oxrl will train on are exactly ours
    theirs = prepare_examples(load_source(str(data_file), "train"), "prompt_response", tokenizer, 1024).examples
    assert [(e["input_ids"], e["labels"]) for e in theirs] == [(e["input_ids"], e["labels"]) for e in examples]
    return model_dir, data_file, tokenizer, examples


def batch_order(examples: list[dict], batch_size: int, seed: int, steps: int) -> list[list[int]]:
    """The micro-batches oxrl draws (its deterministic plan, no length grouping); used by (b) and (c) too."""
    from oxrl_core.data.batching import BatchPlan

    plan = BatchPlan([len(e["input_ids"]) for e in examples], batch_size, seed, group_by_length=False)
    return [plan.micro_batch(k) for k in range(steps)]


# ----------------------------------------------------------------------------- (a) oxrl CLI


def oxrl_command() -> list[str]:
    exe = Path(sys.executable).with_name("oxrl")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("oxrl")
    return [found] if found else [sys.executable, "-m", "oxrl_core.cli"]


def _result(step_tokens: list[int], step_s: list[float], losses: list[float], **extra) -> dict:
    tokens, seconds = sum(step_tokens), sum(step_s)
    return {
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "step_tokens": step_tokens,
        "step_s": step_s,
        "losses": losses,
        **extra,
    }


def run_oxrl(
    args, model_dir: Path, data_file: Path, workdir: Path, packing: bool, tag: str, group_by_length: bool = False
) -> dict:
    out_dir = workdir / f"oxrl-{tag}"
    shutil.rmtree(out_dir, ignore_errors=True)
    sets = {
        "model.name": str(model_dir),
        "data.train": str(data_file),
        "data.packing": str(packing).lower(),
        "data.group_by_length": str(group_by_length).lower(),
        "train.max_steps": args.warmup + args.steps,
        "train.batch_size": args.batch_size,
        "train.lr": args.lr,
        "train.lr_scheduler": "constant",
        "train.warmup_steps": 0,
        "train.weight_decay": 0.0,
        "train.max_grad_norm": 1.0,
        "train.precision": "fp32",
        "train.seed": args.seed,
        "engine.device": "cpu",
    }
    cmd = oxrl_command() + ["run", "--alg", "sft", "--quiet", "--output-dir", str(out_dir)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    for extra in args.set:
        cmd += ["--set", extra]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "CUDA_VISIBLE_DEVICES": "",
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"oxrl run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = [r for r in records if r["step"] > args.warmup]
    return _result(
        [r["perf/tokens"] for r in measured],
        [r["perf/step_s"] for r in measured],
        [r["loss"] for r in records],
        wall_s=wall,
    )


# ----------------------------------------------------------------------------- (b) plain loop


def run_plain(args, model_dir: Path, examples: list[dict], batches: list[list[int]], pad_id: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, step_tokens, step_s = [], [], []
    for k, idx in enumerate(batches):
        t0 = time.perf_counter()
        rows = [examples[i] for i in idx]
        width = max(len(r["input_ids"]) for r in rows)
        input_ids = torch.tensor([r["input_ids"] + [pad_id] * (width - len(r["input_ids"])) for r in rows])
        labels = torch.tensor([r["labels"] + [IGNORE] * (width - len(r["labels"])) for r in rows])
        attention_mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        dt = time.perf_counter() - t0
        if k >= args.warmup:
            step_tokens.append(int(attention_mask.sum()))
            step_s.append(dt)
    return _result(step_tokens, step_s, losses)


# ----------------------------------------------------------------------------- (c) TRL


def run_trl(
    args,
    model_dir: Path,
    examples: list[dict],
    batches: list[list[int]],
    tokenizer,
    workdir: Path,
    gradient_checkpointing: bool = False,
) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    order = [i for idx in batches for i in idx]  # read sequentially: TRL's batch k is oxrl's micro-batch k
    dataset = Dataset.from_list(
        [{"input_ids": examples[i]["input_ids"], "completion_mask": examples[i]["completion_mask"]} for i in order]
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = SFTConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_steps=len(batches),
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=gradient_checkpointing,  # TRL's default is True; False = the same work as (a), (b)
        bf16=False,
        fp16=False,
        use_cpu=True,
        packing=False,
        padding_free=False,
        completion_only_loss=True,
        max_length=1024,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        report_to="none",
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,  # oxrl logs every step too
        disable_tqdm=True,
        seed=args.seed,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.losses = [], []

        def on_train_begin(self, *a, **k):
            self.begin = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    clock = Clock()
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.train()
    # step k's time = end(k) - end(k-1): includes fetching/collating its batch, like oxrl's perf/step_s
    ends = [clock.begin] + clock.ends
    step_s = [ends[k + 1] - ends[k] for k in range(args.warmup, len(batches))]
    step_tokens = [sum(len(examples[i]["input_ids"]) for i in idx) for idx in batches[args.warmup :]]
    return _result(step_tokens, step_s, clock.losses)


# ----------------------------------------------------------------------------- main


def run_variant(v: str, rnd: int, args, model_dir, data_file, workdir, examples, batches, tokenizer) -> dict:
    if v == "oxrl-packed":
        return run_oxrl(args, model_dir, data_file, workdir, True, f"packed-{rnd}")
    if v == "oxrl-padded":
        return run_oxrl(args, model_dir, data_file, workdir, False, f"padded-{rnd}")
    if v == "oxrl-grouped":
        return run_oxrl(args, model_dir, data_file, workdir, False, f"grouped-{rnd}", group_by_length=True)
    if v == "plain":
        return run_plain(args, model_dir, examples, batches, tokenizer.pad_token_id)
    if v == "trl":
        return run_trl(args, model_dir, examples, batches, tokenizer, workdir)
    if v == "trl-gc":
        return run_trl(args, model_dir, examples, batches, tokenizer, workdir, gradient_checkpointing=True)
    raise ValueError(v)


def summarise(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Two estimates of tokens/s per variant.

    mean: Σ tokens / Σ step seconds over the measured steps of a round, median over rounds.
    best: Σ tokens / Σ_k min over rounds of step k's seconds. Step k is the same micro-batch in every
          round (and, but for oxrl-grouped, in every variant), so this filters out the seconds a shared
          host stole from some steps; with one round it equals `mean`.
    """
    out = {}
    for v, rs in results.items():
        best_s = [min(col) for col in zip(*(r["step_s"] for r in rs))]
        out[v] = {
            "mean": statistics.median(r["tokens_per_s"] for r in rs),
            "best": sum(rs[0]["step_tokens"]) / sum(best_s),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up steps per variant (not measured)")
    ap.add_argument("--rounds", type=int, default=2, help="repeat the variants, alternating order (ABBA)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--only",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an extra oxRL config override (repeatable)"
    )
    ap.add_argument("--workdir", default="", help="keep model/data/runs here (default: a temp dir, removed)")
    args = ap.parse_args()
    variants = [v for v in args.only.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    if any(v.startswith("trl") for v in variants):
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: skipping the TRL variants (pip install trl)")
            variants = [v for v in variants if not v.startswith("trl")]

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bar()

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="oxrl-sft-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    total_steps = args.warmup + args.steps
    n_rows = max(512, total_steps * args.batch_size)
    t_start = time.perf_counter()
    try:
        model_dir, data_file, tokenizer, examples = setup(workdir, n_rows, args.seed, args.hidden_size, args.layers)
        batches = batch_order(examples, args.batch_size, args.seed, total_steps)
        lengths = [len(examples[i]["input_ids"]) for idx in batches for i in idx]
        padded = sum(max(len(examples[i]["input_ids"]) for i in idx) * len(idx) for idx in batches)
        print(
            f"workload: Llama h={args.hidden_size} L={args.layers}, batch {args.batch_size}, {args.warmup}+{args.steps} steps, "
            f"row tokens {min(lengths)}-{max(lengths)} (mean {statistics.mean(lengths):.0f}), "
            f"real/padded tokens {sum(lengths) / padded:.2f}, threads {args.threads}, torch {torch.__version__}",
            flush=True,
        )
        results: dict[str, list[dict]] = {v: [] for v in variants}
        for rnd in range(args.rounds):
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                res = run_variant(v, rnd, args, model_dir, data_file, workdir, examples, batches, tokenizer)
                results[v].append(res)
                print(
                    f"  round {rnd + 1} {v:12s} {res['tokens_per_s']:8.1f} tok/s  "
                    f"({res['tokens']} tokens in {res['seconds']:.1f}s)",
                    flush=True,
                )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    tps = summarise(results)
    oxrl_variants = [v for v in ("oxrl-packed", "oxrl-padded", "oxrl-grouped") if v in tps]
    figures: dict = {"tokens_per_s": {v: round(x["mean"], 1) for v, x in tps.items()}}
    if args.rounds > 1:
        figures["tokens_per_s_best"] = {v: round(x["best"], 1) for v, x in tps.items()}
    print("\ntokens/s (real tokens; mean = median over rounds of Σtokens/Σseconds; best = per-step best of rounds):")
    for v, x in tps.items():
        print(f"  {v:12s} {x['mean']:8.1f}   best {x['best']:8.1f}")
    print("ratios (mean / best):")
    for ox in oxrl_variants:
        for base in ("plain", "trl"):
            if base in tps:
                r_mean, r_best = tps[ox]["mean"] / tps[base]["mean"], tps[ox]["best"] / tps[base]["best"]
                figures[f"{ox}/{base}"] = round(r_mean, 3)
                if args.rounds > 1:
                    figures[f"{ox}/{base}_best"] = round(r_best, 3)
                print(f"  {ox} / {base}: {r_mean:.3f} / {r_best:.3f}")
    if "trl" in tps and "plain" in tps:
        figures["trl/plain"] = round(tps["trl"]["mean"] / tps["plain"]["mean"], 3)
    if "trl-gc" in tps and "plain" in tps:
        figures["trl-gc/plain"] = round(tps["trl-gc"]["mean"] / tps["plain"]["mean"], 3)
    # headline: the faster of packing on/off (same micro-batches as plain/trl); oxrl-grouped draws other batches
    same_batches = [v for v in ("oxrl-packed", "oxrl-padded") if v in tps]
    if same_batches:
        key = "best" if args.rounds > 1 else "mean"
        fastest = max(same_batches, key=lambda v: tps[v][key])
        figures["oxrl"] = fastest
        if len(same_batches) == 2:
            r = tps["oxrl-packed"][key] / tps["oxrl-padded"][key]
            figures["packed/padded"] = round(r, 3)
            print(f"packing on / off = {r:.3f}: {'packing' if r > 1 else 'padding'} is faster")
        for base, goal in (("plain", 0.95), ("trl", 1.3)):
            if base in tps:
                r = tps[fastest][key] / tps[base][key]
                figures[f"oxrl/{base}"] = round(r, 3)
                print(
                    f"oxrl / {base} = {r:.3f}  (goal >= {goal}: {'met' if r >= goal else 'NOT met'}; oxrl = {fastest}, {key})"
                )
    # the same work: per-step losses agree (same weights, rows, micro-batches, optimiser)
    if "plain" in results:
        ref = results["plain"][0]["losses"]
        for v, rs in results.items():
            if v not in ("plain", "oxrl-grouped"):
                n = min(len(ref), len(rs[0]["losses"]))
                figures.setdefault("max_loss_diff_vs_plain", {})[v] = float(
                    f"{max(abs(a - b) for a, b in zip(ref[:n], rs[0]['losses'][:n])):.2e}"
                )
    figures["last_loss"] = {v: round(rs[0]["losses"][-1], 5) for v, rs in results.items()}
    figures.update(
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        threads=args.threads,
        script_s=round(time.perf_counter() - t_start, 1),
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
