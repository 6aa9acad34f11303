"""Progress of a SuperBatch run, from its first second: a ``tqdm.auto`` bar over rows.

The bar opens when the run starts and names its phase: ``planning`` (reading sizes,
opening or resuming the run), ``waiting for workers`` (a cluster with none yet),
``loading model`` (per worker: the plugin loads it in the background), ``encoding``.
Rows are the unit; the bar moves as each SuperBatch commits (see
:mod:`dask_surge.execution.events`), its total is shown only once known (a streamed
input learns it at the end), and a resumed run starts at the rows already committed.

``tqdm.auto`` is a terminal line (width, rate and ETA handled by tqdm) or a notebook
widget; ``TQDM_DISABLE=1`` or ``progress=False`` shows nothing, and the other
``TQDM_*`` variables of :data:`ENV_OPTIONS` (``TQDM_MININTERVAL``...) apply, read when the bar opens. While the bar is open, the
package's log messages go through ``tqdm.write`` so they never break the bar
(:func:`logging_through`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["RunProgress", "logging_through", "quiet_dask_shutdown", "tqdm_class", "TICK_S", "ENV_OPTIONS"]

#: the terminal bar once its total is known (tqdm's default, with the unit after the total)
KNOWN_TOTAL = "{l_bar}{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

#: the same in a terminal narrower than :data:`NARROW_COLUMNS` (80 columns): no rate, no SuperBatch count,
#: and short phase names, so the bar keeps a dozen characters and the line its end
NARROW_TOTAL = "{l_bar}{bar}| {n_fmt}/{total_fmt} rows [{elapsed}<{remaining}]"

#: terminals narrower than this get :data:`NARROW_TOTAL`
NARROW_COLUMNS = 100

#: seconds between two refreshes of an open bar (and two questions about the model)
TICK_S = 0.5


def tqdm_class() -> Any:
    """``tqdm.auto.tqdm``: the notebook widget in Jupyter, else the terminal bar.

    Imported when the first bar opens (``import dask_surge`` stays light), without
    tqdm's warning when a notebook lacks ``ipywidgets`` (it then falls back to the
    terminal bar, which Jupyter shows as text).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*IProgress not found.*")
        from tqdm.auto import tqdm

    return tqdm


#: the ``TQDM_*`` variables read when a bar opens, and their types (tqdm itself reads them
#: once, when it is imported: one set later, in a notebook or a test, would be missed)
ENV_OPTIONS: dict[str, Callable[[str], Any]] = {
    "disable": lambda v: v.strip().lower() not in ("", "0", "false", "no", "off"),
    "mininterval": float,
    "maxinterval": float,
    "miniters": float,
    "smoothing": float,
    "ncols": int,
    "colour": str,
    "ascii": lambda v: {"true": True, "false": False}.get(v.strip().lower(), v),
}


def _env_options() -> dict[str, Any]:
    """The bar's options that ``TQDM_<NAME>`` environment variables set now (bad values are ignored)."""
    found = {}
    for name, kind in ENV_OPTIONS.items():
        value = os.environ.get(f"TQDM_{name.upper()}")
        if value is not None:
            with contextlib.suppress(ValueError):
                found[name] = kind(value)
    return found


