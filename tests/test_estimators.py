"""Hand-derived maths for the group RL estimators and their shared options: GSPO, RLOO, REINFORCE++,
REINFORCE++-baseline; the KL estimators k1/k2/k3, KL in the reward or the loss, the entropy bonus, DAPO's
overlong shaping and the four loss aggregations (with equal-reward groups, single-sample groups and fully
masked rows); each new loss's gradient with the packed (shared-prompt) forward equals the padded one; an
algorithm's own rollout defaults go under the user's settings."""

from __future__ import annotations

import math

import pytest
import torch

from oxrl_algs_rl.cispo import CISPO
from oxrl_algs_rl.gspo import GSPO
from oxrl_algs_rl.ppo import PPO
from oxrl_algs_rl.reinforce_pp import REINFORCEPP
from oxrl_algs_rl.reinforce_pp_baseline import REINFORCEPPBaseline
from oxrl_algs_rl.rloo import RLOO
from oxrl_algs_rl.sgrpo import SGRPO
from oxrl_core.config import Defaults, RawRunConfig, validate_run_config
from oxrl_core.interfaces import Completion
from oxrl_core.ops import (
    aggregate_loss,
    kl_estimate,
    leave_one_out_advantages,
    overlong_penalty,
    policy_objective,
    shaped_rewards,
)

LN2 = math.log(2)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ----------------------------------------------------------------------------- the shared options


def test_kl_estimators_by_hand():
    logp, logp_ref = torch.log(t(0.5, 0.2)), torch.log(t(0.25, 0.2))  # Δ = log π_ref − log π = −log 2, 0
    assert torch.allclose(kl_estimate(logp, logp_ref, "k1"), t(LN2, 0.0), atol=1e-6)  # −Δ
    assert torch.allclose(kl_estimate(logp, logp_ref, "k2"), t(0.5 * LN2**2, 0.0), atol=1e-6)  # ½Δ²
    assert torch.allclose(kl_estimate(logp, logp_ref, "k3"), t(0.5 + LN2 - 1, 0.0), atol=1e-6)  # e^Δ − Δ − 1
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, logp_ref, "k4")


def test_the_four_loss_aggregations_by_hand_with_a_fully_masked_row():
    per_token = t([1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0])  # (B=3, T=4)
    mask = t([1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0])  # row 3 fully masked: not counted anywhere
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum").item() == pytest.approx((6.0 + 4.0) / 2)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx(
        (6.0 / 8 + 4.0 / 8) / 2
    )
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(per_token, mask, "seq-mean-token-sum-norm")
    nothing = torch.zeros_like(mask)  # no completion token at all: 0, not NaN
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate_loss(per_token, nothing, mode).item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_an_aggregation_over_micro_batches_weighted_as_the_loop_does_equals_the_whole_batch(mode):
    """The RL loop weights each micro-batch's loss by its loss tokens (token-mean) or by its rows with a token
    (the others, `PolicyGradient.loss_weighting`); split that way any batch gives the whole batch's loss."""
    torch.manual_seed(0)
    per_token = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.4).float()
    mask[2] = 0  # a fully masked row
    whole = aggregate_loss(per_token, mask, mode, max_len=5)
    alg = SGRPO(SGRPO.Config(loss_agg=mode))
    parts, total = [[0, 1], [2, 3, 4], [5]], 0.0

    def weight(rows):
        tokens = mask[rows].sum(-1)
        return float(tokens.sum()) if alg.loss_weighting == "tokens" else float((tokens > 0).sum())

    all_weight = weight(list(range(6)))
    for rows in parts:
        total += aggregate_loss(per_token[rows], mask[rows], mode, max_len=5) * weight(rows) / all_weight
    assert total.item() == pytest.approx(whole.item(), abs=1e-6)
    assert alg.loss_weighting == ("tokens" if mode == "token-mean" else "sequences")


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
GROUP_ALGS = (SGRPO, CISPO, GSPO, RLOO, REINFORCEPP, REINFORCEPPBaseline)


