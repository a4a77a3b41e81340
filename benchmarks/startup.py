"""How long does ``batchery worker`` take to become ready? Starts it as a subprocess against a
private ``redis-server`` (a free port, no persistence) and reports the seconds from the spawn to
its ``batchery worker ready`` log line:

- cold: an empty model cache (the converted GGUF, its bf16 copy when the dtype is bf16, and the CPU
  calibration not there yet: the cold start writes them); the GGUF itself is linked (or copied) from
  your model cache, never downloaded again;
- warm: the same cache again, ``--warm`` times;
- with ``--no-convert`` also warm starts with ``BATCHERY_MODEL_CACHE_CONVERT=0`` (the GGUF parsed
  and dequantized at every start, as before the conversion cache);
- with ``--run FILE`` also ``batchery run FILE`` (embedded Redis and worker, as ``make run`` does
  with ``examples/chat.jsonl``) on the warm cache: its wall time, split at the worker's ready line,
  the job's completion and the command's exit.

Each start gets a phase breakdown from the worker's JSON log timestamps (interpreter and imports,
model load, CPU kernel calibration, engine build, Celery start, the warm shutdown), and the CPU
seconds the worker used up to ready (user + system): on a machine busy with other work that is
closer to a quiet machine's wall time than the wall time is. Each start also shows the 1-minute load
average just before it. The compiled CPU kernels live in
torch's extension cache (``~/.cache/torch_extensions``) and are not cleared: "cold" is a new model
cache, not a new machine.

    .venv/bin/python benchmarks/startup.py                 # default model, dtype auto
    .venv/bin/python benchmarks/startup.py --dtype bfloat16 --warm 3 --no-convert
    .venv/bin/python benchmarks/startup.py --model /path/to/model.gguf
    .venv/bin/python benchmarks/startup.py --warm 1 --run examples/chat.jsonl

The worker's other settings come from BATCHERY_* variables as usual (the broker is always the
private Redis)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from batchery.embedded import WORKER_READY_LINE, redis_server_binary  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--maxmemory-policy", "noeviction", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("the private redis-server did not start")


def source_gguf(model: str) -> Path | None:
    """The GGUF to link into the private cache (None: ``model`` is a directory, used in place)."""
    from batchery.contract.names import DEFAULT_MODEL
    from batchery.engine.loader import default_model_path

    if model == DEFAULT_MODEL:
        return default_model_path()  # your model cache; fetched once if it is not there yet
    p = Path(model).expanduser().resolve()
    return p if p.is_file() else None


def private_cache(root: Path, model: str) -> tuple[Path, str]:
    """A new model cache holding only the model's GGUF; returns it and the model to pass the worker."""
    from batchery.contract.names import DEFAULT_MODEL

    gguf = source_gguf(model)
    if gguf is None:
        return root, model
    dest = root / (DEFAULT_MODEL if model == DEFAULT_MODEL else "user") / gguf.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(gguf, dest)
    except OSError:
        shutil.copy2(gguf, dest)
    return root, (model if model == DEFAULT_MODEL else str(dest))


def parse_log(path: Path) -> list[tuple[float, str, str]]:
    """(unix time, logger, message) of each JSON log line."""
    return parse_log_text(path.read_text(errors="replace"))


def parse_log_text(text: str) -> list[tuple[float, str, str]]:
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
            ts = datetime.fromisoformat(rec["ts"]).timestamp()
        except (ValueError, KeyError):
            continue
        out.append((ts, rec.get("logger", ""), rec.get("message", "")))
    return out


def time_run(env: dict[str, str], file: str, work: Path, timeout: float) -> list[tuple[str, float]]:
    """``batchery run FILE`` with the embedded stack: seconds from the spawn to each milestone."""
    import threading

    env = {
        k: v for k, v in env.items() if k not in ("BATCHERY_BROKER_URL", "BATCHERY_RESULT_BACKEND", "BATCHERY_QUEUE")
    }
    env.pop("BATCHERY_HEALTH_PORT", None)
    argv = [sys.executable, "-m", "batchery", "run", file, "-o", str(work / "run-out.jsonl")]
    argv += ["--errors", str(work / "run-errors.jsonl")]
    t_spawn = time.time()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    marks: dict[str, float] = {}
    log_path: list[Path] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            now = time.time()
            if "worker log " in line and not log_path:
                marks.setdefault("embedded Redis up, worker spawned", now)
                log_path.append(Path(line.rsplit("worker log ", 1)[1].strip().rstrip(")")))
            elif "submitted" in line:
                marks.setdefault("file submitted", now)
            elif ": completed " in line or ": failed " in line:
                marks.setdefault("results written (summary printed)", now)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    worker_log = ""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if log_path:
            try:
                worker_log = log_path[0].read_text(errors="replace")
            except OSError:
                pass  # removed at exit
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("batchery run did not finish in time")
        time.sleep(0.02)
    t_exit = time.time()
    reader.join(5)
    if proc.returncode != 0:
        raise SystemExit(f"batchery run exited {proc.returncode}")
    for ts, _, msg in parse_log_text(worker_log):
        if WORKER_READY_LINE in msg:
            marks.setdefault("worker ready", ts)
        elif msg.startswith("worker stopped"):
            marks.setdefault("worker stopped", ts)
    marks["command exited"] = t_exit
    return sorted(((name, ts - t_spawn) for name, ts in marks.items()), key=lambda x: x[1])


