"""A small progress line for SuperBatch runs (terminal and notebooks)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """Prints rows and SuperBatches done of planned, texts/s and ETA, at most once a second."""

    def __init__(self, total_sbs: int, total_rows: int, *, enabled: bool = True, stream=None,
                 done_sbs: int = 0, done_rows: int = 0) -> None:
        self.total_sbs, self.total_rows = total_sbs, total_rows
        self.sbs, self.rows = done_sbs, done_rows
        self._start_rows = done_rows
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self._last = 0.0
        self._tty = getattr(self.stream, "isatty", lambda: False)()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rate = (self.rows - self._start_rows) / elapsed if elapsed > 0 else 0.0
        left = self.total_rows - self.rows
        eta = _duration(left / rate) if rate > 0 else "?"
        return (f"[dask-surge] {self.sbs:,}/{self.total_sbs:,} SuperBatches, "
                f"{self.rows:,}/{self.total_rows:,} rows, {rate:,.0f} texts/s, ETA {eta}")

    def update(self, rows: int, sbs: int = 1) -> None:
        self.rows += rows
        self.sbs += sbs
        now = time.perf_counter()
        if self.enabled and (now - self._last >= 1.0 or self.sbs == self.total_sbs):
            self._last = now
            end = "\r" if self._tty and self.sbs < self.total_sbs else "\n"
            print(self.line(), end=end, file=self.stream, flush=True)
