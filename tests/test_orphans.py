"""A dead worker's unacknowledged messages go back to the queue once it has left the workers' presence, not after the
visibility timeout (``batchery.broker.orphans``; the holder records: ``batchery.worker.kombu_patches``).

Real Redis, real kombu: the holder record is written and dropped by kombu's own Redis channel; the sweep moves
messages written as kombu writes them; and a real worker SIGKILLed while it holds a big job's chunks has them run by
another worker within a minute, with the visibility timeout at five."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from conftest import TEST_BROKER_URL, drop_queue_keys, redis_client, wait_for

from batchery.broker import presence
from batchery.broker.affinity import direct_queue
from batchery.broker.orphans import OWNERS_KEY, UNACKED_INDEX_KEY, UNACKED_KEY, Orphans
from batchery.broker.queues import queue_key


@pytest.fixture()
def broker():
    r = redis_client(TEST_BROKER_URL)
    queue = f"batchery-test-{uuid.uuid4().hex[:10]}"
    tags: list[str] = []
    yield r, queue, tags
    for tag in tags:
        r.hdel(UNACKED_KEY, tag)
        r.zrem(UNACKED_INDEX_KEY, tag)
        r.hdel(OWNERS_KEY, tag)
    for q in (queue, "other-" + queue):
        drop_queue_keys(r, q)


def held(r, tags: list, holder: str, routing_key: str, age_s: float, priority: int = 0) -> tuple[str, dict]:
    """A message as kombu's Redis QoS records one it delivered ``age_s`` ago, and its holder record."""
    tag = str(uuid.uuid4())
    tags.append(tag)
    message = {
        "body": "e30=",
        "headers": {"id": tag, "task": "batchery.batch_lines"},
        "properties": {"delivery_tag": tag, "priority": priority, "delivery_info": {"routing_key": routing_key}},
    }
    r.hset(UNACKED_KEY, tag, json.dumps([message, routing_key, routing_key]))
    r.zadd(UNACKED_INDEX_KEY, {tag: time.time() - age_s})
    r.hset(OWNERS_KEY, tag, holder)
    return tag, message


def queued(r, queue: str, priority: int = 0) -> list[dict]:
    return [json.loads(m) for m in r.lrange(queue_key(queue, priority), 0, -1)]


def test_kombu_records_the_holder_of_a_message_it_delivers_and_drops_it_on_ack(broker, monkeypatch):
    from kombu import Connection, Exchange, Queue
    from kombu.transport import redis as kombu_redis

    from batchery.worker import kombu_patches

    r, queue, tags = broker
    for name in ("append", "_remove_from_indices"):  # undone after the test
        monkeypatch.setattr(kombu_redis.QoS, name, getattr(kombu_redis.QoS, name))
    monkeypatch.setattr(kombu_redis.QoS, "batchery_hostname", None, raising=False)
    kombu_patches.record_holders("holder-a@test")
    q = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
    with Connection(TEST_BROKER_URL) as conn:
        got = []
        for i in range(2):
            conn.Producer().publish({"i": i}, exchange=q.exchange, routing_key=queue, declare=[q])
        with conn.Consumer(q, callbacks=[lambda body, message: got.append(message)]):
            wait_for(lambda: conn.drain_events(timeout=5) or len(got) == 2, 10, what="two deliveries")
        tags.extend(m.delivery_tag for m in got)
        for m in got:
            assert r.hget(OWNERS_KEY, m.delivery_tag) == b"holder-a@test"
            assert r.hexists(UNACKED_KEY, m.delivery_tag)
        got[0].ack()
        assert not r.hexists(OWNERS_KEY, got[0].delivery_tag) and not r.hexists(UNACKED_KEY, got[0].delivery_tag)
        got[1].reject(requeue=True)  # kombu's own restore drops the record too
        assert not r.hexists(OWNERS_KEY, got[1].delivery_tag)
        assert [json.loads(m)["properties"]["delivery_tag"] for m in r.lrange(queue, 0, -1)] == [got[1].delivery_tag]


