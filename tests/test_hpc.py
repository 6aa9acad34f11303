import pytest

from dask_surge.errors import SurgeValueError

pytest.importorskip("dask_jobqueue", reason="HPC helpers need the [jobqueue] extra (dask-jobqueue)")

from dask_surge.hpc import gpu_jobqueue_cluster  # noqa: E402

LOCAL = {"scheduler_options": {"host": "127.0.0.1", "dashboard_address": ":0"}}


def test_slurm_job_script_requests_one_gpu_and_starts_a_cuda_worker():
    with gpu_jobqueue_cluster("slurm", cores=8, memory="64GB", account="proj42", **LOCAL) as cluster:
        script = cluster.job_script()
    assert "#SBATCH --gres=gpu:1" in script
    assert "#SBATCH -A proj42" in script
    assert "-m dask_cuda.cli" in script and "--resources GPU=1" in script
    assert "--nthreads 8" in script


def test_pbs_job_script_requests_one_gpu():
    with gpu_jobqueue_cluster("pbs", cores=4, memory="32GB", **LOCAL) as cluster:
        script = cluster.job_script()
    assert "ngpus=1" in script and "ncpus=4" in script
    assert "-m dask_cuda.cli" in script and "--resources GPU=1" in script


def test_unknown_kind_is_named():
    with pytest.raises(SurgeValueError, match="kind='lsf'"):
        gpu_jobqueue_cluster("lsf")
