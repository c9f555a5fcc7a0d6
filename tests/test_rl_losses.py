"""Hand-derived maths for the RL algorithms: group advantages, k3 KL (and the config's loss options), SGRPO, CISPO, PPO (GAE), RFT,
and the on-policy identity (ratio 1 -> SGRPO and CISPO gradients = the plain policy gradient)."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from oxrl_algs_rl.cispo import CISPO
from oxrl_algs_rl.ppo import PPO, discounted_cumsum, gae
from oxrl_algs_rl.rlaif import RLAIF
from oxrl_algs_rl.rlhf import RLHF
from oxrl_algs_rl.sgrpo import SGRPO
from oxrl_algs_supervised.rft import RFT
from oxrl_core.interfaces import PolicyGradient
from oxrl_core.ops import aggregate_loss, group_advantages, kl_estimate, masked_mean


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    # group 1: mean 0.5, sample std sqrt((4 · 0.25) / 3) = sqrt(1/3)
    expected = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv[:4], torch.tensor([expected, -expected, -expected, expected]), atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal: no signal
    centred = group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), group_size=2, scale=False)
    assert torch.allclose(centred, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_k3_kl_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    logp_ref = torch.log(torch.tensor([0.25, 0.2]))
    # Δ = log(0.25/0.5) = −log 2: exp(Δ) − Δ − 1 = 0.5 + log 2 − 1
    k3 = kl_estimate(logp, logp_ref, "k3")
    assert torch.allclose(k3, torch.tensor([0.5 + math.log(2) - 1, 0.0]), atol=1e-6)
    assert (kl_estimate(torch.randn(50), torch.randn(50), "k3") >= 0).all()


def test_loss_options_are_the_configs():
    """The KL estimators and loss aggregations `ops` computes are the ones the config accepts (one list): each
    name the config validates computes, and a name outside it is refused with the config's list."""
    fields = PolicyGradient.Config.model_fields
    estimators, aggregations = get_args(fields["kl_estimator"].annotation), get_args(fields["loss_agg"].annotation)
    assert estimators and aggregations
    logp, logp_ref, mask = torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3)
    for estimator in estimators:
        assert kl_estimate(logp, logp_ref, estimator).shape == (2, 3)
    for mode in aggregations:
        assert aggregate_loss(logp, mask, mode, max_len=3).dim() == 0
    with pytest.raises(ValueError, match=", ".join(estimators)):
        kl_estimate(logp, logp_ref, "k4")
    with pytest.raises(ValueError, match=", ".join(aggregations)):
        aggregate_loss(logp, mask, "sum")


def _batch(logp, logp_old, adv, mask=None, **extra):
    logp = torch.tensor(logp)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask)
    return {"logp": logp, "logp_old": torch.tensor(logp_old), "adv": torch.tensor(adv), "mask": mask, **extra}


def test_sgrpo_loss_by_hand():
    alg = SGRPO(SGRPO.Config(clip_low=0.2, clip_high=0.28))
    # tokens: ratio 1.5 with A=+1 (clipped to 1.28), ratio 0.5 with A=-1 (clipped to 0.8 -> min picks -0.8),
    #         ratio 1.0 with A=+2, and a masked token that must not count
    logp_old = [[0.0, 0.0], [0.0, 0.0]]
    logp = [[math.log(1.5), math.log(0.5)], [0.0, 5.0]]
    adv = [[1.0, -1.0], [2.0, 0.0]]
    loss, metrics = alg.loss(_batch(logp, logp_old, adv, mask=[[1.0, 1.0], [1.0, 0.0]]))
    surrogates = [min(1.5 * 1, 1.28 * 1), min(0.5 * -1, 0.8 * -1), 2.0]
    assert loss.item() == pytest.approx(-sum(surrogates) / 3, abs=1e-6)
    assert metrics["clip/frac"].item() == pytest.approx(2 / 3)  # both clipped tokens bind


def test_sgrpo_kl_term_and_token_level_aggregation():
    alg = SGRPO(SGRPO.Config(kl_coeff=0.1))
    assert alg.uses_ref() and not SGRPO().uses_ref()
    logp = [[math.log(0.5), math.log(0.5), math.log(0.5)], [math.log(0.5), 0.0, 0.0]]
    batch = _batch(
        logp,
        logp,
        [[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]],
        mask=[[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]],
        logp_ref=torch.log(torch.full((2, 3), 0.25)),
    )
    loss, metrics = alg.loss(batch)
    kl = 0.5 + math.log(2) - 1
    # token level: 4 tokens, surrogates 1, 1, 1, -1 -> mean 0.5; plus β·KL on every token
    assert loss.item() == pytest.approx(-0.5 + 0.1 * kl, abs=1e-6)
    assert metrics["loss/kl"].item() == pytest.approx(kl, abs=1e-6)


