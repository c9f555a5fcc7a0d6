"""The core is strictly layered: every module of `oxrl_core` imports only from its own layer or the
layers below, and the import graph has no cycle (``docs/architecture.md`` draws the same table).

The graph is read from the source (AST), with every ``import`` of an ``oxrl_core`` module at module
level AND inside functions: a function-level import hides a cycle from Python but not from the
design. A function-level import of an oxRL module is allowed only where it keeps something heavy
(torch, transformers, DeepSpeed, Ray) out of a light path such as ``oxrl --help``, ``oxrl plugins``
or ``oxrl score``, and it must say so with a ``lazy:`` comment on its line or on the line just above
it (or above the run of import lines it belongs to).

Within a layer, imports are allowed as long as the graph stays acyclic. A new module must be given
a layer here. Imports made through ``importlib`` (the package's lazy ``__getattr__``) are not read.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "oxrl_core"

#: the layers, bottom up; a module may import from its own layer (acyclically) and any layer below.
#: The services (L3-L9) are sub-packages in this order: each may import the ones before it, never after.
LAYERS: dict[int, tuple[str, ...]] = {
    # L0 leaves: nothing of oxRL but each other (errors); no torch at import
    0: ("oxrl_core", "oxrl_core.errors", "oxrl_core.schema", "oxrl_core.ops", "oxrl_core.atomic",
        "oxrl_core.hookspecs", "oxrl_core.hf_env", "oxrl_core.user_code", "oxrl_core.tool_parsers",
        "oxrl_core.chat_templates", "oxrl_core.redact"),
    # L1 the contracts: plugin interfaces, batch types, the engine protocol
    1: ("oxrl_core.interfaces",),
    # L2 the run configuration (YAML schema) and the plugin registry
    2: ("oxrl_core.config", "oxrl_core.plugins", "oxrl_core.builtin_plugins"),
    # L3-L9 the services, one sub-package each
    3: ("oxrl_core.engines", "oxrl_core.engines.*"),  # torch / DeepSpeed engines, the collectives between ranks
    4: ("oxrl_core.observability", "oxrl_core.observability.*"),  # console progress, health findings, the report
    5: ("oxrl_core.data", "oxrl_core.data.*"),  # sources, rows, tokenisation, batching, the built-in task
    6: ("oxrl_core.models", "oxrl_core.models.*"),  # loading, LoRA, critic, packed attention, the chunked head
    7: ("oxrl_core.run_io", "oxrl_core.run_io.*"),  # checkpoints, lifecycle, tracking, recorded inputs
    8: ("oxrl_core.rollout", "oxrl_core.rollout.*"),  # the hf backend, actors, weight sync, rollout log, env workers
    9: ("oxrl_core.scoring", "oxrl_core.scoring.*"),  # rewards at run time, `oxrl score`, held-out evaluation
    # L10 the loops: one run skeleton and one file per loop
    10: ("oxrl_core.loops", "oxrl_core.loops.*"),
    # L11 the run: the trainer (start-up checks, the loop for the algorithm) and the multi-rank launcher
    11: ("oxrl_core.trainer", "oxrl_core.launcher"),
    # L12 the command line and the commands beside `oxrl run`
    12: ("oxrl_core.cli", "oxrl_core.commands", "oxrl_core.commands.*"),
}  # fmt: skip

LAZY_MARK = "lazy:"


@dataclass(frozen=True)
class Edge:
    """One ``import`` of an oxRL module: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    in_function: bool
    lazy_comment: bool

    def where(self) -> str:
        kind = "function-level" if self.in_function else "module-level"
        return f"{self.source}:{self.line} ({kind}) imports {self.target}"


