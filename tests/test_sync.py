"""Verified weight sync (the probe check) and truncated importance sampling (TIS), with the `hf`
backend: hand-derived maths, the check itself, backend options, and runs of the real CLI."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import oxrl, read_metrics

from oxrl_algs_rl.cispo import CISPO
from oxrl_algs_rl.ppo import PPO
from oxrl_algs_rl.rlhf import RLHF
from oxrl_algs_rl.sgrpo import SGRPO
from oxrl_core.config import RolloutConfig
from oxrl_core.data.encode import encode_prompt
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import RolloutBackend, StrictModel
from oxrl_core.models.loading import load_causal_lm, load_tokenizer
from oxrl_core.ops import kl_estimate, masked_mean
from oxrl_core.rollout.hf import HFRolloutBackend
from oxrl_core.rollout.sync import check_weight_sync, default_tolerance, probe_sequence, tis_weight, trainer_logprobs

# ----------------------------------------------------------------------------- TIS maths


def test_tis_weight_by_hand():
    # π_old / π_rollout = 0.5/0.25 = 2 (capped at 1.5), 0.3/0.3 = 1, 0.2/0.4 = 0.5; the 4th token is masked
    logp_old = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.9]]))
    logp_rollout = torch.log(torch.tensor([[0.25, 0.3, 0.4, 0.01]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weight, metrics = tis_weight(logp_old, logp_rollout, mask, cap=1.5)
    assert torch.allclose(weight, torch.tensor([[1.5, 1.0, 0.5, 0.0]]), atol=1e-6)
    assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["tis/clipped_frac"] == pytest.approx(1 / 3)
    assert not weight.requires_grad
    off, none = tis_weight(logp_old, logp_rollout, mask, cap=0.0)
    assert torch.equal(off, torch.ones(1, 4)) and none == {}


def _batch(logp, logp_old, adv, mask=None, **extra):
    logp = logp if torch.is_tensor(logp) else torch.tensor(logp)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask)
    return {"logp": logp, "logp_old": torch.tensor(logp_old), "adv": torch.tensor(adv), "mask": mask, **extra}


def test_sgrpo_weights_each_tokens_clipped_surrogate_by_hand():
    alg = SGRPO(SGRPO.Config(clip_low=0.2, clip_high=0.28))
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [0.0, 5.0]], requires_grad=True)
    tis = torch.tensor([[0.5, 2.0], [1.5, 7.0]])  # the masked token's weight must not count
    batch = _batch(
        logp, [[0.0, 0.0], [0.0, 0.0]], [[1.0, -1.0], [2.0, 0.0]], mask=[[1.0, 1.0], [1.0, 0.0]], tis_weight=tis
    )
    loss, metrics = alg.loss(batch)
    # surrogates 1.28 (clipped), −0.8 (clipped), 2.0, weighted 0.5, 2, 1.5; token mean over 3
    expected = -(0.5 * 1.28 + 2.0 * -0.8 + 1.5 * 2.0) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["loss/policy"].item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # clipped tokens have no gradient; the unclipped one: d/dlogp −w·ρ·A/N = −1.5·1·2/3
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0], [-1.0, 0.0]]), atol=1e-6)


def test_sgrpo_tis_leaves_the_kl_term_unweighted():
    alg = SGRPO(SGRPO.Config(kl_coeff=0.1))
    half = math.log(0.5)
    batch = _batch(
        [[half, half]],
        [[half, half]],
        [[1.0, 1.0]],
        logp_ref=torch.log(torch.full((1, 2), 0.25)),
        tis_weight=torch.tensor([[2.0, 0.5]]),
    )
    loss, _ = alg.loss(batch)
    kl = 0.5 + math.log(2) - 1  # k3 of log π_ref − log π = −log 2
    assert loss.item() == pytest.approx((-2.0 + 0.1 * kl - 0.5 + 0.1 * kl) / 2, abs=1e-6)


def test_cispo_tis_by_hand():
    alg = CISPO(CISPO.Config(eps_low=1.0, eps_high=0.28))
    logp = torch.tensor([[math.log(0.3), math.log(0.9)]], requires_grad=True)
    batch = {
        "logp": logp,
        "logp_old": torch.log(torch.tensor([[0.1, 0.9]])),
        "adv": torch.tensor([[1.0, -2.0]]),
        "mask": torch.ones(1, 2),
        "tis_weight": torch.tensor([[0.5, 2.0]]),
    }
    loss, _ = alg.loss(batch)
    # IS weights clip(3.0) = 1.28 and 1.0, times the TIS weights 0.5 and 2
    expected = -(0.5 * 1.28 * 1.0 * math.log(0.3) + 2.0 * 1.0 * -2.0 * math.log(0.9)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5 * 1.28 / 2, 2.0 * 2.0 / 2]]), atol=1e-6)


def test_ppo_tis_weights_the_policy_term_only():
    alg = PPO(PPO.Config(clip_eps=0.2, value_clip=0.2, vf_coef=0.5, ent_coef=0.1))
    batch = {
        "mask": torch.ones(1, 2),
        "logp": torch.tensor([[math.log(1.5), 0.0]]),
        "logp_old": torch.zeros(1, 2),
        "adv": torch.tensor([[1.0, -1.0]]),
        "values_new": torch.tensor([[1.0, 0.0]]),
        "values": torch.tensor([[0.5, 0.0]]),
        "returns": torch.tensor([[2.0, 0.5]]),
        "entropy": torch.tensor([[1.0, 3.0]]),
        "tis_weight": torch.tensor([[2.0, 0.5]]),
    }
    loss, metrics = alg.loss(batch)
    policy = -(2.0 * min(1.5, 1.2) * 1.0 + 0.5 * -1.0) / 2
    value = 0.5 * (1.69 + 0.25) / 2  # as without TIS (see test_rl_losses)
    assert metrics["loss/policy"].item() == pytest.approx(policy, abs=1e-6)
    assert metrics["loss/value"].item() == pytest.approx(value, abs=1e-6)
    assert loss.item() == pytest.approx(policy + 0.5 * value - 0.1 * 2.0, abs=1e-6)


def _random_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    logp_old = -torch.rand(B, T, generator=g) * 3
    return {
        "logp": logp_old + 0.3 * torch.randn(B, T, generator=g),
        "logp_old": logp_old,
        "logp_ref": logp_old + 0.2 * torch.randn(B, T, generator=g),
        "adv": torch.randn(B, T, generator=g) * mask,
        "mask": mask,
        "entropy": torch.rand(B, T, generator=g),
        "values_new": torch.randn(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
    }


@pytest.mark.parametrize("alg", [SGRPO(SGRPO.Config(kl_coeff=0.05)), CISPO(), PPO(), RLHF()], ids=lambda a: a.name)
def test_tis_off_is_bit_identical(alg):
    """rollout.tis_cap = 0: the loop passes ones, and the loss equals the loss without TIS bit for bit."""
    batch = _random_batch()
    without, m_without = alg.loss(batch)
    ones, _ = tis_weight(batch["logp_old"], batch["logp_old"] - 0.5, batch["mask"], cap=0.0)
    with_ones, m_ones = alg.loss({**batch, "tis_weight": ones})
    assert torch.equal(without, with_ones)
    assert all(torch.equal(torch.as_tensor(m_without[k]), torch.as_tensor(m_ones[k])) for k in m_without)
    if isinstance(alg, SGRPO):  # the pre-TIS formula, written out
        c, mask = alg.config, batch["mask"]
        ratio = torch.exp(batch["logp"] - batch["logp_old"])
        surrogate = torch.minimum(ratio * batch["adv"], ratio.clamp(1 - c.clip_low, 1 + c.clip_high) * batch["adv"])
        before = masked_mean(-surrogate + c.kl_coeff * kl_estimate(batch["logp"], batch["logp_ref"], "k3"), mask)
        assert torch.equal(without, before)
    # and a real weight changes it
    weighted, _ = alg.loss({**batch, "tis_weight": torch.full_like(batch["mask"], 2.0)})
    assert not torch.equal(without, weighted)


# ----------------------------------------------------------------------------- the probe check


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def test_probe_sequence_is_fixed_and_starts_with_the_first_prompt(tokenizer):
    prompt = encode_prompt(tokenizer, "What is 2+3?")
    probe = probe_sequence(tokenizer, prompt)
    assert probe == probe_sequence(tokenizer, prompt) and 32 <= len(probe) <= 64
    assert probe[: len(prompt)] == prompt and max(probe) < len(tokenizer)
    assert len(probe_sequence(tokenizer, [5])) >= 32  # a short prompt still gets a real probe


def test_hf_score_equals_a_teacher_forced_forward(tiny_model_dir, tokenizer):
    model = load_causal_lm(str(tiny_model_dir))
    model.train()
    ids = probe_sequence(tokenizer, encode_prompt(tokenizer, "Hi"))
    got = torch.tensor(HFRolloutBackend(model, tokenizer).score(ids))
    assert model.training  # left as it was
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert got.shape == (len(ids) - 1,)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(trainer_logprobs(model, ids, nullcontext), want, atol=1e-6, rtol=0)
    assert model.training


def test_check_weight_sync_passes_on_equal_weights_and_names_the_gap_when_stale(tiny_model_dir, tokenizer):
    model = load_causal_lm(str(tiny_model_dir))
    backend = HFRolloutBackend(copy.deepcopy(model), tokenizer)  # its own copy, like an engine
    probe = probe_sequence(tokenizer, encode_prompt(tokenizer, "What is 2+3?"))
    metrics = check_weight_sync(backend, model, probe, 0, 1e-3, nullcontext)
    assert metrics["sync/probe_logprob_diff"] <= 1e-6 and metrics["sync/probe_tolerance"] == 1e-3

    with torch.no_grad():  # the trainer moves on, the backend does not get the new weights
        model.lm_head.weight.add_(0.05 * torch.randn_like(model.lm_head.weight))
    gap = float((torch.tensor(backend.score(probe)) - trainer_logprobs(model, probe, nullcontext)).abs().max())
    assert gap > 1e-2
    with pytest.raises(OxrlError) as err:
        check_weight_sync(backend, model, probe, 3, 1e-3, nullcontext, last_checkpoint="runs/x/checkpoints/step-2")
    message = str(err.value)
    assert "policy version 3" in message and "tolerance 0.001" in message and f"{gap:.3g} nats" in message
    assert "stale or corrupted" in message and "runs/x/checkpoints/step-2" in message
    with pytest.raises(OxrlError, match="at the start"):
        check_weight_sync(backend, model, probe, 0, 1e-3, nullcontext)
    backend.update_weights(model, 4)  # synced again: the check passes
    assert check_weight_sync(backend, model, probe, 4, 1e-3, nullcontext)["sync/probe_logprob_diff"] <= 1e-6


class _Scores(HFRolloutBackend):
    name = "scores"

    def __init__(self, model, tokenizer, values):
        super().__init__(model, tokenizer)
        self.values = values

    def score(self, token_ids):
        return self.values


def test_check_weight_sync_refuses_wrong_lengths_and_nan(tiny_model_dir, tokenizer):
    model = load_causal_lm(str(tiny_model_dir))
    probe = list(range(5, 40))
    with pytest.raises(OxrlError, match="returned 3 logprobs for a 35-token probe"):
        check_weight_sync(_Scores(model, tokenizer, [0.0] * 3), model, probe, 1, 1e-3, nullcontext)
    with pytest.raises(OxrlError, match="nan nats"):
        check_weight_sync(_Scores(model, tokenizer, [math.nan] * 34), model, probe, 1, 1e-3, nullcontext)


def test_default_tolerance_follows_the_trainers_precision():
    assert default_tolerance(None) == 1e-3 and default_tolerance(torch.bfloat16) == 1.0


# ----------------------------------------------------------------------------- backend options and score support


class _NoScore(RolloutBackend):
    name = "no_score"

    def generate(self, prompt_token_ids, sampling):
        return []

    def update_weights(self, state, policy_version):
        pass


class _WithOptions(_NoScore):
    name = "with_options"

    class Config(StrictModel):
        tensor_parallel_size: int = 1


def test_backend_options_are_validated_by_the_backends_config():
    assert HFRolloutBackend.can_score() and not _NoScore.can_score()
    with pytest.raises(OxrlError, match=r"rollout.tp: the 'hf' rollout backend takes no options, got \['tp'\]"):
        HFRolloutBackend.parse_options(RolloutConfig(tp=2))
    assert _WithOptions.parse_options(RolloutConfig(tensor_parallel_size=2)).tensor_parallel_size == 2
    with pytest.raises(
        OxrlError, match="rollout.tensor_paralel_size: unknown field.*did you mean 'tensor_parallel_size'"
    ):
        _WithOptions.parse_options(RolloutConfig(tensor_paralel_size=2))
    with pytest.raises(OxrlError, match="rollout.tensor_parallel_size"):
        _WithOptions.parse_options(RolloutConfig(tensor_parallel_size="two"))


def test_rollout_config_errors(tmp_path, tiny_model_dir):
    proc = oxrl(
        "run", "--alg", "sgrpo", "--set", f"model.name={tiny_model_dir}", "--set", "rollout.tis_cap=0.5", cwd=tmp_path
    )
    assert proc.returncode == 2 and "rollout.tis_cap" in proc.stderr and "at least 1" in proc.stderr
    proc = oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "rollout.batch=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "rollout.batch" in proc.stderr and "takes no options" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- the real CLI

PLUGINS = '''
import copy

from oxrl_core.interfaces import Reward
from oxrl_core.rollout.hf import HFRolloutBackend


class Varied(Reward):
    """Distinct characters per completion: rewards differ within a group, so every step changes the weights."""

    name = "varied"

    def score(self, prompts, completions, examples):
        return [len(set(c)) / 8 for c in completions]


class Copy(HFRolloutBackend):
    """Generates with its own copy of the policy, loaded from the trainer's at every sync."""

    name = "copy"

    @classmethod
    def build(cls, model, tokenizer, model_path, config):
        return cls(copy.deepcopy(model), tokenizer)


