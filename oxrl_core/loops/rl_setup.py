"""Everything an RL run builds before its first step, in one function (`build_rl`) returning the parts
(`RLParts`) that `loops.rl.run_rl` steps with.

The order is the point: data and reward first (bad input fails before any model loads), then the models and
the fast path (chosen here, once), the engine, the rollout backend and the strategy (completions or
episodes), then the `Run` (which resumes a checkpoint) and the verified weight sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from oxrl_core.config import env_options
from oxrl_core.data.batching import make_plan
from oxrl_core.data.images import is_image_row
from oxrl_core.data.sources import eval_source, load_data
from oxrl_core.engines.state_files import load_state_file
from oxrl_core.errors import OxrlError
from oxrl_core.loops.run import Run
from oxrl_core.loops.setup import Setup
from oxrl_core.models.critic import build_critic
from oxrl_core.models.loading import initial_policy_path, load_causal_lm, load_tokenizer
from oxrl_core.models.packed_attention import PACKED_SDPA, attention_fast_paths, packed_attn_implementation
from oxrl_core.rl.batch import prepare_prompts, sync_weights
from oxrl_core.rl.dynamic_sampling import DynamicSampling
from oxrl_core.rl.records import RolloutInputs
from oxrl_core.rl.sources import RolloutSource, rollout_source
from oxrl_core.rl.strategies import RolloutStrategy, build_strategy, check_media_support, probe_prompt
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
    source: RolloutSource  # where each step's scored batch comes from: in turn, or generated ahead; chosen once
    rollout_log: RolloutLog  # rollouts.jsonl: a bounded sample of the rollouts (the report's viewer)
    extra_files: Callable[[Path], None]  # the loop's own checkpoint files (the critic)

    def close(self) -> None:
        self.rollout_log.close()
        self.source.close()  # asynchronous: the jobs still queued are dropped; the actors go next
        if self.backend is not None:
            self.backend.close()


def build_rl(trainer, ckpt: Path | None) -> RLParts:
    setup = Setup(trainer, ckpt)
    cfg, ro = setup.cfg, setup.cfg.rollout
    inputs = _inputs(setup)  # data, reward, environment: before any model loads, so bad input fails fast
    model, ref, critic, shared = _models(setup, inputs, ckpt)  # the fast path is chosen here, once
    # fits? a whole episode (env.max_tokens bounds it, whatever rollout.max_new_tokens is), or one completion;
    # the message names the setting that is too long
    env, ids = inputs.env, inputs.prompts.ids + (inputs.eval_prompts.ids if inputs.eval_prompts else [])
    longest, setting = (cfg.env.max_tokens, "env.max_tokens") if env else (ro.max_new_tokens, "rollout.max_new_tokens")
    check_generation_length(model, max(map(len, ids), default=0), longest, setting)
    total_steps = cfg.train.max_steps * ro.passes_per_batch * ro.minibatches
    engine = setup.build_engine(model, extra_modules=[critic] if critic else [], total_steps=total_steps)

    # ---- the rollout backend and the strategy (completions or episodes)
    backend, strategy = build_strategy(cfg, setup.registry, inputs, model, engine, setup.run_dir)
    source: RolloutSource | None = None  # chosen last, once the run and the backend's weights are settled

    def extra_files(tmp: Path) -> None:
        if critic is not None:
            torch.save(critic.state_dict(), tmp / "critic.pt")

    def checkpoint_files(tmp: Path) -> None:  # rank 0: + what the rollout source has in flight
        extra_files(tmp)
        source.save(tmp, run.position)

    # ---- the run (resumes a checkpoint), then the verified weight sync
    vision, tokenizer, prompts = inputs.vision, inputs.tokenizer, inputs.prompts
    saved_with = vision if vision is not None else tokenizer  # a VLM's final/ keeps its processor
    eval_rows = len(inputs.eval_prompts.rows) if inputs.eval_prompts is not None else 0
    evaluate = (lambda progress: source.evaluate(progress)) if eval_rows else None
    run = Run(
        setup, model, saved_with, engine, evaluate, extra=checkpoint_files, every_metric=True, eval_rows=eval_rows
    )
    try:
        # verified weight sync (oxrl_core.rollout.sync): the backend and the trainer score a fixed probe
        can_score = ro.sync_check and inputs.backend_cls.can_score()
        verify_sync = SyncCheck(backend, can_score, model, engine, tokenizer, probe_prompt(prompts), ro, run.start_step,
                                run.run_dir, run.info)  # fmt: skip
        if run.resumed:
            with engine.full_weights():  # ZeRO-3: the backend may read the weights
                sync_weights(backend, model, run.start_step)
        verify_sync(run.start_step)  # before training: a backend that loaded the wrong weights stops here
        plan = _plans(setup, inputs, strategy)
        samples = f"{cfg.train.batch_size}×{ro.n} samples/step"
        builtin = "built-in tiny Qwen2-VL (warm start)" if inputs.images else "built-in tiny llama (warm start)"
        run.banner(builtin, f"{inputs.train_source.origin} ({len(prompts.rows)} prompts) · "
                   f"reward {strategy.reward_name} · {samples}")  # fmt: skip
        rollout_log = RolloutLog(run.run_dir, cfg.logging.rollout_samples_every, cfg.train.max_steps, tokenizer,
                                 run.start_step if ckpt else None)  # fmt: skip
        # the source, chosen once (rl.sources.rollout_source): in turn, or generated ahead by the actors
        source = rollout_source(strategy, backend, plan, cfg, model, engine, verify_sync, run, ckpt)
    except OxrlError:
        if backend is not None:
            backend.close()
        raise
    return RLParts(run, tokenizer, plan, model, ref, critic, shared, backend, strategy, source, rollout_log,
                   extra_files)  # fmt: skip


def _inputs(setup: Setup) -> RolloutInputs:
    """The prompts (a VLM's through its processor), held-out prompts, reward and environment, checked before any
    model loads."""
    cfg, algorithm, ro = setup.cfg, setup.algorithm, setup.cfg.rollout
    train_source = load_data(cfg.data.train, "train", setup.registry)
    images = not cfg.model.name and any(is_image_row(r) for r in train_source.rows)  # the built-in VLM's warm start
    policy_path = initial_policy_path(cfg.model.name, tools=bool(cfg.env.name), reporter=setup.reporter, images=images)
    tokenizer = load_tokenizer(policy_path, trust_remote_code=cfg.model.trust_remote_code)
    vision = setup.vision(policy_path)
    prompts = prepare_prompts(train_source, tokenizer, cfg.data.max_length, vision)
    if prompts.dropped:
        setup.info(
            f"[yellow]note:[/yellow] {prompts.dropped} prompts dropped: longer than data.max_length={cfg.data.max_length}"
        )
    setup.steps_from_epochs(len(prompts.rows), "prompts", accum=1)  # train.epochs: one pass = every prompt once
    held_out = eval_source(cfg.data, setup.registry)
    eval_prompts = None if held_out is None else prepare_prompts(held_out, tokenizer, cfg.data.max_length, vision)
    reward = build_reward(cfg, setup.registry, algorithm.default_reward, train_source.dataset)
    if ro.n < algorithm.min_group_size:
        raise OxrlError(
            f"rollout.n: '{cfg.algorithm}' compares samples within a group and needs n >= "
            f"{algorithm.min_group_size}, got {ro.n}"
        )
    backend_cls, _ = setup.registry.check("rollout_backend", ro.backend, ro, field="rollout")  # before any model loads
    with_images = prompts.has_media or (eval_prompts is not None and eval_prompts.has_media)
    check_media_support(cfg, algorithm, backend_cls, policy_path, with_images, vision)
    env = None
    if cfg.env.name:  # multi-turn episodes: one instance built now, so a bad option or constructor stops here
        env = setup.registry.build("environment", cfg.env.name, env_options(cfg), field="env")
    return RolloutInputs(train_source, images, policy_path, tokenizer, vision, prompts, held_out, eval_prompts, reward,
                         backend_cls, env)  # fmt: skip


def _models(setup: Setup, inputs: RolloutInputs, ckpt: Path | None):
    """(policy, reference, critic, shared): the models, and the fast path chosen once. data.packing: the training
    forward packs a micro-batch into one row in which the samples of a prompt share one copy of it (not with a
    critic, whose values are read at every position)."""
    cfg, algorithm, policy_path = setup.cfg, setup.algorithm, inputs.policy_path
    attn = cfg.model.attn_implementation
    if cfg.data.packing and not algorithm.needs_critic:
        attn = packed_attn_implementation(attn)
    shared = attn == PACKED_SDPA
    if shared and inputs.env is not None:  # an episode's prompt can change mid-episode (fallback): padded rows
        shared = False
        setup.info("[yellow]note:[/yellow] data.packing: shared prompts do not apply to multi-turn episodes (env.name)")
    if shared and inputs.vision is not None:  # a packed row would need each segment's own image positions
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
    return model, ref, critic, shared


def _plans(setup: Setup, inputs: RolloutInputs, strategy) -> object:
    """The step's prompts in seeded order (`data.batching.BatchPlan`); with dynamic sampling, the refill rounds'
    plan, a stream of its own, given to the strategy."""
    cfg, rows = setup.cfg, inputs.prompts.rows
    sources, lengths = [r.get("_source", 0) for r in rows], [len(p) for p in inputs.prompts.ids]
    plan = setup.plan(inputs.train_source, sources, lengths, group_by_length=False)
    if cfg.rollout.dynamic_sampling:
        seed, size = cfg.train.seed, cfg.train.batch_size
        refill_plan = make_plan(inputs.train_source, sources, lengths, size, stream_seed(seed, "refill_plan"), False)
        strategy.dynamic = DynamicSampling(cfg.rollout, refill_plan, seed, size)
    return plan
