"""Batch-job state in a real Redis (batchery.jobs.store) and the streaming submitter (batchery.jobs.submit), without
a worker: idempotent writes (acceptance 2), status transitions, cancel leases, repairs, chunked
submission with validation, job-level failures, and the bulk-published Celery messages.

Keys live under a per-test prefix in the test result DB; queues are per test; only those are
deleted afterwards."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid

import pytest
from conftest import TEST_BROKER_URL, TEST_RESULT_BACKEND, drop_queue_keys, redis_client

from batchery.broker.publish import MessageBuilder
from batchery.client import Client
from batchery.contract import batch
from batchery.contract.outcomes import Outcome
from batchery.contract.settings import Settings
from batchery.jobs.store import JobNotFound, JobStore

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def req(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, **body}}


@pytest.fixture()
def prefix(redis_urls):
    p = f"batchery-test-{uuid.uuid4().hex[:10]}"
    yield p
    r = redis_client(TEST_RESULT_BACKEND)
    keys = list(r.scan_iter(match=f"{p}:*"))
    if keys:
        r.delete(*keys)


@pytest.fixture()
def store(prefix) -> JobStore:
    return JobStore(redis_client(TEST_RESULT_BACKEND), prefix, ttl=600)


@pytest.fixture()
def client(prefix):
    queue = f"batchery-test-{uuid.uuid4().hex[:10]}"
    c = Client(
        settings=Settings(
            broker_url=TEST_BROKER_URL,
            result_backend=TEST_RESULT_BACKEND,
            queue=queue,
            # a message a line: these tests read the lines' messages on the queue (chunks: tests/test_chunks.py)
            batch={"key_prefix": prefix, "max_line_bytes": 4096, "ttl": 600, "chunk_lines": 1},
        )
    )
    yield c
    drop_queue_keys(redis_client(TEST_BROKER_URL), queue)
    c.close()


def queued(client) -> list[dict]:
    """The Celery messages on the client's queue, oldest first, decoded like a worker would."""
    raw = redis_client(TEST_BROKER_URL).lrange(client.queue, 0, -1)
    out = []
    for m in reversed(raw):
        msg = json.loads(m)
        args, kwargs, embed = json.loads(base64.b64decode(msg["body"]))
        out.append({"headers": msg["headers"], "properties": msg["properties"], "kwargs": kwargs})
    return out


def new_job(store: JobStore, total: int | None = None) -> str:
    job = f"batch_{uuid.uuid4().hex}"
    store.create(job, queue="q", model="m", metadata={"k": "v"})
    if total is not None:
        store.r.hset(store.key(job), "total", total)
        assert store.end_submit(job, total, total) == "in_progress"
    return job


def ok(job: str, line: int, tokens: int = 3) -> dict:
    return batch.output_record(
        job, line, f"c{line}", f"{job}-{line}", {"usage": {"prompt_tokens": 2, "completion_tokens": tokens}}
    )


