"""A batch job's lines are put in order of their prompt's start when submitted (``batchery.jobs.submit``): a
document-questions file, shuffled, reaches the queue grouped by document, window by window, with each line's own
number and custom_id, so results map back to their lines; a take-over of a submitter that died mid-file skips
exactly the lines it recorded. Real Redis (per-test key prefix and queue); one test runs the tiny model's
worker."""

from __future__ import annotations

import base64
import json
import os
import random
import threading
import uuid

import pytest
from conftest import TEST_BROKER_URL, TEST_RESULT_BACKEND, drop_queue_keys, redis_client, wait_for

from batchery.client import Client
from batchery.contract.settings import Settings
from batchery.jobs.submit import Submitter, make_submitter, prefix_key

CHAT = "/v1/chat/completions"


def doc_text(d: int, words: int = 40) -> str:
    return f"document {d}: " + " ".join(f"w{(d * 31 + i * 7) % 97}" for i in range(words))


def doc_line(cid: str, d: int, q: int, **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": CHAT,
        "body": {
            "messages": [
                {"role": "system", "content": doc_text(d)},
                {"role": "user", "content": f"question {q} about it?"},
            ],
            "max_tokens": 4,
            **body,
        },
    }


def docqa(num_docs: int, questions: int, seed: int = 0) -> list[dict]:
    lines = [doc_line(f"d{d}-q{q}", d, q) for d in range(num_docs) for q in range(questions)]
    random.Random(seed).shuffle(lines)
    return lines


def write_jsonl(path, lines) -> None:
    with open(path, "w") as f:
        for x in lines:
            f.write((x if isinstance(x, str) else json.dumps(x)) + "\n")


