"""What does the queue cost? The engine's reference workload, run twice in one go:

1. directly on an ``LLMEngine`` in this process (tokenize, add every request, step until done);
2. through ``Client`` -> Redis -> a ``batchery worker`` subprocess -> Redis -> ``Client``.

Prints both throughputs (generated tokens per second of wall time), their ratio (target >= 0.90),
and the p50/p99 of the time the queue adds to each request:

    added = (engine_added_at - enqueued_at) + (received_at - engine_finished_at)

i.e. publish, broker, worker fetch, validation and hand-off to the engine loop on the way in
(which includes waiting for the engine's current step to end: long steps on a CPU make this
the biggest part; the printed breakdown shows it); result shaping, the result backend and the
client wake-up on the way out. ``received_at`` is taken by a Redis pub/sub listener on the
results' channels, so the order in which the benchmark collects results does not inflate it.
The worker's own batching, step count and time per step are printed beside the direct run's.

Reference workload (``benchmarks/workload.py``): N=64 chat requests, seed 0, "Summarize this
text: " + 20..300 random words from a fixed vocabulary, max_tokens uniform in 16..128, ignore_eos;
decoded greedily here. Both runs warm up on one unrelated request first.

    python benchmarks/queue_overhead.py                      # SmolLM2-135M-Instruct, default settings
    python benchmarks/queue_overhead.py --model /path/to/hf-dir --num-requests 64

Worker and engine settings come from the same BATCHERY_* variables for both runs (e.g.
BATCHERY_DTYPE, BATCHERY_ENGINE__NUM_KV_BLOCKS); Redis from BATCHERY_BROKER_URL."""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from workload import reference_requests  # noqa: E402  (the engine benchmarks' reference workload)

