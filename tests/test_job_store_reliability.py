"""Batch-job state that survives long runs, skewed clocks and a Redis that loses the job (issue 13, items 4, 9, 13),
against the real Redis and the real JobStore, submitter, client and CLI (no worker).

Everything lives in Redis DB 15 (``BATCHERY_TEST_RELIABILITY_URL``), under a per-test key prefix and queue; a test
deletes only its own keys, except the flush test, which flushes DB 15 (this module's own database) on purpose.

- Item 4: a job's TTL counts from its end. While it runs its keys never expire (a job outliving a 2 s TTL keeps its
  record, lease and ledger); at the end every key gets the TTL; the index keeps a running job older than the TTL and
  drops ended jobs once they expire; a job whose submitter died is failed and then gets its TTL.
- Item 9: every timestamp compared across processes (submitter heartbeats, lease deadlines, the repair and cancel
  checks) is the Redis server's. ``time.time`` is shifted in this process only; the server's clock decides.
- Item 13: a job hash that is gone (flushed, a replaced Redis) is never recreated by a write; a malformed one (no
  status) is never immortal; the CLI ends with a message and an exit code, never a traceback."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from conftest import RELIABILITY_URL as URL
from conftest import drop_queue_keys

from batchery import cli
from batchery.client import Client
from batchery.contract import batch
from batchery.contract.settings import Settings
from batchery.jobs.store import SUBMIT_STALE_S, JobNotFound, JobStore

SKEW_S = 130.0  # more than SUBMIT_STALE_S: a client this far off would fail a live submission on its own clock
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def req(cid: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def ok(job: str, line: int) -> dict:
    return batch.output_record(
        job, line, f"c{line}", f"{job}-{line}", {"usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    )


@pytest.fixture()
def prefix(r):
    p = f"batchery-test-rel-{uuid.uuid4().hex[:10]}"
    yield p
    keys = list(r.scan_iter(match=f"{p}:*"))
    if keys:
        r.delete(*keys)


def make_store(r, prefix: str, ttl: int = 600) -> JobStore:
    return JobStore(r, prefix, ttl=ttl)


@pytest.fixture()
def client(r, prefix):
    queue = f"batchery-test-rel-{uuid.uuid4().hex[:10]}"
    c = Client(
        settings=Settings(
            broker_url=URL, result_backend=URL, queue=queue, batch={"key_prefix": prefix, "max_line_bytes": 4096}
        )
    )
    yield c
    drop_queue_keys(r, queue)
    c.close()


def new_job(store: JobStore, total: int | None = None) -> str:
    job = f"batch_{uuid.uuid4().hex}"
    store.create(job, queue="q", model="m")
    if total is not None:
        assert store.end_submit(job, total, total) == "in_progress"
    return job


def server_now(r) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


@pytest.fixture()
def skew(monkeypatch):
    """``skew(s)``: this process's ``time.time`` runs ``s`` seconds off from here on (0 puts it back)."""
    real = time.time

    def shift(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real() + seconds)

    return shift


# -- item 4: the TTL counts from the job's end ------------------------------------------------------------------------
def test_a_job_that_runs_longer_than_its_ttl_keeps_every_key_until_it_ends(r, client):
    client.jobs.ttl = 2  # Settings bound the TTL at 60 s or more; the store takes any
    job = client.submit_batch([req("a"), req("b"), req("c")])
    store = client.jobs
    job_key, results, running, pending = store.keys(job)
    assert store.status(job).status == "in_progress"
    assert store.claim(job, 1, 600) == "run"
    assert store.write(job, 1, ok(job, 1), False) == (True, "in_progress")
    assert store.claim(job, 2, 600) == "run"
    time.sleep(3.0)  # longer than the TTL: a TTL counted from creation would have removed the job by now

    st = store.status(job)  # raised JobNotFound before the fix
    assert st.status == "in_progress" and st.request_counts.completed == 1
    for key in (job_key, results, running, pending):
        assert r.ttl(key) == -1, f"{key} expires while the job runs"
    assert store.leased_lines(job) == {2} and store.pending_lines(job) == {2, 3}
    assert [rec["custom_id"] for rec in store.iter_results(job)] == ["c1"]

    store.write(job, 2, ok(job, 2), False)
    assert store.write(job, 3, ok(job, 3), False) == (True, "completed")
    st = store.status(job)
    assert st.expires_at == pytest.approx(st.completed_at + 2, abs=0.01)
    for key in (job_key, results):
        assert 0 < r.pttl(key) <= 2000
    assert not r.exists(running, pending)
    time.sleep(2.5)
    with pytest.raises(JobNotFound):
        store.status(job)
    assert not r.exists(job_key, results, running, pending)


