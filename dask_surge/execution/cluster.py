"""Clusters: one worker per GPU when there are GPUs, else a CPU ``LocalCluster``."""

from __future__ import annotations

import logging
import os

from .. import config
from ..engine.placement import gpu_count

__all__ = ["local_cluster", "local_cluster_threads"]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def local_cluster(**kwargs):
    """A local Dask cluster sized for this machine.

    With GPUs and ``dask-cuda`` installed: a ``LocalCUDACluster`` with one
    worker per visible GPU (each worker sees its GPU as device 0),
    ``surge.superbatches-per-gpu`` threads per worker (default 4), so while one
    SuperBatch is on the GPU the others read, tokenize and write, and a ``GPU=1``
    worker resource, of which each SuperBatch task claims ``1/n`` (see
    :func:`dask_surge.execution.scheduling.task_resources`). Otherwise a ``LocalCluster`` with one
    single-threaded worker per core (torch uses one thread per worker, and so does the
    Rust tokenizer, see :func:`~dask_surge.execution.plugins.share_tokenizer_cores`, so the
    cores are not oversubscribed).

    Everything it starts listens on the loopback interface only: the scheduler, the
    workers and the dashboard bind to ``127.0.0.1`` (the dashboard on a free port), so on a
    shared login node nobody else can reach the cluster or read its dashboard.

    Its workers run without distributed's statistical profiler
    (``distributed.worker.profile.enabled: False``): sampling every thread's stack costs
    the workers' event loops CPU that the host path needs (``docs/ab_studies.md``). Start
    your own cluster for the dashboard's profile page.

    Parameters
    ----------
    **kwargs
        Passed to the cluster class, overriding the defaults above. ``host`` can be an
        address to listen on (``"0.0.0.0"`` for every interface), or None to use
        ``127.0.0.1``; ``dashboard_address`` can be ``"host:port"``, or None to use a free
        port on ``host``.

    Examples
    --------
    >>> from distributed import Client
    >>> from dask_surge import local_cluster
    >>> with local_cluster(n_workers=1, processes=False) as cluster:  # doctest: +SKIP
    ...     client = Client(cluster)
    """
    import dask
    from distributed import LocalCluster

    cuda, opts = _defaults()
    opts.update(kwargs)
    # distributed (and dask-cuda) are imported before this config.set: importing distributed registers
    # its defaults (distributed.*), which a set entered before the import would erase on exit
    cls = LocalCluster
    if cuda:
        from dask_cuda import LocalCUDACluster

        cls = LocalCUDACluster
    with dask.config.set({"distributed.worker.profile.enabled": False}):  # the nannies hand it to the workers
        return cls(**_loopback(opts))


def _defaults() -> tuple[bool, dict]:
    """Whether :func:`local_cluster` starts dask-cuda workers, and its default options."""
    gpus = gpu_count()
    if gpus:
        try:
            import dask_cuda  # noqa: F401
        except ImportError:
            logger.warning(
                "dask-surge: %d GPU(s) visible but dask-cuda is not installed; using a CPU "
                "LocalCluster. Fix: pip install 'dask-surge[gpu]'.", gpus,
            )
        else:
            # a thread per SuperBatch in flight (surge.superbatches-per-gpu): while one runs on the GPU
            # (the engine serializes forward passes), the others read, tokenize or write their Parquet
            return True, {"n_workers": gpus, "threads_per_worker": int(config.get("superbatches-per-gpu")),
                          "resources": {"GPU": 1}}
    return False, {"n_workers": max(1, os.cpu_count() or 1), "threads_per_worker": 1}


def local_cluster_threads() -> int:
    """Worker threads of the cluster :func:`local_cluster` starts with its defaults (what
    :func:`dask_surge.plan` assumes when no Client is active, as encode() would start it).

    Examples
    --------
    >>> local_cluster_threads() >= 1
    True
    """
    _, opts = _defaults()
    return opts["n_workers"] * opts["threads_per_worker"]


def _loopback(opts: dict) -> dict:
    """``opts`` with the scheduler, workers and dashboard bound to ``127.0.0.1`` unless the
    caller chose a ``host`` or a ``dashboard_address`` (a dashboard follows the chosen host).
    ``distributed``'s own default, ``dashboard_address=":8787"``, listens on every interface."""
    opts = dict(opts)
    if opts.get("host") is None:
        opts["host"] = LOOPBACK
    if opts.get("dashboard_address") is None:
        host = opts["host"]
        opts["dashboard_address"] = f"[{host}]:0" if ":" in host else f"{host}:0"
    return opts
