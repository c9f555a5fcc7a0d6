"""The dataset plugins of oxrl-datasets (plugins/oxrl-datasets): gsm8k, math, openr1_math,
ultrafeedback_binarized, hh_rlhf, alpaca and hf.

Each is built the way the core builds it (``registry.load("dataset", name)``, then
``Config.model_validate(options)``, then ``cls(config)``), and its rows must pass
`oxrl_core.data.rows.normalise_row` for every format it declares. The fixtures under
``tests/fixtures/datasets/<name>/`` are a few rows shaped exactly like the real datasets' rows
(field names, nesting, string formats). Every plugin is read from a JSONL file, a Parquet file, a
``save_to_disk`` directory and the hub; there is no hub here, so the hub is
``datasets.load_dataset`` monkeypatched to serve the fixtures, and the test checks the call.
Hub snapshot directories (data files named by split, a README listing configs) are built in
``tmp_path`` the way the real repositories lay them out.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from oxrl_core.data.rows import normalise_row
from oxrl_core.errors import OxrlError
from oxrl_core.plugins import discover

FIXTURES = Path(__file__).parent / "fixtures" / "datasets"
SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


def fixture_path(name: str, split: str) -> Path:
    return FIXTURES / name / f"{split}.jsonl"


def fixture_rows(name: str, split: str) -> list[dict]:
    return [
        json.loads(line) for line in fixture_path(name, split).read_text(encoding="utf-8").splitlines() if line.strip()
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def registry():
    return discover()


def build(registry, name: str, **options):
    """The dataset plugin `name` with `options`, as the core builds it."""
    cls = registry.load("dataset", name)
    return cls(cls.Config.model_validate(options))


def assert_valid(dataset, rows: list[dict]) -> None:
    """Every row passes the core's check for every format the plugin declares."""
    assert rows
    for i, row in enumerate(rows, start=1):
        for fmt in dataset.formats:
            normalise_row({**row, "_row": i}, fmt, f"dataset '{dataset.name}'")


# ---------------------------------------------------------------------------------------------
# The expected oxRL rows of each fixture's train split (derived values written out literally)
# ---------------------------------------------------------------------------------------------


def expected_gsm8k() -> list[dict]:
    src = fixture_rows("gsm8k", "train")
    return [
        {"prompt": r["question"], "response": r["answer"], "answer": a}
        for r, a in zip(src, ["72", "10", "5"], strict=True)
    ]


def expected_math() -> list[dict]:
    src = fixture_rows("math", "train")
    answers = ["\\dfrac{1}{9}", "7\\sqrt{5}", "10", "10", "20\\sqrt3", "2", "1"]
    return [
        {"prompt": r["problem"], "response": r["solution"], "answer": a, "level": r["level"], "type": r["type"]}
        for r, a in zip(src, answers, strict=True)
    ]


def expected_openr1_math() -> list[dict]:
    keep = ("problem_type", "question_type", "source", "uuid", "correctness_count")
    return [
        {"prompt": r["problem"], "response": r["solution"], "answer": r["answer"], **{k: r[k] for k in keep}}
        for r in fixture_rows("openr1_math", "train")
    ]


def expected_ultrafeedback_binarized() -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": r["chosen"][1]["content"],
            "rejected": r["rejected"][1]["content"],
            "response": r["chosen"][1]["content"],
            "prompt_id": r["prompt_id"],
            "score_chosen": r["score_chosen"],
            "score_rejected": r["score_rejected"],
        }
        for r in fixture_rows("ultrafeedback_binarized", "train_prefs")
    ]


