"""The default rollout backend: batched ``transformers`` ``generate`` on the policy model itself.

Registered as ``hf`` by ``oxrl_core.builtin_plugins`` (an import path, so discovery
stays torch-free). Single process, one device, no distributed code.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.cache_utils import DynamicLayer

from oxrl_core.data.images import collate_pixels
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Completion, RolloutBackend, SamplingParams
from oxrl_core.models.packing_probe import allows_prefill_once
from oxrl_core.models.vision import placeholder_token_ids


def context_length(model) -> int | None:
    """The most positions the model was built for (``max_position_embeddings`` or its older names), or None
    when its config does not say (a model with no such limit, e.g. a pure state-space model)."""
    config = getattr(model, "config", model)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_generation_length(
    model, longest_prompt: int, max_new_tokens: int, field: str = "rollout.max_new_tokens"
) -> None:
    """Refuse, before anything is generated, a prompt + completion longer than the model's context.

    Past its positions a model samples garbage (or indexes out of its position table), and the hf backend
    would size its KV cache for the whole length: a huge ``max_new_tokens`` once asked ~32 GB for a tiny
    model. The message names the field, the model's limit and the largest value that fits."""
    limit = context_length(model)
    if limit is None or longest_prompt + max_new_tokens <= limit:
        return
    room = limit - longest_prompt
    fix = (
        f"set {field} <= {room}"
        if room > 0
        else "shorten the prompts (data.max_length) or use a model with a longer context"
    )
    raise OxrlError(
        f"{field}={max_new_tokens} does not fit the model's context: the longest prompt has {longest_prompt} tokens "
        f"and the model has {limit} positions (max_position_embeddings), so at most {max(room, 0)} new tokens fit; {fix}"
    )


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
    call, and transformers' global ``top_k=50`` default is switched off. One exception, on every call
    for a vision-language model (image prompts and text ones alike): its image placeholder tokens and
    their delimiters (`vision.placeholder_token_ids`) are never sampled (their logits are -inf in the
    processed scores, so the logprobs are of the distribution sampled from): the trainer's forward
    would count such a token against the image features and refuse the row. The trainer scores the
    same masked distribution (`token_head.HeadPath.masked`), so `rollout/logprob_diff` is the
    numerical gap alone.
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
        self.suppressed = placeholder_token_ids(model.config, tokenizer) if hasattr(model, "config") else []

    # ------------------------------------------------------------------ generate

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, images: list[dict] | None = None
    ) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, in prompt order (see the class docstring for logprobs); ``images``:
        each prompt's image inputs from the model's processor ({} for a text prompt), passed to ``generate``."""
        if self.model is None:
            raise OxrlError("the hf rollout backend is closed")
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise OxrlError(f"sampling needs n >= 1 and max_new_tokens >= 1, got {sampling}")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise OxrlError(f"sampling needs temperature >= 0 and 0 < top_p <= 1, got {sampling}")
        if any(len(p) == 0 for p in prompt_token_ids):
            raise OxrlError("every prompt needs at least one token")
        if images is not None and len(images) != len(prompt_token_ids):
            raise OxrlError(f"{len(images)} image entries for {len(prompt_token_ids)} prompts (one per prompt)")

        # `batch_size` prompts (each with its n samples) per generate call
        per_call = len(prompt_token_ids) if self.batch_size is None else self.batch_size
        device = next(self.model.parameters()).device
        rng_devices = (
            [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        )

        flat: list[Completion] = []
        was_training = self.model.training
        saved_config = self.model.generation_config
        self.model.eval()
        # a VLM never samples its placeholders, image prompts or text ones (the class docstring)
        self.model.generation_config = self._clean_generation_config()
        try:
            # fork_rng: seeding makes this call reproducible without touching the caller's RNG state.
            with torch.random.fork_rng(devices=rng_devices, enabled=sampling.seed is not None), torch.no_grad():
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                for start in range(0, len(prompt_token_ids), per_call):
                    part = None if images is None else images[start : start + per_call]
                    flat += self._generate_batch(prompt_token_ids[start : start + per_call], sampling, device, part)
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
            suppress_tokens=self.suppressed or None,  # a VLM's placeholders (class docstring)
        )

    def _generate_batch(
        self, prompts: list[list[int]], sampling: SamplingParams, device, images: list[dict] | None = None
    ) -> list[Completion]:
        """``sampling.n`` samples of each prompt, in one ``generate`` call over P·n left-padded rows. A prompt's image
        inputs go with each of its n rows (`images.collate_pixels`, left-padded like the tokens): the vision tower
        sees the image once per sample, and such a batch starts from transformers' own cache (the shared prefill
        of `_prefilled_cache` numbers positions in one dimension; Qwen-VL's are three)."""
        width = max(map(len, prompts))
        check_generation_length(self.model, width, sampling.max_new_tokens)  # before any buffer is sized
        prompt_ids = torch.tensor(
            [[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device
        )  # (P, W)
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (P, W)
        # each prompt repeated n times, its samples contiguous (greedy generate takes no num_return_sequences > 1)
        input_ids = prompt_ids.repeat_interleave(sampling.n, dim=0)  # (P·n, W)
        attention_mask = prompt_mask.repeat_interleave(sampling.n, dim=0)  # (P·n, W)
        pixels: dict[str, torch.Tensor] = {}
        if images and any(images):
            per_row = [fields for fields in images for _ in range(sampling.n)]  # (P·n,) references, not copies
            pixels = {k: v.to(device) for k, v in collate_pixels(per_row, width, left=True).items()}
        cache = (
            None
            if pixels
            else self._prefilled_cache(prompt_ids, prompt_mask, sampling.n, width + sampling.max_new_tokens)
        )
        greedy = sampling.temperature == 0
        options: dict[str, Any] = (
            dict(do_sample=False)
            if greedy
            else dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        )
        if cache is not None:
            options["past_key_values"] = cache
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=sampling.max_new_tokens,
            use_cache=True,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            **pixels,
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

    def _prefilled_cache(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, capacity: int):
        """The KV cache ``generate`` starts from, or None for transformers' default.

        Two savings over the default ``DynamicCache`` (measured in the README, benchmarks/grpo_step.py):
        each layer's keys/values live in one buffer of ``capacity`` positions that decoding fills in place
        (`PreallocatedLayer`), instead of being concatenated into a new tensor at every token; and with
        n > 1 each prompt's first W-1 positions are computed once and the cache repeated n times, instead
        of prefilling the same prompt n times. ``generate`` then feeds only the last prompt token (it skips
        what the cache holds), so the samples are drawn from the same distribution as before: positions
        and padding follow ``generate``'s own rule (cumulative mask − 1, padding at 0).
        Only for caches made entirely of transformers' plain ``DynamicLayer`` (full attention); a model with
        sliding-window, linear-attention or custom caches gets transformers' default, and so does a model whose
        packed forward the load-time probe found to differ from its separate forwards (`packing_probe`).
        """
        from transformers import DynamicCache

        if not allows_prefill_once(self.model):
            return None
        config = getattr(self.model, "config", None)
        supports = getattr(self.model, "_supports_default_dynamic_cache", None)
        if config is None or supports is None or not supports():
            return None
        try:
            cache = DynamicCache(config=config)
        except Exception:  # noqa: BLE001 - a config transformers cannot lay a cache out for: its default path
            return None
        if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
            return None
        cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
        if n > 1 and prompt_ids.shape[1] > 1:
            positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (P, W), as generate numbers them
            self.model(
                input_ids=prompt_ids[:, :-1],
                attention_mask=prompt_mask[:, :-1],
                position_ids=positions[:, :-1],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            for layer in cache.layers:
                layer.repeat_rows(n)
        return cache

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
        """``log p(token_ids[i] | token_ids[:i])``, i = 1..len-1: one teacher-forced forward, raw logits, float32
        (the weight-sync probe compares raw distributions: `rollout.sync.trainer_logprobs`)."""
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
    def image_support(cls, model_path: str) -> str | None:
        """Any model transformers generates with: the image inputs go to its own ``generate``."""
        return None

    @classmethod
    def build(cls, model, tokenizer, model_path: str, config) -> "HFRolloutBackend":
        """In a run the backend shares the policy module: a weight sync is a version bump, not a copy."""
        cls.parse_options(config)
        return cls(model, tokenizer)

    def close(self) -> None:
        self.model = None


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views into one buffer of ``capacity`` positions.

    ``update`` writes the new positions in place and returns the filled prefix, so decoding T tokens
    copies each position once instead of re-concatenating the whole cache T times (transformers'
    ``DynamicLayer`` does ``torch.cat`` per token). Everything that reads ``keys``/``values`` sees the
    same tensors as with ``DynamicLayer``. The buffer starts at the prompt plus `FIRST_STRETCH` positions
    and doubles when full (amortised: each position is copied O(1) times), never beyond ``capacity``
    unless a caller writes past it.
    """

    #: positions past the prompt allocated at first; the buffer doubles from there
    FIRST_STRETCH = 128

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, filled, _ = key_states.shape
        # sized to what is used: the prompt plus a first stretch of decoding, doubled as generation goes on
        # (at most `capacity`); a run whose samples stop after 3 tokens never pays for max_new_tokens
        size = min(self.capacity, filled + self.FIRST_STRETCH) if self.capacity > filled else filled
        self._keys = key_states.new_empty(batch, heads, size, key_states.shape[-1])  # (B, H, size, D)
        self._values = value_states.new_empty(batch, heads, size, value_states.shape[-1])
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:  # past the buffer: double it (up to the planned capacity, beyond only if asked)
            size = self._keys.shape[-2]
            grow = max(end, min(2 * size, self.capacity)) - size
            self._keys = torch.cat(
                [self._keys, self._keys.new_empty(*self._keys.shape[:2], grow, self._keys.shape[-1])], dim=-2
            )
            self._values = torch.cat(
                [self._values, self._values.new_empty(*self._values.shape[:2], grow, self._values.shape[-1])], dim=-2
            )
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def repeat_rows(self, n: int) -> None:
        """Each batch row repeated n times, in place of the row (row i becomes rows i·n … i·n+n-1)."""
        self._keys = self._keys.repeat_interleave(n, dim=0)
        self._values = self._values.repeat_interleave(n, dim=0)
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.length = self.keys.shape[-2]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.repeat_rows(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def reset(self) -> None:
        super().reset()
        self.length = 0
