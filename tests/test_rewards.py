"""Rewards (the `Reward` interface, `oxrl_core.interfaces`): each `oxrl-rewards` reward on hand-written examples, its
Config, and `oxrl_core.scoring.rewards.score_batch`, which turns every reward failure into a counted 0."""

from __future__ import annotations

import math
import time

import pytest
from pydantic import ValidationError

from oxrl_core.interfaces import Reward
from oxrl_core.scoring.rewards import score_batch

REWARDS = {"math", "gsm8k", "format", "reasoning", "exact_match", "numeric", "arith"}


def reward(name: str, **config) -> Reward:
    from oxrl_core.plugins import discover

    cls = discover().load("reward", name)
    assert issubclass(cls, Reward) and cls.name == name
    return cls(cls.Config(**config))


def scores(r: Reward, completions: list[str], answers: list[str]) -> list[float]:
    """Through score_batch, as a loop would; also checks nothing was counted as a failure."""
    examples = [{"prompt": "q", "answer": a} for a in answers]
    values, metrics = score_batch(r, ["q"] * len(completions), completions, examples)
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0, metrics
    return values


# --------------------------------------------------------------------------------------------
# discovery
# --------------------------------------------------------------------------------------------


def test_every_reward_is_discovered_from_oxrl_rewards():
    from oxrl_core.plugins import discover

    registry = discover()
    rows = {r["name"]: r for r in registry.rows() if r["kind"] == "reward"}
    assert REWARDS <= set(rows), rows
    for name in REWARDS:
        assert rows[name]["package"] == "oxrl-rewards", rows[name]
        assert rows[name]["plugin"] == name  # one entry point per reward
    assert not [e for e in registry.errors if e.package == "oxrl-rewards"], registry.errors


# --------------------------------------------------------------------------------------------
# each reward
# --------------------------------------------------------------------------------------------


def test_math_latex_equivalents_and_boxed_extraction():
    r = reward("math")
    completions = [
        r"So the result is \boxed{0.5}.",  # \frac{1}{2} == 0.5
        r"First \boxed{3}, no wait: \boxed{\frac12}",  # the last \boxed counts
        r"First \boxed{\frac{1}{2}}, then \boxed{3}",  # ... in both directions
        "The final answer is 1/2",  # no \boxed: math-verify's own extraction
        r"\boxed{0.6}",
        "I have no idea",
        "",
    ]
    assert scores(r, completions, [r"\frac{1}{2}"] * len(completions)) == [1, 1, 0, 1, 0, 0, 0]
    assert scores(r, [r"$\boxed{1+x^2}$", r"\boxed{x^2-1}"], ["$x^2+1$", "$x^2+1$"]) == [1, 0]
    assert scores(r, [r"\boxed{1234}", r"\boxed{72}"], ["Natalia sold... #### 1,234", "#### 72"]) == [1, 1]


def test_gsm8k_hash_answers_commas_and_dollars():
    r = reward("gsm8k")
    gold = "She sells 1,000 + 234 = <<1000+234=1234>>1,234 eggs.\n#### 1,234"
    completions = [
        "Total is 1000 + 234.\n#### 1,234",
        "#### $1234.00",
        "so 12 then 1234",  # no ####: the last number
        "1234 eggs, minus 2 = 1232",  # the last number is wrong
        "#### 1234 (and not 7)",  # after ####: the first number
        "#### 1233",
        "no numbers here",
    ]
    assert scores(r, completions, [gold] * len(completions)) == [1, 1, 1, 0, 1, 0, 0]
    assert scores(r, ["the answer is 72.0", "-3", "#### 0.5"], ["72", "#### -3", "0.50"]) == [1, 1, 1]


def test_format_requires_think_then_answer_and_nothing_else():
    r = reward("format")
    completions = [
        "<think>2+2 is 4</think><answer>4</answer>",
        "  <think>\nmulti\nline\n</think>\n\n<answer> 4 </answer>\n",
        "<think></think><answer></answer>",
        "Sure! <think>x</think><answer>4</answer>",  # text before
        "<think>x</think><answer>4</answer> done",  # text after
        "<think>x</think> and <answer>4</answer>",  # text between
        "<answer>4</answer><think>x</think>",  # wrong order
        "<think>x</think>",  # no answer
        "<think>x</think><answer>4</answer><answer>5</answer>",  # two answers
        "<think>a</think>b</think><answer>4</answer>",  # a stray closing tag
        "<think>x<answer>4</answer>",  # unclosed think
        "4",
    ]
    assert scores(r, completions, ["4"] * len(completions)) == [1, 1, 1] + [0] * 9


