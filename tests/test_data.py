"""The data layer (oxrl_core.data): sources, row validation, tokenisation, batching, collation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from oxrl_core import plugins
from oxrl_core.data.batching import BatchPlan, collate
from oxrl_core.data.encode import (
    IGNORE,
    encode_completion,
    encode_prompt,
    prepare_examples,
    tokenise_prompt_response,
    tokenise_text_packed,
)
from oxrl_core.data.rows import normalise_row
from oxrl_core.data.sources import load_source
from oxrl_core.errors import OxrlError

ROWS = [
    {"prompt": "What is 1+2?", "response": "3"},
    {"prompt": "Say hi", "response": "hi"},
    {"prompt": "Count", "response": "1 2 3"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from oxrl_core.models.loading import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def strip_row(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "_row"} for r in rows]


def check_rows(path: Path, fmt: str, split: str = "train") -> list[dict]:
    """Load a file and validate every row, as the loop does."""
    source = load_source(str(path), split)
    return [normalise_row(r, fmt, source.origin) for r in source.rows]


def assert_names(exc: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(exc.value)
    for part in parts:
        assert part in message, f"{part!r} not in error message: {message}"


# ----------------------------------------------------------------------------- loading


def test_load_jsonl_rows_numbered_by_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")  # blank line 2 is skipped
    source = load_source(str(path), "train")
    assert strip_row(source.rows) == ROWS[:2]
    assert [r["_row"] for r in source.rows] == [1, 3]  # the line number, for error messages
    assert source.origin == str(path)
    assert source.dataset is None


def test_load_json_list_and_wrapped_list(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(ROWS))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": ROWS}))
    for path in (plain, wrapped):
        rows = load_source(str(path), "train").rows
        assert strip_row(rows) == ROWS
        assert [r["_row"] for r in rows] == [1, 2, 3]


def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    rows = load_source(str(path), "train").rows
    assert strip_row(rows) == ROWS
    assert [r["_row"] for r in rows] == [1, 2, 3]
    assert all(r == normalise_row(r, "prompt_response", str(path)) for r in rows)


def test_load_saved_dataset_and_dataset_dict(tmp_path):
    from datasets import Dataset, DatasetDict

    single = tmp_path / "single"
    Dataset.from_list(ROWS).save_to_disk(str(single))
    assert strip_row(load_source(str(single), "train").rows) == ROWS

    splits = tmp_path / "splits"
    DatasetDict({"train": Dataset.from_list(ROWS[:2]), "test": Dataset.from_list(ROWS[2:])}).save_to_disk(str(splits))
    assert strip_row(load_source(str(splits), "train").rows) == ROWS[:2]
    assert strip_row(load_source(str(splits), "eval").rows) == ROWS[2:]  # eval falls back to `test`

    only_train = tmp_path / "only_train"
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(only_train))
    with pytest.raises(OxrlError) as exc:
        load_source(str(only_train), "eval")
    assert_names(exc, str(only_train), "'eval'", "train")


def test_directory_that_is_not_a_dataset(tmp_path):
    (tmp_path / "junk").mkdir()
    with pytest.raises(OxrlError) as exc:
        load_source(str(tmp_path / "junk"), "train")
    assert_names(exc, "junk", "save_to_disk")


def test_arith_dataset_plugin():
    registry = plugins.registry()
    assert "arith" in registry.names("dataset")
    train = load_source("arith", "train", registry)
    evaluation = load_source("arith", "eval", registry)
    assert train.dataset is not None and train.dataset.name == "arith"
    assert len(evaluation.rows) == 100 and len(train.rows) > 100
    for row in train.rows[:20]:
        normalise_row(row, "prompt_response", train.origin)
        normalise_row(row, "text", train.origin)
        normalise_row(row, "prompt", train.origin)
        assert train.dataset.verify(row["response"], row) is True
        assert train.dataset.verify("nope", row) is False
    # train and eval problems are disjoint, and the split is deterministic
    assert not {r["prompt"] for r in train.rows} & {r["prompt"] for r in evaluation.rows}
    assert strip_row(load_source("arith", "eval", registry).rows) == strip_row(evaluation.rows)


def test_unknown_source_suggests_plugin(tmp_path):
    with pytest.raises(OxrlError) as exc:
        load_source("arth", "train", plugins.registry())
    assert_names(exc, "arth", "Did you mean dataset 'arith'")
    with pytest.raises(OxrlError) as exc:
        load_source(str(tmp_path / "missing.jsonl"), "train", plugins.registry())
    assert_names(exc, "missing.jsonl", "not found")


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "d.tsv"  # (.csv is read since issue 18)
    path.write_text("prompt\tresponse\na\tb\n")
    with pytest.raises(OxrlError) as exc:
        load_source(str(path), "train")
    assert_names(exc, str(path), ".tsv")


# ----------------------------------------------------------------------------- normalise_row


@pytest.mark.parametrize(
    "fmt,row",
    [
        ("prompt", {"prompt": "p", "answer": "4"}),
        ("prompt", {"prompt": [{"role": "user", "content": "p"}]}),
        ("prompt_response", {"prompt": "p", "response": "r"}),
        ("text", {"text": "t"}),
        ("preference", {"prompt": "p", "chosen": "c", "rejected": "r"}),
        ("unpaired", {"prompt": "p", "completion": "c", "label": False}),
    ],
)
def test_normalise_valid_rows(fmt, row):
    out = normalise_row({**row, "_row": 1}, fmt, "f.jsonl")
    assert {k: v for k, v in out.items() if k != "_row"} == row  # extra fields (answer) kept


def test_normalise_messages_row():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    out = normalise_row({"messages": messages, "_row": 5}, "prompt_response", "f.jsonl")
    assert out["prompt"] == messages[:2]
    assert out["response"] == "4"


@pytest.mark.parametrize(
    "fmt,row,field,words",
    [
        ("prompt_response", {"prompt": "p"}, "'response'", "missing"),
        ("prompt_response", {"prompt": "p", "response": None}, "'response'", "missing"),
        ("prompt_response", {"prompt": "p", "response": 5}, "'response'", "string"),
        ("prompt_response", {"prompt": 7, "response": "r"}, "'prompt'", "string"),
        ("prompt_response", {"prompt": [{"role": "user"}], "response": "r"}, "'prompt[0]'", "content"),
        ("text", {"txt": "oops"}, "'text'", "missing"),
        ("preference", {"prompt": "p", "chosen": "c"}, "'rejected'", "missing"),
        ("preference", {"prompt": "p", "chosen": ["c"], "rejected": "r"}, "'chosen'", "string"),
        ("unpaired", {"prompt": "p", "completion": "c", "label": "yes"}, "'label'", "true or false"),
        ("prompt_response", {"messages": []}, "'messages'", "non-empty"),
        ("prompt_response", {"messages": "hi"}, "'messages'", "list"),
        (
            "prompt_response",
            {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]},
            "'messages'",
            "assistant",
        ),
        ("prompt_response", {"messages": [{"role": "assistant", "content": "a"}]}, "'messages'", "before"),
        (
            "prompt_response",
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]},
            "'messages[1]'",
            "content",
        ),
    ],
)
def test_normalise_bad_rows_name_origin_row_and_field(fmt, row, field, words):
    with pytest.raises(OxrlError) as exc:
        normalise_row({**row, "_row": 12}, fmt, "/data/train.jsonl")
    assert_names(exc, "/data/train.jsonl", "row 12", field, words)


# ----------------------------------------------------------------------------- malformed files


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"prompt": "no response"}) + "\n")
    with pytest.raises(OxrlError) as exc:
        check_rows(path, "prompt_response")
    assert_names(exc, str(path), "row 3", "'response'")


def test_jsonl_wrong_type(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], ROWS[1], {"prompt": "p", "response": 42}])
    with pytest.raises(OxrlError) as exc:
        check_rows(path, "prompt_response")
    assert_names(exc, str(path), "row 3", "'response'", "int")


def test_jsonl_bad_json_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"prompt": "p", "response": \n')
    with pytest.raises(OxrlError) as exc:
        load_source(str(path), "train")
    assert_names(exc, str(path), "row 2", "invalid JSON")


def test_jsonl_non_object_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(["prompt", "response"]) + "\n")
    with pytest.raises(OxrlError) as exc:
        load_source(str(path), "train")
    assert_names(exc, str(path), "row 2", "JSON object", "list")


def test_jsonl_bad_messages(tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "q"}, {"content": "a"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, good, bad])
    with pytest.raises(OxrlError) as exc:
        check_rows(path, "prompt_response")
    assert_names(exc, str(path), "row 4", "'messages[1]'")


def test_json_file_bad_row(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([ROWS[0], "just a string"]))
    with pytest.raises(OxrlError) as exc:
        load_source(str(path), "train")
    assert_names(exc, str(path), "row 2", "JSON object")
    path.write_text(json.dumps([ROWS[0], {"prompt": "p", "response": 1.5}]))
    with pytest.raises(OxrlError) as exc:
        check_rows(path, "prompt_response")
    assert_names(exc, str(path), "row 2", "'response'")


def test_parquet_null_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([ROWS[0], {"prompt": "p", "response": None}]), path)
    with pytest.raises(OxrlError) as exc:
        check_rows(path, "prompt_response")
    assert_names(exc, str(path), "row 2", "'response'")


def test_prepare_examples_reports_bad_rows_and_empty_sources(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "ok"}, {"text": ["not", "a", "string"]}])
    with pytest.raises(OxrlError) as exc:
        prepare_examples(load_source(str(path), "train"), "text", tokenizer, 64)
    assert_names(exc, str(path), "row 2", "'text'")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(OxrlError) as exc:
        prepare_examples(load_source(str(empty), "train"), "prompt_response", tokenizer, 64)
    assert_names(exc, str(empty), "no rows")


# ----------------------------------------------------------------------------- tokenisation


def ids(tokenizer, tokens: list[str]) -> list[int]:
    out = tokenizer.convert_tokens_to_ids(tokens)
    assert tokenizer.unk_token_id not in out
    return out


def test_prompt_goes_through_chat_template_with_generation_prompt(tokenizer):
    # template: <|role|>content<|end|> per message, then <|assistant|> (the generation prompt)
    assert encode_prompt(tokenizer, "Hi") == ids(tokenizer, ["<|user|>", "H", "i", "<|end|>", "<|assistant|>"])
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert encode_prompt(tokenizer, messages) == ids(
        tokenizer, ["<|system|>", "S", "<|end|>", "<|user|>", "Q", "<|end|>", "<|assistant|>"]
    )


def test_prompt_without_chat_template_is_plain_text(tiny_model_dir):
    from oxrl_core.models.loading import load_tokenizer

    plain = load_tokenizer(str(tiny_model_dir))
    plain.chat_template = None
    assert encode_prompt(plain, "Hi") == ids(plain, ["H", "i"])


def test_completion_is_tokens_then_eos(tokenizer):
    assert encode_completion(tokenizer, "42") == ids(tokenizer, ["4", "2"]) + [tokenizer.eos_token_id]
    assert tokenizer.eos_token == "<|end|>"


def test_prompt_response_labels_mask_the_prompt(tokenizer):
    out = tokenise_prompt_response([{"prompt": "Hi", "response": "42"}], tokenizer, max_length=64)
    prompt = ids(tokenizer, ["<|user|>", "H", "i", "<|end|>", "<|assistant|>"])
    completion = ids(tokenizer, ["4", "2", "<|end|>"])
    assert out.dropped == 0
    assert out.examples == [{"input_ids": prompt + completion, "labels": [IGNORE] * 5 + completion}]


def test_prompt_response_truncation_and_dropping(tokenizer):
    rows = [{"prompt": "Hi", "response": "42"}, {"prompt": "A much longer prompt", "response": "x"}]
    out = tokenise_prompt_response(rows, tokenizer, max_length=6)
    # row 1: 5 prompt tokens + the first completion token fit; row 2: its prompt alone exceeds 6 -> dropped
    assert out.dropped == 1
    assert out.examples == [
        {
            "input_ids": ids(tokenizer, ["<|user|>", "H", "i", "<|end|>", "<|assistant|>", "4"]),
            "labels": [IGNORE] * 5 + ids(tokenizer, ["4"]),
        }
    ]


def test_prepare_examples_with_messages_rows(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "42"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    from_messages = prepare_examples(load_source(str(path), "train"), "prompt_response", tokenizer, 64).examples
    from_prompt = tokenise_prompt_response([{"prompt": "Hi", "response": "42"}], tokenizer, 64).examples
    assert from_messages == [{**ex, "_source": 0} for ex in from_prompt]  # prepare_examples tags each example's source


def test_prepare_examples_all_rows_too_long(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 50, "response": "y"}])
    with pytest.raises(OxrlError) as exc:
        prepare_examples(load_source(str(path), "train"), "prompt_response", tokenizer, 8)
    assert_names(exc, str(path), "max_length=8")


def test_cpt_packing_into_blocks_with_eos_between_texts(tokenizer):
    eos = tokenizer.eos_token
    # stream: a b EOS c d e EOS f EOS  (9 tokens) -> blocks of 4: [a b EOS c] [d e EOS f] [EOS] (dropped: 1 token)
    out = tokenise_text_packed([{"text": "ab"}, {"text": "cde"}, {"text": "f"}], tokenizer, max_length=4)
    expected = [ids(tokenizer, ["a", "b", eos, "c"]), ids(tokenizer, ["d", "e", eos, "f"])]
    assert [ex["input_ids"] for ex in out.examples] == expected
    assert [ex["labels"] for ex in out.examples] == expected  # CPT: every token is a target
    # a short last block (>1 token) is kept
    out = tokenise_text_packed([{"text": "ab"}, {"text": "cd"}], tokenizer, max_length=4)
    assert [ex["input_ids"] for ex in out.examples] == [
        ids(tokenizer, ["a", "b", eos, "c"]),
        ids(tokenizer, ["d", eos]),
    ]


# ----------------------------------------------------------------------------- BatchPlan


LENGTHS = [3, 9, 4, 12, 7, 1, 5, 8, 2, 11, 6, 10, 13, 3, 4, 9, 2, 7, 5, 1, 8, 6, 12]  # 23 rows


@pytest.mark.parametrize("group_by_length", [True, False])
def test_batch_plan_same_seed_same_batches(group_by_length):
    a = BatchPlan(LENGTHS, 4, seed=3, group_by_length=group_by_length)
    b = BatchPlan(LENGTHS, 4, seed=3, group_by_length=group_by_length)
    assert a.batches_per_epoch == 6  # ceil(23 / 4)
    assert [a.micro_batch(k) for k in range(18)] == [b.micro_batch(k) for k in range(18)]
    c = BatchPlan(LENGTHS, 4, seed=4, group_by_length=group_by_length)
    assert [a.micro_batch(k) for k in range(6)] != [c.micro_batch(k) for k in range(6)]


@pytest.mark.parametrize("group_by_length", [True, False])
def test_batch_plan_epochs_are_permutations_and_differ(group_by_length):
    plan = BatchPlan(LENGTHS, 4, seed=0, group_by_length=group_by_length)
    epochs = [plan.epoch(e) for e in range(3)]
    for batches in epochs:
        assert len(batches) == plan.batches_per_epoch
        assert all(1 <= len(b) <= 4 for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_batch_plan_micro_batch_depends_only_on_seed_and_index():
    sequential = BatchPlan(LENGTHS, 4, seed=11)
    expected = [sequential.micro_batch(k) for k in range(20)]
    # a fresh plan asked in another order (as after a resume at an arbitrary position) agrees
    jumping = BatchPlan(LENGTHS, 4, seed=11)
    for k in [17, 3, 12, 0, 19, 6, 6, 11, 18, 1]:
        assert jumping.micro_batch(k) == expected[k]
    # k = epoch * batches_per_epoch + index
    assert expected[6:12] == BatchPlan(LENGTHS, 4, seed=11).epoch(1)


def test_batch_plan_group_by_length_sorts_inside_micro_batches():
    plan = BatchPlan(LENGTHS, 4, seed=5, group_by_length=True)
    for batch in plan.epoch(0):
        lengths = [LENGTHS[i] for i in batch]
        assert lengths == sorted(lengths, reverse=True)
    # with one window, the micro-batches are consecutive slices of the length-sorted rows
    spans = sorted((min(LENGTHS[i] for i in b), max(LENGTHS[i] for i in b)) for b in plan.epoch(0))
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi <= lo


# ----------------------------------------------------------------------------- collate


EXAMPLES = [
    {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
    {"input_ids": [8], "labels": [8]},
    {"input_ids": [9, 10], "labels": [IGNORE, 10]},
]


def test_collate_padding():
    batch = collate(EXAMPLES, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE], [IGNORE, 10, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert "position_ids" not in batch
    assert batch["input_ids"].dtype == torch.long and batch["labels"].dtype == torch.long


def test_collate_packing():
    batch = collate(EXAMPLES, pad_id=0, packing=True)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]  # restart at 0 for every row
    # the first token of each row is unlabelled: no row learns to predict the next row's start
    assert batch["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, IGNORE, 10]]
    assert "attention_mask" not in batch


def sft_loss_of_logits(batch: dict, logits):
    """SFT's loss from full logits: its per-token inputs (`logp`, `mask`) by token_head's plain maths."""
    from oxrl_algs_supervised.sft import SFT
    from oxrl_core.models.token_head import on_grid, stats_from_logits

    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE
    rows, pos = mask.nonzero(as_tuple=True)
    logp = on_grid(stats_from_logits(logits[rows, pos], targets[rows, pos])["logp"], rows, pos, mask.shape)
    return SFT().loss({**batch, "logp": logp, "mask": mask})


def test_packed_forward_matches_padded_sft_loss(tiny_model_dir, tokenizer):
    """Block-diagonal attention through position_ids: packing must not change the loss."""
    from oxrl_core.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir)).eval()
    rows = ROWS + [{"prompt": "Hello there, how are you?", "response": "Fine, thanks."}]
    examples = tokenise_prompt_response(rows, tokenizer, 256).examples
    padded = collate(examples, tokenizer.pad_token_id)
    packed = collate(examples, tokenizer.pad_token_id, packing=True)
    assert padded["labels"].ne(IGNORE).sum() == packed["labels"].ne(IGNORE).sum()
    with torch.no_grad():
        logits_padded = model(
            input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False
        ).logits
        logits_packed = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
        logits_leaky = model(input_ids=packed["input_ids"], use_cache=False).logits  # one long causal sequence
    loss_padded, _ = sft_loss_of_logits(padded, logits_padded)
    loss_packed, _ = sft_loss_of_logits(packed, logits_packed)
    loss_leaky, _ = sft_loss_of_logits(packed, logits_leaky)
    assert abs(float(loss_padded) - float(loss_packed)) < 1e-5
    # the check has teeth: without per-row positions/masking, rows see each other and the loss moves
    assert abs(float(loss_padded) - float(loss_leaky)) > 1e-4


def test_packed_sdpa_attends_row_by_row_with_the_same_maths(tiny_model_dir, tokenizer, monkeypatch):
    """data.packing trains with PACKED_SDPA: causal SDPA per packed row instead of the dense block-diagonal
    mask; the loss and the gradients are those of plain sdpa on the same packed batch."""
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.models.packed_attention import packed_attn_implementation

    rows = ROWS + [{"prompt": "Hello there, how are you?", "response": "Fine, thanks."}]
    examples = tokenise_prompt_response(rows, tokenizer, 256).examples
    packed = collate(examples, tokenizer.pad_token_id, packing=True)
    lengths = [len(e["input_ids"]) for e in examples]
    assert packed["cu_seq_lens_q"].tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert packed["max_length_q"] == max(lengths)
    inputs = {k: v for k, v in packed.items() if k != "labels"}
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: calls.append(a[0].shape[2]) or sdpa(*a, **k),
    )
    results = []
    for attn in ("sdpa", packed_attn_implementation("sdpa")):
        model = load_causal_lm(str(tiny_model_dir), attn_implementation=attn)
        calls.clear()
        loss, _ = sft_loss_of_logits(packed, model(**inputs, use_cache=False).logits)
        loss.backward()
        results.append((float(loss.detach()), model.model.layers[0].self_attn.q_proj.weight.grad, list(calls)))
    (loss_dense, grad_dense, calls_dense), (loss_rows, grad_rows, calls_rows) = results
    n_layers = len(model.model.layers)
    assert calls_dense == [sum(lengths)] * n_layers  # one (ΣL)² attention per layer
    assert calls_rows == lengths * n_layers  # one causal attention per row per layer
    assert loss_rows == pytest.approx(loss_dense, abs=1e-5)
    assert torch.allclose(grad_rows, grad_dense, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_shared_prefix_attention_equals_each_response_after_its_prompt(kv_heads):
    """Shared-prefix rows (RL groups, preference pairs): two batched SDPA calls per layer give, for every
    token, the attention it has in ``prompt + response`` on its own; prompts of different lengths, an
    empty response (an EOS-only completion whose one token is dropped), grouped-query attention."""
    import torch.nn.functional as F

    from oxrl_core.models.packed_attention import _shared_prefix_attention

    torch.manual_seed(0)
    segments = [(0, 5, (3, 0, 7)), (15, 1, (2,)), (18, 9, (1, 4))]
    total = 18 + 9 + 5
    query = torch.randn(1, 4, total, 8, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, total, 8, requires_grad=True) for _ in range(2))
    got = _shared_prefix_attention(query, key, value, segments, 0.0, None)  # (1, ΣL, H, D)

    def alone(positions):  # causal attention over `positions` taken as one sequence: (H, len, D)
        idx = torch.tensor(positions)
        q, k, v = query[0][:, idx], key[0][:, idx], value[0][:, idx]
        k, v = (t.repeat_interleave(4 // kv_heads, dim=0) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    want = torch.zeros(total, 4, 8)
    for start, p, lengths in segments:
        prompt = list(range(start, start + p))
        want[start : start + p] = alone(prompt).transpose(0, 1)
        begin = start + p
        for n in lengths:
            response = list(range(begin, begin + n))
            want[begin : begin + n] = alone(prompt + response)[:, p:].transpose(0, 1)
            begin += n
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=0)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got[0], (query, key, value), grad)
    want_grads = torch.autograd.grad(want, (query, key, value), grad)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
