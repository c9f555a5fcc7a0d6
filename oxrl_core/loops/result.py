"""`RunResult`: what a run returns (the loops build it, `Trainer.train` hands it to the caller). No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    run_dir: Path
    final_dir: Path
    steps: int
    metrics: list[dict] = field(default_factory=list)
    eval_before: dict = field(default_factory=dict)
    eval_after: dict = field(default_factory=dict)
