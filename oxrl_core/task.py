"""The built-in verifiable task: small-integer arithmetic.

Rows look like the real datasets oxRL trains on: prompt-response for SFT
(`{"prompt", "response", "answer"}`), prompt-only for RL (the `answer` field
goes to the reward), preference pairs (`chosen` = the right answer, `rejected` =
a near miss) and unpaired KTO rows (`completion` right or wrong, `label`). Train
and eval problems are disjoint (a, b, op) triples, generated from a fixed seed,
so the split is the same everywhere.
"""

from __future__ import annotations

import random
import re

MAX_OPERAND = 19
EVAL_SIZE = 100
TRAIN_SIZE = 100000


def _all_problems() -> list[tuple[int, str, int]]:
    problems = [(a, "+", b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    problems += [(a, "-", b) for a in range(MAX_OPERAND + 1) for b in range(a + 1)]  # answers >= 0
    random.Random(1234).shuffle(problems)
    return problems


NEAR_MISSES = (-10, -2, -1, 1, 2, 10)


def _row(a: int, op: str, b: int) -> dict:
    answer = a + b if op == "+" else a - b
    rng = random.Random(f"{a}{op}{b}")  # the wrong answer and the KTO label are fixed per problem
    wrong = answer + rng.choice(NEAR_MISSES)
    label = rng.random() < 0.5
    return {
        "prompt": f"What is {a}{op}{b}?",
        "response": str(answer),
        "answer": str(answer),
        "chosen": str(answer),
        "rejected": str(wrong),
        "completion": str(answer) if label else str(wrong),
        "label": label,
    }


def rows(split: str) -> list[dict]:
    """`train` or `eval` rows of the arithmetic task (deterministic)."""
    problems = _all_problems()
    if split == "eval":
        chosen = problems[:EVAL_SIZE]
    elif split == "train":
        chosen = problems[EVAL_SIZE : EVAL_SIZE + TRAIN_SIZE]
    else:
        raise ValueError(f"unknown split {split!r} (expected 'train' or 'eval')")
    return [_row(*p) for p in chosen]


_INT = re.compile(r"-?\d+")


def is_correct(completion: str, answer: str) -> bool:
    """The completion is correct when the first integer it contains equals the answer."""
    match = _INT.search(completion)
    return match is not None and match.group() == str(answer).strip()


def _text_row(row: dict) -> dict:
    return {**row, "text": f"{row['prompt']} {row['response']}"}


from oxrl_core.interfaces import Dataset  # noqa: E402  (kept below the task so the maths reads first)


class ArithDataset(Dataset):
    """`arith`: the built-in task as a dataset plugin (prompt, response, answer, text, chosen/rejected, completion/label)."""

    name = "arith"
    formats = ("prompt", "prompt_response", "text", "preference", "unpaired")

    def rows(self, split: str) -> list[dict]:
        return [_text_row(r) for r in rows(split)]

    def verify(self, completion: str, row: dict) -> bool | None:
        return is_correct(completion, row["answer"])