@pytest.mark.parametrize(
    "alg",
    [cls(cls.Config(loss_agg=mode, kl_coeff=0.1, kl_in_reward=False, entropy_coeff=0.01)) for cls in GROUP_ALGS
     for mode in MODES] + [PPO(PPO.Config(kl_coeff=0.1, kl_in_reward=False, entropy_coeff=0.01))],
    ids=lambda a: f"{a.name}-{getattr(a.config, 'loss_agg', 'token-mean')}",
)  # fmt: skip
def test_every_logged_metric_over_a_three_way_split_equals_the_whole_batch(alg):
    """Issue 43: the loop adds a micro-batch's metrics with its loss's share (tokens for token-mean, rows with a
    token otherwise); every metric an algorithm logs -- the loss, loss/policy, loss/kl, loss/entropy, clip/frac,
    ratio/mean, ... -- must then give the whole batch's value, whatever alg.loss_agg (before: loss/kl and
    loss/entropy were token means and GSPO's clip/frac a share of sequences in every mode)."""
    torch.manual_seed(1)
    B, T = 7, 6
    mask = (torch.rand(B, T) > 0.3).float()
    mask[3] = 0  # a fully masked row
    logp_old = -torch.rand(B, T) * 2
    batch = {
        "mask": mask, "logp_old": logp_old, "logp": logp_old + 0.4 * torch.randn(B, T),  # ρ far from 1: clips act
        "logp_ref": logp_old - 0.3 * torch.rand(B, T), "entropy": torch.rand(B, T) * 3,
        "adv": torch.randn(B, T) * mask, "max_new_tokens": T,
        "values": torch.randn(B, T), "values_new": torch.randn(B, T), "returns": torch.randn(B, T),
    }  # fmt: skip
    whole_loss, whole = alg.loss(batch)
    assert {"loss/kl", "clip/frac", "ratio/mean"} <= set(whole)

    def weight(rows):
        tokens = mask[rows].sum(-1)
        return float(tokens.sum()) if alg.loss_weighting == "tokens" else float((tokens > 0).sum())

    total, sums = weight(list(range(B))), {"loss": 0.0}
    for rows in ([0, 1], [2, 3, 4], [5, 6]):
        part = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss, metrics = alg.loss(part)
        share = weight(rows) / total
        sums["loss"] += float(loss) * share
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value) * share
    assert sums["loss"] == pytest.approx(float(whole_loss), abs=1e-6)
    for key, value in whole.items():
        assert sums[key] == pytest.approx(float(value), abs=1e-6), key


def test_overlong_penalty_by_hand():
    # L_max 10, buffer 4: no penalty up to 6 tokens, then −(|y| − 6)/4 · penalty, −penalty at 10
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert torch.allclose(overlong_penalty(lengths, 10, 4, 1.0), t(0.0, 0.0, -0.25, -0.5, -1.0))
    assert torch.allclose(overlong_penalty(lengths, 10, 4, 0.5), t(0.0, 0.0, -0.125, -0.25, -0.5))
    assert torch.equal(overlong_penalty(lengths, 10, 0, 1.0), torch.zeros(5))  # off


def test_shaped_rewards_overlong_and_sequence_kl_in_the_reward_by_hand():
    mask = t([1, 1, 1, 1], [1, 1, 0, 0])  # lengths 4 and 2, L_max 4
    logp_old = torch.log(t([0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]))
    logp_ref = torch.log(t([0.25, 0.5, 0.5, 0.5], [0.25, 0.25, 0.9, 0.9]))  # k1 per token: log 2 or 0
    batch = {"rewards": t(1.0, 1.0), "mask": mask, "logp_old": logp_old, "logp_ref": logp_ref, "max_new_tokens": 4}
    options = SGRPO.Config(overlong_buffer=2, overlong_penalty=0.5, kl_coeff=0.1, kl_in_reward=True, kl_estimator="k1")
    rewards, metrics = shaped_rewards(batch, options)
    # row 1: 4 tokens = L_max -> −0.5; KL sum = log 2.  row 2: 2 tokens, not in the buffer; KL sum = 2 log 2
    assert torch.allclose(rewards, t(1.0 - 0.5 - 0.1 * LN2, 1.0 - 0.1 * 2 * LN2), atol=1e-6)
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.25)
    assert metrics["kl/reward_k1"] == pytest.approx(3 * LN2 / 6, abs=1e-6)  # named by its estimator
    same, none = shaped_rewards(batch, SGRPO.Config())
    assert torch.equal(same, batch["rewards"]) and none == {}  # the defaults change nothing