def test_cispo_loss_and_gradient_by_hand():
    alg = CISPO(CISPO.Config(eps_low=1.0, eps_high=0.28))
    logp = torch.tensor([[math.log(0.3), math.log(0.9)]], requires_grad=True)
    logp_old = torch.log(torch.tensor([[0.1, 0.9]]))  # ratios 3.0 (weight clipped to 1.28) and 1.0
    adv = torch.tensor([[1.0, -2.0]])
    loss, metrics = alg.loss({"logp": logp, "logp_old": logp_old, "adv": adv, "mask": torch.ones(1, 2)})
    expected = -(1.28 * 1.0 * math.log(0.3) + 1.0 * -2.0 * math.log(0.9)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    # the weight is detached: dL/dlogp = −w·A / N, and the clipped token still has a gradient
    assert torch.allclose(logp.grad, torch.tensor([[-1.28 * 1.0 / 2, 2.0 / 2]]), atol=1e-6)
    assert metrics["clip/frac"].item() == pytest.approx(0.5)


def test_discounted_cumsum_and_gae_match_a_loop():
    torch.manual_seed(0)
    B, T, gamma, lam = 3, 9, 0.9, 0.8
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    mask = torch.zeros(B, T)
    for b, (start, end) in enumerate([(2, 9), (4, 7), (0, 3)]):  # completions at different offsets
        mask[b, start:end] = 1
    adv, returns = gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        idx = mask[b].nonzero().flatten().tolist()
        running = 0.0
        for pos in reversed(idx):
            next_v = values[b, pos + 1].item() if pos + 1 in idx else 0.0
            delta = rewards[b, pos].item() + gamma * next_v - values[b, pos].item()
            running = delta + gamma * lam * running
            assert adv[b, pos].item() == pytest.approx(running, abs=1e-5)
            assert returns[b, pos].item() == pytest.approx(running + values[b, pos].item(), abs=1e-5)
    assert torch.equal(adv * (1 - mask), torch.zeros(B, T))
    x = torch.randn(2, 6)
    loop = torch.zeros_like(x)
    for t in reversed(range(6)):
        loop[:, t] = x[:, t] + (0.5 * loop[:, t + 1] if t + 1 < 6 else 0)
    assert torch.allclose(discounted_cumsum(x, 0.5), loop, atol=1e-6)


def test_gae_skips_environment_tokens_between_model_turns():
    """A multi-turn row: model tokens at 1-2 and 5-6, environment tokens at 3-4 (mask 0). The model's
    tokens are the time steps: the last token of turn 1 bootstraps from V at the first token of turn 2,
    and the discount counts model tokens only."""
    gamma, lam = 0.9, 0.5
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 1]])
    values = torch.tensor([[9.0, 1.0, 2.0, 9.0, 9.0, 3.0, 4.0]])  # 9s: never read
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, returns = gae(rewards, values, mask, gamma, lam)
    # by hand, over the steps (V = 1, 2, 3, 4; r = 0, 0, 0, 1):
    d6 = 1.0 - 4.0  # δ = r + γ·0 − V
    d5 = 0.0 + 0.9 * 4.0 - 3.0
    d2 = 0.0 + 0.9 * 3.0 - 2.0  # bootstraps from turn 2's first token, across the environment's tokens
    d1 = 0.0 + 0.9 * 2.0 - 1.0
    a6 = d6
    a5 = d5 + 0.45 * a6
    a2 = d2 + 0.45 * a5  # one step of discount, not three
    a1 = d1 + 0.45 * a2
    assert adv[0].tolist() == pytest.approx([0.0, a1, a2, 0.0, 0.0, a5, a6], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0.0, a1 + 1, a2 + 2, 0.0, 0.0, a5 + 3, a6 + 4], abs=1e-6)