def phases(t_spawn: float, records: list[tuple[float, str, str]]) -> list[tuple[str, float]]:
    """Seconds between consecutive milestones of the start-up, from the log."""

    def first(pred) -> float | None:
        return next((ts for ts, lg, msg in records if pred(lg, msg)), None)

    def last(pred) -> float | None:
        found = [ts for ts, lg, msg in records if pred(lg, msg)]
        return found[-1] if found else None

    kernels = "batchery.engine.kernels"
    marks = [
        ("python, imports, settings", first(lambda lg, m: m.startswith("starting worker"))),
        ("Redis check, Celery app, service start", first(lambda lg, m: m.startswith("loading model"))),
        (
            "weights and tokenizer (incl. a conversion)",
            first(lambda lg, m: lg == kernels or m.startswith("loaded model")),
        ),
        ("CPU kernels: build/load and calibration", last(lambda lg, m: lg == kernels)),
        ("engine (KV pool, warm-up), GC freeze, Celery start", first(lambda lg, m: WORKER_READY_LINE in m)),
    ]
    out, prev = [], t_spawn
    for name, ts in marks:
        if ts is None:
            continue
        out.append((name, ts - prev))
        prev = ts
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc): on a busy machine a better
    estimate of a quiet machine's wall time than the wall time itself, for a mostly one-threaded start."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def start_once(env: dict[str, str], log_path: Path, timeout: float) -> tuple[float, list[tuple[str, float]]]:
    cpu = None
    with open(log_path, "wb") as logf:
        t_spawn = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchery", "worker"], cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                text = log_path.read_text(errors="replace")
                if WORKER_READY_LINE in text:
                    cpu = cpu_seconds(proc.pid)
                    break
                if proc.poll() is not None:
                    raise SystemExit(f"the worker exited ({proc.returncode}) before it was ready:\n{text[-3000:]}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"the worker was not ready within {timeout:g} s:\n{text[-3000:]}")
                time.sleep(0.02)
        finally:
            t_term = time.time()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            t_exit = time.time()
    records = parse_log(log_path)
    ready = next(ts for ts, _, msg in records if WORKER_READY_LINE in msg)
    stopped = next((ts for ts, _, msg in records if msg.startswith("worker stopped")), None)
    ph = phases(t_spawn, records)
    if cpu is not None:
        ph.append(("(CPU seconds used by the worker up to ready)", cpu))
    if stopped is not None:  # the warm shutdown that ends each start here, as it ends `batchery run`
        ph += [
            ("shutdown: SIGTERM to 'worker stopped'", stopped - t_term),
            ("shutdown: process exit", t_exit - stopped),
        ]
    return ready - t_spawn, ph


def load_average() -> str:
    """The 1-minute load average (figures taken beside other work are that work's as much as the worker's)."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except (OSError, IndexError):
        return "?"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> int:
    from batchery.contract.names import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("BATCHERY_MODEL", DEFAULT_MODEL))
    ap.add_argument("--dtype", default=os.environ.get("BATCHERY_DTYPE", "auto"))
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--no-convert", action="store_true", help="also time warm starts without the conversion cache")
    ap.add_argument("--run", metavar="FILE", help="also time `batchery run FILE` on the warm cache")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, private cache)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="batchery-startup-"))
    redis, url = start_redis(work)
    try:
        cache, model = private_cache(work / "models", args.model)
        env = {k: v for k, v in os.environ.items() if k != "BATCHERY_MODEL_CACHE_CONVERT"}
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "BATCHERY_BROKER_URL": url,
                "BATCHERY_RESULT_BACKEND": url,
                "BATCHERY_MODEL": model,
                "BATCHERY_DTYPE": args.dtype,
                "BATCHERY_MODEL_CACHE": str(cache),
                "BATCHERY_LOG_FORMAT": "json",
                "BATCHERY_LOG_LEVEL": "INFO",
                "BATCHERY_HEALTH_PORT": "0",
                "BATCHERY_QUEUE": f"startup-bench-{os.getpid()}",
            }
        )
        runs: list[tuple[str, float, list[tuple[str, float]]]] = []
        plan = [("cold", env)] + [(f"warm {i + 1}", env) for i in range(args.warm)]
        if args.no_convert:
            off = {**env, "BATCHERY_MODEL_CACHE_CONVERT": "0"}
            plan += [(f"no conversion cache {i + 1}", off) for i in range(max(1, args.warm))]
        for label, e in plan:
            load = load_average()
            secs, ph = start_once(e, work / f"worker-{len(runs)}.log", args.timeout)
            runs.append((f"{label}, load average {load}", secs, ph))
            print(f"{label:>24}: ready in {secs:6.2f} s (load average {load} before it)", flush=True)
        run_marks = time_run(env, args.run, work, args.timeout) if args.run else []
    finally:
        redis.terminate()
        redis.wait(10)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs and cache kept in {work}")

    import torch

    print(f"\n{cpu_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, model {args.model}")
    print(f"dtype {args.dtype}\n")
    for label, secs, ph in runs:
        print(f"{label} ({secs:.2f} s):")
        for name, dt in ph:
            print(f"  {dt:6.2f} s  {name}")
    if run_marks:
        print(f"\nbatchery run {args.run} (warm cache), seconds from the command's start:")
        for name, at in run_marks:
            print(f"  {at:6.2f} s  {name}")
    warm = [s for label, s, _ in runs if label.startswith("warm")]
    if warm:
        print(f"\nwarm: median {statistics.median(warm):.2f} s, best {min(warm):.2f} s (target < 5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
