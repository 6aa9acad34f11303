"""Units of an in-memory input submitted with a name against a graph Dask tokenizes.

Usage::

    python -m benchmarks.unit_submit [--texts 40000] [--partitions 1000] [--workers 2]
                                     [--rounds 3] [--out benchmarks/results/unit_submit.json]

``ddf.surge.encode(..., output=...)`` of ``--texts`` synthetic texts in ``--partitions``
log-normal pandas partitions (``dd.from_pandas``: the partitions' data is in the graph), on a
``LocalCluster`` of ``--workers`` single-threaded workers, the tiny random BERT model, b_min 256,
b_max 1024. Two arms, alternating ABBA by round, each run a new output:

- ``named``: each unit's graph is submitted as ``named_graph(graph, key)`` (what runs do);
- ``tokenized``: the graph dict is submitted as it was before, so ``Client.get`` wraps it in
  an expression whose name Dask computes by tokenizing the graph (pickling its data).

Reported per run: wall seconds of the encode call and the client process's CPU seconds during it
(``time.process_time``: the scheduler and workers are other processes), medians per arm and
the ratios tokenized / named. The machine's load is recorded with each run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from . import _results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=40_000)
    ap.add_argument("--partitions", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(_results.RESULTS / "unit_submit.json"))
    args = ap.parse_args(argv)
    report = _results.new_report(__spec__.name if __spec__ else "benchmarks.unit_submit", argv, args)

    from distributed import Client, LocalCluster

    from dask_surge.execution import scheduling
    from dask_surge.synthetic import lognormal_sizes, make_partitioned_frame
    from dask_surge.testing import make_tiny_model

    named = scheduling.named_graph
    arms = {"named": named, "tokenized": lambda graph, token: graph}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["DASK_SURGE_CACHE_DIR"] = str(work / "cache")
        model = str(make_tiny_model(work / "model"))
        with (
            LocalCluster(
                n_workers=args.workers, threads_per_worker=1, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster),
        ):
            sizes = lognormal_sizes(args.texts, args.partitions, sigma=1.72, seed=1)
            warm = make_partitioned_frame(sizes.tolist(), seed=0)  # model load, imports: not timed
            warm.surge.encode("text", output=str(work / "warm"), model=model, progress=False)
            run = 0
            for r in range(args.rounds):
                for arm in ("named", "tokenized") if r % 2 == 0 else ("tokenized", "named"):
                    ddf = make_partitioned_frame(sizes.tolist(), seed=100 + run)
                    scheduling.named_graph = arms[arm]
                    try:
                        load = os.getloadavg()[0]
                        c0, t0 = time.process_time(), time.perf_counter()
                        result = ddf.surge.encode(
                            "text",
                            output=str(work / f"out-{run}"),
                            model=model,
                            b_min=256,
                            b_max=1024,
                            progress=False,
                        )
                        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    finally:
                        scheduling.named_graph = named
                    assert result.rows == args.texts
                    rec = {"arm": arm, "round": r, "wall_s": round(wall, 3), "client_cpu_s": round(cpu, 3)}
                    rec["load_1min"] = round(load, 2)
                    report["results"].append(rec)
                    print(rec, flush=True)
                    run += 1
    med = {
        arm: {
            k: statistics.median(x[k] for x in report["results"] if x["arm"] == arm)
            for k in ("wall_s", "client_cpu_s")
        }
        for arm in arms
    }
    report["summary"] = {
        "medians": med,
        "tokenized_over_named": {
            k: round(med["tokenized"][k] / med["named"][k], 3) for k in ("wall_s", "client_cpu_s")
        },
    }
    _results.save(report, args.out)
    print(report["summary"])
    return report


if __name__ == "__main__":
    main()
