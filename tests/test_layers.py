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

The plugin boundary: every other distribution in the repository (a directory with a ``pyproject.toml``: the
algorithm, reward, dataset, backend and environment packages, their tests and scripts), the scaffold's templates
and the README's example plugin import only the public API: the names of ``oxrl_core.__all__``, ``from oxrl_core
import ...`` (or ``import oxrl_core``); never a module path ``oxrl_core.<module>``, so a core module can move
without a plugin noticing.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
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
    0: ("oxrl_core", "oxrl_core.errors", "oxrl_core.schema", "oxrl_core.ops", "oxrl_core.batches", "oxrl_core.atomic",
        "oxrl_core.hookspecs", "oxrl_core.hf_env", "oxrl_core.user_code", "oxrl_core.tool_parsers",
        "oxrl_core.chat_templates", "oxrl_core.redact", "oxrl_core.answers", "oxrl_core.seeds"),
    # L1 the contracts: plugin interfaces, batch types, the engine protocol
    1: ("oxrl_core.algorithm", "oxrl_core.interfaces"),
    # L2 the run configuration (YAML schema) and the plugin registry
    2: ("oxrl_core.config", "oxrl_core.config_renames", "oxrl_core.config_rollout", "oxrl_core.plugins",
        "oxrl_core.builtin_plugins"),
    # L3-L9 the services, one sub-package each
    3: ("oxrl_core.engines", "oxrl_core.engines.*"),  # torch / DeepSpeed engines, the collectives between ranks
    4: ("oxrl_core.observability", "oxrl_core.observability.*"),  # console progress, health findings, the report
    5: ("oxrl_core.data", "oxrl_core.data.*"),  # sources, rows, tokenisation, batching, the built-in task
    6: ("oxrl_core.models", "oxrl_core.models.*"),  # loading, LoRA, critic, packed attention, the chunked head
    7: ("oxrl_core.run_io", "oxrl_core.run_io.*"),  # checkpoints, lifecycle, tracking, recorded inputs
    8: ("oxrl_core.rollout", "oxrl_core.rollout.*"),  # the hf backend, actors, weight sync, rollout log, env workers
    9: ("oxrl_core.scoring", "oxrl_core.scoring.*"),  # rewards at run time, `oxrl score`, held-out evaluation
    # L10 what an RL step is made of: prompts, the rollout batch, typed records, strategies, episodes, the source
    10: ("oxrl_core.rl", "oxrl_core.rl.*"),
    # L11 the loops: one run skeleton and one file per loop
    11: ("oxrl_core.loops", "oxrl_core.loops.*"),
    # L12 the run: the trainer (start-up checks, the loop for the algorithm) and the multi-rank launcher
    12: ("oxrl_core.trainer", "oxrl_core.launcher"),
    # L13 the command line and the commands beside `oxrl run`
    13: ("oxrl_core.cli", "oxrl_core.commands", "oxrl_core.commands.*"),
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


# ------------------------------------------------------------------------------------------------
# The plugin boundary: a distribution other than the core imports only the public API
# ------------------------------------------------------------------------------------------------

#: the modules of the core a plugin may import: the package alone (its ``__all__``; ``ops`` is one of its names)
PUBLIC_MODULES = ("oxrl_core",)
#: what a plugin's own tree may hold that is not its source
_NOT_SOURCE = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__", ".pytest_cache"}


def distributions(root: Path = ROOT) -> list[Path]:
    """Every distribution in the repository other than the core: a directory with a ``pyproject.toml``."""
    return sorted(
        p.parent
        for p in root.rglob("pyproject.toml")
        if p.parent != root and not _NOT_SOURCE.intersection(p.relative_to(root).parts)
    )


def distribution_files(dist: Path) -> list[Path]:
    """A distribution's Python files (its packages, tests and scripts), build outputs left out."""
    return sorted(
        p
        for p in dist.rglob("*.py")
        if not _NOT_SOURCE.intersection(p.relative_to(dist).parts)
        and not any(part.endswith(".egg-info") for part in p.relative_to(dist).parts)
    )


