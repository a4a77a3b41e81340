"""``batchery serve``: the synchronous endpoints (Chat Completions, Completions, Responses), Models, keys,
body bounds and the ``batchery serve`` command, with the official ``openai`` package as the client against
a real uvicorn server on a socket, in front of the session's tiny-model worker.

- The SDK parses every answer (``chat.completions.create``, ``completions.create``, ``responses.create``
  and its ``output_text``, ``models.list``/``retrieve``), and the answers are the worker's: at
  temperature 0 the same text as the Python client gets through the queue.
- A wrong or missing key is ``openai.AuthenticationError``; a key sees only its own files and batches
  (``openai.NotFoundError`` for the other key's); a bad body is ``openai.BadRequestError``
  naming the field (``param`` too); ``stream: true`` says batchery serve does not stream; a body over
  ``BATCHERY_API__MAX_BODY_BYTES`` is a 413 (with or without a Content-Length); a prompt over the
  model's context is ``context_length_exceeded``; no worker on the queue is a 503 saying so at once;
  a wait past ``BATCHERY_API__REQUEST_TIMEOUT`` is a 504; a Redis outage is a 503 at once, and the same
  server sends again once Redis is back.
- ``batchery serve`` as a process: refuses a non-loopback host without keys, says it is local and
  unauthenticated, answers the SDK with keys and never logs them, stops cleanly on SIGTERM; without a
  broker it brings up the embedded Redis and worker and leaves no process behind; the light install
  (no serve extra) names ``pip install 'batchery[serve]'``.
- Restarting the API process mid-job loses nothing (needs the Batches endpoints)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from api_util import (  # noqa: E402
    ServeProcess,
    api_settings,
    drop_api_keys,
    openai_client,
    running_api,
    serve_env,
)
from conftest import REPO, free_port, wait_for  # noqa: E402

pytestmark = pytest.mark.integration  # uvicorn servers, batchery serve processes and the tiny worker

KEY_A = "sk-test-key-aaaaaaaaaaaa"
KEY_B = "sk-test-key-bbbbbbbbbbbb"
HELLO = [{"role": "user", "content": "hello world, write a story"}]


@pytest.fixture(scope="module")
def server(tiny_worker, redis_urls, tmp_path_factory):
    """One server with two keys in front of the tiny worker's queue."""
    settings = api_settings(
        redis_urls, tmp_path_factory.mktemp("api"), queue=tiny_worker.queue, keys=f"{KEY_A},{KEY_B}"
    )
    with running_api(settings) as base_url:
        yield base_url


@pytest.fixture()
def sdk(server):
    return openai_client(server, KEY_A)


def raw_post(base_url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(base_url + path, data=body, method="POST")
    for k, v in {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}", **(headers or {})}.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


# -- the synchronous endpoints ------------------------------------------------------------------------------
def test_chat_completions_create_is_the_workers_answer(sdk, tiny_client, tiny_worker):
    r = sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    direct = tiny_client.chat(HELLO, max_tokens=8, temperature=0).get(timeout=120)
    assert r.choices[0].message.content == direct.choices[0].message.content
    assert r.model == direct.model  # the worker's model, whatever the request named


def test_the_body_is_what_the_worker_returned(server, tiny_client):
    """The HTTP body has exactly the worker's fields (nothing added, nothing dropped)."""
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0}
    status, got = raw_post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, got
    direct = tiny_client.chat(HELLO, max_tokens=4, temperature=0)
    raw = direct._result.get(timeout=120)
    assert set(got) == set(raw)
    assert set(got["choices"][0]) == set(raw["choices"][0])
    assert got["choices"][0]["message"] == raw["choices"][0]["message"]


def test_completions_create(sdk, tiny_client):
    r = sdk.completions.create(model="tiny", prompt="once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    direct = tiny_client.complete("once upon a time", max_tokens=6, temperature=0).get(timeout=120)
    assert r.choices[0].text == direct.choices[0].text
    assert 0 < r.usage.completion_tokens <= 6


def test_responses_create_output_text(sdk):
    r = sdk.responses.create(model="tiny", input="hello world, write a story", max_output_tokens=16, temperature=0)
    assert r.object == "response"
    chat = sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, temperature=0)
    assert r.output_text == chat.choices[0].message.content  # a Responses request runs as that chat completion
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_models_list_names_the_live_workers_model(sdk, tiny_worker):
    served = tiny_worker.env["BATCHERY_MODEL"]
    models = sdk.models.list()
    ids = [m.id for m in models.data]
    assert served in ids, ids
    m = next(m for m in models.data if m.id == served)
    assert m.object == "model" and m.owned_by == "batchery" and m.created > 0
    assert sdk.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError) as exc:
        sdk.models.retrieve("no-such-model")
    assert exc.value.code == "model_not_found"


