"""Model-based rewards of `oxrl-rewards`: `reward_model` (a trained sequence-classification RM) and
`llm_judge` (an LLM grading with a rubric). Tiny models built here, so the file runs offline in seconds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from oxrl_core.errors import OxrlError
from oxrl_core.scoring.rewards import build_reward, score_batch

PROMPTS = [
    "What is 2+3?",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    "Hi",
]
COMPLETIONS = ["5", "A colour that is quite long to make this the longest row of the batch: blue.", ""]


def make_rm(path: Path, pad_is_eos: bool = False, seed: int = 0) -> Path:
    """A tiny LlamaForSequenceClassification (num_labels=1) + the character tokenizer, saved to ``path``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from oxrl_core.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    if pad_is_eos:  # the common fallback that breaks transformers' own pooling
        tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores well away from 0, so differences show
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return make_rm(tmp_path_factory.mktemp("rm") / "rm")


@pytest.fixture(scope="module")
def rm_pad_eos_dir(tmp_path_factory) -> Path:
    return make_rm(tmp_path_factory.mktemp("rm") / "rm-pad-eos", pad_is_eos=True)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    from oxrl_core.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("judge") / "judge", hidden_size=64, num_layers=2, seed=0)


def rm_reward(path: Path, **options):
    from oxrl_rewards.reward_model import RewardModelReward

    return RewardModelReward(RewardModelReward.Config(model=str(path), device="cpu", **options))


def run_config(*overrides: str):
    from oxrl_core.config import load_run_config

    return load_run_config(overrides=list(overrides), algorithm="sft")


def test_both_are_discovered_one_entry_point_each():
    import sys

    from oxrl_core.plugins import discover

    rows = {r["name"]: r for r in discover().rows() if r["kind"] == "reward"}
    for name in ("reward_model", "llm_judge"):
        assert rows[name]["package"] == "oxrl-rewards" and rows[name]["plugin"] == name, rows.get(name)
    cls = discover().load("reward", "llm_judge")
    assert cls.name == "llm_judge" and "oxrl_rewards.llm_judge" in sys.modules


# --------------------------------------------------------------------------------------------
# reward_model
# --------------------------------------------------------------------------------------------