# -- acceptance 2: idempotency ---------------------------------------------------------------------
def test_the_same_result_delivered_twice_counts_once(store):
    job = new_job(store, total=2)
    assert store.write(job, 1, ok(job, 1), False, 2, 3) == (True, "in_progress")
    assert store.write(job, 1, ok(job, 1, tokens=99), False, 2, 99) == (False, "in_progress")
    st = store.status(job)
    assert st.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 0}
    assert st.usage.completion_tokens == 3 and st.usage.prompt_tokens == 2
    assert [r["response"]["body"]["usage"]["completion_tokens"] for r in store.iter_results(job)] == [3]

    # eight concurrent deliveries of line 2 (a redelivery racing its original, say): one wins
    barrier = threading.Barrier(8)
    outcomes = []

    def deliver(i: int) -> None:
        barrier.wait()
        rec = (
            ok(job, 2) if i % 2 else batch.error_record(job, 2, "c2", Outcome.ENGINE_ERROR.value, "x", status_code=500)
        )
        outcomes.append(store.write(job, 2, rec, bool(i % 2 == 0), 2, 3))

    threads = [threading.Thread(target=deliver, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(new for new, _ in outcomes) == 1
    st = store.status(job)
    assert st.status == "completed" and st.num_done == 2 == st.request_counts.total
    assert len(list(store.iter_results(job))) == 2
    assert store.r.hlen(store.keys(job)[1]) == 2


def test_transitions_timestamps_and_ttl(store):
    job = new_job(store)
    st = store.status(job)
    assert st.status == "validating" and st.metadata == {"k": "v"} and st.created_at <= time.time()
    assert store.claim(job, 1, 60) == "run"  # lines may start while the file is still being read
    assert store.write(job, 1, ok(job, 1), False)[1] == "validating"  # not final before the total is
    assert store.end_submit(job, 2, 2) == "in_progress"
    assert store.write(job, 2, ok(job, 2), False) == (True, "completed")  # finalizing -> completed
    st = store.status(job)
    assert st.in_progress_at and st.finalizing_at and st.completed_at
    assert st.created_at <= st.started_at <= st.in_progress_at <= st.finalizing_at <= st.completed_at
    assert st.expires_at == pytest.approx(st.completed_at + 600, abs=1)
    for key in store.keys(job)[:2]:
        assert 0 < store.r.ttl(key) <= 600
    assert not store.r.exists(store.keys(job)[2])  # no leases left
    assert store.claim(job, 1, 60) == "done" and store.claim(job, 3, 60) == "completed"


def test_all_lines_done_before_the_submission_ends_completes_at_once(store):
    job = new_job(store)
    store.write(job, 1, batch.error_record(job, 1, None, batch.INVALID_JSON, "x"), True)
    assert store.end_submit(job, 1, 1) == "completed"
    assert store.status(job).request_counts.failed == 1


def test_cancel_waits_for_running_lines_then_is_cancelled(store):
    job = new_job(store, total=5)
    assert store.write(job, 1, ok(job, 1), False)[0]
    assert store.claim(job, 2, 60) == "run"
    assert store.claim(job, 3, 60) == "run"
    assert store.cancel(job) == "cancelling"
    assert store.claim(job, 4, 60) == "cancelling"  # not started: skipped
    assert store.release(job, 2) == "cancelling"  # aborted, no record
    new, status = store.write(job, 3, ok(job, 3), False)  # finished just in time: kept
    assert new and status == "cancelled"
    st = store.status(job)
    assert st.status == "cancelled" and st.cancelling_at <= st.cancelled_at
    assert st.request_counts.model_dump() == {"total": 5, "completed": 2, "failed": 0}
    assert [r["custom_id"] for r in store.iter_results(job)] == ["c1", "c3"]  # partial results
    assert store.cancel(job) == "cancelled"  # idempotent


def test_cancel_ignores_leases_of_dead_workers(store):
    job = new_job(store, total=3)
    assert store.claim(job, 1, -1) == "run"  # its deadline has passed: the worker is gone
    assert store.cancel(job) == "cancelled"


def test_cancel_of_an_ended_or_unknown_job(store):
    job = new_job(store, total=1)
    store.write(job, 1, ok(job, 1), False)
    assert store.cancel(job) == "completed"
    with pytest.raises(JobNotFound):
        store.cancel("batch_nope")
    with pytest.raises(JobNotFound):
        store.status("batch_nope")


def test_status_repairs_what_a_dead_process_left(store):
    stuck = new_job(store, total=1)
    store.write(stuck, 1, ok(stuck, 1), False)
    store.r.hset(store.key(stuck), mapping={"status": "finalizing", "finalizing_at": time.time() - 60})
    assert store.status(stuck).status == "completed"

    orphan = new_job(store)
    store.r.hset(store.key(orphan), mapping={"submit_beat": time.time() - 3600, "total": 4})
    st = store.status(orphan)
    assert st.status == "failed" and st.errors[0].code == "submission_interrupted"
    assert st.request_counts.total == 4


def test_results_come_in_input_order_across_chunks(store):
    job = new_job(store)
    for line in (9, 2, 7, 4, 1):
        store.write(job, line, ok(job, line), False)
    store.end_submit(job, 5, 10)
    assert [r["custom_id"] for r in store.iter_results(job, chunk=3)] == ["c1", "c2", "c4", "c7", "c9"]


def test_list_newest_first_and_drops_expired(store):
    a, b = new_job(store), new_job(store)
    assert [j.id for j in store.list(10)][:2] == [b, a]
    store.r.delete(store.key(a))
    assert a not in [j.id for j in store.list(10)]
    assert store.r.zscore(store.index_key, a) is None


# -- the submitter ----------------------------------------------------------------------------------
def test_submit_validates_streams_and_enqueues_valid_lines(client, tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [
        json.dumps(req("a")),
        "",
        "{oops",
        json.dumps(req("b", temperature=0)),
        json.dumps(req("a")),
        "x" * 5000,
        json.dumps({**req("c"), "url": "/v1/completions", "body": {"prompt": "hi"}}),
    ]
    path.write_text("\n".join(lines) + "\n")
    job = client.submit_batch(path, timeout=30, priority=0, metadata={"team": "qa"})
    st = client.batch_status(job)
    assert st.status == "in_progress" and st.input_file == str(path) and st.metadata == {"team": "qa"}
    assert st.request_counts.model_dump() == {"total": 6, "completed": 0, "failed": 3}
    errors = list(client.batch_results(job))
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [
        (3, "invalid_json"),
        (5, "duplicate_custom_id"),
        (6, "line_too_large"),
    ]
    msgs = queued(client)
    assert [m["kwargs"]["line"] for m in msgs] == [1, 4, 7]  # in input order, first out first
    m = msgs[0]
    assert m["headers"]["task"] == "batchery.batch_line" and m["headers"]["id"] == f"{job}-1"
    assert m["headers"]["ignore_result"] is True
    assert m["kwargs"] == {
        "job": job,
        "line": 1,
        "custom_id": "a",
        "url": "/v1/chat/completions",
        "body": CHAT,
        "timeout": 30.0,
        "priority": 0,
    }
    assert msgs[2]["kwargs"]["url"] == "/v1/completions"


def test_bulk_messages_match_what_celery_publishes(client):
    """The fast path writes what ``send_task`` through kombu would, ids and tags aside."""
    kwargs = {"job": "batch_x", "line": 1, "custom_id": "a", "url": "/v1/chat/completions", "body": CHAT}
    client.app.send_task("batchery.batch_line", kwargs=kwargs, task_id="tid", queue=client.queue, ignore_result=True)
    r = redis_client(TEST_BROKER_URL)
    reference = json.loads(r.rpop(client.queue))
    built = json.loads(MessageBuilder(client.app, "batchery.batch_line", client.queue).build("tid", kwargs))
    # the enqueue stamp for the worker's queue-wait metric: a tag, like the delivery tag
    assert abs(built["headers"].pop("batchery_enqueued_at") - time.time()) < 60
    for m in (reference, built):
        m["body"] = json.loads(base64.b64decode(m["body"]))
        m["properties"].pop("delivery_tag")
        m["properties"].pop("reply_to")
        for h in ("origin", "argsrepr", "kwargsrepr"):
            m["headers"].pop(h)
    assert built == reference


def test_priority_goes_to_the_transport_priority_queue(client):
    job = client.submit_batch([req("a")], priority=5)
    r = redis_client(TEST_BROKER_URL)
    assert r.llen(client.queue) == 0 and r.llen(f"{client.queue}\x06\x163") == 1
    assert client.batch_status(job).priority == 5


def test_iterables_of_dicts_and_lines(client):
    job = client.submit_batch([req("a"), json.dumps(req("b")), "", "[1]", b'{"custom_id": 5}'])
    st = client.batch_status(job)
    assert st.request_counts.model_dump() == {"total": 4, "completed": 0, "failed": 2}
    assert [(e["error"]["line"], e["error"]["code"]) for e in client.batch_results(job)] == [
        (4, "invalid_line"),
        (5, "missing_custom_id"),
    ]


def test_job_level_failures(client, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    st = client.batch_status(client.submit_batch(empty))
    assert st.status == "failed" and st.errors[0].code == "empty_file" and st.failed_at

    client.settings.batch.max_lines = 3
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(json.dumps(req(f"r{i}")) for i in range(5)))
    st = client.batch_status(client.submit_batch(big))
    assert st.status == "failed" and st.errors[0].code == "too_many_lines"
    assert queued(client) == []  # a file is counted first: nothing was enqueued
    st = client.batch_status(client.submit_batch(req(f"r{i}") for i in range(5)))  # an iterable fails on the way
    assert st.status == "failed" and st.errors[0].code == "too_many_lines"


def test_line_counting_for_the_limit(tmp_path):
    from batchery.jobs.submit import exceeds_max_lines

    path = tmp_path / "f.jsonl"
    path.write_bytes(b"a\n\n  \n" + b"x" * 200_000 + b"\nb\n\n")  # 3 non-blank lines, one of them long
    assert not exceeds_max_lines(path, 3) and exceeds_max_lines(path, 2)
    path.write_bytes(b"a\nb\nc")  # no final newline
    assert not exceeds_max_lines(path, 3) and exceeds_max_lines(path, 2)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (dict(timeout=0), "timeout must be a positive number"),
        (dict(priority=10), "priority must be an integer from 0"),
        (dict(metadata={"k": "v" * 600}), "metadata"),
    ],
)
def test_bad_job_options_are_refused_before_anything_is_created(client, bad, needle):
    from batchery.contract.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=needle):
        client.submit_batch([req("a")], **bad)
    assert client.list_batches() == []


def test_an_interrupted_submission_fails_the_job(client):
    from batchery.jobs.submit import make_submitter

    sub = make_submitter(client)
    sub.chunk_size = 1

    def lines():
        yield req("a")
        yield req("b")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sub.run(lines())
    st = client.batch_status(sub.job_id)
    assert st.status == "failed" and st.errors[0].code == "submission_interrupted"
    assert "after 2 request lines: KeyboardInterrupt" in st.errors[0].message
    assert st.request_counts.total == 2 == len(queued(client))  # what was queued is accounted for (and skipped)


def test_a_cancel_during_submission_stops_reading(client):
    from batchery.jobs.submit import make_submitter

    sub = make_submitter(client)
    sub.chunk_size = 2
    read = []

    def lines():
        for i in range(10):
            read.append(i)
            if i == 3:
                client.cancel_batch(sub.job_id)
            yield req(f"r{i}")

    job = sub.run(lines())
    st = client.batch_status(job)
    assert st.status == "cancelled"
    assert len(read) <= 6 and st.request_counts.total == len(read)
    assert len(queued(client)) <= 4
