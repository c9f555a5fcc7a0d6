"""Issue 15, bad data and bad models: each is one message naming the field/file/row and the fix,
exit status 2, no traceback; nothing is trained on a silently broken input.

Items: 3 (names longer than the OS allows; rows given to the Python API), 4 (a byte that is not
UTF-8), 5 (a prompt or completion that encodes to no tokens, refused at load time), 6 (weights that
do not match the class), 7 (preference pairs with chosen == rejected), 21 (an empty or corrupt model
directory reported as what it is).
"""

from __future__ import annotations

import errno
import gzip
import shutil
from pathlib import Path

import pytest
from conftest import oxrl, write_jsonl
from typer.testing import CliRunner

from oxrl_core.errors import OxrlError

LONG = "x" * 300  # longer than any file system's 255-byte name limit


def cli(*args: str):
    """The CLI in-process (fast): exit code and output (stdout and stderr), an `OxrlError` as `main` reports it."""
    from oxrl_core.cli import app

    result = CliRunner().invoke(app, list(args), terminal_width=400)
    if isinstance(result.exception, OxrlError):  # what the console script's `main` prints, then exit 2
        return 2, f"{result.output}error: {result.exception}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # in-process, any other escaped exception is what a traceback would be
    return result.exit_code, result.output


def assert_user_error(code: int, output: str, *parts: str) -> None:
    assert code == 2, output
    assert "Traceback" not in output, output
    for part in parts:
        assert part in output, (part, output)


# ----------------------------------------------------------------------------- models built here


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A GPT-2-style base model: byte-level BPE, no chat template, no BOS added; tied LM head."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([f"What is {a}+{b}? {a + b}" for a in range(10) for b in range(10)], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    assert tokenizer("", add_special_tokens=True)["input_ids"] == [] and not tokenizer.chat_template
    path = tmp_path_factory.mktemp("models") / "gpt2"
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert config.tie_word_embeddings
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    """A reward model's final/: the tiny Llama as a sequence classifier (a `score` head, no `lm_head`)."""
    from transformers import AutoModelForSequenceClassification

    from oxrl_core.models.tiny import save_tiny_model

    base = save_tiny_model(tmp_path_factory.mktemp("models") / "base", hidden_size=64, num_layers=2, seed=0)
    path = tmp_path_factory.mktemp("models") / "rm-final"
    AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(path)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


# ----------------------------------------------------------------------------- 3: names the OS refuses


def test_names_longer_than_the_file_system_allows_name_the_field(tmp_path, sft_jsonl):
    """data.train / data.eval / model.name / model.ref too long for a file name: one line naming the field,
    exit 2, no traceback, and no run directory left behind (checked before it is created)."""
    run = tmp_path / "run"
    proc = oxrl("run", "--alg", "sft", "--set", f"data.train={LONG}.jsonl", "-o", str(run))
    assert_user_error(proc.returncode, proc.stdout + proc.stderr, "data.train", "File name too long")
    assert not run.exists()
    for key, value in (("data.eval", f"/tmp/{LONG}.jsonl"), ("model.name", f"/tmp/{LONG}"), ("model.ref", LONG)):
        code, out = cli(
            "run", "--alg", "sft", "--set", f"data.train={sft_jsonl}", "--set", f"{key}={value}", "-o", str(run)
        )
        assert_user_error(code, out, key, "File name too long")
        assert not run.exists()


def test_python_api_takes_rows_or_a_list_of_sources_not_both(sft_jsonl):
    """`Trainer(data=[rows])` is rows (it used to become a file name too long; issue 18 takes them, see
    test_conveniences.py); a list mixing rows and sources is refused; `Trainer(data=[paths])` is a mixture,
    as data.train takes it."""
    from oxrl_core import Trainer

    assert Trainer(alg="sft", data=[{"prompt": "2+2?", "response": "4"}] * 3).config.data.train == "<in-memory: 3 rows>"
    with pytest.raises(
        OxrlError, match=r"data\[1\]: expected a data source .*a row with keys \['prompt', 'response'\].*not both"
    ):
        Trainer(alg="sft", data=[sft_jsonl, {"prompt": "2+2?", "response": "4"}])
    trainer = Trainer(alg="sft", data=[sft_jsonl, {"source": str(sft_jsonl), "ratio": 2}])
    assert [getattr(s, "source", s) for s in trainer.config.data.train] == [str(sft_jsonl), str(sft_jsonl)]


