"""The /v1/embeddings request body (issue 38): every input shape OpenAI takes, the limits, the errors' wording,
and the base64 encoding the openai SDK decodes."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from pydantic import ValidationError

from batchery.contract.schemas import EmbeddingRequest, describe_validation_error
from batchery.contract.schemas.embeddings import MAX_EMBEDDING_INPUTS, decode_vector, encode_vector


def _error(body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        EmbeddingRequest.model_validate(body)
    return describe_validation_error(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("one text", [["one text"]]),
        (["a", "b"], [["a", "b"]]),
        ([1, 2, 3], [[[1, 2, 3]]]),
        ([[1, 2], [3]], [[[1, 2], [3]]]),
    ],
)
def test_input_shapes(value, expected):
    assert [EmbeddingRequest.model_validate({"input": value, "model": "m"}).input] == expected


def test_defaults_and_fields():
    req = EmbeddingRequest.model_validate(
        {"input": "x", "model": "text-embedding-3-small", "encoding_format": "base64", "dimensions": 256, "user": "u1"}
    )
    assert (req.encoding_format, req.dimensions, req.user, req.truncate_prompt_tokens) == ("base64", 256, "u1", None)
    plain = EmbeddingRequest.model_validate({"input": "x", "encoding_format": None, "dimensions": None})
    assert plain.encoding_format == "float" and plain.dimensions is None  # null is unset, as in OpenAI
    assert EmbeddingRequest.model_validate({"input": "x", "truncate_prompt_tokens": -1}).truncate_prompt_tokens == -1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": ""}, "input[0] is an empty string"),
        ({"input": ["a", ""]}, "input[1] is an empty string"),
        ({"input": []}, "input must not be an empty list"),
        ({"input": [[1], []]}, "input[1] is an empty list of token ids"),
        ({"input": [[1, -2]]}, "input[0] must be a list of non-negative integer token ids"),
        ({"input": ["a", [1]]}, "input mixes strings and token-id lists; send one kind per request"),
        ({"input": ["a", {"x": 1}]}, "input[1] must be a string or a list of token ids"),
        ({"input": [["a"]]}, "input[0] must be a list of non-negative integer token ids"),
        ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input has 2049 items; at most 2048 inputs are allowed"),
        ({"input": 5}, "input must be a string, a list of strings"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format: Input should be 'float' or 'base64'"),
        ({"input": "x", "dimensions": 0}, "dimensions: Input should be greater than or equal to 1"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1, or -1"),
        ({"input": "x", "messages": []}, "messages: unknown field"),
        ({"model": "m"}, "input: Field required"),
    ],
)
def test_refusals_name_the_problem(body, message):
    assert message in _error(body)


def test_a_chat_body_is_refused_on_the_embeddings_url():
    err = _error({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert "input: Field required" in err and "messages: unknown field" in err


def test_at_the_limit_is_accepted():
    assert len(EmbeddingRequest.model_validate({"input": ["x"] * MAX_EMBEDDING_INPUTS}).input) == 2048


def test_base64_is_float32_little_endian_as_the_sdk_decodes():
    vec = [0.5, -1.25, 3.0e-3, 1.0]
    b64 = encode_vector(vec, "base64")
    assert isinstance(b64, str)
    decoded = np.frombuffer(base64.b64decode(b64), dtype="float32")  # what openai's SDK does
    assert decoded.tolist() == pytest.approx(vec, rel=1e-7)
    assert decode_vector(b64) == pytest.approx(vec, rel=1e-7)
    assert encode_vector(vec, "float") is vec
