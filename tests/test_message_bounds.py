"""Hand-written broker messages are checked, never trusted (issue 13 item 12).

Anyone with access to the broker can publish a ``batchery.batch_line`` message. One for a line the
job never queued (0, negative, beyond the last line, a blank line of the input), with a custom_id out of
bounds, a body that is no object, an unsupported url or a task id that is not ``{job}-{line}`` is logged
(its values cut short) and dead-lettered: it writes no record, moves no counter and cannot finish the job
early. Chat content parts are bounded in number, and an empty part counts toward the character limit."""

from __future__ import annotations

import json
import uuid

import pytest
from conftest import wait_for
from pydantic import ValidationError

from batchery.contract.names import BATCH_LINE_TASK
from batchery.contract.schemas import MAX_CONTENT_PARTS, MAX_TEXT_CHARS, ChatCompletionRequest
from batchery.jobs.deadletter import INVALID_MESSAGE, DeadLetters


def _parts(n: int, text: str = "") -> list[dict]:
    return [{"type": "text", "text": text}] * n


def test_content_parts_are_bounded_in_number():
    ok = {"messages": [{"role": "user", "content": _parts(MAX_CONTENT_PARTS, "a")}]}
    assert ChatCompletionRequest.model_validate(ok).engine_messages()[0]["content"] == "a" * MAX_CONTENT_PARTS
    with pytest.raises(ValidationError, match="at most 1024 content parts"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": _parts(200_000)}]})
    spread = {"messages": [{"role": "user", "content": _parts(MAX_CONTENT_PARTS // 2 + 1)}] * 2}
    with pytest.raises(ValidationError, match="1026 content parts; the limit is 1024"):
        ChatCompletionRequest.model_validate(spread)


def test_empty_content_parts_count_toward_the_character_limit():
    full = {"role": "user", "content": "a" * (MAX_TEXT_CHARS - 1)}
    assert ChatCompletionRequest.model_validate({"messages": [full, {"role": "user", "content": _parts(1, "b")}]})
    with pytest.raises(ValidationError, match=f"{MAX_TEXT_CHARS + 1} characters"):
        ChatCompletionRequest.model_validate({"messages": [full, {"role": "user", "content": _parts(2)}]})


def test_hand_written_batch_line_messages_never_touch_the_job(tiny_worker, tiny_client):
    c, q, store = tiny_client, tiny_worker.queue, tiny_client.jobs
    job = f"batch_forged{uuid.uuid4().hex[:10]}"
    store.create(job, queue=q, model=None)
    with store.r.pipeline(transaction=False) as p:  # as the submitter: lines 1 and 3 queued, line 2 blank
        store.ledger_in(p, job, [(1, "{}"), (3, "{}")])
        store.queue_chunk(p, job, 2, 3)
        p.execute()
    assert store.end_submit(job, 2, 3) == "in_progress"
    huge = "C" * 100_000
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    good = {"job": job, "line": 1, "custom_id": "one", "url": "/v1/chat/completions", "body": body}
    forged = {
        "line 0": {"line": 0},
        "a negative line": {"line": -1},
        "beyond the last line": {"line": 4},
        "a line never queued (blank)": {"line": 2},
        "a line that is a string": {"line": "1"},
        "a custom_id too long": {"custom_id": huge},
        "a body that is no object": {"line": 3, "body": "hello"},
        "an unsupported url": {"line": 3, "url": "/v1/moderations"},
        "a priority out of range": {"line": 3, "priority": 42},
    }
    ids = {}
    for n, (name, change) in enumerate(forged.items()):
        kwargs = {**good, **change}
        # the two that pass every check of their own reach the job's checks only with a task id of ours
        in_range = name in ("beyond the last line", "a line never queued (blank)")
        ids[name] = f"{job}-{kwargs['line']}" if in_range else f"{job}-forged{n}"
        c.app.send_task(BATCH_LINE_TASK, kwargs=kwargs, task_id=ids[name], queue=q, ignore_result=True)
    wrong_id = f"{job}-1-forged"  # a good message under an id that is not {job}-{line}
    c.app.send_task(BATCH_LINE_TASK, kwargs=good, task_id=wrong_id, queue=q, ignore_result=True)
    sent = [*ids.values(), wrong_id]
    for task_id in sent:
        tiny_worker.wait_for_log(rf"batch_line\[{task_id}\] succeeded", 60)

    status = store.status(job)
    assert status.status == "in_progress", status
    assert (status.request_counts.total, status.request_counts.completed, status.request_counts.failed) == (2, 0, 0)
    assert store.r.hlen(store.keys(job)[1]) == 0, store.r.hgetall(store.keys(job)[1])  # no record
    assert store.r.hlen(store.keys(job)[2]) == 0  # no lease
    settings = c.settings.deadletter
    dl = DeadLetters(store.r, settings.key_prefix)
    try:
        for task_id in sent:
            entry = dl.get(task_id)
            assert entry is not None and entry["reason"] == INVALID_MESSAGE, (task_id, entry)
        assert "beyond the last line of" in dl.get(f"{job}-4")["message"]
        assert "never queued" in dl.get(f"{job}-2")["message"]
        assert f"must be {job}-1" in dl.get(wrong_id)["message"]
        assert "C" * 1000 not in tiny_worker.log()  # the custom_id is cut short in every log line

        # the real message of line 1 still runs, once
        c.app.send_task(BATCH_LINE_TASK, kwargs=good, task_id=f"{job}-1", queue=q, ignore_result=True)
        wait_for(lambda: store.status(job).request_counts.completed == 1, 60, what="line 1 to complete")
        record = json.loads(store.r.hget(store.keys(job)[1], "1"))
        assert record["custom_id"] == "one" and record["response"]["status_code"] == 200
        assert store.status(job).status == "in_progress"  # line 3 still to come
    finally:
        for task_id in sent:
            dl.remove(task_id)
        store.delete(job)
