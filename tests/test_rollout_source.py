"""Sync or async is decided once: ``rollout.max_staleness`` and the choice of rollout source are read in exactly one
factory (`oxrl_core.rl.sources.rollout_source`), outside the config's own schema and rules (`config*.py`). The RL
step, its setup, checkpoints and evaluation talk to the `RolloutSource` they are given and never ask which it is."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "oxrl_core"
#: the one place allowed to read the option and to build (or test for) a source class
FACTORY = ("rl/sources.py", "rollout_source")
SOURCES = {"SyncRollouts", "AsyncRollouts"}


def decisions(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for each read of ``.max_staleness`` and each use of a source class by name
    (a construction or an ``isinstance`` test: choosing or asking which source runs) in ``tree``."""
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Attribute) and child.attr == "max_staleness":
                found.append((child.lineno, function, "reads .max_staleness"))
            if isinstance(child, ast.Name) and child.id in SOURCES and isinstance(child.ctx, ast.Load):
                found.append((child.lineno, function, f"uses {child.id}"))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def outside_the_factory(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("config"):  # the schema: the field, its description and the rules between fields
            continue
        for line, function, what in decisions(ast.parse(path.read_text())):
            if (rel, function) != FACTORY:
                problems.append(f"oxrl_core/{rel}:{line} ({function}) {what}")
    return problems


def test_the_rollout_source_is_chosen_in_one_factory():
    problems = outside_the_factory()
    assert not problems, (
        "rollout.max_staleness and the rollout source are read only by rl.sources.rollout_source; ask the source "
        "instead (RolloutSource.ahead, .batch, .push, .evaluate, .save, .step_metrics):\n" + "\n".join(problems)
    )


def test_the_factory_is_there_and_reads_the_option(tmp_path):
    """The rule's two ends exist (a rename would make the test above pass vacuously), and a planted branch on the
    source outside the factory is caught."""
    tree = ast.parse((ROOT / FACTORY[0]).read_text())
    inside = [what for _, function, what in decisions(tree) if function == FACTORY[1]]
    assert "reads .max_staleness" in inside and {"uses SyncRollouts", "uses AsyncRollouts"} <= set(inside)
    planted = tmp_path / "oxrl_core"
    (planted / "loops").mkdir(parents=True)
    (planted / "loops" / "rl.py").write_text(
        "def step(parts, ro):\n    if ro.max_staleness:\n        return isinstance(parts.source, AsyncRollouts)\n"
    )
    assert outside_the_factory(planted) == [
        "oxrl_core/loops/rl.py:2 (step) reads .max_staleness",
        "oxrl_core/loops/rl.py:3 (step) uses AsyncRollouts",
    ]
