"""A/B: the small first SuperBatch (``surge.first-superbatch``) against none, end to end on small files.

Usage::

    python -m benchmarks.first_superbatch_ab [--n 60000] [--files 2237] [--rounds 2] [--first 256]
                                             [--out benchmarks/results/first_superbatch_ab.json]

The workload and the measurement are ``benchmarks/e2e_small_files.py``'s ``surge`` run (the
tiny random-weight BERT, real texts in many small Parquet files, a fresh 2-worker cluster
per run with the model loaded inside the clock), with ``surge.first-superbatch`` at
``--first`` rows (a ramp: thresholds doubling up to ``b_min``) or ``None`` (``b_min`` from
the start), set through ``DASK_SURGE__FIRST_SUPERBATCH`` in the run's process. Runs
alternate ABBA per round; medians of the run time and the time to the first committed
file are reported with their ratios. What the ramp should show: an earlier first output
at no cost in throughput (a few more, smaller SuperBatches).
"""

from __future__ import annotations

import argparse
import os
import statistics

from . import _results
from . import e2e_small_files as e2e

ENV = "DASK_SURGE__FIRST_SUPERBATCH"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--files", type=int, default=2237)
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--first", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(_results.RESULTS / "first_superbatch_ab.json"))
    args = parser.parse_args(argv)

    from ._realtext import small_files, tiny_model

    tiny = tiny_model()
    data, layout = small_files(args.n, args.files, sigma=args.sigma)
    report = _results.new_report(__spec__.name, argv, args)
    arms = {"ramp": str(args.first), "none": "None"}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    before = os.environ.get(ENV)
    try:
        for k in range(args.rounds):
            for arm in ("ramp", "none", "none", "ramp") if k % 2 == 0 else ("none", "ramp", "ramp", "none"):
                os.environ[ENV] = arms[arm]  # the run's process reads it (dask config from the environment)
                r = e2e.measure("surge", str(tiny), data, args.workers)
                assert r["rows"] == args.n, r
                r = {"arm": arm, "first_superbatch": arms[arm], "loadavg": list(os.getloadavg()), **r}
                runs[arm].append(r)
                report["results"].append(r)
                print(
                    f"{arm:5s} {args.n / r['seconds']:8,.0f} texts/s ({r['seconds']:.2f} s), first output "
                    f"{r['ttfo_s']:.2f} s, {r['superbatches']} SuperBatches",
                    flush=True,
                )
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
    med = {
        arm: {
            "seconds": statistics.median(r["seconds"] for r in rs),
            "ttfo_s": statistics.median(r["ttfo_s"] for r in rs),
        }
        for arm, rs in runs.items()
    }
    report["summary"] = {
        "layout": layout,
        "medians": med,
        "throughput_ratio_ramp_over_none": med["none"]["seconds"] / med["ramp"]["seconds"],
        "ttfo_ratio_ramp_over_none": med["ramp"]["ttfo_s"] / med["none"]["ttfo_s"],
    }
    print(
        f"throughput ramp/none {report['summary']['throughput_ratio_ramp_over_none']:.2f}, "
        f"first output ramp/none {report['summary']['ttfo_ratio_ramp_over_none']:.2f}"
    )
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
