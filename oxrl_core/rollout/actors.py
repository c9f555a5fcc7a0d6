"""Rollout actors: ``rollout.actors: M`` runs the rollout backend in M Ray actors of its own.

By default rollouts are generated inside the training process(es): the `hf` backend on the
trained model itself, or a colocated vLLM engine. With ``rollout.actors: M`` (docs/architecture.md: N
training actors and M rollout actors) each actor loads the policy from its path and builds the
configured backend (`hf`, `vllm` or a plugin) on its own device; the trainer keeps a
`RolloutActors` proxy that is a `RolloutBackend` like any other:

- ``generate_shards``: the loop's seeded shards of whole prompts are dealt to the actors in turn
  and generated in parallel; the result is in shard order, so a run with M actors draws the same
  samples as a single-process run with the same ``engine.rollout_shards``;
- ``update_weights``: rank 0 puts the gathered weights (under LoRA the merged ones) in Ray's
  object store once, and every actor loads them in place and moves to the new policy version;
- ``score`` (the verified weight sync): every actor scores the probe; an actor that disagrees
  with the first one is an error, and the first one's logprobs are compared with the trainer's.

Only rank 0 talks to the actors; the other training ranks receive the rollouts by broadcast.
Every call is bounded by ``engine.timeout_s``; an actor that dies or raises stops the run with
its error. Actors ask Ray for one GPU each on a cluster with GPUs (in a placement group of their
own), and for no CPU reservation on a CPU-only one (they share their node's cores with the training
ranks, pinned to nodes by node affinity). ``rollout.actor_placement`` says where: ``pack`` (as few
nodes as possible, starting with the driving rank's), ``spread`` or a node id (`engines.placement`);
`RolloutActors.where` records where each actor ran (``rollout_actors.json`` in the run directory).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from oxrl_core.config import RolloutConfig
from oxrl_core.engines import placement
from oxrl_core.engines.distributed import ray_reason
from oxrl_core.engines.ray_cluster import join_ray
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Completion, RolloutBackend, SamplingParams, generate_from
from oxrl_core.models.lora import policy_state_dict
from oxrl_core.plugins import discover

#: actors whose probe logprobs differ from the first actor's by more than this hold other weights
REPLICA_TOLERANCE = 1e-5


class RolloutWorker:
    """One rollout actor: the configured backend on the policy loaded from ``model_path``."""

    def __init__(self, index: int, backend_name: str, model_path: str, rollout: dict, cwd: str, threads: int):
        import torch

        from oxrl_core.models.loading import load_causal_lm, load_tokenizer  # lazy: torch loads in the actor process

        os.chdir(cwd)  # relative plugin paths resolve as in the driver
        if threads:
            torch.set_num_threads(threads)
        self.index = index
        config = RolloutConfig.model_validate(rollout)
        tokenizer = load_tokenizer(model_path)
        model = load_causal_lm(model_path).to("cuda" if torch.cuda.is_available() else "cpu")
        self.backend = discover().build(
            "rollout_backend", backend_name, config, field="rollout", args=(model, tokenizer, model_path)
        )

    def __repr__(self) -> str:  # how Ray names this actor in its messages
        return f"oxrl rollout actor {self.index}"

    def where(self) -> dict:
        import socket

        import ray
        import torch

        return {
            "actor": self.index,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "threads": torch.get_num_threads(),
        }

    def generate(self, shards: list[tuple]) -> list[list[list[Completion]]]:
        """Each shard: (prompts, sampling[, each prompt's image inputs])."""
        return [
            generate_from(self.backend, shard[0], shard[1], shard[2] if len(shard) > 2 else None) for shard in shards
        ]

    def update_weights(self, state: dict, policy_version: int) -> None:
        self.backend.update_weights(state, policy_version)

    def score(self, token_ids: list[int]) -> list[float]:
        return self.backend.score(token_ids)

    def close(self) -> None:
        self.backend.close()


class RolloutActors(RolloutBackend):
    """The trainer's handle on the rollout actors (see the module docstring)."""

    name: ClassVar[str] = "actors"
    remote: ClassVar[bool] = True  # the RL loop: rank 0 generates every shard and broadcasts them

    def __init__(self, actors: list, backend_name: str, timeout_s: float, owns_ray: bool, group=None):
        self.actors = actors
        self.backend_name = backend_name
        self.timeout_s = timeout_s
        self.owns_ray = owns_ray
        self.group = group  # the actors' placement group (GPU clusters), removed at close
        self.policy_version = 0
        self.where: list[dict] = []  # where each actor runs: actor, pid, node_id, host, threads

    @classmethod
    def start(cls, count: int, backend_name: str, model_path: str, rollout, timeout_s: float, ray_address: str = ""):
        """Start ``count`` actors (joining the cluster `resolve_ray_address` names, or starting
        a local one, when this process is not connected to Ray yet) and wait until each has built its backend."""
        import ray

        owns_ray = not ray.is_initialized()  # a joined cluster is only disconnected from at close, and keeps running
        if owns_ray:  # the actors' own output (engine logs) stays in Ray's log files; their errors come back as errors
            join_ray(ray_address, log_to_driver=False, purpose="rollout.actors")
        proxy = cls([], backend_name, timeout_s, owns_ray)
        try:
            actor_cls = ray.remote(RolloutWorker)
            config = rollout.model_dump(mode="json")
            args = (backend_name, model_path, config, os.getcwd())
            proxy.actors = [
                actor_cls.options(**options, max_restarts=0).remote(i, *args, threads)
                for i, (options, threads) in enumerate(proxy._placed(ray, count, rollout.actor_placement))
            ]
            proxy.where = proxy._get([actor.where.remote() for actor in proxy.actors], "start")
        except BaseException:
            proxy.close()
            raise
        return proxy

    def _placed(self, ray, count: int, where: str) -> list[tuple[dict, int]]:
        """Each actor's Ray options and torch threads, by ``rollout.actor_placement`` (the module docstring)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        nodes = placement.cluster_nodes(ray)
        here = ray.get_runtime_context().get_node_id()  # the driving rank's node
        if ray.cluster_resources().get("GPU", 0):  # a GPU each, reserved in a placement group of the actors' own
            if where in placement.PLACEMENTS:
                strategy, selector = where.upper(), None  # Ray's PACK / SPREAD
            else:  # every bundle on the named node
                node = placement.resolve_node(nodes, where, "rollout.actor_placement").node_id
                strategy, selector = "STRICT_PACK", [{"ray.io/node-id": node}] * count
            what = f"{count} rollout actors (rollout.actor_placement: {where})"
            self.group, _ = placement.place_group(ray, [{"GPU": 1}] * count, strategy, what, self.timeout_s, selector)
            return [
                (
                    {
                        "num_gpus": 1,
                        "num_cpus": 0,
                        "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, i),
                    },
                    0,
                )
                for i in range(count)
            ]
        # CPU: generation and training take turns, so an actor reserves no CPU and its node's cores are shared out
        actor_nodes = placement.rollout_nodes(where, count, nodes, here)
        threads = placement.threads_per_node(actor_nodes, nodes)
        return [
            ({"num_gpus": 0, "num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}, t)
            for node, t in zip(actor_nodes, threads)
        ]

    def _get(self, refs: list, what: str) -> list:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise OxrlError(
                f"rollout actors ('{self.backend_name}'): could not {what} within engine.timeout_s={self.timeout_s:g}s"
            ) from None
        except ray.exceptions.RayError as exc:
            raise OxrlError(f"rollout actors ('{self.backend_name}'): could not {what}: {ray_reason(exc)}") from None

    # ------------------------------------------------------------------ rollouts

    def generate_shards(self, shards: list[tuple]) -> list[list[list[Completion]]]:
        """Shard k, (prompts, sampling[, each prompt's image inputs]), goes to actor k mod M; the shards come back in
        order."""
        if not self.actors:
            raise OxrlError("the rollout actors are closed")
        dealt = [list(range(i, len(shards), len(self.actors))) for i in range(len(self.actors))]
        refs = [actor.generate.remote([shards[k] for k in ks]) for actor, ks in zip(self.actors, dealt) if ks]
        out: list = [None] * len(shards)
        for ks, results in zip([ks for ks in dealt if ks], self._get(refs, "generate")):
            for k, groups in zip(ks, results):
                out[k] = groups
        return out

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, images: list[dict] | None = None
    ) -> list[list[Completion]]:
        """One shard: the first actor generates it."""
        return self.generate_shards([(prompt_token_ids, sampling, images)])[0]

    # ------------------------------------------------------------------ weights

    def update_weights(self, state: Any, policy_version: int) -> None:
        """The trainer's weights (a module or a state_dict) into every actor, through the object store once."""
        self.load_weights(self.put_weights(state), policy_version)

    def put_weights(self, state: Any):
        """The trainer's weights (a module or a state_dict) copied into Ray's object store once; a reference
        `load_weights` hands to every actor. (Asynchronous rollouts put them at once and load them later.)"""
        import ray
        import torch

        if isinstance(state, torch.nn.Module):
            state = policy_state_dict(state)  # under LoRA: the merged weights, under the base model's names
        return ray.put({name: tensor.detach().cpu() for name, tensor in state.items()})

    def load_weights(self, ref, policy_version: int) -> None:
        """Every actor loads the weights at ``ref`` (`put_weights`) and moves to ``policy_version``."""
        if not isinstance(policy_version, int) or policy_version <= self.policy_version:
            raise OxrlError(
                f"policy_version must increase: the backend is at {self.policy_version}, got {policy_version!r}"
            )
        self._get(
            [actor.update_weights.remote(ref, policy_version) for actor in self.actors],
            f"sync policy version {policy_version}",
        )
        self.policy_version = policy_version

    def score(self, token_ids: list[int]) -> list[float]:
        per_actor = self._get([actor.score.remote(list(token_ids)) for actor in self.actors], "score the probe")
        for index, logprobs in enumerate(per_actor[1:], start=1):
            gap = max((abs(a - b) for a, b in zip(logprobs, per_actor[0])), default=0.0)
            if not gap <= REPLICA_TOLERANCE:
                raise OxrlError(
                    f"rollout actor {index} scores the probe {gap:.3g} nats away from actor 0 after policy version "
                    f"{self.policy_version}: the actors hold different weights"
                )
        return per_actor[0]

    @classmethod
    def can_score(cls) -> bool:
        return True

    def close(self) -> None:
        import ray

        actors, self.actors = self.actors, []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.group is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - already removed, or the cluster is gone
                pass
            self.group = None
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False