def test_policy_objective_kl_in_the_loss_and_entropy_bonus_by_hand():
    mask = t([1, 1], [1, 0])
    logp = torch.log(t([0.5, 0.5], [0.5, 0.5]))
    batch = {
        "mask": mask,
        "logp": logp,
        "logp_ref": torch.log(t([0.25, 0.5], [0.5, 0.5])),
        "entropy": t([1.0, 2.0], [3.0, 9.0]),
    }
    policy_term = t([1.0, 2.0], [3.0, 9.0])
    options = SGRPO.Config(kl_coeff=0.5, kl_estimator="k2", entropy_coeff=0.1)
    loss, metrics = policy_objective(policy_term, batch, options)
    k2 = [0.5 * LN2**2, 0.0, 0.0]
    expected = sum(p + 0.5 * k - 0.1 * h for p, k, h in zip([1.0, 2.0, 3.0], k2, [1.0, 2.0, 3.0])) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["kl/loss_k2"].item() == pytest.approx(sum(k2) / 3, abs=1e-6) == metrics["loss/kl"].item()
    assert metrics["loss/entropy"].item() == pytest.approx(2.0)
    # the same options with the KL in the reward: no KL term in the loss
    in_reward, metrics = policy_objective(policy_term, batch, SGRPO.Config(kl_coeff=0.5, kl_in_reward=True))
    assert in_reward.item() == pytest.approx(2.0) and "loss/kl" not in metrics


def test_ppo_kl_options_and_the_old_name_of_the_entropy_weight():
    assert PPO.Config(ent_coef=0.1).entropy_coeff == 0.1  # old configs keep working
    mask = t([1, 1])
    batch = {
        "rewards": t(1.0), "mask": mask, "values": t([0.0, 0.0]), "logp_old": torch.log(t([0.5, 0.5])),
        "logp_ref": torch.log(t([0.25, 0.5])), "group_size": 1,
    }  # fmt: skip
    ppo = PPO(PPO.Config(kl_coeff=0.1, whiten_advantages=False, lam=1.0))
    added, metrics = ppo.advantages(batch)
    # r = (−0.1 log 2, 1): A_t = Σ_{k≥t} r_k − V = (1 − 0.1 log 2, 1)
    assert torch.allclose(added["adv"], t([1 - 0.1 * LN2, 1.0]), atol=1e-6)
    assert metrics["kl/reward_k1"] == pytest.approx(LN2 / 2, abs=1e-6)
    in_loss = PPO(PPO.Config(kl_coeff=0.1, kl_in_reward=False, whiten_advantages=False, lam=1.0))
    added, metrics = in_loss.advantages(batch)
    assert torch.allclose(added["adv"], t([1.0, 1.0])) and "kl/reward_k1" not in metrics


# ----------------------------------------------------------------------------- the estimators


def test_leave_one_out_advantages_by_hand():
    rewards = t(1.0, 0.0, 0.0, 2.0, 3.0, 3.0)  # groups of 3: (1, 0, 0), (2, 3, 3)
    adv = leave_one_out_advantages(rewards, 3)
    assert torch.allclose(adv, t(1.0, -0.5, -0.5, -1.0, 0.5, 0.5))  # r_i − mean of the other two
    assert torch.equal(leave_one_out_advantages(t(0.7, 0.7, 0.7, 0.7), 2), torch.zeros(4))  # equal: exactly 0


