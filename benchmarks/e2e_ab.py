"""``e2e_small_files``' surge run, this checkout against a base git revision, side by side.

Usage::

    python -m benchmarks.e2e_ab --base REV [--n 60000] [--files 2237] [--sigma 1.72] [--rounds 4]
                                [--workers 2] [--model tiny|minilm]
                                [--out benchmarks/results/e2e_ab.json]

A change to the engine or the run that matters on a cold cluster (what a first call meets:
the model loading, the first shapes, the heap growing) needs fresh processes on both sides:
each measurement is this checkout's ``python -m benchmarks.e2e_small_files --one surge`` (a
new ``LocalCluster`` of ``--workers`` single-threaded workers, its imports before the clock,
the model loaded inside it) with the base revision's ``dask_surge`` (a ``git worktree``) or
this one's first on ``PYTHONPATH``, alternating which goes first in each round. Reported: each
run's seconds, the workers' and client's CPU seconds, the workers' minor page faults; the
summary gives medians and the median of the paired ratios base/this for seconds and for
the workers' CPU (> 1: this checkout is faster, or spends less).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from . import _ab, _results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="git revision to compare with (e.g. HEAD~1)")
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--files", type=int, default=2237)
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=("tiny", "minilm"), default="tiny")
    parser.add_argument("--out", default=str(_results.RESULTS / "e2e_ab.json"))
    args = parser.parse_args(argv)

    from dask_surge.testing import packaged_model_dir

    from ._realtext import small_files, tiny_model

    if args.model == "tiny":
        model = tiny_model()
    else:
        model = packaged_model_dir()
    data, layout = small_files(args.n, args.files, sigma=args.sigma)
    report = _results.new_report(__spec__.name, argv, args)
    report["summary"]["layout"] = layout
    runs: dict[str, list[dict]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp, _ab.base_checkout(args.base, Path(tmp)) as base_src:
        # the harness is this checkout's on both sides (a folder holding only ``benchmarks``, run from);
        # the library is the variant's, first on PYTHONPATH (LocalCluster's workers inherit the path)
        harness = Path(tmp) / "harness"
        harness.mkdir()
        (harness / "benchmarks").symlink_to(_ab.ROOT / "benchmarks")
        for r, order in enumerate(_ab.alternating(args.rounds, base_src)):
            for name, src in order:
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.e2e_small_files",
                    "--one",
                    "surge",
                    "--model-path",
                    str(model),
                    "--data",
                    str(data),
                    "--workers",
                    str(args.workers),
                ]
                env = dict(os.environ, PYTHONPATH=src)
                rec = _results.run_one(cmd, what=name, env=env, cwd=str(harness))
                assert rec["rows"] == args.n, rec
                runs[name].append(rec)
                report["results"].append({"variant": name, "round": r, **rec})
                print(
                    f"{name:4s} {args.n / rec['seconds']:9,.0f} texts/s  ({rec['seconds']:.2f} s; workers' CPU "
                    f"{rec['workers_cpu_s']:.2f} s)",
                    flush=True,
                )

    def medians(key: str) -> dict[str, float]:
        return {name: statistics.median(r[key] for r in rs) for name, rs in runs.items()}

    def paired(key: str) -> list[float]:
        return [b[key] / t[key] for b, t in zip(runs["base"], runs["this"])]

    report["summary"].update(
        {
            "model": str(model),
            "base": args.base,
            "median_seconds": medians("seconds"),
            "median_workers_cpu_s": medians("workers_cpu_s"),
            "median_workers_minflt": medians("workers_minflt"),
            "paired_speedup": [round(x, 3) for x in paired("seconds")],
            "speedup": statistics.median(paired("seconds")),
            "workers_cpu_ratio": statistics.median(paired("workers_cpu_s")),
        }
    )
    print(
        f"this / base: {report['summary']['speedup']:.2f}x faster (paired median); workers' CPU "
        f"base/this {report['summary']['workers_cpu_ratio']:.2f}",
        flush=True,
    )
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
