"""Hand-derived maths for every preference loss, and the loop's sequence log-probabilities.

Each expected value is worked out with `math` on scalars, independently of the algorithm code.
"""

from __future__ import annotations

import math

import pytest
import torch

from oxrl_algs_preference.dpo import DPO
from oxrl_algs_preference.ipo import IPO
from oxrl_algs_preference.kto import KTO
from oxrl_algs_preference.online_dpo import OnlineDPO
from oxrl_algs_preference.orpo import ORPO
from oxrl_algs_preference.rm import RM
from oxrl_algs_preference.simpo import SimPO
from oxrl_algs_preference.spin import SPIN


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# two pairs: summed log-probs of policy and reference, and completion lengths
PAIRS = {
    "logp_chosen": t(-4.0, -10.0),
    "logp_rejected": t(-6.0, -9.0),
    "ref_logp_chosen": t(-5.0, -9.5),
    "ref_logp_rejected": t(-5.5, -9.2),
    "n_chosen": t(2.0, 5.0),
    "n_rejected": t(3.0, 4.0),
}


def test_dpo_sigmoid_loss_and_metrics():
    loss, m = DPO(DPO.Config(beta=0.5)).loss(dict(PAIRS))
    # pair 1: log-ratios +1.0 (chosen), −0.5 (rejected) -> h = 0.5·1.5 = 0.75
    # pair 2: −0.5, +0.2 -> h = 0.5·(−0.7) = −0.35
    expected = (-math.log(sig(0.75)) - math.log(sig(-0.35))) / 2
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx((0.5 * 1.0 + 0.5 * -0.5) / 2)
    assert float(m["rewards/rejected"]) == pytest.approx((0.5 * -0.5 + 0.5 * 0.2) / 2)
    assert float(m["rewards/margins"]) == pytest.approx((0.75 - 0.35) / 2)
    assert float(m["rewards/accuracies"]) == pytest.approx(0.5)  # pair 1 right, pair 2 wrong
    assert float(m["logps/chosen"]) == pytest.approx(-7.0)
    assert float(m["logps/rejected"]) == pytest.approx(-7.5)


def test_dpo_label_smoothing_and_nll_term():
    eps, alpha = 0.1, 0.3
    loss, m = DPO(DPO.Config(beta=0.5, label_smoothing=eps, nll_alpha=alpha)).loss(dict(PAIRS))
    cdpo = sum(-(1 - eps) * math.log(sig(h)) - eps * math.log(sig(-h)) for h in (0.75, -0.35)) / 2
    nll = (4.0 + 10.0) / (2.0 + 5.0)  # −Σ log π(y_c) / Σ |y_c|
    assert float(m["loss/nll"]) == pytest.approx(nll)
    assert float(loss) == pytest.approx(cdpo + alpha * nll, abs=1e-6)


def test_dpo_gradient_direction():
    batch = {k: v.clone().requires_grad_(k.startswith("logp")) for k, v in PAIRS.items()}
    loss, _ = DPO().loss(batch)
    loss.backward()
    assert (batch["logp_chosen"].grad < 0).all()  # descending the loss raises log π(y_c)
    assert (batch["logp_rejected"].grad > 0).all()  # ... and lowers log π(y_r)


def test_ipo_uses_length_averaged_log_ratios():
    beta = 0.25
    loss, m = IPO(IPO.Config(beta=beta)).loss(dict(PAIRS))
    # pair 1: 1.0/2 − (−0.5)/3 = 0.6667; pair 2: −0.5/5 − 0.2/4 = −0.15; target 1/(2β) = 2
    g = (1.0 / 2 + 0.5 / 3, -0.5 / 5 - 0.2 / 4)
    expected = sum((x - 2.0) ** 2 for x in g) / 2
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx(beta * (1.0 / 2 - 0.5 / 5) / 2)


