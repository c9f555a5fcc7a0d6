"""TRL 1.16 reference numbers for the preference algorithms (a test helper, not a test file).

Each function builds TRL's own trainer on the given model directories (float32, CPU, ``report_to=[]``,
``max_length=None`` so nothing is truncated), collates OUR token ids with the trainer's own data collator and
runs the trainer's own ``compute_loss`` once, in train mode, on that single batch. It returns the loss and the
metrics the trainer logged for that step. Line numbers refer to ``site-packages/trl`` 1.16.0.

How the trainers are fed pre-tokenised ids
------------------------------------------
* No trainer skips its text pipeline for our column names (only ``RewardTrainer._prepare_dataset`` skips when
  ``chosen_ids``/``rejected_ids`` exist, trainer/reward_trainer.py:658). DPO/KTO/ORPO/CPO always re-tokenise text
  (and ORPO/CPO ``tokenize_row`` would add BOS/EOS), so each trainer is built on a dummy one/two-row text
  dataset that is never used; our rows go straight into ``trainer.data_collator`` in the format its tokenised
  dataset would have:
  DPO ``{prompt_ids, chosen_ids, rejected_ids}`` (trainer/dpo_trainer.py:146); KTO ``{prompt_ids,
  completion_ids, KL_completion_ids, label}`` (trainer/kto_trainer.py:161); ORPO/CPO the ``tokenize_row`` output
  ``{prompt_input_ids, chosen_input_ids = prompt+chosen, chosen_labels (-100 on prompt), ...}``
  (experimental/orpo/orpo_trainer.py:458, experimental/cpo/cpo_trainer.py:476); RM ``{chosen_ids =
  prompt+chosen, rejected_ids, [margin]}`` (trainer/reward_trainer.py:203). All collators pad on the right.

Which log-probabilities each loss uses (verified against plain-torch hand computations)
---------------------------------------------------------------------------------------
* DPO (trainer/dpo_trainer.py): fused-LM-head per-token logps of the completion tokens only, SUMMED per
  sequence (:1304), reference the same under no_grad (:1327, :1341). ``rewards/* = beta*(logp - ref_logp)``
  (:1582), ``logps/*`` = batch means of the summed policy logps (:1600). ``sigmoid`` is ``-logsigmoid(beta*delta)``
  with NO label smoothing (:1387; ``label_smoothing`` only feeds ``robust``/``exo_pair``, dpo_config.py:103).
  ``ipo`` divides each summed log-ratio by its completion length: ``(avg_c - avg_r - 1/(2 beta))**2`` (:1393-1404),
  while the logged rewards/logps stay summed. There is no ``rpo_alpha``: RPO is ``loss_type=[..., "sft"]``,
  ``loss_weights=[1, alpha]``, where ``sft`` = -mean of policy logps over ALL chosen completion tokens of the batch
  (token mean, :1495-1498). The loss is the mean over pairs (:1528).
* KTO (trainer/kto_trainer.py): summed completion logps (:1401). KL pairs rotate completions by +1 within each
  ``per_device_train_batch_size`` batch: row i is scored on completion i-1, row 0 on the last one (:1141-1156;
  a closure, so ``kto_kl_completions`` below copies it). Policy KL logps run under ``torch.no_grad`` (:1364);
  ``kl = mean over ALL rows of (KL_logp - ref_KL_logp)``, detached, then ``clamp(min=0)`` (:1443-1444).
  The losses are ``1 - sigmoid(beta*(r - kl))`` (desirable) and ``1 - sigmoid(beta*(kl - r))`` (undesirable), NOT
  -logsigmoid (:1453, :1470). They are weighted, concatenated and averaged over all rows (``nanmean``, :1548).
  ``rewards/chosen`` = sum/num_chosen; ``rewards/margins`` is logged only when both labels are present (:1544);
  KTO logs no ``rewards/accuracies``. Metric ``kl`` is the clamped value.
* ORPO (experimental/orpo/orpo_trainer.py): the odds use the token-AVERAGED completion logp
  (``average_log_prob=True``, :805), ``log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))`` (:693), and
  loss = ``nll - beta * mean(logsigmoid(log_odds))`` (:848). The NLL is a CrossEntropy token mean over the chosen
  half with labels = input_ids wherever attention_mask==1, so it INCLUDES PROMPT tokens (every token after the
  first, :798), unlike the paper (completion only). ``rewards/* = beta * avg logp`` (:699).
* SimPO = CPOTrainer ``loss_type="simpo"`` (experimental/cpo/cpo_trainer.py): token-AVERAGED completion logps
  (:850); loss ``-logsigmoid(beta*(a_c - a_r) - simpo_gamma)`` (label smoothing 0, :716), so ``simpo_gamma`` is the
  paper's absolute gamma (= gamma_beta_ratio * beta). Plus ``cpo_alpha * nll`` (:890), a CE token mean over the
  chosen half's COMPLETION tokens (:840-845). TRL's default cpo_alpha is 1.0; here it is 0 (pure SimPO).
  ``rewards/* = beta * avg logp`` (:746).
* RM (trainer/reward_trainer.py): the score is the logit at the RIGHTMOST token != config.pad_token_id
  (transformers/modeling_layers.py:165), and the trainer copies pad_token_id from the tokenizer (:572). If
  pad == eos, trailing EOS tokens count as padding, so the score is read at the last non-EOS token. loss =
  ``-logsigmoid(r_c - r_r - margin).mean()`` (:790; margin is a per-example dataset column) +
  ``center_rewards_coefficient * mean((r_c + r_r)**2)`` (:795).

Defaults that differ from the papers, or are traps
--------------------------------------------------
DPO beta 0.1. KTO beta 0.1, weights 1.0/1.0. ORPO ``beta`` (the paper's lambda) 0.1. CPO/SimPO beta 0.1 (the SimPO
paper uses ~2.0-2.5), ``simpo_gamma`` 0.5 absolute (the paper gives gamma/beta ~0.5), ``cpo_alpha`` 1.0 (adds NLL).
``max_length`` is 1024 everywhere (truncates; None here). ``disable_dropout`` is True everywhere. ``bf16`` defaults
to True (trainer/base_config.py:108): accelerate wraps the prepared DPO/KTO reference model (dpo_trainer.py:990)
in bf16 autocast even on CPU, which moves the rewards by ~1e-3. It is switched off here.
"""

