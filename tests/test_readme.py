"""The README's promises that can be checked without a network: CI runs its test command verbatim."""

from conftest import ROOT


def _ci_command() -> str:
    lines = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    assert f"\n{_ci_command()}\n" in readme


def test_every_example_is_documented_and_names_its_algorithm():
    readme = (ROOT / "README.md").read_text()
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        assert f"examples/{example.name}" in readme
        assert f"algorithm: {example.stem}" in example.read_text()


def test_every_promise_in_the_readme_points_at_a_test_that_exists():
    """The section "What oxRL promises when things go wrong" names its tests as `file.py::test`, or
    `::test` for the file named last; each must be a test function in that file."""
    import ast
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What oxRL promises when things go wrong", 1)[1].split("\n## ", 1)[0]
    refs = re.findall(r"`((?:test_\w+\.py)?)::(test_\w+)`", section)
    assert len(refs) >= 30
    current, missing = None, []
    defined: dict[str, set[str]] = {}
    for file, name in refs:
        current = file or current
        if current not in defined:
            tree = ast.parse((ROOT / "tests" / current).read_text())
            defined[current] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name not in defined[current]:
            missing.append(f"{current}::{name}")
    assert not missing, missing
