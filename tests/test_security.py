"""Redis with a password, and over TLS, against private ``redis-server`` processes.

1. a worker and a client work through ``redis://:PASSWORD@127.0.0.1:PORT/0`` (requests, a batch
   job, the metrics' queue depth), and the password never appears in the worker's log, even at
   DEBUG;
2. a wrong or missing password fails at once with a clear message: the worker exits 2 before it
   loads the model, the client raises ``RedisAuthError`` on its first send;
3. ``rediss://`` with the certificate options in the URL's query works end to end, and an
   unverifiable certificate fails clearly.

The password is never on a command line: redis-server reads its configuration from stdin."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import WorkerFactory, free_port, wait_for

from batchery.broker.check import RedisAuthError, check_redis
from batchery.client import Client
from batchery.contract.settings import Settings

HI = [{"role": "user", "content": "hello world"}]
QUEUE = f"batchery-secure-{uuid.uuid4().hex[:8]}"
pytestmark = [
    pytest.mark.integration,  # private redis-server processes and real workers
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


class PrivateRedis:
    """A throwaway redis-server on 127.0.0.1 with ``requirepass``, optionally TLS only."""

    def __init__(self, workdir: Path, tls: dict[str, Path] | None = None) -> None:
        self.password = secrets.token_urlsafe(18)
        self.port = free_port()
        self.tls = tls
        conf = [
            "bind 127.0.0.1",
            f"requirepass {self.password}",
            'save ""',
            "appendonly no",
            "maxmemory-policy noeviction",
            f"dir {workdir}",
            'logfile ""',
        ]
        if tls:
            conf += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {tls['cert']}",
                f"tls-key-file {tls['key']}",
                f"tls-ca-cert-file {tls['cert']}",
                "tls-auth-clients no",
            ]
        else:
            conf += [f"port {self.port}"]
        self.log = open(workdir / f"redis-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            ["redis-server", "-"], stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.proc.stdin.write(("\n".join(conf) + "\n").encode())
        self.proc.stdin.close()
        wait_for(lambda: self._answers(), 15, what="the private redis-server")

    def url(self, db: int = 0, password: str | None = None) -> str:
        pw = self.password if password is None else password
        auth = f":{pw}@" if pw else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/{db}?ssl_cert_reqs=required&ssl_ca_certs={self.tls['cert']}"
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def _answers(self) -> bool:
        assert self.proc.poll() is None, "redis-server exited"
        return check_redis(self.url(), "test") is None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def client_for(url0: str, url1: str) -> Client:
    return Client(
        settings=Settings(
            broker_url=url0,
            result_backend=url1,
            queue=QUEUE,
            result_expires=600,
            max_task_timeout=60,
            task_timeout=60,
            retry_backoff_max=2,
            visibility_timeout=300,
        )
    )


def spawn(factory: WorkerFactory, broker: str, backend: str, **env):
    return factory.spawn(QUEUE, BATCHERY_BROKER_URL=broker, BATCHERY_RESULT_BACKEND=backend, **env)


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    r = PrivateRedis(tmp_path_factory.mktemp("redis-auth"))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def secure_worker(locked, tiny_model_dir, tmp_path_factory):
    f = WorkerFactory(tiny_model_dir, locked.url(0), locked.url(1), tmp_path_factory.mktemp("secure-worker"))
    w = spawn(f, locked.url(0), locked.url(1), BATCHERY_LOG_LEVEL="DEBUG", BATCHERY_LOG_FORMAT="json")
    yield w
    f.close()


# -- 1. a password ------------------------------------------------------------------------------------
def test_worker_and_client_work_through_a_password_url(locked, secure_worker):
    with client_for(locked.url(0), locked.url(1)) as c:
        r = c.chat(HI, max_tokens=4, temperature=0).get(timeout=60)
        assert r.usage.completion_tokens > 0
        line = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": HI, "max_tokens": 2},
        }
        job = c.submit_batch([line])
        assert c.wait_batch(job, timeout=60).request_counts.completed == 1
        assert [x["custom_id"] for x in c.batch_results(job)] == ["a"]
    with urllib.request.urlopen(f"http://127.0.0.1:{secure_worker.health_port}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert f'batchery_queue_depth{{queue="{QUEUE}"}} 0.0' in metrics  # the metrics' own Redis login works


def test_the_password_never_reaches_the_worker_log(locked, secure_worker):
    with client_for(locked.url(0), locked.url(1)) as c:
        h = c.chat(HI, max_tokens=2)
        h.get(timeout=60)
    secure_worker.wait_for_log(rf"batchery.chat_completion\[{h.id}\] succeeded", 10)
    log = secure_worker.log()
    assert locked.password not in log
    assert f"redis://:***@127.0.0.1:{locked.port}/0" in log  # the worker says where it connects
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(r["level"] == "DEBUG" for r in records)  # the most talkative level was on
    assert [r for r in records if r.get("task_id") == h.id and "succeeded" in r["message"]]


# -- 2. a wrong or missing password -----------------------------------------------------------------
@pytest.mark.parametrize(
    "password, says",
    [
        ("wrong-password", "refused the password in BATCHERY_BROKER_URL"),
        ("", "requires a password and BATCHERY_BROKER_URL has none"),
    ],
)
def test_worker_with_bad_credentials_exits_2_before_loading_the_model(locked, workers, password, says):
    url = locked.url(0, password=password)
    w = spawn(workers, url, url, ready=False)
    assert w.wait(60) == 2
    log = w.log()
    assert says in log and "not starting" in log
    assert "loading model" not in log  # it did not spend minutes loading weights first
    assert locked.password not in log and (not password or password not in log)


@pytest.mark.parametrize(
    "password, says", [("wrong-password", "refused the password in the broker URL"), ("", "requires a password")]
)
def test_client_with_bad_credentials_fails_at_once(locked, password, says):
    url = locked.url(0, password=password)
    t0 = time.monotonic()
    with client_for(url, url) as c, pytest.raises(RedisAuthError) as err:
        c.chat(HI, max_tokens=2)
    assert time.monotonic() - t0 < 5  # not Celery's ~20 s of reconnecting
    msg = str(err.value)
    assert says in msg and f"127.0.0.1:{locked.port}" in msg
    assert locked.password not in msg and (not password or password not in msg)
    assert isinstance(err.value, ConnectionError)


# -- 3. TLS ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    d = tmp_path_factory.mktemp("redis-tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    r = PrivateRedis(d, tls={"cert": cert, "key": key})
    yield r
    r.stop()


def test_rediss_urls_with_certificate_options_work_end_to_end(tls_redis, tiny_model_dir, tmp_path):
    f = WorkerFactory(tiny_model_dir, tls_redis.url(0), tls_redis.url(1), tmp_path)
    try:
        w = spawn(f, tls_redis.url(0), tls_redis.url(1))
        with client_for(tls_redis.url(0), tls_redis.url(1)) as c:
            assert c.chat(HI, max_tokens=3, temperature=0).get(timeout=60).usage.completion_tokens > 0
        assert tls_redis.password not in w.log()
        assert f"rediss://:***@127.0.0.1:{tls_redis.port}/0" in w.log()
    finally:
        f.close()


def test_an_unverifiable_certificate_fails_clearly(tls_redis):
    url = tls_redis.url(0).split("&ssl_ca_certs=")[0]  # required, but no CA that signed it
    with pytest.raises(RedisAuthError, match="TLS verification failed .* ssl_ca_certs"):
        check_redis(url, "BATCHERY_BROKER_URL")
