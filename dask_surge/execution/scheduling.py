"""Streaming units through a cluster: a bounded window of unit tasks in flight, their reports as
they finish, the worker resources they claim, and a watch for a cluster that lost every worker."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

from .. import config
from .._compat import named_graph
from ..results import SuperBatchReport
from .inputs import Unit

__all__ = ["task_resources", "run_units", "NoWorkersLeft", "WorkerWatch", "received"]

logger = logging.getLogger(__name__)


def task_resources(client) -> dict | None:
    """Worker resources for unit tasks: when workers advertise ``GPU`` (dask-cuda
    workers from :func:`dask_surge.execution.cluster.local_cluster` or :mod:`dask_surge.execution.hpc`), each
    task claims ``1 / n`` of one (``n``: ``surge.superbatches-per-gpu``, read here on the
    client), so SuperBatches run only on GPU workers, at most ``n`` at a time per GPU (the
    engine serializes the forward passes; the others read, tokenize, write and commit).
    ``None`` when no worker advertises a GPU.

    Examples
    --------
    >>> task_resources(None) is None
    True
    """
    if client is None:
        return None
    workers = client.scheduler_info(n_workers=-1).get("workers", {}).values()
    if any(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers):
        return {"GPU": 1 / int(config.get("superbatches-per-gpu"))}
    return None


def run_units(
    units, make_task, client, scheduler, in_flight: int, resources: dict | None = None
) -> Iterator[SuperBatchReport]:
    """Yield SuperBatch reports as units finish, with at most ``in_flight`` units submitted.

    ``units`` is an iterator of :class:`Unit`; ``make_task(key, unit)`` gives a unit's graph. Units are submitted in order, so the first commits early (TTFO) and no
    worker holds more than a bounded number of them.
    """
    counter = iter(range(10**12))
    tag = uuid.uuid4().hex[:16]  # this run's unit keys: no other graph has them

    def submit(unit: Unit):
        key = (f"surge-unit-{tag}", next(counter))
        return key, make_task(key, unit)

    if client is None:
        from dask.local import get_sync
        from dask.threaded import get as get_threads

        get = get_sync if scheduler in ("sync", "synchronous") else get_threads
        for unit in units:
            key, graph = submit(unit)
            yield from received(get(graph, key))
        return
    from distributed import as_completed

    running = as_completed(loop=client.loop)  # this client's, which need not be the default one
    live: list = []
    waiting: set = set()  # submitted, not yet handed back by `running`
    finished = threading.Event()  # set as any of them finishes
    exhausted = False

    def submit_more() -> None:
        nonlocal exhausted
        while not exhausted and running.count() < in_flight:
            unit = next(units, None)
            if unit is None:
                exhausted = True
                return
            key, graph = submit(unit)
            # named by its unique key: Dask would otherwise tokenize the graph, pickling its data
            future = client.get(
                named_graph(graph, f"{key[0]}-{key[1]}"), key, sync=False, resources=resources
            )
            live.append(future)
            waiting.add(future)
            future.add_done_callback(lambda _: finished.set())
            running.add(future)

    watch = WorkerWatch(client, config.get("no-workers-timeout"))
    try:
        submit_more()
        while not running.is_empty():
            if not running.has_ready():
                finished.clear()
                # none finished: wait for one, asking now and then whether any worker is left
                if not any(f.done() for f in waiting) and not finished.wait(watch.poll_s):
                    watch.check(len(waiting))  # raises once every worker has been gone too long
                    continue
            fut = next(running)  # (one that finished reaches `running` a moment later)
            waiting.discard(fut)
            reports = fut.result()
            fut.release()
            submit_more()
            yield from received(reports)
    finally:
        client.cancel([f for f in live if not f.done()])


class NoWorkersLeft(RuntimeError):
    """Every worker left the cluster while SuperBatches waited, for longer than
    ``surge.no-workers-timeout`` (see :class:`WorkerWatch`); :func:`stopped_error` says what is kept."""


class WorkerWatch:
    """Watches, while a run waits on SuperBatch tasks, whether the cluster still has a worker.

    A run whose cluster had workers and then has none for ``timeout`` seconds (jobs preempted
    or cancelled, worker processes that crashed, or that closed, nanny and all, because they
    could not unpickle a task) raises :class:`NoWorkersLeft` from :meth:`check`, instead of
    waiting for ever: Dask's own ``distributed.scheduler.no-workers-timeout`` is off by default.
    A cluster that has not had a worker yet (jobs still queued) is waited for, as long as it
    takes; ``timeout`` None waits for workers in every case.

    Examples
    --------
    >>> WorkerWatch(None, None).check(1)  # no timeout: nothing to watch
    """

    poll_s = 2.0  # how often a run that waits asks the scheduler how many workers it has

    def __init__(self, client, timeout: float | None, clock=time.monotonic) -> None:
        self.client, self.timeout, self.clock = client, timeout, clock
        self.had_workers = False
        self.gone_since: float | None = None
        if timeout is not None:
            self._workers()

    def _workers(self) -> int:
        n = len(self.client.nthreads())
        self.had_workers = self.had_workers or n > 0
        return n

    def check(self, waiting: int) -> None:
        """Raise :class:`NoWorkersLeft` if every worker has been gone for ``timeout`` seconds while
        ``waiting`` SuperBatch tasks wait."""
        if self.timeout is None:
            return
        if self._workers() or not self.had_workers:
            self.gone_since = None
            return
        now = self.clock()
        if self.gone_since is None:
            self.gone_since = now
            logger.warning(
                "every worker has left the cluster; %d SuperBatch task(s) wait for one "
                "(the run stops after surge.no-workers-timeout=%ss)",
                waiting,
                self.timeout,
            )
        elif now - self.gone_since >= self.timeout:
            raise NoWorkersLeft(
                f"every worker left the cluster and none came back within surge.no-workers-timeout="
                f"{self.timeout:g}s, while {waiting} SuperBatch task(s) waited"
            )


def received(reports: list[SuperBatchReport]) -> list[SuperBatchReport]:
    """``reports`` with ``committed_at`` on the client's clock (see
    :meth:`~dask_surge.results.SuperBatchReport.on_client_clock`)."""
    now = time.time()
    return [r.on_client_clock(now) for r in reports]
