"""Big batch jobs: Redis' footprint and the product's cost per line, end to end, as a user runs them.

One run, on a private ``redis-server`` (its own port, no persistence, ``noeviction``, optionally ``--maxmemory``):

1. writes a JSONL file of chat lines (~900 bytes each, ``max_tokens: 1``: classification-sized outputs, where the
   product's own cost per line shows most) for the tiny random-weight model of ``tests/tiny_model.py``;
2. starts ``--workers`` ``batchery worker`` processes on it (unless ``--no-workers``: the submit alone);
3. runs what a user runs: ``batchery batch submit FILE``, ``batchery batch wait ID``, ``batchery batch results ID -o
   OUT`` (each a process of its own, its peak RSS taken by ``wait4``), ``--jobs`` jobs at once;
4. samples ``INFO memory`` (``used_memory``) and each job's counts every second throughout.

It prints, per size: Redis' peak ``used_memory`` above the empty-Redis baseline, lines per second from the first
submit to the last output file written, the CLI processes' peak RSS, the records checked against the input (every
``custom_id`` exactly once: lost 0, duplicated 0), and with ``--offline`` the same lines through the offline engine
(``LLM.chat``) in a process of its own, for the ratio. ``--curve`` prints each job's progress every few seconds.

``--tree DIR`` runs the CLI and the workers from another checkout (``git worktree add /tmp/old <commit>``), with
this venv: that is how the figures of an older tree are measured in the same run.

    .venv/bin/python benchmarks/big_job.py --lines 20000 --no-workers            # the submit's footprint
    .venv/bin/python benchmarks/big_job.py --lines 3000 --offline                # per-line cost vs the engine
    .venv/bin/python benchmarks/big_job.py --lines 100000,1000000 --maxmemory 64mb
    .venv/bin/python benchmarks/big_job.py --lines 20000 --tree /tmp/old         # an older tree, same machine
    .venv/bin/python benchmarks/big_job.py --lines 100000 --fault kill-holder    # exactly once through a fault
    .venv/bin/python benchmarks/big_job.py --lines 1000000 --via-serve           # batchery serve + openai SDK, its RSS
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

LINE_BYTES = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_input(path: Path, n: int, prefix: str = "req", seed: int = 0) -> int:
    """``n`` chat lines of about ``LINE_BYTES`` bytes, words of the tiny model's vocabulary; returns the size."""
    from tiny_model import WORDS

    rnd = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            head = {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "system", "content": "answer yes or no"}], "max_tokens": 1},
            }
            text = []
            size = len(json.dumps(head)) + 40
            while size < LINE_BYTES:
                w = rnd.choice(WORDS)
                text.append(w)
                size += len(w) + 1
            head["body"]["messages"].append({"role": "user", "content": " ".join(text)})
            f.write(json.dumps(head) + "\n")
    return path.stat().st_size