def hand_score(path: Path, prompt, completion: str) -> float:
    """The head's logit at the last token (the EOS) of the unpadded row, computed by hand."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from oxrl_core.data.encode import encode_completion, encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = encode_prompt(tokenizer, prompt) + encode_completion(tokenizer, completion)
    assert ids[-1] == tokenizer.eos_token_id
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state  # (1, T, H)
        return float(hidden[0, -1] @ model.score.weight[0])


@pytest.mark.parametrize("fixture", ["rm_dir", "rm_pad_eos_dir"])
def test_reward_model_is_the_logit_at_the_eos_whatever_the_padding(fixture, request):
    path = request.getfixturevalue(fixture)
    reward = rm_reward(path, batch_size=8)
    batched = reward.score(PROMPTS, COMPLETIONS, [{}] * 3)
    assert all(isinstance(s, float) and math.isfinite(s) for s in batched)
    assert batched == reward.score(PROMPTS, COMPLETIONS, [{}] * 3)  # deterministic
    alone = [reward.score([p], [c], [{}])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert batched == pytest.approx(alone, abs=1e-5)  # a short row next to longer ones == alone
    assert rm_reward(path, batch_size=1).score(PROMPTS, COMPLETIONS, [{}] * 3) == pytest.approx(alone, abs=1e-5)
    by_hand = [hand_score(path, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert batched == pytest.approx(by_hand, abs=1e-5)
    assert len(set(batched)) == 3  # different rows, different scores
    if fixture == "rm_pad_eos_dir":  # transformers' own pooling skips the EOS when pad == EOS; ours does not
        rows = [reward.encode(p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
        width = max(map(len, rows))
        input_ids = torch.tensor([r + [reward.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        with torch.no_grad():
            theirs = reward.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].tolist()
        assert theirs != pytest.approx(by_hand, abs=1e-3)


def test_reward_model_through_build_reward_and_score_batch(rm_dir):
    from oxrl_core.plugins import registry
    from oxrl_rewards.reward_model import RewardModelReward

    config = run_config(
        "reward.name=reward_model", f"reward.model={rm_dir}", "reward.batch_size=2", "reward.device=cpu"
    )
    reward = build_reward(config, registry())
    assert isinstance(reward, RewardModelReward) and reward.name == "reward_model" and reward.timeout_s == 300
    assert reward.config.batch_size == 2 and reward.config.max_length == 1024
    values, metrics = score_batch(reward, PROMPTS, COMPLETIONS, [{}] * 3)
    assert values == pytest.approx(rm_reward(rm_dir).score(PROMPTS, COMPLETIONS, [{}] * 3), abs=1e-5)
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0


def test_reward_model_keeps_the_end_of_a_row_longer_than_max_length(rm_dir):
    reward = rm_reward(rm_dir, max_length=8)
    ids = reward.encode("a long prompt that will be cut", "the end")
    assert len(ids) == 8 and ids[-1] == reward.tokenizer.eos_token_id
    assert math.isfinite(reward.score(["a long prompt that will be cut"], ["the end"], [{}])[0])


def test_reward_model_config_errors_name_the_field(tmp_path, rm_dir, judge_dir):
    from oxrl_core.plugins import registry

    missing = tmp_path / "no-such-rm"
    with pytest.raises(OxrlError, match=r"reward\.model.*not found.*no-such-rm"):
        build_reward(run_config("reward.name=reward_model", f"reward.model={missing}"), registry())
    with pytest.raises(OxrlError, match=r"reward\.modle: unknown field \(did you mean 'model'\?\)"):
        build_reward(
            run_config("reward.name=reward_model", f"reward.model={rm_dir}", f"reward.modle={rm_dir}"), registry()
        )
    with pytest.raises(OxrlError, match=r"reward\.model: Field required"):
        build_reward(run_config("reward.name=reward_model"), registry())
    with pytest.raises(OxrlError, match=r"reward\.batch_size"):
        build_reward(
            run_config("reward.name=reward_model", f"reward.model={rm_dir}", "reward.batch_size=0"), registry()
        )
    # a causal LM is not a reward model: its head would be random
    with pytest.raises(OxrlError, match=r"reward\.model: .* has 2 output labels"):
        rm_reward(judge_dir)
    # ... nor is one whose config claims one label: its head is missing from the checkpoint
    from transformers import AutoConfig

    from oxrl_core.models.tiny import save_tiny_model

    lm = save_tiny_model(tmp_path / "lm", hidden_size=64, num_layers=1)
    config = AutoConfig.from_pretrained(lm)
    config.num_labels = 1
    config.save_pretrained(lm)
    with pytest.raises(OxrlError, match=r"reward\.model: .* not a trained reward model: its head \(score\.weight\)"):
        rm_reward(lm)


# --------------------------------------------------------------------------------------------
# llm_judge
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge(judge_dir):
    from oxrl_rewards.llm_judge import LLMJudgeReward

    return LLMJudgeReward(LLMJudgeReward.Config(model=str(judge_dir), device="cpu", max_new_tokens=8))


def test_judge_parses_the_score_and_counts_what_it_cannot_parse(judge, monkeypatch):
    answers = ["Score: 7", "score:10", "no idea", "Score: 12", "Score: -3", "I think 2... Score: 6.5", "SCORE:  0"]
    seen: list[str] = []

    def fake_generate(judge_prompts: list[str]) -> list[str]:
        seen.extend(judge_prompts)
        return answers[: len(judge_prompts)]

    monkeypatch.setattr(judge, "generate", fake_generate)
    n = len(answers)
    before = judge.unparsable
    assert judge.score(["q"] * n, ["a"] * n, [{}] * n) == [0.7, 1.0, None, 1.0, 0.0, 0.65, 0.0]
    assert judge.unparsable == before + 1

    values, metrics = score_batch(judge, ["q"] * 3, ["a"] * 3, [{}] * 3)
    assert values == [0.7, 1.0, 0.0]  # the unparsable row scores 0 ...
    assert metrics["reward/errors"] == 1 and metrics["reward/timeouts"] == 0  # ... and is counted
    assert judge.unparsable == before + 2

    # the template is filled in once: the prompt, chat messages as "role: content" lines, the completion
    seen.clear()
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say {completion}"}]
    judge.score([messages], ["hello"], [{}])
    assert "system: Be kind.\nuser: Say {completion}" in seen[0] and "[Response]\nhello" in seen[0]


def test_judge_template_and_pattern_are_validated():
    from pydantic import ValidationError

    from oxrl_core.config import validate_reward_section
    from oxrl_rewards.llm_judge import LLMJudgeReward

    Config = LLMJudgeReward.Config
    assert Config(template='Q: {prompt} A: {completion} {"json": 1}').template.startswith("Q:")
    with pytest.raises(ValidationError, match=r"(?s)template.*\{completion\}"):
        Config(template="Rate this: {prompt}")
    with pytest.raises(ValidationError, match="pattern"):
        Config(pattern="Score: \\d+")  # no group
    with pytest.raises(ValidationError, match="pattern"):
        Config(pattern="Score: (\\d+")
    with pytest.raises(ValidationError, match="scale"):
        Config(scale=0)
    config = run_config("reward.name=llm_judge", "reward.template=Just {prompt}")
    with pytest.raises(OxrlError, match=r"reward\.template: .*\{completion\}"):
        validate_reward_section(config, Config)


def test_judge_runs_the_tiny_model_through_score_batch(judge):
    prompts = ["What is 2+3?", [{"role": "user", "content": "Name a colour."}], "Say hi"]
    completions = ["5", "blue", "hi"]
    before = judge.unparsable
    values, metrics = score_batch(judge, prompts, completions, [{}] * 3)
    assert len(values) == 3 and all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values)
    assert len(judge.last_answers) == 3 and all(isinstance(a, str) for a in judge.last_answers)
    # an untrained judge writes noise: whatever it could not parse is exactly what was counted
    assert metrics["reward/errors"] == judge.unparsable - before
    assert metrics["reward/timeouts"] == 0
    # greedy: the same answers again
    answers = list(judge.last_answers)
    assert score_batch(judge, prompts, completions, [{}] * 3)[0] == values and judge.last_answers == answers


def test_judge_defaults_to_the_builtin_tiny_model_through_build_reward():
    from oxrl_core.plugins import registry
    from oxrl_rewards.llm_judge import LLMJudgeReward

    reward = build_reward(
        run_config("reward.name=llm_judge", "reward.max_new_tokens=4", "reward.device=cpu"), registry()
    )
    assert isinstance(reward, LLMJudgeReward) and reward.config.model == "" and reward.timeout_s == 300
    values, metrics = score_batch(reward, ["q"], ["a"], [{}])
    assert 0.0 <= values[0] <= 1.0 and metrics["reward/timeouts"] == 0
