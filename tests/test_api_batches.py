"""OpenAI's Batches API in ``batchery serve`` (issue 15), through the official ``openai`` SDK against the real ASGI
app (``fastapi.testclient.TestClient`` as the SDK's HTTP client: no socket), the real Redis and the tiny-model
session worker (``tiny_worker``): upload, create, poll ``retrieve`` to the end, download the output and error files
and compare them with the job store's records and with ``batchery``'s own client on the same file; ``list``
paginates; ``cancel`` mid-job ends ``cancelled`` with partial output; a tiny ``completion_window`` ends ``expired``
with partial output and ``batch_expired`` error lines; bad requests are OpenAI-shaped errors that create nothing;
another key's batches are 404s; two API replicas write one set of output files."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from api_util import api_settings, drop_api_keys  # noqa: E402
from conftest import TEST_BROKER_URL, TEST_RESULT_BACKEND, drop_queue_keys, redis_client, wait_for  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from batchery.api.app import create_app  # noqa: E402
from batchery.api.batches import batches_of  # noqa: E402
from batchery.contract.batch import BATCH_EXPIRED, INVALID_BODY, UNSUPPORTED_URL  # noqa: E402
from batchery.contract.settings import BatchOptions  # noqa: E402

pytestmark = pytest.mark.integration  # the tiny worker

KEY_A = "sk-batches-test-a-" + "1" * 12
KEY_B = "sk-batches-test-b-" + "2" * 12
ENDED = ("completed", "failed", "expired", "cancelled")
CHAT = "/v1/chat/completions"


def chat_line(cid: str, text: str = "hello", max_tokens: int = 4, **body) -> dict:
    b = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **body}
    return {"custom_id": cid, "method": "POST", "url": CHAT, "body": b}


def completion_line(cid: str) -> dict:
    """A valid line for another endpoint than the batches' here."""
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}}


