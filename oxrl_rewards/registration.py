"""One entry point per reward. Each registers an import path, so discovery never imports math-verify
(nor torch/transformers, which `reward_model` and `llm_judge` load on first use).

The files are `math_answer.py`, `tag_format.py` and `code_exec.py`, not `math.py`/`format.py`/
`code.py`: a module named like a standard-library one shadows it whenever this directory is the
working directory.
"""

from oxrl_core.hookspecs import Registers

math = Registers("reward", "math", "oxrl_rewards.math_answer:MathReward")
gsm8k = Registers("reward", "gsm8k", "oxrl_rewards.gsm8k:GSM8KReward")
format = Registers("reward", "format", "oxrl_rewards.tag_format:FormatReward")  # noqa: A001 - the entry point's name
reasoning = Registers("reward", "reasoning", "oxrl_rewards.reasoning:ReasoningReward")
exact_match = Registers("reward", "exact_match", "oxrl_rewards.exact_match:ExactMatchReward")
numeric = Registers("reward", "numeric", "oxrl_rewards.numeric:NumericReward")
arith = Registers("reward", "arith", "oxrl_rewards.arith:ArithReward")
reward_model = Registers("reward", "reward_model", "oxrl_rewards.reward_model:RewardModelReward")
llm_judge = Registers("reward", "llm_judge", "oxrl_rewards.llm_judge:LLMJudgeReward")
code = Registers("reward", "code", "oxrl_rewards.code_exec:CodeReward")
