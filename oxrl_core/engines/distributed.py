"""Data parallelism inside the loops: the process group, this rank's share of a batch, reductions.

Every rank of a data-parallel run executes the same loop (SPMD, as under torchrun); the Ray
launcher (`oxrl_core.launcher`) only starts the ranks. The loops call the helpers below at the
points where ranks must agree, and in a single process every helper is the identity, so the
single-process run executes exactly the code it always did:

- `shard(rows, unit)`: this rank's contiguous block of whole units (rows, or groups of rows) of a
  micro-batch. A rank left without rows gets the first unit again, flagged as padding, and gives
  it loss weight 0: every rank must run the same forward/backward passes, because DeepSpeed
  gathers (ZeRO-3) and reduces (ZeRO-2/3) parameters and gradients inside them.
- `all_reduce_sum(values)`: loss-token counts and metric sums over ranks. A loop weights micro-batch
  parts by their share of the *global* loss tokens, so the gradient summed over ranks is the
  gradient of the single-process batch (the engine turns DeepSpeed's mean over ranks into a sum).
- `gather_rows(part, positions, total)`: per-row results (log-probabilities, values) of each
  rank's rows, assembled on every rank.
- `all_gather_object(obj)`, `barrier()`, `rank()`, `world_size()`, `is_main()`.

Every collective runs on the process group made by `init_process_group`, whose timeout is
``engine.timeout_s``: a rank whose peer died gets an error instead of waiting forever.

Checked collectives. Collectives pair by their order alone: if one rank issues a collective that
another does not, the next ones pair up wrongly and return garbage or wait forever (a count that
comes back as garbage once made rank 0 loop in the chunked LM head). So every collective oxRL issues
itself goes through `_exchange`, which all-gathers a tag — a fixed marker, the call site
(``module:line (function)``) and this rank's call number — with the values; ranks that differ stop
the run at once with `CollectiveMismatch`, naming the step, the call sites and the ranks. A collective
issued inside `local_section()` (``engine.full_weights()``: code that may run on one rank only)
raises at once, in one process too, so the test suite catches the mistake without two ranks.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
from datetime import timedelta

from oxrl_core.errors import OxrlError

#: environment that Ray actors need in order to behave like the driver (caches, offline flags, thread counts)
FORWARDED_ENV = ("OXRL_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "OMP_")


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def is_main() -> bool:
    """Rank 0 writes the run directory (metrics, config, checkpoints, final/) and prints."""
    return rank() == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(device_type: str, timeout_s: float) -> None:
    """Join the run's process group (no-op when already in one).

    Under the launcher, RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the driver; a
    single-process DeepSpeed run makes a group of one on localhost.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "OXRL_LAUNCHED" not in os.environ:  # a single process: a group of one
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    dist.init_process_group(
        backend_for(device_type),
        init_method="env://",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )


def _device():
    """Where collective buffers live: the GPU for nccl, the CPU for gloo."""
    import torch

    dist = _dist()
    if dist is not None and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CollectiveMismatch(OxrlError):
    """Ranks issued different collectives (a bug in oxRL or a plugin): stopped before they compute with
    values meant for another call or wait for one another forever."""


class CollectiveFailed(OxrlError):
    """A checked collective failed: a peer died (gloo aborts a process that receives a collective it did not
    expect), waited past ``engine.timeout_s``, or stopped at a mismatch. ``where``: the call site, its number
    and the step."""

    where = ""


#: the first element of every tag; another collective's data that pairs with a tag lacks it
TAG_MARK = 4_093_211.0
#: characters of the call site a tag carries
SITE_CHARS = 64
_HEADER = 4 + SITE_CHARS  # mark, call number, step, number of values; then the call site
#: float64 elements of a tag on the wire (8 KiB: the tag, then up to TAG_FLOATS - _HEADER values). Larger than a
#: count or a small parameter gather it may meet when another rank skipped a collective: gloo aborts a process
#: that receives a longer message than it expects, so that rank stops at once instead of computing with the tag.
TAG_FLOATS = 1024

_local_depth = 0  # depth of `local_section()`s on this process
_step = 0  # the optimiser step in progress (0: before the first), for messages
_calls = 0  # checked collectives issued by this process


