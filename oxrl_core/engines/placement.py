"""Where Ray actors run: training ranks in one placement group, rollout actors by ``rollout.actor_placement``.

A cluster is a list of `Node` (one per alive Ray node). The training ranks ask for one bundle each
(``{"CPU": 1}``, plus ``{"GPU": 1}`` on a cluster with GPUs) in one placement group with Ray's PACK
strategy (as few nodes as possible); once Ray has placed the bundles, ranks are numbered so that a
node's ranks are contiguous (`rank_order`), as torchrun numbers them, and each rank learns its
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (`topology`). On GPUs every rank sees its node's
training GPUs in local-rank order (`visible_devices`), so ``cuda:LOCAL_RANK`` is its own GPU and NCCL sees
its peers. Torch threads per actor are its node's CPUs ÷ the actors sharing them (`threads_per_node`).

A group the cluster cannot hold is refused: at once when the cluster's totals are too small, else
after ``engine.timeout_s`` with what each node has free and what was asked (`place_group`) — a
busy cluster never makes a run hang.

Rollout actors reserve no CPU on a CPU-only cluster (generation and training take turns on the same
cores), so there is nothing for a placement group to reserve: they are pinned to nodes with node
affinity, chosen by `rollout_nodes`. On a cluster with GPUs each actor reserves a GPU, in a placement
group of its own (PACK, SPREAD, or every bundle on the named node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from oxrl_core.errors import OxrlError

#: ``rollout.actor_placement`` values besides a node id
PLACEMENTS = ("pack", "spread")


@dataclass(frozen=True)
class Node:
    """One alive Ray node: its id, host name and address, its CPUs and GPUs (total and free now)."""

    node_id: str
    host: str
    ip: str
    cpus: float
    gpus: float
    free_cpus: float
    free_gpus: float
    head: bool = False

    def describe(self) -> str:
        role = ", head" if self.head else ""
        gpus = f", {self.free_gpus:g} of {self.gpus:g} GPUs free" if self.gpus else ""
        return f"node {self.node_id[:8]} ({self.host}{role}): {self.free_cpus:g} of {self.cpus:g} CPUs free{gpus}"


def cluster_nodes(ray) -> list[Node]:
    """The cluster's alive nodes (head first, then in Ray's order), with their free resources when Ray tells them."""
    try:  # per-node free resources: a private helper of Ray's; without it, free = total
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - an older/newer Ray without it: the message shows totals only
        free = {}
    nodes = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        total = info.get("Resources", {})
        avail = free.get(info["NodeID"], total)
        nodes.append(
            Node(
                node_id=info["NodeID"],
                host=info.get("NodeManagerHostname") or info.get("NodeManagerAddress", "?"),
                ip=info.get("NodeManagerAddress", "?"),
                cpus=float(total.get("CPU", 0)),
                gpus=float(total.get("GPU", 0)),
                free_cpus=float(avail.get("CPU", 0)),
                free_gpus=float(avail.get("GPU", 0)),
                head="node:__internal_head__" in total,
            )
        )
    return sorted(nodes, key=lambda n: not n.head)


def describe_cluster(nodes: list[Node]) -> str:
    return "; ".join(n.describe() for n in nodes) or "no alive nodes"


def _ask(bundles: list[dict]) -> str:
    count = len(bundles)
    each = ", ".join(f"{v:g} {k}" + ("s" if v != 1 else "") for k, v in bundles[0].items()) if bundles else "nothing"
    return f"{count} bundle{'s' if count != 1 else ''} of {each}"


def place_group(ray, bundles: list[dict], strategy: str, what: str, timeout_s: float, label_selector=None):
    """A ready placement group of ``bundles`` and each bundle's node id; refuses (removing the group) when Ray
    cannot place it within ``timeout_s``."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    kwargs = {"bundle_label_selector": label_selector} if label_selector else {}
    group = placement_group(bundles, strategy=strategy, **kwargs)
    deadline = time.monotonic() + timeout_s
    ready = False
    while not ready and time.monotonic() < deadline:  # short waits: a Ctrl-C is not held up by a long one
        ready = group.wait(min(5.0, max(0.1, deadline - time.monotonic())))
    if not ready:
        remove_placement_group(group)
        raise OxrlError(
            f"the Ray cluster could not place {what} within engine.timeout_s={timeout_s:g}s: asked for "
            f"{_ask(bundles)} ({strategy}); the cluster has {describe_cluster(cluster_nodes(ray))} "
            f"(other jobs may hold resources; see `ray status` and `oxrl doctor --ray-address ...`)"
        )
    table = placement_group_table(group)["bundles_to_node_id"]
    return group, [table[i] for i in range(len(bundles))]


