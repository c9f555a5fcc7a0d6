"""Everything an RL run builds before its first step, in one function (`build_rl`) returning the parts
(`RLParts`) that `loops.rl.run_rl` steps with.

The order is the point: data and reward first (bad input fails before any model loads), then the models and
the fast path (chosen here, once), the engine, the rollout backend and the strategy (completions or
episodes), then the `Run` (which resumes a checkpoint) and the verified weight sync.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from oxrl_core.atomic import write_text_atomic
from oxrl_core.config import env_options
from oxrl_core.data.batching import make_plan
from oxrl_core.data.images import is_image_row
from oxrl_core.data.sources import eval_source, load_data
from oxrl_core.engines.distributed import is_main, world_size
from oxrl_core.engines.state_files import load_state_file
from oxrl_core.errors import OxrlError
from oxrl_core.loops.run import Run
from oxrl_core.loops.setup import Setup
from oxrl_core.models.critic import build_critic
from oxrl_core.models.loading import initial_policy_path, load_causal_lm, load_tokenizer
from oxrl_core.models.packed_attention import PACKED_SDPA, attention_fast_paths, packed_attn_implementation
from oxrl_core.rl.batch import prepare_prompts, sync_weights
from oxrl_core.rl.dynamic_sampling import DynamicSampling
from oxrl_core.rl.episodes import Episodes
from oxrl_core.rl.sources import AsyncRollouts, load_in_flight
from oxrl_core.rl.strategies import Completions, EpisodeRollouts, RolloutStrategy
from oxrl_core.rollout.hf import check_generation_length
from oxrl_core.rollout.log import RolloutLog
from oxrl_core.rollout.sync import SyncCheck
from oxrl_core.scoring.rewards import build_reward
from oxrl_core.seeds import stream_seed


@dataclass
class RLParts:
    """The parts of an RL run, complete before step 1."""

    run: Run
    tokenizer: object
    plan: object  # `data.batching.BatchPlan` over the prompts: train.batch_size of them a step, seeded
    model: torch.nn.Module
    ref: torch.nn.Module | None  # the frozen reference (when the algorithm uses one)
    critic: torch.nn.Module | None
    shared: bool  # the fast path: the samples of a prompt share one copy of it in a packed row
    backend: object | None  # the rollout backend (None on ranks other than 0 with rollout actors)
    strategy: RolloutStrategy  # completions or multi-turn episodes, chosen once
    verify_sync: SyncCheck  # the trainer and the backend score a fixed probe alike
    rollout_log: RolloutLog  # rollouts.jsonl: a bounded sample of the rollouts (the report's viewer)
    extra_files: Callable[[Path], None]  # the loop's own checkpoint files (the critic)
    pipeline: AsyncRollouts | None = None  # rollout.max_staleness >= 1: batches generated ahead (`rl.sources`)

    def sync(self, version: int) -> dict:
        """Push the policy's weights to the backend as ``version`` and verify them (the probe's metrics).
        Asynchronous rollouts: pushed without waiting; the probe's check comes back with a later step."""
        if self.pipeline is not None:
            return self.pipeline.push(version, last=version == self.run.cfg.train.max_steps)
        with self.run.engine.full_weights():  # ZeRO-3: the backend may read the weights
            sync_weights(self.backend, self.model, version)
        return self.verify_sync(version)

    def close(self) -> None:
        self.rollout_log.close()
        if self.pipeline is not None:
            self.pipeline.close()  # the jobs still queued are dropped; the actors go next
        if self.backend is not None:
            self.backend.close()