def _grad_of(loss_fn, logp: torch.Tensor):
    leaf = logp.clone().requires_grad_(True)
    loss = loss_fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def test_rloo_loss_is_reinforce_with_the_leave_one_out_baseline():
    """One update per batch (ρ = 1): L = −(1/n) Σ_i A_i Σ_t log π(o_{i,t}), so ∂L/∂log π(o_{i,t}) = −A_i / n."""
    alg = RLOO()
    mask = t([1, 1, 1], [1, 0, 0])
    batch = {"rewards": t(1.0, 0.0), "mask": mask, "group_size": 2, "logp_old": torch.zeros(2, 3)}
    added, _ = alg.advantages(batch)
    assert torch.allclose(added["adv"], t([1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]))  # A = ±1
    logp = torch.log(t([0.5, 0.25, 0.5], [0.5, 1.0, 1.0]))
    old = logp.clone()
    loss, grad = _grad_of(lambda lp: alg.loss({**batch, **added, "logp": lp, "logp_old": old})[0], logp)
    assert loss.item() == pytest.approx(-(1.0 * 3 - 1.0) / 2)  # value: −(1/n) Σ_i Σ_t ρ A_i with ρ = 1
    assert torch.allclose(grad, t([-0.5, -0.5, -0.5], [0.5, 0.0, 0.0]))


def test_gspo_sequence_ratio_clip_and_gradient_equal_the_papers_sequence_form():
    """GSPO-token computes GSPO: the value and the gradient equal −(1/n) Σ_i min(s_i A_i, clip(s_i) A_i),
    s_i = exp(mean_t log ρ_{i,t}), written out independently here; a sequence is clipped as a whole."""
    alg = GSPO(GSPO.Config(clip_low=0.1, clip_high=0.1))
    mask = t([1, 1, 1], [1, 1, 0], [1, 1, 1])
    adv_seq = t(1.0, -1.0, 1.0)
    logp_old = torch.log(t([0.5, 0.5, 0.5], [0.4, 0.4, 0.9], [0.5, 0.5, 0.5]))
    # row 1: s = exp(mean log(0.6/0.5)) = 1.2 > 1.1 with A > 0 -> clipped; row 2: s = 1.05 inside; row 3: s = 1
    logp = torch.log(t([0.6, 0.6, 0.6], [0.42, 0.42, 0.1], [0.5, 0.5, 0.5]))
    batch = {"mask": mask, "adv": adv_seq[:, None] * mask, "logp_old": logp_old}
    loss, grad = _grad_of(lambda lp: alg.loss({**batch, "logp": lp})[0], logp)

    def paper(lp):
        log_s = ((lp - logp_old) * mask).sum(-1) / mask.sum(-1)
        s = log_s.exp()
        return -torch.minimum(s * adv_seq, s.clamp(0.9, 1.1) * adv_seq).mean()

    want_loss, want_grad = _grad_of(paper, logp)
    assert loss.item() == pytest.approx(want_loss.item(), abs=1e-6)
    assert loss.item() == pytest.approx(-(1.1 - 1.05 + 1.0) / 3, abs=1e-5)
    assert torch.allclose(grad, want_grad, atol=1e-6)
    assert torch.equal(grad[0], torch.zeros(3))  # the clipped sequence: no gradient on any of its tokens
    _, metrics = alg.loss({**batch, "logp": logp})
    assert metrics["clip/frac"].item() == pytest.approx(1 / 3)  # of sequences
    assert metrics["ratio/mean"].item() == pytest.approx((1.2 + 1.05 + 1.0) / 3, abs=1e-5)


def test_gspo_with_one_update_per_batch_is_grpo_with_sequence_mean_aggregation():
    torch.manual_seed(1)
    mask = (torch.rand(4, 6) > 0.3).float()
    mask[:, 0] = 1
    batch = {"mask": mask, "adv": torch.randn(4)[:, None] * mask, "logp_old": -torch.rand(4, 6)}
    logp = batch["logp_old"].clone()  # ρ = 1 exactly
    gspo = _grad_of(lambda lp: GSPO().loss({**batch, "logp": lp})[0], logp)
    grpo = _grad_of(lambda lp: SGRPO(SGRPO.Config(loss_agg="seq-mean-token-mean")).loss({**batch, "logp": lp})[0], logp)
    assert torch.allclose(gspo[0], grpo[0], atol=1e-6) and torch.allclose(gspo[1], grpo[1], atol=1e-6)


