"""The CPU kernels' build lock: a builder killed mid-build (a worker stopped during start-up) blocks no later build.

cpp_extension's own lock is a plain file that such a builder leaves behind, and every later build then waited for
it forever (seen in a clean-clone CI: every worker after the first hung at "building the CPU kernels"). Builds now
hold an ``flock`` the kernel releases with its holder, and the holder clears the stale file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from conftest import REPO

from batchery.engine import cpu_kernels

_HOLDER = """
import sys, time
from pathlib import Path
from batchery.engine import cpu_kernels
marker, build_dir = Path(sys.argv[1]), Path(sys.argv[2])
with cpu_kernels._build_lock(marker):
    (build_dir / "lock").touch()  # what cpp_extension writes when it starts a build
    print("building", flush=True)
    time.sleep(600)
"""


def _acquired_within(marker: Path, seconds: float) -> bool:
    got = threading.Event()

    def take() -> None:
        with cpu_kernels._build_lock(marker):
            got.set()

    threading.Thread(target=take, daemon=True).start()
    return got.wait(seconds)


def test_a_builder_killed_mid_build_leaves_nothing_that_blocks_the_next(tmp_path):
    marker, build_dir = tmp_path / "notes" / "k.json", tmp_path / "torch-build"
    build_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(marker), str(build_dir)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "building"
        assert not _acquired_within(marker, 0.5), "a live builder's lock was taken"
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert (build_dir / "lock").exists()  # left behind, as a killed cpp_extension build leaves it
        assert _acquired_within(marker, 5.0), "the lock of a killed builder was not released"
        with cpu_kernels._build_lock(marker):
            assert cpu_kernels.clear_stale_baton(build_dir)
        assert not (build_dir / "lock").exists()
        assert not cpu_kernels.clear_stale_baton(build_dir)  # nothing left to clear
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_the_build_goes_on_unlocked_where_the_cache_cannot_be_written(tmp_path):
    ro = tmp_path / "file-not-dir"
    ro.write_text("")
    with cpu_kernels._build_lock(ro / "notes" / "k.json"):  # mkdir fails under a file: no lock, no error
        pass
