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
"""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta

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


def barrier() -> None:
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64, so token counts stay exact)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return list(values)
    import torch

    buffer = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(buffer)
    return buffer.tolist()


def reduce_metrics(sums: dict[str, float]) -> dict[str, float]:
    """A dict of per-rank sums summed over ranks (every rank has the same keys), in its own key order."""
    order = sorted(sums)
    reduced = dict(zip(order, all_reduce_sum([float(sums[k]) for k in order])))
    return {k: reduced[k] for k in sums}


def all_gather_object(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (pickled; for small Python objects)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
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
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return part
    import torch

    full = part.new_zeros((total, *part.shape[1:]))
    if positions:
        full[torch.tensor(positions, device=part.device)] = part
    dist.all_reduce(full)
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
