"""House metrics: limits on the size of the core that keep it readable, measured on the repository itself.

1. No module of ``oxrl_core`` is over 800 lines.
2. No function of ``oxrl_core`` (``def`` and ``async def``, methods and nested functions included) is over 100
   lines, counted from its ``def`` line (decorators excluded) to its last line.
3. ``oxrl_core/loops/`` is at most 1,800 lines in all.
4. The researcher's path is at most 1,300 lines: the ``oxrl_core`` files a reader opens to follow one SGRPO step
   from the loop to the loss, plus the algorithm's file. The files are not listed by hand (moving code out of a
   listed file would hide it); they are read from what one step of the built-in run executes. One SGRPO update
   runs in-process on the built-in tiny model under `sys.setprofile`, and at each call of the algorithm's
   ``advantages`` and ``loss`` the path takes

   - the file of every frame on the stack from the loop's entry (the outermost frame in ``oxrl_core/loops/``)
     down to the algorithm's method, keeping those in ``oxrl_core``;
   - the file defining each name the algorithm's module imports from ``oxrl_core`` (the object's ``__module__``:
     a re-export is followed to where the name is defined), and the file of each ``oxrl_core`` class the
     algorithm inherits from (a reader follows ``class SGRPO(PolicyGradient)`` up);
   - the algorithm's own file.

   The path is the sum of their line counts; the test prints the files and the total.
5. No near-copy of 6 statements or more inside ``oxrl_core`` (`near_copies`): a copy should be one function
   that both places call.

The limits are on lines as a reader meets them (``wc -l``): comments and docstrings count, they are read too.
"""

from __future__ import annotations

import ast
import copy
import importlib
import json
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "oxrl_core"

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100
MAX_LOOPS_LINES = 1_800
MAX_PATH_LINES = 1_300
COPY_WINDOW = 6


def line_count(path: Path) -> int:
    """Lines as ``wc -l`` counts them (every file of the core ends with a newline)."""
    return len(path.read_text().splitlines())


def core_files(root: Path = CORE) -> list[Path]:
    return sorted(root.rglob("*.py"))


def rel(path: Path | str) -> str:
    """A path as the messages show it: relative to the repository when it is inside it."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def functions_of(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From the ``def`` line to the last line: ``node.lineno`` is the ``def`` line, after any decorator."""
    return node.end_lineno - node.lineno + 1


# ------------------------------------------------------------------------------------------------
# 1-3: sizes
# ------------------------------------------------------------------------------------------------


def test_no_module_of_the_core_is_over_800_lines():
    over = {rel(p): n for p in core_files() if (n := line_count(p)) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by what they are about): {over}"


def test_no_function_of_the_core_is_over_100_lines():
    over = [
        f"{rel(p)}:{node.lineno} {node.name} ({function_lines(node)} lines)"
        for p in core_files()
        for node in functions_of(p)
        if function_lines(node) > MAX_FUNCTION_LINES
    ]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (give their parts a name each): {over}"


def test_the_loops_are_at_most_1800_lines():
    sizes = {rel(p): line_count(p) for p in core_files(CORE / "loops")}
    total = sum(sizes.values())
    assert total <= MAX_LOOPS_LINES, f"oxrl_core/loops/ is {total} lines, over {MAX_LOOPS_LINES}: {sizes}"


# ------------------------------------------------------------------------------------------------
# 4: the researcher's path
# ------------------------------------------------------------------------------------------------


def _arith_rows(path: Path) -> Path:
    rows = [(f"What is {a} + {b}?", str(a + b)) for a in range(2, 9) for b in range(3, 7)]
    path.write_text("".join(json.dumps({"prompt": p, "answer": r}) + "\n" for p, r in rows))
    return path