class Api:
    """One app (an API replica) and the SDK for each key on it."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.http = TestClient(create_app(settings), base_url="http://testserver")
        self.a = self.sdk(KEY_A)
        self.b = self.sdk(KEY_B)

    def sdk(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=self.http, max_retries=0)

    @property
    def service(self):
        return batches_of(self.http.app.state.batchery)  # type: ignore[attr-defined]

    def close(self) -> None:
        if "batches" in self.http.app.state.batchery.extras:  # type: ignore[attr-defined]
            self.service.join(30)
        self.http.close()


@pytest.fixture()
def settings(tiny_worker, redis_urls, tmp_path):
    s = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue, keys=f"{KEY_A},{KEY_B}")
    yield s
    drop_api_keys(s.result_backend, s.api.key_prefix)


@pytest.fixture()
def make_api(settings):
    apis: list[Api] = []

    def make(s=None) -> Api:
        api = Api(s or settings)
        apis.append(api)
        return api

    yield make
    for api in apis:
        api.close()


@pytest.fixture()
def api(make_api) -> Api:
    return make_api()


def upload(sdk: openai.OpenAI, tmp_path: Path, lines: list[dict], name: str = "in.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with open(path, "rb") as f:
        return sdk.files.create(file=f, purpose="batch").id


def wait_end(sdk: openai.OpenAI, batch_id: str, timeout: float = 180):
    return wait_for(
        lambda: (b := sdk.batches.retrieve(batch_id)).status in ENDED and b,
        timeout,
        interval=0.2,
        what=f"batch {batch_id} to end",
    )


def jsonl(sdk: openai.OpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(x) for x in sdk.files.content(file_id).text.splitlines()]


def jobs_since(t0: float, input_file_id: str) -> list[str]:
    """Jobs created in the job store since ``t0`` (server time) on this input file: none may be left by a refusal."""
    r = redis_client(TEST_RESULT_BACKEND)
    prefix = BatchOptions().key_prefix
    ids = [i.decode() for i in r.zrangebyscore(f"{prefix}:index", t0, "+inf")]
    return [i for i in ids if (r.hget(f"{prefix}:{i}", "input_file") or b"").decode() == input_file_id]


def server_now() -> float:
    sec, usec = redis_client(TEST_RESULT_BACKEND).time()
    return sec + usec / 1e6


# -- the SDK flow ------------------------------------------------------------------------------------------
def test_upload_create_retrieve_download(api, tiny_client, tmp_path):
    lines = [chat_line(f"r{i}", f"hello {i}") for i in range(5)]
    lines.insert(2, chat_line("bad-body", messages="not a list"))  # refused while submitting: an error line
    lines.append(completion_line("other-url"))  # valid, but not the batch's endpoint
    file_id = upload(api.a, tmp_path, lines)
    created = api.a.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"project": "test"}
    )
    assert created.id.startswith("batch_") and created.object == "batch"
    assert created.status in ("validating", "in_progress", "finalizing")
    assert created.endpoint == CHAT and created.input_file_id == file_id and created.completion_window == "24h"
    assert created.metadata == {"project": "test"}
    assert created.expires_at == created.created_at + 86400

    done = wait_end(api.a, created.id)
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 7, "completed": 5, "failed": 2}
    assert done.errors is None
    assert created.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is done.expired_at is done.cancelled_at is None
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0

    records = list(api.service.store.iter_results(done.id))  # what the job store holds, in input order
    output, errors = jsonl(api.a, done.output_file_id), jsonl(api.a, done.error_file_id)
    assert output == [r for r in records if r["error"] is None]
    assert errors == [r for r in records if r["error"] is not None]
    assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(5)]  # input order
    assert all(r["response"]["status_code"] == 200 for r in output)
    assert output[0]["response"]["body"]["object"] == "chat.completion"
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        ("bad-body", INVALID_BODY, 3),
        ("other-url", UNSUPPORTED_URL, 7),
    ]
    for f in (done.output_file_id, done.error_file_id):
        meta = api.a.files.retrieve(f)
        assert meta.purpose == "batch_output" and meta.filename.startswith(done.id)

    # the same lines through batchery's own client (as `batchery run` submits them): the same answers
    src = tmp_path / "same.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines if x["url"] == CHAT))
    job = tiny_client.wait_batch(tiny_client.submit_batch(src), timeout=120)
    assert job.status == "completed"
    theirs = {r["custom_id"]: r for r in tiny_client.batch_results(job) if r["error"] is None}
    for r in output:
        mine, other = r["response"]["body"], theirs[r["custom_id"]]["response"]["body"]
        assert mine["choices"] == other["choices"] and mine["usage"] == other["usage"]

    # a retrieve after the end changes nothing; the output file cannot be a batch's input
    assert api.a.batches.retrieve(done.id).output_file_id == done.output_file_id
    with pytest.raises(openai.BadRequestError) as e:
        api.a.batches.create(input_file_id=done.output_file_id, endpoint=CHAT, completion_window="24h")
    assert e.value.body["param"] == "input_file_id" and "purpose" in e.value.body["message"]


def test_list_paginates_newest_first_and_only_the_callers(api, tmp_path):
    file_id = upload(api.a, tmp_path, [chat_line("r0")])
    ids = [api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id for _ in range(5)]
    page = api.a.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    raw = api.http.get(
        "/v1/batches", params={"limit": 2, "after": ids[3]}, headers={"Authorization": f"Bearer {KEY_A}"}
    )
    body = raw.json()
    assert [b["id"] for b in body["data"]] == [ids[2], ids[1]] and body["has_more"] is True
    assert body["first_id"] == ids[2] and body["last_id"] == ids[1] and body["object"] == "list"
    assert [b.id for b in api.a.batches.list(limit=2)] == ids[::-1]  # the SDK's auto-pagination follows after
    assert [b.id for b in api.a.batches.list()] == ids[::-1]  # the default limit (20) in one page
    assert list(api.b.batches.list()) == []  # another key sees none of them
    for bad in (0, 101):
        with pytest.raises(openai.BadRequestError):
            api.a.batches.list(limit=bad)
    with pytest.raises(openai.NotFoundError):
        api.a.batches.list(after="batch_" + "0" * 32)
    for i in ids:
        wait_end(api.a, i)


def test_another_keys_batch_is_not_found(api, tmp_path):
    file_id = upload(api.a, tmp_path, [chat_line("r0")])
    batch = api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    for call in (api.b.batches.retrieve, api.b.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch.id)
    with pytest.raises(openai.NotFoundError):
        api.a.batches.retrieve("batch_" + "0" * 32)
    with pytest.raises(openai.AuthenticationError):
        api.sdk("sk-wrong").batches.retrieve(batch.id)
    assert wait_end(api.a, batch.id).status == "completed"  # B's cancel did not touch it


# -- cancel and expiry ----------------------------------------------------------------------------------------
def test_cancel_mid_job_ends_cancelled_with_partial_output(api, tmp_path):
    short = [chat_line(f"s{i}", max_tokens=2) for i in range(3)]
    long = [chat_line(f"l{i}", max_tokens=4000, ignore_eos=True) for i in range(30)]
    file_id = upload(api.a, tmp_path, short + long)
    batch = api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    wait_for(
        lambda: api.a.batches.retrieve(batch.id).request_counts.completed >= 3, 120, what="the short lines to finish"
    )
    cancelling = api.a.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = wait_end(api.a, batch.id, 120)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    assert done.request_counts.total == 33 and done.request_counts.completed < 33
    output = jsonl(api.a, done.output_file_id)
    assert [r["custom_id"] for r in output][:3] == ["s0", "s1", "s2"]  # the partial output, in input order
    assert len(output) == done.request_counts.completed
    assert (done.error_file_id is None) == (done.request_counts.failed == 0)
    assert api.a.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes


def test_a_tiny_completion_window_expires_with_partial_output(api, tmp_path):
    """More lines than the worker runs at once (its task threads: max_num_seqs + 25%), each long enough that the
    first ones still run when a 1 s window ends: the rest never start."""
    n = 200
    # 1,000 tokens a line: the first lines still run at 1 s however they travel (chunks run ~3x faster)
    lines = [chat_line(f"r{i}", f"hello {i}", max_tokens=1000, ignore_eos=True) for i in range(n)]
    file_id = upload(api.a, tmp_path, lines)
    batch = api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="1s")
    assert batch.completion_window == "1s" and batch.expires_at == batch.created_at + 1
    wait_for(lambda: server_now() > batch.created_at + 2, 10, what="the window to end")
    seen = api.a.batches.retrieve(batch.id)  # sees the window passed: expires every pending line
    assert seen.status in ("in_progress", "finalizing", "expired"), seen
    assert seen.request_counts.failed > 0
    done = wait_end(api.a, batch.id, 240)
    assert done.status == "expired", done
    assert done.expired_at is not None and done.completed_at is None
    rc = done.request_counts
    assert rc.total == n and rc.completed > 0 and rc.failed > 0 and rc.completed + rc.failed == n
    output, errors = jsonl(api.a, done.output_file_id), jsonl(api.a, done.error_file_id)
    assert len(output) == rc.completed and len(errors) == rc.failed
    assert all(r["response"]["status_code"] == 200 for r in output)
    assert {e["error"]["code"] for e in errors} == {BATCH_EXPIRED}
    assert all(e["response"] is None for e in errors)
    ids = [r["custom_id"] for r in output] + [e["custom_id"] for e in errors]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # every line once, each in one file
    assert [e["error"]["line"] for e in errors] == sorted(int(e["custom_id"][1:]) + 1 for e in errors)


def test_retrieve_expires_the_lines_no_worker_started(make_api, settings, tmp_path):
    """On a queue no worker serves, nothing claims the lines: the retrieve that sees the window passed records
    every one ``batch_expired`` (``JobStore.expire``), and the batch ends with an error file and no output."""
    queue = f"{settings.queue}-nobody"
    api = make_api(settings.model_copy(update={"queue": queue}))
    try:
        _expire_unserved(api, tmp_path)
    finally:
        drop_queue_keys(redis_client(TEST_BROKER_URL), queue)


def _expire_unserved(api: Api, tmp_path: Path) -> None:
    n = 30
    file_id = upload(api.a, tmp_path, [chat_line(f"r{i}") for i in range(n)])
    batch = api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="1s")
    wait_for(lambda: api.a.batches.retrieve(batch.id).status == "in_progress", 10, what="the submission")
    assert api.a.batches.retrieve(batch.id).request_counts.failed == 0  # inside the window: they wait
    wait_for(lambda: server_now() > batch.created_at + 2, 10, what="the window to end")
    seen = api.a.batches.retrieve(batch.id)
    assert seen.status in ("finalizing", "expired") and seen.request_counts.failed == n, seen
    done = wait_end(api.a, batch.id, 30)
    assert done.status == "expired" and done.request_counts.model_dump() == {"total": n, "completed": 0, "failed": n}
    assert done.output_file_id is None
    errors = jsonl(api.a, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        (f"r{i}", BATCH_EXPIRED, i + 1) for i in range(n)
    ]


# -- whole-file failures ---------------------------------------------------------------------------------------
def test_a_file_with_no_valid_line_fails_with_errors(api, tmp_path):
    file_id = upload(api.a, tmp_path, [chat_line("a", messages=5), completion_line("b")])
    batch = api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    done = wait_end(api.a, batch.id, 30)
    assert done.status == "failed" and done.failed_at is not None
    assert done.output_file_id is None and done.error_file_id is None
    assert done.errors.object == "list"
    codes = [(e.code, e.line) for e in done.errors.data]
    assert codes == [("no_valid_lines", None), (INVALID_BODY, 1), (UNSUPPORTED_URL, 2)]


def test_more_lines_than_the_limit_fails(make_api, settings, tmp_path):
    api = make_api(settings.model_copy(update={"batch": BatchOptions(max_lines=3)}))
    file_id = upload(api.a, tmp_path, [chat_line(f"r{i}") for i in range(5)])
    batch = api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    done = wait_end(api.a, batch.id, 30)
    assert done.status == "failed" and [e.code for e in done.errors.data] == ["too_many_lines"]
    assert "more than 3" in done.errors.data[0].message


# -- refusals: OpenAI-shaped, nothing created ----------------------------------------------------------------
def test_bad_requests_are_refused_and_create_nothing(api, tmp_path):
    file_id = upload(api.a, tmp_path, [chat_line("r0")])
    b_file = upload(api.b, tmp_path, [chat_line("r0")], "b.jsonl")
    gone = upload(api.a, tmp_path, [chat_line("r0")], "gone.jsonl")
    api.a.files.delete(gone)
    t0 = server_now()
    cases = [
        (openai.BadRequestError, dict(endpoint="/v1/nope"), "endpoint", "/v1/chat/completions"),
        (openai.BadRequestError, dict(endpoint="/v1/moderations"), "endpoint", "moderations are not served"),
        (openai.BadRequestError, dict(completion_window="2d"), "completion_window", "24h"),
        (openai.BadRequestError, dict(completion_window="169h"), "completion_window", "7 days"),
        (openai.BadRequestError, dict(metadata={f"k{i}": "v" for i in range(17)}), "metadata", "16"),
        (openai.NotFoundError, dict(input_file_id=gone), "input_file_id", gone),
        (openai.NotFoundError, dict(input_file_id=b_file), "input_file_id", b_file),
        (openai.NotFoundError, dict(input_file_id="file-" + "0" * 28), "input_file_id", "file-"),
    ]
    for exc, override, param, needle in cases:
        args = {**dict(input_file_id=file_id, endpoint=CHAT, completion_window="24h"), **override}
        with pytest.raises(exc) as e:
            api.a.batches.create(**args)
        err = e.value.body
        assert err["param"] == param and needle in err["message"], (override, err)
        assert e.value.response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):  # unknown field
        api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", extra_body={"x": 1})
    assert list(api.a.batches.list()) == []
    r = redis_client(TEST_RESULT_BACKEND)
    assert not list(r.scan_iter(f"{api.settings.api.key_prefix}:batch*"))
    for f in (file_id, gone, b_file):
        assert jobs_since(t0, f) == []


# -- a submitter that dies mid-file ------------------------------------------------------------------------
class StallingReader:
    """The stored input file, read by a submitter that stops for good after ``lines`` lines (its API process
    died mid-file, as far as anyone else can tell) until ``go`` is set: then it reads on, as a process that had
    only stalled would."""

    def __init__(self, path: Path, lines: int, go: threading.Event) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 - closed by the submitter's caller
        self.left = lines
        self.go = go

    def readline(self, limit: int = -1) -> bytes:
        if self.left == 0:
            self.go.wait(60)
        self.left -= 1
        return self.f.readline(limit)

    def read(self, n: int = -1) -> bytes:
        return self.f.read(n)

    def close(self) -> None:
        self.f.close()


def test_a_submitter_that_died_mid_file_is_taken_over(api, tmp_path):
    """The replica reading a batch's file stops after two of its chunks; once its heartbeat is stale, a retrieve
    takes the submission over and goes on from the last chunk recorded: every line runs once, the total is exact,
    and the old submitter, reading on later, is refused."""
    svc = api.service
    svc.chunk_size = 10
    svc.resume_after_s = 2.0
    n = 35
    lines = [chat_line(f"r{i}", f"hello {i}") for i in range(n)]
    lines[3] = chat_line("bad", messages=7)  # an error line in a recorded chunk: counted once
    file_id = upload(api.a, tmp_path, lines)
    go = threading.Event()
    real = svc._open_source
    calls = []

    def open_source(tenant_id: str, fid: str):
        calls.append(fid)
        if len(calls) == 1:  # the create's submitter stalls after 25 lines (two chunks recorded)
            return StallingReader(real(tenant_id, fid), 25, go)
        return real(tenant_id, fid)

    svc._open_source = open_source
    try:
        batch = api.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        store = svc.store
        wait_for(lambda: store.max_line(batch.id) == 20, 10, what="two chunks recorded")
        assert api.a.batches.retrieve(batch.id).status == "validating"  # the submitter is not stale yet
        done = wait_end(api.a, batch.id, 120)  # a retrieve after 2 s takes it over
        assert len(calls) == 2
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": n, "completed": n - 1, "failed": 1}
        output = jsonl(api.a, done.output_file_id)
        assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(n) if i != 3]
        assert [e["custom_id"] for e in jsonl(api.a, done.error_file_id)] == ["bad"]
    finally:
        go.set()  # the old submitter reads on: its next chunk is refused (superseded)
        svc.join(30)
    st = store.status(batch.id)
    assert st.request_counts.model_dump() == {"total": n, "completed": n - 1, "failed": 1}
    assert store.max_line(batch.id) == n


# -- two replicas ------------------------------------------------------------------------------------------
def test_two_replicas_write_one_set_of_output_files(make_api, tmp_path):
    one, two = make_api(), make_api()
    file_id = upload(one.a, tmp_path, [chat_line("r0"), chat_line("bad", messages=1), chat_line("r1")])
    batch = one.a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    store = one.service.store
    wait_for(lambda: store.status(batch.id).is_terminal, 60, what="the job to end")
    seen: list = []
    barrier = threading.Barrier(8)

    def poll(api: Api) -> None:
        barrier.wait()
        seen.append(wait_end(api.a, batch.id, 60))

    threads = [threading.Thread(target=poll, args=((one, two)[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(seen) == 8 and {b.status for b in seen} == {"completed"}
    assert len({(b.output_file_id, b.error_file_id) for b in seen}) == 1
    one.service.join(10)  # a second writer, had there been one, has published its files by now
    two.service.join(10)
    outputs = [f for f in one.a.files.list() if f.purpose == "batch_output"]
    assert sorted(f.id for f in outputs) == sorted([seen[0].output_file_id, seen[0].error_file_id])
