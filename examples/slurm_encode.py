"""Encode a Parquet dataset on a SLURM cluster: one GPU per Dask worker job, or CPU jobs.

    pip install 'dask-surge[gpu,jobqueue]'
    python examples/slurm_encode.py /shared/docs/ /shared/emb/ --jobs 8 --account proj42
    python examples/slurm_encode.py /shared/docs/ /shared/emb/ --cpu --jobs 4 --cores 16 --queue cpu

Worker logs go to --log-directory (default ``surge-logs/`` in the current directory), one
``dask-worker-<jobid>.err`` per job. Rerun the same command after a preemption or a crash:
committed SuperBatches are kept, the run resumes (with any number of jobs).
"""

import argparse
import time

import dask.dataframe as dd
from distributed import Client

import dask_surge  # noqa: F401  (registers the .surge accessor)
from dask_surge.execution.hpc import jobqueue_cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", help="Parquet file or directory")
    parser.add_argument("output", help="output directory (rerun with the same one to resume)")
    parser.add_argument("--jobs", type=int, default=4, help="worker jobs: one GPU each, or --cores CPUs each")
    parser.add_argument("--cpu", action="store_true", help="CPU jobs (no GPU request, one worker per core)")
    parser.add_argument("--cores", type=int, default=None, help="cores per job (default 8)")
    parser.add_argument("--memory", default=None, help="memory per job (default 64GB GPU, 4GB a core CPU)")
    parser.add_argument("--account", default=None)
    parser.add_argument("--queue", default=None, help="partition")
    parser.add_argument("--log-directory", default="surge-logs", help="where worker jobs write their logs")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--model", default="default", help="model dir or name (default: all-MiniLM-L6-v2)")
    args = parser.parse_args()

    with jobqueue_cluster("slurm", gpus=0 if args.cpu else 1, cores=args.cores, memory=args.memory,
                          account=args.account, queue=args.queue, log_directory=args.log_directory) as cluster:
        t0 = time.perf_counter()
        cluster.scale(jobs=args.jobs)
        with Client(cluster) as client:
            client.wait_for_workers(1)
            up = time.perf_counter() - t0
            print(f"first worker up {up:.1f} s after scale(); dashboard: {client.dashboard_link}", flush=True)
            ddf = dd.read_parquet(args.input)
            result = ddf.surge.encode(args.text_column, args.output, model=args.model,
                                      device="cpu" if args.cpu else "cuda")
            done = time.perf_counter() - t0
            if result.ttfo_s is not None:  # the first commit came (seconds - ttfo_s) before the return
                first = done - (result.seconds - result.ttfo_s)
                print(f"first SuperBatch committed {first:.1f} s after scale(); all done after {done:.1f} s")
            print(result)


if __name__ == "__main__":
    main()
