"""Batch jobs through the real Redis and real ``batchery worker`` processes (tiny model).

1. a job mixing valid lines and every kind of invalid line: a 200 for each valid line in input
   order, an error record with the right code and line number for each invalid one, completed;
2. the same request delivered twice counts once (duplicate messages on the queue);
3. cancel mid-job: cancelled, partial results downloadable, nothing left running in the engine;
plus the ``batchery batch`` CLI (every subcommand, text and --json) and the progress bar."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, TEST_BROKER_URL, redis_client, wait_for

from batchery.broker.publish import MessageBuilder
from batchery.cli import BATCH_COMMANDS, COMMANDS, build_parser
from batchery.contract.schemas import BatchJob, ChatCompletion, Completion
from batchery.progress import Progress

pytestmark = pytest.mark.integration  # real worker processes

HI = [{"role": "user", "content": "hello world"}]


def req(cid, url="/v1/chat/completions", **body) -> dict:
    if url == "/v1/chat/completions":
        body = {"messages": HI, "max_tokens": 4, "temperature": 0, **body}
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


@pytest.fixture()
def bclient(session_workers, tiny_worker):
    """A client of the shared tiny worker's queue; deletes the jobs it made."""
    c = session_workers.client(tiny_worker.queue)
    yield c
    for job in c.list_batches(1000):
        if job.queue == tiny_worker.queue:
            c.jobs.delete(job.id)
    c.close()


def mixed_job_lines() -> tuple[list[str], dict[int, str], list[int]]:
    """(physical lines, {line number: expected error code}, [valid line numbers])."""
    rows: list[tuple[str, str | None]] = [
        (json.dumps(req("chat-1")), None),
        ("", None),  # blank: ignored
        ("{this is not json", "invalid_json"),
        (json.dumps(req("comp-1", "/v1/completions", prompt="once upon a time", max_tokens=3, temperature=0)), None),
        ("[1, 2, 3]", "invalid_line"),
        (json.dumps({k: v for k, v in req("x").items() if k != "custom_id"}), "missing_custom_id"),
        (json.dumps(req("chat-1")), "duplicate_custom_id"),
        (json.dumps(req("bad-url", "/v1/moderations", input="x")), "unsupported_url"),
        (json.dumps({**req("bad-method"), "method": "GET"}), "unsupported_method"),
        (json.dumps(req("neg-max", max_tokens=-3)), "invalid_body"),
        (json.dumps({**req("no-messages"), "body": {"messages": []}}), "invalid_body"),
        (json.dumps(req("hot", temperature=7)), "invalid_body"),
        # 9,000 tokens on a worker whose max_model_len is 8,192: only the worker can tell
        (
            json.dumps(req("too-long", "/v1/completions", prompt="hello " * 9000, max_tokens=2)),
            "context_length_exceeded",
        ),
        (json.dumps(req("huge", messages=[{"role": "user", "content": "x" * 70_000}])), "line_too_large"),
        (json.dumps(req("chat-2", messages=[{"role": "user", "content": "the cat and the dog"}], max_tokens=6)), None),
        ("   ", None),
    ]
    errors = {n: code for n, (_, code) in enumerate(rows, 1) if code}
    valid = [n for n, (text, code) in enumerate(rows, 1) if code is None and text.strip()]
    return [text for text, _ in rows], errors, valid


