"""The README's promises that can be checked without a network: CI runs its test command verbatim."""

from conftest import ROOT


def _ci_command() -> str:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
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