def private_imports(
    path: Path, public_names: frozenset[str], label: str | None = None, package: str = PACKAGE
) -> list[str]:
    """Every import in one file (module-level and function-level) of a private module of ``package``, or of a
    name ``from package import`` that its ``__all__`` (``public_names``) does not list; as ``file:line`` messages."""
    label = label or str(path)
    tree = ast.parse(path.read_text())
    inside_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside_function.update(id(sub) for sub in ast.walk(node) if sub is not node)
    public = {package, *(package + m[len(PACKAGE) :] for m in PUBLIC_MODULES)}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.startswith(package + ".") and a.name not in public]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module == package:
            bad = [f"{package}.{a.name}" for a in node.names if a.name != "*" and a.name not in public_names]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(package + "."):
            bad = [node.module] if node.module not in public else []
        else:
            continue
        kind = "function-level" if id(node) in inside_function else "module-level"
        problems += [
            (node.lineno, f"{label}:{node.lineno} ({kind}) imports {name}: not {package}'s public API") for name in bad
        ]
    return [message for _, message in sorted(problems)]


def _public_names() -> frozenset[str]:
    import oxrl_core

    return frozenset(oxrl_core.__all__)


DISTRIBUTIONS = distributions()


def test_the_distributions_are_found():
    names = {d.relative_to(ROOT).as_posix() for d in DISTRIBUTIONS}
    assert {"oxrl_rewards", "oxrl_algs_rl", "plugins/oxrl-datasets", "plugins/oxrl-envs"} <= names, names


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_plugins_import_only_the_public_api(dist):
    names = _public_names()
    problems = [
        problem
        for path in distribution_files(dist)
        for problem in private_imports(path, names, label=path.relative_to(ROOT).as_posix())
    ]
    assert not problems, (
        "a plugin imports only top-level names, `from oxrl_core import X` (X in oxrl_core.__all__), never a module "
        "path such as oxrl_core.interfaces or oxrl_core.ops; export what it needs from oxrl_core/__init__.py (its "
        "_LAZY map) or drop the need:\n" + "\n".join(problems)
    )


def test_the_scaffolded_plugins_import_only_the_public_api(tmp_path):
    """What ``oxrl new-plugin`` writes, of every kind and every algorithm loop, imports only the public API."""
    from oxrl_core.commands.scaffold import KINDS, LOOPS, create

    names = _public_names()
    problems = []
    variants = [(kind, loop) for kind in KINDS for loop in (LOOPS if kind == "algorithm" else [None])]
    assert len(variants) == len(KINDS) - 1 + len(LOOPS) >= 4
    for kind, loop in variants:
        label = f"{kind} --loop {loop}" if loop else kind
        root = create(f"fake_{loop or kind}", tmp_path, kind=kind, loop=loop)
        problems += [
            problem
            for path in distribution_files(root)
            for problem in private_imports(path, names, label=f"scaffold {label}: {path.relative_to(root)}")
        ]
        assert len(distribution_files(root)) >= 3, label  # the hook module, the plugin's class, its test
    assert not problems, "\n".join(problems)


def test_the_readme_example_plugin_imports_only_the_public_api(tmp_path):
    """The README's example plugin (``oxrl_myalg``): its imports are public and every name resolves."""
    import re

    import oxrl_core

    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "oxrl_myalg/" in b.split("\n")[0]]
    assert len(blocks) >= 2, "the README's example plugin (oxrl_myalg/__init__.py, oxrl_myalg/algorithm.py) moved"
    names, problems = _public_names(), []
    for i, block in enumerate(blocks):
        path = tmp_path / f"block{i}.py"
        path.write_text(block)
        problems += private_imports(path, names, label=f"README oxrl_myalg block {i}")
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                module = importlib.import_module(node.module)
                assert all(hasattr(module, a.name) for a in node.names), ast.unparse(node)
    assert not problems, "\n".join(problems)
    assert oxrl_core.Algorithm is importlib.import_module("oxrl_core.interfaces").Algorithm


