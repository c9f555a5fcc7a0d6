"""GRPO step time: oxRL's `sgrpo` (the `hf` rollout backend) vs TRL's `GRPOTrainer`.

The same RL work two ways, in one process, on the CPU:

  (a) oxrl  `oxrl_core.Trainer(alg="sgrpo", ...)` with the built-in `hf` rollout backend; the
            step time is the wall-clock interval between two consecutive steps (it includes the
            metrics.jsonl write), and the loop's own split is read from its metrics
            (`perf/gen_s`, `perf/reward_s`, `perf/train_s`, `perf/step_s`)
  (b) trl   `trl.GRPOTrainer` with `transformers` generation (no vLLM); the step time is the
            interval between two `on_step_end` callbacks, and the split comes from timing
            `_generate` (tokenise + generate + decode) and `_generate_and_score_completions`
            (that plus rewards, advantages and the batch tensors) in a subclass

Workload, identical on both sides: the built-in tiny Llama (hidden 256, 4 layers, character
tokenizer with a chat template) saved to a temp dir, fp32, the same thread count; every step
is 8 prompts × 4 samples = 32 completions of up to 32 new tokens, sampled at temperature 1.0,
top_p 1, no top_k; one optimiser step per rollout (TRL: per_device_train_batch_size 32,
gradient_accumulation_steps 1, steps_per_generation 1, num_iterations 1), no reference model
(β = 0), clipping ε_low 0.2 / ε_high 0.28, group-std-scaled advantages, token-level loss
aggregation (oxRL's SGRPO token mean = TRL's `loss_type="dapo"`), AdamW at the same constant
lr, weight decay 0, grad clipping 1.0, no gradient checkpointing (TRL turns it on by
default; it is off here, as in oxRL), bf16/fp16 off, TRL logging and saving off.
Prompts: the built-in arithmetic task's train questions as one user message, tokenised by
the tokenizer's chat template with the generation prompt on both sides (checked equal).
Reward (the same Python function on both sides): 1 when the first integer of the completion
is the answer (`oxrl_core.data.task.is_correct`), else 0.5 × the fraction of digit characters,
so that groups have non-zero advantages and the update is a real one.

Exactly 32 new tokens: a random-init model emits its EOS token with probability ~1/V per
token (about a third of completions would stop early). By default the saved model gets one
constant feature (embedding column 0 += 1) and the EOS row of the LM head reads it with
weight -10, so the EOS logit is below -40 and every completion runs to the 32-token limit
on both sides (same shapes and FLOPs; architecture and size are unchanged, and the model is
still a random one that samples near-uniformly). `--natural-eos`
keeps the untouched random model; then the padded work is still the same (both pad to the
longest completion of the batch), and the mean completion length of each side is reported.

Noise: the sides alternate over `--repeats` rounds (ABBA) and the first `--warmup` steps of
each run are skipped. The mean, the median and a `best` figure (mean over k of the fastest
round's step k: step k has the same prompts and shapes in every round) are printed; on a host
shared with other CPU-heavy jobs prefer median/best, and rerun if they disagree much with the
mean. Two threads on two cores are badly hurt by any other busy process (OpenMP threads wait
for each other): there a generate call can take 10-50× longer, so check `uptime` first, or
compare with `--threads 1`.

    python benchmarks/grpo_step.py                              # 2 + 12 steps, 3 rounds (~1 min on 2 idle cores)
    python benchmarks/grpo_step.py --steps 20 --repeats 3
    python benchmarks/grpo_step.py --only oxrl --profile        # + a cProfile of one oxRL step
    python benchmarks/grpo_step.py --packing                    # oxRL with data.packing (shared prompts)
    python benchmarks/grpo_step.py --set train.logits_chunk_min_mb=0   # oxRL with the chunked LM head forced on

TRL is a benchmark-only dependency (`pip install trl`). Prints a table, the ratio
`oxRL steps/s ÷ TRL steps/s` (goal ≥ 1.3) and a JSON line with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from oxrl_core.interfaces import Reward

SIDES = ("oxrl", "trl")


# ----------------------------------------------------------------------------- the shared reward


def score_text(completion: str, answer: str) -> float:
    """1.0 for a correct answer (first integer), else 0.5 × the fraction of digit characters."""
    from oxrl_core.data.task import is_correct

    if is_correct(completion, answer):
        return 1.0
    return 0.5 * sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


class BenchReward(Reward):
    """oxRL side of the shared reward (loaded by the run as `<this file>:BenchReward`)."""

    name = "grpo_step_bench"

    def score(self, prompts, completions, examples):
        return [score_text(c, ex["answer"]) for c, ex in zip(completions, examples, strict=True)]


def trl_reward(prompts, completions, answer, **kwargs):
    """TRL side of the shared reward: conversational completions are [{"role": "assistant", "content": ...}]."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [score_text(t, a) for t, a in zip(texts, answer, strict=True)]


