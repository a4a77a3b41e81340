"""The Python client: local validation, bulk enqueue, typed results, async waits, clear errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from conftest import REPO, redis_client

from batchery.client import Client, InvalidRequest, ResultTimeout, TaskExpired
from batchery.contract.schemas import ChatCompletion

HI = [{"role": "user", "content": "hello world"}]


def test_client_module_is_light():
    code = (
        "import sys, batchery.client; heavy = [m for m in ('torch', 'transformers', 'batchery.engine.llm_engine') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_client_defaults_come_from_settings(monkeypatch):
    monkeypatch.setenv("BATCHERY_MODEL", "some/dir/Other-Model")
    c = Client(broker_url="redis://:pw@127.0.0.1:6379/13")
    assert c.queue == "batchery.other-model"
    assert c.settings.result_backend == "redis://:pw@127.0.0.1:6379/13"
    assert c.app.conf.task_serializer == "json" and c.app.conf.accept_content == ["json"]
    c.close()


def test_invalid_requests_fail_before_anything_is_enqueued(session_workers):
    q = session_workers.new_queue()
    c = session_workers.client(q)
    with pytest.raises(InvalidRequest, match="n must be from 1 to 16, got 17"):
        c.chat(HI, n=17)
    with pytest.raises(InvalidRequest, match="tool_choice is only allowed when tools are specified"):
        c.chat(HI, tool_choice="required")
    with pytest.raises(InvalidRequest, match="response_format"):
        c.chat(HI, response_format={"type": "xml"})
    with pytest.raises(InvalidRequest, match="max_output_tokens"):
        c.responses("hello world", max_output_tokens=0)
    with pytest.raises(InvalidRequest, match=r"request body #1: messages"):
        c.chat_many([HI, []])  # all or nothing: #0 is not enqueued either
    with pytest.raises(InvalidRequest, match="timeout"):
        c.complete("x", timeout=0)
    assert redis_client(c.settings.broker_url).llen(q) == 0
    c.close()


def test_chat_and_responses_send_the_openai_fields(session_workers):
    import base64
    import json

    q = session_workers.new_queue()
    c = session_workers.client(q)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    c.chat(
        HI,
        response_format={"type": "json_object"},
        n=2,
        tools=tools,
        tool_choice="none",
        logit_bias={5: -100, "7": 2.5},
        max_tokens=4,
    )
    c.responses("hello world", instructions="be brief", max_output_tokens=8)
    r = redis_client(c.settings.broker_url)
    sent = [json.loads(m) for m in reversed(r.lrange(q, 0, -1))]  # kombu pushes on the left
    assert [m["headers"]["task"] for m in sent] == ["batchery.chat_completion", "batchery.responses"]
    bodies = [json.loads(base64.b64decode(m["body"]))[1]["body"] for m in sent]
    assert bodies[0] == {
        "messages": HI,
        "response_format": {"type": "json_object"},
        "n": 2,
        "tools": tools,
        "tool_choice": "none",
        "logit_bias": {"5": -100, "7": 2.5},  # JSON keys, as OpenAI sends them
        "max_tokens": 4,
    }
    assert bodies[1] == {"input": "hello world", "instructions": "be brief", "max_output_tokens": 8}
    c.close()


def test_result_timeout_when_no_worker_serves_the_queue(session_workers):
    c = session_workers.client(session_workers.new_queue())
    h = c.chat(HI, max_tokens=1)
    t0 = time.monotonic()
    with pytest.raises(ResultTimeout, match="within 0.3 s"):
        h.get(timeout=0.3)
    with pytest.raises(ResultTimeout):
        asyncio.run(h.aget(timeout=0.3))
    assert time.monotonic() - t0 < 3
    c.close()


def test_chat_many_enqueues_fast(session_workers):
    q = session_workers.new_queue()
    c = session_workers.client(q)
    t0 = time.perf_counter()
    handles = c.chat_many([HI] * 500, max_tokens=4)
    elapsed = time.perf_counter() - t0
    assert len({h.id for h in handles}) == 500 and redis_client(c.settings.broker_url).llen(q) == 500
    print(f"chat_many: 500 requests enqueued in {elapsed:.3f} s ({500 / elapsed:.0f}/s)")
    c.close()


def test_aget_gathers_results(tiny_client):
    handles = tiny_client.chat_many([HI] * 4, max_tokens=4, ignore_eos=True)

    async def collect():
        return await asyncio.gather(*(h.aget(timeout=60) for h in handles))

    results = asyncio.run(collect())
    assert all(isinstance(r, ChatCompletion) and r.usage.completion_tokens == 4 for r in results)
    assert [r.id for r in results] == [f"chatcmpl-{h.id}" for h in handles]


def test_expired_task_is_not_started(tiny_client, tiny_worker):
    past = datetime.now(UTC) - timedelta(seconds=5)
    h = tiny_client.chat(HI, max_tokens=4, expires=past)
    with pytest.raises(TaskExpired, match="expired"):
        h.get(timeout=30)
    assert f"[{h.id}] succeeded" not in tiny_worker.log()
