"""Progress of a SuperBatch run: a line in terminals, an updating bar in notebooks."""

from __future__ import annotations

import html
import sys
import time

__all__ = ["Progress", "in_notebook"]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where an HTML display can be updated in place)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class Progress:
    """Rows and SuperBatches done of planned, texts/s and ETA, at most once a second.

    In a terminal it prints one line (rewritten in place on a TTY); in a Jupyter
    notebook it shows an HTML progress bar updated in place (no widget library
    needed). ``enabled=False`` shows nothing.

    Examples
    --------
    >>> import io
    >>> buf = io.StringIO()
    >>> p = Progress(2, 100, stream=buf, notebook=False)
    >>> p.update(60); p.update(40)
    >>> buf.getvalue().splitlines()[-1].startswith("[dask-surge] 2/2 SuperBatches, 100/100 rows")
    True
    """

    def __init__(self, total_sbs: int | None, total_rows: int | None, *, enabled: bool = True, stream=None,
                 done_sbs: int = 0, done_rows: int = 0, notebook: bool | None = None) -> None:
        self.total_sbs, self.total_rows = total_sbs, total_rows
        self.sbs, self.rows = done_sbs, done_rows
        self._start_rows = done_rows
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self._last = 0.0
        self._tty = getattr(self.stream, "isatty", lambda: False)()
        self.notebook = in_notebook() if notebook is None else notebook
        self._handle = None

    def _numbers(self) -> tuple[float, str]:
        elapsed = time.perf_counter() - self.start
        rate = (self.rows - self._start_rows) / elapsed if elapsed > 0 else 0.0
        if self.total_rows is None:  # streaming: the total is learnt as partitions are computed
            return rate, "?"
        left = self.total_rows - self.rows
        return rate, (_duration(left / rate) if rate > 0 else "?")

    def line(self) -> str:
        rate, eta = self._numbers()
        of_sbs = f"/{self.total_sbs:,}" if self.total_sbs is not None else ""
        of_rows = f"/{self.total_rows:,}" if self.total_rows is not None else ""
        return (f"[dask-surge] {self.sbs:,}{of_sbs} SuperBatches, "
                f"{self.rows:,}{of_rows} rows, {rate:,.0f} texts/s, ETA {eta}")

    def html(self) -> str:
        """The notebook view: a ``<progress>`` bar over rows, and the same numbers as :meth:`line`."""
        text = html.escape(self.line().removeprefix("[dask-surge] "))
        return (f'<div><b>dask-surge</b> <progress value="{self.rows}" max="{max(1, self.total_rows or self.rows)}" '
                f'style="width: 40%"></progress> {text}</div>')

    def update(self, rows: int, sbs: int = 1) -> None:
        self.rows += rows
        self.sbs += sbs
        now = time.perf_counter()
        if self.enabled and (now - self._last >= 1.0 or self.sbs == self.total_sbs):
            self._last = now
            if self.notebook:
                self._show_html()
            else:
                end = "\r" if self._tty and (self.total_sbs is None or self.sbs < self.total_sbs) else "\n"
                print(self.line(), end=end, file=self.stream, flush=True)

    def _show_html(self) -> None:
        from IPython.display import HTML, display

        if self._handle is None:
            self._handle = display(HTML(self.html()), display_id=True)
        else:
            self._handle.update(HTML(self.html()))