def test_reinforce_pp_token_rewards_returns_and_batch_normalisation_by_hand():
    alg = REINFORCEPP(REINFORCEPP.Config(kl_coeff=0.5))  # k1 in the reward
    mask = t([1, 1, 0], [1, 1, 1])
    logp_old = torch.log(t([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]))
    logp_ref = torch.log(t([0.25, 0.5, 0.5], [0.5, 0.5, 0.25]))  # k1 = log 2 on (1, 1) and (2, 3)
    batch = {"rewards": t(1.0, 0.0), "mask": mask, "logp_old": logp_old, "logp_ref": logp_ref, "group_size": 1}
    added, metrics = alg.advantages(batch)
    # r: row 1 = (−0.5 log 2, 1), row 2 = (0, 0, −0.5 log 2); G = reverse cumulative sums
    g = [1 - 0.5 * LN2, 1.0, 0.0 - 0.5 * LN2, -0.5 * LN2, -0.5 * LN2]
    mean = sum(g) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 5)
    want = [(x - mean) / (std + 1e-8) for x in g]
    assert torch.allclose(added["adv"][mask > 0], torch.tensor(want), atol=1e-5)
    assert added["adv"][0, 2].item() == 0.0  # off the mask
    assert metrics["kl/reward_k1"] == pytest.approx(2 * LN2 / 5, abs=1e-6)
    # one sample per prompt works: normalisation is over the batch, not a group
    assert REINFORCEPP.min_group_size == 1


def test_reinforce_pp_baseline_centres_each_group_and_an_equal_group_gets_no_reward():
    alg = REINFORCEPPBaseline(REINFORCEPPBaseline.Config(kl_coeff=0.0))
    mask = torch.ones(4, 2)
    batch = {"rewards": t(1.0, 0.0, 0.5, 0.5), "mask": mask, "logp_old": torch.zeros(4, 2), "group_size": 2}
    rewards, _ = alg.sequence_rewards(batch)
    assert torch.equal(rewards, t(0.5, -0.5, 0.0, 0.0))  # R − mean_g; the equal group: exactly 0
    added, _ = alg.advantages(batch)
    # G on both tokens of a row = R̃ (γ = 1, reward on the last token); over the 8 tokens mean 0, std √(4·0.25/8)
    r2 = math.sqrt(2)
    assert torch.allclose(added["adv"], t([r2, r2], [-r2, -r2], [0.0, 0.0], [0.0, 0.0]), atol=1e-5)
    assert REINFORCEPPBaseline().config.kl_estimator == "k2" and not REINFORCEPPBaseline().config.kl_in_reward


def test_group_estimators_give_equal_reward_groups_exactly_zero_advantage():
    mask = torch.ones(4, 3)
    batch = {"rewards": t(1.0, 1.0, 0.0, 1.0), "mask": mask, "logp_old": torch.zeros(4, 3), "group_size": 2}
    for alg in (SGRPO(), CISPO(), GSPO(), RLOO()):
        added, _ = alg.advantages(batch)
        assert torch.equal(added["adv"][:2], torch.zeros(2, 3)), alg.name
        assert (added["adv"][2:] != 0).all(), alg.name


def test_single_sample_groups_carry_no_group_signal_and_rloo_needs_two():
    batch = {"rewards": t(1.0, 0.0, 1.0), "mask": torch.ones(3, 2), "logp_old": torch.zeros(3, 2), "group_size": 1}
    added, _ = SGRPO().advantages(batch)
    assert torch.equal(added["adv"], torch.zeros(3, 2))  # a group of one has nothing to compare with
    assert RLOO.min_group_size == GSPO.min_group_size == REINFORCEPPBaseline.min_group_size == 2
    added, _ = REINFORCEPP(REINFORCEPP.Config(kl_coeff=0.0)).advantages(batch)
    assert (added["adv"] != 0).all()  # REINFORCE++ normalises over the batch: n = 1 still learns


# ----------------------------------------------------------------------------- packed = padded, per loss

