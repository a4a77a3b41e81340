"""The web console of ``batchery serve`` (issue 40) over HTTP, without a browser: the real app (``TestClient``), the
real Redis and the API's own batches (made with the ``openai`` SDK on a queue no worker consumes, so they stay
``in_progress``): the login cookie's flags, tenancy (another key's job is a 404, an operator key sees all and the
workers page), CSRF on cancel, escaping of user input, the no-key console's loopback-only answers, and the vendored
chart library. tests/test_console_browser.py drives the same pages in Chromium with a real worker."""

from __future__ import annotations

import io
import json
import re
import time
import uuid

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")
openai = pytest.importorskip("openai")

from api_util import api_settings, drop_api_keys  # noqa: E402
from conftest import drop_queue_keys, redis_client, wait_for  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from batchery.api.app import create_app  # noqa: E402
from batchery.api.console.session import COOKIE  # noqa: E402

KEY_A = "sk-console-a-" + "1" * 16
KEY_B = "sk-console-b-" + "2" * 16
OPERATOR = "op-console-" + "3" * 16
XSS = "<script>alert(1)</script>"


def chat_line(cid: str) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def cleanup(s) -> None:
    """Delete the test's API keys, its jobs (the job store's keys) and its queue."""
    from batchery.jobs.store import JobStore

    r = redis_client(s.result_backend)
    ids: list[str] = []
    for key in r.scan_iter(match=f"{s.api.key_prefix}:batches:*"):
        ids += [i.decode() for i in r.zrange(key, 0, -1)]
    store = JobStore(r, s.batch.key_prefix)
    for i in ids:
        store.delete(i)
    drop_api_keys(s.result_backend, s.api.key_prefix)
    drop_queue_keys(redis_client(s.broker_url), str(s.queue))


@pytest.fixture()
def app_settings(redis_urls, tmp_path):
    queue = f"batchery-test-console-{uuid.uuid4().hex[:8]}"  # no worker: jobs stay in_progress
    s = api_settings(redis_urls, tmp_path, queue=queue, keys=f"{KEY_A},{KEY_B}", operator_keys=OPERATOR)
    yield s
    cleanup(s)


@pytest.fixture()
def http(app_settings):
    with TestClient(create_app(app_settings), base_url="http://127.0.0.1:8000") as tc:
        yield tc


def make_batch(http: TestClient, key: str, metadata: dict | None = None, cids=("a", "b"), bad=()) -> str:
    """A batch of chat lines ``cids`` and lines ``bad`` for another endpoint (error lines at submission), once it is
    ``in_progress``."""
    sdk = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=key, http_client=http, max_retries=0)
    lines = [chat_line(c) for c in cids] + [{**chat_line(c), "url": "/v1/completions"} for c in bad]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    f = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    b = sdk.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata=metadata
    )
    # a batch starts ``validating`` and a background thread submits its lines: every test here reads an in_progress job
    wait_for(lambda: sdk.batches.retrieve(b.id).status == "in_progress", 30, what=f"batch {b.id} in_progress")
    return b.id


def login(http: TestClient, key: str):
    http.cookies.clear()
    return http.post("/login", data={"key": key}, follow_redirects=False)


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)