def expected_hh_rlhf() -> list[dict]:
    flowers = (
        "Trim about an inch off the stems at an angle before you put them in water, remove any leaves that would sit "
        "below the waterline, and change the water every couple of days. It also helps to keep the vase out of direct "
        "sunlight and away from ripening fruit, which gives off a gas that makes flowers wilt faster."
    )
    bread = (
        "Here’s a simple one: mash 3 ripe bananas, then stir in 1/3 cup of melted butter, 3/4 cup of sugar, 1 beaten egg "
        "and 1 teaspoon of vanilla. Mix in 1 teaspoon of baking soda, a pinch of salt and 1 1/2 cups of flour, pour it "
        "into a buttered loaf pan and bake at 350°F for about an hour."
    )
    return [
        {
            "prompt": [{"role": "user", "content": "What are some good ways to keep cut flowers fresh longer?"}],
            "chosen": flowers,
            "rejected": "You could put them in the fridge.",
            "response": flowers,
        },
        {
            "prompt": [
                {"role": "user", "content": "Can you help me find a recipe for banana bread?"},
                {
                    "role": "assistant",
                    "content": "Sure, do you want a classic recipe, or something like a vegan or gluten-free version?",
                },
                {"role": "user", "content": "Classic is fine."},
            ],
            "chosen": bread,
            "rejected": "I’m not sure what you mean by classic.",
            "response": bread,
        },
    ]


def expected_alpaca() -> list[dict]:
    src = fixture_rows("alpaca", "train")
    prompts = [
        "Give three tips for staying healthy.",
        "Identify the odd one out.\n\nTwitter, Instagram, Telegram",
        "What are the three primary colors?",
    ]
    return [{"prompt": p, "response": r["output"]} for p, r in zip(prompts, src, strict=True)]


@dataclass(frozen=True)
class Case:
    name: str
    train_file: str  # the fixture file of the train split
    eval_file: str | None  # the fixture file of the eval split; None: the dataset has no eval split
    hub_id: str
    subsets: tuple  # the `name` argument of each load_dataset call, in order
    hub_splits: tuple[str, str | None]  # the source splits read as train / eval
    missing: str  # a source field whose absence is an error
    expected: object  # () -> the oxRL rows of the train fixture


CASES = [
    Case("gsm8k", "train", "test", "openai/gsm8k", ("main",), ("train", "test"), "question", expected_gsm8k),
    Case("math", "train", "test", "EleutherAI/hendrycks_math", SUBJECTS, ("train", "test"), "solution", expected_math),
    Case(
        "openr1_math",
        "train",
        None,
        "open-r1/OpenR1-Math-220k",
        ("default",),
        ("train", None),
        "answer",
        expected_openr1_math,
    ),
    Case(
        "ultrafeedback_binarized",
        "train_prefs",
        "test_prefs",
        "HuggingFaceH4/ultrafeedback_binarized",
        (None,),
        ("train_prefs", "test_prefs"),
        "rejected",
        expected_ultrafeedback_binarized,
    ),
    Case("hh_rlhf", "train", "test", "Anthropic/hh-rlhf", (None,), ("train", "test"), "chosen", expected_hh_rlhf),
    Case("alpaca", "train", None, "tatsu-lab/alpaca", (None,), ("train", None), "output", expected_alpaca),
]
BY_NAME = {c.name: c for c in CASES}
each = pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])


# ---------------------------------------------------------------------------------------------
# 1. Every named dataset, from every kind of source
# ---------------------------------------------------------------------------------------------


@each
def test_rows_from_a_jsonl_file(registry, case):
    dataset = build(registry, case.name, path=str(fixture_path(case.name, case.train_file)))
    rows = dataset.rows("train")
    assert rows == case.expected()
    assert_valid(dataset, rows)
    assert dataset.rows("eval") == []  # a single file is the train split only


@each
def test_rows_from_a_parquet_file_with_eval_path(registry, case, tmp_path):
    train = write_parquet(tmp_path / "train.parquet", fixture_rows(case.name, case.train_file))
    eval_file = case.eval_file or case.train_file
    dataset = build(registry, case.name, path=str(train), eval_path=str(fixture_path(case.name, eval_file)))
    assert dataset.rows("train") == case.expected()
    eval_rows = dataset.rows("eval")
    assert len(eval_rows) == len(fixture_rows(case.name, eval_file))
    assert_valid(dataset, eval_rows)


