"""Batch submission benchmark: generate a JSONL file of OpenAI Batch lines (100,000 by default),
submit it against the local Redis with ``Client.submit_batch`` (streaming read, per-line
validation, bulk enqueue), and print:

- lines per second (target: at least 5,000 on the dev machine);
- the client's peak RSS (``resource.getrusage``; target: under 300 MB);
- the Redis memory per 1,000 queued lines (the queue's list plus the job's keys, by ``MEMORY
  USAGE``; and the server's ``used_memory`` growth, which other clients of the server can blur).

It uses its own Redis database, queue and key prefix, never starts a worker, and deletes what it
created. Usage::

    .venv/bin/python benchmarks/batch_submit.py [--lines 100000] [--redis redis://127.0.0.1:6379/11]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = (
    "summarize this text about the cat and the dog by the sea in three short points for a busy "
    "reader who wants the gist and nothing more please"
).split()


def generate(path: Path, n: int, invalid_every: int = 200) -> int:
    """Write ``n`` lines, one in ``invalid_every`` of them invalid; returns the file size."""
    with open(path, "w") as f:
        for i in range(n):
            if invalid_every and i % invalid_every == invalid_every - 1:
                f.write(
                    f'{{"custom_id": "broken-{i}", "method": "POST", "url": "/v1/chat/completions", '
                    '"body": {"messages": [], "max_tokens": 0}}\n'
                )
                continue
            k = 8 + i % 17
            content = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)) + f" (item {i})"
            line = {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [
                        {"role": "system", "content": "You are concise."},
                        {"role": "user", "content": content},
                    ],
                    "max_tokens": 64,
                    "temperature": 0.7,
                    "seed": i,
                },
            }
            f.write(json.dumps(line) + "\n")
    return path.stat().st_size


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument(
        "--redis",
        default=os.environ.get("BATCHERY_BENCH_REDIS", "redis://127.0.0.1:6379/11"),
        help="broker and job store (its own database; default db 11)",
    )
    args = ap.parse_args(argv)

    from batchery.broker.connection import redis_from_url
    from batchery.client import Client
    from batchery.contract.settings import Settings

    tag = uuid.uuid4().hex[:8]
    queue, prefix = f"bench-submit-{tag}", f"bench-submit-{tag}"
    settings = Settings(
        broker_url=args.redis,
        result_backend=args.redis,
        queue=queue,
        batch={"key_prefix": prefix, "max_lines": max(args.lines, 1), "ttl": 3600},
    )
    r = redis_from_url(args.redis)
    r.ping()
    client = Client(settings=settings)
    with tempfile.TemporaryDirectory(prefix="batch-submit-") as tmp:
        path = Path(tmp) / "input.jsonl"
        size = generate(path, args.lines)
        base_rss = rss_mb()
        used_before = r.info("memory")["used_memory"]
        t0 = time.perf_counter()
        job_id = client.submit_batch(path)
        wall = time.perf_counter() - t0
        peak_rss = rss_mb()
        used_after = r.info("memory")["used_memory"]
        try:
            job = client.batch_status(job_id)
            queued = r.llen(queue)
            keys = [queue, *client.jobs.keys(job_id)]
            key_bytes = sum(r.memory_usage(k, samples=0) or 0 for k in keys)
            queue_bytes = r.memory_usage(queue, samples=0) or 0
            rc = job.request_counts
            print(f"input: {args.lines} lines, {size / 1e6:.1f} MB ({rc.failed} invalid); job {job_id} {job.status}")
            print(f"submit: {wall:.2f} s -> {args.lines / wall:,.0f} lines/s (target >= 5,000)")
            print(f"client peak RSS: {peak_rss:.0f} MB (before submitting: {base_rss:.0f} MB; target < 300 MB)")
            print(
                f"redis: {queued} messages queued; {queue_bytes / queued * 1000 / 1e6:.2f} MB per 1,000 queued "
                f"lines in the queue, {key_bytes / queued * 1000 / 1e6:.2f} MB with the job's keys "
                f"(MEMORY USAGE); used_memory grew {(used_after - used_before) / queued * 1000 / 1e6:.2f} MB "
                "per 1,000"
            )
            assert queued == rc.total - rc.failed, "every valid line is on the queue"
        finally:
            r.delete(queue)
            client.jobs.delete(job_id)
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
