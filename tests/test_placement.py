"""Where ranks and rollout actors go (`oxrl_core.engines.placement`), by hand: rank numbering, node topology, threads
per node, visible GPUs, node ids and the rollout actors' placement modes. The two-node runs are in test_multinode.py."""

import pytest

from oxrl_core.config import RolloutConfig
from oxrl_core.engines import placement
from oxrl_core.engines.placement import Node
from oxrl_core.errors import OxrlError

A, B, C = "a" * 56, "b" * 56, "c" * 56


def _node(node_id: str, cpus: float, head: bool = False, gpus: float = 0) -> Node:
    return Node(node_id, f"host-{node_id[0]}", "10.0.0.1", cpus, gpus, cpus, gpus, head)


def test_ranks_are_numbered_so_that_each_nodes_ranks_are_contiguous():
    # Ray placed bundles 0 and 2 on node b, 1 and 3 on node a: ranks 0-1 take b's bundles, ranks 2-3 a's
    assert placement.rank_order([B, A, B, A]) == [0, 2, 1, 3]
    assert placement.rank_order([A, A, A]) == [0, 1, 2]
    assert placement.rank_order([C, A, B]) == [0, 1, 2]
    rank_nodes = [[B, A, B, A][i] for i in placement.rank_order([B, A, B, A])]
    assert rank_nodes == [B, B, A, A]


def test_topology_gives_torchruns_local_rank_local_world_size_and_group_rank():
    assert placement.topology([B, B, A, A, A]) == [
        {"local_rank": 0, "local_world_size": 2, "node_rank": 0},
        {"local_rank": 1, "local_world_size": 2, "node_rank": 0},
        {"local_rank": 0, "local_world_size": 3, "node_rank": 1},
        {"local_rank": 1, "local_world_size": 3, "node_rank": 1},
        {"local_rank": 2, "local_world_size": 3, "node_rank": 1},
    ]


def test_threads_are_each_nodes_own_cpus_divided_by_its_actors():
    nodes = [_node(A, 8, head=True), _node(B, 3)]
    # node a: 8 CPUs ÷ 2 ranks; node b: 3 CPUs ÷ 1 rank — not the cluster's 11 ÷ 3
    assert placement.threads_per_node([A, A, B], nodes) == [4, 4, 3]
    assert placement.threads_per_node([B, B, B, B], nodes) == [1, 1, 1, 1]  # at least one thread each


def test_each_rank_sees_its_nodes_training_gpus_in_local_rank_order():
    # Ray gave ranks 0-1 (node a) GPUs 3 and 1, ranks 2-3 (node b) GPUs 0 and 2: cuda:LOCAL_RANK is each rank's own
    visible = placement.visible_devices([A, A, B, B], [["3"], ["1"], ["0"], ["2"]])
    assert visible == ["3,1", "3,1", "0,2", "0,2"]
    for local_rank, (devices, own) in enumerate(zip(visible[:2], ["3", "1"])):
        assert devices.split(",")[local_rank] == own
    assert placement.visible_devices([A, B], [[], []]) == ["", ""]  # CPU ranks: nothing to set


def test_rollout_actors_pack_spread_or_go_to_a_named_node():
    nodes = [_node(A, 2, head=True), _node(B, 1), _node(C, 1)]
    assert placement.rollout_nodes("pack", 3, nodes, anchor=B) == [B, B, B]  # the driving rank's node
    assert placement.rollout_nodes("spread", 4, nodes, anchor=B) == [B, C, A, B]  # from there, node after node
    assert placement.rollout_nodes(C, 2, nodes, anchor=A) == [C, C]
    assert placement.rollout_nodes("cccccc", 1, nodes, anchor=A) == [C]  # a unique prefix is enough


def test_an_unknown_or_ambiguous_node_id_is_refused_naming_the_clusters_nodes():
    nodes = [_node(A, 2, head=True), _node("ab" + "0" * 54, 1)]
    with pytest.raises(OxrlError, match="rollout.actor_placement: 'dddddd' is not an alive node") as err:
        placement.rollout_nodes("dddddd", 1, nodes, anchor=A)
    assert A in str(err.value) and "host-a" in str(err.value)
    with pytest.raises(OxrlError, match="matches several nodes"):
        placement.rollout_nodes("a", 1, nodes, anchor=A)


def test_actor_placement_is_validated_in_the_config():
    assert RolloutConfig().actor_placement == "pack"
    assert RolloutConfig(actor_placement=" spread ").actor_placement == "spread"
    assert RolloutConfig(actor_placement=A).actor_placement == A
    for bad in ("nodeA", "packed", "abc"):
        with pytest.raises(ValueError, match="neither 'pack', 'spread' nor a Ray node id"):
            RolloutConfig(actor_placement=bad)


def test_a_node_describes_its_free_and_total_resources():
    node = Node(A, "gpu-box", "10.0.0.2", 16, 8, 12, 2, head=True)
    assert node.describe() == "node aaaaaaaa (gpu-box, head): 12 of 16 CPUs free, 2 of 8 GPUs free"
    assert _node(B, 1).describe() == "node bbbbbbbb (host-b): 1 of 1 CPUs free"