def test_orpo_odds_ratio_and_nll():
    lam = 0.2
    loss, m = ORPO(ORPO.Config(lam=lam)).loss(dict(PAIRS))

    def log_odds(avg):
        p = math.exp(avg)
        return math.log(p / (1 - p))

    ratios = (log_odds(-4.0 / 2) - log_odds(-6.0 / 3), log_odds(-10.0 / 5) - log_odds(-9.0 / 4))
    l_or = sum(-math.log(sig(r)) for r in ratios) / 2
    nll = 14.0 / 7.0
    assert float(m["loss/or"]) == pytest.approx(l_or, abs=1e-6)
    assert float(m["loss/nll"]) == pytest.approx(nll)
    assert float(m["log_odds_ratio"]) == pytest.approx(sum(ratios) / 2, abs=1e-6)
    assert float(loss) == pytest.approx(nll + lam * l_or, abs=1e-6)


def test_orpo_log_odds_is_finite_near_probability_one():
    batch = {**PAIRS, "logp_chosen": t(-1e-9, -1e-9)}
    loss, _ = ORPO().loss(batch)
    assert torch.isfinite(loss)


def test_simpo_length_normalised_margin():
    beta, gamma = 2.0, 0.5
    loss, m = SimPO(SimPO.Config(beta=beta, gamma=gamma)).loss(dict(PAIRS))
    h = (beta * (-4.0 / 2) - beta * (-6.0 / 3) - gamma, beta * (-10.0 / 5) - beta * (-9.0 / 4) - gamma)
    assert h[0] == pytest.approx(-0.5)
    expected = sum(-math.log(sig(x)) for x in h) / 2
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx((beta * -2.0 + beta * -2.0) / 2)
    # a pair with equal rewards is not "accurate"
    assert float(m["rewards/accuracies"]) == pytest.approx(0.5)


def test_kto_desirable_undesirable_and_clamped_kl():
    beta = 0.5
    batch = {
        "logp": t(-3.0, -5.0, -4.0),
        "ref_logp": t(-4.0, -4.0, -4.5),
        "label": t(1.0, 0.0, 1.0),
        "kl_logp": t(-6.0, -7.0, -8.0),
        "ref_kl_logp": t(-6.6, -7.3, -8.0),
    }
    loss, m = KTO(KTO.Config(beta=beta, desirable_weight=1.5, undesirable_weight=0.5)).loss(batch)
    z = (0.6 + 0.3 + 0.0) / 3  # mean of log π − log π_ref on the mismatched pairs = 0.3
    r = (1.0, -1.0, 0.5)
    expected = (
        1.5 * (1 - sig(beta * (r[0] - z))) + 0.5 * (1 - sig(beta * (z - r[1]))) + 1.5 * (1 - sig(beta * (r[2] - z)))
    ) / 3
    assert float(m["kl"]) == pytest.approx(z, abs=1e-6)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx(beta * (1.0 + 0.5) / 2)
    assert float(m["rewards/rejected"]) == pytest.approx(beta * -1.0)
    # a negative KL estimate is clamped to 0
    batch["ref_kl_logp"] = batch["kl_logp"] + 1.0
    _, m = KTO(KTO.Config(beta=beta)).loss(batch)
    assert float(m["kl"]) == 0.0


def test_kto_baseline_carries_no_gradient():
    batch = {
        "logp": t(-3.0, -5.0).requires_grad_(),
        "ref_logp": t(-4.0, -4.0),
        "label": t(1.0, 0.0),
        "kl_logp": t(-6.0, -7.0).requires_grad_(),
        "ref_kl_logp": t(-7.0, -8.0),
    }
    loss, _ = KTO().loss(batch)
    loss.backward()
    assert batch["kl_logp"].grad is None or float(batch["kl_logp"].grad.abs().sum()) == 0.0
    assert batch["logp"].grad[0] < 0 and batch["logp"].grad[1] > 0


def test_rm_bradley_terry_margin_and_centering():
    batch = {"rewards_chosen": t(1.0, -0.5), "rewards_rejected": t(0.2, 0.5)}
    loss, m = RM(RM.Config(margin=0.3, center_coeff=0.1)).loss(batch)
    bt = (-math.log(sig(1.0 - 0.2 - 0.3)) - math.log(sig(-0.5 - 0.5 - 0.3))) / 2
    center = ((1.2) ** 2 + (0.0) ** 2) / 2
    assert float(m["loss/centering"]) == pytest.approx(center)
    assert float(loss) == pytest.approx(bt + 0.1 * center, abs=1e-6)
    assert float(m["rewards/accuracies"]) == pytest.approx(0.5)
    assert float(m["rewards/margins"]) == pytest.approx((0.8 - 1.0) / 2)


