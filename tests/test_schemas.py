"""The message contract: request bodies are validated with clear errors; responses are OpenAI-shaped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from batchery.contract.schemas import (
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    describe_validation_error,
)
from batchery.engine.sampling import SamplingParams

HI = [{"role": "user", "content": "Hi"}]


def error_of(schema, body) -> str:
    with pytest.raises(ValidationError) as info:
        schema.model_validate(body)
    return describe_validation_error(info.value)


def test_minimal_chat_body_defaults():
    req = ChatCompletionRequest.model_validate({"messages": HI})
    assert req.engine_messages() == [{"role": "user", "content": "Hi"}]
    s = req.sampling()
    assert s["max_tokens"] is None  # fill the context, as OpenAI does
    assert s["temperature"] == 1.0 and s["logprobs"] is None and s["stop"] == []


def test_chat_body_maps_every_sampling_field():
    body = {
        "model": "whatever",
        "messages": HI,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "stop": "END",
        "seed": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logprobs": True,
        "top_logprobs": 3,
        "n": 2,
        "logit_bias": {"7": -100, "8": 2.5},
        "response_format": {"type": "json_object"},
        "ignore_eos": True,
        "min_tokens": 2,
        "stop_token_ids": [5],
    }
    s = ChatCompletionRequest.model_validate(body).sampling()
    assert s == dict(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=3,
        stop=["END"],
        stop_token_ids=[5],
        ignore_eos=True,
        min_tokens=2,
        logprobs=3,
        n=2,
        logit_bias={7: -100.0, 8: 2.5},
        structured_outputs={"json_object": True},
    )
    SamplingParams(**s)  # the engine accepts it as is


def test_text_content_parts_are_joined():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert req.engine_messages()[0]["content"] == "ab"


def test_max_completion_tokens_alias():
    req = ChatCompletionRequest.model_validate({"messages": HI, "max_completion_tokens": 9})
    assert req.sampling()["max_tokens"] == 9
    assert "disagree" in error_of(ChatCompletionRequest, {"messages": HI, "max_tokens": 1, "max_completion_tokens": 2})


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": HI, "n": 17}, "n must be from 1 to 16"),
        ({"messages": HI, "n": 0}, "n must be from 1 to 16"),
        ({"messages": HI, "stream": True}, "stream is not supported"),
        ({"messages": []}, "messages"),
        ({}, "messages: Field required"),
        ({"messages": HI, "temperature": 3}, "temperature"),
        ({"messages": HI, "top_p": 0}, "top_p"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs requires logprobs"),
        ({"messages": HI, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": HI, "stop": [""]}, "stop"),
        ({"messages": HI, "stop": ["x"] * 17}, "at most 16 stop strings"),
        ({"messages": HI, "tool": []}, "tool: unknown field"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content: content parts of type 'image_url' are not supported: Batchery serves text models",
        ),
        ({"messages": HI, "seed": -1}, "seed"),
    ],
)
def test_bad_chat_bodies_have_clear_errors(body, needle):
    msg = error_of(ChatCompletionRequest, body)
    assert msg.startswith("invalid request body: ")
    assert needle in msg


def test_sizes_are_bounded():
    assert "messages" in error_of(ChatCompletionRequest, {"messages": HI * (MAX_MESSAGES + 1)})
    big = "x" * (MAX_TEXT_CHARS // 2 + 1)
    msg = error_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": big}] * 2})
    assert "limit" in msg
    assert "prompt" in error_of(CompletionRequest, {"prompt": "x" * (MAX_TEXT_CHARS + 1)})


def test_completion_bodies():
    req = CompletionRequest.model_validate({"prompt": "Once upon a time"})
    assert req.sampling()["max_tokens"] == 16  # the OpenAI Completions default
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3], "logprobs": 2}).sampling()["logprobs"] == 2
    assert "one prompt per request" in error_of(CompletionRequest, {"prompt": ["a"]})
    assert "empty" in error_of(CompletionRequest, {"prompt": ""})
    assert "non-negative integers" in error_of(CompletionRequest, {"prompt": [1, -2]})
    assert "echo is not supported" in error_of(CompletionRequest, {"prompt": "a", "echo": True})
    assert "n must be from 1 to 16" in error_of(CompletionRequest, {"prompt": "a", "n": 17})
    three = CompletionRequest.model_validate({"prompt": "a", "n": 3, "best_of": 3, "guided_choice": ["x", "y"]})
    assert three.sampling()["n"] == 3 and three.sampling()["structured_outputs"] == {"choice": ["x", "y"]}
    assert "best_of must equal n" in error_of(CompletionRequest, {"prompt": "a", "n": 2, "best_of": 4})


def test_response_models_parse_openai_shapes():
    chat = ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "system_fingerprint": "extra fields are kept",
        }
    )
    assert chat.choices[0].message.content == "hi" and chat.usage.total_tokens == 4
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    calls = ChatCompletion.model_validate(
        {
            "id": "chatcmpl-2",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )
    msg = calls.choices[0].message
    assert msg.content is None and msg.tool_calls is not None and msg.tool_calls[0].function.name == "f"
    comp = Completion.model_validate(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )
    assert comp.choices[0].text == "x"


sampling_bodies = st.fixed_dictionaries(
    {"messages": st.just(HI), "logprobs": st.booleans()},
    optional={
        "max_tokens": st.integers(1, 1 << 17),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(-1, 1000),
        "min_p": st.floats(0, 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 10, exclude_min=True),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=8), max_size=16),
        "top_logprobs": st.integers(0, 20),
        "min_tokens": st.integers(0, 100),
        "stop_token_ids": st.lists(st.integers(0, 10**6), max_size=8),
        "n": st.integers(1, 16),
        "logit_bias": st.dictionaries(
            st.integers(0, 10**6).map(str), st.floats(-100, 100) | st.integers(-100, 100), max_size=8
        ),
        "response_format": st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": True}},
            ]
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(sampling_bodies)
def test_every_valid_body_is_valid_for_the_engine(body):
    """What the boundary accepts, the engine accepts: no request can pass validation and then be
    refused by SamplingParams (which would surface late, inside the worker)."""
    if "top_logprobs" in body and not body["logprobs"]:
        body = {**body, "logprobs": True}
    s = ChatCompletionRequest.model_validate(body).sampling()
    s["max_tokens"] = s["max_tokens"] or 1
    SamplingParams(**s)
