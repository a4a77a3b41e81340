"""How fast the web console's pages answer with a full store (issue 40: under 200 ms p99 with 1,000 jobs and 20
workers).

    .venv/bin/python benchmarks/console_pages.py [--jobs 1000] [--workers 20] [--requests 200]

On the Redis of ``BATCHERY_BENCH_REDIS`` (default redis://127.0.0.1:6379/15), under key prefixes of its own (deleted
at the end): ``--jobs`` jobs in the job store (a third running, the rest completed, failed or cancelled; half of them
the API batches of one key, with metadata), ``--workers`` workers announced on one queue with their engine snapshot,
and ``create_app`` under uvicorn on a real socket. Then each page is fetched ``--requests`` times in turn (the
operator's jobs list, a status filter, page 20, a job, the workers; the key's own list and job) and its p50 and p99
printed. Exit 1 when a p99 is over ``--limit-ms`` (200)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
import uuid

KEY = "sk-bench-console-" + "7" * 16
OPERATOR = "op-bench-console-" + "8" * 16


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def fill(settings, num_jobs: int, num_workers: int) -> tuple[list[str], list[str]]:
    """The jobs and the workers' announcements; returns every job's id and those of KEY's batches."""
    import redis

    from batchery.api.auth import tenant_id
    from batchery.broker import presence
    from batchery.jobs.store import JobStore, new_job_id

    r = redis.Redis.from_url(settings.result_backend)
    store = JobStore(r, settings.batch.key_prefix, settings.batch.ttl)
    tenant = tenant_id(KEY)
    api = settings.api.key_prefix
    now = store.server_time()
    ids, own = [], []
    rng = random.Random(0)
    for n in range(num_jobs):
        job_id = new_job_id()
        store.create(job_id, queue=str(settings.queue), model="bench-model", metadata={"n": str(n)})
        total = rng.randint(10, 100_000)
        status = ["in_progress", "completed", "failed", "cancelled"][n % 4 if n % 3 else 0]
        done = total if status == "completed" else rng.randint(0, total)
        failed = done // 50
        fields = {
            "status": status,
            "total": total,
            "completed": done - failed,
            "failed": failed,
            "completion_tokens": done * 40,
            "prompt_tokens": done * 60,
            "in_progress_at": repr(now - 600),
            "started_at": repr(now - 590),
        }
        if status != "in_progress":
            fields[f"{status}_at"] = repr(now - 10)
        r.hset(store.key(job_id), mapping=fields)
        if n % 2 == 0:  # an API batch of KEY's, files already written
            meta = {
                "id": job_id,
                "tenant": tenant,
                "input_file_id": "file-bench",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": json.dumps({"project": "bench", "n": str(n)}),
                "created_at": repr(now),
                "files_done": "1",
            }
            r.hset(f"{api}:batch:{job_id}", mapping=meta)
            r.zadd(f"{api}:batches:{tenant}", {job_id: now + n * 1e-3})
            own.append(job_id)
        ids.append(job_id)
    broker = redis.Redis.from_url(settings.broker_url)
    for n in range(num_workers):
        info = {
            "model": "bench-model",
            "state": "serving",
            "batch_size": 30.0,
            "steps_per_s": 40.0,
            "kv_blocks_total": 1000,
            "kv_blocks_used": 400,
            "num_rebuilds": 0,
            "announced_at": time.time(),
        }
        presence.announce(broker, str(settings.queue), f"bench-{n}@{settings.queue}", info, ttl_s=600)
    return ids, own


def clean(settings, num_workers: int) -> None:
    import redis

    from batchery.broker import presence

    r = redis.Redis.from_url(settings.result_backend)
    for prefix in (settings.batch.key_prefix, settings.api.key_prefix):
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 1000):
            r.delete(*keys[i : i + 1000])
    broker = redis.Redis.from_url(settings.broker_url)
    for n in range(num_workers):
        presence.withdraw(broker, str(settings.queue), f"bench-{n}@{settings.queue}")


def serve(settings):
    import uvicorn

    from batchery.api.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, sock.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=20)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--limit-ms", type=float, default=200.0)
    args = ap.parse_args()

    from batchery.contract.settings import Settings

    url = os.environ.get("BATCHERY_BENCH_REDIS", "redis://127.0.0.1:6379/15")
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        broker_url=url,
        result_backend=url,
        queue=f"bench-console-{tag}",
        batch={"key_prefix": f"bench:console:{tag}:batch"},
        api={"key_prefix": f"bench:console:{tag}:api", "keys": KEY, "operator_keys": OPERATOR},
    )
    t0 = time.monotonic()
    ids, own = fill(settings, args.jobs, args.workers)
    print(f"{args.jobs} jobs and {args.workers} workers written in {time.monotonic() - t0:.1f} s ({url})")
    server, thread, port = serve(settings)
    pages = [
        ("operator /", OPERATOR, "/"),
        ("operator /?status=in_progress", OPERATOR, "/?status=in_progress"),
        ("operator /?page=20", OPERATOR, "/?page=20"),
        ("operator /jobs/{id}", OPERATOR, f"/jobs/{ids[len(ids) // 2]}"),
        ("operator /workers", OPERATOR, "/workers"),
        ("operator /workers?fragment=1", OPERATOR, "/workers?fragment=1"),
        ("key /", KEY, "/"),
        ("key /jobs/{id}", KEY, f"/jobs/{own[len(own) // 2]}"),
    ]
    worst = 0.0
    try:
        print(f"{'page':34} {'status':>6} {'p50 ms':>8} {'p99 ms':>8} {'bytes':>8}")
        for name, key, path in pages:
            times = []
            status, size = 0, 0
            for _ in range(args.requests):
                # a connection per request, as a page load's first request: on a kept-alive one, uvicorn's separate
                # writes of headers and body meet the client's delayed ACK (a flat ~40 ms, even for /healthz)
                t = time.perf_counter()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", path, headers={"Cookie": f"batchery_console={key}"})
                resp = conn.getresponse()
                body = resp.read()
                conn.close()
                times.append((time.perf_counter() - t) * 1000)
                status, size = resp.status, len(body)
            p99 = percentile(times, 0.99)
            worst = max(worst, p99)
            print(f"{name:34} {status:>6} {statistics.median(times):8.1f} {p99:8.1f} {size:8d}")
    finally:
        server.should_exit = True
        thread.join(10)
        clean(settings, args.workers)
    ok = worst <= args.limit_ms
    print(f"worst p99 {worst:.1f} ms: {'OK' if ok else 'OVER'} the {args.limit_ms:g} ms limit")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