def test_models_list_names_the_servers_own_model_while_its_queue_has_a_worker(tiny_worker, redis_urls, tmp_path):
    settings = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue, model="my-alias-for-tiny")
    with running_api(settings) as base_url:
        sdk = openai_client(base_url)
        ids = [m.id for m in sdk.models.list().data]
        assert "my-alias-for-tiny" in ids and tiny_worker.env["BATCHERY_MODEL"] in ids
        r = sdk.chat.completions.create(model="my-alias-for-tiny", messages=HELLO, max_tokens=2)
        assert r.model == tiny_worker.env["BATCHERY_MODEL"]  # it ran on the server's queue: the tiny worker
    settings = api_settings(redis_urls, tmp_path, queue="batchery-test-nobody-consumes-this", model="nobody-serves-me")
    with running_api(settings) as base_url:
        assert "nobody-serves-me" not in [m.id for m in openai_client(base_url).models.list().data]


def test_a_request_naming_a_served_model_runs_on_its_queue(sdk, tiny_worker):
    served = tiny_worker.env["BATCHERY_MODEL"]
    r = sdk.chat.completions.create(model=served, messages=HELLO, max_tokens=4, temperature=0)
    assert r.model == served


# -- keys ---------------------------------------------------------------------------------------------------
def test_a_wrong_key_is_an_authentication_error(server):
    for key in ("sk-wrong", KEY_A + "x", KEY_A[:-1]):
        with pytest.raises(openai.AuthenticationError) as exc:
            openai_client(server, key).models.list()
        assert exc.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, key).chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    status, body = raw_post(server, "/v1/chat/completions", b"{}", {"Authorization": ""})
    assert status == 401 and "API key" in body["error"]["message"]
    assert openai_client(server, KEY_B).models.list().data  # either key works


def test_a_key_sees_only_its_own_files_and_batches(server):
    if not _batches_served():
        pytest.skip("POST /v1/batches is not served yet (batchery/api/batches.py)")
    a, b = openai_client(server, KEY_A), openai_client(server, KEY_B)
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": HELLO, "max_tokens": 2},
    }
    up = a.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = a.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: b.files.retrieve(up.id),
        lambda: b.files.content(up.id),
        lambda: b.files.delete(up.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert up.id not in [f.id for f in b.files.list()]
    assert batch.id not in [x.id for x in b.batches.list()]
    assert a.batches.retrieve(batch.id).id == batch.id and a.files.retrieve(up.id).id == up.id


# -- bad bodies ---------------------------------------------------------------------------------------------
def test_an_invalid_body_is_a_bad_request_naming_the_field(sdk):
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=-1)
    assert "max_tokens" in exc.value.message and exc.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model="tiny", messages=HELLO, extra_body={"bogus_field": 1})
    assert "bogus_field" in exc.value.message and exc.value.param == "bogus_field"
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.completions.create(model="tiny", prompt="hi", temperature=7)
    assert exc.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.responses.create(model="tiny", input=[{"role": "user", "content": 5}])
    assert "input" in exc.value.message


def test_a_body_that_is_not_a_json_object(server):
    status, body = raw_post(server, "/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"], body
    status, body = raw_post(server, "/v1/completions", b"[1, 2]")
    assert status == 400 and "object" in body["error"]["message"], body
    status, body = raw_post(server, "/v1/chat/completions", json.dumps({"max_tokens": 4}).encode())
    assert status == 400 and body["error"]["param"] == "messages", body


def test_stream_is_refused_saying_batchery_serve_does_not_stream(sdk):
    for call in (
        lambda: sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, stream=True),
        lambda: sdk.completions.create(model="tiny", prompt="hi", max_tokens=4, stream=True),
        lambda: sdk.responses.create(model="tiny", input="hi", stream=True),
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert "streaming is not supported by batchery serve" in exc.value.message
        assert exc.value.param == "stream"


def test_a_prompt_over_the_context_is_context_length_exceeded(sdk, tiny_worker):
    max_len = int(tiny_worker.env["BATCHERY_ENGINE__MAX_MODEL_LEN"])
    long = " ".join(["hello"] * (max_len + 100))
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], max_tokens=4)
    assert exc.value.code == "context_length_exceeded"
    assert exc.value.param == "messages"


