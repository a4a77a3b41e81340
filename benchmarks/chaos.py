"""Chaos benchmark: batch jobs through real worker processes and a real Redis while things break.

Each scenario submits a batch job, breaks something on the way, waits for the job to end and
reads every record back. One table row per scenario:

- requests: request lines in the job;
- completed / failed: lines with a 200 record / with an error record;
- lost: lines with no record once the job ended (or once the wait gave up);
- duplicated: lines counted more than once (the job's counters above its records, or tokens
  counted twice);
- recovery seconds: how long the fault held the job up (per scenario, below).

The scenarios (issue 5):

1. ``raise``: an engine step raises every 40 steps through a 300-request job. Recovery: the
   longest time from an engine failure to the next line finished.
2. ``hang``: a step hangs; the watchdog (2 s) abandons it. Recovery: from the hang to the next
   line finished.
3. ``kill``: the only worker is SIGKILLed mid-job, and a new one started. Recovery: from the kill
   until every line the dead worker held (its unacknowledged messages) has a record.
4. ``kill-1-of-2``: two workers, one SIGKILLed; the survivor finishes. Recovery as in 3.
5. ``redis-restart``: a private ``redis-server`` with AOF (``appendfsync always``) is stopped and
   started again mid-job; workers and the client reconnect. Recovery: from the stop until every
   line unacknowledged at that moment has a record.
6. ``poison``: poison lines (``poison:XYZZY``) among 200 good ones: only the poison lines fail,
   with ``engine_crash``. Recovery: the longest time from an engine failure to the next line
   finished.
7. ``oom``: three steps raise ``torch.OutOfMemoryError``; the engine shrinks its steps, nothing
   fails and nothing is rebuilt. Recovery: from the first OOM to the next line finished.
8. ``deadlines``: 200 lines with 1 s deadlines and long generations: all fail with
   ``deadline_exceeded`` and the KV pool returns to full. Recovery: from the job's end until the
   pool is full again.

Issue 13 added:

9. ``invalid-for-model``: lines whose parameters pass the schemas but not the model (a stop token id
   beyond the vocabulary with ``min_tokens``; a ``top_k`` beyond any vocabulary) among good lines: only
   the first kind fails, as ``invalid_request``; no engine step fails.
10. ``rebuild-rss``: a step raises every 20 steps until the engine was rebuilt 20 times; the worker's RSS
   after the last rebuild is within half a KV pool of its RSS after the second.
11. ``ttl``: a job waits on a queue with no worker for longer than ``BATCHERY_BATCH__TTL`` (60 s), then
   a worker starts: the job completes, and only then gets its TTL.
12. ``clock-ahead``: a client whose clock runs 125 s ahead polls a submission that is still streaming:
   it is not failed as ``submission_interrupted``.
13. ``run-worker-exit``: ``batchery run``'s embedded worker SIGKILLed mid-job: restarted, every line
   written once, exit 0.
14. ``kill-poison``: lines whose step ends the worker process (``exit_on``, like a segfault or the OOM
   killer) among good ones, one worker restarted whenever it dies: each delivery is counted in Redis
   before the engine sees it; after ``BATCHERY_MAX_DELIVERIES`` (3) deaths the line fails with
   ``engine_crash`` and is dead-lettered; only those lines fail. Recovery: from the first death to the
   job's end.
15. ``sentinel-failover``: a private primary, replica and sentinel (``redis-server --sentinel``, quorum 1,
   down-after 1 s); workers and client use ``sentinel://...?master_name=...`` URLs. The primary is
   SIGKILLed mid-job, the sentinel promotes the replica, the worker and the client follow it.
   Recovery: from the kill until every line recorded at the kill is recorded on the new master.
16. ``sentinel-failover-lag``: as 15, with the replication stream held back 1 s before the kill (a relay
   in front of the primary), so the records, acks and queue pops the old primary acknowledged in that
   second are lost with it, as asynchronous replication allows; those lines run again (their messages
   are still queued, or unacknowledged and restored after the visibility timeout). The notes say how
   many acknowledged records the failover lost.
17. ``poison-deadlines``: 4 poison lines among 200 good ones of 96 tokens, every line with a 10 s
   deadline. Most good lines share the poison lines' failing steps and are quarantined too; they run
   alone one at a time, and the time they wait for that turn does not count against their deadlines:
   no good line fails.

In every row lost and duplicated must be 0 and failed must be exactly the lines meant to fail; the
exit code is 1 otherwise. Everything runs against ``--redis`` (its own database, default 12) or a
private Redis, with its own queues and key prefixes, deleted afterwards. Usage::

    .venv/bin/python benchmarks/chaos.py                      # tiny model, all 8 scenarios
    .venv/bin/python benchmarks/chaos.py --model smollm2-135m-instruct --only poison,oom
    .venv/bin/python benchmarks/chaos.py --fast                # the sizes the tests use

``tests/test_chaos.py`` runs the same scenarios with ``--fast`` sizes and asserts each row.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # tiny_model

WORDS = (
    "summarize this text the cat and the dog by the sea story about a river city light music book "
    "paper stone fire wind rain snow tree flower"
).split()
POISON = "XYZZY"
KILL_POISON = "KILLME"  # the exit_on fault's text: a step holding it ends the worker process
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)


# -- results --------------------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    requests: int
    completed: int
    failed: int
    lost: int
    duplicated: int
    recovery_s: float | None
    expected_failed: int
    unexpected: list[str] = field(default_factory=list)  # custom_ids whose outcome was not the intended one
    checks: dict[str, bool] = field(default_factory=dict)  # scenario-specific conditions
    notes: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.duplicated == 0
            and self.failed == self.expected_failed
            and not self.unexpected
            and all(self.checks.values())
        )

    def cells(self) -> list[str]:
        rec = "-" if self.recovery_s is None else f"{self.recovery_s:.2f}"
        return [
            self.scenario,
            str(self.requests),
            str(self.completed),
            str(self.failed),
            str(self.lost),
            str(self.duplicated),
            rec,
        ]


HEADER = ["scenario", "requests", "completed", "failed", "lost", "duplicated", "recovery seconds"]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


@dataclass
class Sizes:
    """Job sizes and timings: the full benchmark, or ``fast()`` for the tests."""

    raise_requests: int = 300
    raise_every: int = 40
    hang_requests: int = 100
    kill_requests: int = 200
    redis_requests: int = 200
    poison_good: int = 200
    poison_bad: int = 4
    oom_requests: int = 200
    deadline_requests: int = 200
    max_tokens: int = 16
    kill_max_tokens: int = 48  # longer lines, so a kill finds work in flight
    task_timeout: float = 20.0  # per-attempt deadline; the visibility timeout follows it
    job_timeout: float = 300.0
    recover_after: float = 10.0  # no progress for this long: the client looks for lines the broker lost
    invalid_requests: int = 200  # 9: every 5th line asks for a token id the model does not have
    rss_rebuilds: int = 20  # 10: engine rebuilds to measure the worker's RSS over
    job_ttl: int = 60  # 11: BATCHERY_BATCH__TTL (its minimum): the job waits longer than this before it runs
    clock_skew_s: float = 125.0  # 12: how far ahead the second client's clock is
    run_requests: int = 40  # 13: lines of the `batchery run` job whose worker is SIGKILLed
    kill_poison_good: int = 120  # 14: good lines beside ...
    kill_poison_bad: int = 2  # ... lines that end the worker process
    sentinel_requests: int = 200  # 15, 16: the job through a Sentinel failover
    poison_deadline_tokens: int = 96  # 17: tokens a line, poison_good/poison_bad lines, 10 s deadlines
    lost_requests: int = 200  # 18: lines of the job, of which ...
    lost_lines: int = 5  # ... this many lose their message before any worker runs
    lost_unrelated: int = 40  # 18: slow unrelated requests queued behind the job (3 s each)
    recovery_interval: float = 5.0  # 18: BATCHERY_RECOVERY_INTERVAL of the worker
    pause_requests: int = 200  # 19: lines of the job whose Redis is paused
    pause_s: float = 30.0  # 19: how long Redis is SIGSTOPped
    big_lines: int = 100_000  # 20-22 (opt-in: --only big-*): a big job (benchmarks/big_job.py) through one fault

    @classmethod
    def fast(cls) -> Sizes:
        return cls(
            raise_requests=60,
            raise_every=20,
            hang_requests=24,
            kill_requests=48,
            redis_requests=48,
            poison_good=40,
            poison_bad=2,
            oom_requests=40,
            deadline_requests=40,
            max_tokens=12,
            kill_max_tokens=32,
            task_timeout=10.0,
            job_timeout=120.0,
            recover_after=5.0,
            invalid_requests=30,
            run_requests=16,
            kill_poison_good=30,
            kill_poison_bad=1,
            sentinel_requests=48,
            lost_requests=40,
            lost_lines=2,
            lost_unrelated=20,
            recovery_interval=2.0,
            pause_requests=48,
            pause_s=12.0,
            big_lines=6000,
        )

    @property
    def retry_backoff_max(self) -> float:
        return 1.0

    @property
    def visibility_timeout(self) -> float:
        return self.task_timeout + self.retry_backoff_max + 1.0


# -- processes ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def log_times(text: str, pattern: str) -> list[float]:
    """Timestamps (epoch seconds) of the worker log lines matching ``pattern``."""
    out = []
    for line in text.splitlines():
        m = LOG_TIME.match(line)
        if m and re.search(pattern, line):
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


class _Capture(logging.Handler):
    """Collects the messages of a logger of this process (the client's), from now until close()."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.logger = logging.getLogger(name)
        self.old_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def has(self, text: str) -> bool:
        return any(text in m for m in list(self.messages))

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.old_level)
        super().close()


