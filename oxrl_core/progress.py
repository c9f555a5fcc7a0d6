"""What a run prints: a rich progress bar on a terminal, plain lines otherwise, nothing with --quiet.

In a data-parallel run only rank 0 prints (the ranks' metrics are reduced into its own)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from oxrl_core.distributed import is_main


class Reporter:
    def __init__(self, quiet: bool = False, log_steps: int = 1):
        self.silent = not is_main()
        self.quiet = quiet or self.silent
        self.log_steps = log_steps
        self.console = Console(stderr=True, soft_wrap=True)
        self.progress: Progress | None = None
        self.task = None

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, highlight=False)

    def result(self, message: str) -> None:
        """Shown even with --quiet (the outcome of the run)."""
        if not self.silent:
            self.console.print(message, highlight=False)

    def start(self, total: int, completed: int = 0) -> None:
        if self.quiet or not self.console.is_terminal:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=completed, loss="-", tps="-")

    def step(self, step: int, total: int, metrics: dict) -> None:
        loss = f"{metrics['loss']:.4f}"
        tps = f"{metrics.get('perf/tokens_per_s', 0):,.0f}"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=loss, tps=tps)
        elif not self.quiet and (step == 1 or step % self.log_steps == 0 or step == total):
            reward = f" reward {metrics['reward/mean']:.3f}" if "reward/mean" in metrics else ""
            print(
                f"step {step}/{total} loss {loss}{reward} lr {metrics['lr']:.3g} {tps} tok/s",
                file=sys.stderr,
                flush=True,
            )

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