def test_ppo_advantages_fold_kl_into_the_reward():
    alg = PPO(PPO.Config(gamma=1.0, lam=1.0, kl_coeff=0.5, whiten_advantages=False))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    batch = {
        "mask": mask,
        "rewards": torch.tensor([2.0]),
        "values": torch.zeros(1, 3),
        "logp_old": torch.tensor([[0.0, -1.0, -1.0]]),
        "logp_ref": torch.tensor([[0.0, -2.0, -1.5]]),
    }
    out, _ = alg.advantages(batch)
    # r = −β·(logp_old − logp_ref) = [−0.5, −0.25], plus R = 2 at the last token; γ=λ=1, V=0 -> A = reward-to-go
    assert torch.allclose(out["adv"], torch.tensor([[0.0, -0.5 + 1.75, 1.75]]), atol=1e-6)
    assert torch.allclose(out["returns"], out["adv"])


def test_ppo_loss_by_hand():
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
    }
    loss, metrics = alg.loss(batch)
    policy = -(min(1.5, 1.2) * 1.0 + -1.0) / 2
    # token 1: V=1, clipped V = 0.5 + 0.2 = 0.7: max((1−2)², (0.7−2)²) = 1.69; token 2: (0 − 0.5)² = 0.25
    value = 0.5 * (1.69 + 0.25) / 2
    assert metrics["loss/policy"].item() == pytest.approx(policy, abs=1e-6)
    assert metrics["loss/value"].item() == pytest.approx(value, abs=1e-6)
    assert loss.item() == pytest.approx(policy + 0.5 * value - 0.1 * 2.0, abs=1e-6)


def test_rft_keeps_by_threshold_or_best_of_k():
    mask = torch.ones(6, 2)
    batch = {"rewards": torch.tensor([1.0, 0.0, 1.0, 0.5, 0.2, 0.0]), "group_size": 3, "mask": mask}
    out, metrics = RFT(RFT.Config(threshold=0.5)).advantages(batch)
    assert out["adv"][:, 0].tolist() == [1, 0, 1, 1, 0, 0] and metrics["rft/kept"] == 3
    out, _ = RFT(RFT.Config(threshold=0.5, best_of_k=True)).advantages(batch)
    assert out["adv"][:, 0].tolist() == [1, 0, 0, 1, 0, 0]  # the first best of each group
    logp = torch.tensor([[-1.0, -2.0], [-5.0, -5.0]])
    loss, _ = RFT().loss({"adv": torch.tensor([[1.0, 1.0], [0.0, 0.0]]), "logp": logp})
    assert loss.item() == pytest.approx(1.5)  # mean NLL over kept tokens only


def test_rlhf_and_rlaif_are_sgrpo_with_a_reference_and_their_reward():
    assert RLHF().uses_ref() and RLAIF().uses_ref()
    assert RLHF.default_reward == "reward_model" and RLAIF.default_reward == "llm_judge"


def test_on_policy_ratio_is_one_and_sgrpo_cispo_gradients_equal_plain_policy_gradient(tiny_model_dir):
    """With one update per rollout, logp_old is the same forward's logp (detached): ρ = 1 exactly,
    and both losses have the gradient of −(1/N) Σ A·log π — the plain policy gradient."""
    from transformers import AutoModelForCausalLM

    from oxrl_core.rl.batch import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    input_ids = torch.randint(4, 90, (4, 10))
    attention_mask = torch.ones_like(input_ids)
    mask = torch.zeros(4, 9)
    mask[:, 4:] = 1
    mask[1, 7:] = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = group_advantages(rewards, 2)[:, None] * mask

    def grads(loss_fn):
        model.zero_grad()
        logp, entropy, _ = token_logprobs(model, input_ids, attention_mask, temperature=1.0)
        batch = {"logp": logp, "logp_old": logp.detach(), "adv": adv, "mask": mask, "entropy": entropy}
        loss, metrics = loss_fn(batch)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()], metrics

    g_sgrpo, m_sgrpo = grads(SGRPO().loss)
    g_cispo, m_cispo = grads(CISPO().loss)
    g_pg, _ = grads(lambda b: (masked_mean(-b["adv"] * b["logp"], b["mask"]), {}))
    assert m_sgrpo["ratio/mean"].item() == 1.0 and m_cispo["ratio/mean"].item() == 1.0
    for a, b, c in zip(g_sgrpo, g_cispo, g_pg):
        assert torch.allclose(a, c, atol=1e-7) and torch.allclose(b, c, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in g_pg)
