"""``batchery run`` under a dying worker and with clashing paths (issue 13, items 10 and 11).

- Item 11: an output path that names the input, or ``--errors`` naming the output or the input (however
  spelled: ``./x``, a symlink), is refused with exit 2 before anything starts: no Redis, no worker, no
  file written or truncated.
- Item 10: the embedded worker SIGKILLed mid-job is restarted and the job completes with every line
  once; a worker that keeps exiting (the ``exit_on`` fault) is restarted ``MAX_WORKER_RESTARTS`` times,
  then the run writes every record that exists, in input order, says how many lines completed and
  how the worker exited, and exits 3."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from conftest import wait_for
from test_run import Tree, finished, kill_all, leftovers, run_dir_of, start_run, tiny_env, worker_log_of

pytestmark = pytest.mark.integration  # batchery run's embedded Redis and worker

EXIT_PARTIAL = 3  # batchery.run.EXIT_PARTIAL, spelled out: the tests pin the documented code


def run_to_end(args: list[str], env, tag, tmp_path: Path, timeout: float = 300) -> tuple[int, str, str, Tree]:
    err_path = tmp_path / "stderr.txt"
    proc = start_run(args, env, err_path)
    tree = Tree(proc.pid)
    try:
        wait_for(lambda: finished(proc, tree), timeout, interval=0.1, what="batchery run to finish")
        return proc.returncode, proc.stdout.read().decode(), err_path.read_text(), tree
    finally:
        kill_all(proc, tag, tree)
        shutil.rmtree(run_dir_of(err_path) or tmp_path / "none", ignore_errors=True)


def chat_line(custom_id: str, content: str, max_tokens: int = 2) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True},
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# -- item 11: output paths ---------------------------------------------------------------------------------
CLASHES = {
    # name: (args after the input, given the dir; the clashing words the message must name)
    "errors same as output (./ spelling)": (
        lambda d: ["-o", str(d / "x.jsonl"), "--errors", f"{d}/./x.jsonl"],
        "errors",
    ),
    "output is the input": (lambda d: ["-o", str(d / "in.jsonl")], "input"),
    "output is a symlink to the input": (lambda d: ["-o", str(d / "link.jsonl")], "input"),
    "errors is the input (relative spelling)": (
        lambda d: ["-o", str(d / "out.jsonl"), "--errors", str(d / "sub" / ".." / "in.jsonl")],
        "input",
    ),
}


@pytest.mark.parametrize("case", list(CLASHES))
def test_run_refuses_clashing_paths_before_any_work(case, tiny_model_dir, tmp_path):
    make_args, what = CLASHES[case]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [chat_line(f"q{i}", "hello") for i in range(3)])
    original = src.read_bytes()
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.jsonl").symlink_to(src)
    (tmp_path / "x.jsonl").write_text("keep me\n")  # an existing output: must not be truncated either
    env, tag = tiny_env(tiny_model_dir)
    rc, _out, stderr, tree = run_to_end([str(src), *make_args(tmp_path)], env, tag, tmp_path, timeout=120)
    assert rc == 2, stderr
    assert "same file" in stderr and what in stderr, stderr
    assert "embedded Redis" not in stderr and "Traceback" not in stderr, stderr
    assert tree.seen == {}, "the run started processes before refusing its paths"
    assert src.read_bytes() == original
    assert (tmp_path / "x.jsonl").read_text() == "keep me\n"
    assert not (tmp_path / "out.jsonl").exists() and list(tmp_path.glob(".*.tmp")) == []


# -- item 10: the embedded worker exits ---------------------------------------------------------------------
def worker_pid(tree: Tree) -> int | None:
    tree.sample()
    for pid in tree.alive():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"batchery.worker" in f.read():
                    return pid
        except OSError:
            pass
    return None


def test_run_restarts_a_killed_worker_and_completes(tiny_model_dir, tmp_path):
    env, tag = tiny_env(tiny_model_dir)
    env["BATCHERY_BATCH__CHUNK_LINES"] = "1"  # a message a line: its first lines finish while others still run
    src, out, errs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    n = 24
    write_jsonl(src, [chat_line(f"q{i}", "hello", max_tokens=2 if i < 4 else 500) for i in range(n)])
    err_path = tmp_path / "stderr.txt"
    proc = start_run([str(src), "-o", str(out), "--errors", str(errs)], env, err_path)
    tree = Tree(proc.pid)
    try:
        log = worker_log_of(err_path)

        def working():
            assert proc.poll() is None, err_path.read_text()
            return log.exists() and re.search(r"batch_line\[\S+\] succeeded", log.read_text(errors="replace"))

        wait_for(working, 120, what="the embedded worker to finish its first lines")
        first = worker_pid(tree)
        assert first is not None
        os.kill(first, signal.SIGKILL)  # the OOM killer, a segfault: no acks, no cleanup
        wait_for(lambda: finished(proc, tree), 300, interval=0.2, what="batchery run to finish after the kill")
        stderr = err_path.read_text()
        assert proc.returncode == 0, stderr
        assert re.search(r"the worker exited \(killed by SIGKILL\); restarting it \(restart 1 of 3\)", stderr), stderr
        assert re.search(rf"completed batch_\w+: {n} lines ok, 0 failed", stderr), stderr
        assert [r["custom_id"] for r in read_jsonl(out)] == [f"q{i}" for i in range(n)]
        assert read_jsonl(errs) == []
        assert leftovers(tag, tree) == []
    finally:
        kill_all(proc, tag, tree)
        shutil.rmtree(run_dir_of(err_path) or tmp_path / "none", ignore_errors=True)


def test_run_gives_up_after_bounded_restarts_and_writes_what_completed(tiny_model_dir, tmp_path):
    # one sequence per step, so the good lines before the poison one run (and finish) without it
    env, tag = tiny_env(tiny_model_dir, BATCHERY_FAULTS="exit_on:KILLME")
    env["BATCHERY_MAX_NUM_SEQS"] = "1"
    env["BATCHERY_MAX_DELIVERIES"] = "0"  # no dead-lettering: the line kills every worker it meets
    rows = [chat_line(f"q{i}", f"hello {i}") for i in range(6)]
    rows.insert(2, {**chat_line("bad", "hello"), "body": {"messages": [], "max_tokens": 2}})  # invalid: an error
    rows.append(chat_line("poison", "please KILLME now"))
    src, out, errs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    write_jsonl(src, rows)
    rc, _stdout, stderr, tree = run_to_end(
        [str(src), "-o", str(out), "--errors", str(errs)], env, tag, tmp_path, timeout=400
    )
    assert rc == EXIT_PARTIAL, stderr
    for k in (1, 2, 3):
        assert f"the worker exited with code 70; restarting it (restart {k} of 3)" in stderr, stderr
    m = re.search(r"(\d+) of (\d+) lines completed; the worker exited 4 times: (.*)", stderr)
    assert m, stderr
    assert m.group(3).startswith("code 70, code 70, code 70, code 70"), m.group(3)
    oks, bad = read_jsonl(out), read_jsonl(errs)
    assert (int(m.group(1)), int(m.group(2))) == (len(oks) + len(bad), len(rows))
    ids = [r["custom_id"] for r in oks]
    # input order; every good line but (at most) the one that shared the dying worker with the poison
    assert ids == sorted(ids, key=lambda c: int(c[1:])) and len(ids) >= 5, ids
    assert [r["custom_id"] for r in bad] == ["bad"] and bad[0]["error"]["code"] == "invalid_body"
    assert "poison" not in ids
    assert re.search(r"\(logs kept in \S+\)", stderr)
    assert leftovers(tag, tree) == []


def test_run_dead_letters_a_line_that_kills_its_worker_and_completes(tiny_model_dir, tmp_path):
    """Item 2 under ``batchery run``: the line that kills every worker it meets is given up after
    ``BATCHERY_MAX_DELIVERIES`` (3) deaths, as an ``engine_crash`` error record; every other line completes
    and the run exits 0 (the restarts stay within their bound)."""
    env, tag = tiny_env(tiny_model_dir, BATCHERY_FAULTS="exit_on:KILLME")
    rows = [chat_line(f"q{i}", f"hello {i}") for i in range(6)] + [chat_line("poison", "please KILLME now")]
    src, out, errs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    write_jsonl(src, rows)
    rc, _stdout, stderr, tree = run_to_end(
        [str(src), "-o", str(out), "--errors", str(errs)], env, tag, tmp_path, timeout=400
    )
    assert rc == 0, stderr
    # one death per delivery: 3 deliveries died (3 restarts), the 4th dead-letters it without running it
    assert "the worker exited with code 70; restarting it (restart 3 of 3)" in stderr, stderr
    assert "gave up" not in stderr, stderr
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"q{i}" for i in range(6)]
    bad = read_jsonl(errs)
    assert [r["custom_id"] for r in bad] == ["poison"], bad
    assert bad[0]["error"]["code"] == "engine_crash" and "dead-letter" in bad[0]["error"]["message"], bad[0]
    assert leftovers(tag, tree) == []


# -- item 13: a Redis that cannot be reached ends in one clear line ------------------------------------------
def test_run_on_an_unreachable_cluster_says_so_without_a_traceback(tmp_path):
    from conftest import free_port

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [chat_line("q0", "hello")])
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
    env.update(BATCHERY_BROKER_URL=url, BATCHERY_RESULT_BACKEND=url, PYTHONPATH=str(Path(__file__).parents[1]))
    err_path = tmp_path / "stderr.txt"
    proc = start_run([str(src), "-o", str(out)], env, err_path)
    proc.wait(120)
    stderr = err_path.read_text()
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert re.search(
        r"batchery run: ConnectionError: .*\(redis://:\*\*\*@127\.0\.0\.1:\d+/0\); no output written", stderr
    )
    assert "hunter2" not in stderr
    assert not out.exists()
