"""oxRL's own collectives across ranks (`oxrl_core.engines.distributed`): every rank issues the same ones in the same order.

Collectives pair by order alone, so a rank that issues one collective more than another makes the
next ones pair wrongly: the chunked LM head once all-reduced its chunk count while rank 0 evaluated
alone inside ``engine.full_weights()``, paired with rank 1's DeepSpeed parameter gather, read garbage
and looped. Shown here on two real gloo ranks (two processes) with a ZeRO-3 engine:

* the chunked head issues the same number of collectives on both ranks, forward and backward, for
  uneven inputs (37 / 3 / 0 scored tokens), and none inside ``engine.full_weights()``;
* an oxRL collective inside ``engine.full_weights()`` raises at once (in one process too);
* ranks at different checked collectives both stop with `CollectiveMismatch`, naming both call sites
  and ranks.

The planted mismatch through the real CLI (one rank skips one head call; the run stops, its
checkpoint kept) is in tests/test_zero3_held_out.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from oxrl_core.engines import distributed
from oxrl_core.engines.distributed import CollectiveMismatch

requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install 'oxrl[deepspeed]')"
)

WORKER = r'''
import json, os, sys, traceback
import torch
import torch.distributed as dist

rank, port, model_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                  OXRL_LAUNCHED="1", DS_ACCELERATOR="cpu")
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM

from oxrl_core.engines import distributed
from oxrl_core.models import token_head
from oxrl_core.config import load_run_config
from oxrl_core.engines.distributed import CollectiveMismatch
from oxrl_core.engines.deepspeed_engine import DeepSpeedEngine

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "all_gather_object",
               "broadcast_object_list", "barrier", "reduce", "all_to_all_single")
calls = []
for name in COLLECTIVES:
    original = getattr(dist, name, None)
    if original is None:
        continue
    def counted(*args, _original=original, _name=name, **kwargs):
        calls.append(_name)
        return _original(*args, **kwargs)
    setattr(dist, name, counted)

result = {}
try:
    cfg = load_run_config(overrides=["engine.name=deepspeed", "engine.zero_stage=3", "engine.world_size=2",
                                     "engine.device=cpu", "engine.timeout_s=60", "train.lr=1e-3"], algorithm="sft")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    token_head.choose_path(model, 8)  # chunks of 8 scored tokens
    engine = DeepSpeedEngine(model, cfg.train, cfg.engine)
    vocab = model.config.vocab_size

    def scored(tokens):
        """A (2, 24) batch with ``tokens`` scored positions (different on each rank)."""
        g = torch.Generator().manual_seed(10 + rank)
        ids = torch.randint(0, vocab, (2, 24), generator=g)
        rows, pos = torch.arange(48).div(24, rounding_mode="floor")[:tokens], torch.arange(48).remainder(24)[:tokens]
        pos = pos.clamp(max=22)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, rows, pos, ids[rows, pos + 1]

    phases = []
    for tokens in ([37, 3], [5, 0], [0, 17]):  # rank 0's and rank 1's scored tokens
        inputs, rows, pos, targets = scored(tokens[rank])
        start = len(calls)
        with engine.autocast():
            stats = token_head.token_stats(model, inputs, rows, pos, targets, entropy=True)
        forward = calls[start:]
        loss = stats["logp"].sum() + 0.1 * stats["entropy"].sum()
        start = len(calls)
        engine.backward(loss)
        backward = calls[start:]
        engine.step()
        phases.append({"tokens": tokens[rank], "forward": forward, "backward": backward,
                       "logp": stats["logp"].detach().tolist()})
    result["phases"] = phases

    # inside engine.full_weights(): rank 0 alone runs the chunked head; no collective, and a checked one raises
    with engine.full_weights():
        start = len(calls)
        if rank == 0:
            inputs, rows, pos, targets = scored(37)
            with torch.no_grad():
                token_head.token_stats(model, inputs, rows, pos, targets)
            try:
                distributed.all_reduce_sum([1.0])
                result["inside"] = "no error"
            except CollectiveMismatch as exc:
                result["inside"] = str(exc)
        result["calls_inside"] = calls[start:]

    # checked collectives at different call sites: both ranks stop, each naming both calls
    try:
        if rank == 0:
            distributed.all_reduce_sum([1.0, 2.0])
        else:
            distributed.barrier()
        result["mismatch"] = "no error"
    except (CollectiveMismatch, distributed.CollectiveFailed) as exc:
        result["mismatch"] = f"{type(exc).__name__}: {exc}"
except Exception:
    result["error"] = traceback.format_exc()
with open(out, "w") as f:
    json.dump(result, f)
os._exit(0)  # no process-group teardown
'''


def test_a_collective_inside_full_weights_raises_at_once_in_one_process(tiny_model_dir):
    """The rule is checked without a second rank, so the whole suite checks it."""
    from transformers import AutoModelForCausalLM

    from oxrl_core.config import load_run_config
    from oxrl_core.engines.torch_engine import TorchEngine

    cfg = load_run_config(overrides=["train.lr=1e-3"], algorithm="sft")
    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg.train, cfg.engine)
    assert distributed.all_reduce_sum([2.0, 3]) == [2.0, 3]  # one process: the values as they are
    with engine.full_weights():
        for collective in (
            lambda: distributed.all_reduce_sum([1.0]),
            distributed.barrier,
            lambda: distributed.all_gather_object(1),
        ):
            with pytest.raises(CollectiveMismatch, match=r"issued inside engine\.full_weights\(\)"):
                collective()
    distributed.barrier()  # outside again: fine


@requires_deepspeed
def test_two_zero3_ranks_issue_the_same_collectives_for_uneven_inputs(tmp_path, tiny_model_dir):
    port = str(distributed.free_port())
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port, str(tiny_model_dir), str(tmp_path / f"rank{r}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    results = []
    for r in (0, 1):
        assert (tmp_path / f"rank{r}.json").is_file(), logs[r]
        results.append(json.loads((tmp_path / f"rank{r}.json").read_text()))
        assert "error" not in results[r], results[r]["error"]
    zero, one = results

    # the chunked head: the same collectives on both ranks, forward and backward, whatever each rank's tokens
    for a, b in zip(zero["phases"], one["phases"]):
        assert a["forward"] == b["forward"], (a["tokens"], b["tokens"])
        assert a["backward"] == b["backward"], (a["tokens"], b["tokens"])
        assert a["forward"] and a["backward"]  # ZeRO-3 gathers are counted: the count cannot pass vacuously
        assert len(a["logp"]) == a["tokens"] and len(b["logp"]) == b["tokens"]
    # inside engine.full_weights(): none, and a checked collective raises before it is issued
    assert zero["calls_inside"] == [] and one["calls_inside"] == []
    assert "issued inside engine.full_weights()" in zero["inside"] and "test_collectives" not in zero["inside"]

    # different checked collectives: each rank names both ranks' call sites
    for result in (zero, one):
        message = result["mismatch"]
        assert message.startswith("CollectiveMismatch: ranks out of step before the first step: rank 0 at __main__:")
        assert "(<module>) (collective #" in message and "; rank 1 at __main__:" in message, message
    assert zero["mismatch"] == one["mismatch"]