def test_a_body_over_the_limit_is_413(tiny_worker, redis_urls, tmp_path):
    settings = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue, max_body_bytes=4096)
    with running_api(settings) as base_url:
        sdk = openai_client(base_url)
        big = [{"role": "user", "content": "hello " * 1000}]
        with pytest.raises(openai.APIStatusError) as exc:
            sdk.chat.completions.create(model="tiny", messages=big, max_tokens=2)
        assert exc.value.status_code == 413
        assert "4096" in exc.value.message and exc.value.code == "request_too_large"
        # no Content-Length (chunked): counted as it arrives
        host, port = base_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        payload = json.dumps({"messages": big, "max_tokens": 2}).encode()
        chunks = (payload[i : i + 1000] for i in range(0, len(payload), 1000))
        conn.request("POST", "/v1/chat/completions", body=chunks, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413, resp.read()
        assert json.loads(resp.read())["error"]["code"] == "request_too_large"
        conn.close()
        # under the limit still works
        r = sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
        assert r.choices


def test_no_worker_on_the_queue_is_503_at_once(redis_urls, tmp_path):
    settings = api_settings(redis_urls, tmp_path, queue="batchery-test-nobody-consumes-this")
    with running_api(settings) as base_url:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as exc:
            openai_client(base_url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
        assert time.monotonic() - t0 < 10
        assert exc.value.status_code == 503
        assert "no worker has been seen on queue 'batchery-test-nobody-consumes-this'" in exc.value.message
        assert exc.value.code == "no_worker"


def test_a_wait_past_the_request_timeout_is_504(tiny_worker, redis_urls, tmp_path):
    settings = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue, request_timeout=0.01)
    with running_api(settings) as base_url:
        with pytest.raises(openai.InternalServerError) as exc:
            openai_client(base_url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=64)
        assert exc.value.status_code == 504
        assert exc.value.code == "timeout" and "0.01" in exc.value.message
        assert exc.value.response.headers.get("x-should-retry") == "false"


def _answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_a_broker_outage_is_503_at_once_and_the_server_recovers(tmp_path):
    """Redis gone: 503 broker_unavailable at once (not a 500, not a wait); Redis back: requests go through
    again on the same server."""
    import redis

    from batchery.broker import presence

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]

    def start_redis() -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _answers(url), 15, what="the private redis-server")
        # a worker as presence sees one; nothing consumes, so a request runs into the request timeout
        presence.announce(redis.Redis.from_url(url), "batchery-test-outage", "fake@test", {"model": "fake"}, 600)
        return proc

    proc = start_redis()
    settings = api_settings((url, url), tmp_path, queue="batchery-test-outage", request_timeout=1)
    try:
        with running_api(settings, drop_keys=False) as base_url:
            sdk = openai_client(base_url)

            def status() -> tuple[int, str | None]:
                try:
                    sdk.chat.completions.create(model="fake", messages=HELLO, max_tokens=2)
                except openai.APIStatusError as exc:
                    return exc.status_code, exc.code
                return 200, None

            assert status() == (504, "timeout")  # sent and waited for: the send path works
            proc.kill()
            proc.wait(10)
            # the first request may still be sent (presence is cached for 2 s) and wait on Celery's reconnects
            wait_for(lambda: status() == (503, "broker_unavailable"), 60, interval=0.2, what="a 503")
            t0 = time.monotonic()
            assert status() == (503, "broker_unavailable")
            with pytest.raises(openai.InternalServerError) as exc:
                sdk.models.list()
            assert exc.value.status_code == 503 and exc.value.code == "broker_unavailable"
            assert time.monotonic() - t0 < 3  # at once, from then on
            proc = start_redis()
            wait_for(lambda: status() == (504, "timeout"), 60, interval=0.5, what="the server to send again")
    finally:
        proc.kill()
        proc.wait(10)


# -- batchery serve, the command ------------------------------------------------------------------------
def serve_cmd(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchery", "serve", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serve_without_keys_refuses_a_public_host(redis_urls, tmp_path):
    env = serve_env(api_settings(redis_urls, tmp_path))
    for args, extra in ((["--host", "0.0.0.0"], {}), ([], {"BATCHERY_API__HOST": "0.0.0.0"}), (["--host", "::"], {})):
        r = serve_cmd(*args, "--port", "0", env={**env, **extra})
        assert r.returncode == 2, r.stdout + r.stderr
        assert "set BATCHERY_API__KEYS to listen on" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_serve_without_the_serve_extra_names_the_install(redis_urls, tmp_path):
    env = serve_env(api_settings(redis_urls, tmp_path))
    code = (
        "import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None; "
        "from batchery.cli import main; sys.exit(main(['serve']))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'batchery[serve]'" in r.stderr


def test_serve_without_keys_is_local_and_says_so(tiny_worker, redis_urls, tmp_path):
    settings = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue)
    with ServeProcess(serve_env(settings), tmp_path / "serve.log").start() as proc:
        r = openai_client(proc.base_url, None).chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
        assert r.choices
        log = proc.log()
        assert "no API key" in log and "unauthenticated" in log and "127.0.0.1" in log
        assert proc.terminate() == 0
    drop_api_keys(settings.result_backend, settings.api.key_prefix)


def test_serve_answers_the_sdk_and_never_logs_a_key(tiny_worker, redis_urls, tmp_path):
    settings = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue, keys=f"{KEY_A}, {KEY_B}")
    env = serve_env(settings, BATCHERY_LOG_LEVEL="DEBUG")
    with ServeProcess(env, tmp_path / "serve.log", host="0.0.0.0").start() as proc:
        sdk = openai_client(proc.base_url, KEY_A)
        assert sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).choices
        assert sdk.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
        assert tiny_worker.env["BATCHERY_MODEL"] in [m.id for m in sdk.models.list().data]
        with pytest.raises(openai.AuthenticationError):
            openai_client(proc.base_url, KEY_B + "-wrong").models.list()
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=-5)
        assert proc.terminate() == 0
        log = proc.log()
    assert "2 API keys" in log, log
    for secret in (KEY_A, KEY_B, KEY_A[8:], KEY_B[8:], "aaaaaaaa", "bbbbbbbb"):
        assert secret not in log, f"a key leaked into the log:\n{log}"
    drop_api_keys(settings.result_backend, settings.api.key_prefix)