# ------------------------------------------------------------------------------------------------
# Reading the graph
# ------------------------------------------------------------------------------------------------


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``: dotted name -> file."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an imported dotted name lives in: ``a.b.c`` -> ``a.b.c`` if a module, else ``a.b``..."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _has_lazy_comment(lines: list[str], node: ast.stmt) -> bool:
    """``lazy:`` on the import's own line(s), or on the line above the run of import lines it is in."""
    if any(LAZY_MARK in lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
        return True
    i = node.lineno - 1  # 1-based line above
    while i >= 1 and lines[i - 1].strip().startswith(("from ", "import ")):
        if LAZY_MARK in lines[i - 1]:
            return True
        i -= 1
    return i >= 1 and LAZY_MARK in lines[i - 1]


def imports_of(module: str, path: Path, modules: dict[str, Path], package: str) -> list[Edge]:
    """Every import of a ``package`` module in one file, module-level and function-level."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    inside_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside_function.update(id(sub) for sub in ast.walk(node) if sub is not node)
    is_package = path.name == "__init__.py"
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name != package and not name.startswith(package + "."):
                continue
            target = _resolve(name, modules)
            if not target or target == module:
                continue
            fn = id(node) in inside_function
            edges.append(Edge(module, target, node.lineno, fn, fn and _has_lazy_comment(lines, node)))
    return sorted(set(edges), key=lambda e: (e.source, e.line, e.target))


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> list[Edge]:
    modules = module_files(root, package)
    return [edge for name, path in modules.items() for edge in imports_of(name, path, modules, package)]


# ------------------------------------------------------------------------------------------------
# The checks
# ------------------------------------------------------------------------------------------------


def layer_of(module: str, layers: dict[int, tuple[str, ...]]) -> int | None:
    """The layer a module is given (``pkg.*`` names every module under ``pkg``)."""
    for level, names in layers.items():
        for name in names:
            if module == name or (name.endswith(".*") and module.startswith(name[:-1])):
                return level
    return None


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: every
    module in one of them can reach every other, i.e. they sit on import cycles."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(components)


def cycle_edges(edges: list[Edge], component: list[str]) -> list[Edge]:
    """The imports that run between the modules of one cycle (what to cut)."""
    members = set(component)
    return [e for e in edges if e.source in members and e.target in members]


def layer_problems(edges: list[Edge], layers: dict[int, tuple[str, ...]]) -> list[str]:
    """Upward imports, and modules not given a layer."""
    problems = []
    for e in edges:
        src, dst = layer_of(e.source, layers), layer_of(e.target, layers)
        if src is None or dst is None:
            continue
        if dst > src:
            problems.append(f"{e.where()}: upward import (L{src} -> L{dst})")
    return problems


def lazy_problems(edges: list[Edge]) -> list[str]:
    """Function-level imports without a ``lazy:`` comment saying why."""
    return [f"{e.where()}: no '{LAZY_MARK}' comment saying why it is not at module level" for e in edges
            if e.in_function and not e.lazy_comment]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The repository's graph
# ------------------------------------------------------------------------------------------------

EDGES = import_graph()
MODULES = sorted(module_files(ROOT, PACKAGE))


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if layer_of(m, LAYERS) is None]
    assert not missing, f"give these modules a layer in tests/test_layers.py (and docs/architecture.md): {missing}"


def test_no_import_cycles():
    cycles = find_cycles(EDGES)
    report = [" <-> ".join(c) + "\n      " + "\n      ".join(e.where() for e in cycle_edges(EDGES, c)) for c in cycles]
    assert not cycles, "import cycles in oxrl_core:\n  " + "\n  ".join(report)


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_downward(module):
    problems = layer_problems([e for e in EDGES if e.source == module], LAYERS)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module", MODULES)
def test_function_level_imports_say_why(module):
    problems = lazy_problems([e for e in EDGES if e.source == module])
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# The checker itself, on small fake graphs and a fake package
# ------------------------------------------------------------------------------------------------


def _edge(source: str, target: str, in_function: bool = False, lazy: bool = False) -> Edge:
    return Edge(source, target, 1, in_function, lazy)


def test_checker_finds_a_planted_cycle():
    edges = [_edge("p.a", "p.b"), _edge("p.b", "p.c"), _edge("p.c", "p.a", in_function=True, lazy=True)]
    edges.append(_edge("p.c", "p.d"))
    assert find_cycles(edges) == [["p.a", "p.b", "p.c"]]
    assert {e.target for e in cycle_edges(edges, ["p.a", "p.b", "p.c"])} == {"p.a", "p.b", "p.c"}
    assert find_cycles(edges[:2] + edges[3:]) == []  # cut the back edge: acyclic


def test_checker_finds_upward_imports_and_missing_lazy_comments():
    layers = {0: ("p.low",), 1: ("p.mid", "p.sub.*"), 2: ("p.top",)}
    edges = [
        _edge("p.top", "p.low"),  # downward: fine
        _edge("p.mid", "p.sub.x"),  # same layer: fine
        _edge("p.low", "p.top", in_function=True, lazy=True),  # upward, even though lazy
        _edge("p.mid", "p.low", in_function=True),  # downward but no lazy comment
    ]
    assert layer_problems(edges, layers) == ["p.low:1 (function-level) imports p.top: upward import (L0 -> L2)"]
    assert [p.split(":")[0] for p in lazy_problems(edges)] == ["p.mid"]
    assert layer_of("p.sub.deep.y", layers) == 1 and layer_of("p.other", layers) is None


def test_checker_reads_function_level_imports_from_source(tmp_path):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from fakepkg import b\n")
    (pkg / "b.py").write_text(
        "def f():\n"
        "    from fakepkg.a import thing\n"  # hidden cycle, no comment
        "\n"
        "def g():\n"
        "    # lazy: keeps the heavy c out of importing b\n"
        "    import fakepkg.c\n"
        "    from .a import other\n"  # relative, in the run of imports under the comment
    )
    (pkg / "c.py").write_text("")
    edges = import_graph(tmp_path, "fakepkg")
    assert [(e.source, e.target, e.line, e.in_function, e.lazy_comment) for e in edges] == [
        ("fakepkg.a", "fakepkg.b", 1, False, False),
        ("fakepkg.b", "fakepkg.a", 2, True, False),
        ("fakepkg.b", "fakepkg.c", 6, True, True),
        ("fakepkg.b", "fakepkg.a", 7, True, True),
    ]
    assert find_cycles(edges) == [["fakepkg.a", "fakepkg.b"]]
    assert lazy_problems(edges) == [
        "fakepkg.b:2 (function-level) imports fakepkg.a: no 'lazy:' comment saying why it is not at module level"
    ]