def test_login_sets_a_strict_httponly_cookie_and_never_puts_the_key_in_a_url(http):
    r = http.get("/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert "password" in http.get("/login").text
    r = login(http, "sk-wrong")
    assert (
        r.status_code == 401 and "not one this server knows" in r.text and COOKIE not in r.headers.get("set-cookie", "")
    )
    r = login(http, KEY_A)
    assert r.status_code == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"]
    assert (
        cookie.startswith(f"{COOKIE}=")
        and "HttpOnly" in cookie
        and "SameSite=strict" in cookie.replace("Strict", "strict")
    )
    assert KEY_A not in r.headers["location"]
    page = http.get("/")
    assert page.status_code == 200 and "Jobs" in page.text and KEY_A not in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"] and page.headers["x-frame-options"] == "DENY"
    # a key in the query string is not a way in
    http.cookies.clear()
    assert http.get(f"/?key={KEY_A}", follow_redirects=False).status_code == 303


def test_a_key_sees_only_its_own_jobs_and_the_operator_sees_all(http):
    a = make_batch(http, KEY_A, {"owner": "a"})
    b = make_batch(http, KEY_B, {"owner": "b"})
    login(http, KEY_A)
    jobs = http.get("/").text
    assert a in jobs and b not in jobs
    assert http.get(f"/jobs/{a}").status_code == 200
    assert http.get(f"/jobs/{b}").status_code == 404
    assert http.get(f"/jobs/{b}/series.json").status_code == 404
    assert http.get(f"/jobs/{b}/output.jsonl").status_code == 404
    assert http.get("/workers").status_code == 404  # an API key is no operator
    page = http.get(f"/jobs/{a}").text
    assert http.post(f"/jobs/{b}/cancel", data={"csrf": csrf_of(page)}, follow_redirects=False).status_code == 404
    login(http, OPERATOR)
    jobs = http.get("/").text
    assert a in jobs and b in jobs
    assert http.get(f"/jobs/{b}").status_code == 200
    workers = http.get("/workers")
    assert workers.status_code == 200 and "Workers" in workers.text
    done = http.get("/?status=completed").text  # the operator sees every job of the store: other tests' too
    assert a not in done and b not in done
    assert a in http.get("/?status=in_progress").text


def test_user_input_is_escaped_everywhere(http):
    a = make_batch(http, KEY_A, {"note": XSS}, cids=(XSS, "ok"), bad=(XSS + "-bad",))
    sdk = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY_A, http_client=http, max_retries=0)
    wait_for(lambda: sdk.batches.retrieve(a).request_counts.failed == 1, 30, what="the bad line's error record")
    login(http, KEY_A)
    failures = re.search(r'<table class="failures" id="failures">(.*?)</table>', http.get(f"/jobs/{a}").text, re.S)
    assert failures, "no failures table"
    assert "line 3" in failures.group(1) and "&lt;script&gt;alert(1)&lt;/script&gt;-bad" in failures.group(1)
    for page in (http.get("/").text, http.get(f"/jobs/{a}").text, http.get(f"/jobs/{a}?fragment=1").text):
        assert XSS not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_cancel_needs_the_csrf_token_and_a_same_site_origin(http, app_settings):
    a = make_batch(http, KEY_A)
    login(http, KEY_A)
    page = http.get(f"/jobs/{a}").text
    assert 'id="cancel"' in page and "data-confirm=" in page
    token = csrf_of(page)
    assert http.post(f"/jobs/{a}/cancel", data={}, follow_redirects=False).status_code == 403
    assert http.post(f"/jobs/{a}/cancel", data={"csrf": "0" * 32}, follow_redirects=False).status_code == 403
    foreign = {"origin": "http://evil.example"}
    r = http.post(f"/jobs/{a}/cancel", data={"csrf": token}, headers=foreign, follow_redirects=False)
    assert r.status_code == 403
    # another key's token does not work either
    login(http, KEY_B)
    b_token = csrf_of(http.get("/").text)
    login(http, KEY_A)
    assert http.post(f"/jobs/{a}/cancel", data={"csrf": b_token}, follow_redirects=False).status_code == 403
    assert 'id="cancel"' in http.get(f"/jobs/{a}").text  # nothing was cancelled
    r = http.post(
        f"/jobs/{a}/cancel", data={"csrf": token}, headers={"origin": "http://127.0.0.1:8000"}, follow_redirects=False
    )
    assert r.status_code == 303 and r.headers["location"] == f"/jobs/{a}"
    sdk = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY_A, http_client=http, max_retries=0)
    assert sdk.batches.retrieve(a).status in ("cancelling", "cancelled")


def test_the_job_page_samples_the_counts_and_lists_transitions(http):
    a = make_batch(http, KEY_A)
    login(http, KEY_A)
    page = http.get(f"/jobs/{a}").text
    assert "created" in page and "in progress" in page  # transitions
    assert 'id="download-output"' in page and 'id="no-failures"' in page
    s = http.get(f"/jobs/{a}/series.json").json()
    assert len(s["t"]) >= 1 and s["completed"][-1] == 0 and set(s) >= {"t", "completed", "failed", "tokens_per_s"}


def test_without_keys_the_console_is_local_only(redis_urls, tmp_path):
    s = api_settings(redis_urls, tmp_path, queue=f"batchery-test-console-{uuid.uuid4().hex[:8]}")
    try:
        with TestClient(create_app(s), base_url="http://127.0.0.1:8000") as tc:
            r = tc.get("/")
            assert r.status_code == 200 and "local (no keys configured)" in r.text
            assert tc.get("/workers").status_code == 200
            assert tc.get("/login", follow_redirects=False).status_code == 303
            assert tc.get("/", headers={"host": "localhost:8000"}).status_code == 200
            assert tc.get("/", headers={"host": "[::1]:8000"}).status_code == 200
            # a page of another site whose name points at 127.0.0.1 (DNS rebinding) gets nothing
            assert tc.get("/", headers={"host": "evil.example:8000"}).status_code == 403
            assert tc.get("/workers", headers={"host": "evil.example"}).status_code == 403
    finally:
        cleanup(s)


