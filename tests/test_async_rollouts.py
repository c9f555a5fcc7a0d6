"""Asynchronous rollouts (``rollout.max_staleness: k``, `oxrl_core.rl.sources`): the batch of step s comes from
policy version max(0, s − 1 − k), exactly, whatever the timing; the importance weights and off-policy metrics by
their formulas; in-flight batches kept and refused as files a user could hand over; overlap shown by events;
end to end: the schedule, the rollout logprobs re-scored with each version's saved weights, a lying backend, and
a run killed mid-pipeline and resumed equal to an uninterrupted one. (k = 0 with an actor reproduces the
``sgrpo_actors`` golden run recorded before this code existed: tests/test_golden.py.)"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import oxrl, read_metrics

from oxrl_core.config import RolloutConfig
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Completion
from oxrl_core.observability.health import ASYNC_BOUND, pipeline_text
from oxrl_core.rl.sources import (
    INFLIGHT_FILE,
    AsyncRollouts,
    Worker,
    check_schedule,
    decode,
    encode,
    load_in_flight,
    scheduled_version,
)
from oxrl_core.rollout.sync import off_policy_metrics, tis_weight
from oxrl_core.scoring.rewards import Failures

# ----------------------------------------------------------------------------- the maths, by hand


def test_importance_weights_truncate_and_mask_by_their_formulas():
    # r = π_old / π_rollout per token: 0.25, 1.0, 3.0 | 0.5, 1.5, (masked-out position)
    r = torch.tensor([[0.25, 1.0, 3.0], [0.5, 1.5, 9.0]])
    logp_rollout = torch.log(torch.tensor([[0.4, 0.2, 0.1], [0.5, 0.2, 0.1]]))
    logp_old = logp_rollout + torch.log(r)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])

    w, m = tis_weight(logp_old, logp_rollout, mask, cap=2.0)  # truncate: min(r, 2)
    assert torch.allclose(w, torch.tensor([[0.25, 1.0, 2.0], [0.5, 1.5, 0.0]]), atol=1e-6)
    assert m["tis/weight_mean"] == pytest.approx((0.25 + 1 + 2 + 0.5 + 1.5) / 5, abs=1e-6)
    assert m["tis/clipped_frac"] == pytest.approx(1 / 5)

    w, m = tis_weight(logp_old, logp_rollout, mask, cap=2.0, mode="mask", low=0.4)  # r outside [0.4, 2] -> 0
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0], [0.5, 1.5, 0.0]]), atol=1e-6)
    assert m["tis/masked_frac"] == pytest.approx(2 / 5)
    assert m["tis/weight_mean"] == pytest.approx(3.0 / 5, abs=1e-6)

    w, m = tis_weight(logp_old, logp_rollout, mask, cap=0.0)  # off
    assert torch.equal(w, torch.ones_like(w)) and m == {}


def test_off_policy_metrics_by_their_formulas():
    r = [0.5, 1.0, 2.0]
    logp_rollout = torch.log(torch.tensor([[0.2, 0.3, 0.1, 0.7]]))
    logp_old = logp_rollout + torch.log(torch.tensor([r + [5.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 4th token is not a completion token
    m = off_policy_metrics(logp_old, logp_rollout, mask)
    assert m["offpolicy/kl_k3"] == pytest.approx(sum((x - 1) - math.log(x) for x in r) / 3, abs=1e-6)
    assert m["offpolicy/chi2"] == pytest.approx(sum((x - 1) ** 2 for x in r) / 3, abs=1e-6)
    assert m["offpolicy/ess"] == pytest.approx(sum(r) ** 2 / (3 * sum(x * x for x in r)), abs=1e-6)
    on_policy = off_policy_metrics(logp_rollout, logp_rollout, mask)
    assert on_policy == pytest.approx({"offpolicy/kl_k3": 0.0, "offpolicy/chi2": 0.0, "offpolicy/ess": 1.0})


def test_the_schedule_and_the_options_that_go_with_it():
    ro = RolloutConfig(actors=1, max_staleness=2)
    assert [scheduled_version(s, ro.max_staleness) for s in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    assert [scheduled_version(s, RolloutConfig().max_staleness) for s in range(1, 4)] == [0, 1, 2]
    assert ro.importance_cap == 2.0 and RolloutConfig().importance_cap == 0.0  # unset: 2.0 when asynchronous
    assert RolloutConfig(actors=1, max_staleness=1, tis_cap=3).importance_cap == 3.0
    refused = {
        "needs rollout.actors >= 1": dict(max_staleness=1),
        "rollout.tis_cap=0 with rollout.max_staleness=1": dict(actors=1, max_staleness=1, tis_cap=0),
        "the check cannot be turned off": dict(actors=1, max_staleness=1, strict_on_policy=False),
        "is_mode=mask needs an importance weight": dict(is_mode="mask"),
        "is_low is the lower bound of rollout.is_mode=mask": dict(is_low=0.5),
    }
    for message, settings in refused.items():
        with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
            RolloutConfig(**settings)


def test_the_cli_refuses_asynchronous_rollouts_without_actors_naming_the_fields(tmp_path):
    proc = oxrl("run", "--alg", "sgrpo", "--set", "rollout.max_staleness=1", "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "rollout.max_staleness=1 needs rollout.actors >= 1" in proc.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_sample_off_the_schedule_stops_the_run(tmp_path):
    done = [Completion([1, 2], [-0.1, -0.2], "stop", 1)]
    assert check_schedule(done, 1, 3, 1, tmp_path) == {1}
    with pytest.raises(OxrlError, match=r"step 4: samples from policy version\(s\) \[1\].*max\(0, 4 - 1 - 1\) = 2"):
        check_schedule(done, 2, 4, 1, tmp_path)


# ----------------------------------------------------------------------------- in-flight batches on disk


def test_in_flight_batches_round_trip_through_a_weights_only_load(tmp_path):
    failures = Failures("arith", samples=8, errors=1, first_error="boom", first_row=3, failed_rows=[3])
    produced = (
        [4, 7],
        [[1, 2, 3], [1, 5]],
        [Completion([9, 3], [-0.5, -0.01], "stop", 2, None), Completion([8], [-1.25], "length", 2, [1])],
        [1.0, 0.0],
        {"reward/mean": 0.5},
        failures,
        [{"pixel_values": torch.randn(2, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}, {}],
        Failures("calc", "environment", samples=2, timeouts=1, first_timed_out=True),
    )
    torch.save({"payload": encode(produced)}, tmp_path / "f.pt")
    back = decode(torch.load(tmp_path / "f.pt", weights_only=True)["payload"])
    assert back[:6] == produced[:6] and back[7] == produced[7]
    assert torch.equal(back[6][0]["pixel_values"], produced[6][0]["pixel_values"]) and back[6][1] == {}
    with pytest.raises(TypeError, match="cannot keep a object"):
        encode([object()])


def test_in_flight_failures_of_a_checkpoint_written_with_two_failure_classes_still_load():
    """Before a reward's and an environment's failures were one `Failures` record, a checkpoint tagged them
    RewardFailures (``reward``, ``rows``) and EnvFailures (``env``, ``episodes``, no ``failed_rows``): exactly these
    payloads, as that code wrote them, decode to the records a run of today would have kept."""
    reward = {"reward": "arith", "rows": 8, "errors": 1, "timeouts": 0, "first_error": "boom", "first_row": 3,
              "first_prompt": "'1+1'", "failed_rows": [3]}  # fmt: skip
    env = {"env": "calc", "episodes": 2, "errors": 0, "timeouts": 1, "first_error": "timeout", "first_row": 2,
           "first_prompt": "'2+2'", "first_timed_out": True}  # fmt: skip
    payload = {"__tuple__": [{"__class__": "RewardFailures", "fields": reward},
                             {"__class__": "EnvFailures", "fields": env}]}  # fmt: skip
    back = decode(payload)
    assert back == (
        Failures("arith", "reward", 8, 1, 0, "boom", 3, "'1+1'", failed_rows=[3]),
        Failures("calc", "environment", 2, 0, 1, "timeout", 2, "'2+2'", first_timed_out=True),
    )
    assert back[1].describe().startswith("environment 'calc' failed on row 2: timeout (prompt '2+2'); 1 of 2 episodes")
    assert decode(encode(back)) == back  # and written again under today's tag


def _save_in_flight(ckpt: Path, k: int, steps: list[int]) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    batches = [{"step": s, "version": 0, "seed": s, "payload": encode(([s], [], [], [], {}, Failures("r")))}
               for s in steps]  # fmt: skip
    torch.save({"max_staleness": k, "step": steps[0] - 1, "batches": batches}, ckpt / INFLIGHT_FILE)


def test_a_checkpoint_in_flight_file_that_does_not_fit_the_run_is_refused_naming_it(tmp_path):
    ckpt = tmp_path / "step-4"
    _save_in_flight(ckpt, 2, [5, 6])
    assert sorted(load_in_flight(ckpt, 2, 4, 10)) == [5, 6]
    with pytest.raises(OxrlError, match=r"written with rollout.max_staleness=2 and this run has 1.*--set"):
        load_in_flight(ckpt, 1, 4, 10)
    with pytest.raises(OxrlError, match=r"written with rollout.max_staleness=2 and this run has 0"):
        load_in_flight(ckpt, 0, 4, 10)
    _save_in_flight(ckpt, 3, [5, 6])
    with pytest.raises(OxrlError, match=r"holds the batches of steps \[5, 6\], expected \[5, 6, 7\]"):
        load_in_flight(ckpt, 3, 4, 10)
    _save_in_flight(ckpt, 2, [5, 6])
    (ckpt / INFLIGHT_FILE).write_bytes(b"PK\x03\x04 not a torch file")
    with pytest.raises(OxrlError, match=rf"{INFLIGHT_FILE}: not a readable state file"):
        load_in_flight(ckpt, 2, 4, 10)
    (ckpt / INFLIGHT_FILE).unlink()
    assert load_in_flight(ckpt, 0, 4, 10) == {}
    with pytest.raises(OxrlError, match=r"without asynchronous rollouts.*steps 5..6.*resume with rollout.max_stal"):
        load_in_flight(ckpt, 2, 4, 10)


# ----------------------------------------------------------------------------- the pipeline with fakes


class FakeActors:
    """Stands for `RolloutActors`: remembers the version it holds; generation reads it."""

    def __init__(self, events):
        self.events, self.version, self.actors = events, 0, ["actor"]

    def put_weights(self, model):
        return f"weights-{len(self.events)}"

    def load_weights(self, ref, version):
        self.events.append(("load", version, time.perf_counter()))
        self.version = version


class FakeStrategy:
    """Generation that records when it starts and ends and which version the actors held."""

    def __init__(self, actors, events, gen_s, block_step=None):
        self.actors, self.events, self.gen_s, self.block = actors, events, gen_s, block_step
        self.release = threading.Event()

    def produce(self, picks, sampling):
        step = picks[0] + 1
        self.events.append(("gen_start", step, time.perf_counter()))
        if step == self.block:
            self.release.wait(30)
        time.sleep(self.gen_s)
        self.events.append(("gen_end", step, time.perf_counter()))
        return step, self.actors.version


def _pipeline(k: int, max_steps: int, gen_s: float, timeout_s: float = 30, block_step=None):
    events: list = []
    actors = FakeActors(events)
    strategy = FakeStrategy(actors, events, gen_s, block_step)
    cfg = SimpleNamespace(
        rollout=RolloutConfig(actors=1, max_staleness=k),
        train=SimpleNamespace(seed=0, max_steps=max_steps),
        engine=SimpleNamespace(timeout_s=timeout_s),
    )
    engine = SimpleNamespace(full_weights=contextlib.nullcontext, autocast=contextlib.nullcontext)
    plan = SimpleNamespace(micro_batch=lambda i: [i])
    pipe = AsyncRollouts(strategy, actors, plan, cfg, None, engine, None, 1e-3, 0, {}, Path("/nonexistent"), k=k)
    return pipe, events, strategy


@pytest.mark.parametrize("k", [1, 2])
def test_generation_overlaps_training_and_every_batch_has_its_scheduled_version(k):
    steps, train_s = 6, 0.1
    pipe, events, _ = _pipeline(k, steps, gen_s=0.05)
    trained = {}
    try:
        for step in range(1, steps + 1):
            (got_step, version), info = pipe.take(step)
            trained[got_step] = version
            assert info["perf/gen_s"] >= 0.05
            events.append(("train_start", step, time.perf_counter()))
            time.sleep(train_s)
            events.append(("train_end", step, time.perf_counter()))
            pipe.push(step, last=step == steps)
    finally:
        pipe.close()
    assert trained == {s: max(0, s - 1 - k) for s in range(1, steps + 1)}
    at = {(name, step): t for name, step, t in events}
    for s in range(1, steps):  # overlap, by events: step s+1's generation starts before step s's training ends
        assert at[("gen_start", s + 1)] < at[("train_end", s)]
    assert [v for name, v, _ in events if name == "load"] == list(range(1, steps + 1))  # every push, in order
    assert max(s for name, s, _ in events if name == "gen_start") == steps  # nothing past train.max_steps


def test_the_async_speedup_counts_only_generation_inside_the_steps():
    """k = 2, 3 steps: the three batches are made during start-up (before step 1), then each step trains 0.02 s
    without waiting. Counting the batches' whole generation time (``perf/gen_s``) would claim (0.3 + 0.06) / 0.06 =
    6× over the phases run in turn; inside the steps nothing was generated, so the speedup is 1×, and never above
    the 2× bound (generation and scoring overlapping training)."""
    pipe, _, _ = _pipeline(2, 3, gen_s=0.1)
    records = []
    try:
        time.sleep(0.5)  # start-up: the first k + 1 batches are generated meanwhile
        for step in range(1, 4):
            start = time.perf_counter()
            _, info = pipe.take(step)
            waited = time.perf_counter() - start
            time.sleep(0.02)  # training
            train = time.perf_counter() - start - waited
            pipe.push(step, last=step == 3)
            end = time.perf_counter()
            records.append({"step": step, "policy/staleness_max": 0.0, "perf/gen_s": info["perf/gen_s"],
                            "perf/gen_in_step_s": pipe.generation_within(start, end), "perf/gen_wait_s": waited,
                            "perf/train_s": train, "perf/step_s": end - start})  # fmt: skip
    finally:
        pipe.close()
    assert all(r["perf/gen_s"] >= 0.1 and r["perf/gen_in_step_s"] == 0.0 for r in records), records
    whole = sum(r["perf/gen_s"] + r["perf/train_s"] for r in records) / sum(r["perf/step_s"] for r in records)
    assert whole > 3  # what counting start-up batches would say
    ratio = float(pipeline_text(records).split("×")[0])
    assert ratio == pytest.approx(
        sum(r["perf/train_s"] for r in records) / sum(r["perf/step_s"] for r in records), abs=0.01
    )
    assert ratio <= 1.0


def test_generation_spans_count_their_part_inside_a_window():
    pipe, _, _ = _pipeline(1, 1, gen_s=0.0)
    pipe.close()
    pipe._spans = [[0.0, 1.0], [2.0, 4.0], [5.0, None]]  # made before, straddling, still running
    assert pipe.generation_within(1.5, 3.0) == pytest.approx(1.0)
    assert pipe.generation_within(3.0, 6.0) == pytest.approx(1.0 + 1.0)
    assert pipe._spans == [[2.0, 4.0], [5.0, None]]  # spans ended before the window are dropped


def test_a_batch_that_does_not_arrive_stops_the_run_within_the_timeout_naming_the_actor():
    pipe, events, strategy = _pipeline(1, 4, gen_s=0.0, timeout_s=0.5, block_step=2)
    try:
        pipe.take(1)
        start = time.perf_counter()
        with pytest.raises(OxrlError, match=r"the rollout batch of step 2 did not arrive within engine.timeout_s=0.5s.*"
                                            r"rollout actor 0"):  # fmt: skip
            pipe.take(2)
        assert time.perf_counter() - start < 5
    finally:
        strategy.release.set()
        pipe.close()


def test_the_worker_runs_jobs_in_submission_order_and_reports_their_errors():
    worker, seen = Worker(), []
    futures = [worker.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), seen.append(i))) for i in range(3)]
    bad = worker.submit(lambda: 1 / 0)
    [f.result(5) for f in futures]
    assert seen == [0, 1, 2]
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    worker.close()


# ----------------------------------------------------------------------------- end to end (the CLI, Ray actors)

COMMON = [
    "--set", "train.batch_size=4", "--set", "rollout.n=4", "--set", "rollout.max_new_tokens=8",
    "--set", "train.eval_every=0", "--set", "train.lr=1e-2", "--set", "train.lr_scheduler=constant",
    "--set", "rollout.actors=1", "-q",
]  # fmt: skip
ENV = {"OMP_NUM_THREADS": "1"}

LIAR = """
from oxrl_core.interfaces import Completion
from oxrl_core.rollout.hf import HFRolloutBackend