@each
def test_rows_from_a_save_to_disk_directory(registry, case, tmp_path):
    train_split, eval_split = case.hub_splits
    splits = {train_split: datasets.Dataset.from_list(fixture_rows(case.name, case.train_file))}
    if eval_split:
        splits[eval_split] = datasets.Dataset.from_list(fixture_rows(case.name, case.eval_file))
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))

    dataset = build(registry, case.name, path=str(tmp_path / "saved"))
    assert dataset.rows("train") == case.expected()
    eval_rows = dataset.rows("eval")
    if eval_split:
        assert len(eval_rows) == len(fixture_rows(case.name, case.eval_file))
        assert_valid(dataset, eval_rows)
    else:
        assert eval_rows == []


@each
def test_rows_from_the_hub(registry, case, monkeypatch):
    """``path`` empty: ``datasets.load_dataset(hub_id, subset, split=...)`` for each subset (MATH: seven)."""
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        served = name in (
            case.subsets[0],
            None,
        )  # MATH: the fixture is served as `algebra`, the other subjects are empty
        split_file = case.train_file if kwargs["split"] == case.hub_splits[0] else case.eval_file
        return datasets.Dataset.from_list(fixture_rows(case.name, split_file) if served else [])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dataset = build(registry, case.name)
    assert dataset.rows("train") == case.expected()
    assert calls == [(case.hub_id, subset, {"split": case.hub_splits[0]}) for subset in case.subsets]

    calls.clear()
    eval_rows = dataset.rows("eval")
    if case.eval_file:
        assert calls == [(case.hub_id, subset, {"split": case.hub_splits[1]}) for subset in case.subsets]
        assert len(eval_rows) == len(fixture_rows(case.name, case.eval_file))
        assert_valid(dataset, eval_rows)
    else:
        assert calls == [] and eval_rows == []  # no eval split: the hub is not even asked


@each
def test_a_missing_field_names_the_dataset_the_row_and_the_field(registry, case, tmp_path):
    rows = fixture_rows(case.name, case.train_file)
    del rows[1][case.missing]
    path = write_jsonl(tmp_path / "broken.jsonl", rows)
    with pytest.raises(OxrlError) as exc:
        build(registry, case.name, path=str(path)).rows("train")
    assert str(exc.value).startswith(f"dataset '{case.name}' ({path}): row 2: missing field '{case.missing}'"), (
        exc.value
    )


def test_a_missing_field_from_the_hub_names_the_hub_id_and_split(registry, monkeypatch):
    rows = fixture_rows("gsm8k", "train")
    del rows[2]["answer"]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(rows))
    with pytest.raises(
        OxrlError, match=r"^dataset 'gsm8k' \(openai/gsm8k main, split 'train'\): row 3: missing field 'answer'$"
    ):
        build(registry, "gsm8k").rows("train")


def test_a_field_of_the_wrong_type_is_named(registry, tmp_path):
    rows = fixture_rows("alpaca", "train")
    rows[0]["output"] = ["a", "list"]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    with pytest.raises(OxrlError, match=r"dataset 'alpaca' .*: row 1: field 'output' must be a string, got list"):
        build(registry, "alpaca", path=str(path)).rows("train")


# ---------------------------------------------------------------------------------------------
# 2. Hub snapshot directories, laid out like the real repositories
# ---------------------------------------------------------------------------------------------


def readme_with_configs(configs: dict[str, dict[str, str]]) -> str:
    """A dataset card whose YAML lists configs -> {split: data-file glob}, as hub repositories do."""
    lines = ["---", "configs:"]
    for config, files in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {glob}" for split, glob in files.items()]
    return "\n".join(lines + ["---", "", "# A dataset", ""])


def test_gsm8k_snapshot_directory_picks_its_subset(registry, tmp_path):
    """openai/gsm8k: main/{train,test}-00000-of-00001.parquet and socratic/…, configs in the README."""
    snap = tmp_path / "gsm8k"
    socratic = [{**r, "question": "Socratic: " + r["question"]} for r in fixture_rows("gsm8k", "train")]
    for split, file in (("train", "train"), ("test", "test")):
        write_parquet(snap / "main" / f"{split}-00000-of-00001.parquet", fixture_rows("gsm8k", file))
        write_parquet(
            snap / "socratic" / f"{split}-00000-of-00001.parquet",
            socratic if split == "train" else fixture_rows("gsm8k", "test"),
        )
    (snap / "README.md").write_text(
        readme_with_configs({c: {"train": f"{c}/train-*", "test": f"{c}/test-*"} for c in ("main", "socratic")})
    )
    dataset = build(registry, "gsm8k", path=str(snap))
    assert dataset.rows("train") == expected_gsm8k()
    assert [r["answer"] for r in dataset.rows("eval")] == ["18", "3"]
    assert (
        build(registry, "gsm8k", path=str(snap), subset="socratic").rows("train")[0]["prompt"].startswith("Socratic: ")
    )