class Worker:
    """A ``batchery worker`` subprocess, its log in a file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.health_port = int(env["BATCHERY_HEALTH_PORT"])
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchery", "worker"], cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600.0) -> Worker:
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}) before it was ready:\n{self.tail()}")
            return "batchery worker ready" in self.log()

        wait_until(ready, timeout, "the worker to be ready", 0.1)
        return self

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/stats", timeout=5) as r:
            return json.loads(r.read())

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, grace: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class PrivateRedis:
    """A ``redis-server`` of our own on a free port, persisting with AOF (fsync on every write)."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.conf = self.dir / "redis.conf"
        self.conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {self.dir}",
                    "appendonly yes",
                    "appendfsync always",
                    'save ""',
                    "maxmemory-policy noeviction",
                    "daemonize no",
                    f"logfile {self.dir / 'redis.log'}",
                ]
            )
            + "\n"
        )
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        import redis

        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)

        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}); see {self.dir / 'redis.log'}")
            try:
                return client.ping()
            except redis.RedisError:  # refused, or still loading the AOF
                return False

        try:
            wait_until(up, 30, "the private redis-server")
        finally:
            client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a clean shutdown: the AOF is fsynced anyway
            self.proc.wait(30)


SENTINEL_MASTER = "chaos-master"


class LagRelay:
    """A TCP relay in front of the primary: the address the sentinel monitors, so every client and the
    replica go through it (a replica pointed at another address is re-pointed by the sentinel,
    ``+fix-slave-config``). ``hold()`` keeps back, for good, what the primary sends on the replication
    link (the connection that sent ``REPLCONF``/``PSYNC``); ``cut()`` closes everything."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.holding = threading.Event()
        self.held_bytes = 0
        self.socks: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="lag-relay").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.server.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            self.socks += [down, up]
            link = {"replication": False}
            threading.Thread(target=self._pump, args=(down, up, link, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, link, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, link: dict, from_primary: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not from_primary and (b"REPLCONF" in data or b"PSYNC" in data):
                    link["replication"] = True
                if from_primary and link["replication"] and self.holding.is_set():
                    self.held_bytes += len(data)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        self.closed = True
        self.server.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


class PrivateSentinelGroup:
    """A primary, a replica and one sentinel, private ``redis-server`` processes on free ports (no
    persistence: a failover, not a restart, is what this rehearses). ``url`` is the ``sentinel://``
    URL the workers and clients use; ``stop()`` kills all three (``Chaos.close`` calls it)."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ports = {n: free_port() for n in ("primary", "replica", "sentinel")}
        self.procs: dict[str, subprocess.Popen] = {}
        self.relay: LagRelay | None = None
        self.monitored = self.ports["primary"]

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.ports['sentinel']}/0?master_name={SENTINEL_MASTER}"

    def _server(self, name: str, *extra: str) -> None:
        import redis

        port = self.ports[name]
        self.procs[name] = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", str(self.dir)]
            + ["--logfile", str(self.dir / f"{name}.log"), *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port, socket_timeout=1)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(up, 30, f"the private {name}")
        client.close()

    def direct(self, name: str):
        import redis

        return redis.Redis(port=self.ports[name], socket_timeout=2, socket_connect_timeout=2)

    def info(self, name: str) -> dict:
        import redis

        try:
            return self.direct(name).info("replication")
        except redis.RedisError:
            return {}

    def start(self, relay: bool = False) -> PrivateSentinelGroup:
        import redis

        self._server("primary")
        if relay:
            self.relay = LagRelay(self.ports["primary"])
            self.monitored = self.relay.port
        self._server("replica", "--replicaof", "127.0.0.1", str(self.monitored))
        wait_until(lambda: self.info("replica").get("master_link_status") == "up", 30, "the replica to sync")
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.ports['sentinel']}\nbind 127.0.0.1\ndir {self.dir}\nlogfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {self.monitored} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n"
            f"sentinel failover-timeout {SENTINEL_MASTER} 5000\n"
        )
        self.procs["sentinel"] = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def sees_replica() -> bool:
            try:
                replicas = self.direct("sentinel").sentinel_slaves(SENTINEL_MASTER)
            except redis.RedisError:
                return False
            return any(r["port"] == self.ports["replica"] and not r["is_sdown"] for r in replicas)

        wait_until(sees_replica, 30, "the sentinel to find the replica")
        return self

    def master_port(self) -> int | None:
        import redis

        try:
            addr = self.direct("sentinel").sentinel_get_master_addr_by_name(SENTINEL_MASTER)
        except redis.RedisError:
            return None
        return int(addr[1]) if addr else None

    def kill_primary(self) -> None:
        self.procs["primary"].send_signal(signal.SIGKILL)
        self.procs["primary"].wait(10)
        if self.relay is not None:
            self.relay.cut()  # what it held back never reaches the replica

    def promoted(self) -> bool:
        return self.master_port() == self.ports["replica"] and self.info("replica").get("role") == "master"

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.cut()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# -- the harness ----------------------------------------------------------------------------------
class Chaos:
    """Runs scenarios: spawns workers on ``model``, submits jobs, tallies the records."""

    def __init__(
        self,
        model: str,
        redis_url: str,
        workdir: Path,
        sizes: Sizes,
        *,
        dtype: str = "float32",
        max_num_seqs: int = 64,
        num_kv_blocks: int | None = 2048,
        verbose: bool = True,
    ) -> None:
        self.model = model
        self.redis_url = redis_url
        self.workdir = Path(workdir)
        self.sizes = sizes
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.verbose = verbose
        self.workers: list[Worker] = []
        self.clients: list = []
        self.redises: list[PrivateRedis] = []
        self.namespaces: list[tuple[str, str]] = []  # (redis url, queue) to clean up
        self.requeued = 0  # lines whose messages the broker lost, queued again by the client

    # -- plumbing ---------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if self.verbose:
            print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def new_queue(self, url: str | None = None) -> str:
        q = f"batchery-chaos-{uuid.uuid4().hex[:10]}"
        self.namespaces.append((url or self.redis_url, q))
        return q

    def env(self, queue: str, url: str | None = None, **overrides) -> dict[str, str]:
        s = self.sizes
        url = url or self.redis_url
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
        env.update(
            {
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "BATCHERY_BROKER_URL": url,
                "BATCHERY_RESULT_BACKEND": url,
                "BATCHERY_MODEL": self.model,
                "BATCHERY_DTYPE": self.dtype,
                "BATCHERY_QUEUE": queue,
                "BATCHERY_HEALTH_HOST": "127.0.0.1",
                "BATCHERY_HEALTH_PORT": str(free_port()),
                "BATCHERY_MAX_NUM_SEQS": str(self.max_num_seqs),
                "BATCHERY_ENGINE__MAX_MODEL_LEN": "2048",
                "BATCHERY_TASK_TIMEOUT": f"{s.task_timeout:g}",
                "BATCHERY_MAX_TASK_TIMEOUT": f"{s.task_timeout:g}",
                "BATCHERY_RETRY_BACKOFF": "0.2",
                "BATCHERY_RETRY_BACKOFF_MAX": f"{s.retry_backoff_max:g}",
                "BATCHERY_VISIBILITY_TIMEOUT": f"{s.visibility_timeout:g}",
                "BATCHERY_RESULT_EXPIRES": "3600",
                "BATCHERY_SHUTDOWN_GRACE": "2",
                "BATCHERY_WATCHDOG_TIMEOUT": "30",
                "BATCHERY_BATCH__KEY_PREFIX": f"{queue}:batch",
                "BATCHERY_QUARANTINE__KEY_PREFIX": f"{queue}:strikes",
            }
        )
        if self.num_kv_blocks:
            env["BATCHERY_ENGINE__NUM_KV_BLOCKS"] = str(self.num_kv_blocks)
        env.update({k: str(v) for k, v in overrides.items()})
        return env

    def spawn(self, queue: str, url: str | None = None, *, ready: bool = True, **overrides) -> Worker:
        log_path = self.workdir / f"worker-{len(self.workers)}-{queue}.log"
        w = Worker(self.env(queue, url, **overrides), log_path)
        self.workers.append(w)
        return w.wait_ready() if ready else w

    def client(self, queue: str, url: str | None = None):
        from batchery.client import Client
        from batchery.contract.settings import Settings

        s = self.sizes
        url = url or self.redis_url
        c = Client(
            settings=Settings(
                broker_url=url,
                result_backend=url,
                queue=queue,
                model=self.model,
                task_timeout=s.task_timeout,
                max_task_timeout=s.task_timeout,
                retry_backoff=0.2,
                retry_backoff_max=s.retry_backoff_max,
                visibility_timeout=s.visibility_timeout,
                result_expires=3600,
                batch={"key_prefix": f"{queue}:batch", "ttl": 3600},
            )
        )
        self.clients.append(c)
        return c

    def lines(
        self, n: int, *, prefix: str = "r", max_tokens: int | None = None, poison: set[int] = frozenset(), **body
    ) -> list[dict]:
        out = []
        for i in range(n):
            words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(4 + i % 9)]
            if i in poison:
                words.insert(len(words) // 2, POISON)
            out.append(
                {
                    "custom_id": f"{prefix}-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "messages": [{"role": "user", "content": " ".join(words)}],
                        "max_tokens": max_tokens or self.sizes.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        **body,
                    },
                }
            )
        return out

    def done(self, client, job_id: str) -> int:
        c = client.batch_status(job_id).request_counts
        return c.completed + c.failed

    def wait_job(self, client, job_id: str):
        """Wait as ``batchery batch wait`` does (riding out outages, re-queueing lines the broker
        lost); notes how many lines had to be re-queued."""
        from batchery.contract.errors import ResultTimeout

        capture = _Capture("batchery.recover")
        try:
            return client.wait_batch(
                job_id, timeout=self.sizes.job_timeout, poll_interval=0.2, recover_after=self.sizes.recover_after
            )
        except ResultTimeout as exc:
            self.say(f"gave up waiting: {exc}")
            return client.batch_status(job_id)
        finally:
            capture.close()
            for m in capture.messages:
                found = re.search(r"the messages of (\d+) lines", m)
                if found:
                    self.requeued += int(found.group(1))

    def waiter(self, client, job_id: str) -> threading.Thread:
        """``wait_job`` in a thread of its own, started."""
        t = threading.Thread(target=self.wait_job, args=(client, job_id), name="chaos-waiter", daemon=True)
        t.start()
        return t

    def held_lines(self, url: str, queue: str, job_id: str) -> set[int]:
        """The lines of ``job_id`` whose messages are unacknowledged (held by some worker) now."""
        import redis

        r = redis.Redis.from_url(url)
        lines = set()
        try:
            for raw in r.hvals("unacked"):
                try:
                    message, _exchange, routing_key = json.loads(raw)
                except ValueError:
                    continue
                headers = message.get("headers") or {}
                task_id = headers.get("id", "")
                if routing_key != queue or not task_id.startswith(job_id + "-"):
                    continue
                if headers.get("batchery_job") == job_id:  # a chunk of lines (batchery.batch_lines)
                    lines.update(int(n) for n in str(headers.get("batchery_lines") or "").split(",") if n.isdigit())
                else:
                    lines.add(int(task_id.rsplit("-", 1)[1]))
        finally:
            r.close()
        return lines

    def recorded(self, client, job_id: str, lines: set[int]) -> bool:
        results = client.jobs.keys(job_id)[1]
        have = client.jobs.r.hmget(results, [str(n) for n in sorted(lines)]) if lines else []
        return all(v is not None for v in have)

    def tally(
        self,
        name: str,
        client,
        job_id: str,
        lines: list[dict],
        *,
        expected_failed: dict[str, str],
        recovery_s: float | None,
        checks: dict[str, bool] | None = None,
        notes: str = "",
    ) -> Row:
        """Read the job back. ``expected_failed``: custom_id -> the error code it must have."""
        job = client.batch_status(job_id)
        records = list(client.batch_results(job_id))
        ids = [ln["custom_id"] for ln in lines]
        per_id = Counter(r["custom_id"] for r in records)
        lost = sum(1 for cid in ids if per_id[cid] == 0)
        counted = job.request_counts.completed + job.request_counts.failed
        duplicated = sum(n - 1 for n in per_id.values() if n > 1) + max(0, counted - len(records))
        tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records if r["error"] is None)
        if tokens != job.usage.completion_tokens:
            notes = (notes + "; " if notes else "") + f"tokens: job {job.usage.completion_tokens} != records {tokens}"
            duplicated = max(duplicated, 1)
        failed = [r for r in records if r["error"] is not None]
        unexpected = sorted(
            {r["custom_id"] for r in failed if expected_failed.get(r["custom_id"]) != r["error"]["code"]}
            | {cid for cid in expected_failed if per_id[cid] and cid not in {r["custom_id"] for r in failed}}
        )
        checks = dict(checks or {})
        checks["job completed"] = job.status == "completed"
        if self.requeued:
            notes = (notes + "; " if notes else "") + f"{self.requeued} lines re-queued (their messages were lost)"
            self.requeued = 0
        row = Row(
            name,
            len(ids),
            len(records) - len(failed),
            len(failed),
            lost,
            duplicated,
            recovery_s,
            len(expected_failed),
            unexpected,
            checks,
            notes,
        )
        self.say(
            f"{name}: {'ok' if row.ok else 'NOT OK'} {row.cells()} checks={checks} unexpected={unexpected[:5]} {notes}"
        )
        return row

    @staticmethod
    def after_fault(worker: Worker, fault: str, success: str = r"batch_lines?\[\S+\] succeeded") -> float | None:
        """The longest time from a log line matching ``fault`` to the next line finished."""
        text = worker.log()
        faults, oks = log_times(text, fault), log_times(text, success)
        gaps = [min((t for t in oks if t >= f), default=f) - f for f in faults]
        return max(gaps) if gaps else None

    def close(self) -> None:
        for w in self.workers:
            try:
                w.stop(grace=10)
            except Exception:  # noqa: BLE001
                pass
        for c in self.clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        self.cleanup()
        for r in self.redises:
            r.stop()

    def cleanup(self) -> None:
        import redis

        for url, queue in self.namespaces:
            if any(r.url == url for r in self.redises):
                continue  # a private Redis goes away whole
            try:
                r = redis.Redis.from_url(url)
                keys = list(r.scan_iter(match=f"{queue}*")) + list(r.scan_iter(match=f"_kombu.binding*{queue}"))
                if keys:
                    r.delete(*keys)
                for tag, raw in r.hscan_iter("unacked"):
                    try:
                        if json.loads(raw)[2] == queue:
                            r.hdel("unacked", tag)
                            r.zrem("unacked_index", tag)
                    except (ValueError, IndexError):
                        pass
                r.close()
            except redis.RedisError:
                pass

    # -- the scenarios ----------------------------------------------------------------------------
    def engine_raise(self) -> Row:
        s = self.sizes
        q = self.new_queue()
        # 16 sequences a step: more steps, so more failures; every line is shorter than the period
        w = self.spawn(q, BATCHERY_FAULTS=f"step_raise_every:{s.raise_every}", **self.SMALL)
        c = self.client(q)
        lines = self.lines(s.raise_requests)
        job = c.submit_batch(lines)
        self.wait_job(c, job)
        stats = w.stats()
        row = self.tally(
            f"1. engine step raises every {s.raise_every} steps",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=self.after_fault(w, r"ERROR .*engine failure"),
            checks={"engine failed and was rebuilt": stats["num_rebuilds"] >= 1},
            notes=f"{stats['num_failures']} engine failures",
        )
        w.stop()
        return row

    def hang(self) -> Row:
        s = self.sizes
        q = self.new_queue()
        w = self.spawn(q, BATCHERY_FAULTS="step_hang:5:120", BATCHERY_WATCHDOG_TIMEOUT="2")
        c = self.client(q)
        lines = self.lines(s.hang_requests)
        job = c.submit_batch(lines)
        self.wait_job(c, job)
        fired = "the watchdog fired" in w.log()
        row = self.tally(
            "2. engine step hangs (watchdog 2 s)",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=self.after_fault(w, r"WARNING .*step_hang.* hangs"),
            checks={"watchdog fired": fired},
        )
        w.stop()
        return row

    # a smaller batch and prefetch than the job, so part of it is still queued when the fault hits
    SMALL = {"BATCHERY_MAX_NUM_SEQS": "16", "BATCHERY_CONCURRENCY": "20"}

    def _kill(self, name: str, two: bool) -> Row:
        s = self.sizes
        q = self.new_queue()
        w1 = self.spawn(q, **self.SMALL)
        w2 = self.spawn(q, **self.SMALL) if two else None
        c = self.client(q)
        lines = self.lines(s.kill_requests, max_tokens=s.kill_max_tokens)
        job = c.submit_batch(lines)
        waiter = self.waiter(c, job)  # a client waits throughout, as a user would
        wait_until(lambda: self.done(c, job) >= len(lines) // 3, s.job_timeout, "a third of the job")
        t_kill = time.time()
        w1.sigkill()
        held = self.held_lines(self.redis_url, q, job)
        self.say(
            f"{name}: SIGKILLed worker {w1.proc.pid} at {self.done(c, job)}/{len(lines)} done; "
            f"{len(held)} lines unacknowledged"
        )
        w = w2 if two else self.spawn(q, **self.SMALL)
        recovered = None
        try:
            wait_until(lambda: self.recorded(c, job, held), s.job_timeout, "the held lines to be recorded", 0.1)
            recovered = time.time() - t_kill
        except TimeoutError:
            pass
        waiter.join(s.job_timeout)
        row = self.tally(
            name,
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=recovered,
            checks={"the worker held work when killed": bool(held)},
            notes=f"visibility timeout {s.visibility_timeout:g} s",
        )
        w.stop()
        return row

    def kill_restart(self) -> Row:
        return self._kill("3. worker SIGKILLed and restarted", two=False)

    def kill_one_of_two(self) -> Row:
        return self._kill("4. two workers, one SIGKILLed", two=True)

    def redis_restart(self) -> Row:
        s = self.sizes
        red = PrivateRedis(self.workdir / f"redis-{len(self.redises)}").start()
        self.redises.append(red)
        q = self.new_queue(red.url)
        w = self.spawn(q, red.url, **self.SMALL)
        c = self.client(q, red.url)
        lines = self.lines(s.redis_requests, max_tokens=s.kill_max_tokens)
        job = c.submit_batch(lines)
        # the client waits through the outage, as a user's `batchery batch wait` would
        client_log = _Capture("batchery")
        waiter = self.waiter(c, job)
        wait_until(lambda: self.done(c, job) >= len(lines) // 3, s.job_timeout, "a third of the job")
        held = self.held_lines(red.url, q, job)
        t_stop = time.time()
        red.stop()
        self.say(f"redis-restart: stopped Redis with {len(held)} lines unacknowledged")
        # down until both sides have given up on quick retries: the worker's first reconnect failed,
        # and the client's status poll ran out of its per-command retries (about 3 s)
        wait_until(
            lambda: (
                ("Cannot connect to redis" in w.log() or w.proc.poll() is not None)
                and client_log.has("while waiting for batch job")
            ),
            60,
            "the worker and the client to notice",
            0.1,
        )
        red.start()
        down = time.time() - t_stop
        self.say(f"redis-restart: Redis back after {down:.2f} s")
        recovered = None
        try:
            wait_until(lambda: self.recorded(c, job, held), s.job_timeout, "the held lines to be recorded", 0.1)
            recovered = time.time() - t_stop
        except TimeoutError:
            pass
        waiter.join(s.job_timeout)
        client_log.close()
        try:  # the job can end before the worker's consumer is back (its records go through another connection)
            wait_until(lambda: w.log().count("Connected to redis") >= 2, 30, "the worker's consumer to reconnect", 0.2)
        except TimeoutError:
            pass
        log = w.log()
        row = self.tally(
            "5. private Redis (AOF) restarted",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=recovered,
            checks={
                # it lost the broker (its consumer mid-pop, or a task's ack) and connected again after the restart
                "worker reconnected (logged)": ("Connection to broker lost" in log or "Cannot connect to redis" in log)
                and log.count("Connected to redis") >= 2
                and len(re.findall(r"Connected to redis", log)) >= 2,
                "client reconnected (logged)": client_log.has("Redis is back"),
                "worker still alive": w.proc.poll() is None and w.stats()["state"] == "serving",
            },
            notes=f"Redis down {down:.1f} s",
        )
        w.stop()
        return row

    def poison(self) -> Row:
        s = self.sizes
        q = self.new_queue()
        w = self.spawn(q, BATCHERY_FAULTS=f"poison:{POISON}")
        c = self.client(q)
        n = s.poison_good + s.poison_bad
        bad = {int((k + 0.5) * n / s.poison_bad) for k in range(s.poison_bad)}
        lines = self.lines(n, poison=bad)
        expected = {lines[i]["custom_id"]: "engine_crash" for i in bad}
        job = c.submit_batch(lines)
        self.wait_job(c, job)
        records = {r["custom_id"]: r for r in c.batch_results(job)}
        named = all(
            POISON in json.dumps(lines[i])
            and "InjectedFault" in ((records.get(lines[i]["custom_id"]) or {}).get("error") or {}).get("message", "")
            for i in bad
        )
        stats = w.stats()
        row = self.tally(
            f"6. {s.poison_bad} poison lines among {s.poison_good} good",
            c,
            job,
            lines,
            expected_failed=expected,
            recovery_s=self.after_fault(w, r"ERROR .*engine failure"),
            checks={"engine_crash names the exception": named, "worker never gave up": stats["state"] == "serving"},
            notes=f"{stats['num_failures']} engine failures, {stats['num_solo_runs']} solo runs",
        )
        w.stop()
        return row

    def oom(self) -> Row:
        s = self.sizes
        q = self.new_queue()
        w = self.spawn(q, BATCHERY_FAULTS="oom:5,oom:6,oom:25")
        c = self.client(q)
        lines = self.lines(s.oom_requests)
        job = c.submit_batch(lines)
        self.wait_job(c, job)
        stats = w.stats()
        row = self.tally(
            "7. simulated OOM in 3 steps",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=self.after_fault(w, r"WARNING .*out of memory"),
            checks={
                "3 OOMs, each shrank the step": stats["engine"].get("num_oom") == 3,
                "no engine failure": stats["num_failures"] == 0,
            },
        )
        w.stop()
        return row

    def deadlines(self) -> Row:
        s = self.sizes
        q = self.new_queue()
        w = self.spawn(q)
        c = self.client(q)
        lines = self.lines(s.deadline_requests, prefix="slow", max_tokens=1900)
        job = c.submit_batch(lines, timeout=1)
        end = self.wait_job(c, job)
        t_end = end.completed_at or time.time()

        def pool_full():
            e = w.stats()["engine"]
            return e["kv_blocks_free"] == e["kv_blocks_total"] and e["num_running"] == 0 and e["num_waiting"] == 0

        full = None
        try:
            wait_until(pool_full, 30, "the KV pool to be full again", 0.05)
            full = max(0.0, time.time() - t_end)
        except TimeoutError:
            pass
        row = self.tally(
            f"8. {s.deadline_requests} lines with 1 s deadlines",
            c,
            job,
            lines,
            expected_failed={ln["custom_id"]: "deadline_exceeded" for ln in lines},
            recovery_s=full,
            checks={"KV pool back to full": full is not None},
        )
        w.stop()
        return row

    def invalid_for_model(self) -> Row:
        """Item 1: parameters that pass the schemas but not the model, among good lines: a Llama-3 stop
        token id (128009) with ``min_tokens`` 1 on a model with a smaller vocabulary (fails alone as
        ``invalid_request``, 400), and a ``top_k`` beyond any vocabulary (clamped: it succeeds). No
        engine step may fail."""
        s = self.sizes
        q = self.new_queue()
        w = self.spawn(q)
        c = self.client(q)
        n = s.invalid_requests
        lines = self.lines(n)
        bad = set(range(0, n, 5))
        for i in bad:
            lines[i]["body"].update(stop_token_ids=[128009], min_tokens=1)
        for i in range(2, n, 5):
            lines[i]["body"].update(top_k=2**63 + 1, temperature=0.8, seed=i)
        job = c.submit_batch(lines)
        self.wait_job(c, job)
        stats = w.stats()
        records = {r["custom_id"]: r for r in c.batch_results(job)}
        named = all(
            "128009" in ((records.get(lines[i]["custom_id"]) or {}).get("error") or {}).get("message", "") for i in bad
        )
        row = self.tally(
            f"9. {len(bad)} lines with a token id beyond the vocabulary, {len(range(2, n, 5))} with a huge top_k",
            c,
            job,
            lines,
            expected_failed={lines[i]["custom_id"]: "invalid_request" for i in bad},
            recovery_s=None,
            checks={"no engine step failed": stats["num_failures"] == 0, "the error names the token id": named},
        )
        w.stop()
        return row

    def rebuild_rss(self) -> Row:
        """Item 3: a worker whose engine fails and is rebuilt ``rss_rebuilds`` times (a step raises every
        20 steps) keeps a flat RSS: each rebuild frees the old engine and its 64 MiB KV pool."""
        s = self.sizes
        q = self.new_queue()
        pool_blocks = 16384  # 64 MiB on the tiny model: 2 layers x K,V x 8 slots x 2 heads x 16 dims x 4 bytes
        pool = {"BATCHERY_ENGINE__NUM_KV_BLOCKS": str(pool_blocks)} if self.num_kv_blocks else {}
        w = self.spawn(q, BATCHERY_FAULTS="step_raise_every:20", **pool, **self.SMALL)
        c = self.client(q)
        samples: list[tuple[int, int]] = []  # (rebuilds, RSS bytes)

        def rss() -> int:
            with open(f"/proc/{w.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        lines: list[dict] = []
        job_ids = []
        while True:
            n = w.stats()["num_rebuilds"]
            samples.append((n, rss()))
            if n >= s.rss_rebuilds:
                break
            part = self.lines(80, prefix=f"rss{len(job_ids)}", max_tokens=8)
            lines += part
            job_ids.append(c.submit_batch(part))
            self.wait_job(c, job_ids[-1])
        after_2 = next(b for r, b in samples if r >= 2)
        grown = samples[-1][1] - after_2
        verbose, self.verbose = self.verbose, False  # one row for all the jobs, said below
        rows = [
            self.tally(
                "",
                c,
                j,
                [ln for ln in lines if ln["custom_id"].startswith(f"rss{k}-")],
                expected_failed={},
                recovery_s=None,
            )
            for k, j in enumerate(job_ids)
        ]
        self.verbose = verbose
        row = Row(
            f"10. {samples[-1][0]} engine rebuilds, RSS after rebuild 2 vs the last",
            sum(r.requests for r in rows),
            sum(r.completed for r in rows),
            sum(r.failed for r in rows),
            sum(r.lost for r in rows),
            sum(r.duplicated for r in rows),
            None,
            0,
            [u for r in rows for u in r.unexpected],
            {
                "jobs completed": all(r.checks.get("job completed") for r in rows),
                "RSS grew less than half a KV pool (32 MiB)": grown < (32 << 20),
            },
            f"RSS {after_2 / 2**20:.0f} MiB after rebuild 2, {samples[-1][1] / 2**20:.0f} MiB after rebuild "
            f"{samples[-1][0]} ({grown / 2**20:+.1f} MiB); a KV pool is 64 MiB",
        )
        self.say(f"rss: {'ok' if row.ok else 'NOT OK'} {row.cells()} {row.checks} {row.notes}")
        w.stop()
        return row

    def outlives_ttl(self) -> Row:
        """Item 4: a job that runs longer than ``BATCHERY_BATCH__TTL`` (it waits on a queue with no worker for
        TTL + 10 s, then a worker starts) completes with all its records, and expires a TTL after it ends."""
        s = self.sizes
        q = self.new_queue()
        c = self.client(q)
        c.jobs.ttl = s.job_ttl
        lines = self.lines(20)
        job = c.submit_batch(lines)
        t0 = time.time()
        self.say(f"ttl: job {job} queued with no worker; waiting {s.job_ttl + 10} s (TTL {s.job_ttl} s)")
        time.sleep(s.job_ttl + 10)
        alive = c.jobs.r.exists(c.jobs.key(job)) == 1 and c.jobs.r.ttl(c.jobs.key(job)) == -1
        w = self.spawn(q, BATCHERY_BATCH__TTL=str(s.job_ttl))
        end = self.wait_job(c, job)
        key_ttl = c.jobs.r.ttl(c.jobs.key(job))
        results_ttl = c.jobs.r.ttl(c.jobs.keys(job)[1])
        row = self.tally(
            f"11. a job outlives its TTL ({s.job_ttl} s) before it ends",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=None,
            checks={
                "job kept, without expiry, while it ran": alive,
                "TTL counts from the end": 0 < key_ttl <= s.job_ttl and 0 < results_ttl <= s.job_ttl,
                "expires_at = completed_at + TTL": abs((end.expires_at or 0) - (end.completed_at or 0) - s.job_ttl) < 1,
            },
            notes=f"job ran {time.time() - t0:.0f} s; its keys expire in {key_ttl} s",
        )
        w.stop()
        return row

    def clock_ahead(self) -> Row:
        """Item 9: while a submission is still streaming (``validating``, 12 s), a second client whose clock
        runs ``clock_skew_s`` ahead keeps asking for the job's status (which repairs jobs whose submitter
        died, judged by heartbeats): the live submission is not failed, and the job completes."""
        s = self.sizes
        q = self.new_queue()
        w = self.spawn(q)
        c = self.client(q)
        lines = self.lines(60)
        job_box: list[str] = []

        def slow_lines():
            for i, ln in enumerate(lines):
                if i and i % 5 == 0:
                    time.sleep(1.0)
                yield ln

        submit = threading.Thread(target=lambda: job_box.append(c.submit_batch(slow_lines())), daemon=True)
        submit.start()
        wait_until(lambda: c.jobs.list(limit=1), 30, "the job to be created")
        job = c.jobs.list(limit=1)[0].id
        script = (
            "import sys, time, json\n"
            "real = time.time\n"
            f"time.time = lambda: real() + {s.clock_skew_s}\n"
            "from batchery.jobs.store import JobStore\n"
            "from batchery.broker.connection import redis_from_url\n"
            f"store = JobStore(redis_from_url({self.redis_url!r}), {q + ':batch'!r}, 3600)\n"
            "seen = []\n"
            "end = real() + 15\n"
            "while real() < end:\n"
            f"    st = store.status({job!r})\n"
            "    seen.append(st.status)\n"
            "    if st.is_terminal: break\n"
            "    time.sleep(0.2)\n"
            "print(json.dumps(seen))\n"
        )
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        seen = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []
        submit.join(60)
        self.wait_job(c, job)
        st = c.batch_status(job)
        row = self.tally(
            f"12. a client {s.clock_skew_s:.0f} s ahead polls a live submission",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=None,
            checks={
                "the skewed client saw the submission live": "validating" in seen,
                "no submission_interrupted": not any(e.code == "submission_interrupted" for e in st.errors),
            },
            notes=f"{len(seen)} status calls from the skewed client"
            + ("" if out.returncode == 0 else out.stderr[-300:]),
        )
        w.stop()
        return row

    def run_worker_exit(self) -> Row:
        """Item 10: ``batchery run`` (embedded Redis and worker) whose worker is SIGKILLed mid-job restarts it
        and writes every line once, in input order, exit 0."""
        s = self.sizes
        d = self.workdir / f"run-{uuid.uuid4().hex[:6]}"
        d.mkdir()
        src, out, errs, stderr_path = d / "in.jsonl", d / "out.jsonl", d / "errors.jsonl", d / "stderr.txt"
        lines = self.lines(s.run_requests, prefix="run", max_tokens=s.kill_max_tokens * 4)
        src.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
        env.update(
            {
                "PYTHONPATH": str(REPO),
                "TOKENIZERS_PARALLELISM": "false",
                "BATCHERY_MODEL": self.model,
                "BATCHERY_DTYPE": self.dtype,
                "BATCHERY_MAX_NUM_SEQS": "8",
                "BATCHERY_ENGINE__MAX_MODEL_LEN": "2048",
            }
        )
        if self.num_kv_blocks:
            env["BATCHERY_ENGINE__NUM_KV_BLOCKS"] = str(self.num_kv_blocks)
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchery", "run", str(src), "-o", str(out), "--errors", str(errs)],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        t_kill = None
        try:

            def worker_log() -> str:
                m = re.search(r"worker log (\S+)\)", stderr_path.read_text(errors="replace"))
                return Path(m.group(1)).read_text(errors="replace") if m and Path(m.group(1)).exists() else ""

            wait_until(
                lambda: proc.poll() is not None or re.search(r"batch_lines?\[\S+\] succeeded", worker_log()),
                300,
                "the embedded worker to finish its first lines",
                0.1,
            )
            pid = _descendant(proc.pid, b"batchery.worker")
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                t_kill = time.time()
                self.say(f"run: SIGKILLed the embedded worker {pid}")
            proc.wait(s.job_timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        stderr = stderr_path.read_text(errors="replace")
        got = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        bad = [json.loads(x) for x in errs.read_text().splitlines()] if errs.exists() else []
        per_id = Counter(r["custom_id"] for r in got + bad)
        ids = [ln["custom_id"] for ln in lines]
        row = Row(
            "13. `batchery run`: its worker SIGKILLed mid-job",
            len(lines),
            len(got),
            len(bad),
            sum(1 for cid in ids if per_id[cid] == 0),
            sum(n - 1 for n in per_id.values() if n > 1),
            None,
            0,
            [r["custom_id"] for r in bad],
            {
                "the worker was killed": t_kill is not None,
                "restarted (said on stderr)": "restarting it (restart 1 of 3)" in stderr,
                "exit 0": proc.returncode == 0,
                "input order": [r["custom_id"] for r in got] == ids[: len(got)],
            },
            f"exit {proc.returncode}",
        )
        self.say(f"run: {'ok' if row.ok else 'NOT OK'} {row.cells()} {row.checks}")
        if not row.ok:
            self.say(stderr[-2000:])
        return row

    def process_killing_poison(self) -> Row:
        """Item 2: lines whose step ends the worker process (``exit_on``: ``os._exit(70)``, like a segfault or
        the OOM killer) among good ones, one worker at a time, restarted whenever it dies. After
        ``BATCHERY_MAX_DELIVERIES`` (3) deaths a line fails with ``engine_crash`` and is dead-lettered."""
        from batchery.jobs.deadletter import WORKER_DIED, DeadLetters

        s = self.sizes
        # A private Redis: kombu's sweep for a dead worker's messages takes every queue's messages older than
        # the visibility timeout, and this scenario kills workers on purpose.
        red = PrivateRedis(self.workdir / f"redis-{len(self.redises)}").start()
        self.redises.append(red)
        q = self.new_queue(red.url)
        env = {
            "BATCHERY_FAULTS": f"exit_on:{KILL_POISON}",
            "BATCHERY_DEADLETTER__KEY_PREFIX": f"{q}:deadletter",
            "BATCHERY_DEADLETTER__DELIVERIES_PREFIX": f"{q}:deliveries",
        }
        worker = self.spawn(q, red.url, **env)
        c = self.client(q, red.url)
        n = s.kill_poison_good + s.kill_poison_bad
        bad = {int((k + 0.5) * n / s.kill_poison_bad) for k in range(s.kill_poison_bad)}
        lines = self.lines(n)
        for i in bad:  # the exit_on text in the prompt (self.lines(poison=...) inserts POISON, the raising one)
            msg = lines[i]["body"]["messages"][0]
            msg["content"] = f"{msg['content']} {KILL_POISON}"
        expected = {lines[i]["custom_id"]: "engine_crash" for i in bad}
        job = c.submit_batch(lines)
        exits: list[int] = []
        first_death = None
        deadline = time.time() + s.job_timeout * 3  # several worker starts and visibility timeouts
        while time.time() < deadline and not c.batch_status(job).is_terminal:
            code = worker.proc.poll()
            if code is not None:
                exits.append(code)
                first_death = first_death or time.time()
                self.say(f"kill-poison: the worker exited with code {code} (death {len(exits)}); starting another")
                worker = self.spawn(q, red.url, ready=False, **env)
            time.sleep(0.2)
        recovery = time.time() - first_death if first_death else None
        records = {r["custom_id"]: r for r in c.batch_results(job)}
        max_deliveries = 3  # BATCHERY_MAX_DELIVERIES' default
        dl = DeadLetters(c.jobs.r, f"{q}:deadletter")
        letters = {e["id"]: e for e in dl.list(1000)}

        def names_its_deliveries(i: int) -> bool:
            """The line's engine_crash record names the deliveries that died, as its dead-letter entry counts
            them: at least K, the last of them (K - 2 for K = 3) alone, and no more than the worker died. Not
            always K: two poison lines in flight together both die twice; then one of them runs alone and the
            other, waiting for the turn, dies a third time, not alone, and is dead-lettered after a fourth."""
            message = ((records.get(lines[i]["custom_id"]) or {}).get("error") or {}).get("message", "")
            entry = letters.get(f"{job}-{i + 1}") or {}
            died, alone = entry.get("deliveries", 0), entry.get("deliveries_alone", 0)
            ok = (
                max_deliveries <= died <= len(exits)
                and alone >= max_deliveries - 2
                and f"delivered {died} times and the worker process died each time ({alone} of them running alone)"
                in message
            )
            if not ok:
                self.say(
                    f"kill-poison: {lines[i]['custom_id']}: dead-letter entry {died} deliveries ({alone} alone), "
                    f"{len(exits)} worker deaths; its record says {message!r}"
                )
            return ok

        named = all([names_its_deliveries(i) for i in bad])  # a list: each line that fails says why
        self.say(
            "kill-poison: "
            + "; ".join(
                f"{lines[i]['custom_id']}: {(letters.get(f'{job}-{i + 1}') or {}).get('message', 'not dead-lettered')}"
                for i in sorted(bad)
            )
        )
        dead_lettered = all(letters.get(f"{job}-{i + 1}", {}).get("reason") == WORKER_DIED for i in bad) and len(
            letters
        ) == len(bad)
        row = self.tally(
            f"14. {s.kill_poison_bad} lines that kill the worker process among {s.kill_poison_good} good",
            c,
            job,
            lines,
            expected_failed=expected,  # every other line completes: no innocent request failed
            recovery_s=recovery,
            checks={
                "the worker died and came back": len(exits) >= max_deliveries and set(exits) == {70},
                # each death is charged to every line in flight; a poison line dies at most K times
                f"at most {max_deliveries} deaths per poison line": len(exits) <= max_deliveries * len(bad),
                "engine_crash names the deliveries": named,
                "the poison lines, and only they, are dead-lettered": dead_lettered,
                "the last worker is alive": worker.proc.poll() is None,
            },
            notes=f"{len(exits)} worker deaths; visibility timeout {s.visibility_timeout:g} s",
        )
        worker.stop()
        return row

    def _big_job(self, fault: str, title: str) -> Row:
        """A ``big_lines`` job from a file (the input in the store, fed window by window, chunks), two workers on a
        private Redis, through one fault at 30% of its records: ``benchmarks/big_job.py --fault``, which checks the
        output file against the input (every line once, in input order)."""
        n = self.sizes.big_lines
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
        env.update(BATCHERY_CPU_KERNELS="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cmd = [sys.executable, str(REPO / "benchmarks" / "big_job.py"), "--lines", str(n), "--fault", fault, "--json"]
        self.say(f"big job: {' '.join(cmd[1:])}")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(1800.0, n / 50))
        doc = next((json.loads(x[5:]) for x in p.stdout.splitlines() if x.startswith("JSON ")), None)
        if p.returncode != 0 or doc is None:
            tail = (p.stdout + p.stderr)[-1500:]
            return Row(title, n, 0, 0, 0, 0, None, 0, [f"big_job.py exited {p.returncode}: {tail}"])
        num, lost, dup = doc["checks"]["j0"]
        row = Row(title, n, num - dup, 0, lost, dup, doc.get("fault_recovery_s"), 0, [])
        row.checks = {"the fault happened mid-job": "never" not in doc["fault"] and "no feeder" not in doc["fault"]}
        row.notes = f"{doc['fault']}; Redis peak +{doc['peak_above'] / 1e6:.1f} MB; {doc['lines_per_s']:.0f} lines/s"
        self.say(f"{title}: {'ok' if row.ok else 'NOT OK'} {row.cells()} checks={row.checks} {row.notes}")
        return row

    def big_kill_worker(self) -> Row:
        return self._big_job("kill-worker", f"20. a {self.sizes.big_lines:,}-line job: a worker SIGKILLed")

    def big_kill_holder(self) -> Row:
        return self._big_job("kill-holder", f"21. a {self.sizes.big_lines:,}-line job: its feeder's worker SIGKILLed")

    def big_redis_restart(self) -> Row:
        return self._big_job("redis-restart", f"22. a {self.sizes.big_lines:,}-line job: Redis (AOF) restarted")

    def _sentinel(self, name: str, lag_s: float) -> Row:
        s = self.sizes
        group = PrivateSentinelGroup(self.workdir / f"sentinel-{len(self.redises)}").start(relay=lag_s > 0)
        self.redises.append(group)  # type: ignore[arg-type]  # stop() at close; cleanup() skips its url
        url = group.url
        q = self.new_queue(url)
        # 4 sequences a step: the job lasts long enough for the kill (and a 2 s hold) to find it mid-way
        w = self.spawn(q, url, BATCHERY_MAX_NUM_SEQS="4", BATCHERY_CONCURRENCY="6")
        c = self.client(q, url)
        lines = self.lines(s.sentinel_requests, max_tokens=s.kill_max_tokens)
        job = c.submit_batch(lines)
        results_key = c.jobs.keys(job)[1]
        waiter = self.waiter(c, job)  # the client waits through the failover, as `batchery batch wait` would
        wait_until(lambda: self.done(c, job) >= len(lines) // 6, s.job_timeout, "a sixth of the job")
        primary = group.direct("primary")
        if lag_s:
            group.relay.holding.set()
            time.sleep(lag_s)
        at_kill = primary.hlen(results_key)
        t_kill = time.time()
        group.kill_primary()
        self.say(f"{name}: SIGKILLed the primary with {at_kill}/{len(lines)} lines recorded")
        promoted_s = None
        try:
            wait_until(group.promoted, 60, "the sentinel to promote the replica", 0.1)
            promoted_s = time.time() - t_kill
        except TimeoutError:
            pass
        new_master = group.direct("replica")
        on_new = new_master.hlen(results_key) if promoted_s is not None else 0
        recovered = None
        try:
            wait_until(
                lambda: new_master.hlen(results_key) >= at_kill, s.job_timeout, "the lines lost to be rerun", 0.1
            )
            recovered = time.time() - t_kill
        except TimeoutError:
            pass
        waiter.join(s.job_timeout)
        checks = {
            "the job was running at the kill": at_kill < len(lines),
            "replica promoted": promoted_s is not None,
            # every record is on the promoted replica: the worker wrote there after the kill (kombu may follow
            # the new master without logging a lost connection)
            "worker followed the master": new_master.hlen(results_key) == len(lines),
            "worker still alive": w.proc.poll() is None and w.stats()["state"] == "serving",
        }
        lost_by_failover = at_kill - on_new
        if lag_s:
            checks["the failover lost acknowledged records"] = lost_by_failover > 0 and group.relay.held_bytes > 0
        row = self.tally(
            name,
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=recovered,
            checks=checks,
            notes=(f"promoted after {promoted_s:.1f} s; " if promoted_s is not None else "not promoted; ")
            + f"{lost_by_failover} acknowledged records lost by the failover and run again"
            + (f" (replication held back {lag_s:g} s)" if lag_s else "")
            + f"; visibility timeout {s.visibility_timeout:g} s",
        )
        w.stop()
        return row

    def sentinel_failover(self) -> Row:
        """Redis HA: a private primary, replica and sentinel; the primary SIGKILLed mid-job."""
        return self._sentinel("15. Sentinel failover (primary SIGKILLed)", 0.0)

    def sentinel_failover_lag(self) -> Row:
        """As ``sentinel_failover``, with the replication stream held back 1 s before the kill: the writes the
        old primary acknowledged in that second are lost with it, and the lines run again."""
        return self._sentinel("16. Sentinel failover, replication 1 s behind", 1.0)

    def poison_deadlines(self) -> Row:
        """Item 8: poison lines among good lines whose deadline is 10 s and whose generations are long
        enough that the innocents quarantined beside the poison (they shared its failing steps) could
        not all run alone, one after another, within it: no good line may fail."""
        s = self.sizes
        q = self.new_queue()
        # the visibility timeout bounds how long a line may wait for its turn alone (tasks.chat.max_held)
        w = self.spawn(q, BATCHERY_FAULTS=f"poison:{POISON}", BATCHERY_VISIBILITY_TIMEOUT="600")
        c = self.client(q)
        n = s.poison_good + s.poison_bad
        bad = {int((k + 0.5) * n / s.poison_bad) for k in range(s.poison_bad)}
        lines = self.lines(n, poison=bad, max_tokens=s.poison_deadline_tokens)
        expected = {lines[i]["custom_id"]: "engine_crash" for i in bad}
        job = c.submit_batch(lines, timeout=10)
        self.wait_job(c, job)
        stats = w.stats()
        row = self.tally(
            f"17. {s.poison_bad} poison lines among {s.poison_good} good, 10 s deadlines, "
            f"{s.poison_deadline_tokens} tokens a line",
            c,
            job,
            lines,
            expected_failed=expected,
            recovery_s=self.after_fault(w, r"ERROR .*engine failure"),
            checks={"worker never gave up": stats["state"] == "serving"},
            notes=f"{stats['num_failures']} engine failures, {stats['num_solo_runs']} solo runs",
        )
        w.stop()
        return row

    def lost_lines_unwatched(self) -> Row:
        """18. Lines whose messages the broker lost, nobody waiting, other messages on the queue throughout.

        The job is queued before any worker runs; ``lost_lines`` of its messages are taken off the queue (what a
        worker dying right after its BRPOP does); slow unrelated requests are queued behind it, so the queue is
        never empty while the lost lines are found. No client waits (no ``wait_batch``: only status reads), so only
        the workers' own recovery (every ``recovery_interval`` s, jobs quiet for that long) can finish the job.
        Recovery seconds: from the moment every other line was recorded to the job's end."""
        from batchery.broker.queues import queue_keys

        s = self.sizes
        q = self.new_queue()
        c = self.client(q)
        c.settings.batch.chunk_lines = 1  # a message a line: the broker loses chosen lines (a lost chunk: test_chunks)
        lines = self.lines(s.lost_requests)
        job = c.submit_batch(lines)  # no worker yet: every line waits on the queue
        broker = c.jobs.r  # one Redis here: broker and backend are self.redis_url
        n = len(lines)
        lost = sorted({1 + (k * n) // s.lost_lines + n // (2 * s.lost_lines) for k in range(s.lost_lines)})
        for key in queue_keys(q):
            for raw in broker.lrange(key, 0, -1):
                tid = json.loads(raw)["headers"]["id"]
                if tid.rsplit("-", 1)[0] == job and int(tid.rsplit("-", 1)[1]) in lost:
                    broker.lrem(key, 1, raw)
        unrelated = [[{"role": "user", "content": f"unrelated {i}"}] for i in range(s.lost_unrelated)]
        c.chat_many(unrelated, max_tokens=4000, ignore_eos=True, timeout=3)  # each holds a task thread ~3 s
        self.say(f"lost-unwatched: took lines {lost} of {job} off the queue; {s.lost_unrelated} slow requests behind")
        w = self.spawn(q, BATCHERY_RECOVERY_INTERVAL=f"{s.recovery_interval:g}", BATCHERY_CONCURRENCY="4")

        def chat_queued() -> int:
            return sum(
                json.loads(m)["headers"]["task"] == "batchery.chat_completion"
                for k in queue_keys(q)
                for m in broker.lrange(k, 0, -1)
            )

        wait_until(lambda: self.done(c, job) >= n - len(lost), s.job_timeout, "every line but the lost ones")
        t_stall = time.time()
        wait_until(lambda: "were lost by the broker" in w.log(), s.job_timeout, "the worker's recovery")
        queued_then = chat_queued()
        recovered = None
        try:
            wait_until(lambda: c.batch_status(job).is_terminal, s.job_timeout, "the job to end", 0.2)
            recovered = time.time() - t_stall
        except TimeoutError:
            pass
        log = w.log()
        requeued = sum(int(m) for m in re.findall(r"the messages of (\d+) lines were lost", log))
        row = self.tally(
            "18. lost lines with nobody waiting (5)",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=recovered,
            checks={
                "the worker queued them again (logged)": requeued == len(lost),
                "unrelated requests still queued at recovery": queued_then > 0,
            },
            notes=f"{len(lost)} messages taken off the queue; recovery interval {s.recovery_interval:g} s; "
            f"{queued_then} unrelated requests still queued when they were found",
        )
        w.stop()
        return row

    def redis_paused(self) -> Row:
        """19. Redis SIGSTOPped for ``pause_s`` mid-job (the TCP connections stay up, nothing answers).

        A client waits throughout (as ``batchery batch wait`` would, no timeout). During the pause a second
        ``batchery batch wait JOB --timeout 5`` runs as a process: it must end in about 5 s (exit 124, a message
        saying Redis did not answer), not 5 s plus socket timeouts and retries (about 40 s before). Then Redis
        resumes, and the job must complete with every line once. Recovery seconds: from SIGCONT to the next line
        recorded."""
        s = self.sizes
        red = PrivateRedis(self.workdir / f"redis-{len(self.redises)}").start()
        self.redises.append(red)
        q = self.new_queue(red.url)
        w = self.spawn(q, red.url, **self.SMALL)
        c = self.client(q, red.url)
        lines = self.lines(s.pause_requests, max_tokens=s.kill_max_tokens)
        job = c.submit_batch(lines)
        waiter = self.waiter(c, job)
        wait_until(lambda: self.done(c, job) >= len(lines) // 3, s.job_timeout, "a third of the job")
        done_before = self.done(c, job)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
        env.update(
            PYTHONPATH=str(REPO),
            BATCHERY_BROKER_URL=red.url,
            BATCHERY_BATCH__KEY_PREFIX=f"{q}:batch",
            BATCHERY_QUEUE=q,
        )
        os.kill(red.proc.pid, signal.SIGSTOP)
        t_pause = time.time()
        self.say(f"redis-pause: SIGSTOPped Redis at {done_before}/{len(lines)} done")
        t0 = time.monotonic()
        cli = subprocess.run(
            [sys.executable, "-m", "batchery", "batch", "wait", job, "--timeout", "5", "--no-progress"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        cli_s = time.monotonic() - t0  # includes the interpreter's start (about 1 s)
        self.say(
            f"redis-pause: batch wait --timeout 5 returned {cli.returncode} after {cli_s:.1f} s: {cli.stderr.strip()}"
        )
        time.sleep(max(0.0, s.pause_s - (time.time() - t_pause)))
        os.kill(red.proc.pid, signal.SIGCONT)
        t_resume = time.time()
        self.say(f"redis-pause: SIGCONT after {t_resume - t_pause:.1f} s")
        recovered = None
        try:
            paused_done = self.done(c, job)
            wait_until(lambda: self.done(c, job) > paused_done, s.job_timeout, "a line after the pause", 0.1)
            recovered = time.time() - t_resume
        except TimeoutError:
            pass
        waiter.join(s.job_timeout)
        row = self.tally(
            f"19. Redis paused (SIGSTOP) for {s.pause_s:g} s mid-job (6)",
            c,
            job,
            lines,
            expected_failed={},
            recovery_s=recovered,
            checks={
                "batch wait --timeout 5 returned in about 5 s": cli_s < 5 + 4,
                "... with exit 124 and a message": cli.returncode == 124 and "did not answer" in cli.stderr,
                "worker still alive": w.proc.poll() is None,
            },
            notes=f"batch wait --timeout 5 took {cli_s:.1f} s (exit {cli.returncode}) during the pause",
        )
        w.stop()
        return row


def _descendant(root: int, needle: bytes) -> int | None:
    """A live descendant of ``root`` whose command line contains ``needle``."""
    parents, changed = {root}, True
    procs = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    procs[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    while changed:
        changed = False
        for pid, ppid in procs.items():
            if ppid in parents and pid not in parents:
                parents.add(pid)
                changed = True
    for pid in sorted(parents - {root}):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    return pid
        except OSError:
            pass
    return None


SCENARIOS = {
    "raise": Chaos.engine_raise,
    "hang": Chaos.hang,
    "kill": Chaos.kill_restart,
    "kill-1-of-2": Chaos.kill_one_of_two,
    "redis-restart": Chaos.redis_restart,
    "poison": Chaos.poison,
    "oom": Chaos.oom,
    "deadlines": Chaos.deadlines,
    "invalid-for-model": Chaos.invalid_for_model,
    "rebuild-rss": Chaos.rebuild_rss,
    "ttl": Chaos.outlives_ttl,
    "clock-ahead": Chaos.clock_ahead,
    "run-worker-exit": Chaos.run_worker_exit,
    "kill-poison": Chaos.process_killing_poison,
    "sentinel-failover": Chaos.sentinel_failover,
    "sentinel-failover-lag": Chaos.sentinel_failover_lag,
    "poison-deadlines": Chaos.poison_deadlines,
    "lost-unwatched": Chaos.lost_lines_unwatched,
    "redis-pause": Chaos.redis_paused,
}
# Big jobs through a fault (issue 37's exactly-once rows): minutes each, so only when asked for (--only big-...).
BIG_SCENARIOS = {
    "big-kill-worker": Chaos.big_kill_worker,
    "big-kill-holder": Chaos.big_kill_holder,
    "big-redis-restart": Chaos.big_redis_restart,
}


def machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            cpu = m.group(1) if m else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: a tiny random Llama built on the fly)")
    ap.add_argument("--dtype", default=None, help="dtype (default: float32 for the tiny model, auto otherwise)")
    ap.add_argument(
        "--redis",
        default=os.environ.get("BATCHERY_BENCH_REDIS", "redis://127.0.0.1:6379/12"),
        help="Redis for the scenarios but the restart one (its own database; default db 12)",
    )
    ap.add_argument(
        "--only",
        default="",
        help=f"comma list of scenarios: {', '.join(SCENARIOS)} (all by default); opt-in: {', '.join(BIG_SCENARIOS)}",
    )
    ap.add_argument("--fast", action="store_true", help="the small sizes the tests use")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS and n not in BIG_SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join([*SCENARIOS, *BIG_SCENARIOS])}")
    sizes = Sizes.fast() if args.fast else Sizes()
    workdir = Path(tempfile.mkdtemp(prefix="batchery-chaos-"))
    model, kv = args.model, None
    if model is None:
        from tiny_model import build_tiny_model

        model, kv = str(build_tiny_model(workdir / "tiny-llama")), 2048
    else:
        sizes.task_timeout = max(sizes.task_timeout, 60.0)
        sizes.job_timeout = max(sizes.job_timeout, 1800.0)
    dtype = args.dtype or ("float32" if args.model is None else "auto")
    chaos = Chaos(model, args.redis, workdir, sizes, dtype=dtype, max_num_seqs=args.max_num_seqs, num_kv_blocks=kv)
    rows: list[Row] = []
    t0 = time.monotonic()
    try:
        for name in names:
            try:
                rows.append({**SCENARIOS, **BIG_SCENARIOS}[name](chaos))
            except Exception as exc:  # noqa: BLE001 - one broken scenario must not hide the others
                chaos.say(f"{name}: {type(exc).__name__}: {exc}")
                rows.append(Row(name, 0, 0, 0, 0, 0, None, 0, [f"{type(exc).__name__}: {exc}"]))
    finally:
        chaos.close()
    print(
        f"\nmachine: {machine()}; model: {args.model or 'tiny random Llama (2 layers)'}; "
        f"{'fast' if args.fast else 'full'} sizes; visibility timeout {sizes.visibility_timeout:g} s; "
        f"{time.monotonic() - t0:.0f} s in all\n"
    )
    print(table(rows))
    bad = [r for r in rows if not r.ok]
    for r in bad:
        print(
            f"\nNOT OK: {r.scenario}: expected {r.expected_failed} failed; unexpected {r.unexpected[:10]}; "
            f"checks {r.checks}; {r.notes}"
        )
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    if not bad:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"\nworker logs kept in {workdir}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
