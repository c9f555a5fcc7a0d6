"""Held-out evaluation: the NLL of reference completions and, when the data can verify answers, greedy accuracy."""

from __future__ import annotations

import torch

from oxrl_core.data.batching import collate
from oxrl_core.data.encode import IGNORE, encode_prompt, image_fields
from oxrl_core.data.images import collate_pixels
from oxrl_core.data.sources import can_verify
from oxrl_core.models.token_head import token_stats
from oxrl_core.models.vision import placeholder_token_ids
from oxrl_core.rollout.hf import check_generation_length

__all__ = ["can_verify", "eval_loss", "evaluate", "greedy_completions"]


@torch.no_grad()
def eval_loss(model, examples: list[dict], pad_id: int, batch_size: int, device, progress=None) -> float:
    """Token-mean negative log-likelihood of the labelled tokens (chunk by chunk, `token_head`);
    ``progress(done)`` after each batch, ``done`` examples so far."""
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in collate(examples[start : start + batch_size], pad_id).items()}
        targets = batch["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
        rows, pos = (targets != IGNORE).nonzero(as_tuple=True)  # (M,)
        inputs = {k: v for k, v in batch.items() if k != "labels"}  # a VLM's image inputs too
        logp = token_stats(model, inputs, rows, pos, targets[rows, pos])["logp"]  # (M,)
        total += -float(logp.sum())
        count += int(rows.numel())
        if progress is not None:
            progress(min(start + batch_size, len(examples)))
    return total / max(count, 1)


@torch.no_grad()
def greedy_completions(
    model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int, device, progress=None, vision=None
) -> list[str]:
    """Greedy decoding with left padding; returns the decoded completions (special tokens removed);
    ``progress(done)`` after each batch, ``done`` prompts so far. ``vision`` (a VLM's processing): ``prompts`` are
    rows, encoded with their images by the processor (`encode.image_fields`), pixels passed to ``generate``. A VLM
    never decodes its image placeholders (`vision.placeholder_token_ids`), as its rollouts never sample them."""
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        part = prompts[start : start + batch_size]
        if vision is None:
            ids, images = [encode_prompt(tokenizer, p) for p in part], []
        else:
            fields = [image_fields(vision, row, "", max_length=1 << 30) for row in part]
            ids, images = [f[0] for f in fields], [f[1] for f in fields]
        width = max(map(len, ids))
        check_generation_length(model, width, max_new_tokens)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        pixels = {k: v.to(device) for k, v in collate_pixels(images, width, left=True).items()}
        gen = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            **pixels,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            suppress_tokens=placeholder_token_ids(model.config, tokenizer) or None,  # a VLM's, as its rollouts
        )
        out += tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
        if progress is not None:
            progress(len(out))
    return out


def evaluate(
    model,
    tokenizer,
    device,
    eval_examples,
    eval_rows,
    dataset,
    batch_size: int,
    max_new_tokens: int,
    progress=None,
    vision=None,
) -> dict:
    """``eval/loss`` on ``eval_examples``, ``eval/accuracy`` of greedy answers to ``eval_rows``;
    ``progress(done, total)`` counts both (a `progress.Reporter.counter` update). ``vision``: a VLM's
    processing (the rows' images go with their prompts)."""
    was_training = model.training
    model.eval()
    rows = eval_rows if eval_rows and can_verify(dataset) else []
    total = len(eval_examples) + len(rows)
    update = progress or (lambda done, total=None: None)
    update(0, total)
    try:
        metrics = {}
        if eval_examples:
            metrics["eval/loss"] = eval_loss(
                model, eval_examples, tokenizer.pad_token_id, batch_size, device, progress=update
            )
        if rows:
            completions = greedy_completions(
                model,
                tokenizer,
                [r["prompt"] for r in eval_rows] if vision is None else eval_rows,
                max_new_tokens,
                max(batch_size, 32),
                device,
                progress=lambda done: update(len(eval_examples) + done),
                vision=vision,
            )
            correct = [bool(dataset.verify(c, r)) for c, r in zip(completions, eval_rows)]
            metrics["eval/accuracy"] = sum(correct) / len(correct)
        return metrics
    finally:
        model.train(was_training)
