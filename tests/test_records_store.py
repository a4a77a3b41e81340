"""A job's records move from Redis to the file store while it runs (``batchery.jobs.records``, issue 37), against the
real Redis (DB 15, a per-test key prefix) and a real directory store, with the real JobStore and drainers (no worker):

- a running job that holds ``drain_at`` records joins the drain set; a drain moves them, sorted, into one run in the
  store, and they leave Redis; what Redis keeps stays bounded however many lines the job has;
- exactly once after a drain: a redelivered line's write is refused and its claim answers ``done`` (the done
  bitmap), the counts do not move;
- the merged read is every record once, in input order, whichever order the lines finished in and however the runs
  overlap; a run no list names (a drainer that died before its commit) is never read;
- fencing: a drainer whose lock was lost, or whose sequence number another run took, commits nothing; once a job has
  ended no drain commits, so its layout never changes;
- a reader without the store gets a clear error naming the setting; a run missing from the store likewise."""

from __future__ import annotations

import random
import uuid

import pytest

from batchery.contract import batch
from batchery.contract.settings import Settings
from batchery.jobs.records import Drainers, merge, parse_run, run_name, write_run
from batchery.jobs.storage import LocalStorage, StorageError
from batchery.jobs.store import JobStore


@pytest.fixture()
def env(r, tmp_path):
    prefix = f"batchery-test-rec-{uuid.uuid4().hex[:10]}"
    queue = f"q-{uuid.uuid4().hex[:8]}"
    store = JobStore(r, prefix, ttl=600, drain_at=10)
    storage = LocalStorage(tmp_path / "store")
    settings = Settings(queue=queue, storage_url=str(tmp_path / "store"))
    yield store, storage, Drainers(store, settings, storage=storage, limit=25), queue
    for key in r.scan_iter(f"{prefix}:*"):
        r.delete(key)


def record(job: str, line: int) -> dict:
    return batch.output_record(job, line, f"c{line}", f"{job}-{line}", {"usage": {"prompt_tokens": 1}})


def running_job(store: JobStore, queue: str, n: int) -> str:
    job = f"batch_{uuid.uuid4().hex}"
    store.create(job, queue=queue, model=None)
    with store.r.pipeline() as p:
        store.queue_chunk(p, job, n, n)
        p.execute()
    assert store.end_submit(job, n, n) == "in_progress"
    return job


def test_records_drain_to_sorted_runs_and_read_back_in_order_exactly_once(env):
    store, storage, drainers, queue = env
    n = 100
    job = running_job(store, queue, n)
    order = list(range(1, n + 1))
    random.Random(7).shuffle(order)
    peak = 0
    for i, line in enumerate(order[:-1]):
        assert store.write(job, line, record(job, line), False, 1) == (True, "in_progress")
        if i % 7 == 6:
            drainers.tick()
        peak = max(peak, store.r.hlen(store.keys(job)[1]))
    assert peak <= 10 + 7, f"Redis held {peak} records, more than drain_at and one tick's worth"
    runs = [parse_run(e) for e in store.r.lrange(store._k(job)[5], 0, -1)]
    assert len(runs) >= 5 and all(first <= last for _, first, last, _ in runs)
    assert sum(count for *_, count in runs) + store.r.hlen(store.keys(job)[1]) == n - 1
    for name, *_ in runs:
        lines = [int(raw.split(b"\t")[0]) for raw in storage.open(name)]
        assert lines == sorted(lines), "a run is sorted by line"

    # a redelivered line (drained already) finds its record: no second record, no count
    drained = runs[0][1]
    assert store.write(job, drained, record(job, drained), False, 1) == (False, "in_progress")
    assert store.claim(job, drained, 60) == "done"
    st = store.status(job)
    assert st.request_counts.completed == n - 1 and st.usage.prompt_tokens == n - 1
    assert store.recorded(job, drained) and not store.recorded(job, order[-1])

    assert store.write(job, order[-1], record(job, order[-1]), False, 1) == (True, "completed")
    ids = [rec["custom_id"] for rec in store.iter_results(job, chunk=3, storage=storage)]
    assert ids == [f"c{i}" for i in range(1, n + 1)]
    drainers.tick()  # an ended job is never drained again: its layout is final
    assert store.r.llen(store._k(job)[5]) == len(runs)
    assert not store.r.sismember(store.drain_set_key, job)
    assert store.r.ttl(store._k(job)[4]) > 0 and store.r.ttl(store._k(job)[5]) > 0, "bitmap and runs get the TTL"


