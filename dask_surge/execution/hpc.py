"""HPC clusters through dask-jobqueue: SLURM or PBS jobs on GPU or CPU nodes.

Needs the ``jobqueue`` extra (``pip install 'dask-surge[jobqueue]'``).

- GPU jobs (``gpus=1``): each job runs one dask-cuda worker (``python -m dask_cuda.cli``)
  that owns one GPU and advertises a ``GPU=1`` resource, so each GPU encodes one
  SuperBatch at a time while the worker's CPU threads read, tokenize and write.
- CPU jobs (``gpus=0``): each job runs one single-threaded Dask worker per core (as
  :func:`dask_surge.execution.cluster.local_cluster` does on a CPU machine), with no GPU request.

A job that is preempted or cancelled takes its worker with it; the SuperBatches other
workers committed are kept, and rerunning the same ``encode`` call resumes the run.

Its workers are dask-surge's own: each job exports ``DASK_SURGE__DEDICATED_WORKERS=True``
(``surge.dedicated-workers``), so the process settings that cannot be undone (the allocator's
thresholds, ``docs/tuning.md``) apply there on ``auto``.
"""

from __future__ import annotations

from typing import Any

from ..errors import SurgeValueError

__all__ = ["gpu_jobqueue_cluster", "jobqueue_cluster"]

KINDS = ("slurm", "pbs")

#: the line each job runs before its workers start: they run dask-surge only (``surge.dedicated-workers``)
DEDICATED_EXPORT = "export DASK_SURGE__DEDICATED_WORKERS=True"