def test_reasoning_combines_format_and_correctness_with_configurable_weights():
    completions = [
        r"<think>half</think><answer>\frac{1}{2}</answer>",  # well-formed, correct
        "<think>half</think><answer>0.7</answer>",  # well-formed, wrong
        "Answer: <answer>0.5</answer>",  # malformed, correct
        r"<think>x</think> \boxed{0.5}",  # no <answer>: correctness 0, format 0
    ]
    answers = ["0.5"] * 4
    got = scores(reward("reasoning"), completions, answers)
    assert got == pytest.approx([1.0, 0.1, 0.9, 0.0])
    got = scores(reward("reasoning", format_weight=0.5, correctness_weight=1.0), completions, answers)
    assert got == pytest.approx([1.5, 0.5, 1.0, 0.0])


def test_exact_match_normalises_whitespace_case_and_trailing_period():
    completions = ["  Paris.  ", "<think>hmm</think><answer> new   york </answer>", "Lyon", "paris is it"]
    answers = ["paris", "New York", "Paris", "Paris"]
    assert scores(reward("exact_match"), completions, answers) == [1, 1, 0, 0]
    assert scores(reward("exact_match", case_sensitive=True), completions, answers) == [0, 0, 0, 0]
    assert scores(reward("exact_match", case_sensitive=True), ["Paris."], ["Paris"]) == [1]


def test_numeric_first_or_last_number_within_tolerance():
    completions = ["3 apples and 5 pears: 8", "<answer>$1,000.001</answer> (not 7)", "none", "-2.5"]
    answers = ["8", "1000", "3", "-2.5"]
    assert scores(reward("numeric"), completions, answers) == [1, 0, 0, 1]
    assert scores(reward("numeric", tolerance=0.01), completions, answers) == [1, 1, 0, 1]
    assert scores(reward("numeric", pick="first"), completions, ["3", "1000", "3", "-2.5"]) == [1, 0, 0, 1]


def test_arith_is_the_builtin_task_check():
    from oxrl_core.data.task import is_correct

    completions = ["12", " 12 and then 13", "13", "x", "-4"]
    answers = ["12", "12", "12", "12", "-4"]
    assert scores(reward("arith"), completions, answers) == [
        float(is_correct(c, a)) for c, a in zip(completions, answers)
    ]
    assert scores(reward("arith"), completions, answers) == [1, 1, 0, 0, 1]


@pytest.mark.parametrize("name", sorted(REWARDS - {"format"}))
def test_missing_answer_scores_zero_and_is_counted(name):
    r = reward(name)
    good = {"arith": "7", "exact_match": "7", "numeric": "7", "gsm8k": "#### 7", "math": "7", "reasoning": "7"}[name]
    completion = "<think>x</think><answer>7</answer>" if name == "reasoning" else "7"
    examples = [{"prompt": "q", "answer": good}, {"prompt": "q"}, {"prompt": "q", "answer": good}]
    with pytest.raises(ValueError, match=f"reward '{name}' needs the field 'answer'"):
        r.score(["q"], [completion], [{"prompt": "q"}])
    values, metrics = score_batch(r, ["q"] * 3, [completion] * 3, examples)
    assert values == [1.0, 0.0, 1.0]  # only the row without `answer` is lost
    assert metrics["reward/errors"] == 1 and metrics["reward/timeouts"] == 0


def test_malformed_gold_answer_is_an_error_naming_the_field():
    values, metrics = score_batch(reward("gsm8k"), ["q"], ["#### 5"], [{"answer": "five"}])
    assert values == [0.0] and metrics["reward/errors"] == 1
    with pytest.raises(ValueError, match="'answer'"):
        reward("numeric").score(["q"], ["5"], [{"answer": "five"}])