def test_static_files_and_the_vendored_chart_library(http):
    js = http.get("/console/static/uPlot.iife.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript") and "uPlot" in js.text
    lic = http.get("/console/static/uPlot.LICENSE")
    assert lic.status_code == 200 and "MIT" in lic.text
    assert http.get("/console/static/console.js").status_code == 200
    assert http.get("/console/static/console.css").status_code == 200
    assert http.get("/console/static/../routes.py").status_code == 404
    assert http.get("/console/static/missing.js").status_code == 404
    assert http.get("/healthz").json() == {"status": "ok"}  # the API is where it was


def test_the_workers_page_shows_queues_and_a_failing_engine_in_red(http, app_settings):
    """Twenty workers announced on the test's queue (as a worker's presence beacon does, with its engine snapshot),
    one of them rebuilding after a failure whose message is user-controlled text; three messages queued."""
    from batchery.broker import presence
    from batchery.broker.queues import queue_keys

    broker = redis_client(app_settings.broker_url)
    queue = str(app_settings.queue)
    hosts = [f"fake-{n}@{uuid.uuid4().hex[:6]}" for n in range(20)]
    for n, host in enumerate(hosts):
        info = {
            "model": "tiny",
            "host": "box",
            "pid": 1000 + n,
            "state": "rebuilding" if n == 0 else "serving",
            "last_error": f"engine step raised {XSS}" if n == 0 else None,
            "batch_size": 3.0,
            "steps_per_s": 12.5,
            "kv_blocks_total": 200,
            "kv_blocks_used": 50,
            "num_rebuilds": 2 if n == 0 else 0,
            "announced_at": time.time(),
        }
        presence.announce(broker, queue, host, info, ttl_s=60)
    broker.lpush(queue_keys(queue)[0], "a", "b", "c")
    try:
        login(http, OPERATOR)
        page = http.get("/workers?fragment=1").text
        assert sum(f'data-hostname="{h}"' in page for h in hosts) == 20
        m = re.search(rf'<section class="queue" data-queue="{re.escape(queue)}">(.*?)</section>', page, flags=re.S)
        assert m, "no section for the test's queue"
        section = m.group(1)
        assert '<span class="depth">3</span>' in section and "20 workers" in section
        assert f'<tr class="worker bad" data-hostname="{hosts[0]}">' in section
        assert section.count('class="worker bad"') == 1 and "25%" in section and "12.5" in section
        assert XSS not in page and "engine step raised &lt;script&gt;" in page
        presence.withdraw(broker, queue, hosts[1])  # a worker that stops is gone from the next page
        assert f'data-hostname="{hosts[1]}"' not in http.get("/workers?fragment=1").text
    finally:
        for host in hosts:
            presence.withdraw(broker, queue, host)


def test_a_workers_announcement_carries_its_engine_snapshot():
    """What the workers page shows comes from each announcement: batch size and steps/s between two of them."""
    from batchery.worker.background import EngineSnapshot

    class Service:
        def __init__(self) -> None:
            self.steps, self.seqs = 10, 20
            self.counters = type("C", (), {"last_failure": "step raised RuntimeError: boom"})()

        def stats(self) -> dict:
            engine = {"num_running": 3, "kv_blocks_total": 100, "kv_blocks_free": 60}
            return {
                "state": "serving",
                "num_pending": 4,
                "num_steps": self.steps,
                "num_step_seqs": self.seqs,
                "num_rebuilds": 1,
                "num_failures": 1,
                "engine": engine,
            }

        def health(self) -> dict:
            return {"fatal_reason": None}

    service = Service()
    snap = EngineSnapshot(service)
    first = snap()
    assert first["steps_per_s"] == 0.0 and first["kv_blocks_used"] == 40 and first["kv_blocks_total"] == 100
    assert first["last_error"] == "step raised RuntimeError: boom" and first["num_rebuilds"] == 1
    time.sleep(0.05)
    service.steps, service.seqs = 20, 50  # 10 steps of 3 sequences
    second = snap()
    assert second["batch_size"] == 3.0 and second["steps_per_s"] > 0 and second["state"] == "serving"
    assert second["announced_at"] >= first["announced_at"]