def test_math_snapshot_directory_reads_all_seven_subjects(registry, tmp_path):
    """EleutherAI/hendrycks_math: <subject>/train-00000-of-00001.parquet, one config per subject."""
    snap = tmp_path / "hendrycks_math"
    subject_of = {
        "Algebra": "algebra",
        "Counting & Probability": "counting_and_probability",
        "Geometry": "geometry",
        "Intermediate Algebra": "intermediate_algebra",
        "Number Theory": "number_theory",
        "Prealgebra": "prealgebra",
        "Precalculus": "precalculus",
    }
    for row in fixture_rows("math", "train"):  # one row per subject
        write_parquet(snap / subject_of[row["type"]] / "train-00000-of-00001.parquet", [row])
    (snap / "README.md").write_text(readme_with_configs({s: {"train": f"{s}/train-*"} for s in SUBJECTS}))

    rows = build(registry, "math", path=str(snap)).rows("train")
    assert [r["type"] for r in rows] == list(subject_of)  # every subject, in subject order
    by_prompt = {r["prompt"]: r for r in expected_math()}
    assert sorted(r["prompt"] for r in rows) == sorted(by_prompt)
    assert all(r == by_prompt[r["prompt"]] for r in rows)
    only = build(registry, "math", path=str(snap), subset="prealgebra").rows("train")
    assert [r["answer"] for r in only] == ["7\\sqrt{5}"]


def test_ultrafeedback_snapshot_directory_with_named_splits(registry, tmp_path):
    """HuggingFaceH4/ultrafeedback_binarized: data/<split>-00000-of-00001.parquet for six splits."""
    snap = tmp_path / "ultrafeedback_binarized"
    splits = ("train_prefs", "test_prefs", "train_sft", "test_sft", "train_gen", "test_gen")
    for split in splits:
        file = "test_prefs" if split.startswith("test") else "train_prefs"
        write_parquet(snap / "data" / f"{split}-00000-of-00001.parquet", fixture_rows("ultrafeedback_binarized", file))
    (snap / "README.md").write_text(readme_with_configs({"default": {s: f"data/{s}-*" for s in splits}}))

    dataset = build(registry, "ultrafeedback_binarized", path=str(snap))
    assert dataset.rows("train") == expected_ultrafeedback_binarized()
    assert [r["chosen"] for r in dataset.rows("eval")] == [
        "Cold drops on red leaves\nthe gutter hums a low song\nthe maple lets go"
    ]
    sft = build(registry, "ultrafeedback_binarized", path=str(snap), train_split="train_sft", eval_split="test_sft")
    assert len(sft.rows("train")) == 2 and len(sft.rows("eval")) == 1


def test_alpaca_snapshot_directory_without_a_readme(registry, tmp_path):
    """tatsu-lab/alpaca: data/train-00000-of-00001-<hash>.parquet; the split comes from the file name."""
    snap = tmp_path / "alpaca"
    write_parquet(snap / "data" / "train-00000-of-00001-a09b74b3ef9c3b56.parquet", fixture_rows("alpaca", "train"))
    dataset = build(registry, "alpaca", path=str(snap))
    assert dataset.rows("train") == expected_alpaca()
    assert dataset.rows("eval") == []


