"""benchmarks/gpu_check.py's CPU dry run: every section's code path runs (Triton under the
interpreter, tiny sizes), each in a process of its own; with an off-by-one put into the slot
mapping the new checks fail (the store against ``index_copy_``, the engine against HF sdpa) while
the graph-versus-eager comparison, which reads what the same store wrote, still passes; and a
section whose process dies is reported as a crash of that section only, the next one still running.

Each run starts one Python process per section (about 4 s of imports each), so this is an
integration test; the two runs take about a minute on two cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
ROW = re.compile(r"^  (\w+)\s+(PASS|FAIL|MISS|CRASH|TIMEOUT)\s+[\d.]+s\s+(.*)$", re.M)


def _run(*args: str, timeout: float = 150) -> tuple[int, str, dict[str, tuple[str, str]]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it for its children
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    table = out[out.rfind("gpu_check: ") :]  # the closing table
    rows = {m.group(1): (m.group(2), m.group(3)) for m in ROW.finditer(table)}
    return proc.returncode, out, rows


def test_dry_run_passes_every_section():
    rc, out, rows = _run()
    assert rc == 0, out
    assert set(rows) == {"kernels", "bigpool", "logits", "throughput", "decode"}, out
    assert all(status == "PASS" for status, _ in rows.values()), out
    for line in (
        "store_kvcache float32",  # against index_copy_
        "splits=1:",  # the non-split decode path
        "splits=3:",  # the split path and its reduction, forced (the CPU picks one split)
        "at blocks >= 52",  # the highest blocks of the pool
        "float32 graphs=on vs HF sdpa",
        "float32 graphs=off vs HF sdpa",
        "steps through the decode graphs",
        "HF static",
        "graphs off: decode step",
    ):
        assert line in out, f"{line!r} missing from the dry run:\n{out}"
    assert "FAIL" not in out.split("gpu_check: ")[-1], out


def test_slot_bug_fails_the_new_checks_and_a_crash_fails_only_its_section():
    rc, out, rows = _run("--inject-slot-bug", "--inject-crash", "bigpool", "--sections", "kernels,bigpool,logits")
    assert rc == 1, out
    assert "slot bug injected" in out
    status, detail = rows["kernels"]
    assert status == "FAIL" and "store_kvcache" in detail, out
    assert re.search(r"ok   decode float32 .* splits=1:", out), "the kernels that do not store still pass:\n" + out
    status, detail = rows["bigpool"]
    assert status == "CRASH" and "signal" in detail, out
    status, detail = rows["logits"]  # the section after the crash ran, in a process of its own
    assert status == "FAIL" and "vs HF sdpa" in detail, out
    # what the old check compared: graphs against eager steps, both reading the same wrong slots
    assert re.search(r"ok   float32 graphs on vs off", out), out
