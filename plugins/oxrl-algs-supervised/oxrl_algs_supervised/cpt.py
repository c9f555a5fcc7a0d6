"""CPT: continued pre-training, the language-model loss on every token of packed `text` rows.

    L = -(1/N) Σ_{b,t} log π_θ(x_{b,t+1} | x_{b,≤t}),    N = number of predicted tokens

Rows are `{"text"}`; the data layer appends EOS to each text, concatenates them
and cuts the stream into `data.max_length` blocks (sequence packing, as in
GPT-2/nanoGPT pre-training), so a block may span documents, separated by EOS.
"""

from oxrl_core import Algorithm, StrictModel, SupervisedBatch


class CPT(Algorithm):
    name = "cpt"
    loop = "supervised"
    data_format = "text"

    class Config(StrictModel):
        """CPT has no hyper-parameters beyond `train.*` and `data.max_length` (the block size)."""

    def loss(self, batch: SupervisedBatch):
        logp, mask = batch["logp"], batch["mask"]  # (B, T-1) each; mask only hides padding
        n_tokens = mask.sum().clamp(min=1)
        # L = -(1/N) Σ log π(x_{t+1} | x_≤t)
        loss = -(logp * mask).sum() / n_tokens
        return loss, {"loss/lm": loss.detach(), "perplexity": loss.detach().exp()}
