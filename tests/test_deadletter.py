"""Poison that kills the worker process (issue 13 item 2): counted deliveries, runs alone, dead letters.

A request whose step ends the process (the ``exit_on`` fault: ``os._exit(70)``, like a segfault or the
OOM killer) comes back to the next worker after the visibility timeout. Its deliveries are counted in
Redis before the engine sees it: from the second on it runs alone, and after ``BATCHERY_MAX_DELIVERIES``
deliveries that died it fails for good (``engine_crash``) and its message goes on the dead-letter list,
which ``batchery deadletter list / inspect / requeue`` show and publish again.

The worker tests run on a private redis-server: kombu's sweep for a dead worker's messages takes every
queue's messages older than the (here short) visibility timeout, other tests' included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import REPO, WorkerFactory, free_port, redis_client, wait_for

from batchery.contract.errors import EngineCrash
from batchery.contract.names import CHAT_TASK
from batchery.jobs.deadletter import MAX_PAYLOAD_BYTES, WORKER_DIED, DeadLetters, make_entry
from batchery.jobs.deliveries import Deliveries

POISON = "KILLME"
MAX_DELIVERIES = 2  # two deaths (the first among others, the second alone), then dead-lettered
EXIT_ON_CODE = 70  # batchery.worker.service.faults.EXIT_ON_CODE


# -- the store side, on the shared test Redis ---------------------------------------------------------------
def test_delivery_counts_keep_only_deliveries_that_died(redis_urls):
    r = redis_client(redis_urls[1])
    d = Deliveries(r, f"batchery:test-deliveries-{os.getpid()}", ttl=60)
    try:
        assert d.begin("t1").died == 0
        d.end("t1")  # finished: nothing is kept
        assert d.begin("t1").died == 0  # ... and this delivery dies (never ends)
        seen = d.begin("t1")
        assert (seen.died, seen.died_alone) == (1, 0)
        d.alone("t1")  # it runs alone, and dies
        seen = d.begin("t1")
        assert (seen.died, seen.died_alone) == (2, 1)
        d.end("t1", keep=True)  # an engine failure (a retry): the deaths before it stay counted
        assert (d.begin("t1").died, d.get("t1")["alone"]) == (2, 1)
        d.end("t1")
        assert d.get("t1") == {}
    finally:
        d.clear("t1")


# One worker process, simulated: each task id in argv (in that order, one thread each) is delivered through
# ``batchery.tasks.redelivery.attempt`` and, once in, stays in; then the process dies (``os._exit``), as if
# the last request's step had segfaulted, leaving every delivery it had begun counted. Prints one JSON line
# per request that got in (``solo``: it runs alone) or failed for good (``crash``: the EngineCrash message).
# A suspect that arrives while another holds the turn to run alone dies waiting for it.
_DYING_PROCESS = r"""
import json, os, sys, threading, time
from types import SimpleNamespace
from batchery.contract.errors import EngineCrash
from batchery.contract.generation import GenerationRequest
from batchery.tasks.redelivery import attempt, deliveries

url, prefix, limit, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
deadletter = SimpleNamespace(
    deliveries_prefix=prefix + ":deliveries", key_prefix=prefix + ":deadletter", max_entries=100)
app = SimpleNamespace(batchery_settings=SimpleNamespace(
    max_deliveries=limit, result_backend=url, visibility_timeout=None, queue="q", deadletter=deadletter))

def deliver(tid):
    req = SimpleNamespace(id=tid, delivery_info={}, args=[], kwargs={"custom_id": tid}, hostname="sim")
    task = SimpleNamespace(name="batchery.batch_line", app=app, request=req)
    try:
        with attempt(task, GenerationRequest(), 60) as (g, _):
            print(json.dumps({"id": tid, "solo": g.solo}), flush=True)
            time.sleep(3600)  # its step never ends: the process dies under it
    except EngineCrash as exc:
        print(json.dumps({"id": tid, "crash": str(exc)}), flush=True)

