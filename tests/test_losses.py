"""Hand-derived maths for the supervised losses (SFT, CPT, KD).

Every expected value below is worked out by hand in the comments, from
distributions simple enough to do on paper:

* uniform logits over V tokens               -> p(v) = 1/V, NLL = ln V
* a 2-token vocabulary with logits [0, ln 3] -> p = [1/4, 3/4]
  (e^0 = 1, e^{ln 3} = 3, Z = 4), so NLL(token 1) = ln(4/3), NLL(token 0) = ln 4
* logits [0, ln 9]                           -> p = [1/10, 9/10]

Conventions (`SupervisedBatch` in `oxrl_core.interfaces`): an algorithm gets per-token tensors over
next-token positions — ``mask``, ``logp`` (B, T-1), and ``logp_mean`` / ``kl_teacher`` — never
logits. The tests start from logits (B, T, V) and labels (B, T) (-100 where no loss is taken;
position t predicts label t+1) and build those tensors as the loop does, through the chunked LM
head (`oxrl_core.models.token_head`, 2 tokens a chunk, an identity head so the logits are the given
ones), so each worked example checks the head and the algorithm together; gradients are taken
with respect to the logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from oxrl_algs_supervised.cpt import CPT
from oxrl_algs_supervised.kd import KD
from oxrl_algs_supervised.sft import SFT
from oxrl_core.models.token_head import HeadPath, head_stats, on_grid

IGNORE = -100
LN2, LN3, LN4 = math.log(2), math.log(3), math.log(4)
LN4_3 = math.log(4 / 3)  # NLL of the 3/4 token: 0.2876820724517809


def logits_of(*rows: list[list[float]]) -> torch.Tensor:
    """rows of per-position logit vectors -> (B, T, V) float tensor."""
    return torch.tensor(rows, dtype=torch.float32)


def batch_of(
    logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None = None, kd_temperature: float = 1.0
) -> dict:
    """The loop's per-token batch (``mask``, ``logp``, ``logp_mean``, ``kl_teacher``) from explicit logits."""
    targets = labels[:, 1:]  # (B, T-1)
    mask = targets != IGNORE
    rows, pos = mask.nonzero(as_tuple=True)
    teacher = None if teacher_logits is None else teacher_logits[:, :-1][rows, pos]
    stats = head_stats(
        logits[:, :-1][rows, pos],
        targets[rows, pos],
        torch.nn.Identity(),
        HeadPath(chunk_size=2),
        logp_mean=True,
        h_teacher=teacher,
        teacher_head=torch.nn.Identity(),
        kd_temperature=kd_temperature,
    )
    return {"labels": labels, "mask": mask, **{k: on_grid(v, rows, pos, mask.shape) for k, v in stats.items()}}


def kd_loss(config, batch: dict):
    """KD on a batch of logits: the loop computes ``kl_teacher`` at the algorithm's temperature."""
    kd = KD(config) if config is not None else KD()
    return kd.loss(batch_of(batch["logits"], batch["labels"], batch["teacher_logits"], kd.distill_temperature()))


