"""One entry point per reward. Each registers an import path, so discovery never imports math-verify.

The files are `math_answer.py` and `tag_format.py`, not `math.py`/`format.py`: a module named
like a standard-library one shadows it whenever this directory is the working directory.
"""

from oxrl_core import hookimpl


class _Reward:
    def __init__(self, name: str, target: str):
        self.name, self.target = name, target

    @hookimpl
    def register_rewards(self, register):
        register(self.name, self.target)


math = _Reward("math", "oxrl_rewards.math_answer:MathReward")
gsm8k = _Reward("gsm8k", "oxrl_rewards.gsm8k:GSM8KReward")
format = _Reward("format", "oxrl_rewards.tag_format:FormatReward")  # noqa: A001 - the entry point's name
reasoning = _Reward("reasoning", "oxrl_rewards.reasoning:ReasoningReward")
exact_match = _Reward("exact_match", "oxrl_rewards.exact_match:ExactMatchReward")
numeric = _Reward("numeric", "oxrl_rewards.numeric:NumericReward")
arith = _Reward("arith", "oxrl_rewards.arith:ArithReward")