def test_a_cancelled_or_failed_job_gets_its_ttl_at_the_end(r, prefix):
    store = make_store(r, prefix, ttl=60)
    cancelled = new_job(store, total=3)
    assert store.claim(cancelled, 1, 600) == "run"
    store.write(cancelled, 2, ok(cancelled, 2), False)
    for key in store.keys(cancelled)[:3]:
        assert r.ttl(key) == -1
    assert store.cancel(cancelled) == "cancelling"
    assert r.ttl(store.key(cancelled)) == -1  # not ended yet: a line still runs
    assert store.release(cancelled, 1) == "cancelled"
    failed = new_job(store)
    store.write(failed, 1, ok(failed, 1), False)
    assert store.end_submit(failed, 1, 1, [{"code": "too_many_lines", "message": "x", "line": None}]) == "failed"
    for job in (cancelled, failed):
        st = store.status(job)
        assert st.expires_at == pytest.approx((st.cancelled_at or st.failed_at) + 60, abs=0.01)
        for key in store.keys(job)[:2]:
            assert 0 < r.ttl(key) <= 60
        assert not r.exists(*store.keys(job)[2:])
    # a record written after the end (a line that finished just too late) expires with its job
    store.write(cancelled, 3, ok(cancelled, 3), False)
    assert 0 < r.ttl(store.keys(cancelled)[1]) <= 60


def test_a_job_whose_submitter_died_fails_and_then_gets_its_ttl(r, prefix):
    store = make_store(r, prefix, ttl=2)
    job = new_job(store)
    store.write(job, 1, ok(job, 1), False)  # the submitter recorded a line, then died
    r.hset(store.key(job), "submit_beat", repr(server_now(r) - SUBMIT_STALE_S - 1))
    time.sleep(2.5)  # past the TTL: a TTL counted from creation would have removed the job
    st = store.status(job)  # the repair: raised JobNotFound before the fix
    assert st.status == "failed" and st.errors[0].code == "submission_interrupted"
    for key in store.keys(job)[:2]:
        assert 0 < r.pttl(key) <= 2000


def test_the_index_keeps_running_jobs_and_drops_expired_ones(r, prefix):
    store = make_store(r, prefix, ttl=1)
    running = new_job(store, total=2)
    ended = new_job(store)
    store.end_submit(ended, 0, 0, [{"code": "empty_file", "message": "x", "line": None}])
    time.sleep(1.5)  # both are older than the TTL; only the ended one has expired
    newer = new_job(store)  # creating a job prunes the index
    assert [j.id for j in store.list(10)] == [newer, running]
    assert r.zscore(store.index_key, running) is not None
    assert r.zscore(store.index_key, ended) is None


# -- item 9: the Redis server's clock decides -------------------------------------------------------------------------
@pytest.mark.parametrize("submitter_skew, reader_skew", [(0.0, SKEW_S), (-SKEW_S, 0.0)])
def test_a_skewed_client_clock_does_not_fail_a_live_submission(client, skew, submitter_skew, reader_skew):
    from batchery.jobs.submit import make_submitter

    sub = make_submitter(client)
    sub.chunk_size = 1
    seen = []

    def lines():
        yield req("a")
        yield req("b")  # the first chunk (and its heartbeat) is in
        skew(reader_skew)
        seen.append(client.batch_status(sub.job_id))  # another machine looks while the file is still read
        skew(submitter_skew)
        yield req("c")

    skew(submitter_skew)
    job = sub.run(lines())
    skew(0.0)
    assert seen[0].status == "validating", seen[0].errors  # before the fix: failed, submission_interrupted
    st = client.batch_status(job)
    assert st.status == "in_progress" and st.request_counts.total == 3


def test_status_from_a_clock_ahead_does_not_fail_a_validating_job(r, prefix, skew):
    store = make_store(r, prefix)
    job = new_job(store)
    skew(SKEW_S)
    st = store.status(job)
    assert st.status == "validating", st.errors  # before the fix: failed, submission_interrupted


def test_lease_deadlines_are_server_time(r, prefix, skew):
    store = make_store(r, prefix)
    job = new_job(store, total=2)
    skew(-SKEW_S)  # a worker whose clock is behind takes a 60 s lease
    assert store.claim(job, 1, 60) == "run"
    deadline = float(r.hget(store.keys(job)[2], "1"))
    assert deadline == pytest.approx(server_now(r) + 60, abs=2)
    skew(SKEW_S)  # a client whose clock is ahead sees the lease as live and cancels
    assert store.leased_lines(job) == {1}
    assert store.cancel(job) == "cancelling"  # before the fix: cancelled at once, the line still running
    skew(0.0)
    assert store.release(job, 1) == "cancelled"
    st = store.status(job)
    assert st.cancelling_at <= st.cancelled_at <= server_now(r) + 0.01


