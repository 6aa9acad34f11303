import pytest

from dask_surge.errors import SurgeValueError

pytest.importorskip("dask_jobqueue", reason="HPC helpers need the [jobqueue] extra (dask-jobqueue)")

from dask_surge.execution.hpc import gpu_jobqueue_cluster, jobqueue_cluster

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


def test_slurm_cpu_job_script_asks_for_no_gpu_and_runs_one_worker_per_core():
    with jobqueue_cluster("slurm", gpus=0, cores=4, queue="cpu", **LOCAL) as cluster:
        script = cluster.job_script()
    assert "gres" not in script and "GPU=1" not in script and "dask_cuda" not in script
    assert "#SBATCH -p cpu" in script and "#SBATCH --cpus-per-task=4" in script
    assert "#SBATCH --mem=15G" in script  # 4 GB a core by default (dask-jobqueue writes GiB)
    assert "-m distributed.cli.dask_worker" in script
    assert "--nworkers 4" in script and "--nthreads 1" in script


def test_pbs_cpu_job_script_asks_for_no_gpu():
    with jobqueue_cluster("pbs", gpus=0, cores=2, memory="8GB", **LOCAL) as cluster:
        script = cluster.job_script()
    assert "ngpus" not in script and "ncpus=2" in script and "dask_cuda" not in script


def test_worker_logs_go_to_log_directory(tmp_path):
    logs = tmp_path / "logs"
    with jobqueue_cluster("slurm", gpus=0, cores=1, log_directory=str(logs), **LOCAL) as cluster:
        script = cluster.job_script()
    assert f"#SBATCH -o {logs}/dask-worker-%J.out" in script
    assert f"#SBATCH -e {logs}/dask-worker-%J.err" in script
    assert logs.is_dir()


def test_the_gpu_helper_is_jobqueue_cluster_with_one_gpu():
    with (
        gpu_jobqueue_cluster("slurm", cores=4, **LOCAL) as a,
        jobqueue_cluster("slurm", gpus=1, cores=4, memory="64GB", **LOCAL) as b,
    ):
        scripts = [c.job_script().replace(c.scheduler.address, "SCHEDULER") for c in (a, b)]
    assert scripts[0] == scripts[1] and "--gres=gpu:1" in scripts[0]


@pytest.mark.parametrize("gpus", [2, -1, True, 0.5])
def test_gpus_other_than_0_or_1_is_refused_with_the_fix(gpus):
    with pytest.raises(SurgeValueError, match=rf"gpus={gpus!r}.*scale\(jobs=n\)"):
        jobqueue_cluster("slurm", gpus=gpus)


def test_a_cuda_worker_without_a_gpu_is_refused():
    with pytest.raises(SurgeValueError, match="cuda_worker=True with gpus=0"):
        jobqueue_cluster("slurm", gpus=0, cuda_worker=True)
