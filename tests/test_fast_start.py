"""A worker's start-up path (issue 16: a worker with its model cached is ready in seconds).

- ``batchery worker`` goes straight to ``python -m batchery.worker``: the CLI process imports neither
  pydantic nor the settings before its exec (whatever it imported would be imported again after it);
  the flags are parsed by the worker, under the same ``batchery worker`` name.
- ``run_worker`` pauses the cyclic garbage collector while it loads (each full pass over the start's
  600,000 objects cost 0.1 s and more), freezes what the start leaves and collects again afterwards.

The model cache's bf16 copy of converted weights is tested with the cache (tests/test_model_cache.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEADER = "import time: self [us] | cumulative | imported package"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _imports(chunk: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in chunk.splitlines() if line.startswith("import time:")}


def test_batchery_worker_execs_the_worker_before_importing_the_settings():
    # PYTHONPROFILEIMPORTTIME lists each interpreter's imports on stderr, the exec'd one after a new header
    proc = subprocess.run(
        [sys.executable, "-m", "batchery", "worker", "--help"],
        env=_env(PYTHONPROFILEIMPORTTIME="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    chunks = proc.stderr.split(HEADER)
    assert len(chunks) == 3, "expected two interpreters: the CLI, then the worker it execs"
    cli, worker = _imports(chunks[1]), _imports(chunks[2])
    assert "batchery.cli" in cli and "batchery.worker.__main__" not in cli
    assert not {m for m in cli if m.split(".")[0] in ("pydantic", "pydantic_settings")}, "the CLI imported pydantic"
    assert "batchery.contract.settings" not in cli and "urllib.request" not in cli
    assert {"batchery.worker", "batchery.contract.settings"} <= worker
    assert proc.stdout.startswith("usage: batchery worker"), proc.stdout[:200]
    assert "--model" in proc.stdout


def test_batchery_worker_flags_are_still_checked():
    proc = subprocess.run(
        [sys.executable, "-m", "batchery", "worker", "--no-such-flag"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "usage: batchery worker" in proc.stderr and "--no-such-flag" in proc.stderr


RUN_WORKER = r"""
import gc, json, logging, socket, sys
from batchery.contract.settings import Settings
from batchery.worker.main import run_worker

seen = []

class Probe(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith(("loading model", "loaded model")):
            seen.append(gc.isenabled())

logging.getLogger("batchery.engine.loader").addHandler(Probe())
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()  # the health port is taken: run_worker returns after loading, before consuming
port = taken.getsockname()[1]
settings = Settings(model=sys.argv[1], dtype="float32", health_host="127.0.0.1", health_port=port)
rc = run_worker(settings)
print(json.dumps({"rc": rc, "during": seen, "after": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


@pytest.mark.integration
def test_run_worker_pauses_the_gc_while_loading_and_resumes_it(tiny_model_dir, redis_urls):
    broker, backend = redis_urls
    env = _env(
        BATCHERY_BROKER_URL=broker,
        BATCHERY_RESULT_BACKEND=backend,
        BATCHERY_ENGINE__NUM_KV_BLOCKS="64",
        BATCHERY_QUEUE="fast-start-gc",
    )
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WORKER, str(tiny_model_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rc"] == 2, proc.stderr[-3000:]  # EXIT_CONFIG: the health port could not be bound
    assert out["during"] == [False, False], "the GC ran while the model loaded"
    assert out["after"] is True, "the GC stayed off after the start"
    assert out["frozen"] > 100_000, "what the start loaded was not frozen"
