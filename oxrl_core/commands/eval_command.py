"""`oxrl eval`: generate on held-out prompts and report mean reward, pass@1 and pass@k.

A sample is *correct* when its reward is at least 1 (the dataset's answer check passed, every
test of the ``code`` reward passed, ...). With ``n`` samples per prompt of which ``c`` are
correct, pass@k is the unbiased estimator of Chen et al. (2021, the Codex paper), averaged over
prompts:

    pass@k = 1 − C(n − c, k) / C(n, k)

so pass@1 is the mean accuracy of single samples. With ``n = 1`` decoding is greedy by default
and pass@1 is the greedy accuracy; with ``n > 1`` the default temperature is 1.0.

With ``env`` (``--env NAME``) each sample is a multi-turn episode with that environment, played as
the RL loop plays them (`oxrl_core.rl.episodes`), and its reward is the episode's.

Image rows (``images`` with ``<image>`` markers or ``{"type": "image"}`` parts, as the training loops take them) are
evaluated with a vision-language model: with a VLM every prompt goes through the model's processor, as the run that
trained it encoded its prompts (`rl.batch.prepare_prompts`), and each sample is generated with its prompt's
pixel inputs (`interfaces.generate_from`); with ``--env`` an episode starts from its row's images and may be shown
more by the environment (`rl.episodes`). Image rows with a model that reads no images or with a backend that
takes no images are refused before the weights load, naming the row.
"""

from __future__ import annotations

import math
from typing import Any

import yaml
from pydantic import ValidationError

from oxrl_core.config import RolloutConfig, RunConfig
from oxrl_core.data.images import is_image_row
from oxrl_core.data.rows import normalise_row, row_where
from oxrl_core.data.sources import Source, load_data
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import SamplingParams, generate_from
from oxrl_core.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from oxrl_core.models.vision import is_vlm_config, load_config, load_processing
from oxrl_core.observability.progress import counter
from oxrl_core.plugins import registry as get_registry
from oxrl_core.rl.batch import prepare_prompts
from oxrl_core.rl.episodes import Episodes
from oxrl_core.rollout.hf import check_generation_length
from oxrl_core.schema import format_validation_error
from oxrl_core.scoring.rewards import Failures, build_reward, score_batch

