"""Tool calls (issue 14, item 3): the ``<tool_call>`` parser, the constraint that guarantees a call
(compiled by the real xgrammar and checked with its matcher), the system prompt for templates
without tool support, and chat rendering through a template without tool support (the tiny model's)
and one with it."""

from __future__ import annotations

import json
import re

import pytest
from tiny_model import build_tokenizer

from batchery.contract.tools import parse_tool_calls, tool_call_constraint, tools_system_prompt
from batchery.engine.chat_template import messages_without_tool_support, render_chat, template_supports_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters schema: no arguments
TOOLS = [WEATHER, TIME]


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# -- parse_tool_calls ---------------------------------------------------------------------------------
def test_parse_one_call_only():
    content, calls = parse_tool_calls(call("get_weather", '{"city": "Paris", "days": 2}'))
    assert content is None
    assert len(calls) == 1
    c = calls[0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function"
    assert c["function"]["name"] == "get_weather"
    assert isinstance(c["function"]["arguments"], str)
    assert json.loads(c["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_parse_calls_with_text_around_them_and_unique_ids():
    text = "Let me look.\n" + call("get_weather", '{"city": "Oslo", "days": 1}') + "\n" + call("get_time", "{}")
    content, calls = parse_tool_calls(text + "\nDone.")
    assert content == "Let me look.\n\n\nDone."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_tolerates_parameters_string_arguments_and_lists():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": [1, 2]}
    _, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert calls[0]["function"]["arguments"] == "{}"
    _, calls = parse_tool_calls(
        '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]</tool_call>'
    )
    assert [c["function"]["name"] for c in calls] == ["f", "g"]


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "arguments": {"a": 1',  # unclosed: max_tokens hit inside the call
    ],
)
def test_malformed_blocks_stay_in_the_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_malformed_block_beside_a_good_one_stays_in_the_content():
    bad = "<tool_call>oops</tool_call>"
    content, calls = parse_tool_calls(bad + call("get_time", "{}"))
    assert content == bad and [c["function"]["name"] for c in calls] == ["get_time"]


# -- tools_system_prompt ----------------------------------------------------------------------------
def test_system_prompt_lists_the_tools_and_the_format():
    prompt = tools_system_prompt(TOOLS)
    inner = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    listed = [json.loads(line) for line in inner.splitlines()]
    assert listed == [{"type": "function", "function": t["function"]} for t in TOOLS]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    flat = {"type": "function", "name": "get_time"}  # the Responses API's flat tool shape
    assert '"function": {"type": "function", "name": "get_time"}' in tools_system_prompt([flat])


# -- tool_call_constraint, compiled and run by the real xgrammar ----------------------------------------
@pytest.fixture(scope="module")
def compiler():
    xgr = pytest.importorskip("xgrammar")
    return xgr, xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(build_tokenizer()))


def accepts(compiler, constraint: dict, text: str) -> bool:
    """Whether the constraint's grammar matches ``text`` completely."""
    xgr, c = compiler
    m = xgr.GrammarMatcher(c.compile_structural_tag(json.dumps(constraint)))
    return m.accept_string(text) and m.is_completed()


def test_no_constraint_for_auto_none_or_no_choice():
    assert tool_call_constraint(TOOLS, "auto") is None
    assert tool_call_constraint(TOOLS, "none") is None
    assert tool_call_constraint(TOOLS, None) is None
    assert tool_call_constraint(None, "auto") is None


def test_required_forces_one_or_more_calls_matching_the_schemas(compiler):
    d = tool_call_constraint(TOOLS, "required")
    good = call("get_weather", '{"city": "Paris", "days": 3}')
    assert accepts(compiler, d, good)
    assert accepts(compiler, d, call("get_time", "{}"))
    assert accepts(compiler, d, good + "\n" + call("get_time", "{}"))
    assert not accepts(compiler, d, "The weather is nice.")  # text is no call
    assert not accepts(compiler, d, "")  # at least one call
    assert not accepts(compiler, d, call("get_news", "{}"))  # not a tool
    assert not accepts(compiler, d, call("get_weather", '{"city": "Paris"}'))  # a required argument missing
    assert not accepts(compiler, d, call("get_weather", '{"city": "Paris", "days": 9}'))  # out of range
    assert not accepts(compiler, d, call("get_weather", '{"city": 5, "days": 1}'))
    assert accepts(compiler, d, call("get_weather", '{ "city": "Paris" ,"days": 3 }'))
    assert not accepts(compiler, d, call("get_weather", '{\n    "city": "Paris", "days": 3}'))  # no runs of whitespace
    single = tool_call_constraint(TOOLS, "required", parallel=False)
    assert accepts(compiler, single, good) and not accepts(compiler, single, good + "\n" + good)


def test_a_named_function_forces_exactly_that_call(compiler):
    for choice in (
        {"type": "function", "function": {"name": "get_weather"}},
        {"type": "function", "name": "get_weather"},
    ):
        d = tool_call_constraint(TOOLS, choice)
        good = call("get_weather", '{"city": "Rome", "days": 1}')
        assert accepts(compiler, d, good)
        assert not accepts(compiler, d, call("get_time", "{}"))
        assert not accepts(compiler, d, good + "\n" + good)


def test_a_choice_the_tools_cannot_satisfy_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'get_news', which is not among the tools \(get_weather, get_time\)"):
        tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "get_news"}})
    with pytest.raises(ValueError, match="needs tools"):
        tool_call_constraint([], "required")


