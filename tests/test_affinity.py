"""Prefix affinity (``batchery.broker.affinity``) against a real Redis and real ``batchery worker`` processes:

1. the scripts: a group's lease, forwarding only to a registered worker with room, retiring a direct queue back
   to the head of the main queue in order;
2. the submitter's prefix groups: a document's questions share one, unrelated short prompts do not;
3. two workers, documents x 3 questions shuffled: each document's lines all ran on one worker;
4. a worker SIGKILLed while lines wait in its direct queue: the other moves them back and every line is recorded
   once (lost-line recovery off, so the move is what saves them);
5. a forwarded message carries one hop and, put back where a worker that does not own its group takes it, runs
   there instead of hopping again."""

from __future__ import annotations

import json
import random
import signal
import uuid
from collections import defaultdict

import pytest
from conftest import redis_client, wait_for

from batchery.broker import affinity, presence
from batchery.broker.queues import queue_key, queue_keys
from batchery.jobs.submit import prefix_group

pytestmark = pytest.mark.integration

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def docqa_lines(num_docs: int, questions: int, tag: str, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for d in range(num_docs):
        words = random.Random(f"{seed}-{d}")  # a document does not depend on how many questions it has
        doc = " ".join(words.choice(WORDS) for _ in range(120)) + f" document {tag}{d}"
        for q in range(questions):
            body = {
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": doc},
                    {"role": "user", "content": f"question {q} {rng.choice(WORDS)}"},
                ],
                "max_tokens": 2,
            }
            out.append({"custom_id": f"doc{d}-q{q}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    rng.shuffle(out)
    return out


def forwarded(w) -> int:
    return w.count(r"skipped \(forwarded to ")


def two_workers(workers, queue: str, **env):
    # 16 task threads: an owner takes up to 16 forwarded lines waiting, more than a test's 24 lines can leave it
    env = {"BATCHERY_LOG_FORMAT": "json", "BATCHERY_CONCURRENCY": "16", **env}
    ws = [workers.spawn(queue, ready=False, **env), workers.spawn(queue, ready=False, **env)]
    for w in ws:
        w.wait_ready()
    for w in ws:  # each has seen the other (its chore's view of the queue)
        w.wait_for_log(r"prefix affinity: 2 workers live on queue", timeout=30)
    return ws


def cleanup(r, queue: str) -> None:
    keys = list(r.scan_iter(match=f"{queue}.*")) + list(r.scan_iter(match=f"_kombu.binding.{queue}*"))
    if keys:
        r.delete(*keys)


def test_scripts(redis_urls):
    r = redis_client(redis_urls[0])
    queue = f"batchery-test-aff-{uuid.uuid4().hex[:8]}"
    try:
        a = affinity.Affinity(r, None, queue, "a", max_waiting=2)
        b = affinity.Affinity(r, None, queue, "b", max_waiting=2)
        key = affinity.lease_key(queue, "g1")

        def claim(who: str) -> bytes:
            return who_claims[who]._claim(keys=[key, presence.KEY], args=[who, 30000, f"{queue}\n"])

        who_claims = {"a": a, "b": b}
        assert claim("a") == b"a"
        assert claim("b") == b"b"  # a owns it, but a has no presence: b takes it over
        presence.announce(r, queue, "b", {"model": "tiny"}, ttl_s=60)
        assert claim("a") == b"b" and r.get(key) == b"b"  # b is live: its group stays its own
        assert claim("b") == b"b" and 29000 < r.pttl(key) <= 30000  # refreshed
        presence.announce(r, queue, "b", {"model": "tiny"}, ttl_s=-1)  # b's presence has expired
        assert claim("a") == b"a"
        # forwarding: only to a registered worker, and not past max_waiting
        reg = affinity.registry_key(queue)
        target = queue_key(affinity.direct_queue(queue, "a"), 0)
        assert a._forward(keys=[reg, target], args=["a", 2, "m0"]) == 0
        r.sadd(reg, "a")
        assert [a._forward(keys=[reg, target], args=["a", 2, f"m{i}"]) for i in (1, 2, 3)] == [1, 1, 0]
        # retire: unregistered, the waiting messages at the head of the main queue, oldest first
        main = queue_key(queue, 0)
        r.lpush(main, "older-waiting")
        assert affinity.retire(r, queue, "a") == 2
        assert not r.sismember(reg, "a") and r.llen(target) == 0
        assert [r.rpop(main) for _ in range(3)] == [b"m1", b"m2", b"older-waiting"]
    finally:
        presence.withdraw(r, queue, "b")
        cleanup(r, queue)


def test_prefix_groups():
    lines = docqa_lines(3, 3, "g")
    groups = defaultdict(set)
    for item in lines:
        groups[item["custom_id"].split("-")[0]].add(prefix_group(item["url"], item["body"]))
    assert all(len(g) == 1 for g in groups.values()), groups
    assert len(set().union(*groups.values())) == 3
    short = [{"messages": [{"role": "user", "content": f"hello {i}"}]} for i in range(3)]
    assert len({prefix_group("/v1/chat/completions", b) for b in short}) == 3


def test_each_documents_lines_run_on_one_worker(workers):
    queue = workers.new_queue()
    r = redis_client(workers.broker)
    ws = two_workers(workers, queue)
    c = workers.client(queue)
    c.settings.batch.chunk_lines = 1  # a message a line: round robin splits a document's lines, affinity joins them
    try:
        lines = docqa_lines(8, 3, "a")
        job = c.submit_batch(lines)
        st = c.wait_batch(job, timeout=180)
        assert st.status == "completed" and st.request_counts.completed == len(lines)
        records = list(c.batch_results(job))
        assert sorted(rec["custom_id"] for rec in records) == sorted(item["custom_id"] for item in lines)
        # where each line ran: its record's timing.worker (the lines travel in chunks of a document's questions)
        by_doc: dict[str, set[str]] = defaultdict(set)
        for rec in records:
            by_doc[rec["custom_id"].split("-")[0]].add(rec["response"]["body"]["timing"]["worker"])
        assert len(by_doc) == 8
        assert all(len(ran) == 1 for ran in by_doc.values()), dict(by_doc)
        assert sum(forwarded(w) for w in ws) > 0  # round robin split the groups; affinity put them together
        for w in ws:
            assert w.terminate() == 0
        assert not r.smembers(affinity.registry_key(queue))  # both retired at their warm shutdown
    finally:
        c.close()
        cleanup(r, queue)


def test_lines_waiting_for_a_killed_worker_still_finish_once(workers):
    queue = workers.new_queue()
    r = redis_client(workers.broker)
    a, b = two_workers(workers, queue, BATCHERY_RECOVERY_INTERVAL="0")
    c = workers.client(queue)
    c.settings.batch.chunk_lines = 1  # a message a line: this test follows each line's message
    try:
        first = docqa_lines(6, 1, "k")
        job = c.submit_batch(first)
        assert c.wait_batch(job, timeout=120).status == "completed"
        owned = {_s(r.get(k)) for k in r.scan_iter(match=f"{queue}.affinity.g.*")}
        assert len(owned) == 2, owned  # both own groups (the test needs b to own some)
        b.proc.send_signal(signal.SIGKILL)
        b.wait(10)
        # the same documents, new questions, while b's presence has not yet expired: a forwards b's groups to it
        second = docqa_lines(6, 3, "k")
        for item in second:
            item["custom_id"] = "again-" + item["custom_id"]
        job2 = c.submit_batch(second)
        st = c.wait_batch(job2, timeout=presence.ANNOUNCE_TTL_S + 120)
        assert st.status == "completed"
        assert st.request_counts.completed == len(second) and st.request_counts.failed == 0
        results = [rec["custom_id"] for rec in c.batch_results(job2)]
        assert sorted(results) == sorted(item["custom_id"] for item in second)  # each once
        assert forwarded(a) > 0
        a.wait_for_log(r"prefix affinity: worker \S+ is gone; [1-9]\d* messages of its direct queue are back")
        assert all(r.llen(k) == 0 for k in r.scan_iter(match=f"{queue}.w.*"))
    finally:
        c.close()
        cleanup(r, queue)


def test_a_forwarded_message_hops_once(workers):
    """A live, registered "ghost" worker owns the job's group: the real worker forwards the line to the ghost's
    direct queue with one hop; moved back to the main queue, the worker runs it although the ghost still owns it."""
    queue = workers.new_queue()
    r = redis_client(workers.broker)
    w = workers.spawn(queue, BATCHERY_LOG_FORMAT="json", BATCHERY_CONCURRENCY="4")
    c = workers.client(queue)
    c.settings.batch.chunk_lines = 1  # a message a line: this test follows each line's message
    try:
        presence.announce(r, queue, "ghost", {"model": "tiny"}, ttl_s=300)
        r.sadd(affinity.registry_key(queue), "ghost")
        w.wait_for_log(r"prefix affinity: 2 workers live on queue", timeout=30)
        lines = docqa_lines(1, 2, "h")
        group = prefix_group(lines[0]["url"], lines[0]["body"])
        r.set(affinity.lease_key(queue, group), "ghost", px=300_000)
        job = c.submit_batch(lines)
        ghost_q = affinity.direct_queue(queue, "ghost")
        wait_for(lambda: sum(r.llen(k) for k in queue_keys(ghost_q)) == 2, 60, 0.1, what="two forwarded lines")
        assert c.jobs.status(job).request_counts.completed == 0
        msgs = [json.loads(m) for k in queue_keys(ghost_q) for m in r.lrange(k, 0, -1)]
        for m in msgs:
            assert m["headers"][affinity.HOPS_HEADER] == 1 and m["headers"][affinity.PREFIX_HEADER] == group
            assert m["properties"]["delivery_info"]["routing_key"] == queue  # a restore goes to the main queue
        assert sorted(m["headers"]["id"] for m in msgs) == [f"{job}-1", f"{job}-2"]
        # put them where the worker takes them: it runs them (one hop is enough), the ghost still owning the group
        for k, main in zip(queue_keys(ghost_q), queue_keys(queue), strict=True):
            while r.lmove(k, main, "LEFT", "RIGHT"):
                pass
        st = c.wait_batch(job, timeout=60)
        assert st.status == "completed" and st.request_counts.completed == 2
        assert forwarded(w) == 2 and sum(r.llen(k) for k in queue_keys(ghost_q)) == 0
        assert r.get(affinity.lease_key(queue, group)) == b"ghost"
        # the ghost goes: the worker's chore retires it
        presence.withdraw(r, queue, "ghost")
        wait_for(lambda: not r.sismember(affinity.registry_key(queue), "ghost"), 30, 0.2, what="ghost retired")
    finally:
        presence.withdraw(r, queue, "ghost")
        c.close()
        cleanup(r, queue)


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