def test_hh_rlhf_snapshot_directory_with_data_dir_and_gzipped_jsonl(registry, tmp_path):
    """Anthropic/hh-rlhf: <part>/{train,test}.jsonl.gz; `data_dir` picks the part."""
    snap = tmp_path / "hh-rlhf"
    for part in ("harmless-base", "helpful-base"):
        for split in ("train", "test"):
            rows = fixture_rows("hh_rlhf", split)
            if part == "harmless-base":
                rows = rows[:1]
            (snap / part).mkdir(parents=True, exist_ok=True)
            with gzip.open(snap / part / f"{split}.jsonl.gz", "wt", encoding="utf-8") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in rows)

    helpful = build(registry, "hh_rlhf", path=str(snap), data_dir="helpful-base")
    assert helpful.rows("train") == expected_hh_rlhf()
    assert len(helpful.rows("eval")) == 1
    assert build(registry, "hh_rlhf", path=str(snap), data_dir="harmless-base").rows("train") == expected_hh_rlhf()[:1]

    # One compressed file as `path` is the train split.
    single = build(registry, "hh_rlhf", path=str(snap / "helpful-base" / "train.jsonl.gz"))
    assert single.rows("train") == expected_hh_rlhf()


def test_hub_call_passes_data_dir(registry, monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.Dataset.from_list(fixture_rows("hh_rlhf", "train"))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert build(registry, "hh_rlhf", data_dir="harmless-base").rows("train") == expected_hh_rlhf()
    assert calls == [("Anthropic/hh-rlhf", None, {"split": "train", "data_dir": "harmless-base"})]


# ---------------------------------------------------------------------------------------------
# 3. Splits: what exists, what does not
# ---------------------------------------------------------------------------------------------


def test_a_saved_dataset_without_the_eval_split_lists_the_splits_it_has(registry, tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(fixture_rows("gsm8k", "train"))}).save_to_disk(
        str(tmp_path / "saved")
    )
    dataset = build(registry, "gsm8k", path=str(tmp_path / "saved"))
    assert len(dataset.rows("train")) == 3
    with pytest.raises(OxrlError) as exc:
        dataset.rows("eval")
    message = str(exc.value)
    assert f"dataset 'gsm8k' ({tmp_path / 'saved'}): there is no split 'test'; it has 'train'" in message
    assert "eval_split" in message
    assert build(registry, "gsm8k", path=str(tmp_path / "saved"), eval_split="").rows("eval") == []


def test_a_snapshot_directory_without_the_train_split_lists_the_splits(registry, tmp_path):
    write_parquet(tmp_path / "snap" / "data" / "train-00000-of-00001.parquet", fixture_rows("gsm8k", "train"))
    write_parquet(tmp_path / "snap" / "data" / "test-00000-of-00001.parquet", fixture_rows("gsm8k", "test"))
    with pytest.raises(OxrlError, match=r"there is no split 'validation'; it has 'test', 'train'\. Set train_split"):
        build(registry, "gsm8k", path=str(tmp_path / "snap"), subset="", train_split="validation").rows("train")


def test_a_single_saved_dataset_is_the_train_split(registry, tmp_path):
    datasets.Dataset.from_list(fixture_rows("alpaca", "train")).save_to_disk(str(tmp_path / "one"))
    dataset = build(registry, "alpaca", path=str(tmp_path / "one"), eval_split="test")
    assert dataset.rows("train") == expected_alpaca()
    assert dataset.rows("eval") == []


def test_a_hub_failure_is_one_clear_error(registry, monkeypatch):
    def unknown_split(path, name=None, split=None, **kwargs):
        raise ValueError(f"Unknown split \"{split}\". Should be one of ['train', 'test'].")

    monkeypatch.setattr(datasets, "load_dataset", unknown_split)
    with pytest.raises(OxrlError) as exc:
        build(registry, "gsm8k", train_split="validation").rows("train")
    message = str(exc.value)
    assert "dataset 'gsm8k'" in message and "'validation'" in message and "openai/gsm8k main" in message
    assert "Should be one of ['train', 'test']" in message


def test_unknown_split_and_missing_path(registry, tmp_path):
    with pytest.raises(OxrlError, match=r"unknown split 'validation' \(expected 'train' or 'eval'\)"):
        build(registry, "gsm8k", path=str(fixture_path("gsm8k", "train"))).rows("validation")
    with pytest.raises(OxrlError, match=r"dataset 'gsm8k': path not found: .*nowhere"):
        build(registry, "gsm8k", path=str(tmp_path / "nowhere")).rows("train")
    with pytest.raises(OxrlError, match=r"dataset 'alpaca': eval_path not found"):
        build(registry, "alpaca", path=str(fixture_path("alpaca", "train")), eval_path=str(tmp_path / "no.jsonl")).rows(
            "eval"
        )


