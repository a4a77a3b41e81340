"""A client sending to a queue that no worker consumes is told so (issue 13, item 14).

Each worker announces itself in the broker's Redis (``batchery.broker.presence``: its queue, model and host,
refreshed every few seconds, forgotten when it stops or its announcement expires). A ``ResultTimeout`` names the
queue the request waits on and, when no worker has been seen there, the queues that do have workers;
``batchery batch status`` says the same of a job's queue."""

from __future__ import annotations

import json

import pytest
from conftest import TEST_BROKER_URL, drop_queue_keys, redis_client, wait_for

from batchery import cli
from batchery.broker import presence
from batchery.client import Client, ResultTimeout

HI = [{"role": "user", "content": "hello world"}]


def line(cid: str) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": HI, "max_tokens": 1},
    }


def test_a_result_timeout_names_the_queue_and_the_queues_that_have_workers(session_workers, tiny_worker):
    other = session_workers.new_queue()  # no worker consumes it
    c = session_workers.client(other)
    try:
        h = c.chat(HI, max_tokens=1)
        with pytest.raises(ResultTimeout) as exc:
            h.get(timeout=3)
        msg = str(exc.value)
        assert f"no worker has been seen on queue '{other}'" in msg, msg
        assert f"'{tiny_worker.queue}'" in msg and "model" in msg, msg
        assert "BATCHERY_MODEL" in msg and "BATCHERY_QUEUE" in msg, msg
        # on the worker's own queue, a timeout says nothing of the kind
        mine = session_workers.client(tiny_worker.queue)
        h = mine.chat(HI, max_tokens=4000, ignore_eos=True)
        with pytest.raises(ResultTimeout) as exc:
            h.get(timeout=0.2)
        assert "no worker has been seen" not in str(exc.value)
        assert f"queue '{tiny_worker.queue}'" in str(exc.value)
        mine.close()
    finally:
        c.close()


def test_batch_status_says_when_no_worker_has_been_seen_on_the_jobs_queue(
    session_workers, tiny_worker, monkeypatch, capsys
):
    queue = session_workers.new_queue()
    monkeypatch.setenv("BATCHERY_BROKER_URL", session_workers.broker)
    monkeypatch.setenv("BATCHERY_RESULT_BACKEND", session_workers.backend)
    monkeypatch.setenv("BATCHERY_QUEUE", queue)
    c = Client()
    try:
        job = c.submit_batch(
            [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": HI}}]
        )
        assert cli.main(["batch", "status", job]) == 0
        out = capsys.readouterr().out
        assert f"no worker has been seen on queue '{queue}'" in out, out
        assert f"'{tiny_worker.queue}'" in out, out
        assert cli.main(["batch", "status", job, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["id"] == job and doc["status"] == "in_progress"  # the job's fields as before
        assert doc["workers"]["queue"] == queue and doc["workers"]["seen"] == 0
        assert tiny_worker.queue in doc["workers"]["other_queues"]
        # a job on the worker's queue: its worker is seen
        monkeypatch.setenv("BATCHERY_QUEUE", tiny_worker.queue)
        served = Client()
        job2 = served.submit_batch(
            [
                {
                    "custom_id": "b",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": HI, "max_tokens": 1},
                }
            ]
        )
        served.close()
        assert cli.main(["batch", "status", job2, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["workers"]["seen"] >= 1
        assert cli.main(["batch", "status", job2]) == 0
        assert "no worker has been seen" not in capsys.readouterr().out
    finally:
        if job is not None:
            c.cancel_batch(job)  # nobody will run it: it ends, and so gets its TTL
        c.close()
        drop_queue_keys(redis_client(session_workers.broker), queue)


def test_presence_expires_and_is_withdrawn():
    r = redis_client(TEST_BROKER_URL)
    queue = "batchery-test-presence"
    presence.announce(r, queue, "w1@host", {"model": "m"}, ttl_s=1)
    presence.announce(r, queue, "w2@host", {"model": "m"}, ttl_s=30)
    assert {w["hostname"] for w in presence.workers(r)[queue]} == {"w1@host", "w2@host"}
    presence.withdraw(r, queue, "w2@host")
    wait_for(lambda: queue not in presence.workers(r), 10, what="w1's announcement to expire")
    assert not r.hexists(presence.KEY, f"{queue}\nw1@host")  # pruned, not kept for good


def test_the_worker_withdraws_when_it_stops(workers):
    w = workers.spawn()
    r = redis_client(workers.broker)
    wait_for(lambda: w.queue in presence.workers(r), 30, what="the worker's announcement")
    [seen] = presence.workers(r)[w.queue]
    assert seen["model"] == workers.env(w.queue)["BATCHERY_MODEL"] and seen["pid"] == w.pid
    assert w.terminate() == 0
    assert w.queue not in presence.workers(r)
