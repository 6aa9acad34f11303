"""Commits announced as they happen, so the client's progress moves per SuperBatch.

A unit task returns its SuperBatches' reports only when the whole unit ends (in the
streaming mode a unit may hold many SuperBatches). So each commit is also announced
the moment it is made (:func:`announce`):

- in the client's own process (the local schedulers ``"sync"`` and ``"threads"``, or a
  distributed worker in the client's process), straight to the run's listener;
- on a distributed worker in another process, as a worker event under :data:`TOPIC`
  (``Worker.log_event``), which the scheduler forwards to the client that subscribed
  (:func:`listen` with a client).

Announcements are a courtesy: one that is lost (a client that subscribed late, a
worker that died) costs nothing, as the unit's reports still count every SuperBatch
once they arrive (listeners count a SuperBatch key once).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from .profiler import current_worker

__all__ = ["TOPIC", "announce", "listen"]

logger = logging.getLogger(__name__)

#: the worker-event topic of commit announcements
TOPIC = "dask-surge-commit"

#: run id -> listener(sb key, rows, file), in this process
_LISTENERS: dict[str, Callable[[str, int, str], None]] = {}
_LOCK = threading.Lock()


def announce(run: str, sb: str, rows: int, file: str = "") -> None:
    """Tell the client that SuperBatch ``sb`` of ``run`` committed ``rows`` (written + skipped) rows
    in its data file ``file``.

    Never raises: a progress report must not fail a commit.

    Examples
    --------
    >>> heard = []
    >>> with listen("run-1", lambda sb, rows, file: heard.append((sb, rows))):
    ...     announce("run-1", "0-0", 5)
    >>> announce("run-1", "1-0", 5)  # nobody listens (and no worker here): nothing happens
    >>> heard
    [('0-0', 5)]
    """
    try:
        listener = _LISTENERS.get(run)
        if listener is not None:
            listener(sb, int(rows), file)
            return
        worker = current_worker()
        if worker is None:  # not in a distributed worker, and nobody here listens
            return
        worker.log_event(TOPIC, {"run": run, "sb": sb, "rows": int(rows), "file": file})
    except Exception as err:  # noqa: BLE001  # pragma: no cover - a lost announcement costs nothing
        logger.debug("dask-surge: commit of %s not announced: %s", sb, err)


def _dispatch(event) -> None:
    """The client's handler of :data:`TOPIC` events: ``(timestamp, message)``."""
    _, msg = event
    listener = _LISTENERS.get(str(msg.get("run"))) if isinstance(msg, dict) else None
    if listener is not None:
        listener(str(msg["sb"]), int(msg["rows"]), str(msg.get("file", "")))


@contextlib.contextmanager
def listen(run: str, listener: Callable[[str, int, str], None], client=None) -> Iterator[None]:
    """Call ``listener(sb, rows, file)`` for each commit announced for ``run`` while inside.

    With a distributed ``client``, the client subscribes to :data:`TOPIC` (one handler
    for every run of this process, dispatching by run id), and unsubscribes when the
    last listener leaves.
    """
    with _LOCK:
        _LISTENERS[run] = listener
    if client is not None:
        with contextlib.suppress(Exception):
            client.subscribe_topic(TOPIC, _dispatch)
    try:
        yield
    finally:
        with _LOCK:
            _LISTENERS.pop(run, None)
            last = not _LISTENERS
        if client is not None and last:
            with contextlib.suppress(Exception):
                client.unsubscribe_topic(TOPIC)