# ---------------------------------------------------------------------------------------------
# 4. Mapping details
# ---------------------------------------------------------------------------------------------


def test_gsm8k_final_answer_drops_commas_and_needs_hashes(registry, tmp_path):
    rows = [
        {
            "question": "A farm has 1,200 hens that each lay 1 egg a day. How many eggs in a day?",
            "answer": "1,200 * 1 = <<1200*1=1200>>1,200 eggs\n#### 1,200",
        },
        {"question": "What is 2+2?", "answer": "2+2=<<2+2=4>>4"},
    ]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    with pytest.raises(OxrlError, match=r"row 2: field 'answer' does not end with '#### <number>'"):
        build(registry, "gsm8k", path=str(path)).rows("train")
    write_jsonl(path, rows[:1])
    assert build(registry, "gsm8k", path=str(path)).rows("train")[0]["answer"] == "1200"


def test_math_solution_without_a_boxed_answer_is_an_error(registry, tmp_path):
    rows = fixture_rows("math", "train")
    rows[2]["solution"] = rows[2]["solution"].replace("\\boxed{10}", "10")
    with pytest.raises(OxrlError, match=r"dataset 'math' .*: row 3: field 'solution' has no \\boxed"):
        build(registry, "math", path=str(write_jsonl(tmp_path / "m.jsonl", rows))).rows("train")


def test_openr1_math_rows_leave_the_traces_behind(registry):
    rows = build(registry, "openr1_math", path=str(fixture_path("openr1_math", "train"))).rows("train")
    for row in rows:
        assert not {"generations", "messages", "is_reasoning_complete", "correctness_llama", "finish_reasons"} & set(
            row
        )


def test_hh_rlhf_transcript_that_does_not_parse(registry, tmp_path):
    rows = fixture_rows("hh_rlhf", "train")
    rows[1]["rejected"] = "\n\nAssistant: Hello! How can I help?\n\nHuman: Thanks."  # no final Assistant turn
    path = write_jsonl(tmp_path / "hh.jsonl", rows)
    with pytest.raises(OxrlError) as exc:
        build(registry, "hh_rlhf", path=str(path)).rows("train")
    assert str(exc.value).startswith(f"dataset 'hh_rlhf' ({path}): row 2: field 'rejected' does not parse"), exc.value


def test_preference_pairs_with_an_empty_reply_are_dropped_unless_asked(registry, tmp_path):
    hh = fixture_rows("hh_rlhf", "train")
    hh[0]["rejected"] = "\n\nHuman: What are some good ways to keep cut flowers fresh longer?\n\nAssistant:"
    hh_path = write_jsonl(tmp_path / "hh.jsonl", hh)
    assert build(registry, "hh_rlhf", path=str(hh_path)).rows("train") == expected_hh_rlhf()[1:]
    kept = build(registry, "hh_rlhf", path=str(hh_path), drop_empty=False).rows("train")
    assert kept[0]["rejected"] == ""
    with pytest.raises(OxrlError, match="field 'rejected' is empty"):
        normalise_row(kept[0], "preference", "dataset 'hh_rlhf'")

    uf = fixture_rows("ultrafeedback_binarized", "train_prefs")
    uf[1]["chosen"][1]["content"] = "  "
    uf_path = write_jsonl(tmp_path / "uf.jsonl", uf)
    assert (
        build(registry, "ultrafeedback_binarized", path=str(uf_path)).rows("train")
        == expected_ultrafeedback_binarized()[:1]
    )


def test_ultrafeedback_conversation_must_end_with_the_assistant(registry, tmp_path):
    rows = fixture_rows("ultrafeedback_binarized", "train_prefs")
    rows[0]["chosen"] = rows[0]["chosen"][:1]
    path = write_jsonl(tmp_path / "uf.jsonl", rows)
    with pytest.raises(
        OxrlError, match=r"row 1: field 'chosen': the last message must have role 'assistant', not 'user'"
    ):
        build(registry, "ultrafeedback_binarized", path=str(path)).rows("train")