def test_spin_is_dpo_on_self_play_pairs():
    loss_spin, _ = SPIN(SPIN.Config(beta=0.5)).loss(dict(PAIRS))
    loss_dpo, _ = DPO(DPO.Config(beta=0.5)).loss(dict(PAIRS))
    assert float(loss_spin) == pytest.approx(float(loss_dpo))
    assert SPIN(SPIN.Config(iterations=3)).iterations() == 3


def test_online_dpo_pairs_best_and_worst_and_skips_ties():
    alg = OnlineDPO(OnlineDPO.Config(beta=0.5))
    # 3 prompts × 3 samples; prompt 2 is a tie
    rewards = t(0.0, 1.0, 0.5, 0.3, 0.3, 0.3, 2.0, -1.0, 0.0)
    added, metrics = alg.advantages({"rewards": rewards, "group_size": 3})
    assert added["role"].tolist() == [-1, 1, 0, 0, 0, 0, 1, -1, 0]
    assert float(metrics["pairs/used"]) == pytest.approx(2 / 3)

    # per-token log-probs (B, T) with a mask; summed log-probs per sample are easy to read off
    mask = torch.tensor([[1, 1, 0]] * 9, dtype=torch.float32)
    logp = torch.arange(9, dtype=torch.float32).unsqueeze(1).repeat(1, 3) * -0.1  # sample i: Σ = −0.2·i
    logp_ref = torch.full((9, 3), -0.05)  # Σ = −0.1 per sample
    batch = {"logp": logp, "logp_ref": logp_ref, "mask": mask, "role": added["role"], "group_size": 3}
    loss, m = alg.loss(batch)
    seq = [-0.2 * i for i in range(9)]
    # prompt 0: chosen sample 1, rejected sample 0; prompt 2: chosen 6, rejected 7
    h = [0.5 * ((seq[1] + 0.1) - (seq[0] + 0.1)), 0.5 * ((seq[6] + 0.1) - (seq[7] + 0.1))]
    assert float(loss) == pytest.approx(sum(-math.log(sig(x)) for x in h) / 2, abs=1e-6)
    assert float(m["logps/chosen"]) == pytest.approx((seq[1] + seq[6]) / 2)


def test_online_dpo_all_ties_gives_zero_loss_with_graph():
    alg = OnlineDPO()
    added, _ = alg.advantages({"rewards": t(1.0, 1.0), "group_size": 2})
    logp = torch.zeros(2, 2, requires_grad=True)
    batch = {
        "logp": logp,
        "logp_ref": torch.zeros(2, 2),
        "mask": torch.ones(2, 2),
        "role": added["role"],
        "group_size": 2,
    }
    loss, _ = alg.loss(batch)
    loss.backward()
    assert float(loss.detach()) == 0.0 and logp.grad is not None


# ----------------------------------------------------------------------------- the loop's tensors


@pytest.fixture(scope="module")
def tiny_lm():
    from oxrl_core.models.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(len(tok), hidden_size=64, num_layers=2, seed=3).eval()
    return model, tok


