"""Tool-call parsing (oxrl_core/tool_parsers.py) and the chat templates that render tool calls and tool results:
the built-in tiny model's and every family's of the test matrix (tests/archs.py)."""

from __future__ import annotations

import json

import pytest
from archs import _FAMILY_STYLE, _STYLES, FAMILIES, HISTORY_REWRITING_TEMPLATE, build_tokenizer

from oxrl_core.errors import OxrlError
from oxrl_core.models import tiny
from oxrl_core.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedTurn,
    ToolCall,
    ToolParser,
    detect,
    dumps,
    parser_for,
)

CALC = ToolCall("calculator", {"expression": "12*34"})
SEARCH = ToolCall("search", {"query": "café ☕", "limit": 3, "filters": {"lang": ["fr", "en"], "safe": True}})
HF_CALC = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
USER = {"role": "user", "content": "What is 12*34?"}
TOOL = {"role": "tool", "name": "calculator", "content": "408"}


def hf(call: ToolCall) -> dict:
    """A `ToolCall` in the HF message format."""
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# ------------------------------------------------------------------------------------------------ hermes


def test_hermes_single_and_multiple_calls_with_content_around():
    parser = HermesParser()
    one = parser.parse('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
    assert one == ParsedTurn(content="", calls=[CALC], errors=[])
    text = (
        "Let me compute.\n<tool_call>\n"
        '  {"name": "calculator", "arguments": {"expression": "12*34"}}\n'
        "</tool_call>\n<tool_call>"
        '{"arguments": {"query": "café ☕", "limit": 3, "filters": {"lang": ["fr", "en"], "safe": true}}, '
        '"name": "search"}'
        "</tool_call>\nThen I answer."
    )
    two = parser.parse(text)
    assert two.calls == [CALC, SEARCH] and two.errors == []
    assert two.content == "Let me compute.\n\n\nThen I answer."
    assert parser.parse("  just an answer: 408\n") == ParsedTurn(content="just an answer: 408")


def test_hermes_malformed_calls_are_messages_not_exceptions():
    parser = HermesParser()
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>'  # bad JSON
        '<tool_call>{"arguments": {"x": 1}}</tool_call>'  # no name
        '<tool_call>{"name": "calculator", "arguments": "12*34"}</tool_call>'  # arguments a string
        '<tool_call>["calculator"]</tool_call>'  # not an object
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
        "<tool_call></tool_call>"
        'done <tool_call>{"name": "", "arguments": {}}</tool_call>'  # empty name
    )
    turn = parser.parse(text)
    assert turn.calls == [CALC]
    assert turn.content == "done"
    assert len(turn.errors) == 6
    bad_json, no_name, args, not_object, empty, empty_name = turn.errors
    assert bad_json.startswith("tool call 1 is not valid JSON (Expecting ',' delimiter") and "1+1" in bad_json
    assert no_name.startswith('tool call 2 has no "name"') and '{"arguments": {"x": 1}}' in no_name
    assert args.startswith('tool call 3 (calculator): "arguments" must be a JSON object') and "got str" in args
    assert not_object.startswith("tool call 4 must be a JSON object") and "got list" in not_object
    assert empty.startswith("tool call 6 is not valid JSON (Expecting value")
    assert empty_name.startswith('tool call 7 has no "name"')


def test_hermes_reads_an_unclosed_last_call_and_missing_arguments():
    turn = HermesParser().parse('Sure. <tool_call>{"name": "now"}\n')  # a stop string dropped </tool_call>
    assert turn == ParsedTurn(content="Sure.", calls=[ToolCall("now", {})], errors=[])
    cut = HermesParser().parse('<tool_call>{"name": "calculator", "argu')  # the generation ran out of tokens
    assert cut.calls == [] and cut.errors[0].startswith("tool call 1 is not valid JSON") and cut.content == ""


# ------------------------------------------------------------------------------------------------ llama3_json


def test_llama3_single_multiple_python_tag_and_arguments_key():
    parser = Llama3JsonParser()
    assert parser.parse('{"name": "calculator", "parameters": {"expression": "12*34"}}').calls == [CALC]
    assert parser.parse('<|python_tag|>{"name": "calculator", "arguments": {"expression": "12*34"}}').calls == [CALC]
    text = (
        ' {"name": "calculator", "parameters": {"expression": "12*34"}} ;\n'
        '{"name": "search", "parameters": {"query": "café ☕", "limit": 3, '
        '"filters": {"lang": ["fr", "en"], "safe": true}}};'
    )
    turn = parser.parse(text)
    assert turn == ParsedTurn(content="", calls=[CALC, SEARCH], errors=[])
    semicolon = parser.parse('{"name": "echo", "parameters": {"text": "a; b"}}')  # a ";" inside a string
    assert semicolon.calls == [ToolCall("echo", {"text": "a; b"})]