# ---------------------------------------------------------------------------------------------
# 5. verify(): gsm8k by number, math and openr1_math by math-verify
# ---------------------------------------------------------------------------------------------


def test_gsm8k_verify(registry):
    dataset = build(registry, "gsm8k", path=str(fixture_path("gsm8k", "train")))
    row = dataset.rows("train")[0]  # answer 72
    assert dataset.verify("She sold 24 in May, so 48+24 = 72 in total.\n#### 72", row)
    assert dataset.verify("48 + 24 = 72 clips.", row)  # no ####: the last number
    assert dataset.verify("#### $72.00", row)
    assert not dataset.verify("48/2 = 24, and 48 + 24 = 72.\n#### 71", row)  # the number after #### decides
    assert not dataset.verify("72 is wrong, it is 70.", row)
    assert not dataset.verify("I do not know.", row)
    assert dataset.verify("#### 1,200", {"answer": "1200"})


def test_math_verify(registry):
    dataset = build(registry, "math", path=str(fixture_path("math", "train")))
    dice, root, percent, *_ = dataset.rows("train")
    assert dataset.verify("There are 4 ways out of 36, so the answer is $\\boxed{\\frac{1}{9}}$.", dice)
    assert dataset.verify("The probability is $\\boxed{1/9}$.", dice)
    assert not dataset.verify("The probability is $\\boxed{\\frac{1}{8}}$.", dice)
    assert dataset.verify("$\\sqrt{245} = \\boxed{\\sqrt{5 \\cdot 49}}$", root)
    assert dataset.verify("So the difference is $\\boxed{10}$.", percent)
    assert not dataset.verify("I first thought \\boxed{10} but it is \\boxed{12}.", percent)  # the last box counts
    assert not dataset.verify("no idea", percent)


def test_openr1_math_verify(registry):
    dataset = build(registry, "openr1_math", path=str(fixture_path("openr1_math", "train")))
    limit, choice = dataset.rows("train")
    generation = fixture_rows("openr1_math", "train")[0]["generations"][0]
    assert dataset.verify(generation, limit)
    assert not dataset.verify("The limit is \\boxed{6}.", limit)
    assert dataset.verify("\\boxed{B}", choice)
    assert not dataset.verify("\\boxed{C}", choice)


def test_datasets_without_an_answer_check_do_not_claim_one(registry):
    from oxrl_core.scoring.evaluation import can_verify

    for name in ("ultrafeedback_binarized", "hh_rlhf", "alpaca"):
        path = fixture_path(name, BY_NAME[name].train_file)
        assert not can_verify(build(registry, name, path=str(path))), name
    assert can_verify(build(registry, "hf", path=str(fixture_path("gsm8k", "train")))) is False
    for name in ("gsm8k", "math", "openr1_math"):
        assert can_verify(build(registry, name, path=str(fixture_path(name, "train")))), name


# ---------------------------------------------------------------------------------------------
# 6. hf: any dataset with a field mapping
# ---------------------------------------------------------------------------------------------


def test_hf_maps_fields_and_keeps_the_other_columns(registry):
    path = fixture_path("gsm8k", "train")
    dataset = build(registry, "hf", path=str(path), fields={"prompt": "question", "response": "answer"})
    rows = dataset.rows("train")
    source = fixture_rows("gsm8k", "train")
    assert rows == [
        {"question": r["question"], "answer": r["answer"], "prompt": r["question"], "response": r["answer"]}
        for r in source
    ]
    for i, row in enumerate(rows, start=1):
        normalise_row({**row, "_row": i}, "prompt_response", "dataset 'hf'")
    assert dataset.rows("eval") == []


