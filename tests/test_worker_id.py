"""``timing.worker``: one opaque id per worker process, however many task threads ask for it at once."""

from __future__ import annotations

import os
import threading

from batchery.tasks import chat


def test_threads_asking_at_once_get_one_id():
    chat._worker_id = None  # as in a fresh worker: the first lines' threads race to make it
    got: list[str] = []
    barrier = threading.Barrier(32)

    def ask() -> None:
        barrier.wait()
        got.append(chat.worker_id())

    threads = [threading.Thread(target=ask) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 32 and len(set(got)) == 1, set(got)
    assert len(got[0]) == 12 and int(got[0], 16) >= 0  # 12 hex digits, not the host name
    assert chat.worker_id() == got[0]


def test_another_process_gets_its_own_id():
    chat._worker_id = (os.getpid() + 1, "0123456789ab")  # made by another process (a fork's parent)
    assert chat.worker_id() != "0123456789ab"