EOS = 3


@pytest.mark.parametrize("alg", [GSPO(), RLOO(), REINFORCEPP(), REINFORCEPPBaseline(), SGRPO(SGRPO.Config(loss_agg="seq-mean-token-sum-norm"))], ids=lambda a: f"{a.name}-{a.config.loss_agg}")  # fmt: skip
def test_each_new_loss_has_the_same_value_and_gradient_with_the_packed_forward(alg, tiny_model_dir):
    """`data.packing`: the samples of a prompt share its forward pass; the loss and every parameter's gradient
    equal the padded rows' (a minibatch a few updates in: ρ ≠ 1, so the clips act)."""
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.models.packed_attention import packed_attn_implementation
    from oxrl_core.rl.batch import policy_forward, rollout_tensors

    model = load_causal_lm(str(tiny_model_dir), attn_implementation=packed_attn_implementation("sdpa"))
    prompts = [[5, 9, 11, 12], [5, 9, 11, 12], [7, 8], [7, 8]]
    tokens = [[20, 21, EOS], [22, EOS], [30, 31, 32, EOS], [EOS]]
    batch = rollout_tensors(prompts, [Completion(c, [-0.5] * len(c), "stop", 0) for c in tokens], pad_id=0)
    batch.update(group=torch.tensor([0, 0, 1, 1]), prompt_len=torch.tensor([4, 4, 2, 2]), group_size=2)
    batch.update(rewards=t(1.0, 0.0, 0.0, 0.5), max_new_tokens=4)
    torch.manual_seed(0)
    with torch.no_grad():
        out = policy_forward(model, None, batch, 1.0, False)
    batch["logp_old"] = out["logp"] + 0.3 * torch.randn_like(out["logp"]) * batch["mask"]  # as after updates
    batch["logp_ref"] = out["logp"] - 0.2 * batch["mask"]
    added, _ = alg.advantages(batch)
    batch.update(added)
    results = []
    for shared in (False, True):
        model.zero_grad()
        mb = {**batch, **policy_forward(model, None, batch, 1.0, shared)}
        loss, _ = alg.loss(mb)
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert results[0][0].item() == pytest.approx(results[1][0].item(), abs=1e-6)
    assert results[0][1].abs().max() > 0
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


# ----------------------------------------------------------------------------- an algorithm's rollout defaults


def _validate(raw: dict, defaults: dict):
    return validate_run_config(RawRunConfig(raw, "test.yaml", []), Defaults(loop={}, rollout=defaults))


def test_an_algorithms_rollout_defaults_go_under_the_users_settings_and_are_named():
    assert CISPO.rollout_defaults == PPO.rollout_defaults == {"minibatches": 4} and GSPO.rollout_defaults == {
        "minibatches": 2
    }
    assert SGRPO.rollout_defaults == RLOO.rollout_defaults == {}  # one update per batch
    config = _validate({"algorithm": "gspo"}, GSPO.rollout_defaults)
    assert config.rollout.minibatches == 2 and config.algorithm_defaults == {"rollout.minibatches": 2}
    mine = _validate({"algorithm": "gspo", "rollout": {"minibatches": 1}}, GSPO.rollout_defaults)
    assert mine.rollout.minibatches == 1 and mine.algorithm_defaults == {}  # the user's setting wins
    assert _validate({"algorithm": "sgrpo"}, {}).rollout.minibatches == 1


def test_an_algorithms_tiny_model_defaults_apply_only_to_the_built_in_model(tmp_path, tiny_model_dir):
    """CISPO's smaller lr for the built-in model: under the user's settings, and not for a model of one's own."""
    from oxrl_core.trainer import Trainer

    def lr(*sets: str) -> float:
        return Trainer(alg="cispo", overrides=list(sets), output_dir=tmp_path / "run", quiet=True).config.train.lr

    assert CISPO.tiny_defaults == {"train": {"lr": 1e-4}}
    assert lr() == 1e-4 and lr("train.lr=5e-4") == 5e-4
    assert lr(f"model.name={tiny_model_dir}") == 1e-5  # the generic default for a model of one's own