def labels_of(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def assert_close(actual, expected: float, tol: float = 1e-6) -> None:
    assert float(actual) == pytest.approx(float(expected), abs=tol), (float(actual), float(expected))


def assert_detached(metrics: dict) -> None:
    assert metrics, "an algorithm must report at least one metric"
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            assert not value.requires_grad, f"metric {name!r} is attached to the graph"
            assert value.grad_fn is None, f"metric {name!r} has a grad_fn"
            assert value.dim() == 0, f"metric {name!r} is not a scalar"


# ----------------------------------------------------------------------------- SFT


def test_sft_uniform_logits_give_ln_v():
    """V=4, all logits equal -> p = 1/4 for every token -> NLL = ln 4 = 1.3863 whatever the labels."""
    logits = torch.zeros(2, 5, 4)
    labels = labels_of([IGNORE, 0, 1, 2, 3], [IGNORE, IGNORE, 3, 3, IGNORE])
    loss, metrics = SFT().loss(batch_of(logits, labels))
    assert_close(loss, LN4)
    assert_close(metrics["loss/nll"], LN4)
    assert_detached(metrics)


def test_sft_two_token_vocabulary():
    """logits [0, ln 3] -> p = [1/4, 3/4].

    Target 1 -> -ln(3/4) = ln(4/3) = 0.28768; target 0 -> -ln(1/4) = ln 4 = 1.38629.
    """
    logits = logits_of([[0.0, LN3], [0.0, 0.0]])  # (1, 2, 2); position 1 predicts nothing
    loss_1, _ = SFT().loss(batch_of(logits, labels_of([IGNORE, 1])))
    loss_0, _ = SFT().loss(batch_of(logits, labels_of([IGNORE, 0])))
    assert_close(loss_1, LN4_3)
    assert_close(loss_0, LN4)


def test_sft_next_token_shift():
    """Position t predicts labels[t+1]; the last position predicts nothing and labels[0] is never a target.

    position 0: logits [0, ln 3] (p = [1/4, 3/4]) predicts labels[1] = 1 -> ln(4/3)
    position 1: logits [ln 3, 0] (p = [3/4, 1/4]) predicts labels[2] = 1 -> ln 4
    position 2: logits [50, -50]                 predicts nothing
    L = (ln(4/3) + ln 4) / 2 = (0.28768 + 1.38629) / 2 = 0.83698

    Without the shift (position t scored against labels[t]) the value would differ:
    position 1 vs label 1 -> ln 4, position 2 vs label 1 -> 100, far from 0.837.
    """
    logits = logits_of([[0.0, LN3], [LN3, 0.0], [50.0, -50.0]])
    labels = labels_of([IGNORE, 1, 1])
    loss, _ = SFT().loss(batch_of(logits, labels))
    assert_close(loss, (LN4_3 + LN4) / 2)

    # the last position's logits are irrelevant
    logits2 = logits.clone()
    logits2[0, 2] = torch.tensor([-7.0, 3.0])
    assert_close(SFT().loss(batch_of(logits2, labels))[0], (LN4_3 + LN4) / 2)
    # labels[0] is never a target, even when it is not masked
    assert_close(SFT().loss(batch_of(logits, labels_of([0, 1, 1])))[0], (LN4_3 + LN4) / 2)


def test_sft_prompt_masking():
    """Masked (prompt) positions do not change the loss; unmasking them does.

    V=2, T=5, labels [P, P, P, 1, 1] (P = -100, prompt). Only positions 2 and 3 predict
    completion tokens: both have logits [0, ln 3] -> NLL ln(4/3) each -> L = ln(4/3).
    Positions 0, 1 (predicting prompt tokens) get arbitrary logits.
    """
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 2) * 5
    logits[0, 2] = torch.tensor([0.0, LN3])
    logits[0, 3] = torch.tensor([0.0, LN3])
    labels = labels_of([IGNORE, IGNORE, IGNORE, 1, 1])
    loss, _ = SFT().loss(batch_of(logits, labels))
    assert_close(loss, LN4_3)

    # change the logits that predict prompt tokens, and the prompt token ids: same loss
    other = logits.clone()
    other[0, :2] = torch.tensor([[9.0, -9.0], [-4.0, 2.0]])
    assert_close(SFT().loss(batch_of(other, labels))[0], LN4_3)

    # the mask matters: labelling the prompt too gives a different loss
    unmasked, _ = SFT().loss(batch_of(logits, labels_of([0, 0, 1, 1, 1])))
    assert abs(float(unmasked) - LN4_3) > 1e-3


def test_sft_token_mean_over_batch_not_per_sequence():
    """The mean runs over completion tokens of the whole batch.

    sequence A: 1 completion token, logits [0, 0]    -> NLL ln 2     = 0.69315
    sequence B: 3 completion tokens, logits [0, ln 3] -> NLL ln(4/3) each
    token mean    = (ln 2 + 3 ln(4/3)) / 4 = (0.69315 + 0.86305) / 4 = 0.38905
    sequence mean = (ln 2 + ln(4/3)) / 2                             = 0.49041 (must NOT be returned)
    """
    logits = torch.zeros(2, 4, 2)
    logits[1, :3] = torch.tensor([0.0, LN3])
    labels = labels_of([IGNORE, 1, IGNORE, IGNORE], [IGNORE, 1, 1, 1])  # A is right-padded
    loss, metrics = SFT().loss(batch_of(logits, labels))
    assert_close(loss, (LN2 + 3 * LN4_3) / 4)
    assert abs(float(loss) - (LN2 + LN4_3) / 2) > 0.05
    assert_detached(metrics)


