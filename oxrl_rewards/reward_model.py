"""`reward_model`: the score a trained reward model gives each (prompt, completion).

The model is a sequence-classification checkpoint with one output (``num_labels=1``), e.g. what
a Bradley–Terry reward-model run (``--alg rm``) saves, loaded with
``AutoModelForSequenceClassification`` from ``reward.model`` (hub id or local dir).

Input convention (the same as the RM's training data): the prompt goes through the
tokenizer's chat template with the generation prompt (`oxrl_core.data.encode.encode_prompt`; a string
prompt is one user message, a list of chat messages is used as is), then the completion's
tokens followed by EOS (`oxrl_core.data.encode.encode_completion`). A row longer than ``max_length``
keeps its last ``max_length`` tokens, so the completion's end (where the score is read) survives.

The reward model reads text only. An image prompt reaches it as its text with each image shown as an ``<image>``
marker (`oxrl_core.prompt_text`: a string prompt's own markers; a ``{"type": "image"}`` part of a chat message
becomes one), and the completion it scores is the sampled text; the pixels are the policy's alone.

The score of a row is the head's output at its last token, the EOS, as a float32:

    r(x, y) = w · h_T        # h_T: the model's last hidden state at the EOS closing y

Rows are right-padded and batched with an attention mask. transformers' own pooling takes the
rightmost token that is not ``pad_token_id``, which is wrong whenever the padding token is also
the EOS (a common fallback): it would skip the EOS the score belongs to. So for decoder models
(a per-token ``score`` head) the per-token head output is captured and read at the last attended
position ourselves; a row's score is then the same alone or in any batch. Encoder classifiers
(no ``score`` head, e.g. DeBERTa) pool at their first token and are used as they come.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from oxrl_core import OxrlError, Reward, StrictModel

Device = Literal["auto", "cpu", "cuda"]


def resolve_device(choice: str, field: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cuda`` without one is an error."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise OxrlError(f"{field}: 'cuda' was asked for but no CUDA device is available (use 'auto' or 'cpu')")
    return choice


class RewardModelReward(Reward):
    name = "reward_model"
    timeout_s = 300.0

    class Config(StrictModel):
        model: str = Field(
            ...,
            min_length=1,
            description="the reward model: a hub id or a local directory holding a sequence-classification "
            "checkpoint with one output (num_labels=1) and its tokenizer",
        )
        batch_size: int = Field(16, ge=1, description="rows per forward pass")
        max_length: int = Field(
            1024, ge=2, description="tokens per row (prompt + completion + EOS); longer rows keep their end"
        )
        device: Device = Field("auto", description="where the reward model runs: auto = cuda when available, else cpu")
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
            "auto",
            description="weights' dtype: auto = bfloat16 on cuda, float32 on cpu (scores are returned as float32)",
        )

    def __init__(self, config: "RewardModelReward.Config"):
        import torch
        from transformers import AutoModelForSequenceClassification

        from oxrl_core import load_tokenizer, resolve_model_path

        super().__init__(config)
        cfg = self.config
        self.device = resolve_device(cfg.device, "reward.device")
        dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if self.device == "cuda" else "float32")
        self.tokenizer = load_tokenizer(cfg.model, field="reward.model")  # pad = EOS when it has none
        path = resolve_model_path(cfg.model)
        try:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=getattr(torch, dtype_name), output_loading_info=True
            )
        except Exception as exc:  # noqa: BLE001 - missing files, offline hub, unknown architecture: one message
            raise OxrlError(
                f"reward.model: cannot load a sequence-classification model from '{path}': {type(exc).__name__}: {exc}"
            ) from None
        if model.config.num_labels != 1:
            raise OxrlError(
                f"reward.model: '{path}' has {model.config.num_labels} output labels; a reward model has one "
                "(num_labels=1, as a Bradley-Terry reward-model run saves)"
            )
        head_missing = [
            k
            for k in info.get("missing_keys", [])
            if not k.startswith(getattr(model, "base_model_prefix", "model") + ".")
        ]
        if head_missing:
            raise OxrlError(
                f"reward.model: '{path}' is not a trained reward model: its head ({', '.join(sorted(head_missing))}) "
                "is missing from the checkpoint and would be random"
            )
        model.config.pad_token_id = self.tokenizer.pad_token_id
        model.requires_grad_(False)
        self.model = model.to(self.device).eval()
        # Decoder classifiers apply `score` to every position; we read it at the EOS ourselves.
        head = getattr(model, "score", None)
        self.head = head if isinstance(head, torch.nn.Module) else None

    # ------------------------------------------------------------------ scoring

    def encode(self, prompt: Any, completion: str) -> list[int]:
        """Token ids of one row: chat-templated prompt, completion, EOS; the last ``max_length`` kept."""
        from oxrl_core import encode_completion, encode_prompt, prompt_text

        ids = encode_prompt(self.tokenizer, prompt_text(prompt)) + encode_completion(self.tokenizer, completion)
        return ids[-self.config.max_length :]

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        rows = [self.encode(p, c) for p, c in zip(prompts, completions, strict=True)]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths together: less padding
        scores: list[float] = [0.0] * len(rows)
        size = self.config.batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, value in zip(chunk, self._score_rows([rows[i] for i in chunk])):
                scores[i] = value
        return scores

    def _score_rows(self, rows: list[list[int]]) -> list[float]:
        import torch

        width = max(map(len, rows))
        pad_id = self.tokenizer.pad_token_id
        input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=self.device)  # (B, T)
        attention_mask = torch.tensor(
            [[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device
        )  # (B, T)
        last = attention_mask.sum(dim=1) - 1  # (B,) index of each row's EOS

        captured: dict[str, torch.Tensor] = {}
        hook = None
        if self.head is not None:
            hook = self.head.register_forward_hook(lambda module, args, out: captured.__setitem__("per_token", out))
        options = {"use_cache": False} if self.head is not None else {}  # encoders take no use_cache
        try:
            with torch.inference_mode():
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, **options)
        finally:
            if hook is not None:
                hook.remove()
        per_token = captured.get("per_token")
        if isinstance(per_token, torch.Tensor) and per_token.dim() == 3 and per_token.shape[1] == width:
            # (B, T, 1): the head at every position
            logits = per_token[torch.arange(len(rows), device=per_token.device), last]  # (B, 1)
        else:
            logits = out.logits  # (B, 1): the model's own pooling (encoders: the first token)
        return logits[:, 0].float().tolist()
