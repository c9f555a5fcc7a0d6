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


def _version(value: bool) -> None:
    """``oxrl --version``: the core's version, read without importing torch (or anything of a run)."""
    if value:
        from oxrl_core import __version__  # lazy: only `--version` needs it (the package import is cheap)

        print(f"oxrl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="print oxRL's version and exit"
    ),
) -> None:
    """oxRL: readable, pluggable post-training (SFT, preference optimisation, RL)."""


@app.command()
def run(
    alg: Optional[str] = typer.Option(
        None, "--alg", "-a", help="algorithm name (see `oxrl plugins`); or `algorithm:` in the config"
    ),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override a config key: --set train.lr=1e-5 (repeatable)"),
    output_dir: Optional[Path] = typer.Option(
        None, "--output-dir", "-o", help="run directory (default runs/<alg>-<timestamp>)"
    ),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest complete checkpoint"),
    force_config: bool = typer.Option(
        False,
        "--force-config",
        help="with --resume: allow --set/--config to change the model, data or algorithm of the checkpoint",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output; only the result and errors"),
):
    """Train: oxrl run --alg sft [--config my.yaml] [--set train.lr=1e-5].

    Ctrl-C or SIGTERM saves a checkpoint after the step in progress and exits (130 / 143); again: at once."""
    # lazy: every command imports only what it runs; the trainer brings torch, kept out of `oxrl --help`
    from oxrl_core.trainer import Trainer

    if force_config and not resume:
        raise OxrlError(
            "--force-config applies to --resume only (it allows changing a resumed checkpoint's model, data or algorithm)"
        )
    trainer = Trainer(
        alg=alg,
        config=config,
        overrides=set_,
        output_dir=output_dir,
        resume=resume,
        quiet=quiet,
        force_config=force_config,
    )
    trainer.train()


@app.command()
def plugins(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """List installed algorithms, rewards, datasets and rollout backends, and plugins that failed to load."""
    # lazy: discovery reads entry points without importing torch (`oxrl plugins` stays light)
    from oxrl_core.plugins import discover

    registry = discover()
    rows = registry.rows()
    if as_json:
        errors = [
            {"plugin": e.plugin, "package": e.package, "version": e.version, "error": e.error} for e in registry.errors
        ]
        listing = {
            "plugins": rows,
            "errors": errors,
            "clashes": registry.clash_rows(),
            "aliases": registry.alias_rows(),
        }
        out.print_json(json.dumps(listing))
        return
    table = Table(title="oxRL plugins")
    for column in ("kind", "name", "package", "version"):
        table.add_column(column)
    for row in rows:
        name = f"[yellow]{escape(row['name'])} (ambiguous)[/yellow]" if row["ambiguous"] else escape(row["name"])
        table.add_row(row["kind"], name, row["package"], row["version"])
    out.print(table)
    for alias in registry.alias_rows():
        out.print(f"alias: {alias['kind']} {alias['name']} → {alias['alias_of']}", highlight=False, soft_wrap=True)
    for clash in registry.clash_rows():
        err.print(
            f"[yellow]name clash:[/yellow] {escape(registry.describe_clash(clash['kind'], clash['name']))}",
            highlight=False,
            soft_wrap=True,
        )
    for e in registry.errors:
        err.print(
            f"[red]failed to load[/red] plugin '{escape(e.plugin)}' ({escape(e.package)} {e.version}): {escape(e.error)}",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def doctor(
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help="list this Ray cluster's nodes (default: $RAY_ADDRESS; never starts a cluster)",
    ),
):
    """Check the environment: torch/CUDA, DeepSpeed, Ray, vLLM, trackers, plugins that failed to load, and the
    nodes of a Ray cluster (--ray-address or $RAY_ADDRESS): node ids, hosts, CPUs and GPUs."""
    # lazy: `oxrl doctor` imports its checks only when it runs (keeps `oxrl --help` light)
    from oxrl_core.commands.doctor import cluster_rows, table_rows
    from oxrl_core.plugins import discover

    table = Table(title="oxRL doctor")
    for column in ("component", "status", "detail"):
        table.add_column(column, overflow="fold")  # a long word (a node id) is wrapped whole, never cut with "…"
    registry = discover()
    bad_status = {"plugins": "[red]errors[/red]", "ray cluster": "[red]unreachable[/red]"}
    rows = [*table_rows(registry), *cluster_rows(ray_address)]
    for name, ok, detail in rows:
        table.add_row(name, "[green]ok[/green]" if ok else bad_status.get(name, "[yellow]missing[/yellow]"), detail)
    clashes = registry.clash_rows()
    nodes = any(name.startswith("ray node") for name, _, _ in rows)
    # a node id is one 56-character word: written to a pipe or a file, the table is wide enough to keep it on one line
    (out if out.is_terminal or not nodes else Console(width=max(out.width, 160))).print(table)
    for clash in clashes:
        out.print(
            f"[yellow]name clash:[/yellow] {escape(registry.describe_clash(clash['kind'], clash['name']))}",
            highlight=False,
            soft_wrap=True,
        )
    for e in registry.errors:
        out.print(
            f"[red]plugin '{escape(e.plugin)}'[/red] ({escape(e.package)} {e.version}) failed to load: {escape(e.error)}",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def score(
    reward: str = typer.Option(..., "--reward", "-r", help="reward name (see `oxrl plugins`) or file.py:Class"),
    data: Path = typer.Option(
        ...,
        "--data",
        "-d",
        help="JSONL/JSON/Parquet/CSV rows that hold a `completion` (plus the fields the reward needs)",
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="write one JSON object per row here (default: stdout)"
    ),
    set_: list[str] = typer.Option([], "--set", "-s", help="a reward option: --set workers=4 (repeatable)"),
):
    """Score completions with a reward before a run: one JSON object per row with `score` and the reward's details."""
    # lazy: only `oxrl score` needs the reward machinery (keeps `oxrl --help` light)
    from oxrl_core.scoring.offline import score_file

    score_file(reward, data, output, set_, console=err)


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="one or more run directories (several: their curves overlaid)"),
    output: Optional[Path] = typer.Option(
        None,
        "--output",
        "-o",
        help="the HTML file (default: RUN_DIR/report.html for one run, ./report.html for several)",
    ),
):
    """Write one self-contained HTML report (opens from disk, offline): config and versions, warnings, the
    curves of the run's algorithm, held-out metrics, and for RL runs a rollout viewer."""
    # lazy: only `oxrl report` reads runs (keeps `oxrl --help` light)
    from oxrl_core.observability.report import write_report

    target = output or (run_dirs[0] / "report.html" if len(run_dirs) == 1 else Path("report.html"))
    path = write_report(run_dirs, target)
    out.print(f"report written to {escape(str(path))}", highlight=False, soft_wrap=True)


@app.command("eval")
def eval_(
    model: str = typer.Option(..., "--model", "-m", help="a model directory (e.g. runs/sft-.../final) or hub id"),
    data: str = typer.Option(
        "arith",
        "--data",
        "-d",
        help="held-out rows: a file, a dataset plugin (its eval split) or a hub id; "
        "with options as YAML: '{source: arith, task: products}'",
    ),
    reward: str = typer.Option("", "--reward", "-r", help="reward name; empty = the dataset plugin's own answer check"),
    n: int = typer.Option(
        1, "--n", "-n", min=1, help="samples per prompt; n > 1 also reports pass@k for k = 1, 2, 4, ..., n"
    ),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", "-t", min=0.0, help="default: 0 (greedy) when n = 1, else 1.0"
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    limit: int = typer.Option(0, "--limit", min=0, help="evaluate only the first N rows (0 = all)"),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="prompts per generate call"),
    seed: int = typer.Option(0, "--seed"),
    backend: str = typer.Option("hf", "--backend", help="rollout backend plugin that generates"),
    env: str = typer.Option(
        "", "--env", help="play multi-turn episodes with this environment (e.g. calculator); pass@k over episodes"
    ),
    max_turns: int = typer.Option(4, "--max-turns", min=1, help="with --env: model turns per episode at most"),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="also write the report, with every completion and score, as JSON here"
    ),
    as_json: bool = typer.Option(
        False, "--json", help="print the report (without the samples) as JSON instead of a table"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output (model loading, samples so far)"),
):
    """Evaluate a model on held-out prompts: mean reward, pass@1 and pass@k."""
    # lazy: `oxrl eval` loads torch and transformers; kept out of `oxrl --help`
    from oxrl_core.commands.eval_command import evaluate_model
    from oxrl_core.observability.progress import Reporter

    report = evaluate_model(
        model=model,
        data=data,
        reward=reward,
        n=n,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        limit=limit,
        batch_size=batch_size,
        seed=seed,
        backend=backend,
        env=env,
        max_turns=max_turns,
        reporter=Reporter(quiet),
    )
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2) + "\n")
    if as_json:
        out.print_json(json.dumps({k: v for k, v in report.items() if k != "samples"}))
        return
    table = Table(title=f"oxrl eval · {escape(model or 'built-in tiny model')} · {escape(report['data'])}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report["metrics"].items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    out.print(table)


@app.command("check-model")
def check_model(
    model: str = typer.Argument(..., help="a model directory or hub id"),
    as_json: bool = typer.Option(False, "--json", help="print the report as one JSON object instead of tables"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow the model's own Python code"),
):
    """Check a model before training: architecture, tokenizer, chat template, which oxRL paths apply, problems and fixes.
    Exits with status 2 when oxRL cannot train the model."""
    # lazy: `oxrl check-model` loads torch and transformers; kept out of `oxrl --help`
    from oxrl_core.commands.check_model import check_model as inspect
    from oxrl_core.commands.check_model_render import render, to_json

    report = inspect(model, trust_remote_code=trust_remote_code)
    if as_json:
        print(to_json(report))
    else:
        render(report, out)
    if not report["ok"]:
        raise typer.Exit(2)


@app.command("new-plugin")
def new_plugin(
    name: str = typer.Argument(..., help="plugin name, e.g. myalg (package oxrl-myalg)"),
    kind: str = typer.Option(
        "algorithm", "--kind", "-k", help="what to scaffold: algorithm, or environment (multi-turn RL with tools)"
    ),
    loop: Optional[str] = typer.Option(
        None,
        "--loop",
        "-l",
        help="an algorithm's loop: supervised (the default), preference (a DPO-style loss) or rl (a group-relative "
        "policy gradient)",
    ),
    directory: Path = typer.Option(Path("."), "--dir", help="where to create oxrl-<name>/"),
):
    """Scaffold a third-party plugin package that installs and runs: an algorithm for the supervised, preference
    or RL loop (--loop), or (--kind environment) a tools-style environment for multi-turn RL."""
    # lazy: only `oxrl new-plugin` needs the scaffold (keeps `oxrl --help` light)
    from oxrl_core.commands.scaffold import create, name_taken, next_steps

    root = create(name, directory, kind, loop)
    warning = name_taken(name, kind)
    if warning:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)
    out.print(next_steps(root, name, kind, ambiguous=bool(warning)), highlight=False, soft_wrap=True)


@app.command("bug-report")
def bug_report(
    run_dir: Optional[Path] = typer.Argument(
        None, help="a run directory (runs/<alg>-...); without it: versions and plugins only"
    ),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="write the markdown here (default: stdout)"),
    redact_paths: bool = typer.Option(False, "--redact-paths", help="also write paths under your home directory as ~"),
    metrics: int = typer.Option(5, "--metrics", min=0, help="how many of the last metrics.jsonl lines to include"),
):
    """Write a ready-to-paste markdown issue body: versions, plugins, and a run's config, last error with its
    traceback and last metrics; secrets (tokens, keys, passwords) redacted. Nothing is uploaded."""
    # lazy: only `oxrl bug-report` needs it (it runs the doctor's checks, which import torch)
    from oxrl_core.commands.bug_report import bug_report as report
    from oxrl_core.commands.bug_report import write

    write(report(run_dir, redact_paths=redact_paths, metrics=metrics), output)
    if output is not None:
        err.print(f"wrote {escape(str(output))}: read it through, then paste it into a new issue", highlight=False)


def main() -> None:
    """The console script. Ctrl-C / SIGTERM are oxRL's own (`lifecycle`), not the CLI framework's: click would
    catch a KeyboardInterrupt and exit 1; a run saves a checkpoint first and exits 130 / 143."""
    # lazy: the signal handling of a run; kept out of `oxrl --help`
    from oxrl_core.run_io import lifecycle

    try:
        with lifecycle.handle_signals(lifecycle.stop_at_once):
            app()
    except OxrlError as exc:
        err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (lifecycle.Interrupted, lifecycle.StopNow) as exc:
        err.print(escape(str(exc)), highlight=False, soft_wrap=True)
        sys.exit(exc.exit_status)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
