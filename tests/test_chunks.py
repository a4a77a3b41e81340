"""Lines travel in chunks (``batchery.batch_lines``, issue 37), with real ``batchery worker`` processes on the tiny
model and the real Redis:

1. a job's lines go out as chunk messages (several lines each, grouped by prefix), and every line gets exactly one
   record, in input order, the same records as lines sent one by one; the metrics count lines, not chunks;
2. lost-line recovery sees a chunk's lines as queued (and as held by a worker), and a chunk the broker lost is
   found and its lines queued again as their own messages;
3. a chunk delivered again (its worker SIGKILLed mid-chunk) is split into its lines' own messages, which run once;
4. a forged chunk (a line its job never queued, a wrong task id) is dead-lettered whole and never touches the job."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.request

import pytest
from conftest import redis_client, wait_for

from batchery.broker.publish import MessageBuilder
from batchery.contract.names import BATCH_LINES_TASK, CHUNK_JOB_HEADER, CHUNK_LINES_HEADER
from batchery.jobs import recover
from batchery.jobs.deadletter import DeadLetters

pytestmark = pytest.mark.integration


def rows(n: int, prefix: str = "r", max_tokens: int = 2) -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"say something {i}"}], "max_tokens": max_tokens},
        }
        for i in range(n)
    ]


def queued_messages(r, queue: str) -> list[dict]:
    return [json.loads(m) for m in reversed(r.lrange(queue, 0, -1))]


def kwargs_of(message: dict) -> dict:
    return json.loads(base64.b64decode(message["body"]))[1]


def test_a_job_travels_in_chunks_and_every_line_is_recorded_once_in_order(workers):
    q = workers.new_queue()
    c = workers.client(q)
    c.settings.batch.chunk_lines = 8
    r = redis_client(workers.broker)
    job = c.submit_batch(rows(50))
    msgs = queued_messages(r, q)
    chunks = [m for m in msgs if m["headers"]["task"] == BATCH_LINES_TASK]
    assert chunks and len(msgs) < 50, f"{len(msgs)} messages for 50 lines"
    carried = sorted(e["line"] for m in chunks for e in kwargs_of(m)["lines"])
    singles = sorted(kwargs_of(m)["line"] for m in msgs if m not in chunks)
    assert sorted(carried + singles) == list(range(1, 51)), "every line in exactly one message"
    assert all(len(kwargs_of(m)["lines"]) <= 8 for m in chunks)
    for m in chunks:
        lines = [e["line"] for e in kwargs_of(m)["lines"]]
        assert m["headers"][CHUNK_LINES_HEADER] == ",".join(map(str, lines)) and m["headers"][CHUNK_JOB_HEADER] == job
        assert m["headers"]["id"] == f"{job}-c{lines[0]}"
    assert len(c.jobs.pending_lines(job)) == 50, "the ledger keeps every line's own message"
    # recovery sees every line as queued: nothing is lost
    assert recover.queued_lines(r, q, [job])[job] == set(range(1, 51))

    w = workers.spawn(q)
    st = c.wait_batch(job, timeout=120)
    assert st.status == "completed" and st.request_counts.completed == 50
    records = list(c.batch_results(job))
    assert [rec["custom_id"] for rec in records] == [f"r-{i}" for i in range(50)]
    assert all(rec["error"] is None and rec["id"].startswith("batch_req_") for rec in records)
    assert [rec["response"]["request_id"] for rec in records] == [f"{job}-{n}" for n in range(1, 51)]
    assert w.count(r"batchery\.batch_lines\[") >= len(chunks)
    with urllib.request.urlopen(f"http://127.0.0.1:{w.health_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    task, success = r'(?=[^}]*task="batchery\.batch_line")', r'(?=[^}]*outcome="success")'
    pattern = r"^batchery_requests_total\{" + task + success + r"[^}]*\} (\S+)$"
    counted = re.search(pattern, text, re.M)
    assert counted and float(counted.group(1)) == 50, "each line of a chunk counts as a batch line"
    c.close()


def test_recovery_sees_a_held_chunk_and_requeues_a_lost_one_line_by_line(workers):
    q = workers.new_queue()
    c = workers.client(q)
    c.settings.batch.chunk_lines = 8
    r = redis_client(workers.broker)
    job = c.submit_batch(rows(16))
    msgs = r.lrange(q, 0, -1)
    assert len(msgs) == 2
    # a chunk a worker holds (kombu's unacked hash) is not lost either
    held = json.loads(msgs[0])
    r.hset("unacked", "test-tag-" + job, json.dumps([held, "", q]))
    try:
        lines = {e["line"] for e in kwargs_of(held)["lines"]}
        assert recover.held_lines(r, [job])[job] == lines
    finally:
        r.hdel("unacked", "test-tag-" + job)
    # the broker loses both chunks: recovery finds the 16 lines and queues them again as their own messages
    r.delete(q)
    assert recover.find_lost(c.jobs, r, job, q, confirm_s=0.1) == set(range(1, 17))
    assert recover.requeue(c.jobs, r, job, q, list(range(1, 17))) == 16
    assert sorted(kwargs_of(m)["line"] for m in queued_messages(r, q)) == list(range(1, 17))
    workers.spawn(q)
    st = c.wait_batch(job, timeout=120)
    assert st.status == "completed" and st.request_counts.completed == 16
    assert [rec["custom_id"] for rec in c.batch_results(job)] == [f"r-{i}" for i in range(16)]
    c.close()


def test_a_chunk_delivered_again_after_its_worker_died_is_split_and_runs_once(workers):
    q = workers.new_queue()
    slow = dict(BATCHERY_FAULTS="tokenize_delay:0.3", BATCHERY_VISIBILITY_TIMEOUT=8, BATCHERY_TASK_TIMEOUT=5,
                BATCHERY_MAX_TASK_TIMEOUT=5)  # fmt: skip
    a = workers.spawn(q, **slow)
    c = workers.client(q)
    c.settings.batch.chunk_lines = 16
    c.settings.visibility_timeout = 8
    job = c.submit_batch(rows(16))
    r = redis_client(workers.broker)
    wait_for(lambda: len(recover.held_lines(r, [job])[job]) == 16, 60, what="the worker to hold the chunk")
    time.sleep(1.0)  # its lines in the engine, being tokenized (0.3 s each)
    a.kill()  # SIGKILL: the chunk is held unacknowledged
    done_before = c.batch_status(job).request_counts.completed
    assert done_before < 16
    b = workers.spawn(q, BATCHERY_VISIBILITY_TIMEOUT=8, BATCHERY_TASK_TIMEOUT=5, BATCHERY_MAX_TASK_TIMEOUT=5)
    st = c.wait_batch(job, timeout=180)
    assert st.status == "completed" and st.request_counts.completed == 16 and st.request_counts.failed == 0
    records = list(c.batch_results(job))
    assert [rec["custom_id"] for rec in records] == [f"r-{i}" for i in range(16)], "exactly once, in order"
    assert b.count("delivered again") == 1, "the chunk was split, not run as one again"
    assert b.count(r"batchery\.batch_line\[") >= 16 - done_before
    c.close()


def test_a_forged_chunk_is_dead_lettered_whole_and_never_touches_the_job(workers):
    q = workers.new_queue()
    c = workers.client(q)
    c.settings.batch.chunk_lines = 1  # the job's own lines, one message each
    r = redis_client(workers.broker)
    job = c.submit_batch(rows(3, max_tokens=1))  # queued; no worker yet: the job is in progress
    builder = MessageBuilder(c.app, BATCH_LINES_TASK, q)
    body = rows(1, prefix="forged")[0]["body"]
    forged = {
        "a line the job never queued": (f"{job}-c9", [9]),
        "a wrong task id": (f"{job}-c2", [1, 2]),
    }
    for task_id, lines in forged.values():
        entries = [{"line": n, "custom_id": f"f{n}", "url": "/v1/chat/completions", "body": body} for n in lines]
        msg = builder.build(task_id, {"job": job, "lines": entries, "timeout": None, "priority": 0})
        r.rpush(q, msg)  # at the head: they run before the job's own lines
    w = workers.spawn(q)
    assert c.wait_batch(job, timeout=60).status == "completed"
    dl = DeadLetters(c.jobs.r, c.settings.deadletter.key_prefix)
    wait_for(
        lambda: sum(1 for e in dl.list(100) if e["id"] in {t for t, _ in forged.values()}) == 2,
        30,
        what="both forged chunks dead-lettered",
    )
    st = c.batch_status(job)
    assert st.request_counts.total == 3 and st.request_counts.completed == 3 and st.request_counts.failed == 0
    assert [rec["custom_id"] for rec in c.batch_results(job)] == ["r-0", "r-1", "r-2"]
    assert w.count("refused") >= 2
    time.sleep(0.5)
    c.close()
