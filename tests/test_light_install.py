"""The light install: ``pip install batchery`` in a fresh virtual environment, without the worker extra.

That environment has no torch, transformers or triton, yet its ``Client`` runs a chat request and a
small batch job against a worker of the full install (the shared tiny worker), its ``batchery batch``
CLI submits and follows a job, and the commands that need the worker install say which one to use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, TEST_BROKER_URL, TEST_RESULT_BACKEND

pytestmark = pytest.mark.integration

HEAVY = ("torch", "transformers", "triton")


@pytest.fixture(scope="module")
def light_python(tmp_path_factory) -> str:
    venv = tmp_path_factory.mktemp("light-install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    r = subprocess.run(
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(REPO)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return py


def light_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def run(py: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([py, *args], capture_output=True, text=True, timeout=timeout, cwd="/", env=env or light_env())


def test_light_install_has_no_heavy_packages(light_python):
    code = f"import importlib.util; print([m for m in {HEAVY!r} if importlib.util.find_spec(m)])"
    r = run(light_python, "-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_light_client_runs_chat_and_batch_against_a_full_worker(light_python, tiny_worker):
    script = textwrap.dedent(f"""
        import json, sys
        from batchery import Client
        c = Client(broker_url={TEST_BROKER_URL!r}, result_backend={TEST_RESULT_BACKEND!r}, queue={tiny_worker.queue!r})
        r = c.chat([{{"role": "user", "content": "hello world"}}], max_tokens=4, temperature=0, timeout=30)
        chat = r.get(timeout=120)
        lines = [{{"custom_id": f"q{{i}}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {{"messages": [{{"role": "user", "content": f"the cat {{i}}"}}], "max_tokens": 3}}}}
                 for i in range(5)]
        job = c.submit_batch(lines, timeout=60)
        st = c.wait_batch(job, timeout=120)
        out = list(c.batch_results(job))
        c.jobs.delete(job)
        print(json.dumps({{"chat": chat.choices[0].finish_reason, "tokens": chat.usage.completion_tokens,
                          "status": st.status, "completed": st.request_counts.completed,
                          "ids": [o["custom_id"] for o in out],
                          "codes": [o["response"]["status_code"] for o in out],
                          "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
    """)
    r = run(light_python, "-c", script)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["chat"] in ("stop", "length") and 1 <= got["tokens"] <= 4
    assert got["status"] == "completed" and got["completed"] == 5
    assert got["ids"] == [f"q{i}" for i in range(5)] and got["codes"] == [200] * 5
    assert got["heavy"] == []


def test_light_batch_cli_submits_and_waits(light_python, tiny_worker, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": "once upon a time", "max_tokens": 2},
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    env = light_env(
        BATCHERY_BROKER_URL=TEST_BROKER_URL,
        BATCHERY_RESULT_BACKEND=TEST_RESULT_BACKEND,
        BATCHERY_QUEUE=tiny_worker.queue,
    )
    batchery = os.path.join(os.path.dirname(light_python), "batchery")
    sub = run(batchery, "batch", "submit", str(src), env=env)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.strip().splitlines()[-1]
    wait = run(batchery, "batch", "wait", job, "--timeout", "120", env=env)
    assert wait.returncode == 0, wait.stdout + wait.stderr
    out = tmp_path / "out.jsonl"
    res = run(batchery, "batch", "results", job, "-o", str(out), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["c0", "c1", "c2"]


def test_worker_commands_name_the_worker_install(light_python, tmp_path):
    batchery = os.path.join(os.path.dirname(light_python), "batchery")
    w = run(batchery, "worker")
    assert w.returncode == 2 and "pip install 'batchery[worker]'" in w.stderr, w.stdout + w.stderr
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    r = run(batchery, "run", str(src), "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 2 and "pip install 'batchery[worker]'" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out.jsonl").exists()
    llm = run(light_python, "-c", "from batchery import LLM")
    assert llm.returncode != 0 and "pip install 'batchery[worker]'" in llm.stderr, llm.stdout + llm.stderr