from __future__ import annotations

import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# bf16/fp16 off: TRL configs default bf16=True (trainer/base_config.py:108), and accelerate then wraps the
# prepared reference model in bf16 autocast, even on CPU (rewards then drift by ~1e-3).
_COMMON = dict(
    report_to=[],
    use_cpu=True,
    bf16=False,
    fp16=False,
    save_strategy="no",
    logging_strategy="no",
    seed=0,
    disable_tqdm=True,
)


def _load(model_dir, cls=None, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    cls = cls or AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32, **kwargs)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _pref_text():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["ab", "cd"], "chosen": ["e", "f"], "rejected": ["g", "h"]})


def _run(trainer, batch) -> float:
    """One `compute_loss` call, in train mode, on our batch; returns the loss as a float."""
    trainer.model.train()
    batch = trainer._prepare_inputs(batch)
    loss = trainer.compute_loss(trainer.model, batch)
    return float(loss.detach())


def _last(metrics) -> dict:
    return {k: float(v[-1]) for k, v in metrics.items() if len(v)}


def trl_dpo(policy_dir, ref_dir, examples, *, beta, loss_type="sigmoid", label_smoothing=0.0, rpo_alpha=None) -> dict:
    """TRL DPOTrainer numbers (loss_type: "sigmoid", "ipo", "hinge", "robust", ...).

    ``rpo_alpha`` maps to TRL 1.16's ``loss_type=[loss_type, "sft"], loss_weights=[1, rpo_alpha]``.
    ``label_smoothing`` with "sigmoid" is rejected: TRL 1.16's sigmoid loss has no label smoothing.
    """
    from trl import DPOConfig, DPOTrainer

    if loss_type == "sigmoid" and label_smoothing:
        raise ValueError("TRL 1.16 ignores label_smoothing for loss_type='sigmoid' (use 'robust')")
    loss_types, weights = [loss_type], None
    if rpo_alpha is not None:
        loss_types, weights = [loss_type, "sft"], [1.0, float(rpo_alpha)]
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=len(examples),
            max_length=None,
            beta=beta,
            loss_type=loss_types,
            loss_weights=weights,
            label_smoothing=label_smoothing,
            **_COMMON,
        )
        trainer = DPOTrainer(
            model=_load(policy_dir),
            ref_model=_load(ref_dir),
            args=args,
            train_dataset=_pref_text(),
            processing_class=_tokenizer(policy_dir),
        )
        rows = [
            {
                "prompt_ids": list(e["prompt_input_ids"]),
                "chosen_ids": list(e["chosen_input_ids"]),
                "rejected_ids": list(e["rejected_input_ids"]),
            }
            for e in examples
        ]
        loss = _run(trainer, trainer.data_collator(rows))
        return {"loss": loss, **_last(trainer._metrics["train"])}


def kto_kl_completions(completions: list[list[int]]) -> list[list[int]]:
    """TRL's KL pairing (trainer/kto_trainer.py add_kl_completion_ids): rotate completions by +1 in the batch."""
    return [completions[-1]] + completions[:-1]