class OneAhead(HFRolloutBackend):
    name = "one_ahead"

    def generate(self, prompt_token_ids, sampling, images=None):
        groups = super().generate(prompt_token_ids, sampling)
        if self.policy_version < 1:
            return groups
        return [[Completion(c.token_ids, c.logprobs, c.finish_reason, c.policy_version + 1) for c in g] for g in groups]
"""


def _rl(tmp_path, model, name: str, *sets: str, steps: int = 5):
    run = tmp_path / name
    args = ["run", "--alg", "sgrpo", "--set", f"model.name={model}", "--set", f"train.max_steps={steps}", *COMMON]
    return run, oxrl(*args, *sets, "-o", str(run), cwd=tmp_path, env=ENV)


def _completion_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Plain transformers, one sequence: log p(completion token | everything before it)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


K2 = ["--set", "rollout.max_staleness=2", "--set", "train.save_every=1", "--set", "train.save_total_limit=0"]


@pytest.fixture(scope="module")
def k2_run(tmp_path_factory, tiny_model_dir):
    """One uninterrupted 6-step run at rollout.max_staleness=2, a checkpoint after every step (all kept)."""
    root = tmp_path_factory.mktemp("k2")
    run, proc = _rl(root, tiny_model_dir, "k2", *K2, steps=6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.slow
def test_k2_trains_each_step_on_its_scheduled_version_and_the_rollout_logprobs_are_that_versions(k2_run):
    from transformers import AutoModelForCausalLM

    run = k2_run
    metrics = read_metrics(run)
    assert [m["policy/version"] for m in metrics] == [0, 0, 0, 1, 2, 3]
    assert [m["policy/staleness_max"] for m in metrics] == [0, 1, 2, 2, 2, 2]
    assert all(0 <= m["perf/overlap_share"] <= 1 and "offpolicy/ess" in m for m in metrics)
    assert all(0 <= m["perf/gen_in_step_s"] <= m["perf/step_s"] for m in metrics)
    assert 0 < float(pipeline_text(metrics).split("×")[0]) <= ASYNC_BOUND  # the end-of-run table's speedup
    assert metrics[-1]["sync/probe_version"] == 6 and metrics[-1]["sync/probe_logprob_diff"] < 1e-5

    # checkpoint 3 keeps the batches of steps 4 and 5 (versions 1 and 2): each one's rollout logprobs are its
    # version's weights' (checkpoint step-v), to 1e-5 in fp32, and not its neighbours'
    saved = torch.load(run / "checkpoints" / "step-3" / INFLIGHT_FILE, weights_only=True)
    assert [(b["step"], b["version"]) for b in saved["batches"]] == [(4, 1), (5, 2)]
    _, prompts, completions, *_ = decode(saved["batches"][1]["payload"])
    assert {c.policy_version for c in completions} == {2}
    gaps = {}
    for version in (1, 2, 3):
        model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / f"step-{version}", dtype=torch.float32)
        gaps[version] = max(
            float((_completion_logprobs(model, prompts[i // 4], c.token_ids) - torch.tensor(c.logprobs)).abs().max())
            for i, c in enumerate(completions)
        )
    assert gaps[2] < 1e-5, gaps
    assert gaps[1] > 1e-3 and gaps[3] > 1e-3, gaps


@pytest.mark.slow
def test_k2_killed_mid_pipeline_and_resumed_equals_the_uninterrupted_run(k2_run, tmp_path, tiny_model_dir, ray_address):
    killed = tmp_path / "killed"
    exe = Path(sys.executable).with_name("oxrl")
    cmd = [str(exe), "run", "--alg", "sgrpo", "--set", f"model.name={tiny_model_dir}", "--set", "train.max_steps=6",
           *COMMON, *K2, "-o", str(killed)]  # fmt: skip
    env = {**os.environ, **ENV, "RAY_ADDRESS": ray_address}  # this worker's Ray head, as `oxrl()` runs join it
    child = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step-3").is_dir() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)  # the trainer mid-pipeline (its actors die with their driver)
    child.wait()
    steps_before = len(read_metrics(killed))
    assert 3 <= steps_before < 6, "the run was not killed mid-way"
    assert (killed / "checkpoints" / "step-3" / INFLIGHT_FILE).is_file()  # steps 4 and 5, in flight

    proc = oxrl("run", "--resume", "-o", str(killed), cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_metrics(k2_run), read_metrics(killed)
    assert [m["step"] for m in b] == list(range(1, 7))
    for x, y in zip(a, b):  # the same samples, rewards and losses: one seed, one result, killed or not
        assert x["reward/mean"] == y["reward/mean"] and x["response/length"] == y["response/length"]
        assert x["policy/version"] == y["policy/version"] == max(0, x["step"] - 3)
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6) and x["grad_norm"] == pytest.approx(y["grad_norm"])


@pytest.mark.slow
def test_a_backend_that_reports_another_version_stops_the_run(tmp_path, tiny_model_dir):
    (tmp_path / "liar.py").write_text(LIAR)
    run, proc = _rl(tmp_path, tiny_model_dir, "liar", "--set", "rollout.max_staleness=1",
                    "--set", f"rollout.backend={tmp_path / 'liar.py'}:OneAhead", steps=4)  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "step 3: samples from policy version(s) [2]" in proc.stderr
    assert "max(0, 3 - 1 - 1) = 1" in proc.stderr
    assert [m["step"] for m in read_metrics(run)] == [1, 2]  # it stopped before training on them


def test_the_start_says_what_an_asynchronous_run_does_and_warns_of_stacked_off_policyness():
    from oxrl_core.rl.sources import _async_notes

    said: list[str] = []
    _async_notes(RolloutConfig(actors=1, max_staleness=2), 2, said.append)
    assert len(said) == 1 and "max(0, s-1-2)" in said[0] and "truncated at 2 (rollout.tis_cap unset)" in said[0]
    assert "mismatch alarm is off" in said[0]
    said.clear()
    ro = RolloutConfig(
        actors=1, max_staleness=1, is_mode="mask", is_low=0.5, tis_cap=3, minibatches=2, max_logprob_diff=1
    )
    _async_notes(ro, 1, said.append)
    assert "masked outside [0.5, 3]" in said[0] and "unset" not in said[0] and "alarm" not in said[0]
    assert "rollout.minibatches=2" in said[1] and "more than 1 versions behind" in said[1]
