"""HPC clusters through dask-jobqueue: one GPU per worker job (SLURM or PBS).

Needs the ``jobqueue`` extra (``pip install 'dask-surge[jobqueue]'``). Each job runs one
dask-cuda worker (``python -m dask_cuda.cli``) that owns one GPU and advertises a
``GPU=1`` resource, so each GPU encodes one SuperBatch at a time while the worker's CPU
threads read, tokenize and write.
"""

from __future__ import annotations

from typing import Any

from .errors import SurgeValueError

__all__ = ["gpu_jobqueue_cluster"]

KINDS = ("slurm", "pbs")


def gpu_jobqueue_cluster(
    kind: str = "slurm",
    *,
    cores: int = 8,
    memory: str = "64GB",
    walltime: str = "02:00:00",
    queue: str | None = None,
    account: str | None = None,
    cuda_worker: bool = True,
    **kwargs: Any,
):
    """A dask-jobqueue cluster whose every job is one worker with one GPU.

    Parameters
    ----------
    kind : {"slurm", "pbs"}
    cores, memory, walltime, queue, account
        Per-job resources, as dask-jobqueue takes them.
    cuda_worker : bool
        Start workers with ``dask_cuda.cli`` (each sees its GPU as device 0);
        ``False`` uses plain ``distributed.cli.dask_worker``.
    **kwargs
        Passed to the dask-jobqueue cluster class (they win over the defaults).

    Returns
    -------
    dask_jobqueue.SLURMCluster or dask_jobqueue.PBSCluster
        Call ``cluster.scale(jobs=n)`` for n GPUs, then ``Client(cluster)``.

    Examples
    --------
    >>> cluster = gpu_jobqueue_cluster("slurm", account="proj42")   # doctest: +SKIP
    >>> print(cluster.job_script())                                 # doctest: +SKIP
    >>> cluster.scale(jobs=8)                                       # doctest: +SKIP
    """
    if kind not in KINDS:
        raise SurgeValueError(f"kind={kind!r} is not supported. Fix: choose one of {KINDS}.")
    try:
        import dask_jobqueue
    except ImportError as err:
        raise SurgeValueError(
            "gpu_jobqueue_cluster needs dask-jobqueue. Fix: pip install 'dask-surge[jobqueue]'."
        ) from err
    opts: dict[str, Any] = dict(
        cores=cores, memory=memory, walltime=walltime, processes=1, queue=queue, account=account,
        worker_extra_args=["--resources", "GPU=1"],
    )
    if cuda_worker:
        opts["worker_command"] = "dask_cuda.cli"
    if kind == "slurm":
        opts["job_extra_directives"] = ["--gres=gpu:1"]
        cls = dask_jobqueue.SLURMCluster
    else:
        opts["resource_spec"] = f"select=1:ncpus={cores}:ngpus=1:mem={memory}"
        cls = dask_jobqueue.PBSCluster
    opts.update(kwargs)
    return cls(**opts)