def test_the_sweep_gives_back_only_old_messages_of_this_queue_whose_holder_stayed_gone(broker):
    r, queue, tags = broker
    presence.announce(r, queue, "alive@test", {})
    try:
        gone, _ = held(r, tags, "gone@test", queue, age_s=120)
        recent, _ = held(r, tags, "gone@test", queue, age_s=1)  # a moment ago: its holder may not have announced
        urgent, _ = held(r, tags, "gone@test", queue, age_s=120, priority=9)
        direct, _ = held(r, tags, "gone@test", direct_queue(queue, "gone@test"), age_s=120)
        held(r, tags, "gone@test", "other-" + queue, age_s=120)  # another queue's workers sweep that one
        alive, _ = held(r, tags, "alive@test", queue, age_s=120)
        dangling = str(uuid.uuid4())  # a holder record whose message was acknowledged
        tags.append(dangling)
        r.hset(OWNERS_KEY, dangling, "gone@test")

        sweeper = Orphans(r, queue, "me@test", confirm_s=0.5, grace_s=30)
        assert sweeper.sweep() == 0  # missing once is not gone yet
        assert queued(r, queue) == [] and r.hexists(OWNERS_KEY, dangling)
        time.sleep(0.6)
        assert sweeper.sweep() == 3

        heads = queued(r, queue)
        assert sorted(m["properties"]["delivery_tag"] for m in heads) == sorted([gone, direct])
        for m in heads + queued(r, queue, 9):
            assert m["headers"]["redelivered"] and m["properties"]["delivery_info"]["redelivered"]
        assert [m["properties"]["delivery_tag"] for m in queued(r, queue, 9)] == [urgent]
        assert r.llen(direct_queue(queue, "gone@test")) == 0  # nobody consumes a dead worker's direct queue
        for tag in (gone, urgent, direct, dangling):
            assert not r.hexists(UNACKED_KEY, tag) and not r.hexists(OWNERS_KEY, tag)
            assert r.zscore(UNACKED_INDEX_KEY, tag) is None
        assert r.hget(OWNERS_KEY, recent) == b"gone@test" and r.hexists(UNACKED_KEY, recent)
        assert r.hget(OWNERS_KEY, alive) == b"alive@test" and r.hexists(UNACKED_KEY, alive)
        assert queued(r, "other-" + queue) == []
        assert sweeper.sweep() == 0  # nothing moves twice
        assert len(queued(r, queue)) == 2
    finally:
        presence.withdraw(r, queue, "alive@test")


def test_a_message_that_changed_hands_since_the_sweep_read_it_stays(broker):
    """The move checks the holder and the message it read: a message acknowledged, restored by kombu or taken by
    another worker meanwhile is not pushed again."""
    r, queue, tags = broker
    tag, _ = held(r, tags, "gone@test", queue, age_s=120)
    sweeper = Orphans(r, queue, "me@test", confirm_s=0, grace_s=30)
    raw = r.hget(UNACKED_KEY, tag)
    r.hset(OWNERS_KEY, tag, "new-holder@test")  # redelivered to a live worker under the same tag
    assert sweeper._move("gone@test", tag, raw) == 0
    r.hset(OWNERS_KEY, tag, "gone@test")
    r.hset(UNACKED_KEY, tag, raw + b" ")
    assert sweeper._move("gone@test", tag, raw) == 0
    assert queued(r, queue) == []


@pytest.mark.integration
def test_a_sigkilled_workers_chunks_run_on_another_worker_long_before_the_visibility_timeout(workers):
    """A worker SIGKILLed while it holds a job's chunks (unacknowledged): with the visibility timeout at 300 s, the
    job still completes within about a minute on the worker that replaces it, every line recorded once."""
    queue = workers.new_queue()
    c = workers.client(queue)
    c.settings.batch.chunk_lines = 8
    lines = [
        {
            "custom_id": f"k{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 400, "ignore_eos": True},
        }
        for i in range(48)
    ]
    try:
        a_name = f"orphan-a-{uuid.uuid4().hex[:6]}@test"
        a = workers.spawn(queue, BATCHERY_CONCURRENCY="8", BATCHERY_ORPHAN_GRACE="4", BATCHERY_HOSTNAME=a_name)
        job = c.submit_batch(lines)
        wait_for(lambda: c.jobs.status(job).status == "in_progress", 30, 0.1, what="the job to start")
        broker = redis_client(workers.broker)
        wait_for(lambda: any(h == a_name for h in held_by(broker)), 30, 0.1, what="the worker to hold messages")
        a.kill()
        killed = time.monotonic()
        b = workers.spawn(queue, BATCHERY_CONCURRENCY="8", BATCHERY_ORPHAN_GRACE="4")
        gone = rf"worker {a_name} is gone: \d+ messages it held \(unacknowledged\) are back on queue"
        b.wait_for_log(gone, timeout=90)
        st = wait_for(lambda: (s := c.jobs.status(job)).is_terminal and s, 120, 0.2, what=f"job {job} to end")
        assert time.monotonic() - killed < 200  # the visibility timeout (300 s) never came into it
        assert st.status == "completed" and st.request_counts.completed == 48
        records = c.batch_results(job)
        assert sorted(r["custom_id"] for r in records) == sorted(f"k{i}" for i in range(48))
        assert not any(h == a_name for h in held_by(broker))
        assert b.terminate() == 0
    finally:
        c.close()


def held_by(r) -> list[str]:
    return [v.decode() for v in r.hvals(OWNERS_KEY)]
