"""Host–device syncs of a training step, counted on the CPU (`host_syncs.SyncCounter`): the calls that make a GPU
wait — a tensor's value read on the host, an op whose output shape depends on the data — between one optimiser
update and the next, in steady state (steps 2 and 3 of a run; no evaluation, no checkpoint in between).

The step reads its loss, metrics and gradient norm once (`loops.run.Run.update`), and the collator gives what
the host already knows (scored positions, token counts, packed row boundaries). What is left is transformers'
own: on packed rows it looks for the sequence boundaries in ``position_ids`` (one read per forward); on padded
rows it checks the padding mask (two per forward). Shared-prompt rows (packed DPO, packed RL groups) pass an
empty 4-D mask (`packed_attention.shared_prefix_mask`), which transformers takes as prepared. So a packed SFT step
makes 2, a packed DPO step 1, a padded DPO step 5 (policy and reference).

The RL update phase (`loops.rl.Update`) is counted per optimiser step, from the update's entry: the rollout
batch carries what the host knows of each row (`rollouts.HostRow`), the rollout checks, the advantages' metrics
and every check that stops the run are read with the first optimiser step's figures, and a shared-prompt forward
gives transformers nothing to look for. SGRPO with shared prompts makes 1 per optimiser step; with two minibatches
2 (their order drawn on the host, a CPU ``tolist``) then 1; on padded rows 2 (transformers' padding-mask check).
"""

from __future__ import annotations

import json

import pytest
from host_syncs import SyncCounter

from oxrl_core import Trainer


