"""`batchery serve` under load, with the official openai SDK as the client.

    python benchmarks/api_batches.py [--lines 100000] [--pollers 200] [--polls 5]

Starts `batchery serve` as its own process against the Redis at $BATCHERY_BROKER_URL (default
redis://127.0.0.1:6379/0) on a queue nobody consumes (so the lines stay queued, and are cancelled
and deleted at the end), then:
1. uploads a ``--lines``-line chat batch file (``files.create``) and creates the batch
   (``batches.create``), and polls until the submission is done (status ``in_progress``): lines per
   second for upload alone, and for upload + create + validation;
2. ``--pollers`` concurrent clients each call ``batches.retrieve`` ``--polls`` times: latency p50
   and p99;
3. the server process's peak RSS (VmHWM) over the whole run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def write_file(path: str, n: int) -> int:
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Question {i}: why?"}]}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
            f.write("\n")
    return os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--pollers", type=int, default=200)
    ap.add_argument("--polls", type=int, default=5)
    args = ap.parse_args()

    import openai

    broker = os.environ.get("BATCHERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="batchery-api-bench-")
    key = "bench-key-" + os.urandom(4).hex()
    env = dict(
        os.environ,
        BATCHERY_BROKER_URL=broker,
        BATCHERY_QUEUE="batchery.bench-nobody-" + os.urandom(3).hex(),
        BATCHERY_API__KEYS=key,
        BATCHERY_API__STORAGE_DIR=os.path.join(tmp, "files"),
        BATCHERY_API__KEY_PREFIX="batchery:apibench:" + os.urandom(3).hex(),
        BATCHERY_BATCH__KEY_PREFIX="batchery:apibench-jobs:" + os.urandom(3).hex(),
        BATCHERY_BATCH__MAX_LINES=str(max(args.lines, 100_000)),
    )
    log = open(os.path.join(tmp, "serve.log"), "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "batchery", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=600)
    try:
        for _ in range(300):
            try:
                client.batches.list(limit=1)
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        path = os.path.join(tmp, "input.jsonl")
        size = write_file(path, args.lines)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            up = client.files.create(file=f, purpose="batch")
        t_up = time.perf_counter() - t0
        batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
        while batch.status == "validating":
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
        t_all = time.perf_counter() - t0
        total = batch.request_counts.total if batch.request_counts else None
        print(f"{args.lines} lines ({size / 1e6:.1f} MB): upload {t_up:.2f} s = {args.lines / t_up:,.0f} lines/s")
        print(
            f"  upload + create + validation (status {batch.status}, total {total}): {t_all:.2f} s = "
            f"{args.lines / t_all:,.0f} lines/s"
        )

        async def pollers() -> list[float]:
            ac = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
            lat: list[float] = []

            async def one() -> None:
                for _ in range(args.polls):
                    s = time.perf_counter()
                    await ac.batches.retrieve(batch.id)
                    lat.append(time.perf_counter() - s)

            s = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(args.pollers)))
            wall = time.perf_counter() - s
            await ac.close()
            print(f"  {args.pollers} concurrent pollers x {args.polls}: {len(lat) / wall:,.0f} retrieves/s")
            return lat

        lat = sorted(asyncio.run(pollers()))
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"  retrieve latency: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
        print(f"  server peak RSS: {peak_rss_mb(server.pid):.0f} MB")
        client.batches.cancel(batch.id)
        client.files.delete(up.id)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        drop_queue(broker, env["BATCHERY_QUEUE"], env["BATCHERY_API__KEY_PREFIX"], env["BATCHERY_BATCH__KEY_PREFIX"])


def drop_queue(broker: str, queue: str, *prefixes: str) -> None:
    """Delete what the run left in Redis: the unconsumed queue's messages and the API's records."""
    import redis

    from batchery.broker.queues import queue_keys

    r = redis.Redis.from_url(broker)
    keys = queue_keys(queue) + list(r.scan_iter(match=f"_kombu.binding*{queue}"))
    for prefix in prefixes:
        keys += list(r.scan_iter(match=f"{prefix}*"))
    if keys:
        r.delete(*keys)


if __name__ == "__main__":
    main()
