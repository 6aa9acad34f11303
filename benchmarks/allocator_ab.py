"""A/B: Dask workers that load the model with and without :func:`dask_surge.models.allocator.keep_large_blocks`.

Usage::

    python benchmarks/allocator_ab.py [--n 3000] [--files 112] [--rounds 4] [--model default]
                                      [--workers 2] [--out benchmarks/results/allocator_ab_cpu.json]

A Dask nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which pins glibc's mmap
threshold at 128 KiB: every activation block above it is mapped, zeroed and unmapped on
each use. Loading a model calls ``keep_large_blocks`` (threshold 32 MiB). Each run here gets
a fresh ``LocalCluster`` of ``--workers`` single-threaded workers (started, with torch and
sentence-transformers imported, before the clock; the model loads inside it, as a user's
first call does) and runs ``dd.read_parquet(dir).surge.encode("text", output=..., device="cpu")``
over ``--n`` real texts:

- ``kept``: as shipped;
- ``stock``: the workers' ``dask_surge.models.allocator`` is first marked as done, so loading
  leaves the allocator as the nanny set it.

(Switching the threshold back on a warm worker measures nothing: blocks then come from the
heap it already grew.) Runs go in ABBA order; paired ratios and medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _ab import script_header  # noqa: E402 - the benchmarks folder, put on the path above

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ARMS = ("stock", "kept")


def skip_allocator() -> None:
    """Mark this worker's allocator as set, so loading a model leaves it as the nanny did."""
    from dask_surge.models import allocator

    allocator._done.append(-1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--files", type=int, default=112)
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="default")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "allocator_ab_cpu.json"))
    args = parser.parse_args(argv)

    import dask.dataframe as dd
    from _realtext import small_files
    from distributed import Client, LocalCluster

    import dask_surge  # noqa: F401 - registers the .surge accessor

    data, layout = small_files(args.n, args.files, sigma=args.sigma)
    scratch = Path(tempfile.mkdtemp(prefix="allocator-ab-"))
    env: list = []

    def run(name: str) -> float:
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                          dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
            client.run(lambda: __import__("dask_surge.models.engine") and __import__("sentence_transformers") and None)
            env.extend(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values())
            if name == "stock":
                client.run(skip_allocator)
            t0 = time.perf_counter()
            dd.read_parquet(str(data)).surge.encode("text", output=str(scratch / f"{name}-{time.time_ns()}"),
                                                    model=args.model, device="cpu", progress=False,
                                                    scheduler=client)
            return time.perf_counter() - t0

    runs: dict[str, list[float]] = {name: [] for name in ARMS}
    for i in range(args.rounds):
        for name in ARMS[:: 1 if i % 2 == 0 else -1]:  # ABBA: no order effect
            runs[name].append(run(name))
            print(f"{name:6s} {runs[name][-1]:.2f} s", flush=True)
    paired = [s / k for s, k in zip(runs["stock"], runs["kept"])]
    out = {
        **script_header(argv),
        "layout": layout, "model": args.model, "workers": args.workers,
        "workers_MALLOC_TRIM_THRESHOLD_": sorted(set(map(str, env))),
        "runs_s": runs, "median_s": {k: statistics.median(v) for k, v in runs.items()},
        "paired_speedups_stock_over_kept": paired, "median_speedup": statistics.median(paired),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"stock {out['median_s']['stock']:.2f} s, kept {out['median_s']['kept']:.2f} s: "
          f"paired speedups {', '.join(f'{x:.3f}' for x in paired)} (median {out['median_speedup']:.3f})")
    return out


if __name__ == "__main__":
    main()