class RunProgress:
    """The progress bar of one run (see the module docstring).

    Thread-safe: commits are heard on the client's event loop (distributed), in task
    threads (``"threads"``) and in the run loop, and a ticker thread refreshes the bar
    and follows the model's loading.

    Parameters
    ----------
    enabled : bool
        False shows nothing (``TQDM_DISABLE=1`` too).
    file : file-like, optional
        Where a terminal bar goes (default: standard error).

    Examples
    --------
    >>> import io
    >>> buf = io.StringIO()
    >>> with RunProgress(file=buf) as bar:
    ...     bar.planned(rows=10, superbatches=2, done_rows=4, done_superbatches=1)
    ...     bar.phase("encoding")
    ...     bar.commit("1-0", 6)
    ...     bar.commit("1-0", 6)  # heard twice (event, then the unit's report): counted once
    >>> buf.getvalue().replace("\\r", "\\n").splitlines()[-1]  # doctest: +ELLIPSIS
    'dask-surge [encoding]: 100%|...| 10/10 rows [...<00:00, ... rows/s, 2/2 SuperBatches]'

    """

    def __init__(self, *, enabled: bool = True, file=None, phase: str = "planning") -> None:
        self._lock = threading.RLock()
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the ticker's next tick is now
        self._ticker: threading.Thread | None = None
        self._ready: Callable[[], tuple[int, int]] | None = None
        self._workers = False
        self._model: tuple[int, int] | None = None  # the last answer of ``ready``
        self._committed = False  # a SuperBatch committed in this run
        self.superbatches = 0
        self.total_superbatches: int | None = None
        self.phase_name = phase
        env = _env_options()
        self.narrow = _columns(file, env.get("ncols")) < NARROW_COLUMNS
        self._format = NARROW_TOTAL if self.narrow else KNOWN_TOTAL
        options: dict[str, Any] = {
            "total": None,
            "unit": " rows",
            "desc": self._desc(),
            "file": file,
            "dynamic_ncols": True,
            "smoothing": 0.1,
            **env,
        }
        if not enabled:
            options["disable"] = True
        self.bar = tqdm_class()(**options)
        self._quiet = quiet_dask_shutdown()
        self._quiet.__enter__()  # for the run's whole life, its cluster's start and close included
        self._postfix()
        if not self.disabled:
            self._ticker = threading.Thread(target=self._tick, name="surge-progress", daemon=True)
            self._ticker.start()

    @property
    def disabled(self) -> bool:
        return bool(getattr(self.bar, "disable", False))

    @property
    def rows(self) -> int:
        return int(self.bar.n)

    def _desc(self) -> str:
        name = self.phase_name
        if self.narrow:  # "encoding, model on 1/2 workers" -> "encoding"; "loading model 1/2 workers" -> "loading model 1/2"
            name = re.sub(r" (\d+/\d+) workers$", r" \1", name.split(",")[0])
        return f"dask-surge [{name}]"

    def _postfix(self) -> None:
        if self.narrow and self.bar.total is not None:  # the narrow line has no room for the count
            self.bar.set_postfix_str("", refresh=False)
            return
        of = f"/{self.total_superbatches:,}" if self.total_superbatches is not None else ""
        self.bar.set_postfix_str(f"{self.superbatches:,}{of} SuperBatches", refresh=False)

    def phase(self, name: str) -> None:
        """Show the phase ``name`` (``planning``, ``loading model``, ``encoding``...)."""
        with self._lock:
            if name != self.phase_name:
                self.phase_name = name
                self.bar.set_description_str(self._desc(), refresh=True)

    def planned(
        self, *, rows: int | None, superbatches: int | None, done_rows: int = 0, done_superbatches: int = 0
    ) -> None:
        """What the run will do (totals: None when unknown) and what is already committed."""
        with self._lock:
            bar = self.bar
            self.total_superbatches, self.superbatches = superbatches, done_superbatches
            if rows is not None and rows != bar.total:
                started = getattr(bar, "start_t", None)
                bar.bar_format = self._format
                bar.reset(total=rows)  # (the notebook widget learns its new maximum here)
                if started is not None:  # elapsed time counts from the run's start, planning included
                    bar.start_t = started
            bar.n = bar.last_print_n = bar.initial = done_rows  # a resumed run's rate counts its own rows
            self._postfix()
            bar.refresh()

    def commit(self, sb: str, rows: int) -> None:
        """SuperBatch ``sb`` committed ``rows`` rows (written + skipped nulls); counted once per key."""
        with self._lock:
            if sb in self._seen:
                return
            self._seen.add(sb)
            self.superbatches += 1
            self._committed = True
            self.phase(self._model_phase())
            self._postfix()
            self.bar.update(rows)

    def follow_model(self, ready: Callable[[], tuple[int, int]], *, workers: bool) -> None:
        """Show ``loading model`` until ``ready()`` says every worker has it, then ``encoding``.

        ``ready`` returns ``(workers ready, workers)``. The ticker thread asks it at once and
        then every :data:`TICK_S`, never the caller's thread: on a cluster the question is a
        round trip to every worker, which the run's first tasks must not wait for. A disabled bar asks nothing. With ``workers=False`` (one
        process) the count is not shown.
        """
        if self.disabled:
            return
        with self._lock:
            self._workers = workers
            self._ready = ready
        self._wake.set()

    def _check_model(self) -> None:
        ready = self._ready
        if ready is None:
            return
        try:
            done, total = ready()
        except Exception:  # noqa: BLE001 - a question that fails must not stop the run: show "encoding"
            done, total = 1, 1
        with self._lock:
            if total and done >= total:
                self._ready = None
            self._model = (done, total)
            self.phase(self._model_phase())

    def _model_phase(self) -> str:
        """The phase while (or once) the model loads: what :meth:`follow_model` learnt last."""
        if self._ready is None or self._model is None:
            return "encoding"
        done, total = self._model
        if not total:
            return "waiting for workers"
        if self._committed:  # some worker encodes already; the others still load
            return f"encoding, model on {done}/{total} workers" if self._workers else "encoding"
        return f"loading model {done}/{total} workers" if self._workers else "loading model"

    def _tick(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(TICK_S)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._check_model()
            with self._lock:
                if not self._stop.is_set():
                    self.bar.refresh()  # elapsed time moves while nothing commits

    def finish(self, rows: int, superbatches: int) -> None:
        """The run is complete: its totals are now known (a streamed run learns them here)."""
        with self._lock:
            self._ready = None
            self.total_superbatches = superbatches
            if self.bar.total is None or self.bar.total != rows:
                self.bar.total = rows
                self.bar.bar_format = self._format
                container = getattr(self.bar, "container", None)  # the notebook widget's bar
                if container is not None:
                    with contextlib.suppress(Exception):
                        container.children[1].max = rows
            self.superbatches = superbatches
            self.bar.n = rows
            self.phase("done")
            self._postfix()
            self.bar.refresh()

    def close(self, stopped: bool = False) -> None:
        self._stop.set()
        self._wake.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)  # a question to a hung cluster must not hold the run's end
        with self._lock:
            if stopped and self.phase_name != "done":
                self.phase("stopped")
            self.bar.close()
        self._quiet.__exit__(None, None, None)

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(stopped=kind is not None)


