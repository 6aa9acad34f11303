"""Distributed's statistical profiler, paused on a worker while it runs SuperBatch tasks.

A Dask worker samples every thread's stack every 10 ms (``distributed.worker.profile``)
for the dashboard's profile page. Each sample runs on the worker's event loop and holds
the GIL while it walks the stacks (``docs/ab_studies.md``). :func:`profiler_paused` stops
the profiler's sampling callback when a worker starts its first SuperBatch task and starts
it again when its last one ends, so the profiler runs as before between runs and for every
other task. It is the tuning setting ``surge.tuning.pause-profiler`` (``docs/tuning.md``):
``auto`` pauses it where the worker plugin applied it (a CPU worker), ``false`` leaves it alone.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .._compat import profile_callback
from ..engine import tuning

__all__ = ["current_worker", "profiler_paused"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: id(worker) -> SuperBatch tasks running there that want its profiler paused
_holders: dict[int, int] = {}
#: id(worker) of the workers whose profiler this module stopped (and so starts again)
_stopped: set[int] = set()


def current_worker() -> Any:
    """The distributed worker running this thread's task, or None outside a worker.

    A process that never imported ``distributed`` runs no worker: it is not imported to find that
    out (a small run in the user's process never loads it, ``tests/test_lazy_import.py``).

    Examples
    --------
    >>> current_worker() is None  # no worker runs this doctest
    True
    """
    if "distributed" not in sys.modules:
        return None
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def _sync(worker: Any) -> None:
    """On the worker's event loop: stop its profile callback while tasks hold it paused, start it
    again once none does, and only if this module stopped it (one the user stopped stays stopped)."""
    callback = profile_callback(worker)
    if callback is None:
        return
    key = id(worker)
    with _lock:
        wanted = key in _holders
        if wanted and callback.is_running():
            callback.stop()
            _stopped.add(key)
        elif not wanted and key in _stopped:
            _stopped.discard(key)
            callback.start()


def _schedule_sync(worker: Any) -> None:
    try:  # tornado's callbacks are not thread-safe; add_callback is
        worker.loop.add_callback(_sync, worker)
    except RuntimeError:  # the worker's loop is closing: nothing to pause or resume
        logger.debug("dask-surge: worker loop closed; profiler left as it is")


@contextlib.contextmanager
def profiler_paused(enabled: bool | None = None) -> Iterator[bool]:
    """Pause the profiler of the worker running this task for the ``with`` block.

    Tasks nest and overlap: the profiler is paused while any of them runs on the worker
    and resumes when the last one ends. Nothing happens outside a worker, when the worker
    runs without a profiler (``distributed.worker.profile.enabled: False``), or when
    ``enabled`` is False; a profiler stopped by someone else stays stopped.

    Parameters
    ----------
    enabled : bool, optional
        Can be True, False, or None for the tuning setting ``surge.tuning.pause-profiler`` in this
        process (:func:`dask_surge.engine.tuning.active`).

    Yields
    ------
    bool
        Whether this block holds the profiler paused.

    Examples
    --------
    >>> with profiler_paused() as paused:  # not on a worker: nothing to pause
    ...     paused
    False
    """
    if enabled is None:
        enabled = tuning.active("pause-profiler")
    worker = current_worker() if enabled else None
    held = worker is not None and profile_callback(worker) is not None
    if held:
        with _lock:
            first = not _holders.get(id(worker))
            _holders[id(worker)] = _holders.get(id(worker), 0) + 1
        if first:
            _schedule_sync(worker)
    try:
        yield held
    finally:
        if held:
            with _lock:
                _holders[id(worker)] -= 1
                last = not _holders[id(worker)]
                if last:
                    del _holders[id(worker)]
            if last:
                _schedule_sync(worker)
