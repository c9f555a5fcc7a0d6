"""The README's five-minute walkthrough ("Your model and your data in five minutes"), run as written on a
tiny local model directory and small JSONL files: its `oxrl` commands are read from the README, the hub id
is replaced by the local model, and each run is cut to a few steps."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import ROOT, oxrl, read_metrics, write_jsonl

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
QUICK = ["--set", "train.max_steps=3", "--set", "train.batch_size=4", "--set", "rollout.n=4"]
QUICK += ["--set", "rollout.max_new_tokens=8", "-q"]


def walkthrough_commands() -> list[list[str]]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your model and your data in five minutes", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("oxrl ")]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_sft_dpo_grpo_and_a_report(tmp_path, tiny_model_dir):
    commands = walkthrough_commands()
    assert [c[1] for c in commands] == ["check-model", "run", "run", "run", "report"]
    write_jsonl(
        tmp_path / "sft.jsonl",
        [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(6) for b in range(6)],
    )
    pairs = [
        {"prompt": f"What is {a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(6)
        for b in range(6)
    ]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    write_jsonl(
        tmp_path / "problems.jsonl",
        [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(6) for b in range(6)],
    )
    for command in commands:
        args = [
            str(tiny_model_dir) if a.endswith(HUB_ID) and "=" not in a else a.replace(HUB_ID, str(tiny_model_dir))
            for a in command[1:]
        ]
        if args[0] == "run":
            args += QUICK
        out = oxrl(*args, cwd=tmp_path)
        assert out.returncode == 0, (command, out.stderr[-3000:])
        assert "Traceback" not in out.stderr
    for run in ("my-sft", "my-dpo", "my-grpo"):
        assert [m["step"] for m in read_metrics(tmp_path / "runs" / run)] == [1, 2, 3]
        assert (tmp_path / "runs" / run / "final" / "config.json").is_file()
    assert "sgrpo" in (tmp_path / "runs" / "my-grpo" / "config.yaml").read_text()  # grpo runs sgrpo
    report = (tmp_path / "report.html").read_text()
    assert all(f"runs/{run}" in report or run in report for run in ("my-sft", "my-dpo", "my-grpo"))
