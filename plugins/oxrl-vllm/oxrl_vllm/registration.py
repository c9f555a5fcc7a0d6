"""One entry point, an import path: `oxrl plugins` lists the backend without importing vLLM or torch."""

from oxrl_core.hookspecs import Registers

vllm = Registers("rollout_backend", "vllm", "oxrl_vllm.backend:VLLMRolloutBackend")