@contextlib.contextmanager
def local_section():
    """Code that may run on some ranks only (``engine.full_weights()``: rank 0 evaluating alone, each rank
    generating a different number of tokens): a collective issued inside raises `CollectiveMismatch`."""
    global _local_depth
    _local_depth += 1
    try:
        yield
    finally:
        _local_depth -= 1


def in_local_section() -> bool:
    return _local_depth > 0


def at_step(step: int) -> None:
    """The training loop's step in progress (named by a mismatch's message)."""
    global _step
    _step = step


_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")  # frames of their own before Python 3.12


def _call_site() -> str:
    """``module:line (function)`` of the first caller outside this module (the same on every rank)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_globals.get("__name__") == __name__ or frame.f_code.co_name in _COMPREHENSIONS
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_lineno} ({frame.f_code.co_name})"


def _when(step: int) -> str:
    return f"at step {step}" if step else "before the first step"


def _decode(row: list[float]) -> tuple[int, int, int, str] | None:
    """(call number, step, number of values, call site) of a received tag, or None when it is not one (another
    collective's data)."""
    if row[0] != TAG_MARK or not all(0 <= c < 0x110000 and c == int(c) for c in row[1:_HEADER]):
        return None
    site = "".join(chr(int(c)) for c in row[4:_HEADER] if c)
    return int(row[1]), int(row[2]), int(row[3]), site


def _exchange(values: list[float]) -> list[list[float]] | None:
    """One checked collective: every rank's ``values`` (float64), ``[values of rank 0, values of rank 1, ...]``,
    once every rank is known to be at the same call; None in one process.

    Every rank all-gathers its tag — the call site, its call number, the step, how many values — with its
    values, `TAG_FLOATS` elements in all, and compares the tags: ranks at different calls raise
    `CollectiveMismatch` naming each rank's call (a rank in a collective that is not a checked one sends no
    tag, and is named as such). More values than fit are gathered on their own once the tags agree.
    """
    site = _call_site()
    if _local_depth:
        raise CollectiveMismatch(
            f"a collective at {site} was issued inside engine.full_weights(), where ranks may run different "
            "code (rank 0 evaluating alone, each rank generating its own lengths): it would pair with another "
            "rank's different collective. This is a bug in oxRL or a plugin; move the collective outside."
        )
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return None
    import torch

    global _calls
    _calls += 1
    world, when, k = dist.get_world_size(), _when(_step), len(values)
    inline = _HEADER + k <= TAG_FLOATS  # values that fit travel with the tag
    codes = [float(ord(ch)) for ch in site[:SITE_CHARS]]
    tag = [TAG_MARK, float(_calls), float(_step), float(k), *codes, *[0.0] * (SITE_CHARS - len(codes))]
    sent = torch.zeros(TAG_FLOATS, dtype=torch.float64)
    sent[:_HEADER] = torch.tensor(tag, dtype=torch.float64)
    if inline and k:
        sent[_HEADER : _HEADER + k] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    sent = sent.to(_device())
    got = [torch.zeros_like(sent) for _ in range(world)]
    with _failing_as(site, when):
        dist.all_gather(got, sent)
    rows = [row[: _HEADER + (k if inline else 0)] for row in torch.stack(got).cpu().tolist()]
    tags = [_decode(row) for row in rows]
    if any(t != (_calls, _step, k, site) for t in tags):
        where = "; ".join(
            f"rank {r} at {t[3]} (collective #{t[0]}, {_when(t[1])})"
            if t
            else f"rank {r} in another collective (not one of oxRL's checked ones, e.g. DeepSpeed's parameter gather)"
            for r, t in enumerate(tags)
        )
        raise CollectiveMismatch(
            f"ranks out of step {when}: {where}. Every rank must issue the same collectives in the same order; "
            "one issued a collective the others did not (a bug in oxRL or a plugin). The run stopped instead of "
            "hanging or computing with mixed-up values; checkpoints are kept."
        )
    if inline:
        return [row[_HEADER:] for row in rows]
    parts = [torch.zeros(k, dtype=torch.float64, device=_device()) for _ in range(world)]
    with _failing_as(site, when):  # the tags agree, so do the sizes
        dist.all_gather(parts, torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device()))
    return torch.stack(parts).cpu().tolist()