CORRECT = 1.0 - 1e-9  # a reward at least this large counts as a correct sample
NO_LIMIT = 1 << 30  # prompts are never cut here: a prompt too long for the model is `check_generation_length`'s


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 − C(n−c, k)/C(n, k): the chance that at least one of k of the n samples is correct."""
    if n - c < k:
        return 1.0
    # the product form of the binomial ratio, stable for large n (as in the Codex paper's code)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def check_image_rows(image_row: dict, origin: str, env: str, backend_cls, model: str) -> None:
    """What an evaluation cannot do with image rows, refused before any model loads: a backend that takes no
    images (its `image_support` says why). (Multi-turn episodes, ``--env``, start from image prompts as the RL
    loop's do.)"""
    where = f"{row_where(image_row, origin)}: field 'images'"
    reason = backend_cls.image_support(resolve_model_path(model))
    if reason is not None:
        raise OxrlError(
            f"--backend {backend_cls.name}: {where} holds images and {reason}; evaluate image rows with --backend hf "
            "(transformers' generate, which takes the model's image inputs)"
        )


def load_vision(model: str, image_row: dict | None, origin: str):
    """The model's image processing (`vision.VLMProcessing`) when ``model`` is a vision-language model whose
    processor loads: its prompts then go through the processor, as the training loops encode them. Otherwise None,
    and an image row (``image_row``, the first) is refused, naming it: its images would be silently dropped."""
    path = resolve_model_path(model)
    if is_vlm_config(load_config(path, "--model")):
        try:
            return load_processing(path, "--model")
        except OSError as exc:  # a multimodal layout saved without its image processor: text rows only
            reason = f"is a vision-language model whose processor does not load ({str(exc).split('. ')[0]})"
    else:
        reason = "is a text-only model"
    if image_row is not None:
        raise OxrlError(
            f"{row_where(image_row, origin)}: field 'images': this row has images and --model {model} {reason}; "
            "evaluate image rows with a vision-language model saved with its processor (e.g. the final/ of a run "
            "on image rows), or leave the images out"
        )
    return None


def held_out_rows(data: Any, limit: int, registry) -> tuple[Source, list[dict]]:
    """``--data``'s held-out rows (a YAML mapping or list given inline is read as one), as prompt rows, the first
    ``limit`` of them when ``limit`` is set; no rows is an error."""
    if isinstance(data, str) and data.strip().startswith(("{", "[")):  # {source: arith, task: products}
        data = yaml.safe_load(data)
    source = load_data(data, "eval", registry, field="--data")
    if not source.rows:
        raise OxrlError(
            f"--data: {source.origin} has no held-out rows (a dataset plugin without an eval split needs a file)"
        )
    rows = [normalise_row(r, "prompt", source.origin) for r in source.rows]
    if limit:
        rows = rows[:limit]
    return source, rows


def pass_metrics(n: int, rows: list[dict], texts, lengths, scores, reward_metrics: dict, env_metrics: dict):
    """The report's metrics (mean reward, pass@k for each k of `ks_for`, lengths and counts) and its samples (each
    prompt's ``n`` completions with their scores), from the scored samples in prompt order."""
    correct = [sum(s >= CORRECT for s in scores[i * n : (i + 1) * n]) for i in range(len(rows))]
    metrics: dict[str, float] = {
        "reward/mean": reward_metrics["reward/mean"],
        "reward/std": reward_metrics["reward/std"],
    }
    for k in ks_for(n):
        metrics[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(rows)
    metrics.update(
        {
            "reward/errors": reward_metrics["reward/errors"],
            "reward/timeouts": reward_metrics["reward/timeouts"],
            "response/length": sum(lengths) / len(lengths),
            "prompts": len(rows),
            "samples": len(texts),
            **env_metrics,
        }
    )
    samples = [
        {"row": r.get("_row"), "completions": texts[i * n : (i + 1) * n], "scores": scores[i * n : (i + 1) * n]}
        for i, r in enumerate(rows)
    ]
    return metrics, samples


def evaluate_model(
    model: str,
    data: Any,
    reward: str = "",
    n: int = 1,
    temperature: float | None = None,
    max_new_tokens: int = 64,
    limit: int = 0,
    batch_size: int = 32,
    seed: int = 0,
    backend: str = "hf",
    env: str = "",
    max_turns: int = 4,
    reporter=None,
) -> dict:
    """Generate ``n`` completions per held-out prompt, score them, and return the report. ``reporter`` (a
    `progress.Reporter`) shows the model loading and the samples generated so far."""
    import torch

    registry = get_registry()
    temperature = (0.0 if n == 1 else 1.0) if temperature is None else temperature
    if n > 1 and temperature == 0:
        raise OxrlError("--n > 1 with --temperature 0 gives n identical greedy samples; set a temperature above 0")

    # data and reward first: bad input fails before a model loads
    source, rows = held_out_rows(data, limit, registry)
    image_row = next((r for r in rows if is_image_row(r)), None)
    sections = {"reward": {"name": reward}, "rollout": {"max_new_tokens": max_new_tokens}}
    if env:
        sections["env"] = {"name": env, "max_turns": max_turns, "max_tokens": max_turns * max_new_tokens * 2}
    try:
        config = RunConfig.model_validate({"algorithm": "eval", **sections})
    except ValidationError as exc:
        raise format_validation_error(exc, RunConfig, "oxrl eval") from None
    scorer = build_reward(config, registry, dataset=source.dataset, source="--reward")
    environment = registry.build("environment", env, {}, field="--env") if env else None
    rollout = RolloutConfig(backend=backend, n=n, max_new_tokens=max_new_tokens, temperature=temperature)
    backend_cls, _ = registry.check("rollout_backend", backend, rollout, field="rollout")
    if image_row is not None:
        check_image_rows(image_row, source.origin, env, backend_cls, model)

    tokenizer = load_tokenizer(model, field="--model")
    vision = load_vision(model, image_row, source.origin)
    # before the weights load; a VLM's prompts through its processor, each image row with its pixel inputs
    prompts = prepare_prompts(Source(source.rows[: len(rows)], source.origin), tokenizer, NO_LIMIT, vision)
    rows, prompt_ids, images = prompts.rows, prompts.ids, prompts.media
    policy = load_causal_lm(model, field="--model", reporter=reporter)
    policy.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    check_generation_length(policy, max(map(len, prompt_ids)), max_new_tokens, "--max-new-tokens")
    if env:  # an episode's budget: up to two completions' worth per turn, within the model's context
        room = getattr(policy.config.get_text_config(), "max_position_embeddings", 0) or 1 << 30
        config.env.max_tokens = min(config.env.max_tokens, room - max(map(len, prompt_ids)))
    generator = registry.build("rollout_backend", backend, rollout, field="rollout", args=(policy, tokenizer, model))

    sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    texts, lengths = [], []
    sample_rows = [r for r in rows for _ in range(n)]
    env_metrics: dict[str, float] = {}
    try:
        with counter(reporter, "evaluation", "samples", total=len(sample_rows)) as update:
            if environment is not None:  # multi-turn episodes, scored as the RL loop scores them
                runner = Episodes(type(environment), environment.config, config, tokenizer, generator, vision)
                played = []
                for start in range(0, len(rows), batch_size):
                    played += runner.play(rows[start : start + batch_size], sampling)
                    update(len(played))
            else:
                for start in range(0, len(rows), batch_size):
                    part = images[start : start + batch_size]
                    for group in generate_from(generator, prompt_ids[start : start + batch_size], sampling, part):
                        texts += [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
                        lengths += [len(c.token_ids) for c in group]
                    update(len(texts))
        if environment is not None:
            texts = [e.final_answer() for e in played]
            lengths = [e.used for e in played]
            scores, reward_metrics = runner.rewards(played, scorer, Failures(getattr(scorer, "name", "reward")))
            reward_metrics.setdefault("reward/errors", 0.0)
            reward_metrics.setdefault("reward/timeouts", 0.0)
            env_metrics = runner.metrics(played)
    finally:
        generator.close()
    if environment is None:
        scores, reward_metrics = score_batch(scorer, [r["prompt"] for r in sample_rows], texts, sample_rows)

    metrics, samples = pass_metrics(n, rows, texts, lengths, scores, reward_metrics, env_metrics)
    return {
        "model": model,
        "data": source.origin,
        "reward": getattr(scorer, "name", type(scorer).__name__),
        "n": n,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "env": env,
        "metrics": metrics,
        "samples": samples,
    }