def jobqueue_cluster(
    kind: str = "slurm",
    *,
    gpus: int = 1,
    cores: int | None = None,
    memory: str | None = None,
    walltime: str | None = "02:00:00",
    queue: str | None = None,
    account: str | None = None,
    cuda_worker: bool | None = None,
    log_directory: str | None = None,
    **kwargs: Any,
):
    """A dask-jobqueue cluster whose every job is a GPU worker or a set of CPU workers.

    Parameters
    ----------
    kind : {"slurm", "pbs"}
        The batch system.
    gpus : int, default 1
        GPUs per job. Can be 1, for one dask-cuda worker per job that owns one GPU
        (``--gres=gpu:1`` on SLURM, ``ngpus=1`` on PBS) and advertises a ``GPU=1``
        resource, or 0, for CPU jobs: no GPU request and one single-threaded worker per
        core. More GPUs means more jobs: ``cluster.scale(jobs=n)``.
    cores : int, optional
        CPU cores per job. Can be an integer, or None to use 8 (a GPU job's threads read,
        tokenize and write while the GPU encodes; a CPU job runs 8 workers).
    memory : str, optional
        Memory per job, as dask-jobqueue takes it (``"64GB"``). Can be a size, or None to
        use 64GB for a GPU job and 4GB per core for a CPU job. A CPU job's workers share it.
    walltime : str, optional
        Job time limit (``"HH:MM:SS"``). Can be a time, or None to use dask-jobqueue's
        configured default (``jobqueue.<kind>.walltime``).
    queue, account : str, optional
        Partition (queue) and account to charge. Can be a name, or None to use the
        batch system's default (or dask-jobqueue's configuration).
    cuda_worker : bool, optional
        Can be True, to start workers with ``dask_cuda.cli`` (each sees its GPU as device
        0), False, to use plain ``distributed.cli.dask_worker``, or None to use
        ``dask_cuda.cli`` for GPU jobs and the plain worker for CPU jobs.
    log_directory : str, optional
        Where each job writes its worker's log. Can be a directory (created if missing;
        SLURM writes ``<job_name>-<jobid>.out`` and ``.err`` there, ``job_name`` being
        ``dask-worker`` unless given), or None to leave it to the batch system (SLURM:
        ``slurm-<jobid>.out`` in the directory you submitted from).
    **kwargs
        Passed to the dask-jobqueue cluster class (they win over the defaults), e.g.
        ``job_script_prologue=["module load cuda"]`` (run after the line that marks the workers
        as dask-surge's own, ``DASK_SURGE__DEDICATED_WORKERS=True``), ``scheduler_options``,
        ``interface``.

    Returns
    -------
    dask_jobqueue.SLURMCluster or dask_jobqueue.PBSCluster
        Call ``cluster.scale(jobs=n)``, then ``Client(cluster)``.

    Raises
    ------
    SurgeValueError
        For an unknown ``kind``, ``gpus`` other than 0 or 1, ``cuda_worker=True`` with
        ``gpus=0``, or when dask-jobqueue is not installed.

    Examples
    --------
    >>> cluster = jobqueue_cluster("slurm", gpus=0, cores=16, queue="cpu")  # doctest: +SKIP
    >>> print(cluster.job_script())                                         # doctest: +SKIP
    >>> cluster.scale(jobs=4)                                               # doctest: +SKIP
    """
    if kind not in KINDS:
        raise SurgeValueError(f"kind={kind!r} is not supported. Fix: choose one of {KINDS}.")
    if isinstance(gpus, bool) or gpus not in (0, 1):
        raise SurgeValueError(
            f"gpus={gpus!r}: each job holds one dask-cuda worker with one GPU (gpus=1) or only "
            "CPU workers (gpus=0). Fix: for n GPUs pass gpus=1 and call cluster.scale(jobs=n)."
        )
    if cuda_worker and not gpus:
        raise SurgeValueError(
            "cuda_worker=True with gpus=0: a dask-cuda worker needs a GPU in its job. "
            "Fix: pass gpus=1, or leave cuda_worker=None for CPU jobs."
        )
    try:
        import dask_jobqueue
    except ImportError as err:
        raise SurgeValueError(
            "jobqueue_cluster needs dask-jobqueue. Fix: pip install 'dask-surge[jobqueue]'."
        ) from err
    cores = 8 if cores is None else int(cores)
    if memory is None:
        memory = "64GB" if gpus else f"{4 * cores}GB"
    opts: dict[str, Any] = {
        "cores": cores,
        "memory": memory,
        "queue": queue,
        "account": account,
        "log_directory": log_directory,
    }
    if walltime is not None:
        opts["walltime"] = walltime
    if gpus:
        opts.update(processes=1, worker_extra_args=["--resources", "GPU=1"])
        if cuda_worker is None or cuda_worker:
            opts["worker_command"] = "dask_cuda.cli"
    else:
        # one single-threaded worker per core: the nanny sets OMP_NUM_THREADS=1, so torch
        # in each worker uses one core and the job's cores are not oversubscribed
        opts["processes"] = cores
    if kind == "slurm":
        if gpus:
            opts["job_extra_directives"] = ["--gres=gpu:1"]
        cls: type = dask_jobqueue.SLURMCluster
    else:
        if gpus:
            opts["resource_spec"] = f"select=1:ncpus={cores}:ngpus=1:mem={memory}"
        cls = dask_jobqueue.PBSCluster
    opts.update(kwargs)
    opts["job_script_prologue"] = [DEDICATED_EXPORT, *(kwargs.get("job_script_prologue") or ())]
    return cls(**opts)


def gpu_jobqueue_cluster(
    kind: str = "slurm",
    *,
    cores: int = 8,
    memory: str = "64GB",
    walltime: str | None = "02:00:00",
    queue: str | None = None,
    account: str | None = None,
    cuda_worker: bool = True,
    **kwargs: Any,
):
    """A dask-jobqueue cluster whose every job is one worker with one GPU.

    The same as :func:`jobqueue_cluster` with ``gpus=1``.

    Parameters
    ----------
    kind : {"slurm", "pbs"}
        The batch system.
    cores, memory, walltime, queue, account
        Per-job resources, as in :func:`jobqueue_cluster`.
    cuda_worker : bool, default True
        Can be True, to start workers with ``dask_cuda.cli`` (each sees its GPU as device
        0), or False, to use plain ``distributed.cli.dask_worker``.
    **kwargs
        Passed to :func:`jobqueue_cluster` and on to the dask-jobqueue cluster class.

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
    return jobqueue_cluster(
        kind,
        gpus=1,
        cores=cores,
        memory=memory,
        walltime=walltime,
        queue=queue,
        account=account,
        cuda_worker=cuda_worker,
        **kwargs,
    )
