"""DPO throughput: `oxrl run --alg dpo` vs TRL's DPOTrainer, optimiser steps per second.

The same DPO work two ways, in one run, on the CPU:

  (a) oxrl  the real CLI (`oxrl run --alg dpo`) in a subprocess, read back from the run's
            metrics.jsonl (`perf/step_s`, `perf/tokens`, `loss`, `grad_norm` per step); the
            reference is `model.ref` empty = a frozen copy of the policy's initial weights.
            oxrl-padded: `data.packing: false` (the 2B sequences of a micro-batch padded to
            the longest); oxrl-packed: `data.packing: true` (one padding-free row in which the
            chosen and rejected responses of a pair share one copy of their prompt)
  (b) trl   `trl.DPOTrainer` (1.16) with `ref_model=None`, for which TRL loads its own copy of
            the policy from the same directory (same dtype and attention implementation);
            `padding_free=False` (its default; TRL 1.16 forces it off anyway: "temporarily
            unavailable after a refactor"), so there is no padding-free TRL variant.
            Timed by a TrainerCallback: step k = on_step_begin -> on_step_end (forward and
            backward of policy + reference, clipping, optimiser); TRL collates the batch before
            on_step_begin, so unlike oxrl's perf/step_s its figure excludes collation. The
            end-to-end interval on_step_end(k-1) -> on_step_end(k), which includes collation and
            TRL's per-step logging, is printed too (`trl (e2e)`).

Workload: the built-in tiny Llama at hidden size 256 with 4 layers (character tokenizer with
a chat template), fp32, batch 8 pairs, grad accumulation 1. Preference rows shaped like a real
set (seeded): a conversational prompt (a system message of chained arithmetic + the built-in
task question) of 60-250 tokens after the chat template, a chosen worked answer and a rejected
one with a wrong answer, each 20-120 tokens (EOS included), lengths drawn independently. Both
sides see the same pairs in the same micro-batches (oxrl's deterministic order,
`BatchPlan(..., group_by_length=False)`; TRL reads a dataset already in that order with
`train_sampling_strategy="sequential"`), the same token ids (TRL's own tokenisation of the
conversational rows is asserted equal to oxrl's: prompt via the chat template with the
generation prompt, completion + EOS, no BOS), the same initial weights for policy and
reference, loss sigmoid, beta 0.1, lr constant (no warm-up), weight decay 0, grad clipping 1.0,
no gradient checkpointing (TRL's default is on), bf16/fp16 off (TRL defaults bf16 on),
max_length None on the TRL side (nothing truncated; oxrl's 1024 truncates nothing here),
reference log-probs computed per step (not precomputed), no eval, logging every step, the
same thread count. Step 1 loss is log 2 on both sides (policy == reference); the per-step
losses and grad norms of the two are compared as a check that the work is the same.

Figures: steps/s = measured steps / Σ step seconds (the first `--warmup` steps skipped), and
tokens/s = the policy's real tokens (Σ 2·prompt + chosen + rejected) / Σ step seconds. The
headline `oxrl` is the faster of oxrl-padded and oxrl-packed. With `--rounds N` the variants are
repeated in alternating order (ABBA); `mean` is the median over rounds and `best` uses step k's
minimum over rounds (step k is the same micro-batch in every round and variant, so this filters
out seconds stolen by other jobs on a shared host); the headline uses `best` when N > 1.

    python benchmarks/dpo_throughput.py                        # 3 + 30 steps, 2 rounds
    python benchmarks/dpo_throughput.py --steps 4 --warmup 1 --rounds 1   # a quick check
    python benchmarks/dpo_throughput.py --only oxrl-packed,trl --rounds 3

Measured (2 idle CPU cores, torch 2.13.0+cpu, trl 1.16.0; 3 + 30 steps × 2 rounds, per-step best):
oxrl-packed 1.366 steps/s, oxrl-padded 0.604, trl 0.607 -> oxrl / trl = 2.25 (goal 1.3); the
losses of all three agree to 8.5e-6 over 33 steps. The gain is packing (71% of TRL's padded
tokens are real) times computing each prompt once (2P + C + R -> P + C + R tokens; P ≈ 159,
C, R ≈ 71 here); padded, oxrl and TRL do the same work at the same speed.

TRL is a benchmark-only dependency (`pip install trl`); without it the TRL variant is skipped.
Prints steps/s and tokens/s per variant, `oxrl / trl` (goal >= 1.3) and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from sft_throughput import oxrl_command  # the same CLI lookup (this folder is on sys.path when run as a script)

VARIANTS = ("oxrl-padded", "oxrl-packed", "trl")
LOSS_TOL = 1e-3


# ----------------------------------------------------------------------------- workload


def _arith(rng: random.Random, n_chars: int, start: str) -> str:
    """Chained arithmetic ('3+4=7, 7+12=19, 19-5=14, ...') after `start`, cut to exactly n_chars characters."""
    parts, value = [start], rng.randint(0, 19)
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


def _answer(rng: random.Random, expr: str, value: int, n_tokens: int) -> str:
    """A worked answer ending in 'Answer: <value>.' whose text is n_tokens - 1 characters (EOS is the last token)."""
    tail = f" Answer: {value}."
    n_chars = n_tokens - 1
    work = (f"{expr} = {value}. " + _arith(rng, max(0, n_chars), "Check: "))[: max(0, n_chars - len(tail))]
    return (work + tail)[-n_chars:]


def build_rows(tokenizer, n: int, seed: int, prompt_len=(60, 250), completion_len=(20, 120)) -> list[dict]:
    """Preference rows {prompt: [system, user] messages, chosen, rejected} with the token lengths drawn uniformly."""
    from oxrl_core.data.encode import encode_prompt
    from oxrl_core.data.task import rows as task_rows

    rng = random.Random(seed)
    base_rows = task_rows("train")
    rows = []
    for k in range(n):
        base = base_rows[k % len(base_rows)]
        expr, answer = base["prompt"][len("What is ") : -1], int(base["answer"])
        wrong = answer + rng.choice((-1, 1)) * rng.randint(1, 9)
        prompt = [{"role": "system", "content": ""}, {"role": "user", "content": base["prompt"]}]
        need = rng.randint(*prompt_len) - len(encode_prompt(tokenizer, prompt))
        if need < 0:
            raise RuntimeError(f"prompt too long for the minimum length {prompt_len[0]}")
        prompt[0]["content"] = _arith(rng, need, "Context: ")
        rows.append(
            {
                "prompt": prompt,
                "chosen": _answer(rng, expr, answer, rng.randint(*completion_len)),
                "rejected": _answer(rng, expr, wrong, rng.randint(*completion_len)),
            }
        )
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
    data_file = workdir / "pairs.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the ids oxrl trains on (its own tokenisation of the file); TRL's are checked against these
    examples = prepare_examples(load_source(str(data_file), "train"), "preference", tokenizer, 1024).examples
    assert len(examples) == len(rows)
    eos = tokenizer.eos_token_id
    for ex, row in zip(examples, rows):
        assert ex["chosen_ids"][-1] == eos and ex["rejected_ids"][-1] == eos
        assert tokenizer.decode(ex["chosen_ids"][:-1]) == row["chosen"]
    return model_dir, data_file, tokenizer, rows, examples


def batch_order(examples: list[dict], batch_size: int, seed: int, steps: int) -> list[list[int]]:
    """The micro-batches oxrl draws (run_preference's plan, no length grouping); TRL gets the same."""
    from oxrl_core.data.batching import BatchPlan

    lengths = [len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in examples]
    plan = BatchPlan(lengths, batch_size, seed, group_by_length=False)
    return [plan.micro_batch(k) for k in range(steps)]


def pair_tokens(ex: dict) -> int:
    """The tokens of one pair as two sequences, prompt + chosen and prompt + rejected (padding not counted).

    Every variant is credited with this same count, so tokens/s compares the same work; oxrl-packed
    reads each prompt once (shared prompts), its own `perf/tokens` is smaller and not used here."""
    return 2 * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"])


def _result(step_s: list[float], step_tokens: list[int], losses: list[float], grad_norms: list[float], **extra) -> dict:
    seconds = sum(step_s)
    return {
        "steps_per_s": len(step_s) / seconds,
        "tokens_per_s": sum(step_tokens) / seconds,
        "seconds": seconds,
        "step_s": step_s,
        "step_tokens": step_tokens,
        "losses": losses,
        "grad_norms": grad_norms,
        **extra,
    }


# ----------------------------------------------------------------------------- (a) oxrl CLI


def run_oxrl(
    args, model_dir: Path, data_file: Path, workdir: Path, packing: bool, tag: str, step_tokens: list[int]
) -> dict:
    out_dir = workdir / f"oxrl-{tag}"
    shutil.rmtree(out_dir, ignore_errors=True)
    sets = {
        "model.name": str(model_dir),
        "data.train": str(data_file),
        "data.packing": str(packing).lower(),
        "data.group_by_length": "false",
        "train.max_steps": args.warmup + args.steps,
        "train.batch_size": args.batch_size,
        "train.grad_accum_steps": 1,
        "train.lr": args.lr,
        "train.lr_scheduler": "constant",
        "train.warmup_steps": 0,
        "train.weight_decay": 0.0,
        "train.max_grad_norm": 1.0,
        "train.precision": "fp32",
        "train.precompute_ref_logps": "false",
        "train.seed": args.seed,
        "alg.beta": args.beta,
        "engine.device": "cpu",
    }
    cmd = oxrl_command() + ["run", "--alg", "dpo", "--quiet", "--output-dir", str(out_dir)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
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
    assert len(measured) == len(step_tokens)
    return _result(
        [r["perf/step_s"] for r in measured],
        step_tokens,
        [r["loss"] for r in records],
        [r["grad_norm"] for r in records],
        wall_s=wall,
    )


# ----------------------------------------------------------------------------- (b) TRL


def run_trl(
    args, model_dir: Path, rows: list[dict], examples: list[dict], batches: list[list[int]], workdir: Path
) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    order = [i for idx in batches for i in idx]  # read sequentially: TRL's batch k is oxrl's micro-batch k
    # conversational rows: TRL's chat-template tokenisation then matches oxrl's (asserted below)
    dataset = Dataset.from_list(
        [
            {
                "prompt": rows[i]["prompt"],
                "chosen": [{"role": "assistant", "content": rows[i]["chosen"]}],
                "rejected": [{"role": "assistant", "content": rows[i]["rejected"]}],
            }
            for i in order
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = DPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_steps=len(batches),
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        loss_type="sigmoid",
        max_length=None,  # TRL's default 1024 would truncate (nothing is this long here, but be explicit)
        padding_free=False,
        precompute_ref_log_probs=False,
        gradient_checkpointing=False,  # TRL's default is True; oxrl does not recompute activations
        bf16=False,  # TRL's default is True, even on CPU (autocast)
        fp16=False,
        use_cpu=True,
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
            self.begins, self.ends, self.losses, self.grad_norms = [], [], [], []

        def on_train_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_begin(self, *a, **k):
            self.begins.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.grad_norms.append(float(logs.get("grad_norm", math.nan)))

    clock = Clock()
    trainer = DPOTrainer(
        model=model, ref_model=None, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
    )
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model  # its own copy, per-step ref logps
    assert not trainer.args.gradient_checkpointing and not trainer.padding_free and not trainer.precompute_ref_logps
    # the same token ids as oxrl's, row by row
    theirs = trainer.train_dataset
    for j, i in enumerate(order):
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert list(theirs[j][key]) == examples[i][key], (j, key)
    trainer.train()
    step_s = [e - b for b, e in zip(clock.begins, clock.ends)][args.warmup :]
    ends = [clock.start] + clock.ends
    e2e_s = [ends[k + 1] - ends[k] for k in range(len(clock.ends))][args.warmup :]
    step_tokens = [sum(pair_tokens(examples[i]) for i in idx) for idx in batches[args.warmup :]]
    assert len(step_s) == len(step_tokens) == args.steps
    return _result(step_s, step_tokens, clock.losses, clock.grad_norms, e2e_s=e2e_s)


# ----------------------------------------------------------------------------- main


def summarise(rs: list[dict], key: str = "step_s") -> dict[str, float]:
    """steps/s and tokens/s: `mean` = median over rounds of (count / Σ seconds); `best` = count / Σ_k min_rounds s_k."""
    n, tokens = len(rs[0][key]), sum(rs[0]["step_tokens"])
    best_s = sum(min(col) for col in zip(*(r[key] for r in rs)))
    return {
        "steps_mean": statistics.median(n / sum(r[key]) for r in rs),
        "steps_best": n / best_s,
        "tokens_mean": statistics.median(tokens / sum(r[key]) for r in rs),
        "tokens_best": tokens / best_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant (not measured)")
    ap.add_argument("--rounds", type=int, default=2, help="repeat the variants, alternating order (ABBA)")
    ap.add_argument("--batch-size", type=int, default=8, help="preference pairs per optimiser step")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--only", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--workdir", default="", help="keep model/data/runs here (default: a temp dir, removed)")
    args = ap.parse_args()
    variants = [v for v in args.only.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    if "trl" in variants:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: skipping the TRL variant (pip install trl)")
            variants.remove("trl")

    import logging
    import warnings

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bar()
    logging.getLogger("trl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="oxrl-dpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    total_steps = args.warmup + args.steps
    n_rows = total_steps * args.batch_size
    t_start = time.perf_counter()
    results: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        model_dir, data_file, tokenizer, rows, examples = setup(
            workdir, n_rows, args.seed, args.hidden_size, args.layers
        )
        batches = batch_order(examples, args.batch_size, args.seed, total_steps)
        used = [examples[i] for idx in batches for i in idx]
        p_len = [len(e["prompt_ids"]) for e in used]
        c_len = [len(e[k]) for e in used for k in ("chosen_ids", "rejected_ids")]
        real = sum(pair_tokens(e) for e in used)
        padded = sum(
            2
            * len(idx)
            * max(
                len(examples[i]["prompt_ids"]) + len(examples[i][k])
                for i in idx
                for k in ("chosen_ids", "rejected_ids")
            )
            for idx in batches
        )
        print(
            f"workload: Llama h={args.hidden_size} L={args.layers}, {args.batch_size} pairs/step, "
            f"{args.warmup}+{args.steps} steps × {args.rounds} rounds, prompt tokens {min(p_len)}-{max(p_len)} "
            f"(mean {statistics.mean(p_len):.0f}), completion tokens {min(c_len)}-{max(c_len)} "
            f"(mean {statistics.mean(c_len):.0f}), real/padded tokens {real / padded:.2f}, beta {args.beta}, lr {args.lr}, "
            f"threads {args.threads}, torch {torch.__version__}",
            flush=True,
        )
        for rnd in range(args.rounds):
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                if v == "trl":
                    res = run_trl(args, model_dir, rows, examples, batches, workdir)
                else:
                    step_tokens = [sum(pair_tokens(examples[i]) for i in idx) for idx in batches[args.warmup :]]
                    res = run_oxrl(args, model_dir, data_file, workdir, v == "oxrl-packed", f"{v}-{rnd}", step_tokens)
                results[v].append(res)
                print(
                    f"  round {rnd + 1} {v:12s} {res['steps_per_s']:6.3f} steps/s  {res['tokens_per_s']:8.1f} tok/s  "
                    f"({args.steps} steps in {res['seconds']:.1f}s)",
                    flush=True,
                )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    key = "best" if args.rounds > 1 else "mean"
    table = {v: summarise(rs) for v, rs in results.items()}
    if "trl" in results:
        table["trl (e2e)"] = summarise(results["trl"], "e2e_s")
    print("\nsteps/s and tokens/s (mean = median over rounds of count/Σseconds; best = per-step best of rounds):")
    print(f"  {'variant':12s} {'steps/s':>8s} {'best':>8s} {'tok/s':>9s} {'best':>9s}")
    for v, s in table.items():
        print(
            f"  {v:12s} {s['steps_mean']:8.3f} {s['steps_best']:8.3f} {s['tokens_mean']:9.1f} {s['tokens_best']:9.1f}"
        )
    if "trl" in table:
        print(
            "  trl = on_step_begin -> on_step_end (excludes collation); trl (e2e) = on_step_end -> on_step_end "
            "(includes collation and TRL's logging)"
        )
    figures: dict = {
        "steps_per_s": {v: round(s["steps_mean"], 4) for v, s in table.items()},
        "tokens_per_s": {v: round(s["tokens_mean"], 1) for v, s in table.items()},
    }
    if args.rounds > 1:
        figures["steps_per_s_best"] = {v: round(s["steps_best"], 4) for v, s in table.items()}
    ox = [v for v in ("oxrl-padded", "oxrl-packed") if v in table]
    if len(ox) == 2:
        r = table["oxrl-packed"][f"steps_{key}"] / table["oxrl-padded"][f"steps_{key}"]
        figures["packed/padded"] = round(r, 3)
        print(f"packing on / off = {r:.3f}: {'packing' if r > 1 else 'padding'} is faster ({key})")
    if ox and "trl" in table:
        fastest = max(ox, key=lambda v: table[v][f"steps_{key}"])
        for v in ox:
            figures[f"{v}/trl"] = round(table[v][f"steps_{key}"] / table["trl"][f"steps_{key}"], 3)
        r = table[fastest][f"steps_{key}"] / table["trl"][f"steps_{key}"]
        r_e2e = table[fastest][f"steps_{key}"] / table["trl (e2e)"][f"steps_{key}"]
        figures.update({"oxrl": fastest, "oxrl/trl": round(r, 3), "oxrl/trl_e2e": round(r_e2e, 3)})
        print(
            f"oxrl / trl steps/s = {r:.3f}  (goal >= 1.3: {'met' if r >= 1.3 else 'NOT met'}; oxrl = {fastest}, "
            f"the faster of padded/packed; {key}; vs trl e2e: {r_e2e:.3f})"
        )
    # the same work: step 1 is log 2 on both sides (policy == reference); later steps should track each other
    if "trl" in results:
        ref_loss, ref_gn = results["trl"][0]["losses"], results["trl"][0]["grad_norms"]
        checks = {}
        print(f"loss check vs trl (step 1 loss trl {ref_loss[0]:.6f}, log 2 = {math.log(2):.6f}):")
        for v in ox:
            loss, gn = results[v][0]["losses"], results[v][0]["grad_norms"]
            n = min(len(loss), len(ref_loss))
            diff = [abs(a - b) for a, b in zip(loss[:n], ref_loss[:n])]
            gn_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(gn[:n], ref_gn[:n]))
            ok = diff[0] < 1e-5 and max(diff) < LOSS_TOL
            checks[v] = {
                "step1_loss": round(loss[0], 6),
                "max_loss_diff": float(f"{max(diff):.2e}"),
                "max_grad_norm_rel_diff": float(f"{gn_rel:.2e}"),
                "agree": ok,
            }
            shown = ", ".join(f"{a:.5f}/{b:.5f}" for a, b in list(zip(loss, ref_loss))[: min(n, 4)])
            print(
                f"  {v:12s} step 1 {loss[0]:.6f}; max |loss diff| {max(diff):.2e} over {n} steps, max grad-norm "
                f"rel. diff {gn_rel:.2e} -> {'agree' if ok else f'DRIFT (tolerance {LOSS_TOL})'}  [{shown}]"
            )
        figures["loss_check"] = checks
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
