"""Big batch jobs (``batchery.jobs.submit``'s window, ``batchery.jobs.feeder``), with real ``batchery worker``
processes on the tiny model and the real Redis:

1. a job larger than its window never has more than a window of lines queued or running; the submitter hands it
   off after the first window and a worker feeds the rest from the store; every line gets exactly one record;
2. the worker feeding a job is SIGKILLed: another worker takes the lease over and the job completes, exactly once;
3. the store's configuration errors: a store that cannot be written, an unsupported URL (clear errors at submit,
   nothing created); a small job never touches the store; a worker that cannot read the input fails the job with
   ``input_unreadable``."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import redis_client, wait_for

from batchery.jobs.storage import StorageError
from batchery.jobs.submit import input_key

pytestmark = pytest.mark.integration

WINDOW = 40  # lines of a job queued or running at once, in these tests
DRAIN_AT = 30  # records a running job keeps in Redis before the workers move them to the store, in these tests


def lines(n: int, prefix: str = "r") -> list[str]:
    return [
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"hello world {i}"}], "max_tokens": 2},
            }
        )
        for i in range(n)
    ]


def write_file(path, rows: list[str]):
    path.write_text("\n".join(rows) + "\n")
    return path


def client_for(workers, queue: str, store, **batch):
    c = workers.client(queue)
    c.settings.storage_url = str(store)
    c.settings.batch.window_min = batch.get("window_min", WINDOW)
    c.settings.batch.window_max = batch.get("window_max", WINDOW)
    return c


def spawn(workers, queue: str, store, **overrides):
    return workers.spawn(
        queue,
        BATCHERY_STORAGE_URL=str(store),
        BATCHERY_BATCH__WINDOW_MIN=WINDOW,
        BATCHERY_BATCH__WINDOW_MAX=WINDOW,
        BATCHERY_BATCH__FEEDER_LEASE_S=3,
        BATCHERY_BATCH__DRAIN_AT=DRAIN_AT,
        BATCHERY_MAX_NUM_SEQS=8,
        BATCHERY_CONCURRENCY=8,
        **overrides,
    )


class Outstanding(threading.Thread):
    """Samples, until stopped, the most lines of a job counted but not recorded (queued or running), and the most
    records it held in Redis."""

    def __init__(self, client, job: str) -> None:
        super().__init__(daemon=True)
        self.r = client.jobs.r
        self.key = client.jobs.key(job)
        self.results = client.jobs.keys(job)[1]
        self.peak = 0
        self.peak_records = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            total, done, failed = self.r.hmget(self.key, ["total", "completed", "failed"])
            self.peak = max(self.peak, int(total or 0) - int(done or 0) - int(failed or 0))
            self.peak_records = max(self.peak_records, self.r.hlen(self.results))
            time.sleep(0.01)


def check_exactly_once(c, job: str, n: int, prefix: str = "r") -> None:
    records = list(c.batch_results(job))
    ids = [r["custom_id"] for r in records]
    assert ids == [f"{prefix}-{i}" for i in range(n)], "every line exactly once, in input order"
    assert all(r["error"] is None for r in records)


def test_a_job_bigger_than_its_window_is_fed_by_a_worker_a_window_at_a_time(workers, tmp_path):
    store = tmp_path / "store"
    q = workers.new_queue()
    w = spawn(workers, q, store, BATCHERY_FAULTS="tokenize_delay:0.02")  # at most 50 lines/s: the job runs ~8 s
    c = client_for(workers, q, store)
    path = write_file(tmp_path / "in.jsonl", lines(400))
    job = c.submit_batch(path)
    st = c.batch_status(job)
    assert st.status == "validating" and st.request_counts.total <= WINDOW, "handed off after the first window"
    assert (store / input_key(job)).is_file(), "the input is in the store for the worker to feed on"
    watch = Outstanding(c, job)
    watch.start()
    try:
        st = c.wait_batch(job, timeout=120)
    finally:
        watch.halt.set()
        watch.join()
    assert st.status == "completed" and st.request_counts.total == 400 and st.request_counts.completed == 400
    assert watch.peak <= WINDOW, f"{watch.peak} lines queued or running at once, above the window of {WINDOW}"
    runs = c.jobs.r.lrange(c.jobs._k(job)[5], 0, -1)
    assert runs, "the workers moved records to the store while the job ran"
    assert c.jobs.r.hlen(c.jobs.keys(job)[1]) < 400 - DRAIN_AT, "most records left Redis"
    # the drainers run each second: what Redis holds is bounded by drain_at and a second or two of records
    assert watch.peak_records <= DRAIN_AT + 120, f"Redis held {watch.peak_records} of the job's 400 records at once"
    check_exactly_once(c, job, 400)
    wait_for(lambda: not (store / input_key(job)).exists(), 10, what="the input's copy deleted once fed")
    assert job not in c.jobs.handed_off()
    assert w.count("took over its submission") == 1
    c.close()


def test_the_feeding_worker_killed_another_takes_the_job_over(workers, tmp_path):
    store = tmp_path / "store"
    q = workers.new_queue()
    # slow lines, so that the job is still being fed when its feeder dies; the lines the dead worker held come back
    # after the visibility timeout, as after any worker loss
    slow = dict(
        BATCHERY_FAULTS="tokenize_delay:0.02",
        BATCHERY_VISIBILITY_TIMEOUT=20,
        BATCHERY_TASK_TIMEOUT=10,
        BATCHERY_MAX_TASK_TIMEOUT=10,
    )
    a = spawn(workers, q, store, **slow)
    b = spawn(workers, q, store, **slow)
    c = client_for(workers, q, store)
    path = write_file(tmp_path / "in.jsonl", lines(600))
    job = c.submit_batch(path)
    feeder = wait_for(
        lambda: next((w for w in (a, b) if w.count("took over its submission")), None), 30, what="a feeder"
    )
    wait_for(lambda: c.batch_status(job).request_counts.total > 3 * WINDOW, 60, what="the feeder to feed a while")
    feeder.kill()
    other = b if feeder is a else a
    st = c.wait_batch(job, timeout=240)
    assert st.status == "completed" and st.request_counts.completed == 600
    assert other.count("took over its submission") == 1, "the survivor took the lease over"
    check_exactly_once(c, job, 600)
    c.close()


def test_store_errors_are_clear_at_submit_and_create_nothing(workers, tmp_path):
    q = workers.new_queue()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path = write_file(tmp_path / "in.jsonl", lines(100))
    for url, words in ((str(blocker / "store"), "not a writable directory"), ("s3://bucket/x", "scheme 's3'")):
        c = client_for(workers, q, url)
        before = {j.id for j in c.list_batches(1000)}
        queued = redis_client(workers.broker).llen(q)
        with pytest.raises(StorageError, match=words):
            c.submit_batch(path)
        assert {j.id for j in c.list_batches(1000)} == before, "no job was created"
        assert redis_client(workers.broker).llen(q) == queued, "nothing was queued"
        # a job that fits its window never needs the store
        small = c.submit_batch(write_file(tmp_path / "small.jsonl", lines(WINDOW - 1)))
        assert c.batch_status(small).request_counts.total == WINDOW - 1
        c.cancel_batch(small)
        c.close()


def test_a_worker_that_cannot_read_the_input_fails_the_job_clearly(workers, tmp_path):
    q = workers.new_queue()
    spawn(workers, q, tmp_path / "the-workers-store")
    c = client_for(workers, q, tmp_path / "the-submitters-store")
    job = c.submit_batch(write_file(tmp_path / "in.jsonl", lines(200)))
    st = wait_for(lambda: (s := c.batch_status(job)).status == "failed" and s, 30, what="the job to fail")
    assert st.errors[0].code == "input_unreadable"
    assert "BATCHERY_STORAGE_URL" in st.errors[0].message and "share one store" in st.errors[0].message
    c.close()
