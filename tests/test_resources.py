"""SuperBatch tasks claim the GPU resource that GPU workers advertise (dask-cuda, HPC jobs)."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import dask
from distributed import Client, LocalCluster

import dask_surge
from dask_surge.execution.scheduling import task_resources as _task_resources
from dask_surge.testing import make_partitioned_frame


def test_superbatches_run_only_on_workers_that_advertise_a_gpu(tmp_path, tiny_model):
    # a plain worker (as a CPU node of a mixed cluster), plus a worker started the way the HPC
    # job script starts one, with --resources GPU=1 (its "GPU" is this CPU: device="cpu")
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        assert _task_resources(client) is None  # no GPU worker: no restriction at all
        gpu_worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                cluster.scheduler_address,
                "--nthreads",
                "2",
                "--resources",
                "GPU=1",
                "--no-dashboard",
                "--name",
                "gpu-0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            client.wait_for_workers(2, timeout=60)
            assert _task_resources(client) == {"GPU": 1 / 4}  # surge.superbatches-per-gpu's default
            pids = client.run(os.getpid)
            info = client.scheduler_info(n_workers=-1)["workers"]
            gpu_pid = next(pids[a] for a, w in info.items() if w.get("resources", {}).get("GPU"))
            plain_pid = next(pids[a] for a, w in info.items() if not w.get("resources", {}).get("GPU"))
            ddf = make_partitioned_frame([7, 3, 12, 5, 9, 4], seed=9)
            out = tmp_path / "o"
            res = ddf.surge.encode(
                "text", str(out), model=tiny_model, device="cpu", b_min=8, b_max=16, progress=False
            )
            assert res.rows == 40 and res.superbatches >= 3
            records = [json.loads(p.read_text()) for p in Path(out).glob("_surge/runs/*/commits/*.json")]
            assert {r["pid"] for r in records} == {gpu_pid} != {plain_pid}
        finally:
            gpu_worker.terminate()
            gpu_worker.wait(30)
    back = dask_surge.read_embeddings(str(out)).compute()
    assert len(back[["partition", "row"]].drop_duplicates()) == 40


# in-process clusters (a scheduler and workers in this process) where real processes are not the point.
# Not distributed's gen_cluster: its cleanup checks the whole process, where the session's 2-process
# cluster (tests/conftest.py) and its client live, and under load it closed that cluster's workers.


def _where(i: int) -> str:
    from distributed import get_worker

    return get_worker().address


async def _in_process(*workers: dict):
    """An in-process scheduler, one worker per ``workers`` (Worker keyword arguments) and an async client."""
    from contextlib import AsyncExitStack

    from distributed import Scheduler, Worker

    stack = AsyncExitStack()
    s = await stack.enter_async_context(Scheduler(dashboard_address=":0", port=0))
    ws = [await stack.enter_async_context(Worker(s.address, **kw)) for kw in workers]
    c = await stack.enter_async_context(Client(s.address, asynchronous=True))
    await c.wait_for_workers(len(ws))
    return stack, c, ws


def test_tasks_claim_half_a_gpu_once_a_worker_advertises_one():
    async def main():
        stack, c, (plain, gpu) = await _in_process({"nthreads": 1}, {"nthreads": 2, "resources": {"GPU": 1}})
        async with stack:
            assert _task_resources(c) == {"GPU": 1 / 4}  # surge.superbatches-per-gpu's default
            with dask.config.set(
                {"surge.superbatches-per-gpu": 2}
            ):  # read on the client, when the run starts
                assert _task_resources(c) == {"GPU": 1 / 2}
            # a claim of half a GPU runs only where one is advertised
            futures = [c.submit(_where, i, resources=_task_resources(c), pure=False) for i in range(6)]
            assert set(await c.gather(futures)) == {gpu.address}
            plain_futures = [c.submit(_where, i, pure=False) for i in range(6)]  # without the claim: anywhere
            assert await c.gather(plain_futures)

    asyncio.run(main())


def test_no_gpu_worker_means_no_restriction():
    async def main():
        stack, c, _ = await _in_process({"nthreads": 1})
        async with stack:
            assert _task_resources(c) is None
            assert _task_resources(None) is None

    asyncio.run(main())