@contextlib.contextmanager
def _failing_as(site: str, when: str):
    """A collective's RuntimeError (a dead peer, ``engine.timeout_s``, a peer stopped at a mismatch) as one line."""
    try:
        yield
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        failed = CollectiveFailed(
            f"rank {rank()} was at {site} (collective #{_calls}, {when}) when it failed: {reason}. Another rank "
            "died, waited past engine.timeout_s, or stopped at a mismatch; checkpoints are kept."
        )
        failed.where = f"{site} (collective #{_calls}, {when})"
        raise failed from None


def barrier() -> None:
    """Every rank waits for the others (a checked exchange of no values)."""
    _exchange([])


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64, so token counts stay exact; summed in rank order on every rank)."""
    every = _exchange(values)
    if every is None:
        return list(values)
    return [sum(column) for column in zip(*every)]


def max_over_ranks(value: float) -> float:
    """The largest of every rank's ``value``."""
    every = _exchange([value])
    return value if every is None else max(row[0] for row in every)


def reduce_metrics(sums: dict[str, float]) -> dict[str, float]:
    """A dict of per-rank sums summed over ranks (every rank has the same keys), in its own key order."""
    order = sorted(sums)
    reduced = dict(zip(order, all_reduce_sum([float(sums[k]) for k in order])))
    return {k: reduced[k] for k in sums}


def all_gather_object(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (pickled; for small Python objects)."""
    if _exchange([]) is None:
        return [obj]
    out = [None] * world_size()
    _dist().all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if _exchange([]) is None:
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=src)
    return box[0]


def shard(rows: list[int], unit: int = 1) -> tuple[list[int], bool]:
    """This rank's rows of ``rows`` (a micro-batch), in contiguous blocks of whole ``unit``s, and
    whether they are padding (a stand-in for a rank without rows; its loss weight must be 0).

    5 units over 2 ranks: rank 0 gets units 0-1, rank 1 units 2-4. One process: all rows.
    """
    n = world_size()
    if n == 1:
        return list(rows), False
    units = len(rows) // unit
    r = rank()
    lo, hi = r * units // n, (r + 1) * units // n
    if lo == hi:
        return list(rows[:unit]), True
    return list(rows[lo * unit : hi * unit]), False


def gather_rows(part, positions: list[int], total: int):
    """(total, ...) on every rank from each rank's ``part`` (len(positions), ...), whose row i is row
    ``positions[i]`` of the whole; a padding rank passes no positions. Exact: every row is the sum
    of its one owner's values and zeros."""
    if _exchange([]) is None:
        return part
    import torch

    full = part.new_zeros((total, *part.shape[1:]))
    if positions:
        full[torch.tensor(positions, device=part.device)] = part
    _dist().all_reduce(full)
    return full


def main_pid() -> int:
    """Rank 0's process id, on every rank (it names the temp dir that all ranks write a checkpoint into)."""
    return broadcast_object(os.getpid())


# ----------------------------------------------------------------------------- Ray actors (training ranks, rollout actors)


def env_for_actors() -> dict:
    """The environment variables a Ray actor is started with (`FORWARDED_ENV`)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # torch.distributed deprecations, once per rank
    return env


def resolve_ray_address(configured: str) -> tuple[str, str]:
    """The Ray cluster a run uses, and where that came from: ``engine.ray_address``; when empty,
    ``$RAY_ADDRESS`` (Ray's own convention: ``ray job submit``, a cluster's nodes); else ``("local", "")``,
    a new local cluster (not ``ray.init()``'s default, which would join any cluster started on this machine)."""
    if configured:
        return configured, "engine.ray_address"
    if os.environ.get("RAY_ADDRESS", "").strip():
        return os.environ["RAY_ADDRESS"].strip(), "RAY_ADDRESS"
    return "local", ""


def ray_reason(exc) -> str:
    """Ray's explanation in one line (its messages run to a page): the first line, and for a dead
    worker the exit detail."""
    text = str(getattr(exc, "error_msg", None) or exc).strip()
    first = next(
        (
            line.strip()
            for line in text.splitlines()
            if line.strip() and not line.strip().startswith(("Traceback", "ray::", "File "))
        ),
        type(exc).__name__,
    )
    detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text, re.S)
    first = first.rstrip(".")
    return f"{first} ({detail.group(1).strip().rstrip('.')})" if detail else first
