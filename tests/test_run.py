"""``batchery run``: the main job in one command.

- With a broker URL it submits to that cluster and waits: the mixed job completes and it exits 0.
- Acceptance 4: end to end on examples/chat.jsonl with the embedded Redis and the default model;
  afterwards no Redis or worker process of the run is left.
- Ctrl-C (SIGINT to the foreground process group, as a terminal sends it) mid-job: exit 130, no
  output file (not even a partial one), no process left. SIGKILL of the command: its children die
  with it (PR_SET_PDEATHSIG).

Processes of a run are found by a tag in their environment (every child inherits it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import REPO, wait_for
from test_batch_worker import check_mixed_records, mixed_job_lines

pytestmark = pytest.mark.integration  # batchery run's embedded Redis and worker

TAG = "BATCHERY_TEST_RUN_TAG"


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """Live processes (pid, command) whose environment carries ``TAG=tag``. (redis-server rewrites
    its environment block for its process title, so it is found as a descendant instead.)"""
    needle = f"{TAG}={tag}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in env:
            found.append((int(pid), cmd))
    return found


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, state) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[19], fields[0]


class Tree:
    """The descendants of a process, as sampled while it runs; ``alive`` tells which still live
    (same pid and start time, not a zombie)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, str] = {}

    def sample(self) -> int:
        stats = {int(p): _stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
        parents = {self.root} | set(self.seen)
        changed = True
        while changed:
            changed = False
            for pid, st in stats.items():
                if st and st[0] in parents and pid not in parents:
                    parents.add(pid)
                    self.seen[pid] = st[1]
                    changed = True
        return len(self.seen)

    def alive(self) -> list[int]:
        out = []
        for pid, start in self.seen.items():
            st = _stat(pid)
            if st is not None and st[1] == start and st[2] != "Z":
                out.append(pid)
        return out


def finished(proc: subprocess.Popen, tree: Tree) -> bool:
    """Sample the process tree while waiting, so short-lived children are seen too."""
    tree.sample()
    return proc.poll() is not None


def leftovers(tag: str, tree: Tree) -> list:
    return sorted(set(tree.alive()) | {pid for pid, _ in tagged_processes(tag)})


def run_env(**extra) -> tuple[dict[str, str], str]:
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
    env.update({TAG: tag, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    env.update({k: str(v) for k, v in extra.items()})
    return env, tag


def _as_a_terminal_starts_it() -> None:
    """SIGINT at its default in the child, as a shell's foreground job has it. Python turns SIGINT into
    KeyboardInterrupt only when it starts with the default, and a test run launched in the background of a
    non-interactive shell (``bash -c 'pytest ... &'``) hands its children SIGINT ignored: the Ctrl-C test then
    waited 60 s on a run that never saw the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run(args: list[str], env: dict[str, str], stderr_path: Path) -> subprocess.Popen:
    with open(stderr_path, "wb") as err:
        # its own process group, like a shell job: a terminal's Ctrl-C signals the whole group
        return subprocess.Popen(
            [sys.executable, "-m", "batchery", "run", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
            preexec_fn=_as_a_terminal_starts_it,
        )


def tiny_env(tiny_model_dir, **extra):
    return run_env(
        BATCHERY_MODEL=tiny_model_dir,
        BATCHERY_DTYPE="float32",
        BATCHERY_MAX_NUM_SEQS=16,
        BATCHERY_ENGINE__NUM_KV_BLOCKS=1024,
        BATCHERY_ENGINE__MAX_MODEL_LEN=4096,
        **extra,
    )


# -- with a broker: submit to the cluster ---------------------------------------------------------------
def test_run_against_a_cluster_writes_results_and_exits_0(session_workers, tiny_worker, tmp_path):
    lines, errors, valid = mixed_job_lines()
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    env = session_workers.env(tiny_worker.queue, BATCHERY_BATCH__MAX_LINE_BYTES=65536)
    out, err = tmp_path / "out" / "results.jsonl", tmp_path / "errors.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "batchery", "run", str(src), "-o", str(out), "--errors", str(err), "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] == "completed"
    assert (summary["lines_ok"], summary["lines_failed"]) == (len(valid), len(errors))
    assert summary["completion_tokens"] > 0 and summary["wall_s"] > 0
    assert re.search(rf"completed batch_\w+: {len(valid)} lines ok, {len(errors)} failed", proc.stderr)
    assert "embedded" not in proc.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()] + [
        json.loads(x) for x in err.read_text().splitlines()
    ]
    check_mixed_records(records, errors, valid, summary["job"])
    session_workers.client(tiny_worker.queue).jobs.delete(summary["job"])


# -- acceptance 4: embedded, end to end -----------------------------------------------------------------
@pytest.mark.slow
def test_run_embedded_on_the_example_with_the_default_model(tmp_path):
    env, tag = run_env()  # no BATCHERY_BROKER_URL, no BATCHERY_MODEL: embedded Redis, smollm2-135m-instruct
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    popen = start_run(["examples/chat.jsonl", "-o", str(out), "--errors", str(err)], env, tmp_path / "stderr.txt")
    tree = Tree(popen.pid)
    try:
        wait_for(lambda: finished(popen, tree), 600, interval=0.2, what="batchery run to finish")
        proc = subprocess.CompletedProcess(
            popen.args, popen.returncode, popen.stdout.read().decode(), (tmp_path / "stderr.txt").read_text()
        )
        assert tree.seen, "the run started no processes?"
        assert proc.returncode == 0, proc.stderr
        assert "embedded Redis and a worker for smollm2-135m-instruct" in proc.stderr
        assert re.search(r"completed batch_\w+: 19 lines ok, 1 failed", proc.stderr), proc.stderr
        assert re.search(
            r"tokens: \d+ prompt \(\d+ from the prefix cache\) \+ \d+ completion; "
            r"wall [\d.]+ s, generating [\d.]+ s: [\d.]+ completion tokens/s",
            proc.stderr,
        )
        oks = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["custom_id"] for r in oks] == [f"request-{i}" for i in range(1, 19)] + ["request-completion"]
        for r in oks:
            body = r["response"]["body"]
            assert r["response"]["status_code"] == 200 and body["model"] == "smollm2-135m-instruct"
            choice = body["choices"][0]
            assert (choice.get("message") or {}).get("content", choice.get("text", "")).strip()
        (bad,) = [json.loads(x) for x in err.read_text().splitlines()]
        assert bad["custom_id"] == "request-invalid" and bad["error"]["line"] == 11
        assert bad["error"]["code"] == "invalid_body" and "temperature" in bad["error"]["message"]
        assert not list(tmp_path.glob(".*.tmp"))
    finally:
        if popen.poll() is None:
            popen.kill()
        assert leftovers(tag, tree) == [], "batchery run left processes behind"


# -- Ctrl-C and SIGKILL --------------------------------------------------------------------------------------
def long_job(path: Path, n: int = 40) -> None:
    rows = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 2 if i < 4 else 3000,
                "ignore_eos": True,
            },
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_dir_of(stderr_path: Path) -> Path | None:
    """The run's temporary directory (it holds the logs), as the run announced it."""
    m = re.search(r"worker log (\S+)/worker\.log\)", stderr_path.read_text(errors="replace"))
    return Path(m.group(1)) if m else None


def worker_log_of(stderr_path: Path) -> Path:
    def found():
        m = re.search(r"worker log (\S+)\)", stderr_path.read_text(errors="replace"))
        return m and Path(m.group(1))

    return wait_for(found, 30, what="the run to start its stack")


def wait_until_working(stderr_path: Path, proc: subprocess.Popen) -> None:
    log = worker_log_of(stderr_path)

    def working():
        assert proc.poll() is None, stderr_path.read_text()
        return log.exists() and re.search(r"batch_line\[\S+\] succeeded", log.read_text(errors="replace"))

    wait_for(working, 120, what="the embedded worker to finish its first lines")


def test_ctrl_c_mid_job_leaves_no_processes_and_no_output(tiny_model_dir, tmp_path):
    env, tag = tiny_env(tiny_model_dir)
    env["BATCHERY_BATCH__CHUNK_LINES"] = "1"  # a message a line: the lines finish one by one, the job stays long
    src, out = tmp_path / "long.jsonl", tmp_path / "out.jsonl"
    long_job(src)
    proc = start_run([str(src), "-o", str(out)], env, tmp_path / "stderr.txt")
    tree = Tree(proc.pid)
    try:
        wait_until_working(tmp_path / "stderr.txt", proc)
        assert tree.sample() == 2  # its Redis and its worker
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(60) == 130
        stderr = (tmp_path / "stderr.txt").read_text()
        assert "interrupted (Ctrl-C); no output written" in stderr and "Traceback" not in stderr
        assert not out.exists() and list(tmp_path.glob(".out.jsonl*")) == []
        assert leftovers(tag, tree) == []
        assert not run_dir_of(tmp_path / "stderr.txt").exists()  # its logs went with it
    finally:
        kill_all(proc, tag, tree)


def test_sigkill_of_the_command_takes_its_children_down(tiny_model_dir, tmp_path):
    env, tag = tiny_env(tiny_model_dir)
    env["BATCHERY_BATCH__CHUNK_LINES"] = "1"  # a message a line: the lines finish one by one, the job stays long
    src = tmp_path / "long.jsonl"
    long_job(src)
    proc = start_run([str(src), "-o", str(tmp_path / "out.jsonl")], env, tmp_path / "stderr.txt")
    tree = Tree(proc.pid)
    try:
        wait_until_working(tmp_path / "stderr.txt", proc)
        assert tree.sample() == 2
        proc.kill()
        proc.wait(10)
        wait_for(lambda: leftovers(tag, tree) == [], 30, what="the orphaned Redis and worker to die")
    finally:
        kill_all(proc, tag, tree)
        # a SIGKILLed run cannot remove its own directory
        shutil.rmtree(run_dir_of(tmp_path / "stderr.txt") or tmp_path / "none", ignore_errors=True)


def kill_all(proc: subprocess.Popen, tag: str, tree: Tree) -> None:
    """Test cleanup only: whatever is still alive after a failed assertion."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for pid in leftovers(tag, tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_run_reports_a_worker_that_cannot_start(tmp_path):
    env, tag = run_env(BATCHERY_MODEL="/nonexistent/model")
    src = tmp_path / "in.jsonl"
    long_job(src, 2)
    proc = start_run([str(src), "-o", str(tmp_path / "o.jsonl")], env, tmp_path / "stderr.txt")
    tree = Tree(proc.pid)
    try:
        wait_for(lambda: finished(proc, tree), 120, interval=0.2, what="batchery run to give up")
        stderr = (tmp_path / "stderr.txt").read_text()
        assert proc.returncode == 1, stderr
        assert "the worker exited with code 3" in stderr and "could not load model" in stderr
        kept = re.search(r"\(logs kept in (\S+)\)", stderr)
        assert kept and (Path(kept.group(1)) / "worker.log").exists()
        assert not (tmp_path / "o.jsonl").exists()
        assert tree.seen and leftovers(tag, tree) == []
    finally:
        kill_all(proc, tag, tree)
        shutil.rmtree(run_dir_of(tmp_path / "stderr.txt") or tmp_path / "none", ignore_errors=True)
