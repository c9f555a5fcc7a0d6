"""`rollouts.jsonl`: a bounded sample of what an RL run generated, for `oxrl report`'s rollout viewer.

Every ``logging.rollout_samples_every`` steps (and at the first and the last step) one JSON line:

    {"step": 10,
     "rewards": [...],                 every sample's reward in the rollout batch (the distribution)
     "samples": [{"prompt": "...", "group": 0, "sample": 1, "reward": 1.0, "advantage": 0.53,
                  "finish_reason": "stop", "length": 7,
                  "ids": [...], "tokens": [...],          the completion's token ids and their text
                  "logp": [...], "logp_rollout": [...], "entropy": [...], "adv": [...], "mask": [...],
                  "logp_ref": [...]}]}                    (with a reference model)

The per-token values are the trainer's logprob of each sampled token, the rollout backend's, the
policy's entropy there, the advantage, the loss mask (0 on an environment's tokens in a multi-turn
episode) — read off the rollout batch the update trained on, at the completion's next-token positions.

Bounded: the first `PROMPTS` prompts of the batch, the first `SAMPLES` samples of each, the first
`MAX_TOKENS` tokens of each completion (``length`` keeps the full count), the prompt's text cut to
`MAX_PROMPT_CHARS`. Written as metrics.jsonl is (`tracking.JsonlSink`: appended line by line, cut back
to the checkpoint on resume, a torn line skipped), on rank 0 only.
"""

from __future__ import annotations

import math
from pathlib import Path

from oxrl_core.engines.distributed import is_main
from oxrl_core.run_io.tracking import JsonlSink

PROMPTS, SAMPLES, MAX_TOKENS, MAX_PROMPT_CHARS = 2, 4, 1024, 2000


def _num(value: float, digits: int = 4):
    """JSON-safe: a non-finite value is null (JSON has no NaN)."""
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


class RolloutLog:
    """``due(step)`` says whether ``step`` is logged; ``write(...)`` logs it; ``close()`` at the end."""

    def __init__(self, run_dir: Path, every: int, max_steps: int, tokenizer, resume_step: int | None = None):
        self.every, self.max_steps, self.tokenizer = every, max_steps, tokenizer
        self.sink = JsonlSink(run_dir / "rollouts.jsonl", resume_step) if every > 0 and is_main() else None

    def due(self, step: int) -> bool:
        """Every process agrees (the loop gathers extra values on a logged step)."""
        return self.every > 0 and (step == 1 or step % self.every == 0 or step == self.max_steps)

    def write(self, step: int, prompts, completions, scores, batch: dict, n: int) -> None:
        """``prompts`` (B lists of ids), ``completions`` (B), ``scores`` (B), ``batch`` the rollout batch
        after the update (``logp_old``, ``logp_rollout``, ``mask``, ``adv``, ``entropy_old``, optional
        ``logp_ref``; (B, T) over next-token positions), ``n`` samples per prompt."""
        if self.sink is None:
            return
        names = {"logp": "logp_old", "logp_rollout": "logp_rollout", "entropy": "entropy_old", "mask": "mask"}
        names.update(adv="adv", logp_ref="logp_ref")  # an advantage and a reference where the algorithm has them
        keys = {name: key for name, key in names.items() if batch.get(key) is not None}
        rows = [g * n + s for g in range(min(PROMPTS, len(completions) // n)) for s in range(min(SAMPLES, n))]
        samples = []
        for i in rows:
            c, start = completions[i], len(prompts[i]) - 1  # position start + j predicts completion token j
            ids = list(c.token_ids[:MAX_TOKENS])
            end = start + len(ids)
            values = {}
            for name, key in keys.items():
                tensor = batch[key][i]
                if tensor.dim() == 0:  # a per-sequence quantity (an advantage per row): the same at every token
                    tensor = tensor.expand(batch["mask"].shape[1])
                values[name] = [_num(v) for v in tensor[start:end].float().tolist()]
            adv = None
            if "adv" in values:  # the sample's advantage: the mean over its trained tokens
                trained = [a for a, m in zip(values["adv"], values["mask"]) if m and a is not None]
                adv = _num(sum(trained) / len(trained)) if trained else None
            samples.append(
                {
                    "prompt": self._prompt_text(prompts[i]),
                    "group": i // n,
                    "sample": i % n,
                    "reward": _num(scores[i]),
                    "advantage": adv,
                    "finish_reason": c.finish_reason,
                    "length": len(c.token_ids),
                    "ids": ids,
                    "tokens": [self.tokenizer.decode([t]) for t in ids],
                    **values,
                }
            )
        self.sink.log(step, {"rewards": [_num(s) for s in scores], "samples": samples})

    def _prompt_text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        if len(text) > MAX_PROMPT_CHARS:
            half = MAX_PROMPT_CHARS // 2
            text = f"{text[:half]} … [{len(text) - MAX_PROMPT_CHARS} characters left out] … {text[-half:]}"
        return text

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