def test_a_run_no_list_names_is_never_read_and_a_fenced_drainer_commits_nothing(env):
    store, storage, drainers, queue = env
    job = running_job(store, queue, 40)
    for line in range(1, 21):
        store.write(job, line, record(job, line), False)
    # a drainer that died after writing its run but before the commit: an orphan with its own token in the name
    orphan = run_name(job, 0, "deadbeef" * 2)
    write_run(storage, orphan, [(1, b'{"custom_id":"ghost"}')])
    # a drainer that lost its lock commits nothing
    keys = store._k(job)
    lock = f"{store.key(job)}:draining"
    store.r.set(lock, "someone-else")
    args = ["mine", 0, f"{run_name(job, 0, 'mine')} 1 2 2", store.drain_at, job, "1", "2"]
    assert store._drain_commit(keys=keys + [lock, store.drain_set_key], args=args) == b"lost"
    store.r.set(lock, "mine")
    assert store._drain_commit(keys=keys + [lock, store.drain_set_key], args=[*args[:1], 5, *args[2:]]) == b"stale"
    store.r.delete(lock)
    assert store.r.hlen(keys[1]) == 20 and store.r.llen(keys[5]) == 0, "refused commits moved nothing"

    assert drainers.tick() == 20
    for line in range(21, 41):
        store.write(job, line, record(job, line), False)
    ids = [rec["custom_id"] for rec in store.iter_results(job, storage=storage)]
    assert ids == [f"c{i}" for i in range(1, 41)], "the orphan run is not read; every record once"
    assert storage.local_path(orphan).exists()


def test_reading_without_the_store_or_with_a_run_missing_is_a_clear_error(env, tmp_path):
    store, storage, drainers, queue = env
    job = running_job(store, queue, 12)
    for line in range(1, 13):
        store.write(job, line, record(job, line), False)
    assert store.status(job).status == "completed"  # drained only while running: nothing moved yet
    job = running_job(store, queue, 30)
    for line in range(1, 13):
        store.write(job, line, record(job, line), False)
    assert drainers.tick() == 12
    with pytest.raises(StorageError, match="BATCHERY_STORAGE_URL"):
        list(store.iter_results(job))
    name = parse_run(store.r.lindex(store._k(job)[5], 0))[0]
    storage.delete(name)
    with pytest.raises(StorageError, match="missing from the store"):
        list(store.iter_results(job, storage=storage))


def test_the_merge_opens_nearly_disjoint_runs_a_few_at_a_time():
    opened: list[int] = []
    live = {"now": 0, "peak": 0}

    def run(k: int):
        def gen():
            opened.append(k)
            live["now"] += 1
            live["peak"] = max(live["peak"], live["now"])
            try:
                for line in range(k * 100 + 1, k * 100 + 106):  # each run overlaps the next by 5 lines
                    yield line, b"%d" % line
            finally:
                live["now"] -= 1

        return k * 100 + 1, gen

    out = [line for line, _ in merge([run(k) for k in range(50)])]
    assert out == sorted(set(out)) and len(out) == 50 * 100 + 5
    assert opened == list(range(50)) and live["peak"] <= 2


def test_the_sweep_deletes_only_the_runs_no_job_needs(env):
    store, storage, drainers, queue = env
    running = running_job(store, queue, 40)
    ended = running_job(store, queue, 40)
    for job in (running, ended):
        for line in range(1, 21):
            store.write(job, line, record(job, line), False)
    assert drainers.tick() == 40
    for line in range(21, 41):
        store.write(ended, line, record(ended, line), False)
    assert store.status(ended).status == "completed"
    gone = f"batch_{uuid.uuid4().hex}"
    orphans = {job: run_name(job, 9, uuid.uuid4().hex) for job in (running, ended, gone)}
    for name in orphans.values():
        write_run(storage, name, [(1, b"{}")])
    listed = {job: parse_run(store.r.lindex(store._k(job)[5], 0))[0] for job in (running, ended)}

    assert drainers.sweep() == 2
    assert storage.local_path(orphans[running]).exists(), "a running job's unlisted run may be about to commit"
    assert not storage.local_path(orphans[ended]).exists() and not storage.local_path(orphans[gone]).exists()
    assert all(storage.local_path(name).exists() for name in listed.values())
    store.delete(ended)  # as its TTL would
    assert drainers.sweep() == 1 and not storage.local_path(listed[ended]).exists()