@torch.no_grad()
def _direct_logps(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # (L-1, V)
    targets = ids[0, 1:]
    per_token = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[len(prompt) - 1 :]
    return float(per_token.sum()), len(completion)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_sequence_logps_match_a_direct_computation(tiny_lm, layout):
    from oxrl_core.loops.preference import collate_sequences, collate_shared_prompts, sequence_logps
    from oxrl_core.models.packed_attention import packed_attn_implementation

    model, tok = tiny_lm
    prompts = [[5, 9, 11], [7, 8], [6, 6, 6, 6, 6]]
    chosen = [[20, 21, 3], [30, 3], [40, 41, 42, 43, 3]]
    rejected = [[22, 3], [31, 32, 33, 3], [44, 3]]
    seqs = list(zip(prompts, chosen)) + list(zip(prompts, rejected))
    if layout == "shared":
        batch = collate_shared_prompts(prompts, chosen, rejected)
    else:
        batch = collate_sequences(seqs, tok.pad_token_id, layout == "packed")
    if layout != "padded":
        model.config._attn_implementation = packed_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            sums, counts = sequence_logps(model, batch)
    finally:
        model.config._attn_implementation = "sdpa"
    for i, (p, c) in enumerate(seqs):
        expected, n = _direct_logps(model, p, c)
        assert float(sums[i]) == pytest.approx(expected, abs=1e-4)
        assert float(counts[i]) == n


def test_shared_prompt_gradients_equal_separate_sequences(tiny_lm):
    """Computing the prompt once must not change the gradient (it collects both responses' parts)."""
    from oxrl_core.loops.preference import collate_sequences, collate_shared_prompts, sequence_logps
    from oxrl_core.models.packed_attention import packed_attn_implementation

    model, tok = tiny_lm
    prompts, chosen, rejected = [[5, 9, 11], [7, 8]], [[20, 21, 3], [30, 3]], [[22, 3], [31, 32, 33, 3]]
    grads = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            model.config._attn_implementation = packed_attn_implementation("sdpa")
            batch = collate_shared_prompts(prompts, chosen, rejected)
        else:
            batch = collate_sequences(
                list(zip(prompts, chosen)) + list(zip(prompts, rejected)), tok.pad_token_id, False
            )
        try:
            sums, _ = sequence_logps(model, batch)
            (sums[:2] - 0.5 * sums[2:]).sum().backward()
        finally:
            model.config._attn_implementation = "sdpa"
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_collate_marks_completion_tokens_and_last_tokens():
    from oxrl_core.loops.preference import collate_sequences, collate_shared_prompts

    seqs = [([1, 2], [3, 4]), ([5], [6])]
    padded = collate_sequences(seqs, 0, packing=False)
    # row 0 = [1, 2, 3, 4]: positions 1, 2 predict 3, 4; row 1 = [5, 6, pad, pad]: position 0 predicts 6
    assert padded["pred_index"].tolist() == [[0, 1], [0, 2], [1, 0]]
    assert padded["target"].tolist() == [3, 4, 6] and padded["owner"].tolist() == [0, 0, 1]
    assert padded["last"].tolist() == [[0, 3], [1, 1]]
    packed = collate_sequences(seqs, 0, packing=True)
    # one row [1, 2, 3, 4, 5, 6]
    assert packed["pred_index"].tolist() == [[0, 1], [0, 2], [0, 4]]
    assert packed["owner"].tolist() == [0, 0, 1] and packed["last"].tolist() == [[0, 3], [0, 5]]
    shared = collate_shared_prompts([[1, 2]], [[3, 4]], [[7]])
    # one row [1, 2 | 3, 4 | 7] at positions [0, 1, 2, 3, 2]; the prompt's last token predicts 3 and 7
    assert shared["input_ids"].tolist() == [[1, 2, 3, 4, 7]] and shared["position_ids"].tolist() == [[0, 1, 2, 3, 2]]
    assert shared["pred_index"][:, 1].tolist() == [1, 2, 1] and shared["target"].tolist() == [3, 4, 7]
    assert shared["owner"].tolist() == [0, 0, 1] and shared["last"].tolist() == [[0, 3], [0, 4]]


def test_reward_head_reads_the_same_scores_in_every_layout():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from oxrl_core.loops.preference import collate_sequences, collate_shared_prompts, sequence_scores
    from oxrl_core.models.packed_attention import packed_attn_implementation

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        num_labels=1,
        pad_token_id=0,
    )
    model = LlamaForSequenceClassification(config).eval()
    prompts, chosen, rejected = [[5, 9, 11], [7, 8]], [[20, 21, 3], [30, 3]], [[22, 3], [31, 32, 33, 3]]
    seqs = list(zip(prompts, chosen)) + list(zip(prompts, rejected))
    with torch.no_grad():
        expected = [float(model(torch.tensor([p + c])).logits[0, 0]) for p, c in seqs]  # transformers' own pooling
        padded = sequence_scores(model, collate_sequences(seqs, 0, packing=False))
        model.config._attn_implementation = packed_attn_implementation("sdpa")
        packed = sequence_scores(model, collate_sequences(seqs, 0, packing=True))
        shared = sequence_scores(model, collate_shared_prompts(prompts, chosen, rejected))
    for scores in (padded, packed, shared):
        assert scores.tolist() == pytest.approx(expected, abs=1e-5)
