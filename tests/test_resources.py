"""SuperBatch tasks claim the GPU resource that GPU workers advertise (dask-cuda, HPC jobs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dask
from distributed import Client, LocalCluster

import dask_surge
from dask_surge.execution.runner import task_resources as _task_resources
from dask_surge.testing import make_partitioned_frame


def test_superbatches_run_only_on_workers_that_advertise_a_gpu(tmp_path, tiny_model):
    # a plain worker (as a CPU node of a mixed cluster), plus a worker started the way the HPC
    # job script starts one, with --resources GPU=1 (its "GPU" is this CPU: device="cpu")
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        assert _task_resources(client) is None  # no GPU worker: no restriction at all
        gpu_worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
             "--nthreads", "2", "--resources", "GPU=1", "--no-dashboard", "--name", "gpu-0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(2, timeout=60)
            assert _task_resources(client) == {"GPU": 1 / 4}  # surge.superbatches-per-gpu's default
            pids = client.run(os.getpid)
            info = client.scheduler_info(n_workers=-1)["workers"]
            gpu_pid = next(pids[a] for a, w in info.items() if w.get("resources", {}).get("GPU"))
            plain_pid = next(pids[a] for a, w in info.items() if not w.get("resources", {}).get("GPU"))
            ddf = make_partitioned_frame([7, 3, 12, 5, 9, 4], seed=9)
            out = tmp_path / "o"
            res = ddf.surge.encode("text", str(out), model=tiny_model, device="cpu", b_min=8, b_max=16,
                                   progress=False)
            assert res.rows == 40 and res.superbatches >= 3
            records = [json.loads(p.read_text()) for p in Path(out).glob("_surge/runs/*/commits/*.json")]
            assert {r["pid"] for r in records} == {gpu_pid} != {plain_pid}
        finally:
            gpu_worker.terminate()
            gpu_worker.wait(30)
    back = dask_surge.read_embeddings(str(out)).compute()
    assert len(back[["partition", "row"]].drop_duplicates()) == 40


# in-process clusters (distributed's gen_cluster) where real processes are not the point


from distributed.utils_test import gen_cluster  # noqa: E402

#: the session's 2-process cluster (tests/conftest.py) lives across tests: its worker processes, threads
#: and client are not leaks of these in-process clusters
CLEAN = {"processes": False, "threads": False, "instances": False}


def _where(i: int) -> str:
    from distributed import get_worker

    return get_worker().address


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 2, {"resources": {"GPU": 1}})], clean_kwargs=CLEAN)
async def test_tasks_claim_half_a_gpu_once_a_worker_advertises_one(c, s, plain, gpu):
    await c.wait_for_workers(2)
    assert _task_resources(c) == {"GPU": 1 / 4}  # surge.superbatches-per-gpu's default
    with dask.config.set({"surge.superbatches-per-gpu": 2}):  # read on the client, when the run starts
        assert _task_resources(c) == {"GPU": 1 / 2}
    # a claim of half a GPU runs only where one is advertised
    futures = [c.submit(_where, i, resources=_task_resources(c), pure=False) for i in range(6)]
    assert set(await c.gather(futures)) == {gpu.address}
    plain_futures = [c.submit(_where, i, pure=False) for i in range(6)]  # without the claim: anywhere
    assert await c.gather(plain_futures)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], clean_kwargs=CLEAN)
async def test_no_gpu_worker_means_no_restriction(c, s, a):
    assert _task_resources(c) is None
    assert _task_resources(None) is None
