"""A batch job's progress for humans: a live bar on a terminal, a plain line now and then elsewhere.

    [##########----------]  120/200 done  3 failed  45.2 tok/s  ETA 0:00:32  in_progress

Rates are over a sliding window of the last ``window`` seconds, so the ETA follows the current
speed rather than the average since the start (which includes loading the model)."""

from __future__ import annotations

import time
from collections import deque

from batchery.contract.schemas import BatchJob


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "--:--"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """Feed it ``BatchJob`` states with ``update``; ``close`` ends the bar's line."""

    def __init__(self, stream, *, width: int = 24, window: float = 20.0, plain_every: float = 10.0) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.width = width
        self.window = window
        self.plain_every = plain_every
        self._samples: deque[tuple[float, int, int]] = deque()  # (monotonic, done, completion tokens)
        self._last_plain = 0.0
        self._drawn = False
        self._last_line = ""

    def rates(self) -> tuple[float, float]:
        """(lines per second, completion tokens per second) over the window."""
        if len(self._samples) < 2:
            return 0.0, 0.0
        t0, d0, k0 = self._samples[0]
        t1, d1, k1 = self._samples[-1]
        dt = t1 - t0
        return ((d1 - d0) / dt, (k1 - k0) / dt) if dt > 0 else (0.0, 0.0)

    def render(self, job: BatchJob) -> str:
        rc = job.request_counts
        done, total = job.num_done, rc.total
        frac = done / total if total else 0.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        lines_s, tok_s = self.rates()
        eta = None
        if job.status == "in_progress" and lines_s > 0:
            eta = (total - done) / lines_s
        elif job.is_terminal:
            eta = 0.0
        total_s = f"{total}" if job.status != "validating" else f"{total}+"
        return (
            f"[{bar}] {done:>{len(str(total))}}/{total_s} done  {rc.failed} failed  {tok_s:6.1f} tok/s  "
            f"ETA {fmt_duration(eta)}  {job.status}"
        )

    def update(self, job: BatchJob) -> None:
        now = time.monotonic()
        self._samples.append((now, job.num_done, job.usage.completion_tokens))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window:
            self._samples.popleft()
        line = self.render(job)
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif job.is_terminal or now - self._last_plain >= self.plain_every:
            if line != self._last_line:
                self.stream.write(line + "\n")
                self.stream.flush()
            self._last_plain = now
        self._last_line = line

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
