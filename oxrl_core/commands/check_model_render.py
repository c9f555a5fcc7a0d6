"""`oxrl check-model`'s report (`check_model.check_model`) as the terminal shows it (rich tables) and as JSON.

A module of its own because it reads nothing but the report's dict: the checks load models, this only prints.
"""

from __future__ import annotations

import json


def _yes(flag) -> str:
    return "[green]yes[/green]" if flag else "[yellow]no[/yellow]"


def render(report: dict, console) -> None:
    """The report as rich tables: the model, the oxRL paths, the problems with their fixes."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"oxRL check-model: {escape(report['path'])}", show_header=True)
    table.add_column("field")
    table.add_column("value")
    vocab, att = report["vocab"], report["attention"]
    arch = report["architecture"] or "?"
    if report.get("loaded_class") and report["loaded_class"] != arch:
        arch += f" (loads as {report['loaded_class']})"
    table.add_row("architecture", escape(arch))
    mt = report["model_type"] or "?"
    if report["nested_text_config"]:
        mt += f" (text config nested: {report['text_model_type']})"
    table.add_row("model_type", escape(mt))
    table.add_row(
        "parameters", f"{report['parameters']:,}" if report["parameters"] is not None else "[red]not loaded[/red]"
    )
    table.add_row(
        "vocabulary",
        f"config {vocab['config']}, embedding rows {vocab['embedding_rows']}, tokenizer {vocab['tokenizer']}",
    )
    table.add_row(
        "attention",
        f"{att['num_layers']} layers, hidden {att['hidden_size']}, heads {att['num_heads']}, "
        f"kv heads {att['num_kv_heads']}, head_dim {att['head_dim']}",
    )
    window = att["sliding_window"]
    if window and att["sliding_layers"] is not None:
        window = f"{window} ({att['sliding_layers']}/{att['num_layers']} layers)"
    table.add_row("sliding window", str(window or "none"))
    table.add_row(
        "soft-capping",
        f"attention {att['attn_logit_softcapping'] or 'none'}, final logits {att['final_logit_softcapping'] or 'none'}",
    )
    moe = report["moe"]
    table.add_row("MoE", f"{moe['num_experts']} experts, {moe['experts_per_token']} per token" if moe else "no")
    table.add_row("max positions", str(report["max_positions"]))
    table.add_row("tied embeddings", _yes(report["tied_embeddings"]))
    tokens = report["tokens"]
    if tokens:

        def show(t):
            return "[red]none[/red]" if t["id"] is None else f"{escape(repr(t['token']))} ({t['id']})"

        table.add_row(
            "EOS / pad / BOS",
            f"{show(tokens['eos'])} / {show(tokens['pad'])}"
            f"{' (= EOS)' if tokens['pad_is_eos'] else ''} / {show(tokens['bos'])}",
        )
    chat = report["chat_template"]
    if chat:
        if not chat["present"]:
            table.add_row("chat template", "[yellow]none[/yellow]")
        else:
            table.add_row(
                "chat template",
                f"renders conversation {_yes(chat['renders_conversation'])}, generation prompt "
                f"{_yes(chat['renders_generation_prompt'])}, completion follows {_yes(chat['completion_follows'])}",
            )
    if report.get("vision"):
        _vision_rows(table, report["vision"], escape)
    console.print(table)

    if report["paths"]:
        paths = Table(title="oxRL paths", show_header=True)
        for column in ("path", "applies", "detail"):
            paths.add_column(column)
        for key, value in report["paths"].items():
            paths.add_row(key, _yes(value["applies"]), escape(value["detail"]))
        console.print(paths)

    if report["problems"]:
        problems = Table(title="problems", show_header=True)
        problems.add_column("severity")
        for column in ("problem", "fix"):
            problems.add_column(column, overflow="fold")  # a path in full on a narrow terminal, never cut with …
        colour = {"error": "red", "warning": "yellow", "note": "cyan"}
        for p in report["problems"]:
            problems.add_row(f"[{colour[p['severity']]}]{p['severity']}[/]", escape(p["problem"]), escape(p["fix"]))
        console.print(problems)
    verdict = (
        "[green]oxRL can train this model[/green]"
        if report["ok"]
        else "[bold red]oxRL cannot train this model as it is[/bold red] (see the errors above)"
    )
    console.print(verdict)


def _vision_rows(table, vis: dict, escape) -> None:
    """A VLM's rows of the model table: family, vision tower and projector, processor, image token, image tokens."""
    if not vis["verified"]:
        table.add_row(
            "vision family",
            f"[red]{escape(vis['family'])}: not verified[/red] (verified: {', '.join(vis['verified_families'])})",
        )
        return
    table.add_row("vision family", f"{escape(vis['family'])} (verified)")
    tower, projector = vis.get("tower"), vis.get("projector")
    if tower:
        line = f"{tower['module']} ({tower['class']}, {tower['parameters']:,} parameters)"
        line += (
            f"; projector {projector['module']} ({projector['class']}, {projector['parameters']:,})"
            if projector
            else "; no separate projector"
        )
        table.add_row("vision tower", escape(line))
    if "processor" not in vis:
        return
    processor = vis["processor"]
    if processor is None:
        table.add_row("processor", "[yellow]not loaded[/yellow]")
    else:
        line = f"{processor['class']} (image processor {processor['image_processor']})"
        if processor["without_video"]:
            why = "video processor config absent" if processor["torchvision"] else "torchvision absent"
            line += f", built without its video processor ({why})"
        table.add_row("processor", escape(line))
    token = vis["image_token"]
    table.add_row(
        "image token",
        escape((f"{token['token']!r} ({token['id']})" if token else "none") + f", placeholder {vis['placeholder']!r}"),
    )
    per_image = vis["tokens_per_image"]
    counts = ", ".join(f"{n} for {size.replace('x', '×')}" for size, n in per_image.items()) if per_image else "?"
    table.add_row(
        "image tokens",
        escape(f"{vis['tokens']}: {counts}; extra inputs {', '.join(vis['extra_inputs'])}"),
    )


def to_json(report: dict) -> str:
    return json.dumps(report, default=str)
