"""Host–device syncs of a training step, counted on the CPU (`host_syncs.SyncCounter`): the calls that make a GPU
wait — a tensor's value read on the host, an op whose output shape depends on the data — between one optimiser
update and the next, in steady state (steps 2 and 3 of a run; no evaluation, no checkpoint in between).

The step reads its loss, metrics and gradient norm once (`loops.run.Run.update`), and the collator gives what
the host already knows (scored positions, token counts, packed row boundaries). What is left is transformers'
own: on packed rows it looks for the sequence boundaries in ``position_ids`` (one read per forward); on padded
rows it checks the padding mask (two per forward). So a packed SFT step and a packed DPO step whose reference
log-probabilities are precomputed make 2; a DPO step that runs the reference each step makes 3.
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
        ("dpo", ["data.packing=true", "train.precompute_ref_logps=true"], 2),
        ("dpo", ["data.packing=true"], 3),
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
