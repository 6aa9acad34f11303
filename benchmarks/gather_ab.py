"""A SuperBatch's rows gathered from a unit's Parquet files: per-partition pandas slices against one frame's views.

Usage::

    python -m benchmarks.gather_ab [--n 60000] [--files 2237] [--sigma 1.72] [--b-min 4096] [--b-max 8192]
                                   [--rounds 5] [--out benchmarks/results/gather_ab.json]

A unit's Parquet files are read into one pandas frame
(:class:`~dask_surge.io.parquet.ParquetPartitions`); this times what a SuperBatch task does
with it on the host before and around the model, in this process, with the model replaced by
a constant callable: the partitions handed on, the SuperBatch's texts and ``keep=["doc_id"]``
gathered, hashed and built into the output frame (``SuperBatchTask.encode``). Two arms, on
the same frame and the same plan (``plan_superbatches(sizes, --b-min, --b-max)``), ABBA by round:

- ``sliced``: a pandas slice per partition, as ``ParquetPartitions.iterate`` hands them on
  (and as every partition was handed on before);
- ``rows``: a :class:`~dask_surge.io.frames.FrameRows` view per partition
  (``ParquetPartitions.rows``, what a unit's task now gets), a SuperBatch sliced once.

Input: ``--n`` real texts (docstring paragraphs, ``_realtext.py``) in ``--files`` Parquet files of
log-normal sizes (sigma 1.72, a median of a few rows: ``e2e_small_files.py``'s layout). Reported:
the thread's CPU microseconds per text (about the time it holds the GIL: all of it is Python and
pandas) and the wall time per text, medians of the rounds, and the ratio sliced / rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

from . import _results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--files", type=int, default=2237)
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--b-min", type=int, default=4096)
    parser.add_argument("--b-max", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(_results.RESULTS / "gather_ab.json"))
    args = parser.parse_args(argv)

    import dask.dataframe as dd
    import numpy as np

    from dask_surge import Encoder
    from dask_surge.execution.inputs import task_arguments
    from dask_surge.execution.superbatch import SuperBatchTask
    from dask_surge.io.parquet import ParquetPartitions
    from dask_surge.planning.policy import plan_superbatches

    from ._realtext import small_files

    data, layout = small_files(args.n, args.files, sigma=args.sigma)
    reader = ParquetPartitions.of(dd.read_parquet(str(data)).expr)
    assert reader is not None, "a plain read_parquet of local files"
    partitions = sorted(reader.pieces)
    views = dict(reader.rows(partitions))
    sizes = [len(views[p]) for p in partitions]
    plan = plan_superbatches(sizes, args.b_min, args.b_max)
    planned = dict(zip(partitions, sizes))
    tasks = [task_arguments(sb, planned) for sb in plan]
    sbe = SuperBatchTask("text", ("doc_id",), Encoder(lambda texts: np.zeros((len(texts), 4), np.float32)))

    def run(arm: str) -> tuple[float, float, int]:
        c0, t0 = time.thread_time(), time.perf_counter()
        held = views if arm == "rows" else {p: v.sliced() for p, v in views.items()}
        rows = 0
        for inputs, spans in tasks:
            rows += len(sbe.encode([held[p] for p in inputs], spans).frame)
        return time.perf_counter() - t0, time.thread_time() - c0, rows

    report = _results.new_report(__spec__.name, argv, args)
    arms = ("sliced", "rows")
    for arm in arms:  # warm-up
        run(arm)
    seen: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            wall, cpu, rows = run(arm)
            assert rows == args.n, (arm, rows)
            seen[arm].append((wall, cpu))
            report["results"].append(
                {"round": r, "arm": arm, "wall_s": wall, "thread_cpu_s": cpu, "rows": rows}
            )
    per_text = {
        a: {
            "wall_us_per_text": statistics.median(w for w, _ in v) / args.n * 1e6,
            "thread_cpu_us_per_text": statistics.median(c for _, c in v) / args.n * 1e6,
        }
        for a, v in seen.items()
    }
    report["summary"] = {
        "layout": layout,
        "superbatches": len(plan),
        **per_text,
        "ratio_sliced_over_rows_cpu": per_text["sliced"]["thread_cpu_us_per_text"]
        / per_text["rows"]["thread_cpu_us_per_text"],
    }
    for a in arms:
        print(
            f"{a:7s} thread CPU {per_text[a]['thread_cpu_us_per_text']:6.2f} us/text   "
            f"wall {per_text[a]['wall_us_per_text']:6.2f} us/text"
        )
    print(
        f"sliced / rows (thread CPU): {report['summary']['ratio_sliced_over_rows_cpu']:.2f}x "
        f"over {len(plan)} SuperBatches of {args.n:,} texts in {args.files:,} files"
    )
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