def traced_step_files(tmp_path: Path, alg: str = "sgrpo") -> tuple[set[Path], object]:
    """One update of ``alg`` on the built-in tiny model, traced: the ``oxrl_core`` files on the stack from the
    loop's entry down to each call of the algorithm's ``advantages`` and ``loss`` (with the algorithm's frame
    last), and the algorithm object the run built."""
    from oxrl_core import Trainer
    from oxrl_core.interfaces import Algorithm

    loops, seen, algorithm = str(CORE / "loops") + "/", set(), []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name not in ("advantages", "loss"):
            return
        if not isinstance(frame.f_locals.get("self"), Algorithm):
            return
        algorithm.append(frame.f_locals["self"])
        stack = []
        while frame is not None:
            stack.append(frame.f_code.co_filename)
            frame = frame.f_back
        stack.reverse()  # outermost first
        start = next((i for i, name in enumerate(stack) if name.startswith(loops)), None)
        assert start is not None, f"no frame of oxrl_core/loops/ on the stack of {algorithm[-1]}: {stack}"
        seen.update(Path(name) for name in stack[start:])

    overrides = [
        f"data.train={_arith_rows(tmp_path / 'arith.jsonl')}",
        "reward.name=exact_match",
        "train.max_steps=1",
        "train.save_every=0",
        "train.batch_size=4",
        "rollout.max_new_tokens=8",
    ]
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        Trainer(alg=alg, overrides=overrides, quiet=True, output_dir=tmp_path / "run").train()
    finally:
        sys.setprofile(previous)
    assert algorithm, f"one {alg} step never called its algorithm's advantages or loss"
    return {p for p in seen if p.is_relative_to(CORE)}, algorithm[0]


def definition_files(algorithm) -> set[Path]:
    """The algorithm's file, the files defining what it imports from ``oxrl_core``, and those of its ``oxrl_core``
    base classes."""
    module = sys.modules[type(algorithm).__module__]
    files = {Path(module.__file__)}
    names = [
        alias.asname or alias.name
        for node in ast.walk(ast.parse(Path(module.__file__).read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "oxrl_core"
        for alias in node.names
    ]
    # a name's home: a module imported whole (``from oxrl_core import ops``) is its own file, anything else the module
    # that defines it
    objects = [getattr(module, name) for name in names]
    homes = [o.__name__ if isinstance(o, types.ModuleType) else getattr(o, "__module__", None) for o in objects]
    homes += [cls.__module__ for cls in type(algorithm).__mro__]
    for home in homes:
        if home.split(".")[0] == "oxrl_core":
            files.add(Path(importlib.import_module(home).__file__))
    return files


def test_the_researchers_path_through_one_sgrpo_step_is_at_most_1300_lines(tmp_path):
    stack_files, algorithm = traced_step_files(tmp_path)
    files = sorted(stack_files | definition_files(algorithm))
    sizes = {rel(p): line_count(p) for p in files}
    total = sum(sizes.values())
    listing = "\n".join(f"  {n:5d}  {name}" for name, n in sizes.items()) + f"\n  {total:5d}  in all"
    print(f"\nthe researcher's path through one {algorithm.name} step:\n{listing}")
    assert total <= MAX_PATH_LINES, f"the researcher's path is {total} lines, over {MAX_PATH_LINES}:\n{listing}"


# ------------------------------------------------------------------------------------------------
# 5: near-copies
# ------------------------------------------------------------------------------------------------

#: the fields of a compound statement that hold statements: a compound statement counts as its header
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


class _Anonymous(ast.NodeTransformer):
    """Local names and parameters all read ``_``: a copy with its variables renamed is still a copy. Attributes,
    calls' keywords and constants are kept, so two runs of different calls with the same shape do not match."""

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id="_", ctx=node.ctx)

    def visit_arg(self, node: ast.arg) -> ast.arg:
        return ast.arg(arg="_")


@dataclass(frozen=True)
class Place:
    file: str
    function: str
    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.file}:{self.first}-{self.last} ({self.function})"


