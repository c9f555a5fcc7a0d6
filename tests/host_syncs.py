"""Counting the calls that make a GPU wait for its host (a host–device sync), on the CPU.

On a GPU, reading a tensor's value on the host (``float(t)``, ``t.item()``, ``bool(t)``, ``t.tolist()``)
blocks until the device has computed it, and so does every op whose output *shape* depends on the
data (``nonzero``, ``unique``, ``masked_select``, boolean indexing, ``repeat_interleave`` without
``output_size``): the host must learn the shape before it can queue the next kernel. On a CPU the same
calls are cheap, but they are the same calls: `SyncCounter` counts them during a window, in the
counting thread and every thread started while counting, through a
`TorchDispatchMode` per thread:

  - ``aten._local_scalar_dense`` (what ``item``/``float``/``int``/``bool`` of a tensor call);
  - ``aten.nonzero``, boolean-mask ``aten.index`` / ``index_put``, ``aten.masked_select``, the ``unique`` family;
  - ``aten.repeat_interleave`` of a repeats tensor without ``output_size``;
  - ``Tensor.tolist`` / ``Tensor.numpy`` / ``Tensor.cpu``: a device-to-host copy on a GPU (every call is
    counted: on a CPU a host tensor and a device tensor look the same).

Tensors built on the host before they reach the device (the collator's) are made of Python lists, not of
these calls, so they count nothing.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
}


def _bool_index(args) -> bool:
    """Whether an index/index_put call indexes by a boolean mask (which needs the mask's nonzero count)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


class _Mode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _DATA_DEPENDENT:
            self.counter.add(name)
        elif name in ("aten::index", "aten::index_put", "aten::index_put_") and _bool_index(args):
            self.counter.add(f"{name} (boolean mask)")
        elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None and len(args) >= 1:
            if isinstance(args[0], torch.Tensor) and (len(args) < 2 or isinstance(args[1], torch.Tensor)):
                self.counter.add("aten::repeat_interleave (no output_size)")
        return func(*args, **kwargs)


class SyncCounter:
    """``with SyncCounter() as c: ...`` then ``c.total`` / ``c.counts``; ``c.window()`` starts a new window
    (``c.windows`` keeps each window's Counter)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.windows: list[Counter] = []
        self.lock = threading.Lock()
        self.active = False

    def add(self, name: str) -> None:
        if self.active:
            with self.lock:
                self.counts[name] += 1

    def window(self) -> Counter:
        """Close the current window (returned) and open the next."""
        with self.lock:
            done, self.counts = self.counts, Counter()
            self.windows.append(done)
        return done

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self):
        counter = self
        self._patched = {}
        # threads started from now on run under their own mode
        original_run = threading.Thread.run

        def run(thread_self, *args, **kwargs):
            with _Mode(counter):
                return original_run(thread_self, *args, **kwargs)

        threading.Thread.run = run
        self._patched[(threading.Thread, "run")] = original_run
        for method in ("tolist", "numpy", "cpu"):
            original = getattr(torch.Tensor, method)

            def wrapped(t, *args, _original=original, _name=method, **kwargs):
                counter.add(f"Tensor.{_name}")
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, method, wrapped)
            self._patched[(torch.Tensor, method)] = original
        self._mode = _Mode(self)
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False
        self._mode.__exit__(*exc)
        for (owner, name), original in self._patched.items():
            setattr(owner, name, original)
        return False
