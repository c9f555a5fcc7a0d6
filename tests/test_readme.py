"""The README's promises that can be checked without a network: CI runs its test command verbatim."""

from conftest import ROOT

#: the lines of .ci/run around the README's command: shell settings and the fresh virtualenv it runs in
CI_SETUP = (
    "#", "set ", "cd ", "df -h ", "export PIP_NO_CACHE_DIR=",
    'venv="$(mktemp -d)/venv"', 'python3 -m venv "$venv"', 'source "$venv/bin/activate"',
)  # fmt: skip


def _ci_lines() -> list[str]:
    return [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line]


def _ci_command() -> str:
    lines = [line for line in _ci_lines() if not line.startswith(CI_SETUP)]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_the_readme_test_command_verbatim_in_a_fresh_virtualenv():
    """CI runs the README's one test line as it is, after making and activating a new virtualenv (so the suite
    is checked where most users install; the scaffold install tests once failed only there)."""
    readme = (ROOT / "README.md").read_text()
    assert f"\n{_ci_command()}\n" in readme
    lines = _ci_lines()
    made, activated, command = (
        lines.index('python3 -m venv "$venv"'),
        lines.index('source "$venv/bin/activate"'),
        lines.index(_ci_command()),
    )
    assert made < activated < command


def test_every_example_is_documented_and_names_its_algorithm():
    readme = (ROOT / "README.md").read_text()
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        assert f"examples/{example.name}" in readme
        # sft.yaml, dpo.yaml, ...: the algorithm's own example; sft_images.yaml: the same algorithm on images
        assert f"algorithm: {example.stem.removesuffix('_images')}" in example.read_text()


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


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    import re

    anchors, fence = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.*)$", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def test_the_table_of_contents_and_every_link_resolve():
    """The README's contents list every section, in order; each `[..](#anchor)` names a heading, each
    relative link an existing file (and its `#anchor` a heading there), in the README and in docs/."""
    import re

    readme = (ROOT / "README.md").read_text()
    contents = readme.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\]\(#([^)]+)\)", contents)
    body = readme.split("## Contents", 1)[1].split("\n## ", 1)[1]
    sections = [_slug(h) for h in re.findall(r"^#{2,3} (.*)$", "## " + body, flags=re.M)]
    assert listed == sections, (set(sections) ^ set(listed)) or "out of order"
    problems = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                problems.append(f"{doc.name}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                problems.append(f"{doc.name}: {target}: no such heading")
    assert not problems, problems
