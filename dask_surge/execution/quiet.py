"""The worker side of quiet runs: a plugin for the clusters dask-surge starts itself.

Imported only when :func:`dask_surge.local_cluster` starts one (it imports ``distributed``).
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from .progress import ShutdownNoise

__all__ = ["QuietWorkerShutdown"]


class QuietWorkerShutdown(WorkerPlugin):
    """In each worker process of a cluster :func:`dask_surge.local_cluster` started: the filter of
    :data:`dask_surge.execution.progress.SHUTDOWN_NOISE` on the ``distributed`` and root loggers
    and their handlers, so that a worker's last heartbeat after the scheduler left
    (``CommClosedError``), when the cluster closes, does not reach the terminal. The worker
    process lives only as long as that cluster, so the filter does too."""

    name = "dask-surge-quiet-shutdown"

    def setup(self, worker: Any) -> None:
        noise = ShutdownNoise()
        for lg in (
            logging.getLogger("distributed"),
            logging.getLogger("distributed.worker"),
            logging.getLogger(),
        ):
            lg.addFilter(noise)
            for handler in lg.handlers:
                handler.addFilter(noise)
