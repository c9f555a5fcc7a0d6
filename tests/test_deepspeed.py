"""The `deepspeed` engine and Ray data parallelism, on CPU (gloo), through the real CLI.

Invariances (``docs/architecture.md``, engines): ZeRO-1/2/3 in one process and ZeRO-3 over two Ray ranks follow the
`torch` engine's loss trajectory; resume from a ZeRO-3 checkpoint equals the uninterrupted run;
a killed rank stops the run cleanly and `--resume` finishes it. Tolerances: the ranks' gradients
are summed in another order than one process sums them, and ZeRO computes the clipping norm in
its own order, so values agree to float32 rounding (~1e-7 relative per step); Adam turns that
into weight differences of at most ~1e-5 after a few steps at lr 1e-3. Losses are compared at
1e-5, weights at 1e-4.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from archs import LINEAR_ATTENTION
from conftest import oxrl as _oxrl
from conftest import read_metrics, write_jsonl

from oxrl_core.config import load_run_config
from oxrl_core.errors import OxrlError

requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install 'oxrl[deepspeed]')"
)
requires_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'oxrl[ray]')")

LOSS_ATOL, WEIGHT_ATOL = 1e-5, 1e-4
#: LoRA runs also take the chunked LM head (ZeRO-3 re-partitions the frozen head weight after each recompute);
#: the other runs here take the full logits, the default at this vocabulary
LORA = ["--set", "lora.enabled=true", "--set", "lora.r=4", "--set", "lora.alpha=8", "--set", "train.lr=1e-2"]
LORA += ["--set", "train.logits_chunk_min_mb=0"]
DS = ["--set", "engine.name=deepspeed"]
DP2 = [*DS, "--set", "engine.zero_stage=3", "--set", "engine.world_size=2", "--set", "engine.timeout_s=120"]

DIGITS_REWARD = '''
from oxrl_core.interfaces import Reward


class Digits(Reward):
    """The share of digits in a completion: a reward that varies inside every group."""

    name = "digits"

    def score(self, prompts, completions, examples):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
'''


def oxrl(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """The CLI with one torch thread per process: the tiny model runs faster so, and the two Ray ranks get one each
    (``env``: more variables, e.g. RAY_ADDRESS to join a given cluster)."""
    return _oxrl(*args, env={"OMP_NUM_THREADS": "1", **(env or {})}, **kwargs)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_close_weights(a: dict, b: dict, atol: float = WEIGHT_ATOL) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=atol, rtol=0, msg=f"tensor {key} differs")


def _assert_same_trajectory(a: Path, b: Path, keys=("loss",), atol: float = LOSS_ATOL) -> None:
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        for key in keys:
            assert x[key] == pytest.approx(y[key], abs=atol), (key, x["step"], x[key], y[key])


# ----------------------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return make_work(tmp_path_factory.mktemp("deepspeed"))


def make_work(root: Path) -> Path:
    """The runs' inputs in ``root``: SFT rows, RL prompts with answers, the digits reward."""
    write_jsonl(
        root / "sft.jsonl",
        [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(6) for b in range(6)],
    )
    write_jsonl(
        root / "prompts.jsonl",
        [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(6) for b in range(6)],
    )
    (root / "digits.py").write_text(DIGITS_REWARD)
    return root


def sft_args(work: Path, model: Path, *sets: str) -> list[str]:
    """`oxrl run` of 4 optimiser steps of 2 micro-batches of 8 rows (each rank of two gets 4 rows of each)."""
    return [
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={model}",
        "--set",
        f"data.train={work / 'sft.jsonl'}",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.batch_size=8",
        "--set",
        "train.grad_accum_steps=2",
        "--set",
        "train.lr=1e-3",
        "--set",
        "train.save_every=2",
        *sets,
    ]


def sgrpo_args(work: Path, model: Path, *sets: str) -> list[str]:
    """`oxrl run` of 3 steps of 4 prompts × 4 samples in two seeded rollout shards (so one process samples what
    two ranks do)."""
    return [
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={model}",
        "--set",
        f"data.train={work / 'prompts.jsonl'}",
        "--set",
        f"reward.name={work / 'digits.py'}:Digits",
        "--set",
        "train.max_steps=3",
        "--set",
        "train.batch_size=4",
        "--set",
        "rollout.n=4",
        "--set",
        "rollout.max_new_tokens=6",
        "--set",
        "train.lr=1e-2",
        "--set",
        "engine.rollout_shards=2",
        *sets,
    ]


