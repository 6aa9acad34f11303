"""The same run written to an S3 endpoint and to a local disk, side by side, with the store's requests.

Usage::

    python -m benchmarks.store_output [--n 20000] [--files 200] [--b 2000] [--rounds 3] [--workers 2]
                                      [--out benchmarks/results/store_output.json]

Input: ``--n`` synthetic texts in ``--files`` local Parquet files of log-normal sizes. Encoder:
the random 2-layer BERT of ``make_tiny_model`` (compute-light, so the output path weighs
most). On one warm ``LocalCluster`` of ``--workers`` single-threaded workers, each round runs
``dd.read_parquet(src).surge.encode("text", output=...)`` once to a new local directory and
once to a new prefix of a moto S3 server on loopback (``ThreadedMotoServer``), alternating
which goes first. Reported per run: wall seconds from the call to the end, SuperBatches, and
for the S3 runs the store requests by operation (PUT, GET, HEAD, LIST, COPY, DELETE), counted
by wrapping ``s3fs.S3FileSystem._call_s3`` in the client and in every worker (``client.run``;
nothing of this is in the package). Summary: the median ratio S3 / local of the wall time
(loopback S3 is not a real store: this is the protocol's own overhead, not a network's) and
the requests per SuperBatch and per run.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

from . import _results

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_COUNTS: collections.Counter = collections.Counter()


def _count_requests() -> None:
    """Wrap s3fs's one request method in this process (idempotent), counting by operation."""
    import s3fs

    if getattr(s3fs.S3FileSystem._call_s3, "_counting", False):
        return
    real = s3fs.S3FileSystem._call_s3

    async def counting(fs, method, *args, **kwargs):
        _COUNTS[method] += 1
        return await real(fs, method, *args, **kwargs)

    counting._counting = True  # type: ignore[attr-defined]
    s3fs.S3FileSystem._call_s3 = counting


def _take_counts() -> dict:
    out = dict(_COUNTS)
    _COUNTS.clear()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--b", type=int, default=2000, help="b_min = b_max (sets the SuperBatch count)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(_results.RESULTS / "store_output.json"))
    args = parser.parse_args(argv)
    report = _results.new_report(__spec__.name if __spec__ else "benchmarks.store_output", argv, args)

    os.environ.update(CREDENTIALS)
    import dask.dataframe as dd
    import s3fs
    from distributed import Client, LocalCluster
    from moto.server import ThreadedMotoServer

    from benchmarks import store_output as this  # by reference, not by value as __main__'s functions would go
    from dask_surge.synthetic import lognormal_sizes, write_partitioned_parquet
    from dask_surge.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="store-output-"))
    src = work / "in"
    write_partitioned_parquet(
        src, [int(s) for s in lognormal_sizes(args.n, args.files, sigma=1.0, seed=1)], seed=2
    )
    model = make_tiny_model(work / "model")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
    }
    s3fs.S3FileSystem(**options).mkdir("bench")
    kw = {"model": model, "b_min": args.b, "b_max": args.b, "progress": False, "device": "cpu"}
    try:
        with (
            LocalCluster(
                n_workers=args.workers, threads_per_worker=1, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster) as client,
        ):
            this._count_requests()
            client.run(this._count_requests)
            dd.read_parquet(str(src)).surge.encode(
                "text", str(work / "warm"), **kw
            )  # models loaded, caches warm

            def run(where: str, i: int, b: int) -> dict:
                output = f"s3://bench/out{i}-{b}" if where == "s3" else str(work / f"out{i}")
                this._take_counts()
                client.run(this._take_counts)
                t0 = time.perf_counter()
                res = dd.read_parquet(str(src)).surge.encode(
                    "text",
                    output,
                    storage_options=options if where == "s3" else None,
                    **{**kw, "b_min": b, "b_max": b},
                )
                seconds = time.perf_counter() - t0
                requests = collections.Counter(this._take_counts())
                for counts in client.run(this._take_counts).values():
                    requests.update(counts)
                return {
                    "method": where,
                    "round": i,
                    "b": b,
                    "rows": res.rows,
                    "superbatches": res.superbatches,
                    "seconds": seconds,
                    "texts_per_s": res.rows / seconds,
                    "ttfo_s": res.ttfo_s,
                    "requests": dict(requests) if where == "s3" else {},
                }

            for i in range(args.rounds):
                order = ("s3", "local") if i % 2 else ("local", "s3")
                for where in order:
                    report["results"].append(run(where, i, args.b))
            halved = run("s3", args.rounds, args.b // 2)  # twice the SuperBatches: what one more costs
            halved["method"] = "s3-half-b"
            report["results"].append(halved)
    finally:
        server.stop()

    by = {w: [r for r in report["results"] if r["method"] == w] for w in ("local", "s3")}
    ratios = [s["seconds"] / loc["seconds"] for s, loc in zip(by["s3"], by["local"])]
    first, half = by["s3"][0], report["results"][-1]
    extra = max(1, half["superbatches"] - first["superbatches"])
    ops = sorted(set(first["requests"]) | set(half["requests"]))
    per_sb = {op: (half["requests"].get(op, 0) - first["requests"].get(op, 0)) / extra for op in ops}
    fixed = {op: first["requests"].get(op, 0) - per_sb[op] * first["superbatches"] for op in ops}
    report["summary"] = {
        "ratio_s3_over_local_seconds": statistics.median(ratios),
        "ratios": ratios,
        "superbatches": [first["superbatches"], half["superbatches"]],
        "requests_per_superbatch": per_sb,
        "requests_per_run_besides": fixed,
    }
    _results.save(report, args.out)
    print(
        f"S3 / local wall time: {report['summary']['ratio_s3_over_local_seconds']:.2f} (median of {len(ratios)}); "
        f"requests per SuperBatch {per_sb}; per run besides {fixed}"
    )
    return report


if __name__ == "__main__":
    main()