def check_mixed_records(records: list[dict], errors: dict[int, str], valid: list[int], job_id: str) -> None:
    lines = [r["error"]["line"] if r["error"] else None for r in records]
    oks = [r for r in records if r["error"] is None]
    assert [r["custom_id"] for r in oks] == ["chat-1", "comp-1", "chat-2"]  # input order
    for r, n in zip(oks, valid):
        assert r["id"] == f"batch_req_{job_id.removeprefix('batch_')}_{n}"
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"] == f"{job_id}-{n}"
        body = r["response"]["body"]
        model = ChatCompletion if body["object"] == "chat.completion" else Completion
        assert model.model_validate(body).usage.completion_tokens > 0
    errs = [r for r in records if r["error"] is not None]
    assert {r["error"]["line"]: r["error"]["code"] for r in errs} == errors
    assert [n for n in lines if n is not None] == sorted(errors)  # errors interleaved in input order too
    by_code = {r["error"]["code"]: r for r in errs}
    worker_side = by_code["context_length_exceeded"]
    assert worker_side["custom_id"] == "too-long" and "max_model_len" in worker_side["error"]["message"]
    assert worker_side["response"]["status_code"] == 400
    assert worker_side["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert by_code["invalid_json"]["response"] is None and by_code["invalid_json"]["custom_id"] is None


# -- 1. mixed valid and invalid lines -------------------------------------------------------------------
def test_mixed_job_every_line_accounted_for_in_input_order(bclient, tmp_path, tiny_client):
    lines, errors, valid = mixed_job_lines()
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    bclient.settings.batch.max_line_bytes = 65536
    job_id = bclient.submit_batch(path, timeout=60, metadata={"case": "mixed"})
    job = bclient.wait_batch(job_id, timeout=120)
    assert job.status == "completed"
    assert job.request_counts.model_dump() == {
        "total": len(valid) + len(errors),
        "completed": len(valid),
        "failed": len(errors),
    }
    assert job.usage.completion_tokens > 0 and job.metadata == {"case": "mixed"}
    records = list(bclient.batch_results(job_id))
    check_mixed_records(records, errors, valid, job_id)
    # the batch line answers exactly what the same request answers on its own
    direct = tiny_client.chat(HI, max_tokens=4, temperature=0).get(timeout=60)
    assert records[0]["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content


def test_priority_jobs_are_consumed_too(bclient):
    # priorities 1-9 go to kombu's priority lists next to the queue; the worker reads them all
    job = bclient.wait_batch(bclient.submit_batch([req("p1"), req("p2")], priority=9), timeout=60)
    assert job.status == "completed" and job.request_counts.completed == 2 and job.priority == 9


# -- 2. idempotency end to end ----------------------------------------------------------------------------
def test_each_line_delivered_twice_counts_once(bclient, tiny_worker):
    """Every message is on the queue twice, as after a redelivery: each line is recorded and
    counted once, and the second delivery says so."""
    store = bclient.jobs
    job_id = f"batch_dup{int(time.time() * 1000)}"
    store.create(job_id, queue=bclient.queue, model=bclient.settings.model)
    builder = MessageBuilder(bclient.app, "batchery.batch_line", bclient.queue)
    n = 6
    msgs = []
    for line in range(1, n + 1):
        kwargs = {
            "job": job_id,
            "line": line,
            "custom_id": f"r{line}",
            "url": "/v1/chat/completions",
            "body": {"messages": HI, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        }
        msgs += [builder.build(f"{job_id}-{line}", kwargs) for _ in range(2)]
    store.r.hset(store.key(job_id), "total", n)
    with store.r.pipeline() as p:  # the ledger, as the submitter keeps it: a line not in it is refused
        store.ledger_in(p, job_id, [(line, msgs[2 * (line - 1)]) for line in range(1, n + 1)])
        p.execute()
    with redis_client(TEST_BROKER_URL).pipeline() as p:
        builder.push(p, msgs)
        p.execute()
    store.end_submit(job_id, n, n)
    job = bclient.wait_batch(job_id, timeout=60)
    assert job.status == "completed" and job.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
    assert job.usage.completion_tokens == 8 * n  # tokens counted once too
    records = list(bclient.batch_results(job_id))
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(1, n + 1)]

    def second_deliveries():
        log = tiny_worker.log()
        return sum(log.count(f"batch_line[{job_id}-{line}] succeeded") for line in range(1, n + 1)) == 2 * n and log

    log = wait_for(second_deliveries, 30, what="both deliveries of every line to be handled")
    dup = log.count("already recorded (duplicate delivery)") + log.count("s: skipped (done)")
    dup += log.count("skipped (another copy of the line runs in this worker process)")  # both copies in flight at once
    assert dup >= n


# -- 3. cancel mid-job ---------------------------------------------------------------------------------------
def test_cancel_mid_job(workers):
    w = workers.spawn(BATCHERY_MAX_NUM_SEQS="8", BATCHERY_CONCURRENCY="10")
    c = workers.client(w.queue)
    c.settings.batch.chunk_lines = 1  # a message a line: the short lines, queued first, run first
    short = [req(f"short-{i}", max_tokens=2) for i in range(4)]
    long = [req(f"long-{i}", max_tokens=3000, ignore_eos=True) for i in range(40)]
    job_id = c.submit_batch(short + long)
    engine = lambda: w.stats()["engine"]  # noqa: E731
    wait_for(
        lambda: c.batch_status(job_id).request_counts.completed >= 4 and engine()["num_running"] >= 4,
        60,
        what="the short lines done and long ones running",
    )
    t0 = time.monotonic()
    st = c.cancel_batch(job_id)
    assert st.status in ("cancelling", "cancelled")
    job = wait_for(lambda: (s := c.batch_status(job_id)).status == "cancelled" and s, 10, what="cancelled")
    assert time.monotonic() - t0 < 8  # polls: 0.25 s per request, 0.5 s per job and process
    counts = job.request_counts
    assert counts.total == 44 and 4 <= counts.completed < 44 and counts.failed == 0
    records = list(c.batch_results(job_id))  # partial results stay downloadable
    assert len(records) == counts.completed
    assert [r["custom_id"] for r in records[:4]] == [f"short-{i}" for i in range(4)]
    assert all(r["response"]["status_code"] == 200 for r in records)
    # nothing left running in the engine, every KV block back; the rest of the queue is skipped
    wait_for(
        lambda: (
            (e := engine())["num_running"] == 0
            and e["num_waiting"] == 0
            and e["kv_blocks_free"] == e["kv_blocks_total"]
            and w.stats()["num_pending"] == 0
        ),
        10,
        what="an empty engine",
    )
    r = redis_client(TEST_BROKER_URL)
    wait_for(lambda: r.llen(w.queue) == 0, 30, what="the queue to drain")
    wait_for(
        lambda: w.count(r"s: cancelled |") + w.count(r"s: skipped \(cancel") >= 44 - counts.completed,
        30,
        what="every unfinished line to be aborted or skipped",
    )
    assert w.count(r"s: cancelled |") >= 1  # at least one line was aborted while running
    assert c.batch_status(job_id).request_counts == counts  # and nothing moves afterwards
    c.jobs.delete(job_id)
    c.close()


# -- the CLI ---------------------------------------------------------------------------------------------------
def cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchery", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_command_has_help(capsys):
    parser = build_parser()
    commands = [[name] for name in COMMANDS] + [["batch", name] for name in BATCH_COMMANDS]
    for argv in commands:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*argv, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: batchery " + " ".join(argv)), out
        if argv[0] == "batch" and len(argv) == 2 and argv[1] != "list":
            assert "--json" in out


def test_batch_cli_round_trip(session_workers, tiny_worker, tmp_path):
    env = session_workers.env(tiny_worker.queue)
    env["BATCHERY_BATCH__MAX_LINE_BYTES"] = "65536"
    lines, errors, valid = mixed_job_lines()
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")

    sub = cli("batch", "submit", str(path), "--metadata", "team=qa", "--timeout", "60", "--json", env=env)
    assert sub.returncode == 0, sub.stderr
    job = BatchJob.model_validate_json(sub.stdout)
    assert job.metadata == {"team": "qa"} and job.timeout == 60

    wait = cli("batch", "wait", job.id, "--json", env=env)
    assert wait.returncode == 0, wait.stderr
    done = BatchJob.model_validate_json(wait.stdout)
    assert done.status == "completed" and done.request_counts.failed == len(errors)

    status = cli("batch", "status", job.id, env=env)
    assert status.returncode == 0 and "status:    completed" in status.stdout
    assert f"{len(valid) + len(errors)} total, {len(valid)} completed, {len(errors)} failed" in status.stdout

    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    res = cli("batch", "results", job.id, "-o", str(out), "--errors", str(err), env=env)
    assert res.returncode == 0, res.stderr
    assert f"{len(valid)} output lines" in res.stdout
    oks = [json.loads(x) for x in out.read_text().splitlines()]
    errs = [json.loads(x) for x in err.read_text().splitlines()]
    assert all(r["error"] is None for r in oks) and all(r["error"] for r in errs)
    assert [r["custom_id"] for r in oks] == ["chat-1", "comp-1", "chat-2"]
    assert [r["error"]["line"] for r in errs] == sorted(errors)
    inline = cli("batch", "results", job.id, env=env)  # to stdout, errors inline, input order
    recs = [json.loads(x) for x in inline.stdout.splitlines()]
    check_mixed_records(recs, errors, valid, job.id)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]

    listed = cli("batch", "list", "--json", "--limit", "50", env=env)
    assert job.id in [j["id"] for j in json.loads(listed.stdout)]
    assert job.id in cli("batch", "list", env=env).stdout
    cancel = cli("batch", "cancel", job.id, "--json", env=env)  # an ended job keeps its status
    assert cancel.returncode == 0 and json.loads(cancel.stdout)["status"] == "completed"
    missing = cli("batch", "status", "batch_nope", env=env)
    assert missing.returncode == 1 and "no batch job 'batch_nope'" in missing.stderr
    bad = cli("batch", "submit", str(tmp_path / "nope.jsonl"), env=env)
    assert bad.returncode == 2 and "no such file" in bad.stderr
    session_workers.client(tiny_worker.queue).jobs.delete(job.id)


# -- the progress bar -------------------------------------------------------------------------------------------
class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_done_failed_rate_and_eta():
    stream = FakeTTY()
    bar = Progress(stream, width=10)
    base = dict(id="batch_x", queue="q", created_at=0.0, status="in_progress")
    bar.update(BatchJob(**base, request_counts={"total": 100, "completed": 0, "failed": 0}))
    bar._samples[0] = (bar._samples[0][0] - 10.0, 0, 0)  # ten seconds ago
    bar.update(
        BatchJob(**base, request_counts={"total": 100, "completed": 45, "failed": 5}, usage={"completion_tokens": 2000})
    )
    line = stream.getvalue().split("\r")[-1]
    assert line.startswith("[#####-----]  50/100 done  5 failed")
    assert "200.0 tok/s" in line and "ETA 0:00:10" in line and line.endswith("in_progress\x1b[K")
    bar.update(BatchJob(**{**base, "status": "completed"}, request_counts={"total": 100, "completed": 95, "failed": 5}))
    bar.close()
    assert stream.getvalue().endswith("ETA 0:00:00  completed\x1b[K\n")
