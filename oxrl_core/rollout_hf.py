"""The default rollout backend: batched ``transformers`` ``generate`` on the policy model itself.

Registered as ``hf`` by ``oxrl_core.builtin_plugins`` (an import path, so discovery
stays torch-free). Single process, one device, no distributed code.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Completion, RolloutBackend, SamplingParams


class HFRolloutBackend(RolloutBackend):
    """Samples with ``model.generate`` (KV cache, left padding, attention mask).

    Logprobs: ``Completion.logprobs[i]`` is ``log p(token_ids[i])`` under the distribution
    the token was actually drawn from, i.e. ``log_softmax`` of generate's *processed* scores
    (``output_scores=True``): the logits divided by ``temperature`` and, when ``top_p < 1``,
    with tokens outside the nucleus set to -inf (so the nucleus is renormalised). This is what
    ``model.compute_transition_scores(..., normalize_logits=True)`` returns, computed here in
    float32. At ``temperature=1, top_p=1`` it equals the model's own log-softmax of the token.
    With ``temperature=0`` (greedy) no processing is applied, so the logprobs are the model's
    own (temperature-1) log-softmax of the chosen tokens.

    Nothing else may reshape the distribution: the model's own ``generation_config`` (which
    for a hub model may set top_k, repetition_penalty, min_p, ...) is set aside during the
    call, and transformers' global ``top_k=50`` default is switched off.
    """

    name: ClassVar[str] = "hf"

    def __init__(self, model, tokenizer, batch_size: int | None = None):
        if batch_size is not None and batch_size < 1:
            raise OxrlError(f"rollout batch_size must be >= 1, got {batch_size}")
        if tokenizer.eos_token_id is None:
            raise OxrlError("the tokenizer has no EOS token; completions end with EOS")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.eos_id: int = tokenizer.eos_token_id
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.policy_version = 0

    # ------------------------------------------------------------------ generate

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, in prompt order (see the class docstring for logprobs)."""
        if self.model is None:
            raise OxrlError("the hf rollout backend is closed")
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise OxrlError(f"sampling needs n >= 1 and max_new_tokens >= 1, got {sampling}")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise OxrlError(f"sampling needs temperature >= 0 and 0 < top_p <= 1, got {sampling}")
        if any(len(p) == 0 for p in prompt_token_ids):
            raise OxrlError("every prompt needs at least one token")

        # Each prompt is repeated n times (greedy generate does not take num_return_sequences > 1).
        rows = [list(p) for p in prompt_token_ids for _ in range(sampling.n)]
        per_call = len(rows) if self.batch_size is None else self.batch_size * sampling.n
        device = next(self.model.parameters()).device
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []

        flat: list[Completion] = []
        was_training = self.model.training
        saved_config = self.model.generation_config
        self.model.eval()
        self.model.generation_config = self._clean_generation_config()
        try:
            # fork_rng: seeding makes this call reproducible without touching the caller's RNG state.
            with torch.random.fork_rng(devices=rng_devices, enabled=sampling.seed is not None), torch.no_grad():
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                for start in range(0, len(rows), per_call):
                    flat += self._generate_batch(rows[start : start + per_call], sampling, device)
        finally:
            self.model.generation_config = saved_config
            self.model.train(was_training)
        return [flat[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompt_token_ids))]

    def _clean_generation_config(self):
        from transformers import GenerationConfig

        return GenerationConfig(
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            bos_token_id=getattr(self.tokenizer, "bos_token_id", None),
        )

    def _generate_batch(self, rows: list[list[int]], sampling: SamplingParams, device) -> list[Completion]:
        width = max(map(len, rows))
        input_ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        greedy = sampling.temperature == 0
        options: dict[str, Any] = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0
        )
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=sampling.max_new_tokens,
            use_cache=True,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            **options,
        )
        new_tokens = out.sequences[:, width:]  # (B, steps)
        scores = torch.stack(out.scores, dim=1).float()  # (B, steps, V): the processed scores sampled from
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)

        completions = []
        for tokens, lps in zip(new_tokens.tolist(), logprobs.tolist()):
            if self.eos_id in tokens:
                end = tokens.index(self.eos_id) + 1  # keep the EOS, drop the padding after it
                completions.append(Completion(tokens[:end], lps[:end], "stop", self.policy_version))
            else:
                completions.append(Completion(tokens, lps, "length", self.policy_version))
        return completions

    # ------------------------------------------------------------------ weights

    def update_weights(self, state: Any, policy_version: int) -> None:
        """Load ``state`` (a state_dict or a model with the same parameter names) strictly; set the version."""
        if self.model is None:
            raise OxrlError("the hf rollout backend is closed")
        if not isinstance(policy_version, int) or policy_version <= self.policy_version:
            raise OxrlError(
                f"policy_version must increase: the backend is at {self.policy_version}, got {policy_version!r}"
            )
        if state is not self.model:  # the RL loop's hf backend generates with the trained model itself
            if isinstance(state, torch.nn.Module):
                state = state.state_dict()
            self.model.load_state_dict(state, strict=True)
        self.policy_version = policy_version

    def score(self, token_ids: list[int]) -> list[float]:
        """``log p(token_ids[i] | token_ids[:i])``, i = 1..len-1: one teacher-forced forward, raw logits, float32."""
        if self.model is None:
            raise OxrlError("the hf rollout backend is closed")
        device = next(self.model.parameters()).device
        ids = torch.tensor([token_ids], device=device)  # (1, L)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # (L-1, V)
        finally:
            self.model.train(was_training)
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()

    @classmethod
    def build(cls, model, tokenizer, model_path: str, config) -> "HFRolloutBackend":
        """In a run the backend shares the policy module: a weight sync is a version bump, not a copy."""
        cls.parse_options(config)
        return cls(model, tokenizer)

    def close(self) -> None:
        self.model = None
