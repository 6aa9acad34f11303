"""A written encode of an input whose upstream is as costly as the encode: this checkout
against a base git revision, side by side.

Usage::

    python benchmarks/one_pass_ab.py [--base 32b0d6c] [--rounds 3] [--rows 6000] [--partitions 300]
                                     [--upstream-ms-per-row 6.0] [--b-min 256] [--b-max 1024]
                                     [--out benchmarks/results/one_pass_ab_cpu.json]

The input is ``make_partitioned_frame`` (log-normal partition sizes, sigma 1.72, ``dd.from_map``
over in-memory frames: Dask does not know the partition sizes) followed by a ``map_partitions``
step that sleeps ``--upstream-ms-per-row`` per row, standing in for a cleaning or join step, and
appends one line per call to a file, so the JSON also says how many times the upstream ran per
partition. Before the one-pass change, ``encode(..., output=...)`` sized such an input with a
``len`` pass (the upstream ran twice); now it streams it (once).

Each round runs both variants, in alternating order, each in a fresh process with its own
2-worker ``LocalCluster`` (1 thread each), ``PYTHONPATH`` pointing at its source tree, the tiny
random-weight BERT, into a fresh output directory. The JSON holds every time, the ratio per
round (base / this checkout), its median, the upstream calls per partition, the machine and the
exact command line.
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


def upstream(part, log, seconds_per_row):
    with open(log, "a") as f:
        f.write("x\n")
    time.sleep(seconds_per_row * len(part))
    return part


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    import dask_surge
    from dask_surge.testing import lognormal_sizes, make_partitioned_frame

    assert os.path.dirname(dask_surge.__file__).startswith(spec["src"]), dask_surge.__file__
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        sizes = lognormal_sizes(spec["rows"], spec["partitions"], sigma=1.72, seed=7)
        ddf = make_partitioned_frame(sizes, seed=7)
        ddf = ddf.map_partitions(upstream, spec["log"], spec["ms"] / 1000, meta=ddf._meta)
        t0 = time.perf_counter()
        res = ddf.surge.encode("text", spec["out"], model=spec["model"], device="cpu", b_min=spec["b_min"],
                               b_max=spec["b_max"], progress=False)
        seconds = time.perf_counter() - t0
    with open(spec["log"]) as f:
        calls = sum(1 for _ in f)
    assert res.rows == int(sizes.sum()), (res.rows, int(sizes.sum()))
    print(json.dumps({"seconds": seconds, "ttfo_s": res.ttfo_s, "superbatches": res.superbatches,
                      "upstream_calls": calls, "partitions": len(sizes), "sizes_source": res.sizes_source}))
"""


def run_variant(src: str, spec: dict, tmp: str, name: str) -> dict:
    work = tempfile.mkdtemp(prefix=f"{name}-", dir=tmp)
    return run_child(CHILD, src, dict(spec, out=str(Path(work) / "out"), log=str(Path(work) / "calls")))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="32b0d6c", help="git revision to compare with (default: before one pass)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=6_000)
    parser.add_argument("--partitions", type=int, default=300)
    parser.add_argument("--upstream-ms-per-row", type=float, default=6.0)
    parser.add_argument("--b-min", type=int, default=256)
    parser.add_argument("--b-max", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/one_pass_ab_cpu.json")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from dask_surge.testing import make_tiny_model

    report = new_report(base=args.base, this=this_revision(), rounds=[])
    with tempfile.TemporaryDirectory() as tmp, base_checkout(args.base, Path(tmp)) as base_src:
        spec = {"model": str(make_tiny_model(Path(tmp) / "tiny")), "rows": args.rows,
                "partitions": args.partitions, "b_min": args.b_min, "b_max": args.b_max,
                "ms": args.upstream_ms_per_row}
        for r, order in enumerate(alternating(args.rounds, base_src)):
            got = {name: run_variant(src, spec, tmp, name) for name, src in order}
            ratio = got["base"]["seconds"] / got["this"]["seconds"]
            report["rounds"].append({"order": [n for n, _ in order], **got, "base_over_this": ratio})
            print(f"round {r}: base {got['base']['seconds']:.2f} s "
                  f"({got['base']['upstream_calls']} upstream calls, first output {got['base']['ttfo_s']:.2f} s), "
                  f"this {got['this']['seconds']:.2f} s ({got['this']['upstream_calls']} upstream calls, "
                  f"first output {got['this']['ttfo_s']:.2f} s): {ratio:.2f}x", flush=True)
    return finish(report, args.out)

if __name__ == "__main__":
    main()
