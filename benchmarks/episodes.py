"""Multi-turn episodes per second: batched turns (oxRL's `Episodes`) vs one episode at a time.

The same work two ways, in one process, on the same model and backend:

  (a) batched   `oxrl_core.rl.episodes.Episodes.play` on all rows at once: per turn, ONE
                ``generate`` call for every live episode (what the RL loop does)
  (b) one-by-one the same `Episodes.play`, called once per row: every turn of every episode is its
                own ``generate`` call (what a loop over episodes does)

Workload: the built-in tiny Llama after its tool-use warm start (it calls the ``calc`` tool of the
`calculator` environment, then answers: 2 model turns per episode), the products task's held-out
questions, greedy decoding, ``rollout.max_new_tokens`` 80, the built-in `hf` rollout backend, fp32.
Both sides play identical episodes (greedy; checked: same messages). The sides alternate over
``--repeats`` rounds; printed: episodes/s of each side and the ratio.

    python benchmarks/episodes.py [--rows 32] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oxrl_core.config import RunConfig
from oxrl_core.data.task import CalculatorEnv, product_rows
from oxrl_core.interfaces import SamplingParams
from oxrl_core.models.tiny import warm_start_dir
from oxrl_core.rl.episodes import Episodes
from oxrl_core.rollout.hf import HFRolloutBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = warm_start_dir(tools=True, log=print)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = RunConfig.model_validate(
        {"algorithm": "sgrpo", "env": {"name": "calculator", **CalculatorEnv.tiny_defaults["env"]}}
        | {"rollout": CalculatorEnv.tiny_defaults["rollout"]}
    )
    runner = Episodes(CalculatorEnv, CalculatorEnv.Config(), cfg, tokenizer, HFRolloutBackend(model, tokenizer))
    rows = product_rows("eval")[: args.rows]
    greedy = SamplingParams(n=1, max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)

    def batched():
        return runner.play(rows, greedy)

    def one_by_one():
        return [e for row in rows for e in runner.play([row], greedy)]

    a, b = batched(), one_by_one()  # warm-up, and the check that both do the same work
    assert [e.messages for e in a] == [e.messages for e in b], "the two sides played different episodes"
    turns = sum(e.turns for e in a) / len(a)
    times = {"batched": [], "one-by-one": []}
    for _ in range(args.repeats):
        for name, fn in (("batched", batched), ("one-by-one", one_by_one)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rate = {k: len(rows) / statistics.median(v) for k, v in times.items()}
    print(f"{len(rows)} episodes, {turns:.2f} model turns each, {args.threads} threads, median of {args.repeats}")
    for name, r in rate.items():
        print(f"  {name:>10}: {r:7.2f} episodes/s")
    print(f"  ratio batched / one-by-one: {rate['batched'] / rate['one-by-one']:.2f}x")


if __name__ == "__main__":
    main()