def test_llama3_plain_text_is_content_and_malformed_json_is_an_error():
    parser = Llama3JsonParser()
    assert parser.parse("  The answer is {408}.\n") == ParsedTurn(content="The answer is {408}.")
    assert parser.parse('<|python_tag|>search.call(query="x")').content == '<|python_tag|>search.call(query="x")'
    bad = parser.parse('{"name": "calculator", "parameters": {"expression": 12*34}}')
    assert bad.calls == [] and bad.content == "" and len(bad.errors) == 1
    assert bad.errors[0].startswith("tool call 1 is not valid JSON (Expecting ',' delimiter")
    tagged = parser.parse("<|python_tag|> {oops")
    assert tagged.calls == [] and tagged.errors[0].startswith("tool call 1 is not valid JSON")
    second = parser.parse('{"name": "calculator", "parameters": {"expression": "12*34"}}; {nope}')
    assert second.calls == [CALC] and second.errors[0].startswith("tool call 2 is not valid JSON")
    trailing = parser.parse('{"name": "calculator", "parameters": {"expression": "12*34"}} and that is it')
    assert trailing == ParsedTurn(content="and that is it", calls=[CALC], errors=[])


def test_llama3_missing_name_and_parameters_not_an_object():
    turn = Llama3JsonParser().parse('{"answer": 408}; {"name": "calculator", "parameters": ["12*34"]}; [1]')
    assert turn.calls == []
    assert turn.errors[0].startswith('tool call 1 has no "name"')
    assert turn.errors[1].startswith('tool call 2 (calculator): "parameters" must be a JSON object')
    assert (
        len(turn.errors) == 3
        and turn.errors[2].startswith("tool call 3 must be a JSON object")
        and "list" in turn.errors[2]
    )


# ------------------------------------------------------------------------------------------------ mistral


def test_mistral_calls_with_content_before_and_after():
    parser = MistralParser()
    turn = parser.parse(
        'Let me compute. [TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "12*34"}}, '
        '{"name": "search", "arguments": {"query": "café ☕", "limit": 3, '
        '"filters": {"lang": ["fr", "en"], "safe": true}}}] thanks'
    )
    assert turn == ParsedTurn(content="Let me compute.\nthanks", calls=[CALC, SEARCH], errors=[])
    single = parser.parse('[TOOL_CALLS]{"name": "calculator", "arguments": {"expression": "12*34"}}')
    assert single == ParsedTurn(content="", calls=[CALC])
    assert parser.parse(" The answer is [408]. ") == ParsedTurn(content="The answer is [408].")


def test_mistral_malformed_calls_are_messages():
    parser = MistralParser()
    turn = parser.parse(
        '[TOOL_CALLS][{"arguments": {}}, {"name": "calculator", "arguments": 5}, '
        '{"name": "calculator", "arguments": {"expression": "12*34"}}, "calculator"]'
    )
    assert turn.calls == [CALC] and turn.content == ""
    assert turn.errors[0].startswith('tool call 1 has no "name"')
    assert (
        turn.errors[1].startswith('tool call 2 (calculator): "arguments" must be a JSON object')
        and "int" in turn.errors[1]
    )
    assert turn.errors[2].startswith("tool call 4 must be a JSON object") and "got str" in turn.errors[2]
    bad = parser.parse('I will call. [TOOL_CALLS][{"name": "calculator", "arguments": {"expression": }}]')
    assert bad.calls == [] and bad.content == "I will call."
    assert len(bad.errors) == 1 and bad.errors[0].startswith("tool call 1 is not valid JSON (Expecting value")
    then = parser.parse('[TOOL_CALLS][{bad [TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12*34"}}]')
    assert then.calls == [CALC] and len(then.errors) == 1  # the next [TOOL_CALLS] is read after a broken one


# ------------------------------------------------------------------------------------------------ format


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_format_round_trips(name):
    parser = PARSERS[name]()
    assert parser.name == name and isinstance(parser, ToolParser)
    for calls in ([CALC], [CALC, SEARCH, ToolCall("now", {})], [ToolCall("echo", {"text": 'a "quoted"; b</'})]):
        text = parser.format(calls)
        assert parser.parse(text) == ParsedTurn(content="", calls=calls, errors=[]), text
    assert parser.format([]) == "" and parser.parse("") == ParsedTurn(content="")


