"""`llm_judge`: an LLM grades each completion against a rubric (AI feedback, as in RLAIF).

For each (prompt, completion) the rubric ``template`` is filled in — ``{prompt}`` with the prompt
(a string as is; a list of chat messages as ``role: content`` lines; the judge reads text only, so each
image of an image prompt is shown as an ``<image>`` marker) and ``{completion}`` with the completion's text — and sent to the judge model as one user message through its chat template with
the generation prompt (`oxrl_core.data.encode.encode_prompt`). The judge answers greedily
(temperature 0, ``max_new_tokens``) through the core's ``hf`` rollout backend, on its own copy
of the judge model (``reward.model``; empty = the built-in tiny model).

The answer is searched with ``pattern`` (case-insensitive; its first group is the number; the
last match counts, so a judge may reason before it concludes) and

    reward = clamp(score / scale, 0, 1)

An answer with no match cannot be scored: that row's value is None, which `score_batch` scores
0 and counts in ``reward/errors``; ``self.unparsable`` keeps a running count as well.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from pydantic import Field, field_validator

from oxrl_core import Reward, SamplingParams, StrictModel
from oxrl_rewards.reward_model import Device, resolve_device

DEFAULT_TEMPLATE = """You are a strict and fair judge. Rate how well the response answers the request: \
correct, helpful, clear and complete. 0 means useless or wrong, 10 means perfect.

[Request]
{prompt}

[Response]
{completion}

Reply with one line, "Score: N", where N is an integer from 0 to 10."""

DEFAULT_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"
PLACEHOLDER = re.compile(r"\{(prompt|completion)\}")


def render_prompt(prompt: Any) -> str:
    """A prompt as text for the template: a string as is, chat messages as ``role: content`` lines. The judge
    reads text only: an image is shown as an ``<image>`` marker (a string prompt's own; one per
    ``{"type": "image"}`` part of a message, `oxrl_core.prompt_text`)."""
    from oxrl_core import prompt_text

    prompt = prompt_text(prompt)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(
            f"{m.get('role', 'user')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in prompt
        )
    return str(prompt)


class LLMJudgeReward(Reward):
    name = "llm_judge"
    timeout_s = 300.0

    class Config(StrictModel):
        model: str = Field(
            "", description="the judge: a causal LM hub id or local dir; empty = the built-in tiny model"
        )
        template: str = Field(
            DEFAULT_TEMPLATE,
            description="the rubric sent to the judge, with {prompt} and {completion} placeholders "
            "(other braces are kept as they are)",
        )
        pattern: str = Field(
            DEFAULT_PATTERN,
            description="regular expression (case-insensitive) whose first group is the judge's score; the last match counts",
        )
        scale: float = Field(10.0, gt=0, description="the parsed score is divided by this, then clamped to [0, 1]")
        max_new_tokens: int = Field(16, ge=1, description="tokens the judge may write")
        batch_size: int = Field(16, ge=1, description="judge prompts per generate call")
        device: Device = Field("auto", description="where the judge runs: auto = cuda when available, else cpu")

        @field_validator("template")
        @classmethod
        def _has_placeholders(cls, template: str) -> str:
            missing = [p for p in ("{prompt}", "{completion}") if p not in template]
            if missing:
                raise ValueError(f"the template needs the placeholder(s) {' and '.join(missing)}")
            return template

        @field_validator("pattern")
        @classmethod
        def _compiles_with_a_group(cls, pattern: str) -> str:
            try:
                compiled = re.compile(pattern, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
            if compiled.groups < 1:
                raise ValueError("the pattern needs a group capturing the number, e.g. Score:\\s*(\\d+)")
            return pattern

    def __init__(self, config: "LLMJudgeReward.Config | None" = None):
        from oxrl_core import HFRolloutBackend, load_causal_lm, load_tokenizer

        super().__init__(config)
        cfg = self.config
        self.device = resolve_device(cfg.device, "reward.device")
        self.tokenizer = load_tokenizer(cfg.model, field="reward.model")
        model = load_causal_lm(cfg.model, field="reward.model")  # its own copy, never the policy
        model.requires_grad_(False)
        self.backend = HFRolloutBackend(model.to(self.device).eval(), self.tokenizer, batch_size=cfg.batch_size)
        self.sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens)
        self.regex = re.compile(cfg.pattern, re.IGNORECASE)
        self.unparsable = 0  # running count of answers with no score in them
        self.last_answers: list[str] = []  # the judge's answers of the latest call (for inspection)
        self._lock = threading.Lock()

    def judge_prompt(self, prompt: Any, completion: str) -> str:
        """The filled-in template (one pass, so a placeholder inside the prompt is left alone)."""
        values = {"prompt": render_prompt(prompt), "completion": completion}
        return PLACEHOLDER.sub(lambda m: values[m.group(1)], self.config.template)

    def parse(self, answer: str) -> float | None:
        """``clamp(score / scale, 0, 1)`` of the last match of ``pattern`` in ``answer``; None when there is none."""
        matches = list(self.regex.finditer(answer))
        if not matches:
            return None
        try:
            value = float(matches[-1].group(1))
        except (TypeError, ValueError):
            return None
        return min(max(value / self.config.scale, 0.0), 1.0)

    def generate(self, judge_prompts: list[str]) -> list[str]:
        """The judge's greedy answers, as text."""
        from oxrl_core import encode_prompt

        ids = [encode_prompt(self.tokenizer, text) for text in judge_prompts]
        outputs = self.backend.generate(ids, self.sampling)
        return [self.tokenizer.decode(group[0].token_ids, skip_special_tokens=True) for group in outputs]

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float | None]:
        judge_prompts = [self.judge_prompt(p, c) for p, c in zip(prompts, completions, strict=True)]
        answers = self.generate(judge_prompts) if judge_prompts else []
        scores = [self.parse(answer) for answer in answers]
        with self._lock:
            self.last_answers = answers
            self.unparsable += sum(s is None for s in scores)
        return scores
