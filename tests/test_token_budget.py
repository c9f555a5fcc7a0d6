"""Token-budget batching (`train.max_tokens_per_micro_batch`): micro-batches filled up to a token
budget instead of a fixed row count, with the same gradient as one big batch."""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, write_jsonl

from oxrl_core import Trainer
from oxrl_core.data.batching import regroup_by_tokens, token_budget_batches


def test_budget_batches_are_filled_longest_first_by_hand():
    # lengths 5 3 8 2 9, budget 16, padded (rows × longest): [9] | [8, 5] (2·8=16) | [3, 2] (2·3=6)
    assert token_budget_batches([5, 3, 8, 2, 9], 16) == [[4], [2, 0], [1, 3]]
    # packed (Σ lengths): [9] | [8, 5, 3] (16) | [2]
    assert token_budget_batches([5, 3, 8, 2, 9], 16, packing=True) == [[4], [2, 0, 1], [3]]
    # groups of 2 stay together, longest group first: (9, 1) | (8, 2) | (5, 3)
    assert token_budget_batches([5, 3, 8, 2, 9, 1], 20, unit=2) == [[4, 5], [2, 3], [0, 1]]
    # a row over the budget gets a micro-batch of its own; nothing is dropped
    assert token_budget_batches([50, 1], 16) == [[0], [1]]


def test_regrouping_keeps_every_row_of_the_optimiser_step():
    picks = [[7, 1, 4], [0, 2, 9]]
    lengths = {7: 30, 1: 5, 4: 12, 0: 7, 2: 29, 9: 1}
    groups = regroup_by_tokens(picks, lengths.__getitem__, 40)
    assert sorted(i for g in groups for i in g) == sorted(i for p in picks for i in p)
    assert all(len(g) * max(lengths[i] for i in g) <= 40 or len(g) == 1 for g in groups)
    assert regroup_by_tokens(picks, lengths.__getitem__, 0) == picks  # off: as drawn


def _rows(n: int) -> list[dict]:
    # very different lengths, so a small budget splits the batch unevenly
    return [
        {"prompt": f"What is {a}+{b}?" + " please" * (a % 4), "response": str(a + b) * (1 + b % 3)}
        for a in range(n)
        for b in range(2)
    ]


def _weights(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "model.safetensors"))


def _run(tmp_path, name, model_dir, alg, data, *overrides):
    run = tmp_path / name
    Trainer(
        alg=alg,
        model=str(model_dir),
        data=str(data),
        output_dir=run,
        quiet=True,
        overrides=["train.max_steps=2", "train.lr=1e-3", *overrides],
    ).train()
    return run


def _assert_same_run(a, b, atol=1e-5):
    ma, mb = read_metrics(a), read_metrics(b)
    assert all(m["perf/micro_batches"] == 1 for m in ma) and all(m["perf/micro_batches"] > 1 for m in mb)
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], abs=atol), key
    wa, wb = _weights(a), _weights(b)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=atol, rtol=0, msg=f"{key} differs")


@pytest.mark.parametrize("packing", ["false", "true"])
def test_sft_token_budget_equals_one_big_batch(tmp_path, tiny_model_dir, packing):
    data = write_jsonl(tmp_path / "sft.jsonl", _rows(8))
    whole = _run(tmp_path, "whole", tiny_model_dir, "sft", data, "train.batch_size=8", f"data.packing={packing}")
    budget = _run(
        tmp_path,
        "budget",
        tiny_model_dir,
        "sft",
        data,
        "train.batch_size=8",
        f"data.packing={packing}",
        "train.max_tokens_per_micro_batch=60",
    )
    _assert_same_run(whole, budget)


def test_dpo_token_budget_equals_one_big_batch(tmp_path, tiny_model_dir):
    pairs = [
        {
            "prompt": f"What is {a}+{b}?" + " now" * (a % 3),
            "chosen": str(a + b),
            "rejected": str(a + b + 1) * (1 + a % 2),
        }
        for a in range(6)
        for b in range(2)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    whole = _run(tmp_path, "whole", tiny_model_dir, "dpo", data, "train.batch_size=6")
    budget = _run(
        tmp_path, "budget", tiny_model_dir, "dpo", data, "train.batch_size=6", "train.max_tokens_per_micro_batch=80"
    )
    _assert_same_run(whole, budget)


@pytest.mark.slow
def test_rl_token_budget_equals_whole_minibatch(tmp_path, tiny_model_dir):
    runs = {}
    for name, extra in (("whole", []), ("budget", ["train.max_tokens_per_micro_batch=64"])):
        run = tmp_path / name
        Trainer(
            alg="sgrpo",
            model=str(tiny_model_dir),
            output_dir=run,
            quiet=True,
            overrides=[
                "train.max_steps=2",
                "train.batch_size=4",
                "rollout.n=4",
                "rollout.minibatches=2",
                "alg.kl_coeff=0.05",
                "train.lr=1e-3",
                *extra,
            ],
        ).train()
        runs[name] = read_metrics(run)
    assert all(m["perf/micro_batches"] == 1 for m in runs["whole"])  # one per optimiser step (minibatch)
    assert all(m["perf/micro_batches"] > 1 for m in runs["budget"])
    for key in ("loss", "grad_norm", "kl/ref", "reward/mean"):
        assert [m[key] for m in runs["budget"]] == pytest.approx([m[key] for m in runs["whole"]], abs=1e-4), key