def rank_order(bundle_nodes: list[str]) -> list[int]:
    """Bundle index for each rank: nodes in the order of their first bundle, a node's bundles contiguous.

    ``["b", "a", "b", "a"]`` → ``[0, 2, 1, 3]`` (ranks 0-1 on node b, ranks 2-3 on node a)."""
    first = {}
    for index, node in enumerate(bundle_nodes):
        first.setdefault(node, index)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first[bundle_nodes[i]], i))


def topology(rank_nodes: list[str]) -> list[dict]:
    """Each rank's place among its node's ranks, given each rank's node (contiguous per node):
    ``local_rank``, ``local_world_size`` and ``node_rank`` (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)."""
    order = list(dict.fromkeys(rank_nodes))
    out = []
    for rank, node in enumerate(rank_nodes):
        peers = [r for r, n in enumerate(rank_nodes) if n == node]
        out.append({"local_rank": peers.index(rank), "local_world_size": len(peers), "node_rank": order.index(node)})
    return out


def threads_per_node(actor_nodes: list[str], nodes: list[Node]) -> list[int]:
    """Torch threads for each actor: its node's CPUs ÷ the actors on that node (at least 1)."""
    cpus = {n.node_id: n.cpus for n in nodes}
    return [max(1, int(cpus.get(node, 1) // actor_nodes.count(node))) for node in actor_nodes]


def visible_devices(rank_nodes: list[str], rank_gpus: list[list[str]]) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each rank: the GPUs of its node's ranks in local-rank order, so that
    ``cuda:LOCAL_RANK`` is the rank's own GPU (Ray gives each actor only its own); "" without GPUs."""
    out = []
    for node in rank_nodes:
        ids = [gpu for n, gpus in zip(rank_nodes, rank_gpus) if n == node for gpu in gpus[:1]]
        out.append(",".join(ids))
    return out


def resolve_node(nodes: list[Node], wanted: str, field: str) -> Node:
    """The alive node whose id is ``wanted`` (or starts with it); refuses naming the cluster's nodes."""
    matches = [n for n in nodes if n.node_id == wanted] or [n for n in nodes if n.node_id.startswith(wanted)]
    if len(matches) != 1:
        listing = ", ".join(f"{n.node_id} ({n.host})" for n in nodes)
        why = "matches several nodes" if matches else "is not an alive node of the Ray cluster"
        raise OxrlError(f"{field}: {wanted!r} {why}; its nodes are: {listing} (`oxrl doctor --ray-address ...`)")
    return matches[0]


def rollout_nodes(placement: str, count: int, nodes: list[Node], anchor: str) -> list[str]:
    """The node of each of ``count`` rollout actors on a CPU-only cluster: ``pack`` all on ``anchor`` (the node of
    the rank that drives them), ``spread`` one per node in turn starting there, or all on the named node."""
    if placement == "pack":
        return [anchor] * count
    if placement == "spread":
        ids = [n.node_id for n in nodes]
        start = ids.index(anchor) if anchor in ids else 0
        ids = ids[start:] + ids[:start]
        return [ids[i % len(ids)] for i in range(count)]
    return [resolve_node(nodes, placement, "rollout.actor_placement").node_id] * count
