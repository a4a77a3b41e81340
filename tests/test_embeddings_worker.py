"""/v1/embeddings through a real worker of the real all-MiniLM-L6-v2 (issue 38): the Client's embed, batch lines
(chunked and one by one), the openai SDK's shapes, the vectors the engine gives offline, and each refusal as a
clear per-line error (too long, empty, too many inputs, a wrong ``dimensions``, a chat line sent to the embedding
model's worker)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from batchery.contract.errors import InvalidRequest
from batchery.contract.names import EMBEDDING_MODEL, EMBEDDINGS_TASK

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TIMEOUT = 120


@pytest.fixture(scope="module")
def offline():
    from batchery.engine.llm import LLM

    return LLM(EMBEDDING_MODEL, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def emb_worker(session_workers):
    w = session_workers.spawn(BATCHERY_MODEL=EMBEDDING_MODEL, BATCHERY_ENGINE__MAX_MODEL_LEN="512")
    return w, session_workers.client(w.queue)


def test_client_embed_matches_offline(emb_worker, offline):
    _, client = emb_worker
    texts = ["The cat sat on the mat.", "  ünïcødé, 日本語  ", "The cat sat on the mat."]
    resp = client.embed(texts).get(timeout=TIMEOUT)
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.object == "list"
    assert [d.embedding for d in resp.data] == [o.embedding for o in offline.embed(texts)]  # same fp32 bits
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(offline.engine.encode(t)) for t in texts)
    b64 = client.embed("The cat sat on the mat.", encoding_format="base64").get(timeout=TIMEOUT)
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="float32")  # as the openai SDK decodes
    assert decoded.tolist() == pytest.approx(resp.data[0].embedding, abs=1e-7)
    ids = offline.engine.encode("token ids in")
    assert client.embed(ids).get(timeout=TIMEOUT).data[0].embedding == offline.embed(ids)[0].embedding


def test_client_refusals(emb_worker):
    _, client = emb_worker
    with pytest.raises(InvalidRequest, match=r"input\[1\] has 602 tokens; this model takes at most 256"):
        client.embed(["fine", "word " * 600]).get(timeout=TIMEOUT)
    cut = client.embed("word " * 600, truncate_prompt_tokens=-1).get(timeout=TIMEOUT)
    assert cut.usage.prompt_tokens == 256
    with pytest.raises(InvalidRequest, match="does not support dimensions"):
        client.embed("x", dimensions=64).get(timeout=TIMEOUT)
    with pytest.raises(InvalidRequest, match=r"input\[0\] is an empty string"):  # refused before it is sent
        client.embed("")
    with pytest.raises(InvalidRequest, match="at most 2048 inputs"):
        client.embed(["x"] * 2049)
    with pytest.raises(InvalidRequest, match="an embedding model: it takes /v1/embeddings requests only"):
        client.chat([{"role": "user", "content": "hi"}], max_tokens=4).get(timeout=TIMEOUT)


def test_embedding_task_on_a_chat_worker_names_its_kind(tiny_worker, tiny_client):
    h = tiny_client.app.send_task(EMBEDDINGS_TASK, args=[{"input": "hi"}], queue=tiny_worker.queue)
    with pytest.raises(Exception, match="a generative model: /v1/embeddings needs a worker of an embedding model"):
        h.get(timeout=TIMEOUT)


@pytest.mark.parametrize("chunk_lines", ["32", "1"])
def test_batch_file_of_embeddings(session_workers, offline, tmp_path, chunk_lines):
    w = session_workers.spawn(
        BATCHERY_MODEL=EMBEDDING_MODEL, BATCHERY_ENGINE__MAX_MODEL_LEN="512", BATCHERY_BATCH__CHUNK_LINES=chunk_lines
    )
    client = session_workers.client(w.queue)
    texts = [f"document {i}: " + "words of the corpus " * (i % 40) for i in range(60)]
    lines = [
        {"custom_id": f"d{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": t}}
        for i, t in enumerate(texts)
    ]
    lines += [
        {"custom_id": "long", "method": "POST", "url": "/v1/embeddings", "body": {"input": "word " * 600}},
        {"custom_id": "dims", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 8}},
        {"custom_id": "empty", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["a", ""]}},
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        },
        {
            "custom_id": "chatbody",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        },
    ]
    job = client.submit_batch(lines, timeout=60)
    st = client.wait_batch(job, timeout=4 * TIMEOUT)
    assert st.status == "completed" and st.request_counts.total == 65, st
    out = {r["custom_id"]: r for r in client.batch_results(job)}
    ref = offline.embed(texts)
    for i in range(60):
        body = out[f"d{i}"]["response"]["body"]
        assert "data" in body, out[f"d{i}"]
        assert body["data"][0]["embedding"] == ref[i].embedding, i
        assert body["usage"]["prompt_tokens"] == ref[i].num_prompt_tokens
    assert out["long"]["error"]["code"] == "context_length_exceeded"
    assert "input[0] has 602 tokens; this model takes at most 256" in out["long"]["error"]["message"]
    assert out["dims"]["error"]["code"] == "invalid_request"
    assert "does not support dimensions" in out["dims"]["error"]["message"]
    assert (
        out["empty"]["error"]["code"] == "invalid_body"
        and "input[1] is an empty string" in out["empty"]["error"]["message"]
    )
    assert out["chat"]["error"]["code"] == "invalid_request"
    assert "an embedding model: it takes /v1/embeddings requests only" in out["chat"]["error"]["message"]
    assert (
        out["chatbody"]["error"]["code"] == "invalid_body"
        and "messages: unknown field" in out["chatbody"]["error"]["message"]
    )
