"""Clusters: one worker per GPU when there are GPUs, else a CPU ``LocalCluster``."""

from __future__ import annotations

import ast
import logging
import os
import sys
import types

from .. import config
from ..engine.placement import gpu_count
from ..errors import SurgeError

__all__ = ["DEDICATED", "local_cluster", "local_cluster_threads", "check_main_guard", "MAIN_GUARD"]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

#: the config dask-surge's own clusters give their workers: they run dask-surge only
#: (``surge.dedicated-workers``), so ``auto`` applies the settings that cannot be undone
DEDICATED = {"surge.dedicated-workers": True}


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

    Its worker processes leave a closing cluster's expected noise out of the terminal (a
    worker's last heartbeat after the scheduler left:
    :class:`~dask_surge.execution.quiet.QuietWorkerShutdown`).

    Its workers run without distributed's statistical profiler
    (``distributed.worker.profile.enabled: False``): sampling every thread's stack costs
    the workers' event loops CPU that the host path needs (``docs/ab_studies.md``). Start
    your own cluster for the dashboard's profile page.

    Its workers are dask-surge's own (``surge.dedicated-workers: true`` in their config): the
    process settings that cannot be undone (the allocator's thresholds, ``docs/tuning.md``) apply
    there on ``auto``, and never on the workers of a cluster you started yourself.

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

    from .quiet import QuietWorkerShutdown  # a worker plugin: imports distributed, as starting a cluster does

    check_main_guard(kwargs.get("processes", True))
    cuda, opts = _defaults()
    opts.update(kwargs)
    # a worker's last heartbeat after the scheduler left is noise of this cluster's close, not news
    opts["plugins"] = (*opts.get("plugins", ()), QuietWorkerShutdown())
    # distributed (and dask-cuda) are imported before this config.set: importing distributed registers
    # its defaults (distributed.*), which a set entered before the import would erase on exit
    cls = LocalCluster
    if cuda:
        from dask_cuda import LocalCUDACluster

        cls = LocalCUDACluster
    # the nannies hand this config to their workers: no profiler, and workers that run dask-surge only
    with dask.config.set({"distributed.worker.profile.enabled": False, **DEDICATED}):
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
                "LocalCluster. Fix: pip install 'dask-surge[gpu]'.",
                gpus,
            )
        else:
            # a thread per SuperBatch in flight (surge.superbatches-per-gpu): while one runs on the GPU
            # (the engine serializes forward passes), the others read, tokenize or write their Parquet
            return True, {
                "n_workers": gpus,
                "threads_per_worker": int(config.get("superbatches-per-gpu")),
                "resources": {"GPU": 1},
            }
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


MAIN_GUARD = 'if __name__ == "__main__":'


def check_main_guard(processes: bool = True) -> None:
    """Refuse, in one line, to start process workers from a script's top level without the
    ``if __name__ == "__main__":`` guard.

    Dask's process workers are started with ``spawn``: each new process imports the script
    again, so an unguarded script starts its cluster again in every worker, which Python
    stops with "An attempt has been made to start a new process before the current process
    has finished its bootstrapping phase" and distributed with "Nanny failed to start" (a
    hundred lines of traceback, the workers re-running the script). Two cases are caught:

    - this process is such a worker, re-importing the script (multiprocessing's
      bootstrapping phase): the script started a cluster at import time;
    - the call comes from the top level of the script run as ``__main__``, on a line that is
      not inside the guard (checked in the script's source, before any process starts).

    Notebooks, ``python -c`` and interactive sessions have no script to re-import and pass.

    Raises
    ------
    SurgeError
        Naming the script and the line, and the fix.
    """
    if not processes:
        return
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SurgeError(
            _guard_message(getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the script", None)
        )
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not str(path).endswith(".py") or not os.path.isfile(path):
        return
    frame: types.FrameType | None = sys._getframe(1)
    line = None
    while frame is not None:  # the outermost frame of the script's own top-level code
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return
    if not _guarded(tree, line):
        raise SurgeError(_guard_message(str(path), line))


def _guard_message(path: str, line: int | None) -> str:
    where = f"{path}, line {line}," if line is not None else f"{path}"
    return (
        f"{where} starts a local Dask cluster at the script's top level, outside the "
        f"`{MAIN_GUARD}` guard: its worker processes would run the script again and fail. Fix: put the "
        f"script's code under `{MAIN_GUARD}` (see the quick start), or pass scheduler='threads'."
    )


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def _guarded(tree: ast.Module, line: int) -> bool:
    """Whether ``line`` of the module lies inside the body of an ``if __name__ == "__main__":``
    block (or of a function or class, which the top level only defines).

    Examples
    --------
    >>> src = "import x\\nx.go()\\nif __name__ == '__main__':\\n    x.go()\\n"
    >>> tree = ast.parse(src)
    >>> _guarded(tree, 2), _guarded(tree, 4)
    (False, True)
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            body = node.body
            if body and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno):
                return True
    return False