def test_sft_label_smoothing():
    """ε-smoothed CE = (1-ε)·NLL + ε·(1/V)·Σ_v -log p(v)  (the torch / TRL convention).

    logits [0, ln 3], target 1, ε = 0.1, V = 2:
      NLL             = ln(4/3)                          = 0.287682
      uniform term    = (ln 4 + ln(4/3)) / 2             = 0.836988
      L               = 0.9·0.287682 + 0.1·0.836988      = 0.342613
    loss/nll stays the unsmoothed NLL.
    """
    logits = logits_of([[0.0, LN3], [0.0, 0.0]])
    labels = labels_of([IGNORE, 1])
    sft = SFT(SFT.Config(label_smoothing=0.1))
    loss, metrics = sft.loss(batch_of(logits, labels))
    assert_close(loss, 0.9 * LN4_3 + 0.1 * (LN4 + LN4_3) / 2)
    assert_close(loss, 0.342613, tol=1e-6)
    assert_close(metrics["loss/nll"], LN4_3)
    assert_detached(metrics)


def test_sft_label_smoothing_uses_only_completion_tokens():
    """Smoothing is masked like the NLL: a prompt position with extreme logits adds nothing.

    Position 0 predicts a prompt token with logits [100, -100] (its uniform term would be ~100);
    position 1 predicts token 1 with logits [0, ln 3] -> same 0.342613 as above.
    """
    logits = logits_of([[100.0, -100.0], [0.0, LN3], [0.0, 0.0]])
    labels = labels_of([IGNORE, IGNORE, 1])
    loss, _ = SFT(SFT.Config(label_smoothing=0.1)).loss(batch_of(logits, labels))
    assert_close(loss, 0.9 * LN4_3 + 0.1 * (LN4 + LN4_3) / 2)


def test_sft_config_rejects_bad_smoothing():
    with pytest.raises(ValidationError):
        SFT.Config(label_smoothing=1.0)
    with pytest.raises(ValidationError):
        SFT.Config(label_smothing=0.1)  # typo: extra fields are errors


def test_sft_gradient_only_on_completion_predictions():
    """dL/dlogits is zero at positions that predict prompt tokens and at the last position.

    For the one completion prediction (position 1, logits [0, ln 3], target 1, N = 1)
    dL/dz = p - onehot = [1/4, 3/4 - 1] = [0.25, -0.25].
    """
    logits = logits_of([[1.0, 2.0], [0.0, LN3], [3.0, -1.0]]).requires_grad_()
    loss, _ = SFT().loss(batch_of(logits, labels_of([IGNORE, IGNORE, 1])))
    loss.backward()
    grad = logits.grad[0]
    assert torch.equal(grad[0], torch.zeros(2))
    assert torch.equal(grad[2], torch.zeros(2))
    assert torch.allclose(grad[1], torch.tensor([0.25, -0.25]), atol=1e-6)


def test_sft_all_masked_is_zero_not_nan():
    logits = torch.randn(1, 3, 4)
    loss, _ = SFT().loss(batch_of(logits, labels_of([IGNORE, IGNORE, IGNORE])))
    assert torch.isfinite(loss) and float(loss) == 0.0


# ----------------------------------------------------------------------------- CPT


def test_cpt_mean_over_all_non_pad_tokens_and_perplexity():
    """CPT labels every token; -100 only marks padding.

    V=2. Row A (3 tokens, labels [0, 1, 1]): positions 0, 1 have logits [0, ln 3] and predict
    token 1 twice -> ln(4/3) + ln(4/3). Row B (2 tokens + 1 pad, labels [1, 0, P]): position 0
    has logits [0, ln 3] and predicts token 0 -> ln 4; position 1 predicts padding (no loss).
      L   = (2·ln(4/3) + ln 4) / 3 = (0.57536 + 1.38629) / 3 = 0.65389
      ppl = e^L = ((4/3)·(4/3)·4)^(1/3) = (64/9)^(1/3) = 1.92296
    The per-row mean would be (ln(4/3) + ln 4) / 2 = 0.83698, not this.
    """
    logits = torch.zeros(2, 3, 2)
    logits[0, :2] = torch.tensor([0.0, LN3])
    logits[1, 0] = torch.tensor([0.0, LN3])
    logits[1, 1:] = torch.tensor([25.0, -25.0])  # predicts the pad: must not count
    labels = labels_of([0, 1, 1], [1, 0, IGNORE])
    loss, metrics = CPT().loss(batch_of(logits, labels))
    assert_close(loss, (2 * LN4_3 + LN4) / 3)
    assert_close(metrics["perplexity"], (64 / 9) ** (1 / 3), tol=1e-5)
    assert_close(metrics["loss/lm"], (2 * LN4_3 + LN4) / 3)
    assert_detached(metrics)