def _sft(work: Path, name: str, model: Path, *sets: str, env: dict | None = None) -> Path:
    """`sft_args` run in ``work/name``; ``env``: more variables for `oxrl`."""
    _ok(oxrl(*sft_args(work, model, *sets), "-o", str(work / name), cwd=work, env=env))
    return work / name


def _sgrpo(work: Path, name: str, model: Path, *sets: str, env: dict | None = None) -> Path:
    """`sgrpo_args` run in ``work/name``; ``env``: more variables for `oxrl`."""
    _ok(oxrl(*sgrpo_args(work, model, *sets), "-o", str(work / name), cwd=work, env=env))
    return work / name


@pytest.fixture(scope="module")
def torch_sft(work, tiny_model_dir) -> Path:
    return _sft(work, "torch-sft", tiny_model_dir)


# ----------------------------------------------------------------------------- settings refused before launch


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["engine.zero_stage=3"], ["engine.zero_stage=3 needs engine.name: deepspeed"]),
        (["engine.world_size=2"], ["engine.world_size=2 needs engine.name: deepspeed"]),
        (["engine.name=deepspeed", "engine.offload_optimizer=true"], ["engine.offload_optimizer needs ZeRO", "got 0"]),
        (
            ["engine.name=deepspeed", "engine.zero_stage=2", "engine.offload_params=true"],
            ["engine.offload_params needs engine.zero_stage: 3", "got 2"],
        ),
        (
            ["engine.name=deepspeed", "engine.world_size=4", "train.batch_size=6"],
            ["train.batch_size=6", "engine.world_size=4", "6 / 4 = 1.5", "train.batch_size × train.grad_accum_steps"],
        ),
    ],
)
def test_inconsistent_engine_settings_exit_2_with_the_fields_and_the_arithmetic(
    tmp_path, tiny_model_dir, sets, expected
):
    args = [a for s in sets for a in ("--set", s)]
    proc = oxrl(
        "run", "--alg", "sft", "--set", f"model.name={tiny_model_dir}", *args, "-o", str(tmp_path / "r"), cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr)
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_rollout_shards_must_deal_evenly_to_the_ranks():
    config = load_run_config(
        overrides=["engine.name=deepspeed", "engine.world_size=2", "engine.rollout_shards=3", "train.batch_size=6"],
        algorithm="sgrpo",
    )
    from oxrl_core.engines import check_engine

    with pytest.raises(
        OxrlError,
        match=r"engine.rollout_shards=3 rollout shards cannot be dealt evenly to engine.world_size=2 ranks \(3 / 2 = 1.5\)",
    ):
        check_engine(config, needs_rollouts=True)
    config = load_run_config(overrides=["engine.rollout_shards=3", "train.batch_size=4"], algorithm="sgrpo")
    with pytest.raises(OxrlError, match=r"train.batch_size=4 prompts cannot be cut into 3 equal rollout shards"):
        check_engine(config, needs_rollouts=True)


def test_world_size_beyond_the_gpus_is_refused(monkeypatch):
    """One GPU per rank: checked against this machine's GPUs before Ray starts."""
    from oxrl_core.engines import check_local_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    engine = load_run_config(overrides=["engine.name=deepspeed", "engine.world_size=2"], algorithm="sft").engine
    with pytest.raises(OxrlError, match=r"engine.world_size=2 ranks need 2 GPUs \(one each\) but this machine has 1"):
        check_local_gpus(engine)
    check_local_gpus(
        load_run_config(
            overrides=["engine.name=deepspeed", "engine.world_size=2", "engine.device=cpu"], algorithm="sft"
        ).engine
    )


