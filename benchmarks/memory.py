"""Peak memory at a real vocabulary: oxRL (chunked LM head, and with it off) vs TRL 1.16, SFT / DPO / SGRPO.

Each configuration runs in a fresh subprocess (this script with ``--child``), so its peak is its
own: the child's peak resident set (``ru_maxrss``, CPU) or ``torch.cuda.max_memory_allocated``
(GPU), for the whole process — imports, model, optimiser state, data and the training steps.

Workload: a Llama with a 151,936-token vocabulary (Qwen2.5's), 2 layers, hidden 128, untied
embeddings (39M parameters, nearly all in the embedding and the LM head), the built-in
character tokenizer (so a row of N characters is ~N tokens); fp32 (CPU) or bf16 autocast (GPU);
AdamW, lr 1e-5, grad clipping 1.0, no activation checkpointing anywhere, batch 2:

  sft    2 rows of ~2,000 tokens (a 200-token prompt, masked; a 1,800-token response)
         oxrl: `oxrl_core.Trainer(alg="sft")`; trl: `SFTTrainer` (completion-only loss, no packing)
  dpo    2 pairs, each ~2,000 tokens (a 200-token prompt, chosen and rejected ~900 tokens each)
         oxrl: `Trainer(alg="dpo")` (reference model: a frozen copy); trl: `DPOTrainer(ref_model=None)`
  sgrpo  one update step on a fixed rollout: 2 samples of one 200-token prompt, 1,800-token
         completions, rewards 1 and 0 (no generation is timed or measured)
         oxrl: the RL loop's single-pass update (`loops.rl._forward` with the token-mean SGRPO loss,
         logp_old = the same forward's logp, detached); trl: `GRPOTrainer.compute_loss` with
         `loss_type="dapo"` (the same token-mean clipped objective) on the same tensors

Sides: ``oxrl`` (the default, ``train.logits_chunk_size`` 1024), ``oxrl-plain``
(``train.logits_chunk_size=0``: the model's full logits, what oxRL did before) and ``trl``.
Printed per workload: peak GB, tokens/s over the measured steps (after ``--warmup``), and the
ratios oxrl / trl and oxrl / oxrl-plain; then one JSON line with every figure.

    python benchmarks/memory.py                          # all three workloads, all sides (CPU: ~20 min; oxrl-plain
                                                         # SGRPO alone peaks near 19 GB: run it on a quiet machine)
    python benchmarks/memory.py --only sft --steps 3
    python benchmarks/memory.py --sides oxrl,trl --chunk 512

TRL is a benchmark-only dependency (`pip install trl`); without it the TRL side is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sft_throughput import _filler  # the benchmarks' shared row filler

WORKLOADS = ("sft", "dpo", "sgrpo")
SIDES = ("oxrl", "oxrl-plain", "trl")
IGNORE = -100


# ----------------------------------------------------------------------------- workload


def setup(workdir: Path, args) -> None:
    """The model (151,936-token vocabulary) with the built-in character tokenizer, and the rows."""
    from oxrl_core.models.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(args.vocab, hidden_size=args.hidden, num_layers=args.layers, max_positions=4096, seed=0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")
    rng = random.Random(args.seed)
    prompt = lambda: "Continue the chain. " + _filler(rng, args.prompt_tokens - 40)
    sft = [
        {"prompt": prompt(), "response": _filler(rng, args.row_tokens - args.prompt_tokens)}
        for _ in range(args.batch * 8)
    ]
    half = (args.row_tokens - args.prompt_tokens) // 2
    dpo = [
        {"prompt": prompt(), "chosen": _filler(rng, half), "rejected": _filler(rng, half - 7)}
        for _ in range(args.batch * 8)
    ]
    for name, rows in (("sft", sft), ("dpo", dpo)):
        (workdir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "sgrpo.json").write_text(
        json.dumps(
            {
                "prompt": prompt(),
                "completions": [_filler(rng, args.row_tokens - args.prompt_tokens) for _ in range(args.batch)],
            }
        )
    )


def _train_cfg(args, steps: int, chunk: int) -> dict:
    return {
        "max_steps": steps,
        "batch_size": args.batch,
        "lr": 1e-5,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": args.seed,
        "save_every": 0,
        "logits_chunk_size": chunk,
    }


# ----------------------------------------------------------------------------- oxRL


def oxrl_sl(alg: str, args, workdir: Path, chunk: int) -> dict:
    """SFT or DPO through `oxrl_core.Trainer` (the CLI's code path); tokens/s from its metrics."""
    from oxrl_core import Trainer

    out = workdir / f"run-{alg}-{chunk}"
    shutil.rmtree(out, ignore_errors=True)
    trainer = Trainer(
        alg=alg,
        model=str(workdir / "model"),
        data={"train": str(workdir / f"{alg}.jsonl"), "max_length": 4096},
        output_dir=out,
        quiet=True,
        train=_train_cfg(args, args.warmup + args.steps, chunk),
        engine={"device": args.device},
    )
    records = trainer.train().metrics[args.warmup :]
    return {
        "tokens": sum(r["perf/tokens"] for r in records),
        "seconds": sum(r["perf/step_s"] for r in records),
        "loss": records[-1]["loss"],
    }


def rollout_rows(workdir: Path):
    """The fixed rollout: prompt token ids (chat template + generation prompt) and completion token ids (+ EOS)."""
    from transformers import AutoTokenizer

    from oxrl_core.data.encode import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    spec = json.loads((workdir / "sgrpo.json").read_text())
    prompt_ids = encode_prompt(tokenizer, spec["prompt"])
    completions = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in spec["completions"]
    ]
    return tokenizer, prompt_ids, completions


