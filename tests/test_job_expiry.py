"""A batch job's completion window (OpenAI's ``completion_window``), in the job store alone, on a real Redis and the
real submitter (no worker: the tests play the worker's part with ``claim`` and ``write``).

Lines not started when the window ends are not run: a claim after the end records the line ``batch_expired`` itself,
once; ``JobStore.expire`` records every pending line that is not running, in pieces, and may be called any number
of times; lines running when the window ended finish and keep their results; the job ends ``expired`` once every
line has a record, and the counts stay exact throughout."""

from __future__ import annotations

import json
import random
import threading
import uuid

import pytest
from conftest import TEST_BROKER_URL, TEST_RESULT_BACKEND, drop_queue_keys, redis_client, wait_for

from batchery.client import Client
from batchery.contract import batch
from batchery.contract.errors import InvalidRequest
from batchery.contract.settings import Settings
from batchery.jobs.store import JobStore
from batchery.jobs.submit import make_submitter

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
EXPIRED_MESSAGE = "the batch's completion window ended before this line started"


def req(cid: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def ok(job: str, line: int) -> dict:
    return batch.output_record(
        job, line, f"c{line}", f"{job}-{line}", {"usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    )


@pytest.fixture()
def prefix(redis_urls):
    p = f"batchery-test-exp-{uuid.uuid4().hex[:10]}"
    yield p
    r = redis_client(TEST_RESULT_BACKEND)
    keys = list(r.scan_iter(match=f"{p}:*"))
    if keys:
        r.delete(*keys)


@pytest.fixture()
def client(prefix):
    """A client on a queue no worker serves: lines wait in the queue until the test claims them."""
    queue = f"batchery-test-exp-{uuid.uuid4().hex[:10]}"
    c = Client(
        settings=Settings(
            broker_url=TEST_BROKER_URL,
            result_backend=TEST_RESULT_BACKEND,
            queue=queue,
            batch={"key_prefix": prefix, "max_line_bytes": 4096, "ttl": 600},
        )
    )
    yield c
    drop_queue_keys(redis_client(TEST_BROKER_URL), queue)
    c.close()


def submit(client: Client, n: int, window: float | None) -> str:
    return make_submitter(client).run([req(f"c{i}") for i in range(1, n + 1)], completion_window=window)


def wait_window(store: JobStore, job: str) -> None:
    ends = store.status(job).window_ends_at
    assert ends is not None
    wait_for(lambda: store.server_time() > ends, 10, what="the completion window to end (server time)")


def records(store: JobStore, job: str) -> dict[int, dict]:
    return {int(k): json.loads(v) for k, v in store.r.hgetall(store.keys(job)[1]).items()}


def assert_expired_record(rec: dict, job: str, line: int) -> None:
    assert rec == {
        "id": batch.record_id(job, line),
        "custom_id": f"c{line}",
        "response": None,
        "error": {"code": batch.BATCH_EXPIRED, "message": EXPIRED_MESSAGE, "line": line},
    }


def test_the_window_is_server_time_from_creation(client):
    job = submit(client, 2, 30)
    st = client.jobs.status(job)
    assert st.window_s == 30 and st.window_ends_at == pytest.approx(st.created_at + 30, abs=1e-3)
    assert st.status == "in_progress"
    assert client.jobs.claim(job, 1, 60, "c1") == "run"  # inside the window: it runs
    never = submit(client, 1, None)
    assert client.jobs.status(never).window_ends_at is None
    assert client.jobs.expire(never) == "in_progress"  # no window: nothing to expire
    assert client.jobs.claim(never, 1, 60, "c1") == "run"


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "24h", True])
def test_a_bad_window_is_refused_before_anything_is_created(client, bad):
    with pytest.raises(InvalidRequest, match="completion_window"):
        submit(client, 1, bad)
    assert client.jobs.r.zcard(client.jobs.index_key) == 0


def test_a_claim_after_the_window_records_batch_expired_once(client):
    store = client.jobs
    job = submit(client, 3, 0.3)
    assert store.claim(job, 1, 60, "c1") == "run"
    wait_window(store, job)
    assert store.claim(job, 2, 60, "c2") == "expired"  # the task skips it: nothing runs
    assert store.claim(job, 2, 60, "c2") == "done"  # a redelivery: already recorded, counted once
    assert_expired_record(records(store, job)[2], job, 2)
    st = store.status(job)
    assert st.status == "in_progress" and st.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 1}
    assert st.expired_lines == 1
    assert store.pending_lines(job) == {1, 3} and store.leased_lines(job) == {1}
    # the running line finishes after the window and keeps its result; the last claim ends the job
    assert store.write(job, 1, ok(job, 1), False) == (True, "in_progress")
    assert store.claim(job, 3, 60, "c3") == "expired"
    st = store.status(job)
    assert st.status == "expired" and st.expired_at >= st.window_ends_at
    assert st.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2} and st.expired_lines == 2
    assert st.expires_at == pytest.approx(st.expired_at + 600, abs=1)  # the TTL, from the end
    assert 0 < store.r.ttl(store.key(job)) <= 600
    assert not store.r.exists(*store.keys(job)[2:])  # no leases or ledger left
    assert [r["custom_id"] for r in store.iter_results(job)] == ["c1", "c2", "c3"]
    assert store.claim(job, 3, 60, "c3") == "done"


