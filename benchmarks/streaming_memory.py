"""Peak worker memory of a streamed encode as the input grows: it should stay flat.

Usage::

    python -m benchmarks.streaming_memory [--rows 25000 100000 400000 1600000] [--rows-per-partition 100]
                                           [--b-min 2000] [--b-max 8000]
                                           [--out benchmarks/results/streaming_memory.json]

The input is ``dd.from_map`` over partition numbers, each partition generating its texts
(``make_texts``, seeded by its number) when computed: Dask does not know its sizes, so
``encode(..., output=...)`` streams it, and the task graph carries no data. The model is
``dask_surge.testing.checksum_model`` (no weights), so what is measured is what the run
holds: partitions buffered until a SuperBatch closes, the SuperBatch's output, the units in
flight (``surge.in-flight``). A thread samples every worker's resident memory (RSS) every
50 ms; the report gives each worker's peak above its RSS before the run, per input size, on
one 2-worker ``LocalCluster`` (1 thread each) reused for every size, smallest first, after
one unrecorded warm-up run (the first run imports the model stack on the workers).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from . import _results


def make_partition(i: int, rows: int):
    import pandas as pd

    from dask_surge.testing import make_texts

    return pd.DataFrame(
        {
            "text": pd.array(make_texts(rows, seed=i), dtype="string[pyarrow]"),
            "doc_id": range(i * rows, (i + 1) * rows),
        }
    )


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[25_000, 100_000, 400_000, 1_600_000])
    parser.add_argument("--rows-per-partition", type=int, default=100)
    parser.add_argument("--b-min", type=int, default=2_000)
    parser.add_argument("--b-max", type=int, default=8_000)
    parser.add_argument("--out", default="benchmarks/results/streaming_memory.json")
    args = parser.parse_args(argv)

    import functools

    import dask.dataframe as dd
    from distributed import Client, LocalCluster

    import dask_surge  # noqa: F401  (registers .surge)
    from dask_surge.testing import checksum_model

    report = _results.new_report(__spec__.name, argv, args)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
        tempfile.TemporaryDirectory() as tmp,
    ):
        # warm-up, not recorded: the first run imports the model stack on the workers (~480 MiB)
        warm = dd.from_map(
            functools.partial(make_partition, rows=args.rows_per_partition), range(20), enforce_metadata=False
        )
        warm.surge.encode(
            "text",
            str(Path(tmp) / "warm-up"),
            model=checksum_model,
            b_min=args.b_min,
            b_max=args.b_max,
            progress=False,
        )
        for rows in sorted(args.rows):
            parts = rows // args.rows_per_partition
            ddf = dd.from_map(
                functools.partial(make_partition, rows=args.rows_per_partition),
                range(parts),
                enforce_metadata=False,
            )
            client.run(__import__("gc").collect)
            before = client.run(_rss)
            peaks = dict(before)
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    for addr, rss in client.run(_rss).items():
                        peaks[addr] = max(peaks.get(addr, 0), rss)
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.perf_counter()
            res = ddf.surge.encode(
                "text",
                str(Path(tmp) / f"out-{rows}"),
                model=checksum_model,
                b_min=args.b_min,
                b_max=args.b_max,
                progress=False,
            )
            seconds = time.perf_counter() - t0
            stop.set()
            sampler.join()
            assert res.rows == parts * args.rows_per_partition and res.sizes_source == "streamed"
            growth = {addr: peaks[addr] - before[addr] for addr in before}
            run = {
                "rows": res.rows,
                "partitions": parts,
                "superbatches": res.superbatches,
                "seconds": seconds,
                "peak_rss_growth_bytes": growth,
                "max_peak_rss_growth_bytes": max(growth.values()),
            }
            report["results"].append(run)
            print(
                f"{res.rows:>9,} rows in {parts:,} partitions, {res.superbatches} SuperBatches, {seconds:.1f} s: "
                f"peak worker RSS +{max(growth.values()) / 2**20:.1f} MiB",
                flush=True,
            )
    first, last = report["results"][0], report["results"][-1]
    report["summary"] = {
        "growth_ratio_last_over_first": (
            last["max_peak_rss_growth_bytes"] / max(1, first["max_peak_rss_growth_bytes"])
        ),
        "rows_ratio_last_over_first": last["rows"] / first["rows"],
    }
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
