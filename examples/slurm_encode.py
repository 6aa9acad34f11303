"""Encode a Parquet dataset on a SLURM cluster, one GPU per Dask worker.

    pip install 'dask-surge[gpu,jobqueue]'
    python examples/slurm_encode.py /shared/docs/ /shared/emb/ --jobs 8 --account proj42

Rerun the same command after a preemption or a crash: committed SuperBatches are kept.
"""

import argparse

import dask.dataframe as dd
from distributed import Client

import dask_surge
from dask_surge.hpc import gpu_jobqueue_cluster

parser = argparse.ArgumentParser()
parser.add_argument("input")
parser.add_argument("output")
parser.add_argument("--jobs", type=int, default=4, help="GPUs (one worker job each)")
parser.add_argument("--account", default=None)
parser.add_argument("--queue", default=None)
parser.add_argument("--text-column", default="text")
args = parser.parse_args()

with gpu_jobqueue_cluster("slurm", account=args.account, queue=args.queue) as cluster:
    cluster.scale(jobs=args.jobs)
    with Client(cluster) as client:
        client.wait_for_workers(1)
        print("dashboard:", client.dashboard_link)
        ddf = dd.read_parquet(args.input)
        print(ddf.surge.encode(args.text_column, args.output, device="cuda"))