def test_hf_from_the_hub_with_subset_and_eval_split(registry, monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.Dataset.from_list(fixture_rows("alpaca", "train"))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dataset = build(
        registry,
        "hf",
        hub_id="someone/instructions",
        subset="en",
        eval_split="validation",
        fields={"prompt": "instruction", "response": "output"},
    )
    assert [r["prompt"] for r in dataset.rows("train")] == [r["instruction"] for r in fixture_rows("alpaca", "train")]
    assert len(dataset.rows("eval")) == 3
    assert calls == [
        ("someone/instructions", "en", {"split": "train"}),
        ("someone/instructions", "en", {"split": "validation"}),
    ]


def test_hf_missing_mapped_column_and_missing_source(registry, tmp_path):
    path = fixture_path("alpaca", "train")
    with pytest.raises(
        OxrlError, match=r"dataset 'hf' \(.*alpaca/train.jsonl\): row 1: missing field 'question' \(mapped to 'prompt'"
    ):
        build(registry, "hf", path=str(path), fields={"prompt": "question"}).rows("train")
    with pytest.raises(ValidationError, match="set `path`"):
        build(registry, "hf", fields={"prompt": "question"})


# ---------------------------------------------------------------------------------------------
# 7. Configs and discovery
# ---------------------------------------------------------------------------------------------

NAMES = [c.name for c in CASES] + ["hf"]


def test_configs_forbid_unknown_options_and_describe_every_field(registry):
    defaults = {
        "gsm8k": ("openai/gsm8k", "main", "train", "test"),
        "math": ("EleutherAI/hendrycks_math", "all", "train", "test"),
        "openr1_math": ("open-r1/OpenR1-Math-220k", "default", "train", ""),
        "ultrafeedback_binarized": ("HuggingFaceH4/ultrafeedback_binarized", "", "train_prefs", "test_prefs"),
        "hh_rlhf": ("Anthropic/hh-rlhf", "", "train", "test"),
        "alpaca": ("tatsu-lab/alpaca", "", "train", ""),
    }
    for name in NAMES:
        cls = registry.load("dataset", name)
        fields = cls.Config.model_fields
        assert {"path", "eval_path", "hub_id", "subset", "train_split", "eval_split"} <= set(fields), name
        assert all(f.description for f in fields.values()), (name, [k for k, f in fields.items() if not f.description])
        with pytest.raises(ValidationError, match="pth"):
            cls.Config.model_validate({"pth": "x", "hub_id": "a/b"})
        if name in defaults:
            config = cls.Config()
            assert (config.hub_id, config.subset, config.train_split, config.eval_split) == defaults[name]


def test_every_dataset_is_discovered_from_oxrl_datasets(registry):
    for name in NAMES:
        reg = registry.get("dataset", name)
        assert reg.package == "oxrl-datasets", (name, reg.package)
        assert reg.plugin == name
    assert not [e for e in registry.errors if e.package == "oxrl-datasets"]


def test_discovery_imports_neither_datasets_nor_math_verify():
    code = textwrap.dedent(
        """
        import sys
        from oxrl_core.plugins import discover
        registry = discover()
        assert "gsm8k" in registry.names("dataset")
        heavy = [m for m in ("datasets", "math_verify", "oxrl_datasets.sources", "torch") if m in sys.modules]
        assert not heavy, heavy
        print("LIGHT")
        """
    )
    env = {**os.environ, "OXRL_PLUGINS": "", "OXRL_STRICT_PLUGINS": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "LIGHT", proc.stdout + proc.stderr


def test_a_plain_directory_of_split_files_is_read_once_whatever_the_subsets(registry, tmp_path):
    """The fixture directories hold `train.jsonl`/`test.jsonl` and no README configs: MATH's seven
    subjects (subset `all`) must not read the same files seven times; a subject directory is used when there is one."""
    whole = build(registry, "math", path=str(FIXTURES / "math"))
    assert len(whole.rows("train")) == len(fixture_rows("math", "train"))
    assert len(whole.rows("eval")) == len(fixture_rows("math", "test"))
    algebra = [r for r in fixture_rows("math", "train") if r["type"] == "Algebra"]
    (tmp_path / "snap" / "algebra").mkdir(parents=True)
    (tmp_path / "snap" / "algebra" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in algebra))
    assert [r["prompt"] for r in build(registry, "math", path=str(tmp_path / "snap")).rows("train")] == [
        r["problem"] for r in algebra
    ]
    with pytest.raises(OxrlError, match="no split 'test'"):
        build(registry, "math", path=str(tmp_path / "snap")).rows("eval")