def oxrl_sgrpo(args, workdir: Path, chunk: int) -> dict:
    import torch

    from oxrl_algs_rl.sgrpo import SGRPO
    from oxrl_core.interfaces import Completion
    from oxrl_core.loops.rollouts import policy_forward as _forward
    from oxrl_core.loops.rollouts import rollout_tensors
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.models.token_head import choose_path

    tokenizer, prompt_ids, completions = rollout_rows(workdir)
    device = torch.device(args.device)
    model = load_causal_lm(str(workdir / "model"))
    choose_path(model, chunk, print)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    algorithm = SGRPO()
    done = [Completion(c, [0.0] * len(c), "stop", 0) for c in completions]
    batch = rollout_tensors([prompt_ids] * len(done), done, tokenizer.pad_token_id)
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.update(
        rewards=torch.tensor([1.0, 0.0] * (len(done) // 2), device=device),
        group_size=2,
        group=torch.arange(len(done), device=device) // 2,
        prompt_len=torch.full((len(done),), len(prompt_ids), device=device),
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens, seconds = 0, 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with autocast:
            mb = {**batch, **_forward(model, None, batch, temperature=1.0)}
            mb["logp_old"] = mb["logp"].detach()  # one update per rollout: π_old = π_θ
            mb["tis_weight"] = torch.ones_like(mb["mask"])
            mb.update(algorithm.advantages(mb)[0])
            loss, _ = algorithm.loss(mb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            tokens += int(batch["attention_mask"].sum())
            seconds += time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "loss": float(loss)}


# ----------------------------------------------------------------------------- TRL


def _trl_common(args, workdir: Path, steps: int) -> dict:
    return dict(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        bf16=args.device == "cuda",
        fp16=False,
        use_cpu=args.device == "cpu",
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        report_to="none",
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
    )


class _Clock:
    """Times TRL's steps (on_step_begin .. on_step_end) after the warm-up ones."""

    def __init__(self, warmup: int):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, *a, **k):
                clock.begin = time.perf_counter()

            def on_step_end(self, *a, **k):
                clock.steps.append(time.perf_counter() - clock.begin)

        self.warmup, self.steps, self.callback = warmup, [], Callback()

    @property
    def seconds(self) -> float:
        return sum(self.steps[self.warmup :])


def trl_sft(args, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_source

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    examples = prepare_examples(
        load_source(str(workdir / "sft.jsonl"), "train"), "prompt_response", tokenizer, 4096
    ).examples
    steps = args.warmup + args.steps
    rows = [examples[i % len(examples)] for i in range(steps * args.batch)]
    dataset = Dataset.from_list(
        [{"input_ids": e["input_ids"], "completion_mask": [int(x != IGNORE) for x in e["labels"]]} for e in rows]
    )
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32, attn_implementation="sdpa")
    clock = _Clock(args.warmup)
    config = SFTConfig(
        **_trl_common(args, workdir, steps),
        packing=False,
        padding_free=False,
        completion_only_loss=True,
        max_length=4096,
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock.callback]
    )
    trainer.train()
    tokens = sum(len(e["input_ids"]) for e in rows[args.warmup * args.batch :])
    return {"tokens": tokens, "seconds": clock.seconds}


def trl_dpo(args, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    base = [json.loads(line) for line in (workdir / "dpo.jsonl").read_text().splitlines()]
    steps = args.warmup + args.steps
    rows = [base[i % len(base)] for i in range(steps * args.batch)]
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32, attn_implementation="sdpa")
    clock = _Clock(args.warmup)
    config = DPOConfig(
        **_trl_common(args, workdir, steps),
        beta=0.1,
        loss_type="sigmoid",
        max_length=None,
        padding_free=False,
        precompute_ref_log_probs=False,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=None,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock.callback],
    )
    trainer.train()
    data = trainer.train_dataset
    tokens = sum(
        2 * len(data[j]["prompt_ids"]) + len(data[j]["chosen_ids"]) + len(data[j]["rejected_ids"])
        for j in range(args.warmup * args.batch, steps * args.batch)
    )
    return {"tokens": tokens, "seconds": clock.seconds}


