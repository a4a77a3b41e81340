"""Redis high availability (issue 13): ``sentinel://`` URLs for the broker, the result backend, the job
store and the strike counters, and a batch job that survives its primary being SIGKILLed.

The integration tests start a private primary, a replica and one sentinel (``redis-server --sentinel``)
on free ports, in a temporary directory, killed at teardown. The replica may replicate through
``LagProxy``, a TCP relay that can hold back the replication stream: the writes the primary
acknowledged meanwhile are then lost when it dies, as asynchronous replication allows, and the job
must still complete with every line once."""

from __future__ import annotations

import logging
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import free_port, wait_for

from batchery.broker.celery_app import make_celery
from batchery.broker.check import RedisAuthError, SentinelConfigError, check_redis
from batchery.broker.connection import parse_sentinel_url, redis_from_url, retry_through_outage
from batchery.contract.settings import Settings, mask_url
from batchery.jobs.store import JobStore
from batchery.jobs.strikes import Strikes

MASTER = "mymaster"
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


# -- URLs, no servers -----------------------------------------------------------------------------
def test_sentinel_url_parses_into_sentinels_master_and_credentials():
    s = parse_sentinel_url("sentinel://:p%40ss@a:26380/2;sentinel://b?master_name=prod")
    assert s.sentinels == (("a", 26380), ("b", 26379))
    assert (s.master_name, s.db, s.username, s.password) == ("prod", 2, None, "p@ss")
    # kombu and Celery take the first address's credentials and database: every address gets them
    assert s.celery_url == "sentinel://:p%40ss@a:26380/2;sentinel://:p%40ss@b:26379/2"


@pytest.mark.parametrize(
    "url, needle",
    [
        ("sentinel://:secret@a:26379/0", "master_name"),
        ("sentinel://a;sentinel://b?master_name=x&socket_timeout=1", "unknown query parameter 'socket_timeout'"),
        ("sentinel://:secret@a/1;sentinel://:secret@b/2?master_name=x", "different databases"),
        ("sentinel://:secret@a;sentinel://:other@b?master_name=x", "different credentials"),
        ("sentinel://a;redis://:secret@b?master_name=x", "no sentinel address"),
    ],
)
def test_a_bad_sentinel_url_fails_clearly_without_its_password(url, needle):
    with pytest.raises(ValueError, match=needle) as err:
        parse_sentinel_url(url)
    assert "secret" not in str(err.value)
    with pytest.raises(SentinelConfigError) as err:  # what the worker's start-up check says (exit 2)
        check_redis(url, "BATCHERY_BROKER_URL")
    assert "BATCHERY_BROKER_URL" in str(err.value) and "secret" not in str(err.value)


def test_make_celery_gives_kombu_and_celery_the_master_name():
    settings = Settings(
        broker_url="sentinel://:pw@127.0.0.1:26379;sentinel://127.0.0.1:26380/0?master_name=mq",
        result_backend="sentinel://:pw@127.0.0.1:26379/1?master_name=results",
    )
    app = make_celery(settings)
    opts = app.conf.broker_transport_options
    assert opts["master_name"] == "mq" and opts["visibility_timeout"] == settings.visibility_timeout
    assert "unacked_restore_interval" in opts and opts["sentinel_kwargs"]["socket_timeout"] > 0
    assert app.conf.result_backend_transport_options["master_name"] == "results"
    conn = app.connection_for_write()  # kombu refuses an unknown query parameter (TypeError): none is left
    assert conn.transport_cls == "sentinel" and len(conn.alt) == 2 and conn.virtual_host == "0"
    assert type(app.backend).__name__ == "SentinelBackend"
    assert app.backend.connparams["db"] == 1
    assert "pw" not in conn.as_uri() and "pw" not in app.backend.as_uri()


def test_the_kombu_patch_holds_for_the_sentinel_transport():
    """kombu's Sentinel channel builds its pool through the same ``_connparams`` that
    ``worker/kombu_patches.py`` guards: a detached channel raises a connection error, not the
    AttributeError that would kill the worker."""
    import types

    import redis
    from kombu.transport.redis import SentinelChannel

    from batchery.worker import kombu_patches

    kombu_patches.apply()
    channel = SentinelChannel.__new__(SentinelChannel)  # a channel whose transport was detached
    channel.connection = types.SimpleNamespace(client=None)
    with pytest.raises(redis.ConnectionError, match="detached"):
        channel._sentinel_managed_pool()
    with pytest.raises(redis.ConnectionError, match="detached"):
        channel._get_pool()


