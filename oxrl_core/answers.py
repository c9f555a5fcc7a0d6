"""Final answers read out of text: the one copy that rewards and datasets share (``from oxrl_core import ...``).

- `to_number`: ``"$1,234.50"`` -> 1234.5, ``"72."`` -> 72.0; None when the text is not one number
  (thousands commas, ``$``, spaces and a trailing ``.`` are dropped).
- `numbers`: every number in a text, in order (`NUMBER`: an optional sign and ``$``, digits with optional
  thousands commas, an optional decimal part).
- `answer_tag`: the content of the last ``<answer>…</answer>``.
- `gsm8k_answer`: the text after a GSM8K solution's last ``####``, commas removed (``"…\\n#### 1,234"`` ->
  ``"1234"``); None when there is no ``####`` or no single number after it.
- `completion_number`: the number a completion gives as its answer: the first number after its last
  ``####`` when it has one, else its last number anywhere; None when there is none.
- `numbers_equal`: `completion_number` equals the gold number (absolute tolerance 1e-6).
- `last_boxed`: the content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), braces balanced, so
  ``\\boxed{\\frac{1}{9}}`` gives ``\\frac{1}{9}``; ``\\boxed 5`` (no braces) gives ``5``.
- `first_integer_equals`: the first integer in the completion is the answer (the built-in arithmetic task's rule).
- `math_equivalent`: math-verify's equivalence of the completion's final answer and the gold one (needs the
  ``math-verify`` package, which oxrl-rewards and oxrl-datasets depend on): the gold answer after any ``####`` is
  parsed as LaTeX (``$gold$`` first), the completion from its last ``\\boxed`` when it has one (else
  math-verify's own extraction), and ``verify(gold, completion)`` decides (``\\frac{1}{9}`` = ``1/9``).
  math-verify times itself out with ``signal.alarm``, which only works on the main thread; off it (the core
  scores rewards in worker threads, with its own time limit) its timeouts are switched off, as its
  documentation asks.

Layer 0: nothing of oxRL, no torch; math-verify is imported on the first `math_equivalent` call.
"""

from __future__ import annotations

import math
import re
import threading

__all__ = [
    "NUMBER",
    "to_number",
    "numbers",
    "answer_tag",
    "gsm8k_answer",
    "completion_number",
    "numbers_equal",
    "last_boxed",
    "first_integer_equals",
    "math_equivalent",
]

#: an optional sign, an optional $, digits with optional thousands commas, an optional decimal part
NUMBER = re.compile(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\.\d+")
BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INT = re.compile(r"-?\d+")


def to_number(text: str) -> float | None:
    """``"$1,234.50"`` -> 1234.5; ``"72.0"`` -> 72.0; None when ``text`` is not one number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def numbers(text: str) -> list[float]:
    """Every number in ``text``, in order (commas, $ and a trailing ".0" handled by `to_number`)."""
    return [n for n in (to_number(m.group()) for m in NUMBER.finditer(text)) if n is not None]


def answer_tag(completion: str) -> str | None:
    """The content of the last ``<answer>…</answer>`` in the completion, or None."""
    found = _ANSWER_TAG.findall(completion)
    return found[-1] if found else None


def gsm8k_answer(solution: str) -> str | None:
    """The final number of a GSM8K answer text (after its last ``####``), commas removed, as a string; or None."""
    if "####" not in solution:
        return None
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return final if to_number(final) is not None else None


def completion_number(completion: str) -> float | None:
    """The first number after the completion's last ``####`` when it has one, else its last number; or None."""
    if "####" in completion:
        after = numbers(completion.rsplit("####", 1)[1])
        return after[0] if after else None
    found = numbers(completion)
    return found[-1] if found else None


def numbers_equal(completion: str, gold: str | float) -> bool:
    """`completion_number` equals ``gold`` (a number or its text) within 1e-6."""
    predicted = completion_number(completion)
    expected = float(gold) if isinstance(gold, (int, float)) else to_number(gold)
    return (
        predicted is not None and expected is not None and math.isclose(predicted, expected, rel_tol=0.0, abs_tol=1e-6)
    )


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}``/``\\fbox{…}`` of ``text``, or None."""
    start, command = max((text.rfind(c), c) for c in BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command) :]
    body = rest.lstrip(" ")
    if not body.startswith("{"):  # "\boxed 5": the token after the space
        token = re.match(r"[^\s${}]+", body) if len(body) < len(rest) else None
        return token.group() if token else None
    depth = 0
    for j, char in enumerate(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return body[1:j]
    return None  # unbalanced braces


def first_integer_equals(completion: str, answer: str | int) -> bool:
    """The first integer the completion contains equals ``answer``."""
    match = _INT.search(completion)
    return match is not None and match.group() == str(answer).strip()


# ----------------------------------------------------------------------------- math-verify


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def _math_verify():
    try:
        import math_verify  # lazy: an optional dependency (of oxrl-rewards and oxrl-datasets), heavy to import
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "oxrl_core.math_equivalent needs the math-verify package: pip install 'math-verify>=0.7'"
        ) from exc
    return math_verify


def parse_gold(gold: str) -> list:
    """math-verify's parse of a gold answer: the part after any ``####``, as LaTeX (``$gold$`` first)."""
    parse = _math_verify().parse
    gold = gold.split("####")[-1].strip()
    attempts = [gold] if ("$" in gold or "\\boxed" in gold) else [f"${gold}$", gold]
    for text in attempts:
        parsed = parse(text, parsing_timeout=_timeout())
        if parsed:
            return parsed
    return []


def parse_completion(completion: str) -> list:
    """math-verify's parse of a completion's final answer: from its last ``\\boxed`` when it has one."""
    parse = _math_verify().parse
    start = max(completion.rfind(c) for c in BOX_COMMANDS)
    return parse(completion[start:] if start >= 0 else completion, parsing_timeout=_timeout())


def math_equivalent(completion: str, gold: str) -> bool:
    """Whether the completion's final answer equals ``gold`` according to math-verify."""
    gold_parsed, answer_parsed = parse_gold(gold), parse_completion(completion)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(_math_verify().verify(gold_parsed, answer_parsed, timeout_seconds=_timeout()))
