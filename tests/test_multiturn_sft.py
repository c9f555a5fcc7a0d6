"""Multi-turn SFT on ``messages`` rows (issue 17): the loss on every assistant turn (tool calls included) and
nowhere else, the per-turn fallback for templates that rewrite earlier turns, load-time validation, and a loss
cross-checked against a plain transformers forward pass."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import oxrl, read_metrics, write_jsonl

from oxrl_core.data.batching import collate
from oxrl_core.data.encode import (
    IGNORE,
    prepare_examples,
    tokenise_messages,
    tokenise_preference,
    tokenise_prompt_response,
)
from oxrl_core.data.rows import is_multi_turn, normalise_row
from oxrl_core.data.sources import load_source
from oxrl_core.errors import OxrlError
from oxrl_core.models.tiny import build_tokenizer

PLAIN = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Go"},
    {"role": "assistant", "content": "ok"},
]


def calculator_row(a: int, b: int, arguments_as_string: bool = False) -> dict:
    """A tool-use conversation: the assistant calls the calculator, reads its result, answers."""
    arguments = {"expression": f"{a}*{b}"}
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps(arguments) if arguments_as_string else arguments},
    }
    return {
        "messages": [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": f"What is {a}*{b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": f"{a}*{b} = {a * b}"},
        ]
    }


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tokenizer_with(template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def ids(tokenizer, tokens: list[str]) -> list[int]:
    out = tokenizer.convert_tokens_to_ids(tokens)
    assert tokenizer.unk_token_id not in out
    return out


def chars(text: str) -> list[str]:
    return list(text)


def load(tmp_path, rows: list[dict], tokenizer, max_length: int = 256, name: str = "chat.jsonl"):
    path = write_jsonl(tmp_path / name, rows)
    return path, prepare_examples(load_source(str(path), "train"), "prompt_response", tokenizer, max_length)


def trained(example: dict) -> list[int]:
    return [t for t in example["labels"] if t != IGNORE]


# ----------------------------------------------------------------------------- which rows are multi-turn


def test_which_messages_rows_are_multi_turn():
    single = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    assert not is_multi_turn(single)
    # Parquet / datasets give every message every field: null tool_calls are no tool calls
    assert not is_multi_turn([{**m, "tool_calls": None, "name": None} for m in single])
    assert is_multi_turn(PLAIN)  # two assistant turns
    assert is_multi_turn(calculator_row(2, 3)["messages"])
    assert is_multi_turn([*single[:2], {"role": "tool", "content": "4"}, single[2]])  # a tool result alone
    assert not is_multi_turn("not a list")


def test_single_turn_rows_keep_the_prompt_response_form(tmp_path, tokenizer):
    row = {"messages": PLAIN[:2], "_row": 1}
    assert normalise_row(row, "prompt_response", "f.jsonl") == {**row, "prompt": PLAIN[:1], "response": "42"}
    _, out = load(tmp_path, [{"messages": PLAIN[:2]}], tokenizer)
    expected = tokenise_prompt_response([{"prompt": "Hi", "response": "42"}], tokenizer, 256).examples
    assert out.examples == [{**ex, "_source": 0} for ex in expected]


# ----------------------------------------------------------------------------- the built-in template


def test_plain_conversation_trains_exactly_the_assistant_turns(tmp_path, tokenizer):
    _, out = load(tmp_path, [{"messages": PLAIN}], tokenizer)
    # <|user|>Hi<|end|><|assistant|>42<|end|><|user|>Go<|end|><|assistant|>ok<|end|>
    #    0     1 2   3        4      5 6   7      8     9 10 11      12      13 14 15
    tokens = ["<|user|>", "H", "i", "<|end|>", "<|assistant|>", "4", "2", "<|end|>"]
    tokens += ["<|user|>", "G", "o", "<|end|>", "<|assistant|>", "o", "k", "<|end|>"]
    input_ids = ids(tokenizer, tokens)
    labels = [IGNORE] * 5 + input_ids[5:8] + [IGNORE] * 5 + input_ids[13:16]
    assert out.dropped == 0 and out.per_turn == []
    assert out.examples == [{"input_ids": input_ids, "labels": labels, "_source": 0}]
    assert out.notes(256) == []


def test_truncation_cuts_the_sequence_and_drops_a_row_whose_first_turn_does_not_fit(tmp_path, tokenizer):
    full = ids(tokenizer, ["<|user|>", "H", "i", "<|end|>", "<|assistant|>", "4", "2", "<|end|>", "<|user|>", "G"])
    _, out = load(tmp_path, [{"messages": PLAIN}], tokenizer, max_length=10)
    assert out.examples == [{"input_ids": full, "labels": [IGNORE] * 5 + full[5:8] + [IGNORE] * 2, "_source": 0}]
    _, out = load(tmp_path, [{"messages": PLAIN}], tokenizer, max_length=6)  # one token of the first turn fits
    assert out.examples == [{"input_ids": full[:6], "labels": [IGNORE] * 5 + full[5:6], "_source": 0}]
    long_first = [{"role": "user", "content": "x" * 20}, *PLAIN[1:]]
    examples, _ = tokenise_messages(tokenizer, long_first, 23)  # <|user|> + 20 x + <|end|> + <|assistant|> = 23
    assert examples == []
    rows = [{"messages": PLAIN}, {"messages": long_first}]
    _, out = load(tmp_path, rows, tokenizer, max_length=16)
    assert out.dropped == 1 and len(out.examples) == 1
    assert "1 rows dropped" in out.notes(16)[0]


def test_tool_calls_are_trained_as_the_template_renders_them(tmp_path, tokenizer):
    row = calculator_row(12, 34)
    _, out = load(tmp_path, [row], tokenizer)
    (example,) = out.examples
    whole = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    # the built-in template: <|role|>...<|end|> per message; the first assistant turn is the rendered call
    head, call_turn, answer_turn = whole.split("<|assistant|>")
    call = call_turn[: call_turn.index("<|end|>")]
    assert "calculator" in call and "12*34" in call  # the template shows the call (how is the template's business)
    tool = call_turn[len(call) + len("<|end|>") :]
    assert answer_turn == "12*34 = 408<|end|>"

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assistant = ids(tokenizer, ["<|assistant|>"])
    assert example["input_ids"] == enc(head) + assistant + enc(call_turn) + assistant + enc(answer_turn)
    assert example["labels"] == (
        [IGNORE] * len(enc(head) + assistant)
        + enc(call + "<|end|>")
        + [IGNORE] * len(enc(tool) + assistant)
        + enc(answer_turn)
    )
    # arguments given as a JSON string (OpenAI style) are the same call
    _, same = load(tmp_path, [calculator_row(12, 34, arguments_as_string=True)], tokenizer, name="s.jsonl")
    assert same.examples == out.examples


# ----------------------------------------------------------------------------- ChatML: no loss after <|im_end|>


def test_chatml_trains_up_to_im_end_and_not_the_newline_after_it():
    from archs import build_tokenizer as arch_tokenizer

    tok = arch_tokenizer("qwen2")
    assert tok.eos_token == "<|im_end|>"
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Compute 2 times 3."},
        {"role": "assistant", "content": "The result is 6."},
    ]
    pieces = [  # (text, trained) of the ChatML rendering, derived by hand
        ("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n", False),
        ("5<|im_end|>", True),
        ("\n<|im_start|>user\nCompute 2 times 3.<|im_end|>\n<|im_start|>assistant\n", False),
        ("The result is 6.<|im_end|>", True),
        ("\n", False),
    ]
    enc = [tok(text, add_special_tokens=False)["input_ids"] for text, _ in pieces]
    expected_ids = [t for piece in enc for t in piece]
    assert tok("".join(text for text, _ in pieces), add_special_tokens=False)["input_ids"] == expected_ids
    expected_labels = [t if keep else IGNORE for piece, (_, keep) in zip(enc, pieces) for t in piece]
    (example,), one_sequence = tokenise_messages(tok, messages, 256)
    assert one_sequence
    assert example == {"input_ids": expected_ids, "labels": expected_labels}
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1 and example["labels"][-1] == IGNORE and example["input_ids"][-1] == newline[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral", "phi3", "olmo2"])
def test_every_template_style_of_the_matrix_trains_each_turn_and_its_eos(family):
    """ChatML, Gemma (turns trimmed), Mistral (no generation prompt) and Phi-3 (EOS after the last turn when
    there is no generation prompt) all keep a conversation one sequence with the loss on content + EOS."""
    from archs import build_tokenizer as arch_tokenizer

    tok = arch_tokenizer(family)
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Compute 2 times 3."},
        {"role": "assistant", "content": "The result is 6."},
    ]
    (example,), one_sequence = tokenise_messages(tok, messages, 512)
    runs, run = [], []
    for label in [*example["labels"], IGNORE]:
        if label != IGNORE:
            run.append(label)
        elif run:
            runs, run = [*runs, tok.decode(run)], []
    assert one_sequence
    assert runs == [f"5{tok.eos_token}", f"The result is 6.{tok.eos_token}"]
    assert example["labels"][0] == IGNORE and len(example["labels"]) == len(example["input_ids"])


def test_a_template_without_eos_after_turns_trains_the_whole_turn():
    tok = tokenizer_with(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (example,), one_sequence = tokenise_messages(tok, PLAIN, 256)
    tokens = ["<|user|>", "H", "i", ";", "<|assistant|>", "4", "2", ";"]
    tokens += ["<|user|>", "G", "o", ";", "<|assistant|>", "o", "k", ";"]
    input_ids = ids(tok, tokens)
    assert one_sequence
    assert example == {"input_ids": input_ids, "labels": [IGNORE] * 5 + input_ids[5:8] + [IGNORE] * 5 + input_ids[13:]}


# ----------------------------------------------------------------------------- the per-turn fallback

#: renders an assistant message's content only when it is the last message (as Qwen3 drops earlier <think>)
LAST_ASSISTANT_ONLY = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_gives_one_example_per_turn(tmp_path):
    tok = tokenizer_with(LAST_ASSISTANT_ONLY)
    path, out = load(tmp_path, [{"messages": PLAIN[:2]}, {"messages": PLAIN}], tok)
    first_prompt = ids(tok, ["<|user|>", "H", "i", "<|end|>", "<|assistant|>"])
    first_turn = ids(tok, ["4", "2", "<|end|>"])
    second_prompt = first_prompt + ids(tok, ["<|end|>", "<|user|>", "G", "o", "<|end|>", "<|assistant|>"])
    second_turn = ids(tok, ["o", "k", "<|end|>"])
    single = {"input_ids": first_prompt + first_turn, "labels": [IGNORE] * 5 + first_turn, "_source": 0}
    assert out.examples == [
        single,  # row 1 (single-turn, the prompt/response form)
        single,  # row 2, turn 1: prompt = the template of messages[:1] with the generation prompt
        {"input_ids": second_prompt + second_turn, "labels": [IGNORE] * 11 + second_turn, "_source": 0},
    ]
    assert out.per_turn == [(str(path), 2)]
    assert out.notes(256) == [
        f"1 multi-turn rows trained as one example per assistant turn: the chat template renders earlier turns "
        f"differently in a longer conversation (e.g. drops their <think>): {path} row 2"
    ]
    # cut to max_length: turn 2's prompt no longer fits, turn 1 still does
    examples, one_sequence = tokenise_messages(tok, PLAIN, 8)
    assert not one_sequence
    assert examples == [{"input_ids": first_prompt + first_turn, "labels": [IGNORE] * 5 + first_turn}]


# ----------------------------------------------------------------------------- errors at load time


@pytest.mark.parametrize(
    "messages,words",
    [
        (
            [{"role": "bot", "content": "Hi"}, *PLAIN[1:]],
            ["'messages[0].role'", "'bot'", "system, user, assistant, tool"],
        ),
        (PLAIN[:3] + [{"role": "tool", "content": "4"}], ["last message", "'assistant'"]),
        ([PLAIN[1], *PLAIN], ["before the first assistant"]),
        (
            [PLAIN[0], {"role": "assistant", "tool_calls": {"name": "calculator"}}, *PLAIN[2:]],
            ["'messages[1].tool_calls'", "must be a list"],
        ),
        (
            [PLAIN[0], {"role": "assistant", "tool_calls": [{"name": "calculator"}]}, *PLAIN[2:]],
            ["'messages[1].tool_calls[0]'", "function"],
        ),
        (
            [PLAIN[0], {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}, *PLAIN[2:]],
            ["'messages[1].tool_calls[0].function.name'"],
        ),
        (
            [PLAIN[0], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}, *PLAIN],
            ["'messages[1].tool_calls[0].function.arguments'", "not JSON"],
        ),
        (
            [PLAIN[0], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}, *PLAIN],
            ["'messages[1].tool_calls[0].function.arguments'", "object", "int"],
        ),
        (
            [*PLAIN[:2], {"role": "tool", "name": "calculator", "content": {"value": 4}}, PLAIN[3]],
            ["'messages[2].content'", "string", "tool message"],
        ),
        (
            [{**PLAIN[0], "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}, *PLAIN[1:]],
            ["'messages[0].tool_calls'", "only assistant messages"],
        ),
        ([PLAIN[0], {"role": "assistant", "content": " "}, *PLAIN[2:]], ["'messages[1]'", "content or tool_calls"]),
        ([*PLAIN[:2], {"role": "tool", "name": 5, "content": "4"}, PLAIN[3]], ["'messages[2].name'", "string"]),
    ],
)
def test_bad_conversations_name_the_file_the_row_and_the_field(tmp_path, tokenizer, messages, words):
    rows = [calculator_row(1, 2), {"messages": PLAIN}, {"messages": messages}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(OxrlError) as exc:
        prepare_examples(load_source(str(path), "train"), "prompt_response", tokenizer, 256)
    message = str(exc.value)
    for part in [f"{path}: row 3", *words]:
        assert part in message, f"{part!r} not in error message: {message}"


def test_a_tokenizer_without_chat_template_is_refused_naming_the_row(tmp_path):
    tok = tokenizer_with("")
    tok.chat_template = None
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": PLAIN[:2]}, calculator_row(2, 3)])
    with pytest.raises(OxrlError) as exc:
        prepare_examples(load_source(str(path), "train"), "prompt_response", tok, 256)
    assert f"{path}: row 2" in str(exc.value) and "chat template" in str(exc.value)


def test_a_template_that_drops_tool_calls_is_refused_naming_the_row(tmp_path):
    tok = tokenizer_with(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": PLAIN}, calculator_row(2, 3)])
    with pytest.raises(OxrlError) as exc:
        prepare_examples(load_source(str(path), "train"), "prompt_response", tok, 256)
    assert all(w in str(exc.value) for w in (f"{path}: row 2", "'messages[2].tool_calls[0]'", "'calculator'"))


def test_a_failing_template_is_an_error_naming_the_row(tmp_path):
    tok = tokenizer_with("{% for m in messages %}{{ raise_exception('roles must alternate') }}{% endfor %}")
    with pytest.raises(OxrlError) as exc:
        tokenise_messages(tok, PLAIN, 256, "chat.jsonl: row 7")
    assert "chat.jsonl: row 7" in str(exc.value) and "roles must alternate" in str(exc.value)


def test_self_play_reads_a_conversation_as_its_last_turn(tokenizer):
    rows = [normalise_row({"messages": PLAIN, "_row": 1}, "prompt_response", "f.jsonl")]
    legacy = [{"prompt": PLAIN[:3], "response": "ok", "_row": 1}]
    assert tokenise_preference(rows, "prompt_response", tokenizer, 256).examples == (
        tokenise_preference(legacy, "prompt_response", tokenizer, 256).examples
    )
    tools = [normalise_row({**calculator_row(2, 3), "_row": 4}, "prompt_response", "f.jsonl")]
    with pytest.raises(OxrlError) as exc:
        tokenise_preference(tools, "prompt_response", tokenizer, 256, "f.jsonl")
    assert "f.jsonl: row 4" in str(exc.value) and "sft" in str(exc.value)


# ----------------------------------------------------------------------------- the loss, cross-checked


@pytest.mark.parametrize("packing", [False, True])
def test_sft_loss_on_a_conversation_equals_a_plain_transformers_forward(tiny_model_dir, tokenizer, packing):
    """oxRL's SFT loss (the loop's `supervised_tokens` + the `sft` algorithm) on a conversation, padded or packed
    beside a single-turn row, equals cross-entropy computed by hand from transformers' logits on the same ids
    with the mask derived by hand: the tokens of both assistant turns, their <|end|> included."""
    from transformers import AutoModelForCausalLM

    from oxrl_algs_supervised.sft import SFT
    from oxrl_core.loops.supervised import supervised_tokens
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.models.packed_attention import packed_attn_implementation

    (conversation,), _ = tokenise_messages(tokenizer, PLAIN, 256)
    (single,) = tokenise_prompt_response([{"prompt": "Go", "response": "12"}], tokenizer, 256).examples
    scored = {0: [5, 6, 7, 13, 14, 15], 1: [5, 6, 7]}  # positions of 4 2 <|end|> o k <|end|>; 1 2 <|end|>

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    terms = []
    for row, example in enumerate([conversation, single]):
        input_ids = torch.tensor([example["input_ids"]])
        logp = torch.log_softmax(reference(input_ids).logits[0].double(), -1)  # (L, V)
        terms += [-logp[t - 1, example["input_ids"][t]] for t in scored[row]]
    expected = torch.stack(terms).mean()

    attn = packed_attn_implementation("sdpa") if packing else "sdpa"
    model = load_causal_lm(str(tiny_model_dir), attn_implementation=attn).eval()
    batch = collate([conversation, single], tokenizer.pad_token_id, packing)
    sft = SFT(SFT.Config())
    with torch.no_grad():
        tokens = supervised_tokens(model, None, batch, sft)
        loss, _ = sft.loss({**batch, **tokens})
    assert int(tokens["mask"].sum()) == 9
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the real CLI


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["false", "true"])
def test_oxrl_run_sft_on_tool_use_conversations(tmp_path, tiny_model_dir, packing):
    rows = [calculator_row(a, b, arguments_as_string=bool(a % 2)) for a in range(2, 6) for b in range(3, 6)]
    rows += [{"messages": PLAIN}]
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    run = tmp_path / "run"
    sets = [f"model.name={tiny_model_dir}", f"data.train={data}", "train.max_steps=2", "train.batch_size=4"]
    sets += [f"data.packing={packing}", "data.max_length=256"]
    proc = oxrl("run", "--alg", "sft", *[a for s in sets for a in ("--set", s)], "-o", str(run), cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "(13 examples)" in " ".join((proc.stdout + proc.stderr).split())  # one example per conversation
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["loss/nll"] > 0 and m["loss/nll"] == m["loss/nll"] for m in metrics)
    assert (run / "final" / "model.safetensors").is_file()