# -- private servers ------------------------------------------------------------------------------
class LagProxy:
    """A TCP relay in front of the primary: the address the sentinel monitors, and so the one every
    client and the replica use (a replica pointed anywhere else is re-pointed by the sentinel,
    ``+fix-slave-config``). ``hold()`` keeps back what the primary sends on the replication link (a
    connection that sent ``REPLCONF`` or ``PSYNC``); ``cut()`` closes everything, so the replica never
    sees the writes the primary acknowledged after ``hold()``. Other connections pass untouched."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.holding = threading.Event()
        self.held_bytes = 0
        self.socks: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

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
                    self.held_bytes += len(data)  # kept back for good: the stream cannot resume
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

    def hold(self) -> None:
        self.holding.set()

    def cut(self) -> None:
        self.closed = True
        self.server.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


class SentinelCluster:
    """A primary, a replica and one sentinel, each a private ``redis-server`` in ``workdir``; with
    ``proxy``, the primary is reached through a ``LagProxy``."""

    def __init__(self, workdir: Path, *, proxy: bool = False) -> None:
        self.dir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports = {name: free_port() for name in ("primary", "replica", "sentinel")}
        self.proxy: LagProxy | None = None
        self._start("primary")
        self.monitored = self.ports["primary"]  # the master's address, as the sentinel and clients see it
        if proxy:
            self.proxy = LagProxy(self.ports["primary"])
            self.monitored = self.proxy.port
        self._start("replica", "--replicaof", "127.0.0.1", str(self.monitored))
        wait_for(lambda: self.info("replica").get("master_link_status") == "up", 20, what="the replica to sync")
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.ports['sentinel']}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.monitored} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 5000\n"
        )
        self.procs["sentinel"] = subprocess.Popen(
            ["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(self._sentinel_sees_the_replica, 20, what="the sentinel to find the replica")

    def _start(self, name: str, *extra: str) -> None:
        port = self.ports[name]
        self.procs[name] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(self.dir), "--logfile", str(self.dir / f"{name}.log"), *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: self._answers(port), 15, what=f"the private {name}")

    @staticmethod
    def _answers(port: int) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def direct(self, name: str):
        import redis

        return redis.Redis(port=self.ports[name], socket_timeout=2, socket_connect_timeout=2)

    def info(self, name: str) -> dict:
        import redis

        try:
            return self.direct(name).info("replication")
        except redis.RedisError:
            return {}

    def _sentinel_sees_the_replica(self) -> bool:
        import redis

        try:
            replicas = self.direct("sentinel").sentinel_slaves(MASTER)
        except redis.RedisError:
            return False
        return any(r["port"] == self.ports["replica"] and not r["is_sdown"] for r in replicas)

    def master_port(self) -> int | None:
        import redis

        try:
            addr = self.direct("sentinel").sentinel_get_master_addr_by_name(MASTER)
        except redis.RedisError:
            return None
        return int(addr[1]) if addr else None

    def url(self, db: int = 0) -> str:
        return f"sentinel://127.0.0.1:{self.ports['sentinel']}/{db}?master_name={MASTER}"

    def kill_primary(self) -> float:
        """SIGKILL the primary (cutting the proxy, if any, with what it held); returns time.monotonic()."""
        self.procs["primary"].send_signal(signal.SIGKILL)
        self.procs["primary"].wait(10)
        if self.proxy is not None:
            self.proxy.cut()
        return time.monotonic()

    def wait_promoted(self, timeout: float = 30.0) -> None:
        def promoted() -> bool:
            return self.master_port() == self.ports["replica"] and self.info("replica").get("role") == "master"

        wait_for(promoted, timeout, 0.1, what="the sentinel to promote the replica")

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.cut()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture()
def cluster(tmp_path):
    c = SentinelCluster(tmp_path)
    yield c
    c.close()


@pytest.fixture()
def lagging_cluster(tmp_path):
    c = SentinelCluster(tmp_path, proxy=True)
    yield c
    c.close()


@needs_redis
@pytest.mark.integration
def test_clients_follow_the_master_through_a_failover(cluster):
    r = redis_from_url(cluster.url(1))
    assert r.info("server")["tcp_port"] == cluster.ports["primary"]  # the sentinel's master, not the replica
    store = JobStore(r, "batchery:test-sentinel", ttl=600)
    strikes = Strikes(r, "batchery:test-sentinel-strikes", ttl=600)
    job = "batch_sentinel"
    store.create(job, queue="q", model=None)
    store.end_submit(job, total=3, max_line=2)
    assert store.claim(job, 0, 60) == "run"
    assert store.write(job, 0, {"custom_id": "a"}, failed=False) == (True, "in_progress")
    assert strikes.add(f"{job}-1") == 1
    primary = cluster.direct("primary")
    primary.execute_command("SELECT", 1)
    assert primary.exists(store.key(job))  # it was the primary that took the writes
    r.execute_command("WAIT", 1, 5000)  # everything so far is on the replica

    cluster.kill_primary()
    # the same client object: its commands fail while no master answers, then land on the promoted replica
    t0 = time.monotonic()
    assert retry_through_outage(lambda: strikes.add(f"{job}-1"), "counting a strike", deadline=t0 + 40) == 2
    took = time.monotonic() - t0
    cluster.wait_promoted()
    assert r.info("server")["tcp_port"] == cluster.ports["replica"]
    assert r.info("replication")["role"] == "master"
    # the job store's scripts run on the new master (its script cache is empty: redis-py loads them again)
    assert store.claim(job, 0, 60) == "done"
    assert store.claim(job, 1, 60) == "run"
    assert store.write(job, 1, {"custom_id": "b"}, failed=False) == (True, "in_progress")
    assert store.write(job, 1, {"custom_id": "b"}, failed=False) == (False, "in_progress")
    assert store.status(job).request_counts.completed == 2
    print(f"failover: the client's strike went through {took:.1f} s after the primary was SIGKILLed")
    r.close()
    assert check_redis(cluster.url(), "BATCHERY_BROKER_URL") is None


@needs_redis
@pytest.mark.integration
def test_a_command_cut_off_by_the_failover_is_retried_on_the_new_master(cluster):
    """redis-py's own retry of a command reconnects to the address it had (``send_packed_command`` ->
    ``connect_check_health``), not to the one the sentinels name: a command in flight when the primary
    died kept knocking on the dead address until its retries ran out. Ours asks the sentinels again."""
    r = redis_from_url(cluster.url(2))
    r.delete("batchery-test-sentinel-list")
    outcome: list[object] = []

    def pop() -> None:
        try:
            outcome.append(r.blpop(["batchery-test-sentinel-list"], timeout=15))
        except Exception as exc:  # noqa: BLE001
            outcome.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=pop, daemon=True)
    t.start()
    wait_for(lambda: any(c.get("cmd") == "blpop" for c in cluster.direct("primary").client_list()), 10, what="BLPOP")
    cluster.kill_primary()  # the BLPOP's connection breaks: its reply never comes
    cluster.wait_promoted()
    new_master = cluster.direct("replica")
    new_master.execute_command("SELECT", 2)
    new_master.rpush("batchery-test-sentinel-list", "after the failover")
    t.join(60)
    assert not t.is_alive(), "the command never came back"
    assert outcome == [(b"batchery-test-sentinel-list", b"after the failover")], outcome
    r.close()


@needs_redis
@pytest.mark.integration
def test_a_master_name_no_sentinel_knows_fails_the_check(cluster):
    url = f"sentinel://127.0.0.1:{cluster.ports['sentinel']}/0?master_name=nosuch"
    t0 = time.monotonic()
    with pytest.raises(SentinelConfigError, match=f"named 'nosuch'; they monitor: {MASTER}"):
        check_redis(url, "BATCHERY_BROKER_URL")
    assert time.monotonic() - t0 < 30
    assert issubclass(SentinelConfigError, RedisAuthError)  # the worker exits 2 (configuration), not retry


# -- end to end: a worker, a client, a batch job, the primary SIGKILLed ---------------------------
LINES = 30


def _lines(n: int, max_tokens: int) -> list[dict]:
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    return [
        {
            "custom_id": f"s-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": " ".join(words[(i + j) % len(words)] for j in range(5))}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(n)
    ]


def _sentinel_client(broker: str, backend: str, queue: str):
    from batchery.client import Client

    return Client(
        settings=Settings(
            broker_url=broker,
            result_backend=backend,
            queue=queue,
            result_expires=600,
            max_task_timeout=15,
            task_timeout=15,
            retry_backoff_max=2,
            visibility_timeout=20,
        )
    )


WORKER_ENV = {
    # short deadlines, so a message whose ack the failover lost comes back after 20 s, not 5 minutes
    "BATCHERY_TASK_TIMEOUT": "15",
    "BATCHERY_MAX_TASK_TIMEOUT": "15",
    "BATCHERY_VISIBILITY_TIMEOUT": "20",
    # two lines at a time, so the job lasts long enough for the kill (and a 2 s hold) to find it mid-way
    "BATCHERY_MAX_NUM_SEQS": "2",
    "BATCHERY_CONCURRENCY": "3",
}
MAX_TOKENS = 100


def _tally(client, job_id: str, lines: list[dict]) -> tuple[int, int, object]:
    job = client.batch_status(job_id)
    records = list(client.batch_results(job_id))
    per_id = Counter(r["custom_id"] for r in records)
    lost = sum(1 for ln in lines if per_id[ln["custom_id"]] == 0)
    counted = job.request_counts.completed + job.request_counts.failed
    duplicated = sum(n - 1 for n in per_id.values() if n > 1) + max(0, counted - len(records))
    assert all(r["error"] is None for r in records), [r["error"] for r in records if r["error"]][:3]
    return lost, duplicated, job


def _run_failover(cluster, workers, *, hold_s: float, num_lines: int = LINES) -> dict:
    broker, backend = cluster.url(0), cluster.url(1)
    queue = workers.new_queue()
    w = workers.spawn(queue, BATCHERY_BROKER_URL=broker, BATCHERY_RESULT_BACKEND=backend, **WORKER_ENV)
    client = _sentinel_client(broker, backend, queue)
    lines = _lines(num_lines, MAX_TOKENS)
    job_id = client.submit_batch(lines)
    results_key = client.jobs.keys(job_id)[1]

    def done() -> int:
        c = client.batch_status(job_id).request_counts
        return c.completed + c.failed

    wait_for(lambda: done() >= 4, 60, what="the first lines to finish")
    primary = cluster.direct("primary")
    primary.execute_command("SELECT", 1)
    before_hold = primary.hlen(results_key)
    if hold_s:
        cluster.proxy.hold()
        time.sleep(hold_s)
    at_kill = primary.hlen(results_key)
    assert at_kill < num_lines, "the job finished before the kill: slow it down"
    t_kill = cluster.kill_primary()
    cluster.wait_promoted()
    promoted_s = time.monotonic() - t_kill
    new_master = cluster.direct("replica")
    new_master.execute_command("SELECT", 1)
    after = new_master.hlen(results_key)
    requeued: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: requeued.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("batchery.recover").addHandler(handler)
    try:
        status = client.wait_batch(job_id, timeout=120, poll_interval=0.2, recover_after=5)
    finally:
        logging.getLogger("batchery.recover").removeHandler(handler)
    took = time.monotonic() - t_kill
    lost, duplicated, job = _tally(client, job_id, lines)
    log = w.log()
    figures = {
        "records_before_hold": before_hold,
        "records_at_kill": at_kill,
        "records_on_new_master": after,
        "records_lost_by_failover": at_kill - after,
        "held_bytes": cluster.proxy.held_bytes if cluster.proxy else 0,
        "requeued_from_ledger": sum(
            int(m.group(1)) for m in (re.search(r"the messages of (\d+) lines", t) for t in requeued) if m
        ),
        "task_runs": len(re.findall(r"batch_line\[\S+\] succeeded", log)),
        "promoted_s": round(promoted_s, 1),
        "job_done_s": round(took, 1),
        "lost": lost,
        "duplicated": duplicated,
        "status": status.status,
        "worker_reconnected": "Connection to broker lost" in log,
        "worker_alive": w.proc.poll() is None,
    }
    print("sentinel failover:", figures)
    assert job.status == "completed", (figures, w.tail())
    assert (lost, duplicated) == (0, 0), figures
    # kombu may follow the new master without logging a lost connection (seen in CI): what matters is that
    # the worker lives and that every record is on the promoted replica, which it wrote after the kill
    assert figures["worker_alive"], w.tail()
    assert new_master.hlen(results_key) == num_lines, (figures, w.tail())
    assert w.stats()["state"] == "serving"
    client.close()
    return figures


@needs_redis
@pytest.mark.integration
def test_a_batch_job_completes_through_a_sentinel_failover(cluster, workers):
    # replication keeps up on one host: records_lost_by_failover was 0 in every run here (printed, not
    # asserted: a record written in the last microsecond before the kill may be lost, and is run again)
    _run_failover(cluster, workers, hold_s=0)


@needs_redis
@pytest.mark.integration
def test_writes_lost_by_asynchronous_replication_are_run_again(lagging_cluster, workers):
    # the replication stream is held back for 2 s before the kill: records (and acks, and queue pops)
    # the primary acknowledged in those 2 s never reach the replica that becomes the master
    # more lines: the job goes on during the hold, and a fast CPU finished 30 of them in it (CI saw 30 of 30)
    figures = _run_failover(lagging_cluster, workers, hold_s=2.0, num_lines=6 * LINES)
    assert figures["held_bytes"] > 0
    assert figures["records_lost_by_failover"] > 0, "no acknowledged record was lost: the test proves nothing"


def test_mask_url_masks_each_sentinel():
    for url in (
        "sentinel://:pw@a;sentinel://:pw@b:26379",
        "sentinel://:pw@a:1/0;sentinel://:pw@b:2/0?master_name=m",
        "sentinel://u:pw@a:1;sentinel://u:pw@b:2/0?master_name=m",
    ):
        assert ":pw@" not in mask_url(url), mask_url(url)
    assert mask_url("sentinel://:pw@a:1/0;sentinel://b:2/0") == "sentinel://:***@a:1/0;sentinel://b:2/0"