def build_rl(trainer, ckpt: Path | None) -> RLParts:
    setup = Setup(trainer, ckpt)
    cfg, algorithm, ro = setup.cfg, setup.algorithm, setup.cfg.rollout
    if ro.dynamic_sampling and ro.max_staleness and cfg.env.name:
        raise OxrlError(
            f"rollout.dynamic_sampling with rollout.max_staleness={ro.max_staleness} and env.name={cfg.env.name}: "
            "asynchronous rollouts support dynamic sampling for single-turn completions only; for multi-turn "
            "episodes set rollout.max_staleness=0 (dynamic sampling works there) or rollout.dynamic_sampling=false"
        )

    # ---- data and reward (before any model loads, so bad input fails fast); a VLM's prompts go through its processor
    train_source = load_data(cfg.data.train, "train", setup.registry)
    images = not cfg.model.name and any(is_image_row(r) for r in train_source.rows)  # the built-in VLM's warm start
    policy_path = initial_policy_path(cfg.model.name, tools=bool(cfg.env.name), reporter=setup.reporter, images=images)
    tokenizer = load_tokenizer(policy_path, trust_remote_code=cfg.model.trust_remote_code)
    vision = setup.vision(policy_path)
    prompts = prepare_prompts(train_source, tokenizer, cfg.data.max_length, vision)
    rows, prompt_ids = prompts.rows, prompts.ids
    if prompts.dropped:
        setup.info(
            f"[yellow]note:[/yellow] {prompts.dropped} prompts dropped: longer than data.max_length={cfg.data.max_length}"
        )
    setup.steps_from_epochs(len(rows), "prompts", accum=1)  # train.epochs: one pass = every prompt once
    held_out = eval_source(cfg.data, setup.registry)
    eval_prompts = None if held_out is None else prepare_prompts(held_out, tokenizer, cfg.data.max_length, vision)
    eval_rows, eval_ids = ([], []) if eval_prompts is None else (eval_prompts.rows, eval_prompts.ids)
    with_images = prompts.images is not None or (eval_prompts is not None and eval_prompts.images is not None)
    reward = build_reward(cfg, setup.registry, algorithm.default_reward, train_source.dataset)
    if ro.n < algorithm.min_group_size:
        raise OxrlError(
            f"rollout.n: '{cfg.algorithm}' compares samples within a group and needs n >= "
            f"{algorithm.min_group_size}, got {ro.n}"
        )
    backend_cls, _ = setup.registry.check("rollout_backend", ro.backend, ro, field="rollout")  # before any model loads
    if with_images:
        _check_images(cfg, algorithm, backend_cls, policy_path)
    elif cfg.env.name and vision is not None and (reason := backend_cls.image_support(policy_path)) is not None:
        raise OxrlError(  # an environment may show a VLM images mid-episode: the backend must take them
            f"rollout.backend={cfg.rollout.backend}: a vision-language model's episodes (env.name={cfg.env.name}) "
            f"may be shown images by the environment and {reason}; generate with rollout.backend=hf"
        )
    env = None
    if cfg.env.name:  # multi-turn episodes: one instance built now, so a bad option or constructor stops here
        env = setup.registry.build("environment", cfg.env.name, env_options(cfg), field="env")

    # ---- models; the fast path is chosen here, once. data.packing: the training forward packs a
    # micro-batch into one row in which the samples of a prompt share one copy of it (not with a
    # critic, whose values are read at every position)
    attn = cfg.model.attn_implementation
    if cfg.data.packing and not algorithm.needs_critic:
        attn = packed_attn_implementation(attn)
    shared = attn == PACKED_SDPA
    if shared and env is not None:  # an episode's prompt can change mid-episode (fallback): padded rows
        shared = False
        setup.info("[yellow]note:[/yellow] data.packing: shared prompts do not apply to multi-turn episodes (env.name)")
    if shared and vision is not None:  # a packed row would need each segment's own image positions: padded rows
        shared = False
        setup.info("[yellow]note:[/yellow] data.packing: a vision-language model's rollout rows are padded, not packed")
    start = setup.start_from(policy_path)
    model = load_causal_lm(start, attn_implementation=attn, trust_remote_code=cfg.model.trust_remote_code,
                           reporter=setup.reporter)  # fmt: skip
    if shared and not (fast := attention_fast_paths(model.config))["shared_prefix"][0]:
        shared = False  # decided once: padded rows
        setup.info(
            f"[yellow]note:[/yellow] data.packing: shared prompts do not apply ({fast['shared_prefix'][1]}); "
            "training on padded rows"
        )
    ref = setup.reference(policy_path, attn) if algorithm.uses_ref() else None
    shared = setup.packs_exactly(shared and "shared", model, ref, unshared="it trains on padded rows") == "shared"
    model = setup.policy(model)
    critic = None
    if algorithm.needs_critic:
        critic = build_critic(
            model, algorithm.critic_layout(), lambda: load_causal_lm(policy_path, reporter=setup.reporter)
        )
        if ckpt is not None:
            critic.load_state_dict(load_state_file(ckpt / "critic.pt"))
    # fits? a whole episode (env.max_tokens bounds it, whatever rollout.max_new_tokens is), or one completion;
    # the message names the setting that is too long
    longest, setting = (cfg.env.max_tokens, "env.max_tokens") if env else (ro.max_new_tokens, "rollout.max_new_tokens")
    check_generation_length(model, max(map(len, prompt_ids + eval_ids), default=0), longest, setting)
    total_steps = cfg.train.max_steps * ro.passes_per_batch * ro.minibatches
    engine = setup.build_engine(model, extra_modules=[critic] if critic else [], total_steps=total_steps)

    # ---- the rollout backend and the strategy (completions or episodes)
    if ro.actors:  # rollout.actors: the backend in Ray actors of its own; rank 0 drives them
        from oxrl_core.rollout.actors import RolloutActors  # lazy: Ray starts only when rollout.actors is set

        args = (ro.actors, ro.backend, policy_path, ro, cfg.engine.timeout_s, cfg.engine.ray_address)
        backend = RolloutActors.start(*args) if is_main() else None
        if backend is not None:  # where each actor runs (rollout.actor_placement), beside ranks.json
            text = json.dumps(backend.where, indent=2) + "\n"
            write_text_atomic(Path(setup.run_dir) / "rollout_actors.json", text)
    else:
        backend = setup.registry.build(
            "rollout_backend", ro.backend, ro, field="rollout", args=(model, tokenizer, policy_path)
        )
    shards = cfg.engine.rollout_shards or world_size()
    common = dict(
        reward=reward, rows=rows, ro=ro, run_dir=setup.run_dir, eval_rows=eval_rows,
        eval_dataset=held_out.dataset if held_out is not None else None, seed=cfg.train.seed,
    )  # fmt: skip
    if env is not None:
        episodes = Episodes(type(env), env.config, cfg, tokenizer, backend, vision)
        strategy = EpisodeRollouts(episodes, engine, cfg.env, shards, **common)
    else:
        strategy = Completions(backend, engine, tokenizer, prompts, eval_prompts, shards, **common)

    pipeline: AsyncRollouts | None = None  # built last, once the run and the backend's weights are settled

    def evaluate(progress) -> dict:  # rank 0 evaluates (on whole parameters under ZeRO-3)
        with engine.full_weights():
            if pipeline is not None:  # asynchronous: the worker generates with the actors, after its queued jobs
                return pipeline.evaluate(strategy.evaluate, progress)
            return strategy.evaluate(progress) if is_main() else {}

    def extra_files(tmp: Path) -> None:
        if critic is not None:
            torch.save(critic.state_dict(), tmp / "critic.pt")

    def checkpoint_files(tmp: Path) -> None:  # rank 0: + an asynchronous run's in-flight batches
        extra_files(tmp)
        if pipeline is not None:
            pipeline.save(tmp, run.position)

    # ---- the run (resumes a checkpoint), then the verified weight sync
    saved_with = vision if vision is not None else tokenizer  # a VLM's final/ keeps its processor
    run = Run(
        setup,
        model,
        saved_with,
        engine,
        evaluate if eval_rows else None,
        extra=checkpoint_files,
        every_metric=True,
        eval_rows=len(eval_rows),
    )
    k = ro.max_staleness
    loaded = load_in_flight(ckpt, k, run.start_step, cfg.train.max_steps) if ckpt is not None else {}
    # verified weight sync (oxrl_core.rollout.sync): the backend and the trainer score a fixed probe
    can_score = ro.sync_check and backend_cls.can_score()
    verify_sync = SyncCheck(
        backend, can_score, model, engine, tokenizer, _probe_prompt(prompts), ro, run.start_step, run.run_dir, run.info
    )
    try:
        if run.resumed:
            with engine.full_weights():  # ZeRO-3: the backend may read the weights
                sync_weights(backend, model, run.start_step)
        verify_sync(run.start_step)  # before training: a backend that loaded the wrong weights stops here
    except OxrlError:
        if backend is not None:
            backend.close()
        raise
    sources, lengths = [r.get("_source", 0) for r in rows], [len(p) for p in prompt_ids]
    plan = setup.plan(train_source, sources, lengths, group_by_length=False)  # prompts in seeded order
    if ro.dynamic_sampling:  # refill rounds take their prompts from a second plan, a stream of its own
        seed = cfg.train.seed
        refill_plan = make_plan(
            train_source, sources, lengths, cfg.train.batch_size, stream_seed(seed, "refill_plan"), False
        )
        strategy.dynamic = DynamicSampling(ro, refill_plan, seed, cfg.train.batch_size)
    samples = f"{cfg.train.batch_size}×{ro.n} samples/step"
    builtin = "built-in tiny Qwen2-VL (warm start)" if images else "built-in tiny llama (warm start)"
    run.banner(builtin, f"{train_source.origin} ({len(rows)} prompts) · "
               f"reward {strategy.reward_name} · {samples}")  # fmt: skip
    rollout_log = RolloutLog(
        run.run_dir, cfg.logging.rollout_samples_every, cfg.train.max_steps, tokenizer, run.start_step if ckpt else None
    )
    if k:  # asynchronous rollouts: the worker starts generating the first k+1 batches (or the resumed ones' next)
        _async_notes(ro, run.info)
        pipeline = AsyncRollouts(strategy, backend, plan, cfg, model, engine, verify_sync.probe, verify_sync.tolerance,
                                 run.start_step, loaded, run.run_dir)  # fmt: skip
    return RLParts(run, tokenizer, plan, model, ref, critic, shared, backend, strategy, verify_sync, rollout_log,
                   extra_files, pipeline)  # fmt: skip