def test_cpt_uniform_perplexity_is_vocabulary_size():
    """Uniform logits over V = 8 -> L = ln 8, perplexity exactly 8."""
    logits = torch.zeros(3, 6, 8)
    labels = torch.randint(0, 8, (3, 6))
    loss, metrics = CPT().loss(batch_of(logits, labels))
    assert_close(loss, math.log(8))
    assert_close(metrics["perplexity"], 8.0, tol=1e-5)


def test_cpt_has_no_hyper_parameters():
    assert CPT.data_format == "text"  # the data layer packs `text` rows into data.max_length blocks
    with pytest.raises(ValidationError):
        CPT.Config(alpha=1.0)


# ----------------------------------------------------------------------------- KD

# The KD worked example (V = 2, one completion prediction, target token 1, T = 2):
#   student logits z_S = [0, 2 ln 3] = [0, ln 9]
#       raw:          p_S   = softmax([0, ln 9]) = [1/10, 9/10]   -> CE = ln(10/9) = 0.1053605
#       tempered /T:  p_S^τ = softmax([0, ln 3]) = [1/4, 3/4]
#   teacher logits z_T = [0, 0]  -> p_T^τ = [1/2, 1/2]
#   KL(p_T^τ ‖ p_S^τ) = ½·ln(½ / ¼) + ½·ln(½ / ¾) = ½·ln 2 + ½·ln(2/3) = ½·ln(4/3) = 0.1438410
#   T²·KL = 4 · 0.1438410 = 2·ln(4/3) = 0.5753641
KD_CE = math.log(10 / 9)
KD_KL = 0.5 * LN4_3


def kd_batch(requires_grad: bool = False) -> dict:
    """(1, 3, 2): position 0 predicts a prompt token (masked), position 1 the completion token 1."""
    student = logits_of([[4.0, -4.0], [0.0, 2 * LN3], [1.0, 1.0]])
    teacher = logits_of([[-3.0, 3.0], [0.0, 0.0], [5.0, 0.0]])
    if requires_grad:
        student.requires_grad_()
        teacher.requires_grad_()
    return {"logits": student, "teacher_logits": teacher, "labels": labels_of([IGNORE, IGNORE, 1])}


def test_kd_alpha_one_is_cross_entropy():
    """α = 1: L = CE = ln(10/9); it equals the SFT loss on the same batch."""
    batch = kd_batch()
    loss, metrics = kd_loss(KD.Config(alpha=1.0, temperature=2.0), batch)
    assert_close(loss, KD_CE)
    assert_close(metrics["loss/ce"], KD_CE)
    assert_close(loss, SFT().loss(batch_of(batch["logits"], batch["labels"]))[0])


def test_kd_alpha_zero_is_t_squared_kl():
    """α = 0: L = T²·KL = 4·½·ln(4/3) = 2·ln(4/3) = 0.575364."""
    loss, metrics = kd_loss(KD.Config(alpha=0.0, temperature=2.0), kd_batch())
    assert_close(metrics["loss/kl"], KD_KL)
    assert_close(loss, 4 * KD_KL)
    assert_close(loss, 2 * LN4_3)
    assert_detached(metrics)


def test_kd_temperature_one():
    """T = 1, α = 0: p_S = [1/10, 9/10], p_T = [1/2, 1/2].

    KL = ½·ln(½ / (1/10)) + ½·ln(½ / (9/10)) = ½·ln 5 + ½·ln(5/9) = ½·ln(25/9) = ln(5/3) = 0.5108256
    """
    loss, metrics = kd_loss(KD.Config(alpha=0.0, temperature=1.0), kd_batch())
    assert_close(loss, math.log(5 / 3))
    assert_close(metrics["loss/kl"], math.log(5 / 3))


def test_kd_mixed_case():
    """α = 0.5, T = 2: L = 0.5·ln(10/9) + 0.5·4·½·ln(4/3) = 0.0526803 + 0.2876821 = 0.3403624."""
    loss, metrics = kd_loss(KD.Config(alpha=0.5, temperature=2.0), kd_batch())
    assert_close(loss, 0.5 * KD_CE + 0.5 * 4 * KD_KL)
    assert_close(loss, 0.3403624, tol=1e-6)
    assert_close(metrics["loss/ce"], KD_CE)
    assert_close(metrics["loss/kl"], KD_KL)
    assert_detached(metrics)


def test_kd_defaults_are_alpha_half_temperature_two():
    loss, _ = kd_loss(None, kd_batch())
    assert_close(loss, 0.3403624, tol=1e-6)