#: what Dask logs when a run's cluster closes or its futures are cancelled on purpose: ``(logger
#: prefix, text in the message, exception type name or None)``. A real failure says something else
#: (a worker killed by a signal, a task's error), and the run raises it.
SHUTDOWN_NOISE: tuple[tuple[str, str, str | None], ...] = (
    ("distributed.nanny", "still alive after", None),  # close: a worker busy importing torch is killed
    (
        "distributed",
        "during heartbeat",
        "CommClosedError",
    ),  # a worker's last heartbeat after the scheduler left
    ("distributed", "", "CancelledError"),  # futures of a stopped run, cancelled by its end
    ("distributed", "CancelledError", None),
)


class ShutdownNoise(logging.Filter):
    """Drops the records of :data:`SHUTDOWN_NOISE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        message = record.getMessage()
        for prefix, text, kind in SHUTDOWN_NOISE:
            if record.name.startswith(prefix) and text in message and (kind is None or kind == exc):
                return False
        return True


@contextlib.contextmanager
def quiet_dask_shutdown() -> Iterator[None]:
    """While inside, Dask's expected noise of a closing or interrupted run (:data:`SHUTDOWN_NOISE`)
    is left out of the console: the filter sits on the handlers of the ``distributed`` logger and
    of the root logger (records of distributed's modules propagate there), and on the loggers
    that emit the noise, for as long as the run lasts; everything else is shown as before.

    Examples
    --------
    >>> import io, logging
    >>> out = io.StringIO(); handler = logging.StreamHandler(out)
    >>> log = logging.getLogger("distributed.nanny"); log.addHandler(handler)
    >>> with quiet_dask_shutdown():
    ...     log.warning("Worker process still alive after 4.0 seconds, killing")
    ...     log.warning("Worker process 7 was killed by signal 9")
    >>> log.removeHandler(handler); out.getvalue()
    'Worker process 7 was killed by signal 9\\n'
    """
    noise = ShutdownNoise()
    loggers = [
        logging.getLogger(n)
        for n in (
            "distributed",
            "distributed.nanny",
            "distributed.worker",
            "distributed.client",
            "distributed.core",
        )
    ]
    handlers = {h for lg in (*loggers, logging.getLogger()) for h in lg.handlers}
    for target in (*loggers, *handlers):
        target.addFilter(noise)
    try:
        yield
    finally:
        for target in (*loggers, *handlers):
            target.removeFilter(noise)


def _columns(file, ncols: int | None) -> int:
    """The width the bar has: ``TQDM_NCOLS``, else the terminal's that ``file`` (default: standard
    error) writes to; 120 when it is not a terminal (a file, a notebook, a test's buffer)."""
    if ncols:
        return int(ncols)
    stream = sys.stderr if file is None else file
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        pass
    return (
        shutil.get_terminal_size((120, 24)).columns
        if stream in (sys.stderr, sys.__stderr__) and os.environ.get("COLUMNS")
        else 120
    )


class _BarHandler(logging.Handler):
    """A console handler that writes through ``tqdm.write`` (above the bar, not across it)."""

    def __init__(self, write: Callable[..., Any], stream) -> None:
        super().__init__()
        self._write, self.stream = write, stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001  # pragma: no cover - logging's own convention
            self.handleError(record)


def _is_console(handler: logging.Handler) -> bool:
    return (
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and getattr(handler, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    )


@contextlib.contextmanager
def logging_through(progress: RunProgress, name: str = "dask_surge") -> Iterator[None]:
    """While inside, console handlers of logger ``name`` and of the root logger write
    through ``tqdm.write``; with no handler at all, warnings of ``name`` do (as Python's
    last-resort handler would, but above the bar)."""
    if progress.disabled:
        yield
        return
    write = progress.bar.write
    swapped: list[tuple[logging.Logger, logging.Handler, _BarHandler]] = []
    added: _BarHandler | None = None
    package, root = logging.getLogger(name), logging.getLogger()
    for lg in (package, root):
        for old in list(lg.handlers):
            if _is_console(old):
                new = _BarHandler(write, old.stream)  # type: ignore[attr-defined]
                new.setFormatter(old.formatter)
                new.setLevel(old.level)
                new.filters = list(old.filters)
                lg.handlers[lg.handlers.index(old)] = new
                swapped.append((lg, old, new))
    if not package.handlers and not root.handlers:
        added = _BarHandler(write, sys.stderr)
        added.setLevel(logging.WARNING)
        package.addHandler(added)
    try:
        yield
    finally:
        if added is not None:
            package.removeHandler(added)
        for lg, before, mine in swapped:
            if mine in lg.handlers:
                lg.handlers[lg.handlers.index(mine)] = before
