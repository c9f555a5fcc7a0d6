"""Final answers: GSM8K's ``#### N``, MATH's last ``\\boxed{…}``, and the checks behind ``verify``.

- `gsm8k_answer`: the text after the last ``####`` with thousands commas removed
  (``"…\\n#### 1,234"`` -> ``"1234"``); None when there is no ``####`` or no single number after it.
- `completion_number`: the first number after a completion's last ``####`` when it has one, else
  the last number anywhere in it; ``$`` and thousands commas are dropped (``$1,234.00`` = 1234).
- `last_boxed`: the content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), braces balanced, so
  ``\\boxed{\\frac{1}{9}}`` gives ``\\frac{1}{9}``; ``\\boxed 5`` (no braces) gives ``5``.
- `math_equivalent`: math-verify, as oxrl-rewards' ``math`` reward does it: the gold answer is
  parsed as LaTeX (``$gold$`` first), the completion from its last ``\\boxed`` when it has one
  (else math-verify's own extraction), and ``verify(gold, completion)`` decides
  (``\\frac{1}{9}`` = ``1/9``, ``7\\sqrt{5}`` = ``\\sqrt{245}``).

math-verify times itself out with ``signal.alarm``, which only works on the main thread; off it
(the core scores rewards in worker threads, with its own time limit) its timeouts are switched off,
as its documentation asks.
"""

from __future__ import annotations

import math
import re
import threading

# An optional sign, an optional $, digits with optional thousands commas, an optional decimal part.
NUMBER = re.compile(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\.\d+")
BOX_COMMANDS = ("\\boxed", "\\fbox")


def to_number(text: str) -> float | None:
    """``"$1,234.50"`` -> 1234.5; None when ``text`` is not one number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def gsm8k_answer(solution: str) -> str | None:
    """The final number of a GSM8K answer text, commas removed, as a string."""
    if "####" not in solution:
        return None
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return final if to_number(final) is not None else None


def completion_number(completion: str) -> float | None:
    """The number a completion gives as its answer (see the module docstring), or None."""
    tail = completion.rsplit("####", 1)[1] if "####" in completion else completion
    found = [n for n in (to_number(m.group()) for m in NUMBER.finditer(tail)) if n is not None]
    if not found:
        return None
    return found[0] if "####" in completion else found[-1]


def numbers_equal(completion: str, gold: str) -> bool:
    predicted, expected = completion_number(completion), to_number(gold)
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


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse_gold(gold: str) -> list:
    from math_verify import parse

    attempts = [gold] if ("$" in gold or "\\boxed" in gold) else [f"${gold}$", gold]
    for text in attempts:
        parsed = parse(text, parsing_timeout=_timeout())
        if parsed:
            return parsed
    return []


def _parse_completion(completion: str) -> list:
    from math_verify import parse

    start = max(completion.rfind(c) for c in BOX_COMMANDS)
    return parse(completion[start:] if start >= 0 else completion, parsing_timeout=_timeout())


def math_equivalent(completion: str, gold: str) -> bool:
    """Whether the completion's final answer equals ``gold`` according to math-verify."""
    from math_verify import verify

    gold_parsed, answer_parsed = _parse_gold(gold), _parse_completion(completion)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=_timeout()))