def test_kd_kl_zero_when_teacher_equals_student():
    """Identical logits -> p_T = p_S at every position -> KL = 0, so α = 0 gives L = 0."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7) * 3
    labels = labels_of([IGNORE, IGNORE, 3, 4, 5], [IGNORE, 1, 2, IGNORE, IGNORE])
    batch = {"logits": logits, "teacher_logits": logits.clone(), "labels": labels}
    loss, metrics = kd_loss(KD.Config(alpha=0.0, temperature=3.0), batch)
    assert abs(float(metrics["loss/kl"])) < 1e-6
    assert abs(float(loss)) < 1e-5
    # and with α > 0 only the CE remains
    loss_mixed, metrics_mixed = kd_loss(KD.Config(alpha=0.3, temperature=3.0), batch)
    assert_close(loss_mixed, 0.3 * float(metrics_mixed["loss/ce"]), tol=1e-5)


def test_kd_kl_ignores_masked_positions():
    """Position 0 (predicting a prompt token) has very different teacher/student logits; it must not count."""
    batch = kd_batch()
    batch["teacher_logits"][0, 0] = torch.tensor([40.0, -40.0])
    batch["logits"][0, 0] = torch.tensor([-40.0, 40.0])
    loss, metrics = kd_loss(KD.Config(alpha=0.0, temperature=2.0), batch)
    assert_close(metrics["loss/kl"], KD_KL)


def test_kd_gradients_reach_student_only():
    """Gradients flow into the student logits (at the completion prediction only), never into the teacher's.

    α = 0, T = 2 at position 1: dL/dz_S = T²·(1/T)·(p_S^τ − p_T^τ) = 2·([1/4, 3/4] − [1/2, 1/2]) = [-0.5, 0.5].
    """
    batch = kd_batch(requires_grad=True)
    loss, _ = kd_loss(KD.Config(alpha=0.0, temperature=2.0), batch)
    loss.backward()
    student_grad = batch["logits"].grad[0]
    assert torch.allclose(student_grad[1], torch.tensor([-0.5, 0.5]), atol=1e-6)
    assert torch.equal(student_grad[0], torch.zeros(2))  # masked position
    assert torch.equal(student_grad[2], torch.zeros(2))  # last position predicts nothing
    teacher_grad = batch["teacher_logits"].grad
    assert teacher_grad is None or torch.count_nonzero(teacher_grad) == 0


def test_kd_config_bounds():
    with pytest.raises(ValidationError):
        KD.Config(alpha=1.5)
    with pytest.raises(ValidationError):
        KD.Config(temperature=0.0)
    assert KD.needs_teacher is True


# ----------------------------------------------------------------------------- the per-token contract


def test_algorithms_read_per_token_tensors_and_declare_what_they_need():
    """No logits in the batch: SFT/CPT read logp and mask; label smoothing asks for logp_mean; KD states τ.

    Two scored tokens with p(y) = 3/4 and 1/4 -> NLL = (ln(4/3) + ln 4) / 2 = 0.83698;
    smoothing ε = 0.2 with (1/V) Σ_v log π(v) = −1 and −3 -> uniform = 2, L = 0.8·0.83698 + 0.2·2 = 1.06959;
    KD α = 0.5, T = 3 with KL = 0.1 and 0.3 -> L = 0.5·0.83698 + 0.5·9·0.2 = 1.31849.
    """
    mask = torch.tensor([[False, True, True]])
    logp = torch.tensor([[123.0, math.log(3 / 4), math.log(1 / 4)]])  # the unscored entry is never read
    nll = (LN4_3 + LN4) / 2
    assert_close(SFT().loss({"logp": logp, "mask": mask})[0], nll)
    assert_close(CPT().loss({"logp": logp, "mask": mask})[0], nll)
    smoothing = SFT(SFT.Config(label_smoothing=0.2))
    assert not SFT().uses_logp_mean() and smoothing.uses_logp_mean()
    logp_mean = torch.tensor([[50.0, -1.0, -3.0]])
    assert_close(smoothing.loss({"logp": logp, "mask": mask, "logp_mean": logp_mean})[0], 0.8 * nll + 0.2 * 2)
    kd = KD(KD.Config(alpha=0.5, temperature=3.0))
    assert kd.distill_temperature() == 3.0
    kl_teacher = torch.tensor([[7.0, 0.1, 0.3]])
    assert_close(
        kd.loss({"logp": logp, "mask": mask, "kl_teacher": kl_teacher})[0], 0.5 * nll + 0.5 * 9 * 0.2, tol=1e-5
    )
