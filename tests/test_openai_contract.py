"""Real OpenAI batch files (issue 14): the shapes that OpenAI's documentation, its cookbook and public
code use parse; every OpenAI field is supported, ignored (accepted, no effect) or refused with a
message naming it; /v1/responses requests become chat requests and chat completions become
Response objects that the OpenAI SDK itself parses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai.types.chat as oa_chat
import openai.types.responses as oa_responses
import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import ValidationError

from batchery.contract import batch
from batchery.contract.batch import BatchLine, LineError, parse_line
from batchery.contract.responses import (
    RESPONSES_IGNORED_FIELDS,
    RESPONSES_REFUSED_FIELDS,
    Response,
    ResponsesRequest,
    response_from_chat,
)
from batchery.contract.schemas import (
    CHAT_IGNORED_FIELDS,
    CHAT_REFUSED_FIELDS,
    MAX_SCHEMA_CHARS,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    ToolCall,
    Usage,
    describe_validation_error,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "batch.md"
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
SENTIMENT = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number"},
    },
    "required": ["sentiment", "confidence"],
    "additionalProperties": False,
}


def chat(**fields) -> dict:
    return {"model": "gpt-4o-mini", "messages": HI, **fields}


def chat_error(body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    return describe_validation_error(info.value)


def responses_error(body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate(body)
    return describe_validation_error(info.value)


def as_line(body: dict, url: str = batch.CHAT_URL, custom_id: str = "req-1") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# -- the ten shapes of the issue, as batch lines -------------------------------------------------------
COOKBOOK_JSON_MODE = {
    "model": "gpt-4o-mini",
    "temperature": 0.1,
    "response_format": {"type": "json_object"},
    "messages": [
        {"role": "system", "content": 'Extract the movie\'s genre. Answer in JSON: {"genre": ...}'},
        {"role": "user", "content": "Two hobbits carry a ring to a volcano."},
    ],
}
JSON_SCHEMA_STRICT = {
    "model": "gpt-4o-2024-08-06",
    "messages": [{"role": "user", "content": "Classify: I love this product!"}],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "sentiment_result", "strict": True, "schema": SENTIMENT},
    },
    "max_completion_tokens": 200,
}
SHAPES = {
    "cookbook json mode": (batch.CHAT_URL, COOKBOOK_JSON_MODE),
    "json_schema strict": (batch.CHAT_URL, JSON_SCHEMA_STRICT),
    "n=3": (batch.CHAT_URL, chat(n=3, temperature=0.8, seed=7, max_tokens=20)),
    "tools auto": (batch.CHAT_URL, chat(tools=[WEATHER, TIME], tool_choice="auto")),
    "tools required": (batch.CHAT_URL, chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)),
    "tools named": (
        batch.CHAT_URL,
        chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    ),
    "store and metadata": (batch.CHAT_URL, chat(store=True, metadata={"project": "qa", "run": "7"}, user="u-1")),
    "responses string input": (
        batch.RESPONSES_URL,
        {"model": "gpt-4.1-mini", "input": "Write a haiku about queues.", "instructions": "Be brief."},
    ),
    "responses list input": (
        batch.RESPONSES_URL,
        {
            "model": "gpt-4.1-mini",
            "input": [
                {"role": "developer", "content": "Answer in one word."},
                {"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
            ],
            "max_output_tokens": 16,
            "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": SENTIMENT, "strict": True}},
        },
    ),
    "logit_bias": (batch.CHAT_URL, chat(logit_bias={"50256": -100, "1234": 5}, max_tokens=8)),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_issue_shapes_parse_as_batch_lines(name):
    url, body = SHAPES[name]
    out = parse_line(as_line(body, url), 3, set())
    assert isinstance(out, BatchLine), out
    assert (out.url, out.body) == (url, body)


def test_the_shapes_mean_what_openai_means():
    s = ChatCompletionRequest.model_validate(COOKBOOK_JSON_MODE).sampling()
    assert s["structured_outputs"] == {"json_object": True} and s["temperature"] == 0.1
    strict = ChatCompletionRequest.model_validate(JSON_SCHEMA_STRICT).sampling()
    assert strict["structured_outputs"] == {"json": SENTIMENT} and strict["max_tokens"] == 200
    assert ChatCompletionRequest.model_validate(SHAPES["n=3"][1]).sampling()["n"] == 3
    auto = ChatCompletionRequest.model_validate(SHAPES["tools auto"][1])
    assert auto.engine_tool_choice() == "auto" and not auto.forces_tool_call
    assert [t["function"]["name"] for t in auto.engine_tools()] == ["get_weather", "get_time"]
    assert auto.sampling()["structured_outputs"] is None  # the tool-call constraint is the worker's to add
    required = ChatCompletionRequest.model_validate(SHAPES["tools required"][1])
    assert required.forces_tool_call and required.parallel_tool_calls is False
    named = ChatCompletionRequest.model_validate(SHAPES["tools named"][1])
    assert named.engine_tool_choice() == {"type": "function", "function": {"name": "get_weather"}}
    assert named.forces_tool_call
    plain = ChatCompletionRequest.model_validate(chat()).sampling()
    assert ChatCompletionRequest.model_validate(SHAPES["store and metadata"][1]).sampling() == plain
    assert ChatCompletionRequest.model_validate(SHAPES["logit_bias"][1]).sampling()["logit_bias"] == {
        50256: -100.0,
        1234: 5.0,
    }
    r = ResponsesRequest.model_validate(SHAPES["responses string input"][1]).to_chat()
    assert r.engine_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write a haiku about queues."},
    ]
    r = ResponsesRequest.model_validate(SHAPES["responses list input"][1]).to_chat()
    assert [m["role"] for m in r.engine_messages()] == ["developer", "user"]
    assert r.sampling()["max_tokens"] == 16 and r.sampling()["temperature"] == 0
    assert r.sampling()["structured_outputs"] == {"json": SENTIMENT}


def test_every_constraint_the_contract_gives_compiles_in_the_engine(tiny_model_dir):
    """What the boundary accepts, the grammar engine compiles (the real xgrammar on the tiny tokenizer)."""
    from transformers import AutoTokenizer

    from batchery.engine.sampling import SamplingParams
    from batchery.engine.structured import GrammarCache

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cache = GrammarCache(tok, len(tok))
    bodies = [
        COOKBOOK_JSON_MODE,
        JSON_SCHEMA_STRICT,
        chat(structured_outputs={"regex": "[0-9]{3}"}),
        chat(structured_outputs={"choice": ["yes", "no"]}),
        chat(structured_outputs={"json": json.dumps(SENTIMENT), "disable_any_whitespace": True}),
        chat(guided_json=SENTIMENT, guided_decoding_backend="xgrammar"),
        chat(guided_regex="(cat|dog)s?"),
        chat(guided_choice=["positive", "negative"]),
        chat(guided_grammar='root ::= "a" | "b"'),
    ]
    for body in bodies:
        params = SamplingParams(**{**ChatCompletionRequest.model_validate(body).sampling(), "max_tokens": 8})
        assert params.structured is not None
        cache.compile(params.structured)
    completion = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a", "b"]})
    assert SamplingParams(**completion.sampling()).structured.kind == "choice"


def test_embeddings_lines_are_taken_and_moderations_say_they_are_not_served():
    out = parse_line(as_line({"model": "text-embedding-3-small", "input": "hi"}, "/v1/embeddings"), 4, set())
    assert not isinstance(out, LineError) and out.url == batch.EMBEDDINGS_URL and out.line == 4
    bad = parse_line(as_line({"model": "text-embedding-3-small", "input": ""}, "/v1/embeddings"), 5, set())
    assert isinstance(bad, LineError) and bad.code == batch.INVALID_BODY
    assert "input[0] is an empty string" in bad.message
    out = parse_line(as_line({"model": "omni-moderation-latest", "input": "hi"}, "/v1/moderations"), 6, set())
    assert isinstance(out, LineError) and out.code == batch.UNSUPPORTED_URL and out.line == 6
    assert out.message.startswith("moderations are not served: Batchery runs no moderation model; supported: ")
    assert batch.CHAT_URL in out.message and batch.EMBEDDINGS_URL in out.message


# -- the field policy, table-driven ------------------------------------------------------------------------
# (field, a value OpenAI's docs use, what the parsed request must show)
CHAT_SUPPORTED = {
    "messages": HI,
    "model": "gpt-4o-mini",
    "max_tokens": 9,
    "max_completion_tokens": 9,
    "temperature": 0.2,
    "top_p": 0.5,
    "n": 2,
    "stop": ["\n"],
    "seed": 1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logprobs": True,
    "top_logprobs": 2,
    "logit_bias": {"17": 3},
    "response_format": {"type": "json_object"},
    "tools": [WEATHER],
    "tool_choice": "required",
    "parallel_tool_calls": True,
    "stream": False,
}
CHAT_IGNORED = {
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "user": "user-1",
    "safety_identifier": "hash-1",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
    "stream_options": {"include_usage": True},
    "reasoning_effort": "low",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "the old text"},
    "parallel_tool_calls": False,
    "modalities": ["text"],
    "guided_decoding_backend": "xgrammar",
}
CHAT_REFUSED = {  # field -> (value, words the message must have)
    "guided_whitespace_pattern": (" ", "send structured_outputs.json_layout"),
    "stream": (True, "not supported"),
    "modalities": (["text", "audio"], 'only ["text"]'),
    "audio": ({"voice": "alloy", "format": "wav"}, "text models"),
    "functions": ([WEATHER["function"]], "send tools"),
    "function_call": ("auto", "send tool_choice"),
    "web_search_options": ({}, "hosted tools"),
    "moderation": ({"model": "omni-moderation-latest"}, "moderation"),
}


def test_every_field_of_the_openai_sdk_is_classified():
    """Each Chat Completions field the installed OpenAI SDK knows is supported, ignored or refused
    by name here; none falls through to the generic unknown-field error."""
    known = set(CHAT_SUPPORTED) | set(CHAT_IGNORED) | set(CHAT_REFUSED)
    assert set(CompletionCreateParamsBase.__annotations__) - known == set()
    known = set(RESPONSES_SUPPORTED) | set(RESPONSES_IGNORED) | set(RESPONSES_REFUSED)
    assert set(ResponseCreateParamsBase.__annotations__) - known == set()


@pytest.mark.parametrize("field", list(CHAT_SUPPORTED))
def test_supported_chat_fields_are_accepted(field):
    body = {"messages": HI, field: CHAT_SUPPORTED[field]}
    if field == "top_logprobs":
        body["logprobs"] = True
    if field in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = [WEATHER]
    ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize("field", list(CHAT_IGNORED))
def test_ignored_chat_fields_change_nothing(field):
    base = ChatCompletionRequest.model_validate({"messages": HI})
    req = ChatCompletionRequest.model_validate({"messages": HI, field: CHAT_IGNORED[field]})
    assert req.sampling() == base.sampling()
    assert req.engine_messages() == base.engine_messages() and req.engine_tools() is None
    assert field in CHAT_IGNORED_FIELDS  # and it is documented (test_the_docs_list_every_field)


@pytest.mark.parametrize("field", list(CHAT_REFUSED))
def test_refused_chat_fields_name_the_field_and_why(field):
    value, words = CHAT_REFUSED[field]
    msg = chat_error({"messages": HI, field: value})
    assert f"{field}: " in msg and words in msg, msg
    if field != "stream" and field != "modalities":
        assert field in CHAT_REFUSED_FIELDS
        ChatCompletionRequest.model_validate({"messages": HI, field: None})  # null asks for nothing


def test_nulls_mean_not_set_and_unknown_fields_stay_refused():
    req = ChatCompletionRequest.model_validate(
        {"messages": HI, "temperature": None, "n": None, "max_tokens": None, "tools": None, "audio": None}
    )
    assert req.sampling() == ChatCompletionRequest.model_validate({"messages": HI}).sampling()
    msg = chat_error({"messages": HI, "temprature": 0.5})
    assert msg == (
        'invalid request body: temprature: unknown field (a typo? see "OpenAI compatibility" in docs/batch.md '
        "for the fields Batchery takes)"
    )
    assert "messages: " in chat_error({"messages": None})
    assert "unknown field" in chat_error({"messages": HI, "best_of": 2})  # a Completions field


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"n": 17}, "n must be from 1 to 16, got 17"),
        ({"n": 17}, "OpenAI allows up to 128"),
        ({"n": 0}, "n must be from 1 to 16"),
        ({"logit_bias": {"a": 1}}, "logit_bias: logit_bias keys must be token ids"),
        ({"logit_bias": {"-1": 1}}, "token ids"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias['5'] must be a number from -100 to 100"),
        ({"logit_bias": {"5": True}}, "from -100 to 100"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "at most 1024 entries"),
        ({"logit_bias": [1]}, "object of token ids"),
        (
            {"response_format": {"type": "json_object"}, "guided_json": SENTIMENT},
            "one output constraint per request, got response_format (json_object) and guided_json",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
            "got structured_outputs and guided_choice",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"structured_outputs": {}}, "got none"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn: unknown field"),
        ({"guided_choice": []}, "guided_choice must be a non-empty list"),
        ({"guided_choice": ["a", ""]}, "non-empty strings"),
        ({"guided_regex": ""}, "guided_regex must not be empty"),
        ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json must be a JSON schema object"),
        ({"response_format": {"type": "regex"}}, "does not match any of the expected tags"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: Field required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
            "response_format.json_schema.name: String should match pattern",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema: Field required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"d": "x" * MAX_SCHEMA_CHARS}},
                }
            },
            f"the limit is {MAX_SCHEMA_CHARS}",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tool 0 has type 'custom'"),
        ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "String should match pattern"),
        ({"tools": [WEATHER] * 2}, "function names must be unique; 'get_weather'"),
        ({"tools": [TIME] * 129}, "at most 128 tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            'must be a JSON schema of type "object"',
        ),
        ({"tool_choice": "auto"}, "tool_choice is only allowed when tools are specified"),
        ({"tool_choice": "required", "tools": []}, "tool_choice is only allowed when tools are specified"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice names function 'get_time', which is not in tools (get_weather)",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
            "tool_choice of type 'allowed_tools' is not supported",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice: Input should be 'none', 'auto' or 'required'"),
    ],
)
def test_bad_new_fields_have_clear_errors(fields, needle):
    msg = chat_error({"messages": HI, **fields})
    assert needle in msg, msg


def test_tool_choice_none_and_empty_tools_ask_for_nothing():
    assert ChatCompletionRequest.model_validate(chat(tool_choice="none")).engine_tool_choice() == "none"
    req = ChatCompletionRequest.model_validate(chat(tools=[], tool_choice="none"))
    assert req.engine_tools() is None
    shown = ChatCompletionRequest.model_validate(chat(tools=[WEATHER], tool_choice="none"))
    assert shown.engine_tools() is not None and not shown.forces_tool_call  # OpenAI shows them anyway


def test_engine_tools_are_openai_function_tools_with_parameters():
    req = ChatCompletionRequest.model_validate(chat(tools=[WEATHER, TIME]))
    assert req.engine_tools() == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather in a city",
                "parameters": WEATHER["function"]["parameters"],
            },
        },
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "The time now",
                "parameters": {"type": "object", "properties": {}},  # OpenAI: omitted means no parameters
            },
        },
    ]


# -- messages ------------------------------------------------------------------------------------------
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_HISTORY = [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp": 21}'},
]


def test_tool_history_reaches_the_template():
    req = ChatCompletionRequest.model_validate(chat(messages=TOOL_HISTORY, tools=[WEATHER]))
    assert req.engine_messages()[2:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_abc"},
    ]
    odd = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    msgs = ChatCompletionRequest.model_validate(
        chat(messages=[*HI, {"role": "assistant", "tool_calls": [odd, {**CALL, "id": "c2"}]}])
    ).engine_messages()
    assert [c["function"]["arguments"] for c in msgs[1]["tool_calls"]] == ["not json", {"city": "Paris"}]


def test_text_parts_refusals_and_cache_hints():
    req = ChatCompletionRequest.model_validate(
        chat(
            messages=[
                {"role": "system", "content": [{"type": "text", "text": "Be kind.", "prompt_cache_breakpoint": {}}]},
                {"role": "user", "content": "Help me do something bad."},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
                {"role": "assistant", "content": None, "refusal": "No."},
                {"role": "user", "content": [{"type": "text", "text": "ok"}]},
            ]
        )
    )
    assert [m["content"] for m in req.engine_messages()] == [
        "Be kind.",
        "Help me do something bad.",
        "I can't help with that.",
        "No.",
        "ok",
    ]


@pytest.mark.parametrize(
    "message, needle",
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
            "messages.0.content: content parts of type 'image_url' are not supported: Batchery serves text models",
        ),
        (
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
            "'input_audio' are not supported: Batchery serves text models",
        ),
        (
            {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]},
            "'file' are not supported: Batchery serves text models",
        ),
        ({"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}, "this message takes 'text' parts"),
        ({"role": "function", "name": "f", "content": "1"}, "role 'function' is OpenAI's legacy form"),
        ({"role": "tool", "content": "1"}, "a tool message needs tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id is only allowed on tool messages"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "tool_calls is only allowed on assistant messages"),
        ({"role": "assistant", "audio": {"id": "audio_1"}}, "messages.0.audio: audio is not supported"),
        ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, "send tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{**CALL, "type": "custom", "custom": {}}]},
            "messages.0.tool_calls.0",
        ),
    ],
)
def test_bad_messages_have_clear_errors(message, needle):
    msg = chat_error({"messages": [message]})
    assert needle in msg, msg


# -- responses: what the worker shapes, checked by the OpenAI SDK -------------------------------------------
def _chat_completion(choices: list[ChatChoice], prompt: int = 12, completion: int = 9) -> ChatCompletion:
    return ChatCompletion(
        id="chatcmpl-t1",
        created=1_700_000_000,
        model="smollm2-135m-instruct",
        choices=choices,
        usage=Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=4),
        ),
    )


WEATHER_CALL = ToolCall(
    id="call_0123456789abcdef01234567", function={"name": "get_weather", "arguments": '{"city": "Paris"}'}
)


def test_shaped_chat_completions_parse_with_the_openai_sdk():
    three = _chat_completion(
        [ChatChoice(index=i, message=AssistantMessage(content=f"answer {i}"), finish_reason="stop") for i in range(3)]
    )
    parsed = oa_chat.ChatCompletion.model_validate(three.model_dump(mode="json"))
    assert [c.index for c in parsed.choices] == [0, 1, 2] and parsed.choices[2].message.content == "answer 2"
    calls = _chat_completion(
        [ChatChoice(message=AssistantMessage(content=None, tool_calls=[WEATHER_CALL]), finish_reason="tool_calls")]
    )
    parsed = oa_chat.ChatCompletion.model_validate(calls.model_dump(mode="json"))
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def _response(chat_completion: ChatCompletion, body: dict) -> dict:
    req = ResponsesRequest.model_validate(body)
    return response_from_chat(
        chat_completion.model_dump(mode="json"),
        response_id="resp_t1",
        created_at=1_700_000_000.5,
        model="smollm2-135m-instruct",
        req=req,
    )


def test_a_response_parses_with_the_openai_sdk_and_has_output_text():
    body = {"input": "Write a haiku.", "instructions": "Be brief.", "max_output_tokens": 50, "metadata": {"a": "b"}}
    done = _chat_completion([ChatChoice(message=AssistantMessage(content="Queues wait in line"), finish_reason="stop")])
    obj = _response(done, body)
    sdk = oa_responses.Response.model_validate(obj)
    assert sdk.output_text == "Queues wait in line" == Response.model_validate(obj).output_text
    assert (sdk.id, sdk.object, sdk.status, sdk.error, sdk.incomplete_details) == (
        "resp_t1",
        "response",
        "completed",
        None,
        None,
    )
    assert sdk.output[0].type == "message" and sdk.output[0].role == "assistant" and sdk.output[0].id == "msg_t1"
    assert sdk.output[0].content[0].annotations == []
    assert (sdk.usage.input_tokens, sdk.usage.output_tokens, sdk.usage.total_tokens) == (12, 9, 21)
    assert sdk.usage.input_tokens_details.cached_tokens == 4 and sdk.usage.output_tokens_details.reasoning_tokens == 0
    assert (sdk.instructions, sdk.max_output_tokens, sdk.temperature, sdk.top_p) == ("Be brief.", 50, 1.0, 1.0)
    assert (
        sdk.metadata == {"a": "b"} and sdk.tools == [] and sdk.tool_choice == "auto" and sdk.text.format.type == "text"
    )
    assert sdk.parallel_tool_calls is True


def test_a_response_cut_by_max_output_tokens_is_incomplete():
    cut = _chat_completion([ChatChoice(message=AssistantMessage(content='{"sentim'), finish_reason="length")])
    body = SHAPES["responses list input"][1]
    sdk = oa_responses.Response.model_validate(_response(cut, body))
    assert sdk.status == "incomplete" and sdk.incomplete_details.reason == "max_output_tokens"
    assert sdk.output[0].status == "incomplete" and sdk.output_text == '{"sentim'
    assert sdk.text.format.type == "json_schema" and sdk.text.format.name == "answer"
    assert sdk.text.format.schema_ == SENTIMENT and sdk.temperature == 0


def test_a_response_with_tool_calls_has_function_call_items():
    body = {
        "input": "Weather in Paris?",
        "tools": [
            {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"], "strict": True}
        ],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    calls = _chat_completion(
        [ChatChoice(message=AssistantMessage(content=None, tool_calls=[WEATHER_CALL]), finish_reason="tool_calls")]
    )
    sdk = oa_responses.Response.model_validate(_response(calls, body))
    assert sdk.status == "completed" and sdk.output_text == ""
    [item] = sdk.output
    assert (item.type, item.id, item.call_id, item.name, item.status) == (
        "function_call",
        "fc_t1_0",
        WEATHER_CALL.id,
        "get_weather",
        "completed",
    )
    assert json.loads(item.arguments) == {"city": "Paris"}
    assert sdk.tools[0].name == "get_weather" and sdk.tools[0].strict is True
    assert sdk.tool_choice.type == "function" and sdk.tool_choice.name == "get_weather"
    both = _chat_completion(
        [
            ChatChoice(
                message=AssistantMessage(content="Let me check.", tool_calls=[WEATHER_CALL]), finish_reason="tool_calls"
            )
        ]
    )
    sdk = oa_responses.Response.model_validate(_response(both, body))
    assert [i.type for i in sdk.output] == ["message", "function_call"] and sdk.output_text == "Let me check."


def test_response_logprobs_when_included():
    body = {"input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    req = ResponsesRequest.model_validate(body).to_chat()
    assert req.sampling()["logprobs"] == 1
    lp = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.5,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}],
            }
        ]
    }
    done = _chat_completion([ChatChoice(message=AssistantMessage(content="Hi"), finish_reason="stop", logprobs=lp)])
    sdk = oa_responses.Response.model_validate(_response(done, body))
    assert sdk.output[0].content[0].logprobs[0].token == "Hi" and sdk.top_logprobs == 1
    assert ResponsesRequest.model_validate({"input": "Hi", "top_logprobs": 1}).to_chat().sampling()["logprobs"] is None


# -- responses: the request ----------------------------------------------------------------------------------
def test_responses_items_become_chat_messages():
    req = ResponsesRequest.model_validate(
        {
            "model": "gpt-4.1",
            "instructions": "You help with the weather.",
            "input": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                    "id": "fc_1",
                    "status": "completed",
                },
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "18"}]},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "get_weather",
                    "description": "Weather",
                    "parameters": WEATHER["function"]["parameters"],
                    "strict": True,
                }
            ],
            "tool_choice": "required",
            "parallel_tool_calls": True,
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "store": False,
            "reasoning": {"effort": "low"},
            "truncation": "disabled",
        }
    )
    chat_req = req.to_chat()
    msgs = chat_req.engine_messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[2]["content"] == "Checking." and [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    assert msgs[4]["content"] == "18"
    assert chat_req.engine_tools() == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": WEATHER["function"]["parameters"],
            },
        }
    ]
    assert chat_req.forces_tool_call and chat_req.sampling()["structured_outputs"] is None
    lone = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            ]
        }
    ).to_chat()
    assert lone.engine_messages()[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}],
    }
    mode = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_object"}}}).to_chat()
    assert mode.sampling()["structured_outputs"] == {"json_object": True}


RESPONSES_SUPPORTED = {
    "input": "Hi",
    "model": "gpt-4.1-mini",
    "instructions": "Be brief.",
    "max_output_tokens": 16,
    "temperature": 0.3,
    "top_p": 0.9,
    "top_logprobs": 2,
    "text": {"format": {"type": "json_object"}},
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "include": ["message.output_text.logprobs"],
    "stream": False,
}
RESPONSES_IGNORED = {
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "default",
    "user": "u",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "in_memory",
    "prompt_cache_options": {"mode": "implicit"},
    "stream_options": {"include_obfuscation": False},
    "reasoning": {"effort": "minimal", "summary": "auto"},
    "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
    "max_tool_calls": 3,
    "parallel_tool_calls": False,
    "truncation": "disabled",
    "background": False,
    "background_options": {"completion_window": "2h"},
    "image": {"context_compression": "auto"},
}
RESPONSES_REFUSED = {
    "previous_response_id": ("resp_123", "no state"),
    "conversation": ("conv_123", "no state"),
    "prompt": ({"id": "pmpt_1"}, "stored at OpenAI"),
    "context_management": ([{"type": "compaction"}], "compaction"),
    "moderation": ({"model": "omni-moderation-latest"}, "moderation"),
    "access_programs": ({"cyber": "standard"}, "access programs"),
    "stream": (True, "not supported"),
    "background": (True, "keeps no responses"),
    "truncation": ("auto", "never drops input"),
}


@pytest.mark.parametrize("field", list(RESPONSES_SUPPORTED))
def test_supported_responses_fields_are_accepted(field):
    body = {"input": "Hi", field: RESPONSES_SUPPORTED[field]}
    if field in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = RESPONSES_SUPPORTED["tools"]
    ResponsesRequest.model_validate(body).to_chat()


@pytest.mark.parametrize("field", list(RESPONSES_IGNORED))
def test_ignored_responses_fields_change_nothing(field):
    base = ResponsesRequest.model_validate({"input": "Hi"}).to_chat()
    req = ResponsesRequest.model_validate({"input": "Hi", field: RESPONSES_IGNORED[field]}).to_chat()
    assert req.sampling() == base.sampling() and req.engine_messages() == base.engine_messages()
    assert field in RESPONSES_IGNORED_FIELDS


@pytest.mark.parametrize("field", list(RESPONSES_REFUSED))
def test_refused_responses_fields_name_the_field_and_why(field):
    value, words = RESPONSES_REFUSED[field]
    msg = responses_error({"input": "Hi", field: value})
    assert f"{field}: " in msg and words in msg, msg
    if field in RESPONSES_REFUSED_FIELDS:
        ResponsesRequest.model_validate({"input": "Hi", field: None})


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input": ""}, "the input is empty"),
        ({"input": []}, "input"),
        ({}, "input: Field required"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "content parts of type 'input_image' are not supported: Batchery serves text models",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
            "'input_file' are not supported: Batchery serves text models",
        ),
        (
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
            "input item 0: item_reference needs OpenAI's stored items",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input item 0 has type 'web_search_call'"),
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tool 0 has type 'web_search_preview'"),
        ({"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.name: Field required"),
        ({"input": "x", "tool_choice": {"type": "mcp", "server_label": "s"}}, "tool_choice of type 'mcp'"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice is only allowed when tools are specified"),
        (
            {
                "input": "x",
                "tools": [RESPONSES_SUPPORTED["tools"][0]],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice names function 'g', which is not in tools (f)",
        ),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.json_schema.name"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "seed": 1}, "seed: unknown field"),
        ({"input": [{"role": "user", "content": "x"}] * 1024, "instructions": "y"}, "the limit is 1024"),
    ],
)
def test_bad_responses_bodies_have_clear_errors(body, needle):
    msg = responses_error(body)
    assert needle in msg, msg


# -- the docs ------------------------------------------------------------------------------------------------
def _compat_section() -> str:
    text = DOCS.read_text()
    start = text.index("## OpenAI compatibility")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_docs_list_every_field():
    section = _compat_section()
    named = set(re.findall(r"`([a-z_.]+)`", section))
    for fields in (CHAT_IGNORED_FIELDS, CHAT_REFUSED_FIELDS, RESPONSES_IGNORED_FIELDS, RESPONSES_REFUSED_FIELDS):
        assert set(fields) - named == set()
    assert (set(CHAT_SUPPORTED) | set(RESPONSES_SUPPORTED)) - named == set()
