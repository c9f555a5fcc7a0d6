"""The built-in verifiable task: small-integer arithmetic, and multi-digit products with a calculator.

Rows look like the real datasets oxRL trains on: prompt-response for SFT
(`{"prompt", "response", "answer"}`), prompt-only for RL (the `answer` field
goes to the reward), preference pairs (`chosen` = the right answer, `rejected` =
a near miss) and unpaired KTO rows (`completion` right or wrong, `label`). Train
and eval problems are disjoint (a, b, op) triples, generated from a fixed seed,
so the split is the same everywhere.
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Literal

from oxrl_core.answers import first_integer_equals

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


def is_correct(completion: str, answer: str) -> bool:
    """The completion is correct when the first integer it contains equals the answer."""
    return first_integer_equals(completion, answer)


# ----------------------------------------------------------------------------- products, with a calculator
#: two-digit × two-digit products: answers the tiny model cannot work out in its head, one tool call can
PRODUCT_OPERANDS = range(10, 100)


def _product_problems() -> list[tuple[int, int]]:
    problems = [(a, b) for a in PRODUCT_OPERANDS for b in PRODUCT_OPERANDS]
    random.Random(4321).shuffle(problems)
    return problems


def product_rows(split: str) -> list[dict]:
    """`train` or `eval` rows of the products task: prompt, response, answer, and ``messages``, a tool-use
    transcript (the question, a ``calc`` call, its result, the answer) for a supervised warm start."""
    problems = _product_problems()
    if split == "eval":
        chosen = problems[:EVAL_SIZE]
    elif split == "train":
        chosen = problems[EVAL_SIZE:]
    else:
        raise ValueError(f"unknown split {split!r} (expected 'train' or 'eval')")
    out = []
    for a, b in chosen:
        question, answer, expr = f"What is {a}*{b}?", str(a * b), f"{a}*{b}"
        call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calc", "content": answer},
            {"role": "assistant", "content": answer},
        ]
        out.append({"prompt": question, "response": answer, "answer": answer, "messages": messages})
    return out


#: the operators `calculate` evaluates
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expr: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / // % and parentheses (no names, no
    calls, no powers: nothing a model could use to hang or escape); an integral result is printed as one."""

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r}")

    if len(expr) > 200:
        raise ValueError("expression longer than 200 characters")
    result = value(ast.parse(expr.strip(), mode="eval"))
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


def _text_row(row: dict) -> dict:
    return {**row, "text": f"{row['prompt']} {row['response']}"}


from oxrl_core.interfaces import Dataset, StrictModel, ToolEnvironment  # noqa: E402  (below the task: maths first)


class ArithDataset(Dataset):
    """`arith`: the built-in task as a dataset plugin (prompt, response, answer, text, chosen/rejected,
    completion/label); with ``task: products``, two-digit products (prompt, response, answer, and a
    tool-use transcript in ``messages``) for the `calculator` environment."""

    name = "arith"
    formats = ("prompt", "prompt_response", "text", "preference", "unpaired")

    class Config(StrictModel):
        task: Literal["sums", "products"] = "sums"

    def rows(self, split: str) -> list[dict]:
        if self.config.task == "products":
            return product_rows(split)
        return [_text_row(r) for r in rows(split)]

    def verify(self, completion: str, row: dict) -> bool | None:
        return is_correct(completion, row["answer"])


class CalculatorEnv(ToolEnvironment):
    """`calculator`: a tools-style environment with one tool, ``calc``; the final answer is scored by
    ``reward.name`` (the dataset's own check by default). On the built-in model it trains on two-digit
    products, which the model cannot work out in its head but one call can."""

    name = "calculator"
    tiny_defaults = {
        "data": {"train": [{"source": "arith", "task": "products"}]},  # a list: replaced, never merged
        # sampled at T = 0.6: at T = 1 the tiny character-level model garbles most of its 67-character calls
        "rollout": {"max_new_tokens": 80, "temperature": 0.6},
        "train": {"lr": 1e-4, "max_steps": 20},
        "env": {"max_turns": 3, "max_tokens": 224},
    }

    def calc(self, expr: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expr: numbers with + - * / // % and parentheses, e.g. "12*(3+4)"
        """
        try:
            return calculate(expr)
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as exc:
            return f"error: {exc}"