def _async_notes(ro, info) -> None:
    """What an asynchronous run does differently, said once at the start."""
    k, cap = ro.max_staleness, ro.importance_cap
    unset = " (rollout.tis_cap unset)" if ro.tis_cap is None else ""
    weights = f"masked outside [{ro.is_low:g}, {cap:g}]" if ro.is_mode == "mask" else f"truncated at {cap:g}"
    alarm = "" if ro.max_logprob_diff is not None else "; the logprob mismatch alarm is off (rollout.max_logprob_diff)"
    info(
        f"asynchronous rollouts: rollout.max_staleness={k} — the {ro.actors} rollout actor(s) generate up to {k} "
        f"steps ahead; the batch of step s comes from policy version max(0, s-1-{k}) (checked); importance weights "
        f"π_old/π_rollout {weights}{unset}{alarm}"
    )
    extra = [f"rollout.{key}={getattr(ro, key)}" for key in ("minibatches", "passes_per_batch") if getattr(ro, key) > 1]
    if extra:
        info(
            f"[yellow]note:[/yellow] {' and '.join(extra)} add optimiser steps within a batch on top of its "
            f"staleness: its later updates train on samples more than {k} versions behind"
        )


def _check_images(cfg, algorithm, backend_cls, policy_path: str) -> None:
    """What an RL run cannot do with image prompts, refused before any model loads, with what to use instead."""
    reason = backend_cls.image_support(policy_path)
    if reason is not None:
        raise OxrlError(
            f"rollout.backend={cfg.rollout.backend}: the data has image prompts and {reason}; "
            "generate with rollout.backend=hf (transformers' generate, which takes the model's image inputs)"
        )
    if getattr(algorithm.config, "critic", "shared") == "separate":
        raise OxrlError(
            "alg.critic=separate: the separate critic is a copy of the language model alone, which reads no "
            "images; with image prompts use alg.critic=shared (the value head on the policy's hidden states)"
        )


def _probe_prompt(prompts) -> list[int]:
    """The weight-sync probe's prompt: the first text prompt (the probe is scored without images), or none."""
    if prompts.images is None:
        return prompts.ids[0]
    return next((ids for ids, fields in zip(prompts.ids, prompts.images) if not fields), [])