def test_os_error_while_reading_data_names_field_and_path(tmp_path, monkeypatch):
    """Any OSError while reading a data source (here EIO, injected) is one line naming field and path."""
    from oxrl_core.data import sources as data

    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a", "response": "b"}])

    def broken(_path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(data, "_open_bytes", broken)
    with pytest.raises(OxrlError, match=rf"^data.eval: cannot read {path}: Input/output error$"):
        data.load_source(str(path), "eval", field="data.eval")


# ----------------------------------------------------------------------------- 4: bytes that are not UTF-8

BAD_LINE = b'{"prompt": "caf\xe9", "response": "1", "completion": "1"}\n'
GOOD_LINE = b'{"prompt": "1+0?", "response": "1", "completion": "1"}\n'


def test_non_utf8_byte_in_run_eval_and_score_names_file_line_and_offset(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD_LINE * 2 + BAD_LINE)
    offset = 2 * len(GOOD_LINE) + BAD_LINE.index(b"\xe9")
    where = f"{bad}: line 3: byte 0xe9 at byte offset {offset}"
    proc = oxrl("score", "--reward", "exact_match", "--data", str(bad))  # the real console script once
    assert_user_error(proc.returncode, proc.stdout + proc.stderr, where, "not valid UTF-8", "iconv")
    code, out = cli("eval", "--model", str(tiny_model_dir), "--data", str(bad))
    assert_user_error(code, out, where, "not valid UTF-8")
    code, out = cli(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={bad}",
        "-o",
        str(tmp_path / "run"),
    )
    assert_user_error(code, out, where, "not valid UTF-8")


def test_non_utf8_in_json_compressed_jsonl_and_dataset_plugin_files(tmp_path):
    """Every reader: a JSON list, a .jsonl.gz, and a dataset plugin's `path` report file, line and offset;
    a UTF-8 BOM is not an error."""
    from oxrl_core.data.sources import load_source
    from oxrl_core.plugins import registry

    as_json = tmp_path / "bad.json"
    as_json.write_bytes(b'[\n {"prompt": "ok"},\n {"prompt": "caf\xe9"}\n]')
    with pytest.raises(OxrlError, match=rf"{as_json}: line 3: byte 0xe9 at byte offset 37 \(column 17\)"):
        load_source(str(as_json), "train")
    gz = tmp_path / "bad.jsonl.gz"
    gz.write_bytes(gzip.compress(GOOD_LINE + BAD_LINE))
    with pytest.raises(OxrlError, match=rf"{gz}: line 2: byte 0xe9"):
        load_source(str(gz), "train")
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(GOOD_LINE + BAD_LINE)
    with pytest.raises(
        OxrlError, match=rf"{plain}: line 2: byte 0xe9 at byte offset {len(GOOD_LINE) + BAD_LINE.index(0xE9)}"
    ):
        load_source("hf", "train", registry(), {"path": str(plain)})
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE)
    assert load_source(str(bom), "train").rows[0]["prompt"] == "1+0?"


# ----------------------------------------------------------------------------- 5: rows that encode to nothing


def test_empty_prompt_without_bos_or_template_is_refused_at_load_time(tmp_path, gpt2_dir):
    """GPT-2-style tokenizer + empty prompt: DPO with packing (crashed in packed attention), RL (accepted, then
    failed when sampled) and SFT all refuse at load time, naming the file and the 1-based row."""
    rows = [{"prompt": "What is 1+1?", "response": "2", "chosen": "2", "rejected": "3"}] * 2
    rows.append({"prompt": "", "response": "2", "chosen": "2", "rejected": "3"})
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    message = f"{data}: row 3: field 'prompt' encodes to no tokens"
    common = ["--set", f"model.name={gpt2_dir}", "--set", f"data.train={data}", "--set", "train.max_steps=1"]
    proc = oxrl("run", "--alg", "dpo", *common, "--set", "data.packing=true", "-o", str(tmp_path / "dpo"))
    assert_user_error(proc.returncode, proc.stdout + proc.stderr, message, "no chat template", "adds no BOS")
    for alg in ("sgrpo", "sft"):
        code, out = cli("run", "--alg", alg, *common, "-o", str(tmp_path / alg))
        assert_user_error(code, out, message)


def test_empty_completions_are_refused_naming_row_and_field(tmp_path, gpt2_dir):
    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import Source
    from oxrl_core.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(gpt2_dir))
    for fmt, row, field in (
        ("prompt_response", {"prompt": "1+1?", "response": "  "}, "response"),
        ("preference", {"prompt": "1+1?", "chosen": "2", "rejected": ""}, "rejected"),
    ):
        source = Source(
            [{"prompt": "1+1?", "response": "2", "chosen": "2", "rejected": "3", "_row": 1}, {**row, "_row": 2}],
            "d.jsonl",
        )
        with pytest.raises(OxrlError, match=rf"d.jsonl: row 2: field '{field}' is empty"):
            prepare_examples(source, fmt, tokenizer, 64)


# ----------------------------------------------------------------------------- 6: weights that do not fit


def test_reward_model_used_as_policy_is_refused_in_run_and_eval(tmp_path, rm_dir, sft_jsonl):
    """An RM's final/ (a `score` head, no `lm_head`) as model.name / --model: refused with the missing and
    unexpected keys, instead of training or scoring a randomly-headed model."""
    proc = oxrl(
        "run",
        "--alg",
        "sft",
        "--set",
        f"model.name={rm_dir}",
        "--set",
        f"data.train={sft_jsonl}",
        "--set",
        "train.max_steps=1",
        "-o",
        str(tmp_path / "run"),
    )
    out = proc.stdout + proc.stderr
    assert_user_error(
        proc.returncode, out, "model.name:", str(rm_dir), "lm_head.weight", "score.weight", "reward model"
    )
    assert not (tmp_path / "run" / "final").exists()
    code, out = cli("eval", "--model", str(rm_dir), "--data", str(sft_jsonl), "--reward", "exact_match", "--limit", "1")
    assert_user_error(code, out, "--model:", "lm_head.weight", "reward model")


