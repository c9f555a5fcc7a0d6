"""The `oxrl` command (typer + rich). A thin layer: `run` is `Trainer(...).train()`.

Imports stay light at module level so `oxrl --help` and `oxrl plugins` are fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oxrl_core.errors import OxrlError

app = typer.Typer(
    name="oxrl",
    help="oxRL: readable, pluggable post-training (SFT, preference optimisation, RL).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console()
err = Console(stderr=True)


@app.command()
def run(
    alg: Optional[str] = typer.Option(None, "--alg", "-a", help="algorithm name (see `oxrl plugins`); or `algorithm:` in the config"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override a config key: --set train.lr=1e-5 (repeatable)"),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="run directory (default runs/<alg>-<timestamp>)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest complete checkpoint"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output; only the result and errors"),
):
    """Train: oxrl run --alg sft [--config my.yaml] [--set train.lr=1e-5]."""
    from oxrl_core.trainer import Trainer

    trainer = Trainer(alg=alg, config=config, overrides=set_, output_dir=output_dir, resume=resume, quiet=quiet)
    trainer.train()


@app.command()
def plugins(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """List installed algorithms, rewards, datasets and rollout backends, and plugins that failed to load."""
    from oxrl_core.plugins import discover

    registry = discover()
    rows = registry.rows()
    if as_json:
        errors = [{"plugin": e.plugin, "package": e.package, "version": e.version, "error": e.error} for e in registry.errors]
        out.print_json(json.dumps({"plugins": rows, "errors": errors}))
        return
    table = Table(title="oxRL plugins")
    for column in ("kind", "name", "package", "version"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["kind"], row["name"], row["package"], row["version"])
    out.print(table)
    for e in registry.errors:
        err.print(f"[red]failed to load[/red] plugin '{escape(e.plugin)}' ({escape(e.package)} {e.version}): {escape(e.error)}", highlight=False, soft_wrap=True)


@app.command()
def doctor():
    """Check the environment: torch/CUDA, DeepSpeed, Ray, vLLM, trackers, and plugins that failed to load."""
    from oxrl_core.doctor import checks
    from oxrl_core.plugins import discover

    table = Table(title="oxRL doctor")
    for column in ("component", "status", "detail"):
        table.add_column(column)
    for name, ok, detail in checks():
        table.add_row(name, "[green]ok[/green]" if ok else "[yellow]missing[/yellow]", detail)
    registry = discover()
    counts = {kind: len(names) for kind, names in registry.entries.items()}
    table.add_row("plugins", "[green]ok[/green]" if not registry.errors else "[red]errors[/red]",
                  ", ".join(f"{n} {k}s" for k, n in counts.items()))
    out.print(table)
    for e in registry.errors:
        out.print(f"[red]plugin '{escape(e.plugin)}'[/red] ({escape(e.package)} {e.version}) failed to load: {escape(e.error)}", highlight=False, soft_wrap=True)


@app.command("new-plugin")
def new_plugin(
    name: str = typer.Argument(..., help="algorithm name, e.g. myalg (package oxrl-myalg)"),
    directory: Path = typer.Option(Path("."), "--dir", help="where to create oxrl-<name>/"),
):
    """Scaffold a third-party algorithm plugin package that installs and runs."""
    from oxrl_core.scaffold import create

    root = create(name, directory)
    out.print(f"created {root}\n  pip install -e {root}\n  oxrl run --alg {name} --set train.max_steps=20", highlight=False)


def main() -> None:
    try:
        app()
    except OxrlError as exc:
        err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
