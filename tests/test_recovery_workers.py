"""Lost batch lines are found by the workers, with nobody waiting and other messages on the queue (issue 13, item 5).

kombu takes a message off the queue (``BRPOP``) before it records it as unacknowledged; a worker death or a Redis
restart in between loses it. A job's ledger keeps each line's message until the line is recorded, and
``batchery.jobs.recover`` finds a lost line by looking, line by line, whether its message still waits in the queue,
is held by a worker (kombu's ``unacked``) or is leased (running). The workers do this themselves, one at a time
(a Redis lock), every ``BATCHERY_RECOVERY_INTERVAL`` seconds, for the jobs of their queue that have made no
progress for that long."""

from __future__ import annotations

import json
import uuid

import pytest
from conftest import TEST_BROKER_URL, TEST_RESULT_BACKEND, drop_queue_keys, redis_client, wait_for

from batchery.broker import affinity
from batchery.broker.queues import queue_keys
from batchery.client import Client
from batchery.contract.settings import Settings
from batchery.jobs.recover import RecoveryLock, find_lost, queued_lines

pytestmark = pytest.mark.integration


def lines(n: int, max_tokens: int = 2, start: int = 1) -> list[dict]:
    return [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": max_tokens},
        }
        for i in range(start, start + n)
    ]


def take_line(broker, queue: str, job: str, line: int) -> bytes:
    """Remove line ``line``'s message from the queue (what a worker dying right after its BRPOP does)."""
    for key in queue_keys(queue):
        for raw in broker.lrange(key, 0, -1):
            if json.loads(raw)["headers"]["id"] == f"{job}-{line}":
                assert broker.lrem(key, 1, raw) == 1
                return raw
    raise AssertionError(f"no message for line {line} of {job} on {queue}")


@pytest.fixture()
def private_client():
    queue = f"batchery-test-{uuid.uuid4().hex[:10]}"
    c = Client(
        settings=Settings(
            broker_url=TEST_BROKER_URL,
            result_backend=TEST_RESULT_BACKEND,
            queue=queue,
            batch={"key_prefix": f"{queue}:batch", "ttl": 600, "chunk_lines": 1},  # the broker loses one line
        )
    )
    yield c
    for r in (redis_client(TEST_BROKER_URL), redis_client(TEST_RESULT_BACKEND)):
        drop_queue_keys(r, queue)
    c.close()


def test_a_lost_line_is_found_while_other_messages_wait_on_the_queue(private_client):
    """Today's precondition ("the queue must be empty") hid a lost line for as long as anything else was queued.
    Each line is looked up in the queue instead: in either JSON spelling (the submitter's compact one, kombu's
    ``"id": "..."`` of a retried or restored message)."""
    c, queue = private_client, private_client.queue
    broker = redis_client(TEST_BROKER_URL)
    job = c.submit_batch(lines(4))
    other = c.submit_batch(lines(3, start=10))  # unrelated messages, on the same queue, before and after
    c.chat_many([[{"role": "user", "content": "unrelated"}]] * 3, max_tokens=1)
    take_line(broker, queue, job, 2)
    # line 3 comes back the way kombu writes a message it restores (json.dumps: a space after each colon)
    raw3 = take_line(broker, queue, job, 3)
    broker.rpush(queue, json.dumps(json.loads(raw3)))
    assert sum(broker.llen(k) for k in queue_keys(queue)) == 3 + 3 + 3
    found = queued_lines(broker, queue, [job, other])
    assert found == {job: {1, 3, 4}, other: {1, 2, 3}}
    assert find_lost(c.jobs, broker, job, queue, confirm_s=0) == {2}
    assert find_lost(c.jobs, broker, other, queue, confirm_s=0) == set()
    assert c.requeue_lost(job) == 1
    assert queued_lines(broker, queue, [job])[job] == {1, 2, 3, 4}
    # a lost line goes back to the head of the queue: it has waited long enough
    assert json.loads(broker.lindex(queue, -1))["headers"]["id"] == f"{job}-2"


def test_a_line_forwarded_to_a_workers_direct_queue_is_not_lost(private_client):
    """Prefix affinity moves a line onto its group owner's direct queue (``batchery.broker.affinity``): a line
    waiting there is queued, not lost, so recovery does not run it a second time."""
    c, queue = private_client, private_client.queue
    broker = redis_client(TEST_BROKER_URL)
    job = c.submit_batch(lines(3))
    host = "owner@test"
    direct = affinity.direct_queue(queue, host)
    broker.sadd(affinity.registry_key(queue), host)
    try:
        broker.lpush(direct, take_line(broker, queue, job, 2))
        assert queued_lines(broker, queue, [job])[job] == {1, 2, 3}
        assert find_lost(c.jobs, broker, job, queue, confirm_s=0) == set()
        broker.srem(affinity.registry_key(queue), host)  # an owner no longer registered: its list is not looked at
        assert find_lost(c.jobs, broker, job, queue, confirm_s=0) == {2}
    finally:
        broker.delete(direct, affinity.registry_key(queue))


def test_one_recoverer_at_a_time():
    broker = redis_client(TEST_BROKER_URL)
    queue = f"batchery-test-{uuid.uuid4().hex[:10]}"
    a, b = RecoveryLock(broker, queue, ttl_s=30), RecoveryLock(broker, queue, ttl_s=30)
    try:
        assert a.acquire() and not b.acquire()
        assert a.extend() and not b.extend()
        b.release()  # not b's: a keeps it
        assert not b.acquire()
        a.release()
        assert b.acquire() and not a.extend()
    finally:
        broker.delete(a.key)


def test_a_lost_line_is_requeued_by_the_workers_with_nobody_waiting(workers):
    """A job whose line 2 lost its message, unrelated slow requests queued behind it, and no client waiting: the
    worker's recovery puts line 2 back at the head of the queue and the job completes, each line recorded once."""
    queue = workers.new_queue()
    c = workers.client(queue)
    c.settings.batch.chunk_lines = 1  # a message a line: the broker loses one line (a lost chunk: test_chunks.py)
    broker = redis_client(workers.broker)
    try:
        job = c.submit_batch(lines(4))  # no worker yet: the four lines wait on the queue
        take_line(broker, queue, job, 2)
        slow = [[{"role": "user", "content": f"unrelated {i}"}] for i in range(30)]
        c.chat_many(slow, max_tokens=4000, ignore_eos=True, timeout=3)  # each holds a task thread for up to 3 s
        w = workers.spawn(queue, BATCHERY_RECOVERY_INTERVAL="1", BATCHERY_CONCURRENCY="2")
        w.wait_for_log(rf"batch job {job}: the messages of 1 lines were lost.*lines 2\b", timeout=60)
        waiting = [json.loads(m)["headers"]["task"] for k in queue_keys(queue) for m in broker.lrange(k, 0, -1)]
        assert waiting.count("batchery.chat_completion") > 0, "the unrelated requests should still be queued"
        # nobody calls wait_batch: the status is only read
        st = wait_for(lambda: (s := c.jobs.status(job)).is_terminal and s, 60, 0.2, what=f"job {job} to end")
        assert st.status == "completed"
        assert st.request_counts.completed == 4 and st.request_counts.failed == 0
        assert sorted(r["custom_id"] for r in c.batch_results(job)) == ["c1", "c2", "c3", "c4"]
        assert w.terminate() == 0
    finally:
        c.close()