def test_expire_records_every_pending_line_once_and_running_lines_finish(client):
    store = client.jobs
    job = submit(client, 7, 0.3)
    assert store.write(job, 1, ok(job, 1), False)[0]  # done inside the window
    assert store.claim(job, 2, 60, "c2") == "run"  # running when the window ends
    assert store.claim(job, 3, -1, "c3") == "run"  # a lease whose worker died: not running any more
    assert store.expire(job) == "in_progress"  # before the window ends: nothing happens
    assert store.status(job).request_counts.failed == 0
    wait_window(store, job)

    assert store.expire(job, piece=2) == "in_progress"  # line 2 still runs
    recs = records(store, job)
    assert sorted(recs) == [1, 3, 4, 5, 6, 7]
    for line in (3, 4, 5, 6, 7):
        assert_expired_record(recs[line], job, line)
    st = store.status(job)
    assert st.request_counts.model_dump() == {"total": 7, "completed": 1, "failed": 5} and st.expired_lines == 5
    assert store.pending_lines(job) == {2} and store.leased_lines(job) == {2}

    assert store.expire(job) == "in_progress"  # twice: harmless
    assert store.claim(job, 5, 60, "c5") == "done"  # the queued message of an expired line is skipped
    assert store.status(job).request_counts.model_dump() == {"total": 7, "completed": 1, "failed": 5}

    assert store.write(job, 2, ok(job, 2), False) == (True, "expired")  # the running line finishes: the end
    st = store.status(job)
    assert st.status == "expired" and st.request_counts.model_dump() == {"total": 7, "completed": 2, "failed": 5}
    assert records(store, job)[2]["response"]["status_code"] == 200
    assert store.expire(job) == "expired"  # after the end too


def test_a_job_done_inside_its_window_completes(client):
    store = client.jobs
    job = submit(client, 2, 0.3)
    for line in (1, 2):
        assert store.claim(job, line, 60, f"c{line}") == "run"
    wait_window(store, job)
    assert store.expire(job) == "in_progress"  # both lines run: nothing to expire
    store.write(job, 1, ok(job, 1), False)
    assert store.write(job, 2, ok(job, 2), False) == (True, "completed")  # no line expired: completed
    assert store.status(job).expired_lines == 0


def test_cancel_after_the_window_still_cancels(client):
    store = client.jobs
    job = submit(client, 3, 0.3)
    assert store.claim(job, 1, 60, "c1") == "run"
    wait_window(store, job)
    assert store.cancel(job) == "cancelling"
    assert store.expire(job) == "cancelling"  # a cancelling job is left to the cancel
    assert store.claim(job, 2, 60, "c2") == "cancelling"
    assert store.release(job, 1) == "cancelled"
    st = store.status(job)
    assert st.status == "cancelled" and st.request_counts.failed == 0


def test_a_window_that_ends_during_the_submission(client, prefix):
    """Lines claimed or expired while the file is still being read: the job ends only once the total is known."""
    store = client.jobs
    job = "batch_" + uuid.uuid4().hex
    store.create(job, queue="q", model="m", window_s=0.3)
    with store.r.pipeline(transaction=False) as p:
        store.ledger_in(p, job, [(1, "m1"), (2, "m2")])
        store.queue_chunk(p, job, 2, 2)
        p.execute()
    wait_window(store, job)
    assert store.claim(job, 1, 60, "c1") == "expired"
    assert store.expire(job) == "validating"
    assert store.status(job).request_counts.model_dump() == {"total": 2, "completed": 0, "failed": 2}
    with store.r.pipeline(transaction=False) as p:  # the last chunk arrives after the window
        store.ledger_in(p, job, [(3, "m3")])
        store.queue_chunk(p, job, 1, 3)
        p.execute()
    assert store.end_submit(job, 3, 3) == "in_progress"
    assert store.expire(job) == "expired"
    assert store.status(job).request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    assert sorted(records(store, job)) == [1, 2, 3]


def test_claims_and_expires_racing_count_every_line_exactly_once(client):
    """Workers claiming (and finishing) lines while several API replicas call expire: one record per line."""
    store = client.jobs
    n = 300
    job = submit(client, n, 0.5)
    started = set(range(1, 41))
    for line in started:  # running when the window ends
        assert store.claim(job, line, 60, f"c{line}") == "run"
    wait_window(store, job)
    lines = list(range(41, n + 1))
    random.Random(0).shuffle(lines)
    answers: list[str] = []
    barrier = threading.Barrier(6)

    def worker(mine: list[int]) -> None:
        barrier.wait()
        for line in mine:
            answers.append(store.claim(job, line, 60, f"c{line}"))

    def finisher() -> None:
        barrier.wait()
        for line in sorted(started):
            store.write(job, line, ok(job, line), False)

    def replica() -> None:
        barrier.wait()
        store.expire(job, piece=7)

    threads = [threading.Thread(target=worker, args=(lines[i::3],)) for i in range(3)]
    threads += [threading.Thread(target=finisher), threading.Thread(target=replica), threading.Thread(target=replica)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(answers) <= {"expired", "done"} and len(answers) == n - 40
    wait_for(lambda: store.expire(job) == "expired", 10, what="the job to end expired")
    st = store.status(job)
    assert st.request_counts.model_dump() == {"total": n, "completed": 40, "failed": n - 40}
    assert st.expired_lines == n - 40
    recs = records(store, job)
    assert sorted(recs) == list(range(1, n + 1))
    assert all(recs[line]["error"] is None for line in started)
    assert all(recs[line]["error"]["code"] == batch.BATCH_EXPIRED for line in lines)
