"""One entry point, an import path: `oxrl plugins` lists the backend without importing vLLM or torch."""

from oxrl_core import hookimpl


@hookimpl
def register_rollout_backends(register):
    register("vllm", "oxrl_vllm.backend:VLLMRolloutBackend")
