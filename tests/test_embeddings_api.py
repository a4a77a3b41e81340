"""``POST /v1/embeddings`` and embeddings batches in ``batchery serve``, with the official ``openai`` SDK against a
real server in front of a real worker of all-MiniLM-L6-v2 (issue 38): ``client.embeddings.create`` unchanged (the
SDK asks for base64 and decodes it), the vectors of ``LLM.embed`` offline, each refusal a 400 naming the problem,
and files -> batches with ``endpoint="/v1/embeddings"`` -> output file."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from api_util import api_settings, openai_client, running_api  # noqa: E402

from batchery.contract.names import EMBEDDING_MODEL  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "sk-test-key-embeddings-1"


@pytest.fixture(scope="module")
def offline():
    from batchery.engine.llm import LLM

    return LLM(EMBEDDING_MODEL, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def sdk(session_workers, redis_urls, tmp_path_factory):
    w = session_workers.spawn(BATCHERY_MODEL=EMBEDDING_MODEL, BATCHERY_ENGINE__MAX_MODEL_LEN="512")
    settings = api_settings(redis_urls, tmp_path_factory.mktemp("api-emb"), queue=w.queue, keys=KEY)
    with running_api(settings) as base_url:
        yield openai_client(base_url, KEY)


def _f32(v) -> list[float]:
    return np.asarray(v, dtype="float32").tolist()


def test_embeddings_create(sdk, offline):
    texts = ["a first sentence", "  and a second one, ünïcødé  "]
    resp = sdk.embeddings.create(model="text-embedding-3-small", input=texts)  # the SDK sends base64, decodes it
    ref = offline.embed(texts)
    assert [d.index for d in resp.data] == [0, 1] and resp.object == "list"
    assert [_f32(d.embedding) for d in resp.data] == [_f32(o.embedding) for o in ref]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(o.num_prompt_tokens for o in ref)
    floats = sdk.embeddings.create(model="m", input="a first sentence", encoding_format="float")
    assert floats.data[0].embedding == ref[0].embedding  # JSON floats: the engine's fp32 values exactly
    ids = offline.engine.encode("token ids")
    assert _f32(sdk.embeddings.create(model="m", input=[ids]).data[0].embedding) == _f32(
        offline.embed(ids)[0].embedding
    )


@pytest.mark.parametrize(
    ("kwargs", "code", "message"),
    [
        (dict(input=["ok", "word " * 600]), "context_length_exceeded", "input[1] has 602 tokens"),
        (dict(input="x", dimensions=64), "invalid_request", "does not support dimensions"),
        (dict(input=["a", ""]), None, "input[1] is an empty string"),
        (dict(input=["x"] * 2049), None, "at most 2048 inputs"),
    ],
)
def test_refusals_are_400s(sdk, kwargs, code, message):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.embeddings.create(model="m", **kwargs)
    assert message in str(info.value)
    if code is not None:
        assert info.value.code == code


def test_a_chat_request_to_the_embedding_worker_names_its_kind(sdk):
    with pytest.raises(openai.BadRequestError, match="an embedding model: it takes /v1/embeddings requests only"):
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_an_embeddings_batch(sdk, offline, tmp_path):
    texts = [f"passage {i}: " + "the corpus to search " * (i % 30) for i in range(40)]
    lines = [
        {"custom_id": f"p{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": t}}
        for i, t in enumerate(texts)
    ]
    lines.append(
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
    )
    path = tmp_path / "emb.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with open(path, "rb") as f:
        file_id = sdk.files.create(file=f, purpose="batch").id
    batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts.completed == 40, batch
    assert batch.request_counts.failed == 1  # the chat line: not the batch's endpoint
    out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
    ref = offline.embed(texts)
    assert [r["custom_id"] for r in out] == [f"p{i}" for i in range(40)]
    assert [r["response"]["body"]["data"][0]["embedding"] for r in out] == [o.embedding for o in ref]
    errors = [json.loads(x) for x in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["chat"]
