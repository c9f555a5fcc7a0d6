"""oxRL's preference algorithms against an independent implementation: TRL (a test-only dependency).

For DPO (sigmoid, with and without the RPO NLL term), IPO, KTO, ORPO, SimPO and RM, one step of a real
`oxrl` run (the Python API, i.e. the preference loop of `oxrl run`) on a tiny random Llama, with a separate,
differently initialised reference model (seed 1 vs the policy's seed 0) and a fixed batch, logs the same
first-step loss and log-probabilities / rewards as TRL 1.16's own trainers compute for the same model,
reference, token ids and hyper-parameters, to 1e-4 absolute. The first step's metrics are computed before the
optimiser update, so they are the values at the initial weights, which is what TRL's single `compute_loss`
sees (`tests/trl_reference.py` says how each TRL trainer is driven and where its formulas are).

Tokenisation: the two sides would tokenise differently (TRL applies its own chat template handling and adds
EOS/BOS its own way), so both are fed the SAME token ids: oxRL tokenises the JSONL file itself, and the ids
given to TRL are built with oxRL's own functions, `oxrl_core.data.encode.encode_prompt` (the chat template with the
generation prompt) and `encode_completion` (completion tokens + EOS). TRL then only collates them.

Each training file holds exactly `train.batch_size` rows, so the first micro-batch is the whole file. The
loop shuffles the rows inside it; batch means do not depend on the order, but KTO's KL pairs (prompt i with
the completion of row i-1) do, so the KTO test reproduces the loop's order with `BatchPlan`.

Known definitional differences, kept out of the comparison on purpose (they are not loss mismatches):
- IPO: TRL logs SUMMED-log-ratio rewards (beta * (logp - ref_logp)) even though its loss uses length-averaged
  log-ratios; oxRL logs beta * the length-averaged log-ratio (the quantity in its loss). So IPO compares the
  loss and the (summed) logps, not rewards/accuracies.
- ORPO/SimPO: TRL's `logps/*` are token-AVERAGED log-probabilities, oxRL's are summed (as for every oxRL
  preference algorithm). Both log `rewards/* = beta * averaged logp`, which is compared; oxRL's summed logps
  come from the same `sequence_logps` the DPO/IPO/KTO comparisons check against TRL's summed logps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_reference  # a test helper next to this file

TOL = 1e-4
HIDDEN, LAYERS = 128, 2

PAIRS = [
    {"prompt": "hi", "chosen": "hello there", "rejected": "no"},
    {"prompt": "2+2?", "chosen": "4", "rejected": "five, I think"},
    {"prompt": "Name a colour.", "chosen": "blue", "rejected": "a big dog"},
    {"prompt": "Say yes", "chosen": "yes!", "rejected": "nope"},
]
UNPAIRED = [
    {"prompt": "hi", "completion": "hello there", "label": True},
    {"prompt": "2+2?", "completion": "five, I think", "label": False},
    {"prompt": "Name a colour.", "completion": "blue", "label": True},
    {"prompt": "Say yes", "completion": "nope", "label": False},
]
# ORPO: one-character prompts (see the `orpo_dir` fixture)
ORPO_PAIRS = [
    {"prompt": "a", "chosen": "apple", "rejected": "no"},
    {"prompt": "?", "chosen": "4", "rejected": "five, I think"},
    {"prompt": "c", "chosen": "cat", "rejected": "a big dog"},
]


# ----------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Tiny Llamas: the policy (seed 0) and a differently initialised reference (seed 1)."""
    from oxrl_core.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("ref-models")
    return {
        "policy": save_tiny_model(root / "policy", hidden_size=HIDDEN, num_layers=LAYERS, seed=0),
        "ref": save_tiny_model(root / "ref", hidden_size=HIDDEN, num_layers=LAYERS, seed=1),
    }


