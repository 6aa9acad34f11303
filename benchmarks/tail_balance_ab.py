"""A/B: an automatic b_min balanced over the worker threads, against the unbalanced one.

Usage::

    python benchmarks/tail_balance_ab.py [--n 3000] [--files 112] [--sigma 1.72] [--rounds 4]
                                         [--model default] [--workers 2]
                                         [--out benchmarks/results/tail_balance_ab_cpu.json]

``dd.read_parquet(dir).surge.encode("text", output=..., device="cpu")`` on ``--n`` real texts
(``_realtext.py``) in ``--files`` Parquet files, on one warm ``LocalCluster`` of ``--workers``
single-threaded workers (the model loaded by a first run before the clock), alternating:

- ``plain``: ``b_min`` = what ``"auto"`` resolves to without balancing (every thread gets 4
  SuperBatches: ``ceil(N / (4 x threads))``), passed explicitly;
- ``balanced``: ``b_min="auto"``, which also picks, among values down to half of that,
  the one whose plan ends soonest when the threads take SuperBatches in order
  (:func:`dask_surge.planning.thresholds.balanced_b_min`, work = text bytes + 8 a row).

Reports each round's seconds, the paired ratios and the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _ab import script_header  # noqa: E402 - the benchmarks folder, put on the path above

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--files", type=int, default=112)
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", default="default")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "tail_balance_ab_cpu.json"))
    args = parser.parse_args(argv)

    import dask.dataframe as dd
    from _realtext import small_files
    from distributed import Client, LocalCluster

    import dask_surge  # noqa: F401 - registers the .surge accessor
    from dask_surge.planning.thresholds import MIN_SUPERBATCHES_PER_WORKER

    data, layout = small_files(args.n, args.files, sigma=args.sigma)
    plain_b_min = math.ceil(args.n / (MIN_SUPERBATCHES_PER_WORKER * args.workers))
    scratch = Path(tempfile.mkdtemp(prefix="tail-balance-"))
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                           dashboard_address="127.0.0.1:0")
    client = Client(cluster)

    def run(name: str, b_min) -> dict:
        t0 = time.perf_counter()
        res = dd.read_parquet(str(data)).surge.encode("text", output=str(scratch / f"{name}-{time.time_ns()}"),
                                                      model=args.model, device="cpu", b_min=b_min,
                                                      progress=False, scheduler=client)
        seconds = time.perf_counter() - t0
        starts = sorted(r["started_at"] for r in res.records)
        ends = sorted(r["committed_at"] for r in res.records)
        return {"seconds": seconds, "superbatches": res.superbatches, "rows": res.rows,
                "last_two_ends_apart_s": ends[-1] - ends[-2] if len(ends) > 1 else 0.0,
                "first_start_to_last_end_s": ends[-1] - starts[0]}

    runs: dict[str, list] = {"plain": [], "balanced": []}
    try:
        run("warm", None)  # loads the model on every worker before the clock
        for _ in range(args.rounds):
            runs["plain"].append(run("plain", plain_b_min))
            runs["balanced"].append(run("balanced", None))
    finally:
        client.close()
        cluster.close()
    paired = [p["seconds"] / b["seconds"] for p, b in zip(runs["plain"], runs["balanced"])]
    out = {
        **script_header(argv),
        "layout": layout, "model": args.model, "workers": args.workers, "plain_b_min": plain_b_min,
        "runs": runs,
        "median_s": {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()},
        "paired_speedups_plain_over_balanced": paired,
        "median_speedup": statistics.median(paired),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"plain b_min={plain_b_min}: {out['median_s']['plain']:.2f} s, balanced: {out['median_s']['balanced']:.2f} s, "
          f"paired speedups {', '.join(f'{x:.3f}' for x in paired)} (median {out['median_speedup']:.3f})")
    return out


if __name__ == "__main__":
    main()