@requires_ray
@pytest.mark.slow
def test_more_ranks_than_the_cluster_holds_are_refused_at_launch(tmp_path, tiny_model_dir):
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        *DS,
        "--set",
        "engine.device=cpu",
        "--set",
        "engine.world_size=512",
        "--set",
        "train.batch_size=512",
        "-o",
        str(tmp_path / "r"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "engine.world_size=512 CPU ranks need 512 CPUs" in proc.stderr and "Traceback" not in proc.stderr


def test_deepspeed_json_is_generated_from_the_config():
    from oxrl_core.engines.deepspeed_engine import deepspeed_config

    config = load_run_config(
        overrides=[
            "engine.name=deepspeed",
            "engine.zero_stage=3",
            "engine.world_size=2",
            "engine.offload_optimizer=true",
            "engine.offload_params=true",
            "train.batch_size=8",
            "train.grad_accum_steps=4",
            "train.max_grad_norm=0.5",
        ],
        algorithm="sft",
    )
    ds = deepspeed_config(config.train, config.engine, bf16=True)
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * config.engine.world_size == 8 * 4
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert (
        ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
        and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    )
    assert ds["managed_gradient_accumulation"] is False  # the loops own accumulation


def test_shards_cover_every_row_once_and_pad_ranks_without_rows(monkeypatch):
    from oxrl_core.engines import distributed

    def shares(rows, unit, n):
        out = []
        for r in range(n):
            monkeypatch.setattr(distributed, "world_size", lambda: n)
            monkeypatch.setattr(distributed, "rank", lambda r=r: r)
            out.append(distributed.shard(rows, unit))
        return out

    got = shares(list(range(10)), 2, 2)  # 5 groups of 2 over 2 ranks
    assert got == [([0, 1, 2, 3], False), ([4, 5, 6, 7, 8, 9], False)]
    got = shares([7, 8, 9], 1, 4)  # 3 rows over 4 ranks: rank 0 stands in with row 7, weight 0
    assert got == [([7], True), ([7], False), ([8], False), ([9], False)]


# ----------------------------------------------------------------------------- one process


@requires_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_single_process_zero_stages_match_the_torch_engine(stage, work, tiny_model_dir, torch_sft):
    from transformers import AutoModelForCausalLM

    run = _sft(work, f"zero{stage}", tiny_model_dir, *DS, "--set", f"engine.zero_stage={stage}")
    _assert_same_trajectory(torch_sft, run, keys=("loss", "grad_norm", "lr"))
    final = _weights(run / "final")
    _assert_close_weights(_weights(torch_sft / "final"), final)
    model = AutoModelForCausalLM.from_pretrained(run / "final")  # an ordinary HF directory
    assert all(torch.equal(p.detach(), final[n]) for n, p in model.named_parameters())
    ds_json = json.loads((run / "deepspeed_config.json").read_text())
    assert ds_json["zero_optimization"]["stage"] == stage
    state = json.loads((run / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["engine"] == {"name": "deepspeed", "zero_stage": stage, "world_size": 1}


@requires_deepspeed
@pytest.mark.slow
def test_zero3_checkpoint_holds_the_gathered_weights_and_resume_equals_the_uninterrupted_run(work, tiny_model_dir):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = work / "zero3"
    if not (full / "final").is_dir():
        _sft(work, "zero3", tiny_model_dir, *DS, "--set", "engine.zero_stage=3")
    ckpt = full / "checkpoints" / "step-2"
    # the HF weights of the checkpoint are DeepSpeed's own fp32 masters, gathered from the partitions
    masters = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag="state")
    _assert_close_weights(masters, _weights(ckpt), atol=0)
    # resume from step 2 as if the run had been killed after that checkpoint
    cut = work / "zero3-resumed"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "final")
    (cut / "summary.json").unlink()
    proc = _ok(oxrl("run", "--resume", "-o", str(cut), cwd=work))
    assert "resuming from" in proc.stderr
    assert [m["step"] for m in read_metrics(cut)] == [1, 2, 3, 4]
    _assert_same_trajectory(full, cut, keys=("loss", "grad_norm"), atol=0)
    _assert_close_weights(_weights(full / "final"), _weights(cut / "final"), atol=0)


@requires_deepspeed
def test_a_checkpoint_resumes_only_under_the_engine_that_wrote_it(tmp_path, torch_sft):
    run = tmp_path / "run"
    shutil.copytree(torch_sft, run)
    shutil.rmtree(run / "final")
    proc = oxrl("run", "--resume", "-o", str(run), *DS, "--set", "engine.zero_stage=2", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        "was written with engine.name=torch but this run has engine.name=deepspeed, engine.zero_stage=2" in proc.stderr
    )


@requires_deepspeed
@pytest.mark.slow
def test_lora_under_zero3_matches_the_torch_engine(work, tiny_model_dir):
    """ZeRO-3 partitions the frozen base and the adapter alike; the merged final/ and the adapter are
    gathered whole and equal the torch engine's."""
    single = _sft(work, "torch-lora-sft", tiny_model_dir, *LORA)
    run = _sft(work, "zero3-lora-sft", tiny_model_dir, *LORA, *DS, "--set", "engine.zero_stage=3")
    _assert_same_trajectory(single, run, keys=("loss", "grad_norm"))
    merged = _weights(run / "final")
    _assert_close_weights(_weights(single / "final"), merged)
    _assert_close_weights(_weights(single / "final" / "adapter"), _weights(run / "final" / "adapter"))
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    base = _weights(tiny_model_dir)
    assert max((merged[k] - base[k]).abs().max().item() for k in base) > 1e-3  # the adapter trained and is merged in


# ----------------------------------------------------------------------------- two ranks over Ray


@requires_deepspeed
@requires_ray
@pytest.mark.slow
def test_two_zero3_ranks_follow_the_single_process_sft_trajectory(work, tiny_model_dir, torch_sft):
    run = _sft(work, "dp-sft", tiny_model_dir, *DP2)
    _assert_same_trajectory(torch_sft, run, keys=("loss", "grad_norm", "perf/tokens"))
    _assert_close_weights(_weights(torch_sft / "final"), _weights(run / "final"))
    ranks = json.loads((run / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    # where each rank ran: one node here, its Ray node id and host, and the threads each rank was given
    assert all(r["node_id"] == ranks[0]["node_id"] and len(r["node_id"]) > 8 for r in ranks)
    assert all(r["host"] == socket.gethostname() and r["threads"] >= 1 for r in ranks)
    state = run / "checkpoints" / "step-2"
    assert sorted(p.name for p in (state / "deepspeed" / "state").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert (state / "rng-rank1.pt").is_file()


@requires_deepspeed
@requires_ray
@pytest.mark.slow
def test_two_zero3_ranks_follow_the_single_process_sgrpo_trajectory(work, tiny_model_dir):
    """Each rank samples its rollout shard; with the same engine.rollout_shards one process samples the
    same completions, so rewards agree exactly and losses to rounding."""
    single = _sgrpo(work, "torch-sgrpo", tiny_model_dir)
    run = _sgrpo(work, "dp-sgrpo", tiny_model_dir, *DP2)
    _assert_same_trajectory(single, run, keys=("reward/mean", "reward/std", "response/length"), atol=0)
    _assert_same_trajectory(single, run, keys=("loss", "grad_norm", "rollout/logprob_diff"))
    # rollouts.jsonl: rank 0 alone writes it (one line a logged step), the same samples as one process
    logged = [[json.loads(line) for line in (r / "rollouts.jsonl").read_text().splitlines()] for r in (single, run)]
    assert [x["step"] for x in logged[1]] == [x["step"] for x in logged[0]] == [1, 3]
    for a, b in zip(*logged):
        assert a["rewards"] == b["rewards"] and [s["ids"] for s in a["samples"]] == [s["ids"] for s in b["samples"]]
        assert all(s["logp"] == pytest.approx(t["logp"], abs=1e-3) for s, t in zip(a["samples"], b["samples"]))
    # lr 1e-2 with Adam: a weight whose gradient is rounding noise moves by up to ~lr per step whatever its sign,
    # so summation order alone (rows per rank, the LM head's token chunks) moves a few by ~1e-4
    _assert_close_weights(_weights(single / "final"), _weights(run / "final"), atol=5e-4)


@requires_deepspeed
@requires_ray
@pytest.mark.slow
def test_two_zero3_ranks_train_lora_like_one_process(work, tiny_model_dir):
    """LoRA composed with ZeRO-3 over two Ray ranks: the same LoRA SGRPO run as one torch process."""
    single = _sgrpo(work, "torch-lora-sgrpo", tiny_model_dir, *LORA)
    run = _sgrpo(work, "dp-lora-sgrpo", tiny_model_dir, *LORA, *DP2)
    _assert_same_trajectory(single, run, keys=("reward/mean", "reward/std"), atol=0)
    _assert_same_trajectory(single, run, keys=("loss", "grad_norm"))
    _assert_close_weights(_weights(single / "final" / "adapter"), _weights(run / "final" / "adapter"))
    _assert_close_weights(_weights(single / "final"), _weights(run / "final"))


@requires_deepspeed
@requires_ray
@pytest.mark.slow
def test_two_zero3_ranks_train_qwen3_5_moe_like_one_process(work, arch_model):
    """Qwen3.5-MoE (Gated DeltaNet linear attention packed per sequence, full attention, experts and the shared
    expert: every part of the dense Qwen3.5 and more) under ZeRO-3 over two Ray ranks: the same SFT trajectory and
    final weights as one torch process, and `final/` reloads whole."""
    from transformers import AutoModelForCausalLM

    model = arch_model(LINEAR_ATTENTION[-1])
    short = ("--set", "train.max_steps=2", "--set", "train.save_every=0")
    single = _sft(work, "torch-qwen3_5_moe", model, *short)
    run = _sft(work, "dp-qwen3_5_moe", model, *DP2, *short)
    _assert_same_trajectory(single, run, keys=("loss", "perf/tokens"))
    _assert_same_trajectory(single, run, keys=("grad_norm",), atol=1e-4)  # a norm of ~6: summation order
    _assert_close_weights(_weights(single / "final"), _weights(run / "final"))
    _, info = AutoModelForCausalLM.from_pretrained(run / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@requires_deepspeed
@requires_ray
@pytest.mark.slow
def test_a_killed_rank_stops_the_run_cleanly_and_resume_finishes_it(work, tiny_model_dir, ray_address):
    run = work / "killed"
    args = [
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={work / 'sft.jsonl'}",
        "--set",
        "train.max_steps=60",
        "--set",
        "train.batch_size=8",
        "--set",
        "train.lr=1e-3",
        "--set",
        "train.save_every=4",
        *DP2,
        "-o",
        str(run),
    ]
    driver = start_oxrl(args, work, {"RAY_ADDRESS": ray_address})
    wait_for(driver, (run / "checkpoints" / "step-4").is_dir)
    victim = json.loads((run / "ranks.json").read_text())[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    stderr, last = stopped_resumably(driver, run, since=time.time())
    assert f"rank 1 (pid {victim}" in stderr and "died" in stderr
    resume_to_the_end(work, run, last, steps=60)
    assert (run / "final" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- runs stopped mid-way


def start_oxrl(args: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    """`oxrl` in a process of its own, in the background (the test acts on it or its ranks meanwhile), with one
    torch thread per process as `oxrl` here; ``env``: more variables."""
    exe = Path(sys.executable).with_name("oxrl")
    return subprocess.Popen(
        [str(exe), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def wait_for(driver: subprocess.Popen, ready, timeout: float = 300) -> None:
    """Poll until ``ready()``; fails if the driver exits first or ``timeout`` passes."""
    deadline = time.time() + timeout
    while not ready():
        assert driver.poll() is None, driver.communicate()
        assert time.time() < deadline
        time.sleep(0.05)


def stopped_resumably(driver: subprocess.Popen, run: Path, since: float) -> tuple[str, Path]:
    """The driver of a run that lost a rank at ``since``: it stops at once (not after a collective timeout) with
    exit 2, no traceback and how to resume, leaves no final/, and its newest complete checkpoint holds both ranks'
    ZeRO optimizer shards. Returns (its stderr, that checkpoint)."""
    from oxrl_core.run_io.checkpoint import latest_checkpoint

    try:
        _, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert time.time() - since < 60
    assert driver.returncode == 2, stderr
    assert "Traceback" not in stderr and f"oxrl run --resume --output-dir {run}" in stderr, stderr
    assert not (run / "final").exists()
    last = latest_checkpoint(run)
    assert last is not None and len(list((last / "deepspeed" / "state").glob("*optim_states.pt"))) == 2
    return stderr, last


def resume_to_the_end(work: Path, run: Path, last: Path, steps: int, env: dict | None = None) -> None:
    """`oxrl run --resume` continues from ``last`` and logs every step of the run once."""
    resumed = _ok(oxrl("run", "--resume", "-o", str(run), cwd=work, env=env))
    assert f"resuming from {last}" in resumed.stderr
    assert [m["step"] for m in read_metrics(run)] == list(range(1, steps + 1))
    assert (run / "final" / "model.safetensors").is_file()