def trl_grpo(args, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, prompt_ids, completions = rollout_rows(workdir)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32, attn_implementation="sdpa")
    common = _trl_common(args, workdir, 1)
    config = GRPOConfig(
        **common, num_generations=2, loss_type="dapo", beta=0.0, epsilon=0.2, max_completion_length=4096
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    width = max(map(len, completions))
    completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in completions], device=device)
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions], device=device)
    inputs = {
        "prompt_ids": torch.tensor([prompt_ids] * len(completions), device=device),
        "prompt_mask": torch.ones(len(completions), len(prompt_ids), dtype=torch.long, device=device),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([0.7071, -0.7071] * (len(completions) // 2), device=device),
        "num_items_in_batch": completion_mask.sum(),
    }
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens, seconds = 0, 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with autocast:
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            tokens += len(completions) * len(prompt_ids) + int(completion_mask.sum())
            seconds += time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "loss": float(loss)}


# ----------------------------------------------------------------------------- one configuration per process


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    workload, side = args.child.split(":")
    workdir = Path(args.workdir)
    chunk = 0 if side == "oxrl-plain" else args.chunk
    if side == "trl":
        result = {"sft": trl_sft, "dpo": trl_dpo, "sgrpo": trl_grpo}[workload](args, workdir)
    elif workload == "sgrpo":
        result = oxrl_sgrpo(args, workdir, chunk)
    else:
        result = oxrl_sl(workload, args, workdir, chunk)
    if args.device == "cuda":
        result["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    else:
        result["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    print("RESULT " + json.dumps(result), flush=True)


def run_child(argv: list[str], workload: str, side: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": argv[argv.index("--threads") + 1], "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--child", f"{workload}:{side}"], env=env, capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{workload}:{side} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--row-tokens", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024, help="oxrl's train.logits_chunk_size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", default="", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.device:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return child(args)
    sides = [s for s in args.sides.split(",") if s]
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: skipping the TRL side (pip install trl)")
            sides.remove("trl")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="oxrl-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    setup(workdir, args)
    argv = [
        a
        for pair in (
            ("--workdir", str(workdir)),
            ("--threads", str(args.threads)),
            ("--device", args.device),
            ("--steps", str(args.steps)),
            ("--warmup", str(args.warmup)),
            ("--batch", str(args.batch)),
            ("--chunk", str(args.chunk)),
            ("--seed", str(args.seed)),
        )
        for a in pair
    ]
    print(
        f"model: Llama, vocabulary {args.vocab:,}, {args.layers} layers, hidden {args.hidden}; batch {args.batch} × "
        f"~{args.row_tokens} tokens; device {args.device}, {args.threads} threads; oxrl chunk {args.chunk}",
        flush=True,
    )
    figures: dict = {}
    try:
        for workload in [w for w in args.only.split(",") if w]:
            results = {}
            for side in sides:
                r = run_child(argv, workload, side)
                results[side] = r
                print(
                    f"  {workload:5s} {side:10s} peak {r['peak_gb']:6.2f} GB   {r['tokens'] / r['seconds']:8.1f} tokens/s",
                    flush=True,
                )
            entry = {
                side: {"peak_gb": round(r["peak_gb"], 3), "tokens_per_s": round(r["tokens"] / r["seconds"], 1)}
                for side, r in results.items()
            }
            for base in ("trl", "oxrl-plain"):
                if "oxrl" in results and base in results:
                    mem = results["oxrl"]["peak_gb"] / results[base]["peak_gb"]
                    speed = (results["oxrl"]["tokens"] / results["oxrl"]["seconds"]) / (
                        results[base]["tokens"] / results[base]["seconds"]
                    )
                    entry[f"oxrl/{base}"] = {"peak": round(mem, 3), "tokens_per_s": round(speed, 3)}
                    print(f"  {workload:5s} oxrl / {base:10s} peak {mem:.2f}×, tokens/s {speed:.2f}×", flush=True)
            figures[workload] = entry
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if "trl" in figures.get("sft", {}) and "oxrl" in figures.get("sft", {}):
        r = figures["sft"]["oxrl/trl"]["peak"]
        print(f"SFT: oxrl / trl peak = {r:.2f}× (goal ≤ 0.5: {'met' if r <= 0.5 else 'NOT met'})")
    if "oxrl/oxrl-plain" in figures.get("sft", {}):
        r = figures["sft"]["oxrl/oxrl-plain"]["tokens_per_s"]
        print(f"SFT: oxrl tokens/s / oxrl-plain = {r:.2f}× (goal ≥ 0.95: {'met' if r >= 0.95 else 'NOT met'})")
    print(
        json.dumps(
            {
                "figures": figures,
                "device": args.device,
                "vocab": args.vocab,
                "hidden": args.hidden,
                "layers": args.layers,
                "batch": args.batch,
                "row_tokens": args.row_tokens,
                "chunk": args.chunk,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