counters = deliveries(app)
for tid in ids:
    opened = counters.get(tid).get("open", 0)
    threading.Thread(target=deliver, args=(tid,), daemon=True).start()
    t0 = time.monotonic()
    while counters.get(tid).get("open", 0) == opened and time.monotonic() - t0 < 10:
        time.sleep(0.01)  # until this delivery is counted
    time.sleep(0.3)  # ... and is in, has failed for good, or waits for the turn to run alone
os._exit(70)
"""


def test_engine_crash_names_the_deliveries_of_two_poison_lines_in_flight_together(redis_urls):
    """Two lines that kill the worker process, A and B, delivered together (chaos row 14). Both die twice
    beside each other and become suspects; A takes the process's turn to run alone, and B, waiting for the
    turn, dies with it a third time, not alone. A is then dead-lettered (3 deliveries, 1 alone); B is not
    (no death of its own yet), runs alone, dies a fourth time, and is dead-lettered with 4. Each line's
    ``EngineCrash`` (its ``engine_crash`` record) names the deliveries its dead-letter entry counts."""
    r = redis_client(redis_urls[1])
    prefix = f"batchery:test-deathcount-{os.getpid()}"
    limit = 3  # BATCHERY_MAX_DELIVERIES' default, as in chaos row 14
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def process(*ids: str) -> dict[str, dict]:
        p = subprocess.run(
            [sys.executable, "-c", _DYING_PROCESS, redis_urls[1], prefix, str(limit), *ids],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == EXIT_ON_CODE, p.stderr
        return {o["id"]: o for o in map(json.loads, p.stdout.splitlines())}

    try:
        assert process("A", "B") == {"A": {"id": "A", "solo": False}, "B": {"id": "B", "solo": False}}
        assert process("A", "B") == {"A": {"id": "A", "solo": False}, "B": {"id": "B", "solo": False}}
        assert process("A", "B") == {"A": {"id": "A", "solo": True}}  # B died waiting for A's run alone
        fourth = process("A", "B")
        assert fourth["B"] == {"id": "B", "solo": True}
        fifth = process("B")
        dl = DeadLetters(r, f"{prefix}:deadletter")
        crashes = {"A": fourth["A"]["crash"], "B": fifth["B"]["crash"]}
        for tid, deliveries, alone in (("A", 3, 1), ("B", 4, 1)):
            entry = dl.get(tid)
            assert (entry["deliveries"], entry["deliveries_alone"]) == (deliveries, alone), entry
            named = f"delivered {deliveries} times and the worker process died each time ({alone} of them running alone"
            for message in (crashes[tid], entry["message"]):
                assert message.startswith(named), (tid, message)
    finally:
        r.delete(*r.keys(f"{prefix}:*") or ["-"])


def test_dead_letters_are_bounded_json_newest_first(redis_urls):
    r = redis_client(redis_urls[1])
    dl = DeadLetters(r, f"batchery:test-deadletter-{os.getpid()}", max_entries=3)
    try:
        for i in range(5):
            dl.add(
                make_entry(
                    task_id=f"t{i}", task=CHAT_TASK, args=[], kwargs={"body": {"n": i}}, queue="q", priority=0,
                    reason=WORKER_DIED, message="died",
                )
            )  # fmt: skip
        assert dl.count() == 3 and dl.ids() == ["t4", "t3", "t2"]
        assert dl.get("t0") is None and dl.get("t4")["kwargs"] == {"body": {"n": 4}}
        assert dl.get("t4")["args"] == [] and dl.get("t4")["dead_lettered_at"] > 0
        big = make_entry(
            task_id="x" * 10_000, task=CHAT_TASK, args=[], kwargs={"body": "y" * (MAX_PAYLOAD_BYTES + 1)},
            queue="q", priority=0, reason=WORKER_DIED, message="m" * 5000,
        )  # fmt: skip
        assert big["truncated"] and "kwargs" not in big and len(json.dumps(big)) < 8000
    finally:
        r.delete(dl.entries_key, dl.index_key)


# -- real workers that die ----------------------------------------------------------------------------------
@pytest.fixture()
def private_redis(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"

    def answers():
        try:
            return redis_client(url).ping()
        except Exception:  # noqa: BLE001
            return False

    wait_for(answers, 15, what="the private redis-server")
    yield url
    proc.kill()
    proc.wait(10)


# Short deadlines, so a dead worker's messages come back after 10 s (the visibility timeout must exceed
# the longest deadline plus retry delay: 8 + 1 s).
DYING = {
    "BATCHERY_FAULTS": f"exit_on:{POISON}",
    "BATCHERY_MAX_DELIVERIES": str(MAX_DELIVERIES),
    "BATCHERY_TASK_TIMEOUT": "8",
    "BATCHERY_MAX_TASK_TIMEOUT": "8",
    "BATCHERY_RETRY_BACKOFF_MAX": "1",
    "BATCHERY_VISIBILITY_TIMEOUT": "10",
}


class Reviver:
    """One worker on the queue at all times: a dead one is replaced (as an orchestrator would)."""

    def __init__(self, factory: WorkerFactory, queue: str) -> None:
        self.factory, self.queue = factory, queue
        self.exits: list[int] = []
        self.worker = factory.spawn(queue, **DYING)

    def check(self) -> None:
        code = self.worker.proc.poll()
        if code is not None:
            self.exits.append(code)
            self.worker = self.factory.spawn(self.queue, ready=False, **DYING)


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
    env.update(BATCHERY_BROKER_URL=url, BATCHERY_RESULT_BACKEND=url, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "batchery", "deadletter", *args], env=env, capture_output=True, text=True, timeout=60
    )


def chat_line(custom_id: str, content: str) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "ignore_eos": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_a_line_that_kills_its_worker_is_dead_lettered_and_every_other_line_completes(
    tiny_model_dir, private_redis, tmp_path
):
    factory = WorkerFactory(tiny_model_dir, private_redis, private_redis, tmp_path)
    try:
        queue = factory.new_queue()
        reviver = Reviver(factory, queue)
        client = factory.client(queue)
        rows = [chat_line(f"ok{i}", f"hello number {i}") for i in range(6)]
        rows.insert(3, chat_line("poison", f"please {POISON} now"))
        job = client.submit_batch(rows)

        def ended():
            reviver.check()
            return client.batch_status(job).is_terminal

        wait_for(ended, 240, interval=0.2, what="the job to end while its worker keeps dying")
        status = client.batch_status(job)
        records = {r["custom_id"]: r for r in client.batch_results(job)}
        assert status.status == "completed", status
        assert (status.request_counts.completed, status.request_counts.failed) == (6, 1), status.request_counts
        assert reviver.exits == [EXIT_ON_CODE] * MAX_DELIVERIES, reviver.exits
        bad = records["poison"]
        assert bad["error"]["code"] == "engine_crash" and bad["response"]["status_code"] == 500, bad
        assert f"delivered {MAX_DELIVERIES} times" in bad["error"]["message"], bad
        assert "dead-letter" in bad["error"]["message"], bad
        assert all(records[f"ok{i}"]["response"]["status_code"] == 200 for i in range(6)), records
        task_id = f"{job}-4"  # the poison is the 4th line of the input

        listed = cli(private_redis, "list")
        assert listed.returncode == 0 and task_id in listed.stdout and WORKER_DIED in listed.stdout, listed
        shown = cli(private_redis, "inspect", task_id)
        assert shown.returncode == 0, shown
        entry = json.loads(shown.stdout)
        assert entry["task"] == "batchery.batch_line" and entry["queue"] == queue, entry
        assert entry["kwargs"]["custom_id"] == "poison" and entry["deliveries"] == MAX_DELIVERIES, entry
        # the line has its record, and a line runs once: a requeue would do nothing, so it is refused
        again = cli(private_redis, "requeue", task_id)
        assert again.returncode == 1 and "already has its record" in again.stderr, again
        assert task_id in cli(private_redis, "list").stdout
        client.close()
    finally:
        factory.close()


def test_two_copies_of_a_killing_line_in_one_process_count_each_death_once(tiny_model_dir, private_redis, tmp_path):
    """A duplicate message of a line that kills its worker (chaos row 14 saw one: its dead-letter entry and its
    ``engine_crash`` record named different delivery counts). The copy that finds its line in flight in the same
    process is skipped (``batchery.tasks.inflight``), so each death counts once: the worker dies
    ``MAX_DELIVERIES`` times, and the record names exactly the deliveries its dead-letter entry counts."""
    from batchery.jobs.recover import push_copies

    factory = WorkerFactory(tiny_model_dir, private_redis, private_redis, tmp_path)
    try:
        queue = factory.new_queue()
        client = factory.client(queue)
        rows = [chat_line(f"ok{i}", f"hello number {i}") for i in range(6)]
        rows.insert(3, chat_line("poison", f"please {POISON} now"))
        job = client.submit_batch(rows)
        copies = client.jobs.pending_messages(job, [4])  # the poison is line 4: its ledger copy, queued again
        assert push_copies(redis_client(private_redis), queue, copies) == 1
        reviver = Reviver(factory, queue)  # the worker starts with both copies waiting

        def ended():
            reviver.check()
            return client.batch_status(job).is_terminal

        wait_for(ended, 240, interval=0.2, what="the job to end while its worker keeps dying")
        records = {r["custom_id"]: r for r in client.batch_results(job)}
        assert client.batch_status(job).request_counts.completed == 6
        assert reviver.exits == [EXIT_ON_CODE] * MAX_DELIVERIES, reviver.exits
        entry = DeadLetters(redis_client(private_redis), "batchery:deadletter").get(f"{job}-4")
        assert entry is not None and entry["deliveries"] == MAX_DELIVERIES, entry
        message = records["poison"]["error"]["message"]
        named = f"delivered {entry['deliveries']} times and the worker process died each time"
        assert records["poison"]["error"]["code"] == "engine_crash" and message.startswith(named), (message, entry)
        client.close()
    finally:
        factory.close()


def test_a_chat_request_that_kills_its_worker_fails_clearly_and_can_be_requeued(
    tiny_model_dir, private_redis, tmp_path
):
    factory = WorkerFactory(tiny_model_dir, private_redis, private_redis, tmp_path)
    try:
        queue = factory.new_queue()
        reviver = Reviver(factory, queue)
        client = factory.client(queue)
        innocent = client.chat([{"role": "user", "content": "hello there"}], max_tokens=400, ignore_eos=True)
        poison = client.chat([{"role": "user", "content": f"say {POISON}"}], max_tokens=3)

        def done():
            reviver.check()
            return poison.ready() and innocent.ready()

        wait_for(done, 240, interval=0.2, what="the poison chat request to fail for good")
        with pytest.raises(EngineCrash, match=rf"delivered {MAX_DELIVERIES} times and the worker process died"):
            poison.get(timeout=10)
        assert innocent.get(timeout=10).usage.completion_tokens == 400
        assert reviver.exits == [EXIT_ON_CODE] * MAX_DELIVERIES, reviver.exits

        assert poison.id in cli(private_redis, "list").stdout
        reviver.worker.kill()  # no consumer: the requeued message must wait in the queue, whole
        requeued = cli(private_redis, "requeue", "--all")
        assert requeued.returncode == 0 and f"requeued {poison.id} on {queue}" in requeued.stdout, requeued
        assert "0 dead letters" in cli(private_redis, "list").stdout
        r = redis_client(private_redis)
        waiting = [json.loads(m) for m in r.lrange(queue, 0, -1)]
        assert [m["headers"]["id"] for m in waiting] == [poison.id], waiting
        assert r.exists(f"batchery:deliveries:{poison.id}") == 0  # its count starts afresh
        client.close()
    finally:
        factory.close()


def test_cli_reports_a_missing_dead_letter_and_a_dead_redis(redis_urls):
    missing = cli(redis_urls[1], "inspect", f"no-such-{time.time()}")
    assert missing.returncode == 1 and "no dead letter" in missing.stderr, missing
    dead = cli(f"redis://127.0.0.1:{free_port()}/0", "list")
    assert dead.returncode == 1 and "Redis error" in dead.stderr and "Traceback" not in dead.stderr, dead