@pytest.fixture(scope="module")
def orpo_dir(models, tmp_path_factory) -> Path:
    """The policy with a tokenizer WITHOUT a chat template, for ORPO.

    TRL's ORPO NLL is a token mean over every token of the chosen sequence after the first, prompt included
    (experimental/orpo/orpo_trainer.py:798); oxRL's (like the paper's) covers the completion only. With a
    one-token prompt the two sets of tokens coincide, so the comparison is exact. The chat template would add
    role tokens, so it is removed; then `encode_prompt` encodes the plain prompt text (the character tokenizer
    adds no BOS), one character = one token (checked in the test).
    """
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("orpo") / "policy-no-template"
    shutil.copytree(models["policy"], path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    assert not AutoTokenizer.from_pretrained(path).chat_template
    return path


@pytest.fixture(scope="module")
def rm_dir(models, tmp_path_factory) -> Path:
    """A sequence-classification start point (policy backbone + a seeded `score` head), used by both sides.

    oxRL's rm run on a causal-LM directory would draw its own fresh head; giving both sides this saved
    checkpoint fixes the head. The head is drawn with std 0.1 (not 0.02) so the scores are O(1) and the loss
    is not stuck at log 2.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tmp_path_factory.mktemp("rm") / "rm-start"
    tokenizer = AutoTokenizer.from_pretrained(models["policy"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(models["policy"], num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)

    from oxrl_core.models.loading import load_score_model

    loaded = load_score_model(str(path), pad_token_id=tokenizer.pad_token_id)
    torch.testing.assert_close(loaded.score.weight, model.score.weight, rtol=0, atol=0)  # the head is kept
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_oxrl(alg: str, policy, rows: list[dict], out: Path, ref=None, **alg_config) -> dict:
    """One step of the oxRL preference loop over the whole file; its first metrics.jsonl line."""
    from oxrl_core import Trainer

    data = write_jsonl(out / "train.jsonl", rows)
    # `alg`, `model` and `data` are also Trainer's positional names (algorithm, model.name, data.train), so
    # model.ref, data.eval and the alg: section go in as --set style overrides
    sets = [f"model.ref={json.dumps(str(ref))}"] if ref is not None else []
    sets += ['data.eval=""'] + [f"alg.{k}={json.dumps(v)}" for k, v in alg_config.items()]
    Trainer(
        alg,
        str(policy),
        str(data),
        output_dir=out / "run",
        quiet=True,
        train={"max_steps": 1, "batch_size": len(rows), "lr": 1e-6, "seed": 0, "precision": "fp32"},
        engine={"device": "cpu"},
        overrides=sets,
    ).train()
    return json.loads((out / "run" / "metrics.jsonl").read_text().splitlines()[0])


def pair_examples(model_dir, rows: list[dict]) -> list[dict]:
    """TRL-side ids of preference rows, built with oxRL's own tokenisation functions."""
    from transformers import AutoTokenizer

    from oxrl_core.data.encode import encode_completion, encode_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [
        {
            "prompt_input_ids": encode_prompt(tok, r["prompt"]),
            "chosen_input_ids": encode_completion(tok, r["chosen"]),
            "rejected_input_ids": encode_completion(tok, r["rejected"]),
        }
        for r in rows
    ]


def compare(name: str, ours: dict, theirs: dict, keys: dict[str, str]) -> float:
    """Assert |ours[k] - theirs[keys[k]]| <= TOL for every key; returns the largest difference."""
    diffs = {k: abs(ours[k] - theirs[t]) for k, t in keys.items()}
    print(f"\n{name}: max |oxRL - TRL| = {max(diffs.values()):.2e} over {sorted(diffs)}")
    bad = {k: (ours[k], theirs[t]) for k, t in keys.items() if diffs[k] > TOL}
    assert not bad, f"{name}: oxRL vs TRL differ by more than {TOL} in {bad}"
    return max(diffs.values())


PAIR_KEYS = [
    "loss",
    "logps/chosen",
    "logps/rejected",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
]


# ----------------------------------------------------------------------------- DPO / IPO


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_sigmoid_matches_trl(models, tmp_path, beta):
    # label_smoothing stays 0: TRL 1.16's sigmoid loss has no label smoothing (cDPO is tested by hand elsewhere)
    ours = run_oxrl("dpo", models["policy"], PAIRS, tmp_path, ref=models["ref"], beta=beta, label_smoothing=0.0)
    theirs = trl_reference.trl_dpo(
        models["policy"], models["ref"], pair_examples(models["policy"], PAIRS), beta=beta, loss_type="sigmoid"
    )
    compare(f"dpo beta={beta}", ours, theirs, {k: k for k in PAIR_KEYS})


def test_dpo_rpo_nll_matches_trl(models, tmp_path):
    # our nll_alpha (RPO) = TRL's loss_type=["sigmoid", "sft"], loss_weights=[1, alpha]
    ours = run_oxrl("dpo", models["policy"], PAIRS, tmp_path, ref=models["ref"], beta=0.1, nll_alpha=0.5)
    theirs = trl_reference.trl_dpo(
        models["policy"],
        models["ref"],
        pair_examples(models["policy"], PAIRS),
        beta=0.1,
        loss_type="sigmoid",
        rpo_alpha=0.5,
    )
    compare("dpo+rpo", ours, theirs, {k: k for k in PAIR_KEYS})


def test_ipo_matches_trl(models, tmp_path):
    ours = run_oxrl("ipo", models["policy"], PAIRS, tmp_path, ref=models["ref"], beta=0.1)
    theirs = trl_reference.trl_dpo(
        models["policy"], models["ref"], pair_examples(models["policy"], PAIRS), beta=0.1, loss_type="ipo"
    )
    # rewards are defined differently (module docstring): loss and the summed logps only
    compare("ipo", ours, theirs, {k: k for k in ("loss", "logps/chosen", "logps/rejected")})


# ----------------------------------------------------------------------------- KTO


def kto_batch_order(model_dir, rows: list[dict], seed: int) -> list[int]:
    """The row order of the loop's first micro-batch (the file is exactly one batch)."""
    from transformers import AutoTokenizer

    from oxrl_core.data.batching import BatchPlan
    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import Source

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = prepare_examples(
        Source(rows=[{**r, "_row": i} for i, r in enumerate(rows)], origin="test"), "unpaired", tok, 1024
    ).examples
    # as run_preference computes them (the order does not depend on them without group_by_length)
    lengths = [
        len(ex["prompt_ids"]) + max(len(v) for k, v in ex.items() if k.endswith("_ids") and k != "prompt_ids")
        for ex in examples
    ]
    order = BatchPlan(lengths, len(rows), seed, group_by_length=False).micro_batch(0)
    assert sorted(order) == list(range(len(rows)))
    return order


@pytest.mark.parametrize("swap", [False, True], ids=["kl-positive", "kl-clamped"])
def test_kto_matches_trl(models, tmp_path, swap):
    from transformers import AutoTokenizer

    from oxrl_core.data.encode import encode_completion, encode_prompt

    # Which way round the raw KL estimate is positive depends on the two random models; "kl-positive" is the
    # case the clamp max(0, .) does not hide (asserted below), "kl-clamped" swaps policy and reference.
    policy, ref = (models["ref"], models["policy"]) if swap else (models["policy"], models["ref"])
    ours = run_oxrl("kto", policy, UNPAIRED, tmp_path, ref=ref, beta=0.1, desirable_weight=1.0, undesirable_weight=1.33)
    tok = AutoTokenizer.from_pretrained(policy)
    order = kto_batch_order(policy, UNPAIRED, seed=0)
    examples = [
        {
            "prompt_input_ids": encode_prompt(tok, UNPAIRED[i]["prompt"]),
            "completion_input_ids": encode_completion(tok, UNPAIRED[i]["completion"]),
            "label": UNPAIRED[i]["label"],
        }
        for i in order
    ]
    theirs = trl_reference.trl_kto(policy, ref, examples, beta=0.1, desirable_weight=1.0, undesirable_weight=1.33)
    if swap:
        assert ours["kl"] == 0.0 and theirs["kl"] == 0.0, "expected the clamped case"
    else:
        assert theirs["kl"] > 1e-2, f"raw KL not positive ({theirs['kl']}): the clamp would hide a mismatch"
    compare(
        f"kto ({'clamped' if swap else 'kl>0'})",
        ours,
        theirs,
        {k: k for k in ("loss", "kl", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected")},
    )


# ----------------------------------------------------------------------------- ORPO / SimPO


def test_orpo_matches_trl(orpo_dir, tmp_path):
    lam = 0.25
    examples = pair_examples(orpo_dir, ORPO_PAIRS)
    assert all(len(e["prompt_input_ids"]) == 1 for e in examples), "ORPO prompts must be exactly one token"
    ours = run_oxrl("orpo", orpo_dir, ORPO_PAIRS, tmp_path, lam=lam)
    theirs = trl_reference.trl_orpo(orpo_dir, examples, beta=lam)
    compare(
        "orpo",
        ours,
        theirs,
        {
            "loss": "loss",
            "loss/nll": "nll_loss",
            "log_odds_ratio": "log_odds_chosen",
            "rewards/chosen": "rewards/chosen",
            "rewards/rejected": "rewards/rejected",
            "rewards/margins": "rewards/margins",
            "rewards/accuracies": "rewards/accuracies",
        },
    )


def test_simpo_matches_trl(models, tmp_path):
    # our gamma is TRL's absolute simpo_gamma; cpo_alpha=0 is pure SimPO (TRL's default 1.0 adds an NLL term)
    beta, gamma = 2.0, 1.0
    ours = run_oxrl("simpo", models["policy"], PAIRS, tmp_path, beta=beta, gamma=gamma, label_smoothing=0.0)
    theirs = trl_reference.trl_simpo(
        models["policy"], pair_examples(models["policy"], PAIRS), beta=beta, simpo_gamma=gamma, cpo_alpha=0.0
    )
    compare("simpo", ours, theirs, {k: k for k in PAIR_KEYS if not k.startswith("logps/")})


# ----------------------------------------------------------------------------- RM


@pytest.mark.parametrize("margin,center", [(0.0, 0.0), (0.5, 0.01)])
def test_rm_matches_trl(rm_dir, tmp_path, margin, center):
    ours = run_oxrl("rm", rm_dir, PAIRS, tmp_path, margin=margin, center_coeff=center)
    theirs = trl_reference.trl_rm(
        rm_dir, pair_examples(rm_dir, PAIRS), margin=margin or None, center_rewards_coefficient=center or None
    )
    assert max(abs(s) for s in theirs["scores/chosen"] + theirs["scores/rejected"]) > 0.1  # not a degenerate head
    compare(
        f"rm margin={margin} c={center}",
        ours,
        theirs,
        {
            "loss": "loss",
            "rewards/chosen": "rewards/chosen",
            "rewards/rejected": "rewards/rejected",
            "rewards/accuracies": "accuracy",
            "rewards/margins": "margin",
        },
    )