class StaleCopy(HFRolloutBackend):
    """Generates with its own copy of the policy and stops copying the trainer's weights after version 1."""

    name = "stale_copy"

    @classmethod
    def build(cls, model, tokenizer, model_path, config):
        return cls(copy.deepcopy(model), tokenizer)

    def update_weights(self, state, policy_version):
        if policy_version >= 2:
            self.policy_version = policy_version  # the version moves on, the weights do not
            return
        super().update_weights(state, policy_version)


class WrongModel(HFRolloutBackend):
    """Loaded some other model than the policy."""

    name = "wrong_model"

    @classmethod
    def build(cls, model, tokenizer, model_path, config):
        from oxrl_core.models.tiny import build_model

        return cls(build_model(len(tokenizer), hidden_size=64, num_layers=2, seed=1), tokenizer)
'''


def rl_run(tmp_path: Path, model_dir, *args):
    plugin = tmp_path / "sync_plugins.py"
    plugin.write_text(PLUGINS)
    return oxrl(
        "run",
        "--set",
        f"model.name={model_dir}",
        "--set",
        "train.batch_size=4",
        "--set",
        "rollout.n=2",
        "--set",
        "rollout.max_new_tokens=6",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.lr=1e-2",
        "--set",
        "train.lr_scheduler=constant",
        "--set",
        f"reward.name={plugin}:Varied",
        *args,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_run_logs_the_probe_check_and_tis(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    proc = rl_run(
        tmp_path,
        tiny_model_dir,
        "--alg",
        "sgrpo",
        "--set",
        "train.max_steps=2",
        "--set",
        "rollout.tis_cap=2",
        "-q",
        "-o",
        str(run),
    )
    assert proc.returncode == 0, proc.stderr
    metrics = read_metrics(run)
    for m in metrics:
        # hf generates with the trainer's own module: checked at the start only, never stale after a sync
        assert not any(k.startswith("sync/probe") for k in m)
        assert 0.9 < m["tis/weight_mean"] <= 1.0 + 1e-4 and m["tis/clipped_frac"] == 0.0
        assert m["perf/sync_s"] >= 0
    assert metrics[0]["loss"] != 0  # a real update (the rewards differ within groups)
    # a backend with a copy of its own is checked after every sync
    copied = tmp_path / "copy"
    proc = rl_run(
        tmp_path,
        tiny_model_dir,
        "--alg",
        "sgrpo",
        "--set",
        f"rollout.backend={tmp_path / 'sync_plugins.py'}:Copy",
        "--set",
        "train.max_steps=2",
        "-q",
        "-o",
        str(copied),
    )
    assert proc.returncode == 0, proc.stderr
    for m in read_metrics(copied):
        assert m["sync/probe_tolerance"] == 1e-3 and m["sync/probe_logprob_diff"] <= 1e-5
    proc = rl_run(
        tmp_path,
        tiny_model_dir,
        "--alg",
        "sgrpo",
        "--set",
        "train.max_steps=1",
        "--set",
        "rollout.sync_check=false",
        "-q",
        "-o",
        str(tmp_path / "off"),
    )
    assert proc.returncode == 0, proc.stderr
    off = read_metrics(tmp_path / "off")[0]
    assert not any(k.startswith(("sync/", "tis/")) for k in off)


@pytest.mark.slow
def test_a_skipped_weight_sync_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, tiny_model_dir):
    run = tmp_path / "stale"
    backend = f"rollout.backend={tmp_path / 'sync_plugins.py'}:StaleCopy"
    proc = rl_run(
        tmp_path,
        tiny_model_dir,
        "--alg",
        "cispo",
        "--set",
        backend,
        "--set",
        "train.max_steps=4",
        "--set",
        "train.save_every=1",
        "-o",
        str(run),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "weight sync check failed after the weight sync, policy version 2" in proc.stderr
    assert "tolerance 0.001" in proc.stderr and "checkpoints/step-1" in proc.stderr
    assert (run / "checkpoints" / "step-1" / "trainer_state.json").is_file()
    assert not (run / "checkpoints" / "step-2").exists() and not (run / "final").exists()
    assert [m["step"] for m in read_metrics(run)] == [1]
    # the versions moved on, so strict on-policy alone does not notice: without the sync check the
    # trainer-vs-rollout logprob alarm is the second line of defence ...
    proc = rl_run(
        tmp_path,
        tiny_model_dir,
        "--alg",
        "cispo",
        "--set",
        backend,
        "--set",
        "train.max_steps=3",
        "--set",
        "rollout.sync_check=false",
        "-q",
        "-o",
        str(tmp_path / "unchecked"),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "rollout/logprob_diff" in proc.stderr and "stale weights" in proc.stderr
    # ... and with both turned off the run goes on, training on stale samples
    proc = rl_run(
        tmp_path,
        tiny_model_dir,
        "--alg",
        "cispo",
        "--set",
        backend,
        "--set",
        "train.max_steps=3",
        "--set",
        "rollout.sync_check=false",
        "--set",
        "rollout.max_logprob_diff=0",
        "-q",
        "-o",
        str(tmp_path / "unguarded"),
    )
    assert proc.returncode == 0, proc.stderr


def test_a_backend_with_the_wrong_model_is_caught_before_training(tmp_path, tiny_model_dir):
    run = tmp_path / "wrong"
    proc = rl_run(
        tmp_path,
        tiny_model_dir,
        "--alg",
        "sgrpo",
        "--set",
        f"rollout.backend={tmp_path / 'sync_plugins.py'}:WrongModel",
        "--set",
        "train.max_steps=2",
        "-o",
        str(run),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "weight sync check failed at the start" in proc.stderr and "policy version 0" in proc.stderr
    assert not (run / "metrics.jsonl").is_file() or read_metrics(run) == []