def test_config_rejects_unknown_keys_and_bad_values():
    from oxrl_core.plugins import discover

    registry = discover()
    for name in REWARDS:
        cls = registry.load("reward", name)
        with pytest.raises(ValidationError, match="formt_weight"):
            cls.Config(formt_weight=1.0)
    with pytest.raises(ValidationError, match="tolerance"):
        registry.load("reward", "numeric").Config(tolerance=-1)
    with pytest.raises(ValidationError, match="pick"):
        registry.load("reward", "numeric").Config(pick="middle")


# --------------------------------------------------------------------------------------------
# score_batch: failures score 0, are counted, and never stop the run
# --------------------------------------------------------------------------------------------


class Constant(Reward):
    name = "constant"

    def score(self, prompts, completions, examples):
        return [float(len(c)) for c in completions]


class Raises(Reward):
    name = "raises"

    def score(self, prompts, completions, examples):
        raise RuntimeError("verifier exploded")


class RaisesOnBadRows(Reward):
    name = "picky"

    def score(self, prompts, completions, examples):
        if any(c == "bad" for c in completions):
            raise RuntimeError("bad row")
        return [1.0] * len(completions)


class Sleeps(Reward):
    name = "sleeps"
    timeout_s = 0.05

    def score(self, prompts, completions, examples):
        time.sleep(2.0)
        return [1.0] * len(completions)


class Returns(Reward):
    name = "returns"

    def __init__(self, values):
        super().__init__()
        self.values = values

    def score(self, prompts, completions, examples):
        return self.values


def batch(n: int) -> tuple[list, list, list]:
    return ["p"] * n, ["x" * (i + 1) for i in range(n)], [{"answer": "1"}] * n


def test_score_batch_passes_good_scores_through_with_mean_and_std():
    values, metrics = score_batch(Constant(), *batch(4))
    assert values == [1.0, 2.0, 3.0, 4.0]
    assert metrics == {
        "reward/mean": 2.5,
        "reward/std": pytest.approx(math.sqrt(1.25)),
        "reward/errors": 0.0,
        "reward/timeouts": 0.0,
        "reward/error_share": 0.0,
    }


def test_score_batch_counts_an_exception_as_errors():
    values, metrics = score_batch(Raises(), *batch(3))
    assert values == [0.0, 0.0, 0.0]
    assert metrics["reward/errors"] == 3 and metrics["reward/timeouts"] == 0
    assert metrics["reward/mean"] == 0 and metrics["reward/std"] == 0


def test_score_batch_retries_row_by_row_so_one_bad_row_costs_only_itself():
    values, metrics = score_batch(RaisesOnBadRows(), ["p"] * 3, ["ok", "bad", "ok"], [{}] * 3)
    assert values == [1.0, 0.0, 1.0] and metrics["reward/errors"] == 1


def test_score_batch_stops_waiting_at_timeout_s():
    start = time.monotonic()
    values, metrics = score_batch(Sleeps(), *batch(3))
    assert time.monotonic() - start < 1.0  # did not wait the 2 s the reward sleeps
    assert values == [0.0, 0.0, 0.0]
    assert metrics["reward/timeouts"] == 3 and metrics["reward/errors"] == 0
    # the run goes on: the next batch is scored normally
    assert score_batch(Constant(), *batch(2))[0] == [1.0, 2.0]


@pytest.mark.parametrize(
    "returned, expected, errors",
    [
        ([1.0, float("nan"), 0.5], [1.0, 0.0, 0.5], 1),
        ([float("inf"), -float("inf"), 1], [0.0, 0.0, 1.0], 2),
        ([None, "1.0", True], [0.0, 0.0, 1.0], 2),
        ([1.0, 1.0], [0.0, 0.0, 0.0], 3),  # wrong length: every row
        ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0], 3),
        (None, [0.0, 0.0, 0.0], 3),
        (1.0, [0.0, 0.0, 0.0], 3),
    ],
)
def test_score_batch_non_finite_and_wrong_length_results(returned, expected, errors):
    values, metrics = score_batch(Returns(returned), *batch(3))
    assert values == expected
    assert metrics["reward/errors"] == errors and metrics["reward/timeouts"] == 0
    assert all(math.isfinite(v) for v in metrics.values())


def test_score_batch_on_an_empty_batch():
    assert score_batch(Constant(), [], [], []) == (
        [],
        {
            "reward/mean": 0.0,
            "reward/std": 0.0,
            "reward/errors": 0.0,
            "reward/timeouts": 0.0,
            "reward/error_share": 0.0,
        },
    )
