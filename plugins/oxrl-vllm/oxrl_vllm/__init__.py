"""oxRL's `vllm` rollout backend (``rollout.backend: vllm``); the engine lives in `oxrl_vllm.backend`."""

__version__ = "0.1.0"
