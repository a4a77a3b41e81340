"""OpenAI's Files API in ``batchery serve`` (issue 15), through the official ``openai`` SDK against the real
ASGI app (``fastapi.testclient.TestClient`` as the SDK's HTTP client: no socket), the real Redis (the test
result backend, under a private key prefix) and a real storage directory under ``tmp_path``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from batchery.api.app import create_app
from batchery.api.errors import APIError
from batchery.api.files import Files, files_of
from batchery.contract.settings import ApiOptions, BatchOptions, Settings
from batchery.jobs.storage import LocalStorage, ObjectTooLarge
from tests.conftest import redis_client

KEY_A = "sk-files-test-a-" + "1" * 16
KEY_B = "sk-files-test-b-" + "2" * 16


def line(i: int, text: str = "hello") -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"{text} {i}"}], "max_tokens": 4}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()


@dataclass
class Api:
    app: FastAPI
    http: TestClient
    storage_dir: Path
    prefix: str
    redis: object

    def sdk(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=self.http, max_retries=0)

    @property
    def files(self) -> Files:
        return files_of(self.app.state.batchery)

    def redis_keys(self) -> list[bytes]:
        return sorted(self.redis.scan_iter(f"{self.prefix}:*"))  # type: ignore[attr-defined]

    def stored(self) -> list[str]:
        """Every entry in the storage directory, temporaries (dot files) included."""
        return sorted(p.name for p in self.storage_dir.iterdir()) if self.storage_dir.exists() else []


@pytest.fixture
def make_api(redis_urls, tmp_path):
    prefix = f"test-files-{uuid.uuid4().hex[:12]}"
    r = redis_client(redis_urls[1])
    clients: list[TestClient] = []

    def make(keys: str | None = f"{KEY_A},{KEY_B}", max_line_bytes: int = 1 << 20, **api) -> Api:
        storage_dir = tmp_path / "files"
        settings = Settings(
            broker_url=redis_urls[0],
            result_backend=redis_urls[1],
            api=ApiOptions(keys=keys, storage_dir=str(storage_dir), key_prefix=prefix, **api),
            batch=BatchOptions(max_line_bytes=max_line_bytes),
        )
        http = TestClient(create_app(settings))
        clients.append(http)
        return Api(http.app, http, storage_dir, prefix, r)  # type: ignore[arg-type]

    yield make
    for c in clients:
        c.close()
    for k in r.scan_iter(f"{prefix}:*"):
        r.delete(k)


@pytest.fixture
def api(make_api) -> Api:
    return make_api()


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_upload_retrieve_content_round_trip(api, tmp_path):
    data = b"\n".join(line(i, "h\u00e9llo \u2603") for i in range(5)) + b"\n\n" + line(5) + b"\r\n"
    p = write(tmp_path, "requests.jsonl", data)
    client = api.sdk()
    with p.open("rb") as f:
        created = client.files.create(file=f, purpose="batch")
    assert created.id.startswith("file-") and created.object == "file"
    assert created.bytes == len(data) and created.filename == "requests.jsonl"
    assert created.purpose == "batch" and created.status == "processed"
    assert created.expires_at is None and created.status_details is None
    assert isinstance(created.created_at, int) and abs(created.created_at - __import__("time").time()) < 60

    got = client.files.retrieve(created.id)
    assert got == created
    assert client.files.content(created.id).content == data  # byte for byte
    assert api.storage_dir.joinpath(created.id).read_bytes() == data
    assert api.stored() == [created.id]  # no temporary left beside it

    raw = api.http.get(f"/v1/files/{created.id}/content", headers={"Authorization": f"Bearer {KEY_A}"})
    assert raw.status_code == 200 and raw.content == data
    assert raw.headers["content-length"] == str(len(data))


def test_list_paginates_with_after_limit_and_order(api, tmp_path):
    client = api.sdk()
    ids = []
    for i in range(5):
        p = write(tmp_path, f"f{i}.jsonl", line(i) + b"\n")
        with p.open("rb") as f:
            ids.append(client.files.create(file=f, purpose="batch").id)

    page = client.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == ids[:2] and page.has_more is True
    page2 = client.files.list(limit=2, order="asc", after=page.data[-1].id)
    assert [f.id for f in page2.data] == ids[2:4] and page2.has_more is True
    page3 = client.files.list(limit=2, order="asc", after=ids[3])
    assert [f.id for f in page3.data] == ids[4:] and page3.has_more is False

    # the SDK's auto-pagination follows has_more and the last id; desc is the default order
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]
    assert [f.id for f in client.files.list(limit=2, order="desc", after=ids[3])] == [ids[2], ids[1], ids[0]]
    assert [f.id for f in client.files.list().data] == ids[::-1]  # default limit 10000: all of them

    body = api.http.get("/v1/files?limit=2&order=asc", headers={"Authorization": f"Bearer {KEY_A}"}).json()
    assert body["object"] == "list" and body["first_id"] == ids[0] and body["last_id"] == ids[1]
    assert body["has_more"] is True

    # a cursor that was deleted still marks its place (ids sort by creation time)
    client.files.delete(ids[1])
    assert [f.id for f in client.files.list(order="asc", after=ids[1]).data] == ids[2:]

    for bad in ({"limit": 0}, {"limit": 10001}, {"order": "sideways"}):
        with pytest.raises(openai.BadRequestError):
            client.files.list(**bad)


def test_list_filters_by_purpose_and_output_files_come_from_chunks(api, tmp_path):
    client = api.sdk()
    p = write(tmp_path, "in.jsonl", line(0) + b"\n")
    with p.open("rb") as f:
        upload = client.files.create(file=f, purpose="batch")
    tenant = api.app.state.batchery.keys.tenant(f"Bearer {KEY_A}").id
    out = api.files.create_from_chunks(
        tenant, "batch_x_output.jsonl", "batch_output", iter([b'{"a": 1}\n', b'{"b": 2}\n'])
    )
    assert out["purpose"] == "batch_output" and out["bytes"] == 18 and out["object"] == "file"

    assert [f.id for f in client.files.list(purpose="batch_output")] == [out["id"]]
    assert [f.id for f in client.files.list(purpose="batch")] == [upload.id]
    assert [f.id for f in client.files.list(purpose="fine-tune")] == []
    assert client.files.content(out["id"]).content == b'{"a": 1}\n{"b": 2}\n'
    assert client.files.retrieve(out["id"]).purpose == "batch_output"

    # the interface the batches code uses
    assert api.files.get(tenant, upload.id)["bytes"] == len(line(0)) + 1
    with api.files.open(tenant, upload.id) as f:
        assert f.read() == line(0) + b"\n"
    assert api.files.local_path(tenant, upload.id) == api.storage_dir.resolve() / upload.id
    with pytest.raises(ValueError, match="purpose"):
        api.files.create_from_chunks(tenant, "x.jsonl", "fine-tune", iter([b"x"]))


def test_delete_then_retrieve_is_not_found(api, tmp_path):
    client = api.sdk()
    p = write(tmp_path, "d.jsonl", line(0) + b"\n")
    with p.open("rb") as f:
        fid = client.files.create(file=f, purpose="batch").id
    deleted = client.files.delete(fid)
    assert deleted.id == fid and deleted.deleted is True and deleted.object == "file"
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError) as e:
            call(fid)
        assert fid in e.value.message
    assert api.stored() == [] and api.redis_keys() == []
    assert client.files.list().data == []


def test_wrong_or_missing_key_is_authentication_error(api, tmp_path):
    with pytest.raises(openai.AuthenticationError):
        api.sdk("sk-wrong").files.list()
    p = write(tmp_path, "a.jsonl", line(0) + b"\n")
    with p.open("rb") as f, pytest.raises(openai.AuthenticationError):
        api.sdk("sk-wrong").files.create(file=f, purpose="batch")
    assert api.stored() == [] and api.redis_keys() == []
    assert api.http.get("/v1/files").status_code == 401


def test_another_keys_file_is_not_found_like_a_missing_one(api, tmp_path):
    a, b = api.sdk(KEY_A), api.sdk(KEY_B)
    p = write(tmp_path, "a.jsonl", line(0) + b"\n")
    with p.open("rb") as f:
        fid = a.files.create(file=f, purpose="batch").id
    missing = "file-" + "0" * 28
    for call in (b.files.retrieve, b.files.content, b.files.delete):
        with pytest.raises(openai.NotFoundError) as theirs:
            call(fid)
        with pytest.raises(openai.NotFoundError) as nobodys:
            call(missing)
        assert theirs.value.body == json.loads(json.dumps(nobodys.value.body).replace(missing, fid))
    assert b.files.list().data == [] and [f.id for f in a.files.list()] == [fid]
    assert a.files.retrieve(fid).id == fid  # B's delete did nothing
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve("../../etc/passwd")


def test_over_the_size_limit_is_refused_and_nothing_is_left(make_api, tmp_path):
    api = make_api(max_file_bytes=1000)
    client = api.sdk()
    ok = write(tmp_path, "ok.jsonl", line(0) + b"\n")
    with ok.open("rb") as f:
        kept = client.files.create(file=f, purpose="batch").id
    big = write(tmp_path, "big.jsonl", b"\n".join(line(i) for i in range(40)) + b"\n")
    assert big.stat().st_size > 1000
    with big.open("rb") as f, pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=f, purpose="batch")
    assert e.value.status_code == 413
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"}
    assert "1000 bytes" in err["message"] and err["param"] == "file" and err["type"] == "invalid_request_error"
    assert api.stored() == [kept]  # no temporary left either
    assert [f.id for f in client.files.list()] == [kept]
    assert len([k for k in api.redis_keys() if b":file:" in k]) == 1

    # refused from its Content-Length alone (far over the limit): the same answer
    huge = write(tmp_path, "huge.jsonl", b"{}\n" * 50_000)
    with huge.open("rb") as f, pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=f, purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    assert api.stored() == [kept]

    # exactly at the limit is fine
    exact = write(tmp_path, "exact.jsonl", b"{}" + b" " * 997 + b"\n")
    with exact.open("rb") as f:
        assert client.files.create(file=f, purpose="batch").bytes == 1000


def test_a_file_that_is_not_jsonl_is_refused_naming_the_line(api, tmp_path):
    client = api.sdk()
    cases = {
        b"{}\n\n[1, 2]\n{}\n": "line 3",  # JSON, but not an object
        line(0) + b"\n" + b'{"custom_id": "x", oops}\n': "line 2",
        b"col1,col2\n1,2\n": "line 1",  # a CSV
        b"{}\n" + b'{"a": "\xff"}\n': "line 2",  # not UTF-8
        b'{"a": NaN}\n': "line 1",
    }
    for data, where in cases.items():
        p = write(tmp_path, "bad.jsonl", data)
        with p.open("rb") as f, pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=f, purpose="batch")
        assert f"{where} is not a JSON object" in e.value.message, (data, e.value.message)
        assert e.value.body["param"] == "file"
    assert api.stored() == [] and api.redis_keys() == []

    # a large file refused at its second line: the answer comes while the rest of the body is still arriving
    p = write(tmp_path, "large.jsonl", b"{}\n[]\n" + b"{}\n" * (3 << 20))
    with p.open("rb") as f, pytest.raises(openai.BadRequestError, match="line 2 is not a JSON object: got an array"):
        client.files.create(file=f, purpose="batch")
    assert api.stored() == [] and api.redis_keys() == []


def test_empty_and_blank_files_are_refused(api, tmp_path):
    client = api.sdk()
    for data, what in ((b"", "empty"), (b"\n \n\r\n", "no request lines")):
        p = write(tmp_path, "e.jsonl", data)
        with p.open("rb") as f, pytest.raises(openai.BadRequestError, match=what):
            client.files.create(file=f, purpose="batch")
    assert api.stored() == [] and api.redis_keys() == []


def test_an_oversized_line_is_left_to_the_batch(make_api, tmp_path):
    """Per-line validation belongs to the batch (its error file names the line); the upload only checks that
    the lines it can hold are JSON objects, so a line over BATCHERY_BATCH__MAX_LINE_BYTES passes unparsed."""
    api = make_api(max_line_bytes=1024)
    data = line(0) + b"\n" + b'{"x": "' + b"y" * 5000 + b"\n" + line(1) + b"\n"
    p = write(tmp_path, "long.jsonl", data)
    with p.open("rb") as f:
        fid = api.sdk().files.create(file=f, purpose="batch").id
    assert api.sdk().files.content(fid).content == data


def test_unknown_purpose_and_unsupported_fields_are_refused(api, tmp_path):
    client = api.sdk()
    p = write(tmp_path, "a.jsonl", line(0) + b"\n")
    for purpose in ("fine-tune", "batch_output", "nonsense"):
        with p.open("rb") as f, pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=f, purpose=purpose)  # type: ignore[arg-type]
        assert repr(purpose) in e.value.message and e.value.body["param"] == "purpose"
    with p.open("rb") as f, pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=f, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
    assert "expires_after" in e.value.message
    assert api.stored() == [] and api.redis_keys() == []


def test_multipart_shapes(api):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    data = line(0) + b"\n"
    # purpose after the file (the SDK sends it first; curl -F follows the command line)
    boundary = "b0und4ry"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="dir/x.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'.encode()
        + f"batch\r\n--{boundary}--\r\n".encode()
    )
    r = api.http.post(
        "/v1/files", content=body, headers={**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["filename"] == "x.jsonl" and r.json()["bytes"] == len(data)

    def refused(status: int, param: str | None, headers: dict | None = None, **kw) -> str:
        r = api.http.post("/v1/files", headers={**auth, **(headers or {})}, **kw)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param, err
        return err["message"]

    assert "purpose" in refused(400, "purpose", files={"file": ("x.jsonl", data)})
    assert "file" in refused(400, "file", files={"purpose": (None, "batch")})  # multipart without a file
    assert "multipart/form-data" in refused(400, None, data={"purpose": "batch"})  # urlencoded
    assert "multipart/form-data" in refused(400, None, json={"purpose": "batch"})
    two = [("file", ("a.jsonl", data)), ("file", ("b.jsonl", data))]
    assert "one file" in refused(400, "file", files=two, data={"purpose": "batch"})
    assert "'colour'" in refused(
        400, "colour", files={"file": ("x.jsonl", data)}, data={"purpose": "batch", "colour": "red"}
    )
    assert refused(400, None, content=b"--nope\r\ngarbage", headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert len(api.stored()) == 1


def test_a_client_that_hangs_up_mid_upload_leaves_nothing(api, caplog):
    """Driven through the ASGI interface: the body stops half way through the file and the server is told the
    client went away (what uvicorn says when the connection drops)."""
    boundary = "cutcutcut"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
    ).encode()
    messages = [
        {"type": "http.request", "body": head, "more_body": True},
        *({"type": "http.request", "body": line(i) + b"\n", "more_body": True} for i in range(20_000)),
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/files",
        "raw_path": b"/v1/files",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", f"Bearer {KEY_A}".encode()),
            (b"content-type", f"multipart/form-data; boundary={boundary}".encode()),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    caplog.set_level(logging.INFO, "batchery.api.files")
    asyncio.run(api.app(scope, receive, send))
    assert sent[0]["status"] == 400
    cut = re.search(r"cut off by the client after (\d+) bytes", caplog.text)
    assert cut and int(cut.group(1)) > 2 << 20  # megabytes had gone into the storage writer ...
    assert api.stored() == [] and api.redis_keys() == []  # ... and nothing is left, not even a temporary


def test_keys_never_reach_the_logs(api, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    p = write(tmp_path, "a.jsonl", line(0) + b"\n")
    with p.open("rb") as f:
        fid = api.sdk(KEY_A).files.create(file=f, purpose="batch").id
    with pytest.raises(openai.NotFoundError):
        api.sdk(KEY_B).files.retrieve(fid)
    with pytest.raises(openai.AuthenticationError):
        api.sdk("sk-wrong-key-123").files.list()
    api.sdk(KEY_A).files.delete(fid)
    text = caplog.text
    for secret in (KEY_A, KEY_B, "sk-wrong-key-123"):
        assert secret not in text


def test_no_keys_is_the_local_tenant(make_api, tmp_path):
    api = make_api(keys=None)
    p = write(tmp_path, "a.jsonl", line(0) + b"\n")
    with p.open("rb") as f:
        fid = api.sdk("anything").files.create(file=f, purpose="batch").id
    assert [f.id for f in api.sdk("whatever").files.list()] == [fid]
    assert api.files.get("local", fid)["id"] == fid
    with pytest.raises(APIError) as e:
        api.files.get("key_0000000000000000", fid)
    assert e.value.status_code == 404


# -- storage ------------------------------------------------------------------------------------------
def test_local_storage_never_leaves_a_half_object(tmp_path):
    s = LocalStorage(tmp_path / "s")
    assert s.write_stream("a", iter([b"12", b"34"]), limit=4) == 4
    assert s.open("a").read() == b"1234" and s.size("a") == 4

    with pytest.raises(ObjectTooLarge):
        s.write_stream("b", iter([b"12", b"345"]), limit=4)

    def broken():
        yield b"partial"
        raise OSError("the client hung up")

    with pytest.raises(OSError, match="hung up"):
        s.write_stream("c", broken())
    w = s.writer("d")
    w.write(b"not committed")
    assert not (s.root / "d").exists()  # invisible until commit
    w.abort()
    assert sorted(os.listdir(s.root)) == ["a"]

    assert s.delete("a") is True and s.delete("a") is False
    with pytest.raises(FileNotFoundError):
        s.open("a")
    for bad in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(ValueError):
            s.writer(bad)


def test_local_storage_sweeps_old_temporaries_only(tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    old, young = root / ".file-1.abc.part", root / ".file-2.def.part"
    old.write_bytes(b"x")
    young.write_bytes(b"y")
    os.utime(old, (1, 1))
    LocalStorage(root)
    assert not old.exists() and young.exists()