@pytest.fixture()
def client(redis_urls):
    prefix = f"batchery-test-{uuid.uuid4().hex[:10]}"
    queue = f"batchery-test-{uuid.uuid4().hex[:10]}"
    c = Client(
        settings=Settings(
            broker_url=TEST_BROKER_URL,
            result_backend=TEST_RESULT_BACKEND,
            queue=queue,
            # a message a line: these tests read the lines' messages on the queue (chunks: tests/test_chunks.py)
            batch={"key_prefix": prefix, "max_line_bytes": 1 << 16, "ttl": 600, "chunk_lines": 1},
        )
    )
    yield c
    drop_queue_keys(redis_client(TEST_BROKER_URL), queue)
    r = redis_client(TEST_RESULT_BACKEND)
    keys = list(r.scan_iter(match=f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    c.close()


def queued(client) -> list[dict]:
    """The task kwargs on the client's queue, in the order workers take them."""
    raw = redis_client(TEST_BROKER_URL).lrange(client.queue, 0, -1)
    return [json.loads(base64.b64decode(json.loads(m)["body"]))[1] for m in reversed(raw)]


def doc_of(kwargs: dict) -> int:
    return int(kwargs["custom_id"].split("-")[0][1:])


def runs(seq: list) -> int:
    """How many runs of equal neighbours ``seq`` has."""
    return sum(1 for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x)


# -- the key -------------------------------------------------------------------------------------------------------
def test_the_prefix_key_starts_with_what_starts_the_prompt():
    a, b = doc_line("a", 1, 1)["body"], doc_line("b", 1, 2)["body"]
    other = doc_line("c", 2, 1)["body"]
    ka, kb, kc = prefix_key(CHAT, a), prefix_key(CHAT, b), prefix_key(CHAT, other)
    assert len(os.path.commonprefix([ka, kb])) > len(doc_text(1))  # the shared system message starts both
    order = sorted([ka, kc, kb])
    assert abs(order.index(ka) - order.index(kb)) == 1  # so they sort next to each other
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert prefix_key(CHAT, {**a, "tools": tools}) != ka  # tools come before the messages
    assert prefix_key(CHAT, {**a, "model": "x"}).startswith("x\x00")
    parts = {**a, "messages": [{"role": "system", "content": [{"type": "text", "text": doc_text(1)}]}]}
    assert ka.startswith(prefix_key(CHAT, parts))  # text parts read as the text
    assert doc_text(3) in prefix_key("/v1/completions", {"prompt": doc_text(3) + " q"})
    key = prefix_key("/v1/responses", {"instructions": "be brief", "input": [{"role": "user", "content": "hi"}]})
    assert key.index("be brief") < key.index("hi")


# -- submission ----------------------------------------------------------------------------------------------------
def test_a_shuffled_docqa_file_is_enqueued_grouped_by_document(client, tmp_path):
    lines = docqa(24, 3)
    lines.insert(10, {"custom_id": "bad", "method": "POST", "url": CHAT, "body": {"messages": 5}})
    lines.insert(2, doc_line("d5-q1-again", 5, 1))  # the same body as d5-q1, further up the file
    path = tmp_path / "docqa.jsonl"
    write_jsonl(path, lines[:30] + [""] + lines[30:])  # a blank line: later line numbers move by one
    assert runs([doc_of(x) for x in lines if x["custom_id"] != "bad"]) > 50  # shuffled: documents spread out
    job = client.submit_batch(path)
    st = client.batch_status(job)
    assert st.request_counts.total == 74 and st.request_counts.failed == 1
    msgs = queued(client)
    assert len(msgs) == 73
    assert runs([doc_of(m) for m in msgs]) == 24  # each document's questions one after another
    number = {x["custom_id"]: i + 1 + (i >= 30) for i, x in enumerate(lines)}
    assert all(m["line"] == number[m["custom_id"]] for m in msgs)  # each keeps its own line number
    five = [m["custom_id"] for m in msgs if doc_of(m) == 5]
    assert five == ["d5-q0", "d5-q1-again", "d5-q1", "d5-q2"]  # the same prompt: input order (a stable sort)
    (bad,) = client.batch_results(job)
    assert bad["custom_id"] == "bad" and bad["error"]["line"] == number["bad"] == 12


def test_windows_are_bounded_and_the_first_lines_are_queued_before_the_rest_is_read(client):
    sub = make_submitter(client)
    sub.chunk_size, sub.group_lines = 6, 24
    lines = docqa(12, 4, seed=1)  # 48 lines: windows of 6, 6, 12 and 24 lines
    seen_at = {}

    def source():
        for i, x in enumerate(lines):
            if i in (6, 12, 24):
                seen_at[i] = len(queued(client))
            yield x

    sub.run(source())
    assert seen_at == {6: 6, 12: 12, 24: 24}
    msgs = queued(client)
    bounds = [(0, 6), (6, 12), (12, 24), (24, 48)]
    for lo, hi in bounds:  # each window in prefix order, holding its own lines
        got = msgs[lo:hi]
        assert sorted(m["line"] for m in got) == list(range(lo + 1, hi + 1))
        keys = [prefix_key(m["url"], m["body"]) for m in got]
        assert keys == sorted(keys)


def test_a_byte_bound_closes_a_window_early(client):
    sub = make_submitter(client)
    sub.group_bytes = 8_000  # about 5 messages of these lines
    lines = docqa(6, 3, seed=2)
    sub.run(lines)
    msgs = queued(client)
    assert sorted(m["line"] for m in msgs) == list(range(1, 19))
    assert [m["line"] for m in msgs] != sorted(m["line"] for m in msgs)  # grouped within windows
    first = max(i for i, m in enumerate(msgs) if m["line"] <= 5)
    assert first < 6  # the first window held only lines 1-5 (or so): the bytes closed it


class StallingFile:
    """A binary file whose reader stops after ``lines`` lines until ``go`` is set (its submitter died, as far as
    anyone else can tell; set, it reads on as a process that had only stalled would)."""

    def __init__(self, path, lines: int, go: threading.Event) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 - closed below
        self.left = lines
        self.go = go

    def readline(self, limit: int = -1) -> bytes:
        if self.left == 0:
            self.go.wait(30)
        self.left -= 1
        return self.f.readline(limit)

    def read(self, n: int = -1) -> bytes:
        return self.f.read(n)


def test_a_take_over_skips_exactly_the_lines_recorded(client, tmp_path):
    lines = docqa(10, 4, seed=3)  # 40 lines
    lines[13] = {"custom_id": "bad", "method": "POST", "url": CHAT, "body": {"messages": 5}}  # line 14
    path = tmp_path / "in.jsonl"
    write_jsonl(path, lines)
    old = make_submitter(client)
    old.chunk_size = 4  # windows: lines 1-4, 5-8, 9-16, 17-32, 33-40
    job = old.create()
    go = threading.Event()
    f = StallingFile(path, 20, go)  # dies in the fourth window: 16 lines recorded
    t = threading.Thread(target=old.submit, args=(f,))
    t.start()
    try:
        wait_for(lambda: client.jobs.max_line(job) == 16, 10, what="three windows recorded")
        assert client.batch_status(job).request_counts.total == 16
        new = make_submitter(client)
        new.chunk_size = 4
        assert new.resume(job, path, stale_s=0.0) is True
    finally:
        go.set()
        t.join(30)
        f.f.close()
    assert old.superseded  # its next window was refused
    st = client.batch_status(job)
    assert st.status == "in_progress" and st.request_counts.total == 40 and st.request_counts.failed == 1
    msgs = queued(client)
    got = sorted(m["line"] for m in msgs)
    assert got == [n for n in range(1, 41) if n != 14]  # every valid line queued once, none twice
    assert client.jobs.pending_lines(job) == set(got)
    assert [r["custom_id"] for r in client.batch_results(job)] == ["bad"]


@pytest.mark.integration
def test_a_grouped_job_s_results_map_back_to_their_custom_ids(tiny_client, tmp_path):
    """On the tiny model's worker: every output has its own line's custom_id, and its prompt's size."""
    rng = random.Random(4)
    lines = []
    for d in range(5):
        for q in range(3):
            body = doc_line(f"d{d}-q{q}", d, q)["body"]
            body["messages"][0]["content"] = doc_text(d, words=20 + 6 * d)
            body["messages"][1]["content"] = "question " + " ".join(["why"] * (q + 1))
            lines.append({"custom_id": f"d{d}-q{q}", "method": "POST", "url": CHAT, "body": body})
    rng.shuffle(lines)
    path = tmp_path / "in.jsonl"
    write_jsonl(path, lines)
    job = tiny_client.submit_batch(path)
    st = tiny_client.wait_batch(job, timeout=180)
    assert st.status == "completed", st
    records = list(tiny_client.batch_results(job))
    assert [r["custom_id"] for r in records] == [x["custom_id"] for x in lines]  # input order, by line
    prompt = {r["custom_id"]: r["response"]["body"]["usage"]["prompt_tokens"] for r in records}
    for d in range(5):  # a longer document, a longer prompt; a longer question, one more token each
        p = [prompt[f"d{d}-q{q}"] for q in range(3)]
        assert p[1] == p[0] + 1 and p[2] == p[0] + 2
        if d:
            assert p[0] > prompt[f"d{d - 1}-q0"]


def test_a_non_redis_broker_path_still_groups(client):
    # the Submitter with no broker client sends through Celery's producer (a non-Redis broker); here it
    # is still the test Redis underneath, so the queue can be read back
    sub = Submitter(client.jobs, None, client.app, client.settings)
    sub.run(docqa(5, 3, seed=5))
    wait_for(lambda: len(queued(client)) == 15, 10, what="15 messages")
    assert runs([doc_of(m) for m in queued(client)]) == 5