def test_every_timestamp_is_server_time(r, prefix, skew):
    store = make_store(r, prefix)
    skew(-3600.0)
    job = new_job(store)
    assert store.claim(job, 1, 60) == "run"
    store.end_submit(job, 1, 1)
    store.write(job, 1, ok(job, 1), False)
    skew(0.0)
    st = store.status(job)
    now = server_now(r)
    for name in ("created_at", "started_at", "in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(st, name) == pytest.approx(now, abs=5), name
    assert float(r.hget(store.key(job), "submit_beat")) == pytest.approx(now, abs=5)
    assert r.zscore(store.index_key, job) == pytest.approx(now, abs=5)


# -- item 13: a job that is gone or malformed -------------------------------------------------------------------------
def test_a_redis_flushed_mid_submit_leaves_no_malformed_job(r, client):
    from batchery.jobs.submit import make_submitter

    sub = make_submitter(client)
    sub.chunk_size = 1

    def lines():
        yield req("a")
        yield req("b")
        r.flushdb()  # DB 15 is this module's own
        yield req("c")
        yield req("d")

    with pytest.raises(JobNotFound, match="flushed or replaced"):
        sub.run(lines())
    assert not r.exists(*client.jobs.keys(sub.job_id))  # before the fix: a hash of total/max_line, no id or status
    with pytest.raises(JobNotFound):
        client.batch_status(sub.job_id)


def test_no_script_writes_to_a_job_that_is_gone(r, prefix):
    store = make_store(r, prefix)
    job = new_job(store, total=2)
    store.r.delete(*store.keys(job))
    assert store.claim(job, 1, 60) == "gone"
    assert store.write(job, 1, ok(job, 1), False) == (False, "gone")
    assert store.release(job, 1) == "gone"
    assert store.end_submit(job, 2, 2) == "gone"
    assert store.finalize(job) == "gone"
    with pytest.raises(JobNotFound):
        store.cancel(job)
    with r.pipeline(transaction=False) as p:
        store.ledger_in(p, job, [(1, "{}")])
        store.queue_chunk(p, job, 1, 1)
        assert p.execute()[-1] is None  # the chunk's status read: no job
    assert not r.exists(*store.keys(job))


def _cli(monkeypatch, capsys, prefix: str, *argv: str) -> tuple[int, str]:
    monkeypatch.setenv("BATCHERY_BROKER_URL", URL)
    monkeypatch.setenv("BATCHERY_RESULT_BACKEND", URL)
    monkeypatch.setenv("BATCHERY_BATCH__KEY_PREFIX", prefix)
    monkeypatch.setenv("BATCHERY_BATCH__TTL", "600")
    rc = cli.main(["batch", *argv])  # a traceback would be an exception here
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_cli_on_a_malformed_or_gone_job_says_so(r, prefix, monkeypatch, capsys, tmp_path):
    store = make_store(r, prefix)
    good = new_job(store, total=1)
    bad = f"batch_{uuid.uuid4().hex}"
    r.hset(store.key(bad), mapping={"total": 3, "max_line": 3})  # what a write on a flushed Redis used to leave
    r.zadd(store.index_key, {bad: server_now(r)})
    for argv in (
        ("status", bad),
        ("status", "--json", bad),
        ("wait", "--timeout", "1", "--no-progress", bad),
        ("results", "-o", str(tmp_path / "out.jsonl"), bad),
        ("cancel", bad),
    ):
        rc, text = _cli(monkeypatch, capsys, prefix, *argv)
        assert rc == 1, (argv, text)  # before the fix: KeyError: 'id' from status
        assert f"batch job {bad!r} is malformed" in text and "Traceback" not in text, (argv, text)
    assert 0 < r.ttl(store.key(bad)) <= 600  # not immortal: it expires like an ended job
    assert not (tmp_path / "out.jsonl").exists()

    rc, text = _cli(monkeypatch, capsys, prefix, "list", "--json")
    assert rc == 0 and [j["id"] for j in json.loads(text)] == [good]
    rc, text = _cli(monkeypatch, capsys, prefix, "status", good)
    assert rc == 0 and "expires:   BATCHERY_BATCH__TTL after it ends" in text  # a running job does not expire

    r.delete(*store.keys(good))
    for argv in (("status", good), ("cancel", good), ("results", good), ("wait", "--timeout", "1", good)):
        rc, text = _cli(monkeypatch, capsys, prefix, *argv)
        assert rc == 1 and f"no batch job {good!r}" in text and "Traceback" not in text, (argv, text)


def test_the_cli_on_an_unreachable_redis_says_so(prefix, monkeypatch, capsys):
    from conftest import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    monkeypatch.setenv("BATCHERY_BROKER_URL", url)
    monkeypatch.setenv("BATCHERY_RESULT_BACKEND", url)
    for argv in (("status", "batch_x"), ("list",)):
        rc = cli.main(["batch", *argv])
        err = capsys.readouterr().err
        assert rc == 1 and "Redis error: ConnectionError" in err and "Traceback" not in err, (argv, err)


def test_a_large_chunk_goes_into_the_ledger_whole(r, prefix):
    store = make_store(r, prefix)
    job = new_job(store)
    with r.pipeline(transaction=False) as p:
        store.ledger_in(p, job, [(n, f"m{n}") for n in range(1, 10_001)])  # 20,000 arguments
        store.queue_chunk(p, job, 10_000, 10_000)
        assert p.execute() == [1, b"validating"]
    assert len(store.pending_lines(job)) == 10_000 and store.pending_messages(job, [10_000]) == {10_000: "m10000"}