def _syncs_per_step(tmp_path, alg: str, *sets: str):
    """The counts of steps 2 and 3 (counting starts when step 1's update returns and stops after step 3's, so the
    rest of the run goes at full speed), and their Counters."""
    from oxrl_core.engines.torch_engine import TorchEngine

    counter = SyncCounter()
    step, updates = TorchEngine.step, []

    def counted(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        updates.append(len(updates) + 1)
        if updates[-1] == 1:
            counter.__enter__()
        elif updates[-1] in (2, 3):
            counter.window()  # everything from the previous update to this one
        if updates[-1] == 3:
            counter.__exit__(None, None, None)
        return out

    data = tmp_path / f"{alg}.jsonl"  # a file of rows (no held-out split: no evaluation before and after)
    rows = [(f"What is {a} + {b}?", str(a + b)) for a in range(2, 9) for b in range(3, 7)]
    data.write_text(
        "".join(
            json.dumps({"prompt": p, "response": r} if alg == "sft" else {"prompt": p, "chosen": r, "rejected": "7"})
            + "\n"
            for p, r in rows
        )
    )
    TorchEngine.step = counted
    try:
        Trainer(
            alg=alg,
            overrides=[f"data.train={data}", "train.max_steps=3", "train.save_every=0", "train.batch_size=4", *sets],
            quiet=True,
            output_dir=tmp_path / alg,
        ).train()
    finally:
        TorchEngine.step = step
    return [sum(window.values()) for window in counter.windows], counter.windows


@pytest.mark.parametrize(
    ("alg", "sets", "most"),
    [
        ("sft", ["data.packing=true"], 2),
        ("dpo", ["data.packing=true"], 1),  # shared prompts: no mask to build, the one read
        ("dpo", ["data.packing=false"], 5),  # padded: transformers' padding check, twice a forward
    ],
)
def test_a_training_step_makes_at_most_its_host_syncs(tmp_path, alg, sets, most):
    counts, windows = _syncs_per_step(tmp_path, alg, *sets)
    assert counts and max(counts) <= most, windows
    # the one read of the step's figures is among them
    assert all(window["Tensor.tolist"] == 1 for window in windows), windows


def test_the_counter_sees_what_makes_a_gpu_wait():
    """Each kind of call the counter stands for is counted, in a thread started while counting too."""
    import threading

    import torch

    x = torch.tensor([1.0, -2.0, 3.0])
    with SyncCounter() as counter:
        float(x.sum())  # _local_scalar_dense
        x[x > 0]  # boolean indexing
        torch.unique(x)
        torch.repeat_interleave(torch.tensor([1, 2]))  # no output_size
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # known size: not counted
        x.tolist()
        worker = threading.Thread(target=lambda: bool(x.max() > 0))
        worker.start()
        worker.join()
    assert counter.counts["aten::_local_scalar_dense"] >= 2
    assert counter.counts["aten::index (boolean mask)"] == 1, counter.counts
    assert counter.counts["aten::_unique2"] == 1, counter.counts
    assert counter.counts["aten::repeat_interleave (no output_size)"] == 1
    assert counter.counts["Tensor.tolist"] == 1


def _rl_update_syncs(tmp_path, *sets: str) -> list:
    """The RL update phase's syncs per optimiser step: windows from `Update.__call__`'s entry to its first optimiser
    step's end, then from each step's end to the next's; what follows the last step (the rest of the call, the
    step's metrics, `rl.step_metrics`) counts in the last window. Counted at steps 2 and 3 of a 3-step run (the
    generation and the rest of the step between two updates go at full speed, uncounted)."""
    from oxrl_core.engines.torch_engine import TorchEngine
    from oxrl_core.loops import rl

    counter, windows, calls = SyncCounter(), [], []
    call, step, metrics = rl.Update.__call__, TorchEngine.step, rl.step_metrics

    def counting(fn):
        def counted(*args, **kwargs):
            if len(calls) < 2:  # step 1: not counted
                return fn(*args, **kwargs)
            counter.__enter__()
            try:
                return fn(*args, **kwargs)
            finally:
                counter.__exit__(None, None, None)
                windows[-1].update(counter.window())  # the tail: into the step's last window

        return counted

    def update(self, *args, **kwargs):
        calls.append(len(calls) + 1)
        counter.counts.clear()  # a window opens at the entry
        return counting(call)(self, *args, **kwargs)

    def optimiser_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if counter.active:
            windows.append(counter.window())  # everything from the previous window's end to this update's end
        return out

    rl.Update.__call__, TorchEngine.step, rl.step_metrics = update, optimiser_step, counting(metrics)
    try:
        _rl_run(tmp_path, *sets)
    finally:
        rl.Update.__call__, TorchEngine.step, rl.step_metrics = call, step, metrics
    return windows


def _rl_run(tmp_path, alg: str, *sets: str):
    """A 3-step run of ``alg`` on a small file of arithmetic prompts (no held-out split: no evaluation)."""
    data = tmp_path / "arith.jsonl"
    rows = [(f"What is {a} + {b}?", str(a + b)) for a in range(2, 9) for b in range(3, 7)]
    data.write_text("".join(json.dumps({"prompt": p, "answer": r}) + "\n" for p, r in rows))
    overrides = [
        f"data.train={data}",
        "reward.name=exact_match",
        "train.max_steps=3",
        "train.save_every=0",
        "train.batch_size=4",
        "rollout.max_new_tokens=8",
        *sets,
    ]
    return Trainer(alg=alg, overrides=overrides, quiet=True, output_dir=tmp_path / "run").train()


@pytest.mark.parametrize(
    ("sets", "updates"),
    [
        (["sgrpo"], 1),  # one update on the training forward's own logp_old (shared prompts, the default)
        (["sgrpo", "rollout.minibatches=2"], 2),  # a no-grad logp_old pass, then two optimiser steps
        (["sgrpo", "data.packing=false"], 1),  # padded rows: transformers checks their padding mask per forward
    ],
)
def test_the_rl_update_phase_makes_at_most_two_host_syncs_per_optimiser_step(tmp_path, sets, updates):
    """Issue 42: from the update's entry (old logprobs, the rollout checks and the mismatch alarm, the advantages)
    through each optimiser step (loss, backward, clip, update) to the step's metrics, at most 2 syncs per optimiser
    step (before: 26 for the default SGRPO step, 36 + 20 with two minibatches). Every check that stops the run is
    read with the first step's figures; the rest is what transformers does per forward (a padded row's mask) and,
    with several minibatches, their order drawn on the host (a CPU generator's ``tolist``, counted like a read)."""
    windows = _rl_update_syncs(tmp_path, *sets)
    assert len(windows) == 2 * updates, windows  # steps 2 and 3
    assert max(sum(window.values()) for window in windows) <= 2, windows
    # each optimiser step reads its figures (and, at the first, every stop check) in one copy
    assert sum(window["Tensor.tolist"] for window in windows) >= len(windows), windows


def test_the_checks_read_with_the_first_optimiser_step_still_stop_the_run_before_the_weights_change(
    tmp_path, monkeypatch
):
    """The mismatch alarm (and every finite check) is read with the first optimiser step's figures, after the loss's
    backward: it must still raise its message before the optimiser changes a weight."""
    import torch

    from oxrl_core.errors import OxrlError
    from oxrl_core.loops import rl

    batch_of, call, seen = rl.rollout_batch, rl.Update.__call__, {}

    def off_by_half(*args, **kwargs):  # the rollout's logprobs 0.5 nats off the trainer's on every sampled token
        batch = batch_of(*args, **kwargs)
        batch["logp_rollout"] = batch["logp_rollout"] - 0.5 * batch["mask"]
        batch["rewards"] = torch.arange(len(batch["rewards"]), dtype=torch.float32)  # advantages ≠ 0: a gradient
        return batch

    def update(self, *args, **kwargs):
        seen["model"], seen["before"] = self.model, [p.detach().clone() for p in self.model.parameters()]
        return call(self, *args, **kwargs)

    monkeypatch.setattr(rl, "rollout_batch", off_by_half)
    monkeypatch.setattr(rl.Update, "__call__", update)
    with pytest.raises(
        OxrlError, match=r"step 1: rollout/logprob_diff = 0\.5 nats .* exceeds rollout\.max_logprob_diff"
    ):
        _rl_run(tmp_path, "sgrpo", "train.warmup_steps=0")  # (a warmup's first rate is 0: no update to see)
    assert all(torch.equal(p, q) for p, q in zip(seen["model"].parameters(), seen["before"]))