def test_parse_reads_back_what_the_constraint_forces(compiler):
    text = call("get_weather", '{"city": "Lima", "days": 5}') + "\n" + call("get_time", "{}")
    assert accepts(compiler, tool_call_constraint(TOOLS, "required"), text)
    content, calls = parse_tool_calls(text)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Lima", "days": 5},
        {},
    ]


# -- render_chat ------------------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "weather in paris"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "warm"},
]


def ids_of(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def text_of(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def test_without_tool_support_tools_go_into_the_system_message():
    tok = build_tokenizer()  # the tiny model's template renders only roles and contents
    assert template_supports_tools(tok) is False
    assert tok._batchery_template_tools is False  # asked once per tokenizer
    msgs = messages_without_tool_support(HISTORY, TOOLS)
    assert msgs[0] == {"role": "system", "content": tools_system_prompt(TOOLS)}
    assert msgs[1] == HISTORY[0]
    assert msgs[2]["role"] == "assistant" and "tool_calls" not in msgs[2]
    assert parse_tool_calls(msgs[2]["content"])[1][0]["function"]["arguments"] == '{"city": "Paris", "days": 1}'
    assert msgs[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>",
    }
    assert len(msgs) == 4
    assert render_chat(tok, HISTORY, TOOLS) == ids_of(tok, msgs)
    assert HISTORY[1]["tool_calls"]  # the caller's messages are untouched


def test_without_tool_support_a_system_message_is_merged():
    msgs = messages_without_tool_support([{"role": "system", "content": "be brief"}, HISTORY[0]], [TIME])
    assert msgs[0] == {"role": "system", "content": "be brief\n\n" + tools_system_prompt([TIME])}
    assert msgs[1:] == [HISTORY[0]]
    tok = build_tokenizer()
    plain = [{"role": "user", "content": "hello world"}]
    assert render_chat(tok, plain) == ids_of(tok, plain)


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system tools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<|im_end|> {% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }} {{ message.content }}"
    "{% for c in message.tool_calls or [] %} call {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def test_with_tool_support_tools_and_history_go_to_the_template():
    tok = build_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    assert template_supports_tools(tok) is True
    ids = render_chat(tok, HISTORY, TOOLS)
    assert ids == ids_of(tok, HISTORY, tools=TOOLS)
    text = text_of(tok, HISTORY, tools=TOOLS)
    assert text.startswith("<|im_start|>system tools: get_weather get_time <|im_end|>")
    assert 'call get_weather {"city": "Paris", "days": 1}' in text and "<|im_start|>tool sunny" in text
    assert "<tool_call>" not in text and "# Tools" not in text


@pytest.mark.parametrize(("parallel", "one_call"), [(None, True), (False, True), (True, False)])
def test_a_forced_call_is_one_call_unless_parallel_calls_are_asked_for(parallel, one_call):
    """tool_choice "required": one call by default (a small model offered more keeps calling until
    max_tokens); several only with parallel_tool_calls true."""
    from batchery.contract.schemas import ChatCompletionRequest
    from batchery.tasks.chat import chat_generation

    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "tool_choice": "required"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    gen = chat_generation(ChatCompletionRequest.model_validate(body))
    tag = gen.sampling["structured_outputs"]["structural_tag"]
    assert tag["format"]["stop_after_first"] is one_call
    assert gen.tools == ChatCompletionRequest.model_validate(body).engine_tools()
