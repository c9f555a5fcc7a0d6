"""One entry point per reward. Each registers an import path, so discovery never imports math-verify
(nor torch/transformers, which `reward_model` and `llm_judge` load on first use).

The files are `math_answer.py`, `tag_format.py` and `code_exec.py`, not `math.py`/`format.py`/
`code.py`: a module named like a standard-library one shadows it whenever this directory is the
working directory.
"""

from oxrl_core import hookimpl


@hookimpl
def register_rewards(register):
    register("math", "oxrl_rewards.math_answer:MathReward")
    register("gsm8k", "oxrl_rewards.gsm8k:GSM8KReward")
    register("format", "oxrl_rewards.tag_format:FormatReward")
    register("reasoning", "oxrl_rewards.reasoning:ReasoningReward")
    register("exact_match", "oxrl_rewards.exact_match:ExactMatchReward")
    register("numeric", "oxrl_rewards.numeric:NumericReward")
    register("arith", "oxrl_rewards.arith:ArithReward")
    register("reward_model", "oxrl_rewards.reward_model:RewardModelReward")
    register("llm_judge", "oxrl_rewards.llm_judge:LLMJudgeReward")
    register("code", "oxrl_rewards.code_exec:CodeReward")