def test_format_writes_the_documented_text():
    calc = '{"name": "calculator", "arguments": {"expression": "12*34"}}'
    assert HermesParser().format([CALC, CALC]) == f"<tool_call>{calc}</tool_call>\n<tool_call>{calc}</tool_call>"
    assert MistralParser().format([CALC, CALC]) == f"[TOOL_CALLS][{calc}, {calc}]"
    llama = '{"name": "calculator", "parameters": {"expression": "12*34"}}'
    assert Llama3JsonParser().format([CALC, CALC]) == f"{llama}; {llama}"
    assert dumps({"q": "café"}) == '{"q": "café"}'  # as transformers' tojson: non-ASCII kept


def test_dumps_is_what_the_chat_template_tojson_writes():
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = "{{ messages[0]['content'] | tojson }}"
    value = {"query": "café ☕", "n": [1, 2.5, None, True], "nested": {"b": 1, "a": "x"}}
    assert tokenizer.apply_chat_template([{"role": "user", "content": value}], tokenize=False) == dumps(value)


# ------------------------------------------------------------------------------------------------ parser_for


@pytest.mark.parametrize("family", FAMILIES)
def test_parser_for_detects_each_family(family):
    expected = MistralParser if family == "mistral" else HermesParser
    assert type(parser_for(build_tokenizer(family))) is expected


def test_parser_for_detects_templates_and_the_builtin_tokenizer():
    assert type(parser_for(tiny.build_tokenizer())) is HermesParser
    assert detect("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}") == "llama3_json"
    assert detect("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral" and detect("[INST] x [/INST]") == "mistral"
    assert detect("<|im_start|>") == "hermes" and detect(None) == "hermes" and detect("") == "hermes"
    assert detect({"default": "<|im_start|>", "tool_use": "[TOOL_CALLS]"}) == "mistral"  # named templates
    no_template = tiny.build_tokenizer()
    no_template.chat_template = None
    assert type(parser_for(no_template)) is HermesParser
    assert type(parser_for("[INST]", "hermes")) is HermesParser  # a name wins over the template
    assert type(parser_for(None, "llama3_json")) is Llama3JsonParser


def test_parser_for_loads_an_import_path(tmp_path, monkeypatch):
    path = tmp_path / "my_parser.py"
    path.write_text(
        "from oxrl_core.tool_parsers import ParsedTurn, ToolCall, ToolParser\n\n"
        "class Shout(ToolParser):\n"
        "    name = 'shout'\n\n"
        "    def parse(self, text):\n"
        "        name, _, arg = text.partition('!')\n"
        "        return ParsedTurn(content='', calls=[ToolCall(name, {'arg': arg})])\n\n"
        "    def format(self, calls):\n"
        "        return ''.join(f\"{c.name}!{c.arguments['arg']}\" for c in calls)\n\n"
        "NOT_A_PARSER = 3\n\n"
        "class Half(ToolParser):\n"
        "    name = 'half'\n\n"
        "    def format(self, calls):\n"
        "        return ''\n"
    )
    parser = parser_for(None, f"{path}:Shout")
    assert type(parser).__name__ == "Shout" and parser.parse("ping!1").calls == [ToolCall("ping", {"arg": "1"})]
    assert type(parser_for(None, "oxrl_core.tool_parsers:MistralParser")) is MistralParser
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(parser_for(None, "my_parser:Shout")).__name__ == "Shout"
    with pytest.raises(OxrlError, match=r"'my_parser:NOT_A_PARSER' is not a ToolParser subclass \(it is 3\)"):
        parser_for(None, "my_parser:NOT_A_PARSER")
    with pytest.raises(OxrlError, match="'oxrl_core.errors:OxrlError' is not a ToolParser subclass"):
        parser_for(None, "oxrl_core.errors:OxrlError")
    with pytest.raises(OxrlError, match="'my_parser:Half' could not start: TypeError: .*abstract.*parse"):
        parser_for(None, "my_parser:Half")
    with pytest.raises(OxrlError, match="'my_parser:Missing' failed to load: AttributeError"):
        parser_for(None, "my_parser:Missing")
    with pytest.raises(OxrlError, match="'no_such_module_xyz:P' failed to load: ModuleNotFoundError"):
        parser_for(None, "no_such_module_xyz:P")
    with pytest.raises(OxrlError, match="file not found: .*nope.py"):
        parser_for(None, f"{tmp_path / 'nope.py'}:P")


@pytest.mark.parametrize("name", ["x", "Hermes", "module:", ":Class", ""])
def test_parser_for_refuses_unknown_names(name):
    with pytest.raises(OxrlError) as info:
        parser_for(None, name)
    assert str(info.value) == (
        f"env.tool_parser: unknown tool-call parser '{name}'; built-in: hermes, llama3_json, mistral, or module:Class"
    )


# ------------------------------------------------------------------------------------------------ templates


def _tokenizer(which: str):
    return tiny.build_tokenizer() if which == "tiny" else build_tokenizer(which)


def _assistant_text(tokenizer, assistant: dict) -> str:
    """The assistant's rendered turn: after the generation prompt, before the end of turn."""
    prompt = tokenizer.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([USER, assistant], tokenize=False)
    assert full.startswith(prompt), (prompt, full)
    rest = full[len(prompt) :]
    assert tokenizer.eos_token in rest
    return rest.split(tokenizer.eos_token)[0]


@pytest.mark.parametrize("which", ["tiny", *FAMILIES])
@pytest.mark.parametrize("content", ["", None, "Let me compute that."])
def test_rendered_tool_calls_parse_back(which, content):
    tokenizer = _tokenizer(which)
    parser = parser_for(tokenizer)
    for calls in ([CALC], [CALC, SEARCH]):
        message = {"role": "assistant", "content": content, "tool_calls": [hf(c) for c in calls]}
        text = _assistant_text(tokenizer, message)
        assert parser.parse(text) == ParsedTurn(content=content or "", calls=calls, errors=[]), text


@pytest.mark.parametrize("which", ["tiny", *FAMILIES])
def test_rendered_tool_calls_with_json_string_arguments_and_flat_calls(which):
    """OpenAI-style ``arguments`` (a JSON string) are written as they are; ``function`` may be left out."""
    tokenizer = _tokenizer(which)
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": json.dumps(CALC.arguments)}},
        {"name": "search", "arguments": SEARCH.arguments},
    ]
    text = _assistant_text(tokenizer, {"role": "assistant", "content": "", "tool_calls": calls})
    assert parser_for(tokenizer).parse(text).calls == [CALC, SEARCH]


