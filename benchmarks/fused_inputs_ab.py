"""SURGE on a non-Parquet input: this checkout against a base git revision, side by side.

Usage::

    python benchmarks/fused_inputs_ab.py [--base a96d4d8] [--rounds 3] [--repeats 3] [--rows 20000]
                                         [--partitions 2000] [--b-min 256] [--b-max 1024]
                                         [--out benchmarks/results/fused_inputs_ab_cpu.json]

Measures what fusing input partitions into the SuperBatch tasks changed (``FusedSuperBatchExpr``,
this checkout) against the revision ``--base`` (before it: one task per input partition feeding
the SuperBatch tasks). The base is checked out with ``git worktree`` into a temporary folder.

Each round runs both variants, in alternating order, each in a fresh process with its own
2-worker ``LocalCluster`` (1 thread each) and ``PYTHONPATH`` pointing at its source tree. A
process builds the same input (``make_partitioned_frame``: log-normal partition sizes,
sigma 1.72, ``dd.from_map`` over in-memory pandas frames, so every partition is a task of
the input graph), encodes it with the tiny random-weight BERT (compute-light: per-task
overhead weighs as on a GPU) through ``ddf.surge.encode(...).compute()`` once to warm up,
then times ``--repeats`` runs and reports the best. The JSON holds every time, the ratio
per round (base / this checkout) and its median, the machine and the exact command line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab import ROOT, alternating, base_checkout, finish, new_report, run_child, this_revision  # noqa: E402

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from distributed import Client, LocalCluster

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    import dask_surge
    from dask_surge import Encoder
    from dask_surge.execution.plugins import register_encoder
    from dask_surge.testing import lognormal_sizes, make_partitioned_frame

    assert os.path.dirname(dask_surge.__file__).startswith(spec["src"]), dask_surge.__file__
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        enc = Encoder(spec["model"], device="cpu")
        register_encoder(client, enc)
        sizes = lognormal_sizes(spec["rows"], spec["partitions"], sigma=1.72, seed=7)
        ddf = make_partitioned_frame(sizes, seed=7)
        lazy = ddf.surge.encode("text", model=enc, b_min=spec["b_min"], b_max=spec["b_max"])
        graph_tasks = len(lazy.optimize().__dask_graph__())
        rows = len(client.compute(lazy, sync=True))  # warm-up (and a row count check)
        assert rows == int(sizes.sum()), (rows, int(sizes.sum()))
        times = []
        for _ in range(spec["repeats"]):
            # the last result may still be held: wait until the scheduler forgot it, or the
            # next compute only gathers it again
            while client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
                time.sleep(0.05)
            t0 = time.perf_counter()
            client.compute(lazy, sync=True)
            times.append(time.perf_counter() - t0)
    print(json.dumps({"times_s": times, "graph_tasks": graph_tasks, "superbatches": lazy.npartitions}))
"""


def run_variant(src: str, spec: dict) -> dict:
    return run_child(CHILD, src, spec)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="a96d4d8", help="git revision to compare with (default: before fusing)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=2_000)
    parser.add_argument("--b-min", type=int, default=256)
    parser.add_argument("--b-max", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/fused_inputs_ab_cpu.json")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from dask_surge.testing import make_tiny_model

    report = new_report(base=args.base, this=this_revision(), rounds=[])
    with tempfile.TemporaryDirectory() as tmp, base_checkout(args.base, Path(tmp)) as base_src:
        spec = {"model": str(make_tiny_model(Path(tmp) / "tiny")), "rows": args.rows,
                "partitions": args.partitions, "b_min": args.b_min, "b_max": args.b_max,
                "repeats": args.repeats}
        for r, order in enumerate(alternating(args.rounds, base_src)):
            got = {name: run_variant(src, spec) for name, src in order}
            ratio = min(got["base"]["times_s"]) / min(got["this"]["times_s"])
            report["rounds"].append({"order": [n for n, _ in order], **got, "base_over_this": ratio})
            print(f"round {r}: base {min(got['base']['times_s']):.2f} s ({got['base']['graph_tasks']} tasks), "
                  f"this {min(got['this']['times_s']):.2f} s ({got['this']['graph_tasks']} tasks): "
                  f"{ratio:.2f}x", flush=True)
    return finish(report, args.out)

if __name__ == "__main__":
    main()