# ----------------------------------------------------------------------------- workload


def setup(workdir: Path, args) -> tuple[Path, Path, list[dict]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oxrl_core.data.encode import encode_prompt
    from oxrl_core.data.task import rows as task_rows
    from oxrl_core.models.tiny import save_tiny_model

    model_dir = workdir / "model"
    save_tiny_model(model_dir, hidden_size=args.hidden_size, num_layers=args.layers, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not args.natural_eos:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] += 1.0  # a constant feature, positive in every final hidden state
            model.lm_head.weight[tokenizer.eos_token_id].zero_()
            model.lm_head.weight[tokenizer.eos_token_id, 0] = -10.0  # EOS logit ≈ -10 × (≥ 4.8)
        model.save_pretrained(model_dir)
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in task_rows("train")[: args.prompts]]
    data_file = workdir / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the prompt tokens are the same on both sides: oxRL's encode_prompt == TRL's chat-template call
    for r in rows[:16]:
        messages = [{"role": "user", "content": r["prompt"]}]
        trl_ids = tokenizer.apply_chat_template(
            [messages], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        assert list(trl_ids) == encode_prompt(tokenizer, r["prompt"]), (r, trl_ids)
    return model_dir, data_file, rows


# ----------------------------------------------------------------------------- (a) oxRL


def run_oxrl(args, model_dir: Path, data_file: Path, workdir: Path, tag: str, profile: bool = False) -> dict:
    import torch

    from oxrl_core import Trainer
    from oxrl_core.observability.progress import Reporter

    torch.set_num_threads(args.threads)
    out_dir = workdir / f"oxrl-{tag}"
    shutil.rmtree(out_dir, ignore_errors=True)
    total = args.warmup + args.steps
    trainer = Trainer(
        alg="sgrpo",
        model=str(model_dir),
        data={"train": str(data_file), "packing": args.packing},
        output_dir=out_dir,
        quiet=True,
        train={
            "max_steps": total,
            "batch_size": args.prompts_per_step,
            "lr": args.lr,
            "lr_scheduler": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "precision": "fp32",
            "seed": args.seed,
            "save_every": 0,
        },
        rollout={
            "backend": "hf",
            "n": args.samples,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
        },
        reward={"name": f"{Path(__file__).resolve()}:BenchReward"},
        engine={"device": "cpu"},
        overrides=["alg.clip_low=0.2", "alg.clip_high=0.28", "alg.kl_coeff=0.0", "alg.scale_rewards=true", *args.set],
    )
    # step k's wall time = the interval between the loop's progress calls for steps k-1 and k
    stamps: list[float] = []
    original_start, original_step = Reporter.start, Reporter.step
    profiler = None

    def start(self, *a, **k):
        stamps.append(time.perf_counter())
        return original_start(self, *a, **k)

    def step(self, step_no, *a, **k):
        nonlocal profiler
        stamps.append(time.perf_counter())
        if profile and step_no == args.warmup:  # profile the first measured step
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        elif profiler is not None and step_no == args.warmup + 1:
            profiler.disable()
        return original_step(self, step_no, *a, **k)

    Reporter.start, Reporter.step = start, step
    try:
        result = trainer.train()
    finally:
        Reporter.start, Reporter.step = original_start, original_step
    if profiler is not None:
        import pstats

        path = workdir / "oxrl_step.prof"
        profiler.dump_stats(path)
        print("\ncProfile of one oxRL step (cumulative, top 40):")
        pstats.Stats(str(path), stream=sys.stdout).sort_stats("cumulative").print_stats(40)
        print("cProfile of one oxRL step (own time, top 25):")
        pstats.Stats(str(path), stream=sys.stdout).sort_stats("tottime").print_stats(25)
    records = result.metrics
    measured = records[args.warmup :]
    step_s = [stamps[k + 1] - stamps[k] for k in range(args.warmup, total)]
    return {
        "step_s": step_s,
        "loop_step_s": [r["perf/step_s"] for r in measured],
        "gen_s": [r["perf/gen_s"] for r in measured],
        "reward_s": [r["perf/reward_s"] for r in measured],
        "train_s": [r["perf/train_s"] for r in measured],
        "length": [r["response/length"] for r in measured],
        "clipped": [r["response/clipped"] for r in measured],
        "loss": [r["loss"] for r in records],
        "reward": [r["reward/mean"] for r in records],
    }


# ----------------------------------------------------------------------------- (b) TRL


def run_trl(args, model_dir: Path, rows: list[dict], workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    total = args.warmup + args.steps
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.prompts_per_step * args.samples,  # completions per optimiser step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,  # no reference model
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        loss_type="dapo",  # token-level mean over the batch = SGRPO's aggregation
        mask_truncated_completions=False,
        max_steps=total,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL's default is True; oxRL does not recompute activations
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        dataloader_num_workers=0,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin, self.ends = 0.0, []

        def on_train_begin(self, *a, **k):
            self.begin = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

    class TimedGRPOTrainer(GRPOTrainer):
        gen_s: list[float]
        gen_score_s: list[float]
        lengths: list[float]
        clipped: list[float]
        rewards: list[float]

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            self.gen_s.append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.gen_score_s.append(time.perf_counter() - t0)
            lengths = out["completion_mask"].sum(1).float()
            self.lengths.append(float(lengths.mean()))
            self.clipped.append(float((lengths == args.max_new_tokens).float().mean()))
            return out

    clock = Clock()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=trl_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.gen_s, trainer.gen_score_s, trainer.lengths, trainer.clipped = [], [], [], []
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    assert (
        not trainer.args.gradient_checkpointing and trainer.beta == 0.0 and getattr(trainer, "ref_model", None) is None
    )
    trainer.train()
    ends = [clock.begin] + clock.ends
    step_s = [ends[k + 1] - ends[k] for k in range(args.warmup, total)]
    gen_s = trainer.gen_s[args.warmup : total]
    score_s = [gs - g for gs, g in zip(trainer.gen_score_s[args.warmup : total], gen_s)]
    return {
        "step_s": step_s,
        "gen_s": gen_s,
        "reward_s": score_s,  # rewards + advantages + batch tensors (everything of _generate_and_score_ but generation)
        "train_s": [s - gs for s, gs in zip(step_s, trainer.gen_score_s[args.warmup : total])],
        "length": trainer.lengths[args.warmup : total],
        "clipped": trainer.clipped[args.warmup : total],
    }


# ----------------------------------------------------------------------------- main


def mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per run (not measured)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the sides alternate (ABBA)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (the group size)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=512, help="prompts in the data file")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--natural-eos", action="store_true", help="keep the random model's EOS (completions may stop early)"
    )
    ap.add_argument("--only", default="oxrl,trl", help="comma-separated subset of oxrl,trl")
    ap.add_argument(
        "--packing",
        action="store_true",
        help="oxRL with data.packing: the training forward computes each prompt once for its n samples",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an extra oxRL config override (repeatable)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the first measured oxRL step of round 1")
    ap.add_argument("--workdir", default="", help="keep model/data/runs here (default: a temp dir, removed)")
    args = ap.parse_args()
    sides = [s for s in args.only.split(",") if s]
    if set(sides) - set(SIDES):
        ap.error(f"unknown sides {sorted(set(sides) - set(SIDES))}")
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: skipping TRL (pip install trl)")
            sides.remove("trl")

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bar()
    logging.getLogger("oxrl.rewards").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="oxrl-grpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict[str, list[dict]] = {s: [] for s in sides}
    try:
        model_dir, data_file, rows = setup(workdir, args)
        print(
            f"workload: Llama h={args.hidden_size} L={args.layers}, {args.prompts_per_step} prompts × {args.samples} samples × "
            f"{args.max_new_tokens} new tokens per step, {args.warmup}+{args.steps} steps × {args.repeats} rounds, "
            f"{'natural EOS' if args.natural_eos else 'EOS suppressed in the model'}, threads {args.threads}, "
            f"torch {torch.__version__}, oxRL data.packing {'on' if args.packing else 'off'}",
            flush=True,
        )
        for rnd in range(args.repeats):
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                t0 = time.perf_counter()
                if side == "oxrl":
                    res = run_oxrl(args, model_dir, data_file, workdir, str(rnd), profile=args.profile and rnd == 0)
                else:
                    res = run_trl(args, model_dir, rows, workdir)
                res["wall_s"] = time.perf_counter() - t0
                results[side].append(res)
                print(
                    f"  round {rnd + 1} {side:5s} {mean(res['step_s']):.3f} s/step mean, "
                    f"{statistics.median(res['step_s']):.3f} median (run wall {res['wall_s']:.1f}s)",
                    flush=True,
                )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    def pooled(side, key):
        return [x for r in results[side] for x in r.get(key, [])]

    summary: dict[str, dict] = {}
    for side in sides:
        step_s = pooled(side, "step_s")
        # step k draws the same prompts and (EOS suppressed) the same shapes in every round, so the
        # per-step minimum over rounds filters out seconds stolen by other jobs on the host
        best = [min(col) for col in zip(*(r["step_s"] for r in results[side]))]
        summary[side] = {
            "mean_s": mean(step_s),
            "median_s": statistics.median(step_s),
            "best_s": mean(best),
            "min_s": min(step_s),
            "gen_s": mean(pooled(side, "gen_s")),
            "reward_s": mean(pooled(side, "reward_s")),
            "train_s": mean(pooled(side, "train_s")),
            "completion_len": mean(pooled(side, "length")),
            "clipped": mean(pooled(side, "clipped")),
            "round_means": [round(mean(r["step_s"]), 4) for r in results[side]],
        }
        if side == "oxrl":
            summary[side]["loop_step_s"] = mean(pooled(side, "loop_step_s"))

    print("\nseconds per RL step (after warm-up, pooled over rounds):")
    print(
        f"  {'side':5s} {'mean':>7s} {'median':>7s} {'best':>7s} | {'gen':>6s} {'reward*':>7s} {'train':>6s} | "
        f"{'compl. len':>10s} {'at limit':>8s}"
    )
    for side, s in summary.items():
        print(
            f"  {side:5s} {s['mean_s']:7.3f} {s['median_s']:7.3f} {s['best_s']:7.3f} | {s['gen_s']:6.3f} "
            f"{s['reward_s']:7.3f} {s['train_s']:6.3f} | {s['completion_len']:10.2f} {s['clipped']:8.0%}"
        )
    print("  best = mean over steps k of the fastest round's step k (filters out host noise; = mean with one round)")
    print("  gen = generation (oxRL: perf/gen_s; TRL: _generate = tokenise + generate + decode)")
    print(
        "  reward* = oxRL: perf/reward_s (decode + reward); TRL: rest of _generate_and_score_completions "
        "(reward, advantages, tensors)"
    )
    print(
        "  train = oxRL: perf/train_s (batch tensors, forward, backward, optimiser); TRL: step − _generate_and_score_completions"
    )
    if "oxrl" in summary:
        s = summary["oxrl"]
        print(
            f"  oxRL loop's own perf/step_s mean {s['loop_step_s']:.3f} (the wall interval adds the per-step logging)"
        )
    figures: dict = {
        "summary": {
            k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()} for k, v in summary.items()
        }
    }
    if "oxrl" in summary and "trl" in summary:
        r_mean = summary["trl"]["mean_s"] / summary["oxrl"]["mean_s"]
        r_median = summary["trl"]["median_s"] / summary["oxrl"]["median_s"]
        r_best = summary["trl"]["best_s"] / summary["oxrl"]["best_s"]
        figures.update(ratio_mean=round(r_mean, 3), ratio_median=round(r_median, 3), ratio_best=round(r_best, 3))
        print(
            f"\nratio oxRL steps/s ÷ TRL steps/s = {r_mean:.2f}×  (means; medians: {r_median:.2f}×, best: {r_best:.2f}×; "
            f"goal ≥ 1.3: {'met' if r_mean >= 1.3 else 'NOT met'})"
        )
        if abs(r_mean - r_median) > 0.1 * r_median:
            print("  note: mean and median ratios differ by >10%: the host looks noisy, rerun (--repeats 3)")
    figures.update(
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        natural_eos=args.natural_eos,
        script_s=round(time.perf_counter() - t_start, 1),
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
