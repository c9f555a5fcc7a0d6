"""OnlineDPO: DPO on fresh pairs sampled from the current policy (Guo et al. 2024, "Direct
Language Model Alignment from Online AI Feedback"; TRL's OnlineDPOTrainer).

Each step, for every prompt x the rollout backend samples n ≥ 2 completions from the current
policy, the configured reward (a function or a reward model) scores them, and the best- and
worst-scored completions form the pair (y_c, y_r); then DPO:

    h = β·[(log π_θ(y_c|x) − log π_ref(y_c|x)) − (log π_θ(y_r|x) − log π_ref(y_r|x))]
    L = −(1/P') Σ_{pairs} log σ(h)

With n = 2 (the paper's setting) the pair is the two samples. Deliberate deviations:
- With n > 2 the pair is best vs worst of the group, the most informative pair the samples give.
- A group whose samples all score the same gives no preference and is left out of the loss
  (P' counts the remaining pairs; ``pairs/used`` logs their fraction), instead of picking a
  side at random.
- log π is summed over completion tokens at ``rollout.temperature`` (the distribution sampled
  from); keep it at 1.0 for the paper's objective.
"""

from __future__ import annotations

import torch
from pydantic import Field

from oxrl_algs_preference.common import pair_metrics, sigmoid_loss
from oxrl_core import Algorithm, RLAdvantagesBatch, RLLossBatch, StrictModel


class OnlineDPO(Algorithm):
    name = "online_dpo"
    group_relative = True  # the pair is a group's best and worst: an equal-reward group gives no pair
    loop = "rl"  # trained on its own generations (the RL loop)
    data_format = "prompt"
    needs_ref = True
    min_group_size = 2
    loss_on_groups = True
    loss_weighting = "sequences"

    class Config(StrictModel):
        beta: float = Field(0.1, gt=0, description="β: strength of the KL regularisation towards the reference")
        label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="ε: probability that a ranking is wrong (cDPO)")

    def advantages(self, batch: RLAdvantagesBatch):
        n = batch["group_size"]
        rewards = batch["rewards"].view(-1, n)  # (P, n)
        best, worst = rewards.argmax(1), rewards.argmin(1)  # (P,)
        used = rewards.max(1).values > rewards.min(1).values  # (P,) groups with a preference
        # role: +1 chosen, −1 rejected, 0 not in a pair; (B,)
        role = torch.zeros_like(rewards)
        rows = torch.arange(rewards.shape[0], device=rewards.device)
        role[rows[used], best[used]] = 1.0
        role[rows[used], worst[used]] = -1.0
        return {"role": role.view(-1)}, {"pairs/used": used.float().mean()}

    def loss(self, batch: RLLossBatch):
        n = batch["group_size"]
        # log π(y|x) summed over completion tokens, one per sample; (P, n)
        logp = (batch["logp"] * batch["mask"]).sum(-1).view(-1, n)
        logp_ref = (batch["logp_ref"] * batch["mask"]).sum(-1).view(-1, n)
        role = batch["role"].view(-1, n)  # (P, n)
        chosen, rejected = (role > 0).float(), (role < 0).float()
        used = chosen.sum(1) > 0  # (P,)
        logp_chosen, logp_rejected = (logp * chosen).sum(1)[used], (logp * rejected).sum(1)[used]  # (P',)
        ref_chosen, ref_rejected = (logp_ref * chosen).sum(1)[used], (logp_ref * rejected).sum(1)[used]  # (P',)
        if not used.any():  # no group had a preference: a zero loss that still reaches the graph
            return (logp * 0).sum(), {"pairs/used": 0.0}
        chosen_logratio, rejected_logratio = logp_chosen - ref_chosen, logp_rejected - ref_rejected  # (P',)
        # h = β·[(log π_θ(y_c) − log π_ref(y_c)) − (log π_θ(y_r) − log π_ref(y_r))]
        h = self.config.beta * (chosen_logratio - rejected_logratio)
        loss = sigmoid_loss(h, self.config.label_smoothing).mean()
        metrics = pair_metrics(
            self.config.beta * chosen_logratio, self.config.beta * rejected_logratio, logp_chosen, logp_rejected
        )
        return loss, metrics
