"""Joining Ray (`join_ray`, the one ``ray.init`` of a run's process), and asking a Ray cluster for its alive nodes,
bounded in time, before anything else depends on it.

``ray.init(address=...)`` at an address where no Ray cluster answers does not fail: on a closed port or a port
where another server listens it retries, logging every 30 s, for as long as it is left. So a run that joins a
cluster (``engine.ray_address`` or ``$RAY_ADDRESS``; `check_cluster`) and ``oxrl doctor`` first probe it: a TCP
connection to ``host:port`` (an answer at once when nothing listens), then a join from a child process that is
killed after the bound (``min(engine.timeout_s, 60 s)`` for a run), which prints the nodes as one JSON line and
leaves (the cluster keeps running). ``local`` is never probed: it means a new cluster of the run's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading

from oxrl_core.engines.distributed import env_for_actors, ray_reason, resolve_ray_address
from oxrl_core.engines.placement import PLACEMENTS, Node, resolve_node
from oxrl_core.errors import OxrlError

#: the longest a run waits for a cluster to answer its probe (less when engine.timeout_s is smaller)
RUN_PROBE_LIMIT_S = 60.0
#: the quick TCP check's own bound
_CONNECT_S = 5.0


def join_ray(configured: str, *, log_to_driver: bool, purpose: str = "") -> None:
    """Connect this process to Ray: the cluster `resolve_ray_address` names for ``configured`` (the config's
    ``engine.ray_address``, else ``$RAY_ADDRESS``), or a new local one. The training launcher and the rollout actors
    both join this way, so they see the same cluster, give their actors the same environment (`env_for_actors`),
    keep oxRL's Ctrl-C / SIGTERM handling (`kept_signal_handlers`) and fail with the same message: one `OxrlError`
    naming the address and where it came from, after ``purpose`` (the setting that needed Ray) when given.
    ``log_to_driver``: whether the actors' output is printed by this process (the ranks' is the run's output; the
    rollout actors' engine logs stay in Ray's files)."""
    import ray

    address, source = resolve_ray_address(configured)
    try:
        with kept_signal_handlers():
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=log_to_driver,
                logging_level=logging.ERROR,
                runtime_env={"env_vars": env_for_actors()},
            )
    except Exception as exc:  # noqa: BLE001 - an unreachable address, a broken install: one message
        where = f"join the Ray cluster at {source}={address!r}" if source else "start a local Ray cluster"
        raise OxrlError(f"{purpose}{': ' if purpose else ''}could not {where}: {type(exc).__name__}: {exc}") from None


@contextlib.contextmanager
def kept_signal_handlers():
    """Around ``ray.init``: Ray's core worker installs C-level handlers of its own (on SIGTERM it aborts the
    process with a stack dump); oxRL's are put back afterwards, so Ctrl-C / SIGTERM still save a checkpoint."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


class Unreachable(OxrlError):
    """No Ray cluster answered at the address (its text: what happened, naming the address and its source)."""


def probe_nodes(address: str, where: str, timeout_s: float) -> list[Node]:
    """The alive nodes of the Ray cluster at ``address`` (described as ``where`` in messages), asked from a child
    process killed after ``timeout_s``; `Unreachable` when nothing (or nothing Ray) answers in time."""
    hostport = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)", address)
    if hostport:  # a quick answer for an address where nothing listens
        try:
            socket.create_connection((hostport.group(1), int(hostport.group(2))), timeout=_CONNECT_S).close()
        except OSError as exc:
            raise Unreachable(f"nothing answers at {where}: {exc.strerror or exc}") from None
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from oxrl_core.engines.ray_cluster import _child; _child()", address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise Unreachable(f"no answer from a Ray cluster at {where} within {timeout_s:g} s") from None
    answer = next((line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")), "")
    if not answer:
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), f"exit {proc.returncode}")
        raise Unreachable(f"could not join {where}: {last.strip()}")
    probe = json.loads(answer)
    if "error" in probe:
        raise Unreachable(f"could not join {where}: {probe['error']}")
    nodes = [
        Node(n["node_id"], n["host"] or n["ip"], n["ip"], n["cpus"], n["gpus"], n["cpus"], n["gpus"], n["head"])
        for n in probe["nodes"]
    ]
    return sorted(nodes, key=lambda n: (not n.head, n.ip, n.node_id))


def _child() -> None:
    """In the child process of `probe_nodes`: join the cluster at ``argv[1]``, print its alive nodes as one JSON
    line (or ``{"error": ...}``), leave. Ray's own log lines stay on this process's stderr."""
    import ray

    try:
        ray.init(address=sys.argv[1], include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        try:
            nodes = [
                {
                    "node_id": n["NodeID"],
                    "host": n.get("NodeManagerHostname", ""),
                    "ip": n.get("NodeManagerAddress", ""),
                    "cpus": n.get("Resources", {}).get("CPU", 0),
                    "gpus": n.get("Resources", {}).get("GPU", 0),
                    "head": "node:__internal_head__" in n.get("Resources", {}),
                }
                for n in ray.nodes()
                if n.get("Alive")
            ]
        finally:
            ray.shutdown()  # only disconnects: the cluster keeps running
    except Exception as exc:  # noqa: BLE001 - a wrong address or a refused token fails in any way: one line
        print(json.dumps({"error": f"{type(exc).__name__}: {ray_reason(exc)}"}), flush=True)
        return
    print(json.dumps({"nodes": nodes}), flush=True)


def check_cluster(engine, rollout, uses_rollout_actors: bool) -> None:
    """Before any model loads: a run that will use Ray (``engine.world_size`` > 1, or rollout actors) and names a
    cluster can join it within ``min(engine.timeout_s, 60 s)``, and a node id in ``rollout.actor_placement`` is one
    of its alive nodes. A new local cluster (no address, or ``local``) has no node ids to name in advance."""
    actors = uses_rollout_actors and rollout.actors > 0
    if not (engine.world_size > 1 or actors):
        return
    address, source = resolve_ray_address(engine.ray_address)
    named_node = actors and rollout.actor_placement not in PLACEMENTS
    if not source or address == "local":
        if named_node:
            raise OxrlError(
                f"rollout.actor_placement={rollout.actor_placement!r} names a Ray node, but this run starts a new "
                "local Ray cluster (no engine.ray_address, RAY_ADDRESS unset), whose node ids do not exist yet: use "
                "pack or spread, or join a running cluster with engine.ray_address (`oxrl doctor --ray-address "
                "ADDRESS` lists its node ids)"
            )
        return
    limit = min(engine.timeout_s, RUN_PROBE_LIMIT_S)
    try:
        nodes = probe_nodes(address, f"{address} (from {source})", limit)
    except Unreachable as exc:
        raise OxrlError(
            f"{source}={address!r}: {exc}; start the cluster (`ray start --head`) or correct {source} "
            "(`oxrl doctor --ray-address ADDRESS` checks one)"
        ) from None
    if named_node:
        resolve_node(nodes, rollout.actor_placement, "rollout.actor_placement")
