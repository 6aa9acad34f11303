"""A part file's row groups: one per source partition against :func:`~dask_surge.io.partfiles.row_groups`.

Usage::

    python -m benchmarks.row_groups_ab [--rows 4100] [--partitions 153] [--sigma 1.72] [--dims 32,384] [--rounds 7]
                                       [--out benchmarks/results/row_groups_ab.json]

One SuperBatch's output table as a run writes it (``partition``, ``row``, ``doc_id``,
``text_hash``, a float32 ``embedding`` of each of ``--dims``), over source partitions of
``--partitions`` source partitions of log-normal sizes (sigma 1.72: a median of a few rows,
as ``e2e_small_files.py``'s many small files), serialized by :func:`~dask_surge.io.partfiles.parquet_bytes` (the in-memory
Parquet write, no disk) in three layouts, alternated in each round on the same table:

- ``per_partition``: a row group per source partition (the layout before);
- ``row_groups``: whole partitions gathered to at least ``ROW_GROUP_ROWS`` rows (shipped);
- ``one``: one row group for the file (the floor of what grouping can save).

Reported per dimension: median microseconds per row of each layout, the file's bytes, and
the ratio per_partition / row_groups.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa

from . import _results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=4100, help="rows of the SuperBatch (default 4100)")
    parser.add_argument(
        "--partitions",
        type=int,
        default=153,
        help="source partitions in it (default 153: e2e_small_files' 2,237 files per 60,000 rows)",
    )
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--dims", default="32,384")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(_results.RESULTS / "row_groups_ab.json"))
    args = parser.parse_args(argv)

    from dask_surge.io.arrow import embedding_array
    from dask_surge.io.partfiles import ROW_GROUP_ROWS, parquet_bytes, row_groups
    from dask_surge.synthetic import lognormal_sizes

    report = _results.new_report(__spec__.name, argv, args)
    rng = np.random.default_rng(0)
    n = args.rows
    sizes = np.asarray(lognormal_sizes(n, args.partitions, sigma=args.sigma, seed=0), dtype=np.int64)
    sizes = sizes[sizes > 0]
    partition = np.repeat(np.arange(len(sizes)), sizes)
    row = np.concatenate([np.arange(s) for s in sizes])
    layouts = {"per_partition": sizes.tolist(), "row_groups": row_groups(sizes), "one": [n]}
    for dim in (int(d) for d in args.dims.split(",")):
        table = pa.table(
            {
                "partition": partition.astype(np.int64),
                "row": row.astype(np.int64),
                "doc_id": np.arange(n),
                "text_hash": pa.array([rng.bytes(16) for _ in range(n)], pa.binary(16)),
                "embedding": embedding_array(rng.standard_normal((n, dim)).astype(np.float32)),
            }
        )
        seconds: dict[str, list[float]] = {k: [] for k in layouts}
        size: dict[str, int] = {}
        for name, groups in layouts.items():  # warm-up
            size[name] = len(parquet_bytes(table, groups))
        for r in range(args.rounds):
            order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
            for name in order:
                t0 = time.perf_counter()
                parquet_bytes(table, layouts[name])
                seconds[name].append(time.perf_counter() - t0)
        per_row = {k: statistics.median(v) / n * 1e6 for k, v in seconds.items()}
        for name in layouts:
            report["results"].append(
                {
                    "dim": dim,
                    "layout": name,
                    "row_groups": len(layouts[name]),
                    "us_per_row": per_row[name],
                    "bytes": size[name],
                }
            )
            print(
                f"dim {dim:4d} {name:14s} {len(layouts[name]):5d} groups {per_row[name]:7.2f} us/row "
                f"{size[name]:10,d} bytes",
                flush=True,
            )
        report["summary"][f"dim{dim}"] = {
            "partitions": len(sizes),
            "floor": ROW_GROUP_ROWS,
            "ratio_per_partition_over_row_groups": per_row["per_partition"] / per_row["row_groups"],
            "bytes_ratio_per_partition_over_row_groups": size["per_partition"] / size["row_groups"],
        }
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