WARMUP = [{"role": "user", "content": "hello world " * 40}]  # unrelated to the workload: no prefix-cache help


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# -- direct -----------------------------------------------------------------------------------------
def run_direct(settings, loaded, workload) -> dict:
    """The workload on a fresh engine (cold prefix cache) sharing ``loaded`` weights."""
    from batchery.engine.config import EngineConfig
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(**settings.engine_kwargs()), loaded=loaded)
    stepped: dict = {}

    def run(items) -> tuple[int, float]:
        t0 = time.perf_counter()
        for i, (messages, max_tokens) in enumerate(items):
            engine.add_request(
                f"r{i}-{t0}",
                engine.encode_chat(messages),
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
        tokens = 0
        steps_before = engine.num_steps
        step_seconds = 0.0
        while engine.has_unfinished():
            ts = time.perf_counter()
            tokens += sum(len(o.token_ids) for o in engine.step())
            step_seconds += time.perf_counter() - ts
        stepped.update(steps=engine.num_steps - steps_before, step_seconds=step_seconds)
        return tokens, time.perf_counter() - t0

    def in_thread(items) -> tuple[int, float]:
        # The worker drives its engine from a loop thread, not the main thread; do the same here so
        # both runs see the same threading (it matters on a busy CPU with OpenMP).
        out = []
        t = threading.Thread(target=lambda: out.append(run(items)), name="direct-engine-loop")
        t.start()
        t.join()
        return out[0]

    in_thread([(WARMUP, 4)])  # warm-up (allocator, oneDNN / Triton kernels); not timed
    tokens, wall = in_thread(workload)
    return {
        "tokens": tokens,
        "wall": wall,
        "throughput": tokens / wall,
        **stepped,
        "mean_batch": engine.stats()["mean_batch_size"],
    }


# -- through the queue ----------------------------------------------------------------------------------
class ResultListener:
    """Records when each task's result is published. Celery's Redis backend publishes every result
    on a channel named like its key; one pattern subscription, made before anything is sent, sees
    them all, so the time a result reaches the client is not skewed by the order in which the
    benchmark collects results."""

    def __init__(self, backend_url: str, pattern: str) -> None:
        import redis

        self.pubsub = redis.Redis.from_url(backend_url).pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe(pattern)
        self.received: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self.pubsub.get_message(timeout=0.1)
            if msg and msg["type"] == "pmessage":
                self.received.setdefault(msg["channel"].decode(), time.time())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pubsub.close()


def start_worker(settings, queue: str, log_path: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        BATCHERY_MODEL=settings.model,
        BATCHERY_DTYPE=settings.dtype,
        BATCHERY_MAX_NUM_SEQS=str(settings.max_num_seqs),
        BATCHERY_QUEUE=queue,
        BATCHERY_BROKER_URL=settings.broker_url,
        BATCHERY_RESULT_BACKEND=settings.result_backend,
        BATCHERY_HEALTH_HOST="127.0.0.1",
        BATCHERY_HEALTH_PORT=str(port),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchery", "worker"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    return proc, port


def wait_ready(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"batchery worker ready: .*", log_path.read_text(errors="replace"))
        if m:
            return m.group(0)
        if proc.poll() is not None:
            raise SystemExit(f"worker exited with {proc.returncode}; see {log_path}")
        time.sleep(0.2)
    raise SystemExit(f"worker not ready after {timeout:g} s; see {log_path}")


class QueueRunner:
    def __init__(self, settings, port: int) -> None:
        from batchery.client import Client

        self.client = Client(settings=settings)
        self.listener = ResultListener(settings.result_backend, self.key("*"))
        self.port = port

    def key(self, task_id: str) -> str:
        return self.client.app.backend.get_key_for_task(task_id).decode()

    def stats(self) -> dict:
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as r:
            return json.loads(r.read())

    def _run(self, items):
        t0 = time.perf_counter()
        handles = self.client.chat_many(
            [{"messages": m, "max_tokens": k} for m, k in items], temperature=0.0, ignore_eos=True
        )
        results = [h.get(timeout=3600) for h in handles]
        return handles, results, time.perf_counter() - t0

    def run(self, workload) -> dict:
        self._run([(WARMUP, 4)])  # warm-up, as for the direct run
        before = self.stats()
        handles, results, wall = self._run(workload)
        after = self.stats()
        deadline = time.monotonic() + 5
        while any(self.key(h.id) not in self.listener.received for h in handles) and time.monotonic() < deadline:
            time.sleep(0.01)
        added, parts = [], []
        for h, r in zip(handles, results):
            received = self.listener.received.get(self.key(h.id))
            if received is not None and r.timing is not None:
                t = r.timing
                added.append((t.engine_added_at - h.enqueued_at) + (received - t.engine_finished_at))
                parts.append(
                    (
                        t.task_started_at - h.enqueued_at,
                        t.engine_added_at - t.task_started_at,
                        received - t.engine_finished_at,
                    )
                )
        tokens = sum(r.usage.completion_tokens for r in results)
        steps = after["num_steps"] - before["num_steps"]
        return {
            "tokens": tokens,
            "wall": wall,
            "throughput": tokens / wall,
            "added": added,
            "parts": parts,
            "steps": steps,
            "step_seconds": after["step_seconds"] - before["step_seconds"],
            "mean_batch": (after["num_step_seqs"] - before["num_step_seqs"]) / max(steps, 1),
        }

    def close(self) -> None:
        self.listener.close()
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model (default: BATCHERY_MODEL or smollm2-135m-instruct)")
    p.add_argument("--dtype", help="dtype (default: BATCHERY_DTYPE or auto)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate direct and queued runs this many times (round r uses seed + r); "
        "the ratio reported is the median over rounds",
    )
    p.add_argument("--max-num-seqs", type=int, help="engine batch limit (default: max(64, num requests))")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    args = p.parse_args(argv)

    from batchery.contract.settings import Settings
    from batchery.engine.config import EngineConfig
    from batchery.engine.loader import load_model

    overrides = {k: v for k, v in (("model", args.model), ("dtype", args.dtype)) if v}
    settings = Settings(**overrides)
    queue = f"batchery.bench-{uuid.uuid4().hex[:8]}"
    settings = settings.model_copy(
        update={"max_num_seqs": args.max_num_seqs or max(64, args.num_requests), "queue": queue}
    )
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{queue}.log"
    print(
        f"model {settings.model}, dtype {settings.dtype}, max_num_seqs {settings.max_num_seqs}; "
        f"{args.num_requests} requests per run, {args.rounds} round(s); worker log {log_path}"
    )

    proc, port = start_worker(settings, queue, log_path)
    runner = None
    rounds = []
    try:
        loaded = load_model(EngineConfig(**settings.engine_kwargs()))  # while the worker loads its own copy
        print(f"worker: {wait_ready(proc, log_path, args.ready_timeout)}")
        runner = QueueRunner(settings, port)
        for r in range(args.rounds):
            workload = reference_requests(args.num_requests, args.seed + r)
            direct = run_direct(settings, loaded, workload)
            queued = runner.run(workload)
            rounds.append((direct, queued))
            added_ms = [a * 1000 for a in queued["added"]]
            print(f"round {r} (seed {args.seed + r}, {direct['tokens']} generated tokens)")
            for name, res in (("direct on the engine", direct), ("through the queue   ", queued)):
                print(
                    f"  {name} : {res['throughput']:8.1f} tok/s  ({res['wall']:.2f} s; {res['steps']} steps, "
                    f"{1000 * res['step_seconds'] / max(res['steps'], 1):.1f} ms each, mean batch "
                    f"{res['mean_batch']:.1f})"
                )
            print(f"  ratio queue/direct   : {queued['throughput'] / direct['throughput']:.3f}")
            if added_ms:
                print(
                    f"  time added by queue  : p50 {percentile(added_ms, 0.5):.1f} ms, "
                    f"p99 {percentile(added_ms, 0.99):.1f} ms over {len(added_ms)} requests"
                )
                med = [statistics.median(p[i] for p in queued["parts"]) * 1000 for i in range(3)]
                print(
                    f"    medians: enqueue->task start {med[0]:.1f} ms, task start->in engine {med[1]:.1f} ms, "
                    f"finished->client {med[2]:.1f} ms"
                )
    finally:
        if runner is not None:
            runner.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        try:
            import redis

            redis.Redis.from_url(settings.broker_url).delete(queue)
        except Exception:  # noqa: BLE001
            pass

    ratios = [q["throughput"] / d["throughput"] for d, q in rounds]
    added_ms = [a * 1000 for _, q in rounds for a in q["added"]]
    print(f"direct throughput    : {statistics.median(d['throughput'] for d, _ in rounds):8.1f} tok/s (median)")
    print(f"queue throughput     : {statistics.median(q['throughput'] for _, q in rounds):8.1f} tok/s (median)")
    print(f"ratio queue/direct   : {statistics.median(ratios):.3f} (median of {len(ratios)}; target >= 0.90)")
    if added_ms:
        print(f"time added by queue  : p50 {percentile(added_ms, 0.5):.1f} ms, p99 {percentile(added_ms, 0.99):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
