"""One namespace: the short public names import from inside a Celery project (whose own ``tasks.py``
must not shadow ours), and the repository's top-level folders are not importable outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CELERY_PROJECT_TASKS = """from celery import Celery

app = Celery("myproject", broker="memory://")


@app.task
def add(x, y):
    return x + y
"""


def python(code: str, cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_public_names_import_inside_a_celery_project(tmp_path):
    (tmp_path / "tasks.py").write_text(CELERY_PROJECT_TASKS)
    r = python(
        "from batchery import LLM, SamplingParams, Client\n"
        "import tasks\n"
        "assert tasks.add.name == 'tasks.add', tasks.add.name  # the project's own tasks.py\n"
        "assert LLM.__module__ == 'batchery.engine.llm' and Client.__module__ == 'batchery.client'\n"
        "assert SamplingParams(max_tokens=3).max_tokens == 3\n"
        "print('ok')",
        str(tmp_path),
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.mark.parametrize("name", ["engine", "worker", "tasks"])
def test_top_level_folders_are_not_installed(tmp_path, name):
    r = python(f"import {name}", str(tmp_path))
    assert r.returncode != 0 and f"ModuleNotFoundError: No module named '{name}'" in r.stderr, r.stdout + r.stderr


def test_import_batchery_loads_nothing_heavy(tmp_path):
    r = python(
        "import sys, batchery\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'celery', 'redis')"
        " or m.startswith('batchery.')))",
        str(tmp_path),
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