def _batches_served() -> bool:
    from batchery.api import batches

    return any(getattr(r, "path", "") == "/batches" for r in batches.router.routes)


def test_restarting_the_api_mid_job_loses_nothing(tiny_worker, redis_urls, tmp_path):
    if not _batches_served():
        pytest.skip("POST /v1/batches is not served yet (batchery/api/batches.py)")
    settings = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue, keys=KEY_A)
    n = 24
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"hello {i} write"}], "max_tokens": 48, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
            f.write("\n")
    proc = ServeProcess(serve_env(settings), tmp_path / "serve.log")
    try:
        proc.start()
        sdk = openai_client(proc.base_url, KEY_A)
        with open(src, "rb") as f:
            up = sdk.files.create(file=f, purpose="batch")
        batch = sdk.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
        proc.kill()  # mid-job: SIGKILL, no shutdown at all
        proc.start()  # the same port
        sdk = openai_client(proc.base_url, KEY_A)
        b = sdk.batches.retrieve(batch.id)
        assert b.id == batch.id and b.status not in ("failed", "expired", "cancelled"), b
        done = wait_for(
            lambda: (
                (x := sdk.batches.retrieve(batch.id)).status in ("completed", "failed", "expired", "cancelled") and x
            ),
            240,
            interval=0.5,
            what="the batch to end",
        )
        assert done.status == "completed", f"{done.status}: {done.errors}\n{proc.log()[-3000:]}"
        assert done.request_counts.total == n and done.request_counts.completed == n
        lines = sdk.files.content(done.output_file_id).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(n))
    finally:
        proc.kill()
        drop_api_keys(settings.result_backend, settings.api.key_prefix)


# -- the embedded default -----------------------------------------------------------------------------------
def test_serve_without_a_broker_runs_the_embedded_stack_and_tears_it_down(tiny_model_dir, tmp_path):
    from test_run import Tree, leftovers, run_env

    env, tag = run_env(
        BATCHERY_MODEL=tiny_model_dir,
        BATCHERY_DTYPE="float32",
        BATCHERY_MAX_NUM_SEQS=8,
        BATCHERY_ENGINE__NUM_KV_BLOCKS=256,
        BATCHERY_ENGINE__MAX_MODEL_LEN=2048,
        BATCHERY_API__KEYS=KEY_A,
        PYTHONUNBUFFERED=1,
    )
    assert "BATCHERY_BROKER_URL" not in env
    proc = ServeProcess(env, tmp_path / "serve.log")
    proc.start(timeout=60)
    tree = Tree(proc.proc.pid)
    try:
        sdk = openai_client(proc.base_url, KEY_A)
        wait_for(
            lambda: tree.sample() and str(tiny_model_dir) in [m.id for m in sdk.models.list().data],
            120,
            interval=0.5,
            what="the embedded worker to serve",
        )
        r = sdk.chat.completions.create(model=str(tiny_model_dir), messages=HELLO, max_tokens=4, temperature=0)
        assert r.choices and r.model == str(tiny_model_dir)
        tree.sample()
        assert len(tree.seen) >= 2  # redis-server and the worker
        log = proc.log()
        assert "embedded Redis and a worker" in log and KEY_A not in log
        proc.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: tree.sample() is not None and proc.proc.poll() is not None, 60, what="serve to exit")
        assert proc.proc.returncode == 0, proc.log()
        assert leftovers(tag, tree) == [], proc.log()
    finally:
        proc.kill()
        for pid in tree.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_serve_without_a_broker_and_without_the_worker_install_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
    env["PYTHONPATH"] = str(REPO)
    code = "import sys; sys.modules['torch'] = None; from batchery.cli import main; sys.exit(main(['serve']))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "BATCHERY_BROKER_URL" in r.stderr and "batchery[worker]" in r.stderr