def test_builtin_template_renders_calls_as_the_hermes_format_writes_them():
    tokenizer = tiny.build_tokenizer()
    calc = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    conversation = [USER, {"role": "assistant", "content": None, "tool_calls": [HF_CALC]}, TOOL]
    assert tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == (
        f"<|user|>What is 12*34?<|end|><|assistant|>{calc}<|end|><|tool|>408<|end|><|assistant|>"
    )
    message = {"role": "assistant", "content": "Hm.", "tool_calls": [hf(CALC), hf(SEARCH)]}
    assert _assistant_text(tokenizer, message) == "Hm.\n" + HermesParser().format([CALC, SEARCH])
    # every rendered character is in the character-level vocabulary
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert tokenizer.unk_token_id not in ids


#: a conversation without tools, as each template rendered it before tools were added (it must not change)
PLAIN = [
    {"role": "system", "content": " Be brief. "},
    USER,
    {"role": "assistant", "content": "<think>12*34</think>\n408"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": ""},
]
PLAIN_RENDERED = {
    "tiny": "<|system|> Be brief. <|end|><|user|>What is 12*34?<|end|><|assistant|><think>12*34</think>\n408<|end|>"
    "<|user|>Thanks<|end|><|assistant|><|end|><|assistant|>",
    "chatml": "<|im_start|>system\n Be brief. <|im_end|>\n<|im_start|>user\nWhat is 12*34?<|im_end|>\n"
    "<|im_start|>assistant\n<think>12*34</think>\n408<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
    "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n",
    "gemma": "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>user\nWhat is 12*34?<end_of_turn>\n"
    "<start_of_turn>model\n<think>12*34</think>\n408<end_of_turn>\n<start_of_turn>user\nThanks<end_of_turn>\n"
    "<start_of_turn>model\n<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "<s>[INST]  Be brief.  [/INST][INST] What is 12*34? [/INST]<think>12*34</think>\n408</s>"
    "[INST] Thanks [/INST]</s>",
    "phi3": "<|system|>\n Be brief. <|end|>\n<|user|>\nWhat is 12*34?<|end|>\n<|assistant|>\n"
    "<think>12*34</think>\n408<|end|>\n<|user|>\nThanks<|end|>\n<|assistant|>\n<|end|>\n<|assistant|>\n",
}
TOOL_RENDERED = {
    "tiny": "<|tool|>408<|end|>",
    "chatml": "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n",
    "gemma": "<start_of_turn>user\n<tool_response>\n408\n</tool_response><end_of_turn>\n",
    "mistral": "[TOOL_RESULTS] 408 [/TOOL_RESULTS]",
    "phi3": "<|tool|>\n408<|end|>\n",
}
#: tests/archs.py's tokenizer styles by the template they share
TEMPLATE_OF_STYLE = {"smollm2": "chatml", "olmo2": "chatml", "gemma_mm": "gemma"}


def _style(which: str) -> str:
    if which == "tiny":
        return "tiny"
    style = _FAMILY_STYLE[which]
    return TEMPLATE_OF_STYLE.get(style, style)


@pytest.mark.parametrize("which", ["tiny", *FAMILIES])
def test_templates_render_plain_conversations_as_before_and_tool_messages(which):
    tokenizer = _tokenizer(which)
    style = _style(which)
    plain = tokenizer.apply_chat_template(PLAIN, tokenize=False, add_generation_prompt=True)
    assert plain == PLAIN_RENDERED[style].replace("<bos>", tokenizer.bos_token or "")
    end = tokenizer.eos_token if style == "phi3" else ""  # Phi-3 ends a conversation with EOS
    before = tokenizer.apply_chat_template([USER], tokenize=False).removesuffix(end)
    with_tool = tokenizer.apply_chat_template([USER, TOOL], tokenize=False).removesuffix(end)
    assert with_tool == before + TOOL_RENDERED[style]


def test_a_run_of_tool_messages_shares_one_user_turn():
    tokenizer = build_tokenizer("qwen3")
    second = {"role": "tool", "name": "calculator", "content": "409"}
    rendered = tokenizer.apply_chat_template([USER, TOOL, second, USER], tokenize=False)
    assert rendered == (
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n"
        "<tool_response>\n409\n</tool_response><|im_end|>\n<|im_start|>user\nWhat is 12*34?<|im_end|>\n"
    )


def test_history_rewriting_template_strips_thinking_from_earlier_assistant_turns():
    tokenizer = build_tokenizer("qwen3")
    plain = tokenizer.chat_template
    tokenizer.chat_template = HISTORY_REWRITING_TEMPLATE
    first = {"role": "assistant", "content": "<think>\nmultiply</think>\n\nLet me compute.", "tool_calls": [HF_CALC]}
    last = {"role": "assistant", "content": "<think>done</think>408"}
    conversation = [USER, first, TOOL, last]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert "multiply" not in rendered and "<think>done</think>408<|im_end|>" in rendered
    assert "<|im_start|>assistant\nLet me compute.\n<tool_call>\n" in rendered
    # the last message keeps its thinking, so the turn the model just sampled renders as it was sampled
    assert tokenizer.apply_chat_template(conversation[:2], tokenize=False).count("<think>\nmultiply</think>") == 1
    # without thinking it renders as the plain ChatML template
    no_think = [USER, {**first, "content": "Let me compute."}, TOOL, last]
    assert rendered == tokenizer.apply_chat_template(no_think, tokenize=False)
    tokenizer.chat_template = plain
    assert tokenizer.apply_chat_template(no_think, tokenize=False) == rendered


def test_every_style_is_covered():
    """The tables above cover every template of tests/archs.py."""
    assert {_STYLES[s][4] for s in _STYLES} == {_STYLES[_FAMILY_STYLE[f]][4] for f in FAMILIES}
    assert {_style(f) for f in FAMILIES} == set(PLAIN_RENDERED) - {"tiny"} == set(TOOL_RENDERED) - {"tiny"}


def test_the_cached_builtin_model_is_keyed_by_its_template(tmp_path, monkeypatch):
    """A directory cached before the template changed is never served for the new template."""
    monkeypatch.setenv("OXRL_CACHE", str(tmp_path))
    built = []

    def fake_save(path, **kwargs):
        built.append(path)
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        return path

    monkeypatch.setattr(tiny, "save_tiny_model", fake_save)
    first = tiny.default_model_dir()
    assert tiny.default_model_dir() == first and built == [first]  # cached
    monkeypatch.setattr(tiny, "CHAT_TEMPLATE", tiny.CHAT_TEMPLATE.replace("<|end|>", "<|eot|>"))
    second = tiny.default_model_dir()
    assert second != first and built == [first, second]
