"""The batch line parser (batchery.contract.batch): every kind of bad line gets its code and line number, the
reader streams oversized lines without holding them, and (acceptance 5) a hypothesis fuzz: no input
crashes the parser, and every input becomes a request, an error record, or nothing (blank)."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchery.contract import batch
from batchery.contract.batch import (
    BatchLine,
    LineError,
    error_record,
    line_error_record,
    output_record,
    parse_line,
    parse_stream,
)
from batchery.contract.outcomes import Outcome

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
CODES = {
    batch.INVALID_JSON,
    batch.INVALID_LINE,
    batch.MISSING_CUSTOM_ID,
    batch.DUPLICATE_CUSTOM_ID,
    batch.UNSUPPORTED_METHOD,
    batch.UNSUPPORTED_URL,
    batch.INVALID_BODY,
    batch.LINE_TOO_LARGE,
}


def line(custom_id="a", method="POST", url="/v1/chat/completions", body=None, **extra) -> str:
    d = {"custom_id": custom_id, "method": method, "url": url, "body": CHAT if body is None else body, **extra}
    return json.dumps(d)


@pytest.mark.parametrize(
    "raw, code, needle",
    [
        ("{not json", batch.INVALID_JSON, "invalid JSON"),
        (b"\xff\xfe{}", batch.INVALID_JSON, "not valid UTF-8"),
        ('{"custom_id": "a", "x": NaN}', batch.INVALID_JSON, "NaN is not valid JSON"),
        ("[" * 5000, batch.INVALID_JSON, "nested too deeply"),
        ("[1, 2]", batch.INVALID_LINE, "expected a JSON object, got an array"),
        ('"just a string"', batch.INVALID_LINE, "got a string"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), batch.MISSING_CUSTOM_ID, "missing"),
        (line(custom_id=""), batch.MISSING_CUSTOM_ID, "must not be empty"),
        (line(custom_id=7), batch.MISSING_CUSTOM_ID, "got a number"),
        (line(custom_id="x" * 600), batch.MISSING_CUSTOM_ID, "limit is 512"),
        (line(method="GET"), batch.UNSUPPORTED_METHOD, 'got "GET"'),
        (line(url="/v1/moderations"), batch.UNSUPPORTED_URL, "moderations are not served"),
        (line(url="/v1/images/generations"), batch.UNSUPPORTED_URL, '"/v1/images/generations"'),
        (line(url=None), batch.UNSUPPORTED_URL, "got null"),
        (line(body=[1]), batch.INVALID_BODY, "body must be a JSON object"),
        (line(body={"messages": CHAT["messages"], "max_tokens": -1}), batch.INVALID_BODY, "max_tokens"),
        (line(body={"messages": []}), batch.INVALID_BODY, "messages"),
        (line(body={"messages": CHAT["messages"], "temperature": 9}), batch.INVALID_BODY, "temperature"),
        (line(url="/v1/completions", body={"prompt": "hi", "n": 17}), batch.INVALID_BODY, "n must be from 1 to 16"),
        (line(url="/v1/responses", body={"input": ""}), batch.INVALID_BODY, "input"),
        (line(body={**CHAT, "stream": True}), batch.INVALID_BODY, "stream is not supported"),
        (line(extra_field=1), batch.INVALID_LINE, "unknown field(s) 'extra_field'"),
    ],
)
def test_each_bad_line_gets_its_code_and_line_number(raw, code, needle):
    out = parse_line(raw, 7, set())
    assert isinstance(out, LineError), out
    assert (out.code, out.line) == (code, 7)
    assert needle in out.message


def test_custom_id_is_kept_on_errors_where_known():
    assert parse_line(line(custom_id="k", method="GET"), 1).custom_id == "k"
    assert parse_line("[]", 1).custom_id is None


@pytest.mark.parametrize("make_seen", [set, batch.SeenIds])
def test_valid_lines_and_duplicates(make_seen):
    seen = make_seen()
    ok = parse_line(line("a") + "\n", 1, seen)
    assert ok == BatchLine(1, "a", "/v1/chat/completions", CHAT)
    comp = parse_line(line("b", url="/v1/completions", body={"prompt": [1, 2, 3], "max_tokens": 2}), 2, seen)
    assert isinstance(comp, BatchLine) and comp.url == "/v1/completions"
    resp = parse_line(line("r", url="/v1/responses", body={"input": "hi", "max_output_tokens": 5}), 6, seen)
    assert isinstance(resp, BatchLine) and resp.url == batch.RESPONSES_URL
    dup = parse_line(line("a"), 3, seen)
    assert isinstance(dup, LineError) and dup.code == batch.DUPLICATE_CUSTOM_ID and dup.custom_id == "a"
    # a custom_id is taken by its first line even if that line is invalid: ids stay unique in the output
    bad = parse_line(line("c", method="PUT"), 4, seen)
    assert bad.code == batch.UNSUPPORTED_METHOD
    assert parse_line(line("c"), 5, seen).code == batch.DUPLICATE_CUSTOM_ID


@given(st.lists(st.text(min_size=1, max_size=12), max_size=400))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_seen_ids_answer_as_a_set_of_the_strings_does(ids):
    """Every id, unicode and lone surrogates included, found once added and never before; the table grows past its
    first 1,024 slots on the way."""
    seen, ref = batch.SeenIds(), set()
    for cid in ids + [f"n{i}" for i in range(800)]:
        assert (cid in seen) == (cid in ref)
        assert seen.add_new(cid) == (cid not in ref)
        ref.add(cid)
        assert cid in seen and len(seen) == len(ref)
    assert "\ud800never" not in seen and 7 not in seen


def test_seen_ids_hold_a_million_ids_in_a_third_of_a_set_of_them():
    import tracemalloc

    tracemalloc.start()
    try:
        seen = batch.SeenIds()
        for i in range(0, 1_000_000, 10):  # 100,000 ids, as a job's custom_ids look
            seen.add(f"request-{i}")
        table, _peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        ref = {f"request-{i}" for i in range(0, 1_000_000, 10)}
        as_set, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(f"request-{i}" in seen for i in range(0, 1_000_000, 10))
    assert not any(f"request-{i}" in seen for i in range(5, 1_000_000, 10))
    assert len(seen) == len(ref) == 100_000
    assert table * 3 < as_set - table, (table, as_set - table)


@pytest.mark.parametrize("raw", ["", "\n", "   \t \r\n", b"  \n"])
def test_blank_lines_are_ignored(raw):
    assert parse_line(raw, 1) is None


def test_stream_numbers_physical_lines_and_skips_oversized_ones_without_holding_them():
    limit = 1024
    huge = b'{"custom_id": "big", "pad": "' + b"x" * 50_000 + b'"}'
    data = b"\n".join(
        [
            line("a").encode(),
            b"",
            huge,
            line("b").encode(),
            b"x" * (limit + 1),  # just over
            b"  ",
            line("d").encode(),  # last line, no newline
        ]
    )
    items = list(parse_stream(io.BytesIO(data), limit))
    assert [(i.line, getattr(i, "code", "ok")) for i in items] == [
        (1, "ok"),
        (3, batch.LINE_TOO_LARGE),
        (4, "ok"),
        (5, batch.LINE_TOO_LARGE),
        (7, "ok"),
    ]
    assert f"has {len(huge)} bytes" in items[1].message and f"limit is {limit}" in items[1].message
    assert f"has {limit + 1} bytes" in items[3].message


def test_line_exactly_at_the_limit_is_accepted_with_crlf():
    limit = 1024
    short = line("a", body={"messages": [{"role": "user", "content": ""}]})
    at_limit = line("a", body={"messages": [{"role": "user", "content": "u" * (limit - len(short))}]})
    assert len(at_limit) == limit
    over = at_limit.replace('"a"', '"bb"')
    items = list(parse_stream(io.BytesIO(at_limit.encode() + b"\r\n" + over.encode() + b"\n"), limit))
    assert isinstance(items[0], BatchLine)
    assert (items[1].code, items[1].line) == (batch.LINE_TOO_LARGE, 2)
    assert parse_line(at_limit + "\r\n", 1, max_line_bytes=limit).custom_id == "a"
    assert parse_line(over, 1, max_line_bytes=limit).code == batch.LINE_TOO_LARGE


def test_records_have_the_openai_batch_shape():
    out = output_record("batch_abc", 3, "x", "req-1", {"object": "chat.completion"})
    assert out == {
        "id": "batch_req_abc_3",
        "custom_id": "x",
        "response": {"status_code": 200, "request_id": "req-1", "body": {"object": "chat.completion"}},
        "error": None,
    }
    err = line_error_record("batch_abc", LineError(4, None, batch.INVALID_JSON, "bad"))
    assert err == {
        "id": "batch_req_abc_4",
        "custom_id": None,
        "response": None,
        "error": {"code": "invalid_json", "message": "bad", "line": 4},
    }
    err = error_record(
        "batch_abc", 5, "y", Outcome.CONTEXT_LENGTH_EXCEEDED.value, "too long", status_code=400, request_id="r"
    )
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"] == {
        "message": "too long",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }
    assert err["error"] == {"code": "context_length_exceeded", "message": "too long", "line": 5}


# -- acceptance 5: fuzz ---------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "assistant", "robot"]), "content": json_values}
                ),
                max_size=3,
            )
        },
        optional={
            "max_tokens": json_values,
            "temperature": json_values,
            "stop": json_values,
            "n": json_values,
            "response_format": json_values,
            "tools": json_values,
            "tool_choice": json_values,
            "logit_bias": json_values,
            "guided_json": json_values,
            "metadata": json_values,
        },
    ),
    st.fixed_dictionaries({"prompt": json_values}, optional={"max_tokens": json_values, "logprobs": json_values}),
    st.fixed_dictionaries(
        {"input": json_values}, optional={"instructions": json_values, "text": json_values, "tools": json_values}
    ),
)
line_objects = st.fixed_dictionaries(
    {},
    optional={
        "custom_id": st.one_of(st.text(max_size=10), json_values),
        "method": st.sampled_from(["POST", "GET", "post", None]),
        "url": st.sampled_from(
            ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "", None]
        ),
        "body": bodies,
        "extra": json_values,
    },
)


def _check(out, raw_is_blank: bool, line_no: int) -> None:
    if out is None:
        assert raw_is_blank
        return
    assert isinstance(out, (BatchLine, LineError))
    assert out.line == line_no
    if isinstance(out, LineError):
        assert out.code in CODES and isinstance(out.message, str) and out.message
        json.dumps(line_error_record("batch_x", out))  # always serializable
    else:
        assert isinstance(out.custom_id, str) and out.custom_id and isinstance(out.body, dict)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(raw):
    _check(parse_line(raw, 1, set(), max_line_bytes=200), not raw.strip(), 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(line_objects)
def test_fuzz_line_shaped_objects(obj):
    raw = json.dumps(obj)
    _check(parse_line(raw, 2, set()), False, 2)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(line_objects.map(json.dumps).map(str.encode), st.binary(max_size=60)), max_size=12))
def test_fuzz_streams_give_one_item_per_non_blank_line(lines):
    lines = [ln.replace(b"\n", b" ").replace(b"\r", b" ") for ln in lines]
    items = list(parse_stream(io.BytesIO(b"\n".join(lines)), 256))
    expected = [n for n, ln in enumerate(lines, 1) if ln.strip()]
    assert [i.line for i in items] == expected
    for i in items:
        _check(i, False, i.line)
    ids = [i.custom_id for i in items if isinstance(i, BatchLine)]
    assert len(ids) == len(set(ids))
