"""Issue 24, item 10: a chat template that does not compile, or raises on a plain conversation, is one message
naming the template, its line and jinja2's error (exit status 2, no traceback), from `oxrl run` for a
`model.chat_template` file and for a model's own template, and an error (exit status 2) in `oxrl check-model`.
"""

from __future__ import annotations

import json
import shutil

from conftest import oxrl, write_jsonl
from typer.testing import CliRunner

SFT_ROWS = [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(4) for b in range(4)]

#: line 2 does not compile (a lone '}' ends the expression)
SYNTAX_ERROR = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}\n"
#: compiles, and raises on line 3 whatever the conversation
RAISES = "{% for m in messages %}\n{{ m['content'] }}\n{{ raise_exception('this template wants a system turn') }}\n{% endfor %}\n"


def _run(tmp_path, model, *args: str):
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    return oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={model}",
        "--set",
        f"data.train={data}",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.batch_size=4",
        *args,
        cwd=tmp_path,
    )


def _user_error(proc, *parts: str) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    for part in parts:
        assert part in text, (part, text)
    return text


def test_a_chat_template_file_that_does_not_compile_or_raises_is_refused_naming_its_line(tmp_path, tiny_model_dir):
    """A file that does not compile is refused when the config is read (before any model loads or directory is
    made); one that calls raise_exception when the tokenizer loads, before a row is tokenised. The template files
    are left as they were."""
    broken = tmp_path / "broken.jinja"
    broken.write_text(SYNTAX_ERROR)
    run = tmp_path / "run-broken"
    _user_error(
        _run(tmp_path, tiny_model_dir, "--set", f"model.chat_template={broken}", "-o", str(run)),
        "model.chat_template",
        f"the chat template {broken} does not compile",
        "line 2: unexpected '}' (TemplateSyntaxError)",
    )
    assert not run.exists() and broken.read_text() == SYNTAX_ERROR

    raising = tmp_path / "raises.jinja"
    raising.write_text(RAISES)
    run = tmp_path / "run-raises"
    _user_error(
        _run(tmp_path, tiny_model_dir, "--set", f"model.chat_template={raising}", "-o", str(run)),
        f"model.chat_template: the chat template {raising} fails on a user turn with the generation prompt",
        "line 3: this template wants a system turn (the template's raise_exception)",
    )
    assert not (run / "final").exists() and raising.read_text() == RAISES


def test_a_models_own_broken_template_is_refused_by_run_and_an_error_in_check_model(tmp_path, tiny_model_dir):
    """The model's chat_template.jinja raises: `oxrl run` names that file, its line and the message, and
    model.chat_template (the fix it suggests) trains the same model. `oxrl check-model` says it cannot train a
    model whose template does not compile (exit 2), naming the file and the line, in the table and the JSON."""
    from oxrl_core.cli import app

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    template = model / "chat_template.jinja"
    template.write_text(RAISES)
    _user_error(
        _run(tmp_path, model, "-o", str(tmp_path / "run")),
        f"model.name: the tokenizer's chat template ({template}) fails on a user turn",
        "line 3: this template wants a system turn (the template's raise_exception)",
        "set model.chat_template",
    )
    proc = _run(tmp_path, model, "--set", "model.chat_template=chatml", "-o", str(tmp_path / "run-chatml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "run-chatml" / "final" / "model.safetensors").is_file()

    template.write_text(SYNTAX_ERROR)
    text = _user_error(
        oxrl("check-model", str(model), env={"COLUMNS": "400"}),
        f"({template}) does not compile: line 2: unexpected '}}' (TemplateSyntaxError)",
        "cannot train this model",
    )
    assert "oxRL can train this model" not in text
    result = CliRunner().invoke(app, ["check-model", str(model), "--json"])
    assert result.exit_code == 2
    report = json.loads(result.output)
    assert report["ok"] is False
    errors = [p["problem"] for p in report["problems"] if p["severity"] == "error"]
    assert errors == [f"the chat template ({template}) does not compile: line 2: unexpected '}}' (TemplateSyntaxError)"]


#: renders plain user turns (the start-up check passes) but refuses a system turn, as many models' templates do
NO_SYSTEM = (
    "{% for m in messages %}\n"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}\n"
    "{{ m['content'] }}\n"
    "{% endfor %}\n"
)


def test_a_template_that_fails_on_one_rows_prompt_names_the_row(tmp_path):
    """A prompt that is a message list with a ``system`` turn the template refuses: `oxrl eval` (which encodes every
    prompt before it loads the weights) names the file, the row, the template's line and its message."""
    from oxrl_core.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "model", hidden_size=64, num_layers=1)
    rows = [{"prompt": "What is 1+1?", "answer": "2"}]
    rows.append(
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": "4"}
    )
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = NO_SYSTEM
    tokenizer.save_pretrained(model)
    proc = oxrl("eval", "--model", str(model), "--data", str(data), "--reward", "exact_match", cwd=tmp_path)
    _user_error(
        proc,
        f"{data}: row 2: field 'prompt': the tokenizer's chat template cannot render it",
        "line 2: System role not supported (the template's raise_exception)",
        "set model.chat_template",
    )