def trl_kto(policy_dir, ref_dir, examples, *, beta, desirable_weight=1.0, undesirable_weight=1.0) -> dict:
    """TRL KTOTrainer numbers (loss_type "kto"); rows {"prompt_input_ids", "completion_input_ids", "label"}."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    if len(examples) < 2:
        raise ValueError("TRL's KTO needs a batch of at least 2 rows")
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = KTOConfig(
            output_dir=out,
            per_device_train_batch_size=len(examples),
            max_length=None,
            beta=beta,
            desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight,
            **_COMMON,
        )
        text = Dataset.from_dict({"prompt": ["ab", "cd"], "completion": ["e", "f"], "label": [True, False]})
        trainer = KTOTrainer(
            model=_load(policy_dir),
            ref_model=_load(ref_dir),
            args=args,
            train_dataset=text,
            processing_class=_tokenizer(policy_dir),
        )
        completions = [list(e["completion_input_ids"]) for e in examples]
        rows = [
            {
                "prompt_ids": list(e["prompt_input_ids"]),
                "completion_ids": c,
                "KL_completion_ids": kl,
                "label": bool(e["label"]),
            }
            for e, c, kl in zip(examples, completions, kto_kl_completions(completions))
        ]
        loss = _run(trainer, trainer.data_collator(rows))
        return {"loss": loss, **_last(trainer._metrics["train"])}


def _orpo_cpo_rows(examples):
    """The row format ORPO/CPO `tokenize_row` produces, built from our ids (no BOS/EOS added)."""
    rows = []
    for e in examples:
        p, c, r = list(e["prompt_input_ids"]), list(e["chosen_input_ids"]), list(e["rejected_input_ids"])
        rows.append(
            {
                "prompt_input_ids": p,
                "prompt_attention_mask": [1] * len(p),
                "chosen_input_ids": p + c,
                "chosen_attention_mask": [1] * (len(p) + len(c)),
                "chosen_labels": [-100] * len(p) + c,
                "rejected_input_ids": p + r,
                "rejected_attention_mask": [1] * (len(p) + len(r)),
                "rejected_labels": [-100] * len(p) + r,
            }
        )
    return rows


def trl_orpo(policy_dir, examples, *, beta) -> dict:
    """TRL (experimental) ORPOTrainer numbers; ``beta`` is the paper's lambda."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = ORPOConfig(
            output_dir=out,
            per_device_train_batch_size=len(examples),
            max_length=4096,
            beta=beta,
            remove_unused_columns=False,
            **_COMMON,
        )
        trainer = ORPOTrainer(
            model=_load(policy_dir), args=args, train_dataset=_pref_text(), processing_class=_tokenizer(policy_dir)
        )
        loss = _run(trainer, trainer.data_collator(_orpo_cpo_rows(examples)))
        return {"loss": loss, **_last(trainer._stored_metrics["train"])}


def trl_simpo(policy_dir, examples, *, beta, simpo_gamma=None, gamma_beta_ratio=None, cpo_alpha=0.0) -> dict:
    """TRL (experimental) CPOTrainer with loss_type="simpo". Give ``simpo_gamma`` (TRL's absolute margin) or
    ``gamma_beta_ratio`` (simpo_gamma = ratio * beta). ``cpo_alpha`` > 0 adds TRL's CPO NLL term."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    if (simpo_gamma is None) == (gamma_beta_ratio is None):
        raise ValueError("give exactly one of simpo_gamma / gamma_beta_ratio")
    if simpo_gamma is None:
        simpo_gamma = gamma_beta_ratio * beta
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = CPOConfig(
            output_dir=out,
            per_device_train_batch_size=len(examples),
            max_length=4096,
            beta=beta,
            loss_type="simpo",
            simpo_gamma=simpo_gamma,
            cpo_alpha=cpo_alpha,
            remove_unused_columns=False,
            **_COMMON,
        )
        trainer = CPOTrainer(
            model=_load(policy_dir), args=args, train_dataset=_pref_text(), processing_class=_tokenizer(policy_dir)
        )
        loss = _run(trainer, trainer.data_collator(_orpo_cpo_rows(examples)))
        return {"loss": loss, **_last(trainer._stored_metrics["train"])}


def trl_rm(rm_dir, examples, *, margin=None, center_rewards_coefficient=None) -> dict:
    """TRL RewardTrainer numbers. ``margin``: a float (same for every pair) or one value per example.

    Returns "loss", "rewards/chosen", "rewards/rejected" (batch means of the scores) plus TRL's logged
    "accuracy", "margin", "mean_reward", "min_reward", "max_reward".
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    rows = [
        {
            "chosen_ids": list(e["prompt_input_ids"]) + list(e["chosen_input_ids"]),
            "rejected_ids": list(e["prompt_input_ids"]) + list(e["rejected_input_ids"]),
        }
        for e in examples
    ]
    if margin is not None:
        margins = [float(margin)] * len(rows) if isinstance(margin, (int, float)) else [float(m) for m in margin]
        for row, m in zip(rows, margins):
            row["margin"] = m
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = RewardConfig(
            output_dir=out,
            per_device_train_batch_size=len(examples),
            max_length=None,
            center_rewards_coefficient=center_rewards_coefficient,
            **_COMMON,
        )
        model = _load(rm_dir, AutoModelForSequenceClassification, num_labels=1)
        trainer = RewardTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=_tokenizer(rm_dir)
        )
        batch = trainer._prepare_inputs(trainer.data_collator(rows))
        trainer.model.train()
        loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
        chosen, rejected = torch.chunk(outputs.logits.detach().squeeze(-1), 2)
        return {
            "loss": float(loss.detach()),
            "rewards/chosen": float(chosen.mean()),
            "rewards/rejected": float(rejected.mean()),
            "scores/chosen": chosen.tolist(),
            "scores/rejected": rejected.tolist(),
            **_last(trainer._metrics["train"]),
        }