class Redis:
    """A private ``redis-server``: no persistence, ``noeviction``, optionally a ``maxmemory``."""

    def __init__(self, workdir: Path, maxmemory: str | None, aof: bool = False) -> None:
        import redis

        self.port = free_port()
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes" if aof else "no", "--maxmemory-policy", "noeviction", "--dir", str(workdir)]
        if maxmemory:
            args += ["--maxmemory", maxmemory]
        self.args = args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.r = redis.Redis.from_url(self.url)
        self.wait_ready()
        self.baseline = self.used()

    def wait_ready(self, timeout: float = 30.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.r.ping():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def restart(self) -> None:
        """Stop it (SIGTERM: the AOF is flushed) and start it again on the same port and files."""
        self.stop()
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.wait_ready()

    def used(self) -> int:
        return int(self.r.info("memory")["used_memory"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Sampler(threading.Thread):
    """Every ``interval`` s: Redis' used_memory and each job's counts (read from the job hash directly)."""

    def __init__(self, redis_: Redis, prefix: str, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.redis, self.prefix, self.interval = redis_, prefix, interval
        self.jobs: list[str] = []
        self.peak = redis_.baseline
        self.samples: list[tuple[float, int, dict]] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def sample(self) -> None:
        try:
            used = self.redis.used()
            counts = {}
            for job in list(self.jobs):
                total, done, failed, status = self.redis.r.hmget(
                    f"{self.prefix}:{job}", ["total", "completed", "failed", "status"]
                )
                counts[job] = (int(total or 0), int(done or 0) + int(failed or 0), (status or b"").decode())
        except Exception:  # noqa: BLE001 - a busy Redis: skip the sample
            return
        self.peak = max(self.peak, used)
        self.samples.append((time.monotonic() - self.t0, used, counts))

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.sample()


def run_cli(args: list[str], env: dict, cwd: Path) -> tuple[int, str, str, int]:
    """A ``batchery`` command in a process of its own; returns (exit code, stdout, stderr, peak RSS in bytes)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "batchery", *args], cwd=cwd, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read().decode(), err.read().decode(), usage.ru_maxrss * 1024


def start_workers(
    n: int, env: dict, cwd: Path, logdir: Path, timeout: float = 300.0, first: int = 0
) -> list[subprocess.Popen]:
    procs, logs = [], []
    for i in range(first, first + n):
        log = logdir / f"worker{i}.log"
        wenv = dict(env, BATCHERY_HEALTH_PORT=str(free_port()), BATCHERY_WORKER_ID=f"bigjob{i}")
        with open(log, "wb") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "batchery", "worker"],
                    cwd=cwd,
                    env=wenv,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        logs.append(log)
    deadline = time.monotonic() + timeout
    for proc, log in zip(procs, logs):
        while "batchery worker ready" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_workers(procs)
                raise SystemExit(f"a worker did not start; see {log}:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
    return procs


def stop_workers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def check_records(out: Path, prefix: str, n: int) -> tuple[int, int, int]:
    """(records, lost, duplicated) of the output file against the ``n`` input custom_ids; the records must be in
    input order too (raises otherwise)."""
    seen: dict[str, int] = {}
    last = -1
    with open(out) as f:
        for raw in f:
            cid = json.loads(raw)["custom_id"]
            seen[cid] = seen.get(cid, 0) + 1
            i = int(cid.rsplit("-", 1)[1])
            if i < last:
                raise SystemExit(f"{out}: {cid} comes after {prefix}-{last}: records are not in input order")
            last = i
    lost = sum(1 for i in range(n) if f"{prefix}-{i}" not in seen)
    dup = sum(c - 1 for c in seen.values() if c > 1)
    return sum(seen.values()), lost, dup


class Fault:
    """One fault mid-job (``--fault``), once ``--fault-at`` of the lines are recorded: ``kill-worker`` SIGKILLs a
    worker that does not feed the job, ``kill-holder`` the worker that feeds it (the holder of its feeder lease: the
    last to log that it took the job's submission over; the job must still be fed then), ``redis-restart`` restarts
    Redis (with AOF). A killed worker is replaced by a new one, as an orchestrator would."""

    def __init__(self, args, n: int, red: Redis, workers: list, env: dict, tree: Path, workdir: Path) -> None:
        self.kind, self.at = args.fault, args.fault_at * n * args.jobs
        self.red, self.workers, self.env, self.tree, self.workdir = red, workers, env, tree, workdir
        self.done_at: float | None = None
        self.recovery_s: float | None = None
        self.note = ""
        self._replacement: threading.Thread | None = None

    def check(self, counts: dict) -> None:
        if self.done_at is not None or sum(d for _t, d, _s in counts.values()) < self.at:
            return
        self.done_at = time.monotonic()
        recorded = sum(d for _t, d, _s in counts.values())
        if self.kind == "redis-restart":
            t = time.monotonic()
            self.red.restart()
            self.note = f"Redis restarted at {recorded:,} records ({time.monotonic() - t:.1f} s down)"
            return
        feeding = [i for i, _ in enumerate(self.workers) if "took over its submission" in self._log(i)]
        if self.kind == "kill-holder":
            if not feeding or all(s != "validating" for _t, _d, s in counts.values()):
                self.note = "no feeder to kill: the job was fed already"
                return
            victim = feeding[-1]
        else:
            others = [i for i, p in enumerate(self.workers) if i not in feeding and p.poll() is None]
            victim = others[0] if others else 0
        self.workers[victim].send_signal(signal.SIGKILL)
        self.workers[victim].wait(10)
        self.note = f"worker{victim} SIGKILLed at {recorded:,} records" + (
            " (it held the feeder lease)" if victim in feeding else ""
        )
        first = len(self.workers)

        def replace() -> None:
            self.workers.extend(start_workers(1, self.env, self.tree, self.workdir, first=first))

        self._replacement = threading.Thread(target=replace, daemon=True)
        self._replacement.start()

    def _log(self, i: int) -> str:
        try:
            return (self.workdir / f"worker{i}.log").read_text(errors="replace")
        except OSError:
            return ""

    def join(self) -> None:
        if self._replacement is not None:
            self._replacement.join(300)

    def report(self, t0: float, outcomes: dict) -> str:
        if self.done_at is None:
            return f"{self.kind}: never triggered"
        end = max(o["done_s"] for o in outcomes.values() if isinstance(o, dict) and "done_s" in o)
        self.recovery_s = t0 + end - self.done_at
        return f"{self.note}, {self.done_at - t0:.1f} s in; the last output file {self.recovery_s:.1f} s later"


class Serve:
    """``batchery serve`` from ``tree`` on a free port, in a process of its own, with an API key, the benchmark's
    Redis, queue and store, and an upload limit above the file's size (OpenAI's 200 MB is the default)."""

    def __init__(self, env: dict, tree: Path, workdir: Path) -> None:
        self.port, self.key = free_port(), "bigjob-" + os.urandom(6).hex()
        self.env = dict(
            env,
            BATCHERY_API__KEYS=self.key,
            BATCHERY_API__STORAGE_DIR=str(workdir / "files"),
            BATCHERY_API__MAX_FILE_BYTES=str(4 << 30),
        )
        self.tree, self.log = tree, workdir / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> None:
        import openai

        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "batchery", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=self.tree,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client().batches.list(limit=1)
                return
            except openai.APIConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"batchery serve did not start; see {self.log}") from None
                time.sleep(0.2)

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.key, max_retries=2, timeout=3600)

    def peak_rss(self) -> int:
        """The server's peak resident set (``VmHWM``), in bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def run_jobs(args, n: int, model: Path, workdir: Path, tree: Path) -> dict:
    red = Redis(workdir, args.maxmemory, aof=args.fault == "redis-restart")
    queue = f"bigjob-{os.getpid()}"
    store = workdir / "store"
    store.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        BATCHERY_BROKER_URL=red.url,
        BATCHERY_RESULT_BACKEND=red.url,
        BATCHERY_QUEUE=queue,
        BATCHERY_MODEL=str(model),
        BATCHERY_DTYPE="float32",
        BATCHERY_STORAGE_URL=str(store),
        BATCHERY_HEALTH_HOST="127.0.0.1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    if args.fault and not args.default_visibility:  # chaos.py's deadlines, short enough for the visibility timeout
        env.update(
            BATCHERY_TASK_TIMEOUT="20",
            BATCHERY_MAX_TASK_TIMEOUT="20",
            BATCHERY_RETRY_BACKOFF_MAX="1",
            BATCHERY_VISIBILITY_TIMEOUT="22",
        )  # as benchmarks/chaos.py's workers; the default (2 x BATCHERY_MAX_TASK_TIMEOUT + 60 s) is two hours, and a
        # killed worker's messages come back by the orphan sweep (BATCHERY_ORPHAN_GRACE) then: --default-visibility
    env.pop("BATCHERY_BATCH__MAX_LINES", None)
    env["BATCHERY_BATCH__MAX_LINES"] = str(max(n, 100_000))  # the old tree's default is 100,000
    inputs = []
    for j in range(args.jobs):
        path = workdir / f"input-{n}-{j}.jsonl"
        size = write_input(path, n, prefix=f"j{j}", seed=j)
        inputs.append((path, size, f"j{j}"))
    workers = [] if args.no_workers else start_workers(args.workers, env, tree, workdir)
    serve: Serve | None = None
    sampler = Sampler(red, "batchery:batch")
    sampler.start()
    result: dict = {"lines": n, "jobs": args.jobs, "file_mb": inputs[0][1] / 1e6, "baseline": red.baseline}
    try:
        t0 = time.monotonic()
        job_ids, rss = [], {}
        threads, outcomes = [], {}

        def one(path: Path, prefix: str) -> None:
            if serve is not None:
                via_serve(serve, path, prefix)
                return
            rc, out, err, mem = run_cli(["batch", "submit", str(path), "--json"], env, tree)
            if rc != 0:
                outcomes[prefix] = f"submit exited {rc}: {err[-2000:]}"
                return
            job = json.loads(out)["id"]
            job_ids.append(job)
            sampler.jobs.append(job)
            rss[f"submit {prefix}"] = mem
            outcomes[prefix] = {"submitted_s": time.monotonic() - t0, "job": job}
            if args.no_workers:
                return
            rc, out, err, mem = run_cli(["batch", "wait", job, "--no-progress", "--json"], env, tree)
            rss[f"wait {prefix}"] = mem
            if rc != 0:
                outcomes[prefix] = f"wait exited {rc}: {err[-2000:]} {out[-2000:]}"
                return
            dest = workdir / f"out-{prefix}.jsonl"
            rc, out, err, mem = run_cli(["batch", "results", job, "-o", str(dest), "--json"], env, tree)
            rss[f"results {prefix}"] = mem
            if rc != 0:
                outcomes[prefix] = f"results exited {rc}: {err[-2000:]}"
                return
            outcomes[prefix].update(done_s=time.monotonic() - t0, out=dest)

        def via_serve(srv: Serve, path: Path, prefix: str) -> None:
            """What an OpenAI SDK user does: upload, create the batch, poll it, download the output file."""
            client = srv.client()
            with open(path, "rb") as f:  # httpx streams the file object
                up = client.files.create(file=(path.name, f), purpose="batch")
            batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
            sampler.jobs.append(batch.id)
            outcomes[prefix] = {"submitted_s": time.monotonic() - t0, "job": batch.id}
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(1.0)
                batch = client.batches.retrieve(batch.id)
            if batch.status != "completed" or not batch.output_file_id:
                outcomes[prefix] = f"batch ended {batch.status}: {batch.errors}"
                return
            dest = workdir / f"out-{prefix}.jsonl"
            with client.files.with_streaming_response.content(batch.output_file_id) as resp, open(dest, "wb") as f:
                for piece in resp.iter_bytes(1 << 20):
                    f.write(piece)
            outcomes[prefix].update(done_s=time.monotonic() - t0, out=dest)

        serve = Serve(env, tree, workdir) if args.via_serve else None
        if serve is not None:
            serve.start()
            t0 = time.monotonic()  # from the first upload, as the CLI's clock starts at its first submit
        for path, _, prefix in inputs:
            t = threading.Thread(target=one, args=(path, prefix))
            t.start()
            threads.append(t)
        last_curve = 0.0
        fault = Fault(args, n, red, workers, env, tree, workdir) if args.fault else None
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if fault is not None and sampler.samples:
                fault.check(sampler.samples[-1][2])
            if args.curve and sampler.samples and time.monotonic() - last_curve >= args.curve:
                last_curve = time.monotonic()
                at, used, counts = sampler.samples[-1]
                print(
                    f"  t={at:7.1f} s  redis +{(used - red.baseline) / 1e6:6.1f} MB  "
                    + "  ".join(f"{j[-6:]}: {d}/{t} {s}" for j, (t, d, s) in counts.items()),
                    flush=True,
                )
        wall = time.monotonic() - t0
        sampler.stop()
        if serve is not None:
            rss["serve (VmHWM)"] = serve.peak_rss()
        for prefix, o in outcomes.items():
            if isinstance(o, str):
                raise SystemExit(f"job {prefix}: {o}")
        result.update(wall=wall, peak_above=sampler.peak - red.baseline, rss=rss, outcomes=outcomes)
        if fault is not None:
            fault.join()
            result["fault"] = fault.report(t0, outcomes)
            result["fault_recovery_s"] = fault.recovery_s
        if not args.no_workers:
            checks = {}
            for _path, _, prefix in inputs:
                checks[prefix] = check_records(outcomes[prefix]["out"], prefix, n)
            result["checks"] = checks
            result["lines_per_s"] = n * args.jobs / max(o["done_s"] for o in outcomes.values())
        else:
            result["lines_per_s_submit"] = n * args.jobs / max(o["submitted_s"] for o in outcomes.values())
            result["used_after_submit"] = red.used() - red.baseline
    finally:
        sampler.stop()
        if serve is not None:
            serve.stop()
        stop_workers(workers)
        red.stop()
    return result


def offline(n: int, model: Path, workdir: Path, tree: Path) -> float:
    """Lines/s of the same lines through ``LLM.chat``, in a process of its own (the model loaded before timing)."""
    path = workdir / f"offline-{n}.jsonl"
    write_input(path, n, prefix="off")
    code = f"""
import json, time
from batchery.engine.llm import LLM
from batchery.engine.sampling import SamplingParams
convs = [json.loads(l)["body"]["messages"] for l in open({str(path)!r})]
llm = LLM(model={str(model)!r}, dtype="float32")
llm.chat(convs[:64], SamplingParams(max_tokens=1))
t = time.perf_counter()
outs = llm.chat(convs, SamplingParams(max_tokens=1))
print(json.dumps({{"s": time.perf_counter() - t, "n": len(outs)}}))
"""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return doc["n"] / doc["s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", default="20000", help="lines per job, comma-separated for several runs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1, help="jobs submitted at once (each its own file)")
    ap.add_argument("--maxmemory", default=None, help="Redis maxmemory, e.g. 64mb (default: none)")
    ap.add_argument("--no-workers", action="store_true", help="submit only: the submit's footprint")
    ap.add_argument("--offline", action="store_true", help="also time the same lines through LLM.chat")
    ap.add_argument("--curve", type=float, default=0.0, metavar="S", help="print progress every S seconds")
    ap.add_argument("--tree", default=str(REPO), help="run the CLI and the workers from this checkout")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument(
        "--fault", choices=("kill-worker", "kill-holder", "redis-restart"), help="one fault mid-job (see Fault)"
    )
    ap.add_argument("--json", action="store_true", help="also print each size's figures as a JSON line")
    ap.add_argument(
        "--via-serve",
        action="store_true",
        help="run the jobs through `batchery serve` with the openai SDK (upload, create, poll, download) instead of "
        "the CLI; prints the server's peak RSS",
    )
    ap.add_argument(
        "--default-visibility",
        action="store_true",
        help="with --fault: keep the workers' default deadlines and visibility timeout (two hours), so a killed "
        "worker's messages come back only by the orphan sweep",
    )
    ap.add_argument("--fault-at", type=float, default=0.3, metavar="F", help="when F of the lines are recorded")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    workdir = Path(tempfile.mkdtemp(prefix="bigjob-"))
    try:
        # in a process of its own: torch loaded here would count in every CLI child's peak RSS (fork copies it)
        model = workdir / "tiny"
        subprocess.run(
            [sys.executable, "-c", f"from tiny_model import build_tiny_model; build_tiny_model({str(model)!r})"],
            cwd=REPO / "tests",
            check=True,
            capture_output=True,
        )
        print(f"tree {tree}; work dir {workdir}; CPU {cpu_name()}", flush=True)
        for n in (int(x) for x in args.lines.split(",")):
            r = run_jobs(args, n, model, workdir, tree)
            print(f"\n== {n:,} lines x {args.jobs} job(s), {r['file_mb']:.1f} MB a file, {args.workers} workers")
            print(f"redis: baseline {r['baseline'] / 1e6:.1f} MB, peak +{r['peak_above'] / 1e6:.1f} MB above it")
            if args.no_workers:
                used = r["used_after_submit"]
                print(
                    f"after the submit (no worker): +{used / 1e6:.1f} MB ({used / n / args.jobs:.0f} bytes a line); "
                    f"{r['lines_per_s_submit']:.0f} lines/s submitted"
                )
            else:
                print(f"end to end: {r['wall']:.1f} s, {r['lines_per_s']:.0f} lines/s (submit to last output file)")
                for prefix, (num, lost, dup) in r["checks"].items():
                    print(f"job {prefix}: {num} records, lost {lost}, duplicated {dup}, in input order")
            if "fault" in r:
                print(f"fault: {r['fault']}")
            print("peak RSS: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in r["rss"].items()))
            if args.json:
                keep = ("lines", "jobs", "wall", "peak_above", "checks", "fault", "fault_recovery_s", "lines_per_s")
                print("JSON " + json.dumps({k: r[k] for k in keep if k in r}), flush=True)
            if args.offline:
                rate = offline(n, model, workdir, tree)
                print(f"offline engine (LLM.chat): {rate:.0f} lines/s", end="")
                print(f"; the product runs at {r['lines_per_s'] / rate:.2f}x it" if not args.no_workers else "")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        flags = open("/proc/cpuinfo").read()
        return name + "".join(f", {f}" for f in ("avx512_bf16", "amx_bf16") if f in flags)
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