def statement_lines(statements: list[ast.stmt]) -> list[list[tuple[str, ast.stmt]]]:
    """A function body as runs of statement-lines: each statement in reading order (a compound one as its header,
    then its bodies), normalised by `_Anonymous` and dumped. Docstrings, imports and ``pass`` are left out (every
    module has them in the same words); a nested ``def`` or ``class`` ends a run (it is measured on its own)."""
    runs: list[list[tuple[str, ast.stmt]]] = [[]]

    def walk(body: list) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                runs.append([])
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue
            header = copy.copy(node)
            for field in _BODIES:
                if hasattr(header, field):
                    setattr(header, field, [])
            if isinstance(node, (ast.stmt, ast.excepthandler)) or hasattr(node, "pattern"):
                runs[-1].append((ast.dump(_Anonymous().visit(copy.deepcopy(header))), node))
            for field in _BODIES:
                walk(getattr(node, field, None) or [])

    walk(statements)
    return [run for run in runs if run]


def near_copies(files: list[Path], window: int = COPY_WINDOW, root: Path = ROOT) -> list[tuple[Place, Place]]:
    """Pairs of places, in two functions or twice in one, where ``window`` consecutive statement-lines
    (`statement_lines`) are the same. Overlapping windows of one copy are merged into one pair of places."""
    seen: dict[tuple[str, ...], list[Place]] = defaultdict(list)
    for path in files:
        name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        for fn in functions_of(path):
            for run in statement_lines(fn.body):
                for i in range(len(run) - window + 1):
                    lines = run[i : i + window]
                    last = lines[-1][1]
                    place = Place(name, fn.name, lines[0][1].lineno, last.end_lineno or last.lineno)
                    seen[tuple(dump for dump, _ in lines)].append(place)
    merged: dict[tuple[str, str, str, str], tuple[Place, Place]] = {}
    for places in seen.values():
        unique = sorted(set(places), key=lambda p: (p.file, p.first))
        for i, a in enumerate(unique):
            for b in unique[i + 1 :]:
                if a.file == b.file and a.first <= b.last and b.first <= a.last:
                    continue  # overlapping windows of one run (a repeated statement), not a copy
                key = (a.file, a.function, b.file, b.function)
                if key in merged:
                    old_a, old_b = merged[key]
                    a = Place(a.file, a.function, min(a.first, old_a.first), max(a.last, old_a.last))
                    b = Place(b.file, b.function, min(b.first, old_b.first), max(b.last, old_b.last))
                merged[key] = (a, b)
    return sorted(merged.values(), key=lambda pair: (pair[0].file, pair[0].first))


def test_the_core_has_no_near_copy_of_six_statements():
    copies = near_copies(core_files())
    assert not copies, f"near-copies of {COPY_WINDOW}+ statements (make one function both call):\n" + "\n".join(
        f"  {a}  ==  {b}" for a, b in copies
    )


_ORIGINAL = '''
def total(rows, scale):
    """Sum the rows."""
    out = 0
    for row in rows:
        if row.weight < 0:
            raise ValueError(row)
        out += row.weight * scale
    out = max(out, 1)
    return out / len(rows)
'''

#: the same statements with the variables renamed, inside another function
_COPY = """
def weighted(items, factor, extra):
    print(extra)
    acc = 0
    for item in items:
        if item.weight < 0:
            raise ValueError(item)
        acc += item.weight * factor
    acc = max(acc, 1)
    return acc / len(items)
"""

#: five of them, then a different statement: under the window
_SHORT = """
def shorter(rows, scale):
    out = 0
    for row in rows:
        if row.weight < 0:
            raise ValueError(row)
        out += row.weight * scale
    return out
"""


def test_the_copy_check_catches_a_planted_copy_with_its_names_changed(tmp_path):
    (tmp_path / "a.py").write_text(_ORIGINAL)
    (tmp_path / "b.py").write_text(_COPY + _SHORT)
    copies = near_copies(sorted(tmp_path.glob("*.py")), root=tmp_path)
    assert [(str(a), str(b)) for a, b in copies] == [("a.py:4-10 (total)", "b.py:4-10 (weighted)")], copies
    # a constant changed is a different statement: the copy is broken in two runs under the window
    (tmp_path / "b.py").write_text(_COPY.replace("max(acc, 1)", "max(acc, 2)"))
    assert near_copies(sorted(tmp_path.glob("*.py")), root=tmp_path) == []
