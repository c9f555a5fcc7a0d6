"""GSPO, RLOO, REINFORCE++ and REINFORCE++-baseline through the real CLI: each runs its example YAML for 20
steps (with some of the shared options switched on), and the same run on two ZeRO-3 ranks (with LoRA, where one
update per batch makes the first step's loss the initial weights') logs the same first-step loss and rewards as
the single process. The hand-derived maths is in test_estimators.py."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from conftest import ROOT, oxrl, read_metrics, write_jsonl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("ray") is None,
    reason="needs deepspeed and ray",
)

DIGITS_REWARD = '''
from oxrl_core.interfaces import Reward


class Digits(Reward):
    """The share of digits in a completion: a reward that varies inside every group."""

    name = "digits"

    def score(self, prompts, completions, examples):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
'''

#: per algorithm: the shared options switched on in its 20-step run, and what its metrics must then show
OPTIONS = {
    "gspo": [],  # its own defaults: rollout.minibatches=2, the paper's clip range, seq-mean-token-mean
    "rloo": ["alg.overlong_buffer=3", "alg.kl_coeff=0.05"],  # DAPO's length shaping; KL in the reward (k3)
    "reinforce_pp": ["rollout.n=1", "alg.entropy_coeff=0.01"],  # one sample per prompt; an entropy bonus
    # Dr. GRPO's constant normaliser, its k2 KL loss; generation in a rollout actor (the same samples as in-process)
    "reinforce_pp_baseline": ["alg.loss_agg=seq-mean-token-sum-norm", "rollout.actors=1"],
}
DP2 = ["engine.name=deepspeed", "engine.zero_stage=3", "engine.world_size=2", "engine.timeout_s=120"]
LORA = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "train.logits_chunk_min_mb=0"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("estimators")
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(6) for b in range(6)]
    write_jsonl(root / "prompts.jsonl", rows)
    (root / "digits.py").write_text(DIGITS_REWARD)
    return root


def _run(work: Path, alg: str, name: str, model: Path, steps: int, *sets: str) -> list[dict]:
    """The algorithm's example YAML on the tiny model, 4 prompts a step in two seeded rollout shards (so one
    process samples what two ranks do)."""
    base = [f"model.name={model}", f"data.train={work / 'prompts.jsonl'}", f"reward.name={work / 'digits.py'}:Digits"]
    base += [f"train.max_steps={steps}", "train.batch_size=4", "train.eval_every=0", "engine.rollout_shards=2"]
    base += ["train.lr_scheduler=constant"]  # the first step's later updates use the same lr however long the run
    args = [x for s in [*base, *OPTIONS[alg], *sets] for x in ("--set", s)]
    run = work / name
    proc = oxrl("run", "--config", str(ROOT / "examples" / f"{alg}.yaml"), *args, "-q", "-o", str(run), cwd=work,
                env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return read_metrics(run)


@pytest.mark.slow
@pytest.mark.parametrize("alg", list(OPTIONS))
def test_each_new_estimator_runs_its_example_and_two_zero3_ranks_match_its_first_step(alg, work, tiny_model_dir):
    single = _run(work, alg, f"{alg}-torch", tiny_model_dir, 20)
    assert [m["step"] for m in single] == list(range(1, 21))
    assert all(math.isfinite(m["loss"]) for m in single) and any(m["grad_norm"] > 0 for m in single)
    assert all(m["policy/version"] == m["step"] - 1 for m in single)
    first = single[0]
    if alg == "gspo":  # two optimiser steps a batch; on the second s_i ≠ 1 and whole sequences clip
        assert all(m["perf/updates"] == 2 for m in single)
        assert any(m["clip/frac"] > 0 for m in single) and any(m["ratio/mean"] != 1.0 for m in single)
    else:
        assert all(m["perf/updates"] == 1 for m in single)
    if alg == "rloo":
        assert all(m["reward/overlong_penalty"] <= 0 for m in single) and "kl/reward_k3" in first
        assert any(m["reward/overlong_penalty"] < 0 for m in single) and "loss/kl" not in first
    if alg == "reinforce_pp":
        assert "kl/reward_k1" in first and "loss/entropy" in first and "loss/kl" not in first
    if alg == "reinforce_pp_baseline":
        assert first["kl/loss_k2"] == first["loss/kl"] and "kl/reward_k2" not in first
        assert all(m["sync/probe_logprob_diff"] < 1e-4 for m in single)  # every push to the actor verified
    # the same first step on two ZeRO-3 ranks (GSPO: both updates of it, full weights; the others with LoRA,
    # whose adapters start at zero: one update a batch, so the step's loss is the initial weights')
    sets = DP2 if alg == "gspo" else DP2 + LORA
    (ranked,) = _run(work, alg, f"{alg}-zero3", tiny_model_dir, 1, *sets)
    assert ranked["reward/mean"] == first["reward/mean"] and ranked["response/length"] == first["response/length"]
    assert ranked["loss"] == pytest.approx(first["loss"], abs=1e-5), {
        k: (ranked[k], first[k]) for k in ("loss", "clip/frac", "ratio/mean", "grad_norm", "loss/policy")
    }
    if alg == "gspo":
        assert ranked["clip/frac"] == pytest.approx(first["clip/frac"], abs=1e-6)
