"""Issue 18, item 4: what a TRL / LLaMA-Factory user reaches for, each through the real CLI or the Python API.

`oxrl --version`; `train.epochs` instead of `train.max_steps`; CSV files and directories of data files as
sources (UTF-8 with or without a BOM); `model.revision` / `model.dtype` / `model.chat_template`; rows held in
memory and an already-loaded model given to `Trainer`; `grpo` as a name for SGRPO. A bad input is one message
naming the file / field / row, exit status 2, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from conftest import oxrl, read_metrics, write_jsonl

from oxrl_core.errors import OxrlError

SFT_ROWS = [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(6) for b in range(6)]  # 36 rows


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _user_error(proc: subprocess.CompletedProcess, *parts: str) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    for part in parts:
        assert part in text, (part, text)
    return text


def _sft(tmp_path: Path, model_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """A small SFT run of the tiny model (8 rows a micro-batch, no evaluation unless data.eval is set)."""
    return oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={model_dir}",
        "--set",
        "train.batch_size=8",
        "--set",
        "train.save_every=0",
        "--set",
        "train.save_minutes=0",
        *args,
        cwd=tmp_path,
    )


def _config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


# ----------------------------------------------------------------------------- oxrl --version


def test_version_prints_the_installed_version_without_importing_torch():
    proc = _ok(oxrl("--version"))
    assert proc.stdout.strip() == f"oxrl {version('oxrl')}"
    code = (
        "import sys\nfrom oxrl_core.cli import app\ntry:\n    app(['--version'])\nexcept SystemExit as e:\n"
        "    code = e.code\nprint(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "0 False False", out


# ----------------------------------------------------------------------------- train.epochs


def test_epochs_give_the_steps_from_the_data_size(tmp_path, tiny_model_dir):
    """36 rows, 8 a micro-batch, 2 micro-batches a step: 5 micro-batches (2.5 steps) an epoch, so 2 epochs = 5
    steps; the banner says so, config.yaml keeps epochs (and no max_steps, which follows from the data)."""
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run = tmp_path / "run"
    proc = _ok(
        _sft(
            tmp_path,
            tiny_model_dir,
            "--set",
            f"data.train={data}",
            "--set",
            "train.grad_accum_steps=2",
            "--set",
            "train.epochs=2",
            "-o",
            str(run),
        )
    )
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert metrics[-1]["epoch"] == pytest.approx(2.0)  # exactly two passes over the 5 micro-batches
    text = proc.stdout + proc.stderr
    assert "5 steps (2 epochs)" in text, text
    saved = _config(run)["train"]
    assert saved["epochs"] == 2 and "max_steps" not in saved
    assert json.loads((run / "summary.json").read_text())["steps"] == 5
    again = _ok(oxrl("run", "--resume", "-o", str(run), cwd=tmp_path))  # the saved config reads back: done
    assert "already complete (5 steps)" in again.stdout + again.stderr


def test_fractional_epochs_round_up(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run = tmp_path / "run"
    _ok(_sft(tmp_path, tiny_model_dir, "--set", f"data.train={data}", "--set", "train.epochs=0.3", "-o", str(run)))
    assert len(read_metrics(run)) == 2  # 5 micro-batches an epoch: ⌈0.3 × 5⌉ = 2


def test_epochs_and_max_steps_together_are_refused(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    proc = _sft(tmp_path, tiny_model_dir, "--set", "train.epochs=1", "--set", "train.max_steps=3", "-o", str(run))
    _user_error(proc, "train.epochs=1", "train.max_steps=3", "both set")
    assert not run.exists()


def test_epochs_count_prompts_in_rl(tmp_path, tiny_model_dir):
    """RL: one epoch = every prompt once at train.batch_size prompts a step (10 prompts, 4 a step: 3 steps)."""
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(10)])
    reward = tmp_path / "length.py"
    reward.write_text(
        "from oxrl_core.interfaces import Reward\n\n\nclass Length(Reward):\n    name = 'length'\n\n"
        "    def score(self, prompts, completions, examples):\n        return [float(len(c)) for c in completions]\n"
    )
    run = tmp_path / "run"
    proc = _ok(
        oxrl(
            "run",
            "--alg",
            "sgrpo",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train={data}",
            "--set",
            f"reward.name={reward}:Length",
            "--set",
            "train.batch_size=4",
            "--set",
            "rollout.n=2",
            "--set",
            "rollout.max_new_tokens=4",
            "--set",
            "train.epochs=1",
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    assert len(read_metrics(run)) == 3
    assert "3 steps (1 epoch)" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- CSV and directories of files


def test_csv_with_bom_trains_and_a_directory_of_jsonl_is_held_out(tmp_path, tiny_model_dir):
    """A CSV (BOM, quoted comma and quotes) as data.train, a directory of two JSONL files (one with a BOM) as
    data.eval: the run trains on the CSV's rows and evaluates on both files."""
    csv = tmp_path / "train.csv"
    lines = ["prompt,response"] + [f'"What is {a}+{b}, ""exactly""?",{a + b}' for a in range(4) for b in range(4)]
    csv.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    write_jsonl(held_out / "part-0.jsonl", SFT_ROWS[:3])
    (held_out / "part-1.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(SFT_ROWS[3]).encode() + b"\n")
    run = tmp_path / "run"
    proc = _ok(
        _sft(
            tmp_path,
            tiny_model_dir,
            "--set",
            f"data.train={csv}",
            "--set",
            f"data.eval={held_out}",
            "--set",
            "train.max_steps=2",
            "-o",
            str(run),
        )
    )
    assert "(16 examples)" in proc.stdout + proc.stderr  # every CSV row, the header not one of them
    metrics = read_metrics(run)
    assert len(metrics) == 2 and "eval/loss" in metrics[-1]


def test_csv_and_directory_rows_read_as_written(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from oxrl_core.data.sources import load_data

    csv = tmp_path / "a.csv"
    csv.write_bytes(b'\xef\xbb\xbfprompt,response\n"say ""hi"", please","hi, there"\n\n"two\nlines",x\n')
    rows = load_data(str(csv), "train").rows
    assert rows == [
        {"prompt": 'say "hi", please', "response": "hi, there", "_row": 2},
        {"prompt": "two\nlines", "response": "x", "_row": 4},
    ]
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(SFT_ROWS[2:4]), shards / "train-00001.parquet")
    pq.write_table(pa.Table.from_pylist(SFT_ROWS[:2]), shards / "train-00000.parquet")
    (shards / ".DS_Store").write_text("hidden files are skipped")
    source = load_data(str(shards), "train")
    assert [r["prompt"] for r in source.rows] == [r["prompt"] for r in SFT_ROWS[:4]]  # in file-name order
    assert source.rows[2]["_origin"] == str(shards / "train-00001.parquet") and source.rows[2]["_row"] == 1


@pytest.mark.parametrize(
    "case",
    ["cells", "header", "mixed", "unknown", "empty", "bad-row-in-dir"],
)
def test_bad_csv_or_directory_is_one_clear_message(tmp_path, tiny_model_dir, case):
    target = tmp_path / "data"
    if case == "cells":
        target = tmp_path / "train.csv"
        target.write_text("prompt,response\n1+1=,2\n2+2=,4,8\n")
        expected = [str(target), "row 3", "3 cells", "2 columns"]
    elif case == "header":
        target = tmp_path / "train.csv"
        target.write_text("prompt,prompt\n1+1=,2\n")
        expected = [str(target), "line 1", "repeated column names"]
    else:
        target.mkdir()
        if case == "mixed":
            write_jsonl(target / "a.jsonl", SFT_ROWS[:2])
            (target / "b.csv").write_text("prompt,response\nx,y\n")
            expected = ["data.train", str(target), "mixes file types", ".csv (1)", ".jsonl (1)"]
        elif case == "unknown":
            write_jsonl(target / "a.jsonl", SFT_ROWS[:2])
            (target / "notes.txt").write_text("x")
            expected = ["data.train", str(target), "notes.txt", "not a data file"]
        elif case == "empty":
            expected = ["data.train", str(target), "is empty"]
        else:
            write_jsonl(target / "a.jsonl", SFT_ROWS[:2])
            write_jsonl(target / "b.jsonl", [SFT_ROWS[0], {"prompt": "no response"}])
            expected = [str(target / "b.jsonl"), "row 2", "missing field 'response'"]
    proc = _sft(tmp_path, tiny_model_dir, "--set", f"data.train={target}", "--set", "train.max_steps=1")
    _user_error(proc, *expected)


# ----------------------------------------------------------------------------- model.revision / dtype / chat_template


def test_chat_template_by_name_and_dtype_apply_to_the_run(tmp_path, tiny_model_dir):
    """model.chat_template=chatml renders the training rows (the tiny model's own template is replaced) and goes
    into final/'s tokenizer; model.dtype=bfloat16 trains and saves bfloat16 weights."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from oxrl_core.chat_templates import TEMPLATES

    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run = tmp_path / "run"
    _ok(
        _sft(
            tmp_path,
            tiny_model_dir,
            "--set",
            f"data.train={data}",
            "--set",
            "train.max_steps=2",
            "--set",
            "model.chat_template=chatml",
            "--set",
            "model.dtype=bfloat16",
            "-o",
            str(run),
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert tokenizer.chat_template == TEMPLATES["chatml"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered.startswith("<|im_start|>user\nhi<|im_end|>")
    with safe_open(str(run / "final" / "model.safetensors"), framework="pt") as f:
        dtypes = {str(f.get_tensor(k).dtype) for k in f.keys()}
    assert dtypes == {"torch.bfloat16"}
    assert _config(run)["model"]["dtype"] == "bfloat16"


def test_dtype_auto_keeps_the_checkpoint_dtype_and_nothing_leaks_outside_a_run(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from oxrl_core.config import ModelConfig
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer, model_options

    saved = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(saved)
    with model_options(ModelConfig(name=str(saved), dtype="auto", chat_template="llama3")):
        assert next(load_causal_lm(str(saved)).parameters()).dtype == torch.bfloat16
        assert (
            load_tokenizer(str(tiny_model_dir))
            .apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
            .endswith(
                "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            )
        )
    with model_options(ModelConfig(name=str(saved))):  # the default: float32 master weights
        assert next(load_causal_lm(str(saved)).parameters()).dtype == torch.float32
    assert next(load_causal_lm(str(saved)).parameters()).dtype == torch.float32  # outside a run: float32
    assert "start_header_id" not in (load_tokenizer(str(tiny_model_dir)).chat_template or "")


def test_chat_template_from_a_jinja_file(tmp_path, tiny_model_dir):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run = tmp_path / "run"
    _ok(
        _sft(
            tmp_path,
            tiny_model_dir,
            "--set",
            f"data.train={data}",
            "--set",
            "train.max_steps=1",
            "--set",
            f"model.chat_template={template}",
            "-o",
            str(run),
        )
    )
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run / "final").chat_template == template.read_text()


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("model.chat_template=chatmll", ["model.chat_template", "did you mean 'chatml'", "chatml, gemma, llama3"]),
        ("model.chat_template=./missing.jinja", ["model.chat_template", "nor a Jinja file"]),
        ("model.dtype=bf16", ["model.dtype", "'auto', 'float32', 'bfloat16' or 'float16'"]),
    ],
)
def test_bad_model_option_names_the_field(tmp_path, tiny_model_dir, setting, expected):
    run = tmp_path / "run"
    _user_error(_sft(tmp_path, tiny_model_dir, "--set", setting, "-o", str(run)), *expected)
    assert not run.exists()


def test_revision_goes_to_the_hub_loads_of_model_name_only(tmp_path, tiny_model_dir, monkeypatch):
    """model.revision is passed when model.name itself loads (policy, reference, tokenizer), never for another
    model (here model.ref); transformers' own loaders run (the spy records and calls through)."""
    import transformers

    from oxrl_core import Trainer

    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained

        def spy(path, *args, _original=original, _cls=cls.__name__, **kwargs):
            seen.append((_cls, str(path), kwargs.get("revision")))
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    pairs = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(8)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    ref = tmp_path / "ref"
    import shutil

    shutil.copytree(tiny_model_dir, ref)
    Trainer(
        alg="dpo",
        model={"name": str(tiny_model_dir), "revision": "v1.0", "ref": str(ref)},
        data=str(data),
        train={"max_steps": 1, "batch_size": 4},
        output_dir=tmp_path / "run",
        quiet=True,
    ).train()
    assert ("AutoTokenizer", str(tiny_model_dir), "v1.0") in seen
    assert ("AutoModelForCausalLM", str(tiny_model_dir), "v1.0") in seen
    assert ("AutoModelForCausalLM", str(ref), None) in seen


# ----------------------------------------------------------------------------- the Python API: rows and models in memory


def test_api_takes_rows_a_dataset_and_a_loaded_model(tmp_path, tiny_model_dir):
    """Rows (a list of dicts) as data, a `datasets.Dataset` as eval_data, a loaded model and tokenizer: the run
    trains, writes them into its directory, and its config.yaml names those files, so the CLI can resume it."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oxrl_core import Trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    run = tmp_path / "run"
    trainer = Trainer(
        alg="sft",
        model=model,
        tokenizer=tokenizer,
        data=SFT_ROWS,
        eval_data=datasets.Dataset.from_list(SFT_ROWS[:5]),
        train={"max_steps": 2, "batch_size": 8, "save_every": 1},
        output_dir=run,
        quiet=True,
    )
    assert trainer.config.data.train == "<in-memory: 36 rows>"
    assert trainer.config.model.name == "<in-memory: LlamaForCausalLM>"
    result = trainer.train()
    assert len(result.metrics) == 2 and "eval/loss" in result.metrics[-1]
    saved = _config(run)
    assert saved["data"]["train"] == str(run / "inputs" / "train.jsonl")
    assert saved["data"]["eval"] == str(run / "inputs" / "eval.jsonl")
    assert saved["model"]["name"] == str(run / "inputs" / "model")
    assert [json.loads(line) for line in (run / "inputs" / "train.jsonl").read_text().splitlines()] == SFT_ROWS
    _ok(oxrl("run", "--resume", "-o", str(run), "--set", "train.max_steps=3", "-q", cwd=tmp_path))
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]


def test_api_rows_with_a_source_column_are_rows_and_source_mappings_are_sources(tmp_path):
    from oxrl_core import Trainer

    rows = [{"prompt": "2+2?", "response": "4", "source": "forum"}] * 3
    assert Trainer(alg="sft", data=rows).config.data.train == "<in-memory: 3 rows>"
    path = write_jsonl(tmp_path / "a.jsonl", SFT_ROWS)
    mix = Trainer(alg="sft", data=[{"source": str(path), "ratio": 2}, {"source": str(path)}]).config.data.train
    assert [(s.source, s.ratio) for s in mix] == [(str(path), 2.0), (str(path), 1.0)]


def test_api_resume_with_other_rows_is_refused(tmp_path, tiny_model_dir):
    from oxrl_core import Trainer

    run = tmp_path / "run"
    common = dict(model=str(tiny_model_dir), output_dir=run, quiet=True)
    Trainer(alg="sft", data=SFT_ROWS, train={"max_steps": 2, "batch_size": 8, "save_every": 1}, **common).train()
    with pytest.raises(OxrlError, match=r"--resume: the 36 in-memory train rows differ from those .* trained on"):
        Trainer(alg="sft", data=SFT_ROWS[::-1], train={"max_steps": 3}, resume=True, **common).train()
    result = Trainer(alg="sft", data=SFT_ROWS, train={"max_steps": 3}, resume=True, **common).train()
    assert result.steps == 3 and [m["step"] for m in result.metrics] == [2, 3]  # continued from step-1


@pytest.mark.parametrize("case", ["no-tokenizer", "tokenizer-alone", "not-json", "mixed-list", "dataset-dict"])
def test_api_bad_in_memory_input_is_one_message(tmp_path, tiny_model_dir, case):
    import datasets

    from oxrl_core import Trainer

    kwargs: dict = {"alg": "sft", "output_dir": tmp_path / "run", "model": str(tiny_model_dir), "data": SFT_ROWS}
    if case == "no-tokenizer":
        from transformers import AutoModelForCausalLM

        kwargs["model"] = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        match = r"model=<LlamaForCausalLM>: a loaded model needs its tokenizer too"
    elif case == "tokenizer-alone":
        from transformers import AutoTokenizer

        kwargs["tokenizer"] = AutoTokenizer.from_pretrained(tiny_model_dir)
        match = r"tokenizer= goes with a loaded model"
    elif case == "not-json":
        kwargs["data"] = SFT_ROWS[:3] + [{"prompt": "x", "response": b"bytes"}]
        match = r"data.train: row 4: a value cannot be stored as JSON"
    elif case == "mixed-list":
        kwargs["data"] = [str(tmp_path / "a.jsonl"), {"prompt": "x", "response": "y"}]
        match = r"data\[1\]: expected a data source .* not both"
    else:
        kwargs["data"] = datasets.DatasetDict({"train": datasets.Dataset.from_list(SFT_ROWS)})
        match = r"data: a DatasetDict holds several splits \(train\); pass one each: data=ds\['train'\]"
    with pytest.raises(OxrlError, match=match):
        Trainer(**kwargs)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- grpo


def test_grpo_runs_sgrpo_with_a_note_and_is_listed_as_an_alias(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)])
    reward = tmp_path / "length.py"
    reward.write_text(
        "from oxrl_core.interfaces import Reward\n\n\nclass Length(Reward):\n    name = 'length'\n\n"
        "    def score(self, prompts, completions, examples):\n        return [float(len(c)) for c in completions]\n"
    )
    run = tmp_path / "run"
    proc = _ok(
        oxrl(
            "run",
            "--alg",
            "grpo",
            "--set",
            f"model.name={tiny_model_dir}",
            "--set",
            f"data.train={data}",
            "--set",
            f"reward.name={reward}:Length",
            "--set",
            "train.batch_size=4",
            "--set",
            "train.max_steps=1",
            "--set",
            "rollout.n=2",
            "--set",
            "rollout.max_new_tokens=4",
            "-o",
            str(run),
            cwd=tmp_path,
        )
    )
    text = proc.stdout + proc.stderr
    assert "'grpo' runs oxRL's sgrpo" in text and "clip-higher" in text and "alg.kl_coeff" in text, text
    assert _config(run)["algorithm"] == "sgrpo" and len(read_metrics(run)) == 1
    listing = json.loads(_ok(oxrl("plugins", "--json")).stdout)
    assert {"kind": "algorithm", "name": "grpo", "alias_of": "sgrpo"}.items() <= listing["aliases"][0].items()
    assert "grpo" not in {r["name"] for r in listing["plugins"]}
    assert "alias: algorithm grpo → sgrpo" in _ok(oxrl("plugins")).stdout


def test_grpo_in_a_yaml_config_and_a_plugin_that_registers_grpo_wins(tmp_path):
    from oxrl_core import Trainer, plugins
    from oxrl_core.interfaces import Algorithm

    config = tmp_path / "c.yaml"
    config.write_text("algorithm: grpo\n")
    assert Trainer(config=config, quiet=True).config.algorithm == "sgrpo"

    class Grpo(Algorithm):  # a plugin of that name: no alias then
        name = "grpo"
        loop = "rl"
        data_format = "prompt"

        def loss(self, batch):  # pragma: no cover - never trained here
            raise NotImplementedError

        def advantages(self, batch):  # pragma: no cover
            raise NotImplementedError

    registry = plugins.discover()
    registry.prefer(plugins.Registration("algorithm", "grpo", Grpo, plugin="grpo", package="mine", version="1"))
    assert registry.resolve_alias("algorithm", "grpo") == ("grpo", "")
    assert registry.alias_rows() == []


# ----------------------------------------------------------------------------- start-up cost


def test_saving_a_model_imports_neither_deepspeed_nor_mlflow_and_deepspeed_leaves_mlflow_importable(tiny_model_dir):
    """Issue 26: `save_pretrained` asked accelerate whether the model is a DeepSpeedEngine, which imported
    DeepSpeed (and through its autotuner mlflow: ~1.8 s in every `oxrl run`). Without DeepSpeed loaded nothing can
    be one, so the save imports neither; the DeepSpeed engine's import skips mlflow, which still imports after."""
    code = f"""
import sys, tempfile
from pathlib import Path
from oxrl_core.models.loading import load_causal_lm, load_tokenizer
from oxrl_core.run_io.checkpoint import save_model
model, tok = load_causal_lm({str(tiny_model_dir)!r}), load_tokenizer({str(tiny_model_dir)!r})
save_model(Path(tempfile.mkdtemp()) / "final", model, tok)
print("after save", "deepspeed" in sys.modules, "mlflow" in sys.modules)
from accelerate.utils.other import extract_model_from_parallel
from oxrl_core.engines.deepspeed_engine import import_deepspeed
deepspeed = import_deepspeed("cpu")
print("after deepspeed", "mlflow" in sys.modules, extract_model_from_parallel(model) is model)
import mlflow
print("mlflow", mlflow.__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-3:] == ["after save False False", "after deepspeed False True", "mlflow mlflow"]