def test_intended_new_weights_get_a_note_and_tied_heads_load(gpt2_dir, rm_dir, tiny_model_dir, capsys):
    """A reward model started from a causal LM: its new `score` head is announced in one line. A tied LM
    head absent from the checkpoint (GPT-2) is no error. Loading the RM as an RM: no note."""
    from safetensors import safe_open

    from oxrl_core.models.loading import load_causal_lm, load_score_model

    with safe_open(str(gpt2_dir / "model.safetensors"), "pt") as handle:
        assert not any(k.startswith("lm_head") for k in list(handle.keys()))  # tied: saved once, as the embedding
    load_causal_lm(str(gpt2_dir))
    load_score_model(str(tiny_model_dir), pad_token_id=0)
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "a new `score` head (score.weight) starts from random values" in note[0], note
    load_score_model(str(rm_dir), pad_token_id=0)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- 7: chosen == rejected


def test_identical_pairs_are_dropped_with_a_note_and_refused_when_none_remain(tmp_path, tiny_model_dir):
    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_source
    from oxrl_core.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    rows = [
        {"prompt": "1+1?", "chosen": "2", "rejected": "2"},  # identical
        {"prompt": "1+1?", "chosen": "2 is right", "rejected": "3"},
        {"prompt": "1+1?", "chosen": "22222222222222222222a", "rejected": "22222222222222222222b"},
    ]  # same once cut
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    prompt_len = len(
        prepare_examples(load_source(str(data), "train"), "preference", tokenizer, 512).examples[0]["prompt_ids"]
    )
    out = prepare_examples(load_source(str(data), "train"), "preference", tokenizer, prompt_len + 10)
    assert [ex["_row"] for ex in out.examples] == [2]
    assert out.identical == [(str(data), 1), (str(data), 3)]
    note = (
        f"2 preference pairs dropped: chosen equals rejected (after truncation to data.max_length={prompt_len + 10}), "
        f"nothing to prefer: {data} rows 1, 3"
    )
    assert out.notes(prompt_len + 10) == [note]
    none_left = write_jsonl(tmp_path / "same.jsonl", [rows[0]] * 4)
    proc = oxrl(
        "run",
        "--alg",
        "dpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={none_left}",
        "-o",
        str(tmp_path / "run"),
    )
    assert_user_error(
        proc.returncode,
        proc.stdout + proc.stderr,
        f"{none_left}: no usable preference pair",
        "4 pairs have chosen equal to rejected",
        "rows 1, 2, 3, 4",
    )


def test_dpo_run_notes_identical_pairs_and_trains_on_the_rest(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"What is {a}+1?", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(6)]
    rows[1] = {"prompt": "What is 9+9?", "chosen": "18", "rejected": "18"}
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    code, output = cli(
        "run",
        "--alg",
        "dpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        f"data.train={data}",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.batch_size=2",
        "-o",
        str(tmp_path / "run"),
    )
    assert code == 0, output
    assert "1 preference pairs dropped: chosen equals rejected" in output and f"{data} row 2" in output
    assert (tmp_path / "run" / "final" / "config.json").is_file()


# ----------------------------------------------------------------------------- 21: what is wrong with a model dir


def test_empty_and_corrupt_model_directories_are_named_for_what_they_are(tmp_path, tiny_model_dir, sft_jsonl):
    empty = tmp_path / "empty"
    empty.mkdir()
    truncated = shutil.copytree(tiny_model_dir, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    shutil.copy(tiny_model_dir / "config.json", no_weights)
    run = tmp_path / "run"
    proc = oxrl(
        "run", "--alg", "sft", "--set", f"model.name={empty}", "--set", f"data.train={sft_jsonl}", "-o", str(run)
    )
    out = proc.stdout + proc.stderr
    assert_user_error(proc.returncode, out, f"model.name: no config.json in {empty}", "it is empty")
    assert "sentencepiece" not in out and not run.exists()
    code, out = cli(
        "run", "--alg", "sft", "--set", f"model.name={truncated}", "--set", f"data.train={sft_jsonl}", "-o", str(run)
    )
    assert_user_error(code, out, f"model.safetensors in {truncated} is corrupt or truncated", "re-download")
    code, out = cli(
        "run", "--alg", "sft", "--set", f"model.name={no_weights}", "--set", f"data.train={sft_jsonl}", "-o", str(run)
    )
    assert_user_error(code, out, f"model.name: no weights in {no_weights}")
    code, out = cli("eval", "--model", str(truncated), "--data", str(sft_jsonl), "--reward", "exact_match")
    assert_user_error(code, out, f"--model: model.safetensors in {truncated} is corrupt or truncated")
    assert not run.exists()
