"""The critic of actor-critic algorithms (PPO): a scalar value head V(s_t) per position.

Two layouts, chosen by the algorithm's config:

- ``shared``: a linear head on the policy's last hidden state. One forward pass gives both
  the logits and the values; the value loss also trains the shared backbone.
- ``separate``: the head sits on its own copy of the initial policy's backbone (twice the
  parameters and a second forward pass, no interference between the two losses).

The head starts at zero, so the first values are 0 and the first advantages are the
(discounted) rewards themselves.
"""

from __future__ import annotations

import torch
from torch import nn


class Critic(nn.Module):
    def __init__(self, hidden_size: int, backbone: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone  # None = shared with the policy
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def shared(self) -> bool:
        return self.backbone is None

    def forward(
        self, policy_hidden: torch.Tensor | None, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Values (B, L) from the policy's last hidden state (B, L, H) or from the critic's own backbone."""
        if self.backbone is None:
            hidden = policy_hidden
        else:
            hidden = self.backbone(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)


def build_critic(policy, layout: str, load_backbone) -> Critic:
    """``load_backbone()`` returns a fresh causal LM of the initial policy (used for ``separate``).

    A multimodal-layout checkpoint (e.g. ``Gemma3ForConditionalGeneration``) nests the text model's
    sizes under its text config, and its decoder (``get_decoder()``) is the language model alone."""
    hidden = policy.config.get_text_config().hidden_size
    if layout == "shared":
        return Critic(hidden)
    return Critic(hidden, backbone=load_backbone().get_decoder())
