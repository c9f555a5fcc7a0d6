"""What a run prints: a rich progress bar on a terminal, plain lines otherwise, nothing with --quiet.

Besides the training bar, every phase that can take a while says what it is doing, so a run is never
silent for a minute: `Reporter.counter` for work that can be counted (the warm start's steps, the
held-out evaluation's samples) — a bar with counts on a terminal, ``warm start: 50/450 steps`` lines
otherwise — and `Reporter.activity` for work that cannot (loading a model) — a spinner, or one line.
Code below the loops takes ``reporter=None`` and uses `counter` / `activity` of this module, which do
nothing without a reporter.

In a data-parallel run only rank 0 prints (the ranks' metrics are reduced into its own)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from oxrl_core.engines.distributed import is_main

__all__ = ["Reporter", "activity", "counter", "step_fields"]

#: ``update(done, total=None)``: how far a counted phase has got (``total`` may be given on any call)
Update = Callable[..., None]


def _nothing(done: int = 0, total: int | None = None) -> None:
    return None


def nice_interval(total: int) -> int:
    """The step between two plain progress lines: about a tenth of ``total``, rounded up to 1, 2 or 5 × 10^k."""
    target = max(total / 10, 1)
    power = 10 ** math.floor(math.log10(target))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= target)


def step_fields(metrics: dict) -> dict[str, str]:
    """What the progress line shows of a step: loss, reward and KL to the reference (when logged), tokens/s."""
    fields = {"loss": f"{metrics['loss']:.4f}"}
    if "reward/mean" in metrics:
        fields["reward"] = f"{metrics['reward/mean']:.3f}"
    if "kl/ref" in metrics:
        fields["kl"] = f"{metrics['kl/ref']:.4f}"
    fields["tok/s"] = f"{metrics.get('perf/tokens_per_s', 0):,.0f}"
    return fields


class _Counts(ProgressColumn):
    """``50/450 steps`` for a counted task; nothing for a spinner."""

    def render(self, task) -> Text:
        if task.total is None:
            return Text("")
        return Text(f"{int(task.completed)}/{int(task.total)} {task.fields.get('unit', '')}".rstrip())


class Reporter:
    #: plain lines of a counted phase: between the first and the last, one about every tenth of the way, but
    #: not within this many seconds of the previous one (a quick evaluation is two lines, not twelve)
    plain_min_gap_s = 2.0

    def __init__(self, quiet: bool = False, log_steps: int = 1):
        self.silent = not is_main()
        self.quiet = quiet or self.silent
        self.log_steps = log_steps
        self.console = Console(stderr=True, soft_wrap=True)
        self.progress: Progress | None = None  # the live display (a terminal only): the training bar and phases
        self.task = None  # the training bar's task
        self._transient = False

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, highlight=False)

    def result(self, message: str) -> None:
        """Shown even with --quiet (the outcome of the run)."""
        if not self.silent:
            self.console.print(message, highlight=False)

    def _plain(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # ---- the live display (a terminal only)

    def _live(self, transient: bool) -> Progress:
        if self.progress is None:
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=24),
                _Counts(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=transient,
            )
            self._transient = transient
            self.progress.start()
        return self.progress

    def _release(self) -> None:
        """Stop a live display that only a phase started, once its last task is gone."""
        if self.progress is not None and self._transient and not self.progress.task_ids:
            self.progress.stop()
            self.progress = None

    # ---- phases before and between steps

    @contextlib.contextmanager
    def counter(self, label: str, unit: str, total: int | None = None) -> Iterator[Update]:
        """A phase that can be counted: yields ``update(done, total=None)``. A bar with counts on a terminal;
        otherwise ``label: done/total unit`` lines at 0, about every tenth (`plain_min_gap_s` apart at least),
        and at the end (with its time)."""
        if self.quiet:
            yield _nothing
            return
        start = time.perf_counter()
        state = {"done": 0, "total": total, "printed": -1, "printed_at": start}

        def took() -> str:
            return f"{time.perf_counter() - start:.1f} s"

        if self.console.is_terminal:
            live = self._live(transient=True)
            task = live.add_task(label, total=total, info="", unit=unit)

            def update(done: int, total: int | None = None) -> None:
                state["done"], state["total"] = done, total if total is not None else state["total"]
                live.update(task, completed=done, total=state["total"])

            try:
                yield update
            finally:
                live.remove_task(task)
                self._release()
            if state["total"] and state["done"] >= state["total"]:
                self.console.print(f"{label}: {state['done']}/{state['total']} {unit} in {took()}", highlight=False)
            return

        def update(done: int, total: int | None = None) -> None:
            if total is not None:
                state["total"] = total
            state["done"], total = done, state["total"]
            if not total:  # not known yet, or nothing to do
                return
            if done >= total:
                if state["printed"] < total:
                    self._plain(f"{label}: {total}/{total} {unit} in {took()}")
                state["printed"] = total
            elif state["printed"] < 0 or (
                done // nice_interval(total) > state["printed"] // nice_interval(total)
                and time.perf_counter() - state["printed_at"] >= self.plain_min_gap_s
            ):
                self._plain(f"{label}: {done}/{total} {unit}")
                state["printed"], state["printed_at"] = done, time.perf_counter()

        if total is not None:
            update(0)
        yield update

    @contextlib.contextmanager
    def activity(self, label: str) -> Iterator[None]:
        """A phase that cannot be counted (loading a model): a spinner on a terminal, else one line."""
        if self.quiet:
            yield
            return
        if not self.console.is_terminal:
            self._plain(f"{label} ...")
            yield
            return
        live = self._live(transient=True)
        task = live.add_task(label, total=None, info="", unit="")
        try:
            yield
        finally:
            live.remove_task(task)
            self._release()

    # ---- the training steps

    def start(self, total: int, completed: int = 0) -> None:
        if self.quiet or not self.console.is_terminal:
            return
        live = self._live(transient=False)
        self._transient = False  # the training bar stays on screen when the run ends
        self.task = live.add_task("train", total=total, completed=completed, info="", unit="")

    def step(self, step: int, total: int, metrics: dict) -> None:
        fields = step_fields(metrics)
        if self.progress is not None and self.task is not None:
            info = " · ".join(f"{v} {k}" if k == "tok/s" else f"{k} {v}" for k, v in fields.items())
            self.progress.update(self.task, completed=step, info=info)
        elif not self.quiet and (step == 1 or step % self.log_steps == 0 or step == total):
            tps = fields.pop("tok/s")
            shown = " ".join(f"{k} {v}" for k, v in fields.items())
            print(f"step {step}/{total} {shown} lr {metrics['lr']:.3g} {tps} tok/s", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
            self.task = None


@contextlib.contextmanager
def counter(reporter: Reporter | None, label: str, unit: str, total: int | None = None) -> Iterator[Update]:
    """`Reporter.counter`, or nothing without a reporter."""
    if reporter is None:
        yield _nothing
        return
    with reporter.counter(label, unit, total) as update:
        yield update


@contextlib.contextmanager
def activity(reporter: Reporter | None, label: str) -> Iterator[None]:
    """`Reporter.activity`, or nothing without a reporter."""
    if reporter is None:
        yield
        return
    with reporter.activity(label):
        yield