def test_the_public_api_resolves_and_stays_light():
    """Every name in ``oxrl_core.__all__`` resolves; ``import oxrl_core`` loads no torch; ``from oxrl_core import
    ops`` (a module) works as a name does."""
    code = (
        "import sys, oxrl_core\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'import oxrl_core loaded torch'\n"
        "from oxrl_core import OxrlError, hookimpl, Algorithm, ToolEnvironment, answers\n"
        "assert 'torch' not in sys.modules, 'the interfaces loaded torch'\n"
        "from oxrl_core import ops, errors\n"
        "import oxrl_core.ops, oxrl_core.interfaces, oxrl_core.errors, oxrl_core.hookspecs\n"
        "assert ops is oxrl_core.ops and errors.OxrlError is OxrlError\n"
        "missing = [n for n in oxrl_core.__all__ if getattr(oxrl_core, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert sorted(set(oxrl_core.__all__)) == sorted(oxrl_core.__all__), 'a name twice in __all__'\n"
        "assert set(oxrl_core.__all__) <= set(dir(oxrl_core))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


# the checkers on planted cases


def test_the_plugin_checker_catches_a_private_import(tmp_path):
    plugin = tmp_path / "oxrl-fake"
    (plugin / "oxrl_fake").mkdir(parents=True)
    (plugin / "pyproject.toml").write_text("[project]\nname = 'oxrl-fake'\n")
    (plugin / "oxrl_fake" / "__init__.py").write_text(
        "import oxrl_core.models.loading\n"  # 1: module-level, import form
        "from oxrl_core import Algorithm, hookimpl, ops\n"  # public
        "from oxrl_core.interfaces import StrictModel\n"  # 3: a module path, though the module stays importable
        "from oxrl_core.models import loading\n"  # 4: module-level, from form
        "import oxrl_core.ops\n"  # 5: a module path, though `ops` is a public name
        "\n"
        "def f():\n"
        "    import oxrl_core.data.encode\n"  # 8: function-level, import form
        "    from oxrl_core.rollout import hf\n"  # 9: function-level, from form
        "    from oxrl_core import load_tokenizer, models\n"  # 10: `models` is a private sub-package, not a name
        "    from . import sibling\n"  # relative: the plugin's own
        "    return lambda: __import__('x')\n"
    )
    (plugin / "oxrl_fake" / "build").mkdir()
    (plugin / "oxrl_fake" / "build" / "old.py").write_text("import oxrl_core.loops.rl\n")  # build output: not read
    assert distributions(tmp_path) == [plugin]
    files = distribution_files(plugin)
    assert [f.name for f in files] == ["__init__.py"]
    names = frozenset({"Algorithm", "hookimpl", "ops", "load_tokenizer"})
    problems = private_imports(files[0], names, label="oxrl_fake/__init__.py")
    assert problems == [
        "oxrl_fake/__init__.py:1 (module-level) imports oxrl_core.models.loading: not oxrl_core's public API",
        "oxrl_fake/__init__.py:3 (module-level) imports oxrl_core.interfaces: not oxrl_core's public API",
        "oxrl_fake/__init__.py:4 (module-level) imports oxrl_core.models: not oxrl_core's public API",
        "oxrl_fake/__init__.py:5 (module-level) imports oxrl_core.ops: not oxrl_core's public API",
        "oxrl_fake/__init__.py:8 (function-level) imports oxrl_core.data.encode: not oxrl_core's public API",
        "oxrl_fake/__init__.py:9 (function-level) imports oxrl_core.rollout: not oxrl_core's public API",
        "oxrl_fake/__init__.py:10 (function-level) imports oxrl_core.models: not oxrl_core's public API",
    ]


def test_the_layer_checker_catches_a_planted_upward_import(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("data", "loops"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "loops" / "y.py").write_text("from pkg.data import x\n")  # downward: fine
    (pkg / "data" / "x.py").write_text("def f():\n    # lazy: planted\n    from pkg.loops.y import thing\n")
    layers = {0: ("pkg",), 5: ("pkg.data", "pkg.data.*"), 10: ("pkg.loops", "pkg.loops.*")}
    edges = import_graph(tmp_path, "pkg")
    assert layer_problems(edges, layers) == [
        "pkg.data.x:3 (function-level) imports pkg.loops.y: upward import (L5 -> L10)"
    ]
    assert find_cycles(edges) == [["pkg.data.x", "pkg.loops.y"]]
