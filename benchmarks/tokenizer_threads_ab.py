"""The Rust tokenizer's thread pool in CPU workers: every core per worker against each worker's share.

Usage::

    python -m benchmarks.tokenizer_threads_ab [--n 150000] [--files 1500] [--workers 2] [--rounds 5]
                                              [--forward noop|tiny]
                                              [--out benchmarks/results/tokenizer_threads_ab.json]

Two ``LocalCluster`` s of ``--workers`` single-threaded worker processes, both warm, on the same
texts (``--n`` docstring paragraphs in ``--files`` Parquet files, ``_realtext.py``):

- ``every_core``: the workers start with ``RAYON_NUM_THREADS`` set to this machine's cores, as
  each worker's tokenizer pool was sized before (a thread per core in every worker process);
- ``share``: nothing set; the encoder's worker plugin sizes each pool to the worker's share of
  the host's cores (:func:`dask_surge.execution.plugins.share_tokenizer_cores`).

Each round runs ``dd.read_parquet(dir).surge.encode("text", output=...)`` once on each cluster
(order alternating per round) and, with ``--forward noop`` (the forward replaced by zeros, as in
``host_ceiling.py``), the raw ``encode_batch`` of every text (the host ceiling's arm (a)) for
scale. ``--forward tiny`` runs the benchmarks' tiny encoder for real. Reported: texts/s per arm
(median of the rounds), the paired ratio share / every_core per round, and the CPU each arm
spends per text (the workers' processes, threads that ended included, and the client's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=150_000)
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forward", choices=("noop", "tiny"), default="noop")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.out = args.out or str(_results.RESULTS / "tokenizer_threads_ab.json")

    from distributed import Client, LocalCluster

    from dask_surge.execution.plugins import tokenizer_threads

    from ._noop_forward import register
    from ._realtext import read_texts, small_files, tiny_model
    from .host_ceiling import run_cpu, surge_run, tokenizer_run

    cores = len(os.sched_getaffinity(0))
    model = "default" if args.forward == "noop" else str(tiny_model())
    data, layout = small_files(args.n, args.files)
    texts = read_texts(data)
    warm = small_files(2000, 20, seed=1)[0]
    scratch = Path(tempfile.mkdtemp(prefix="tokenizer-threads-"))
    arms: dict[str, tuple] = {}
    report = _results.new_report(__spec__.name, argv, args)
    try:
        for name, env in (("every_core", {"RAYON_NUM_THREADS": str(cores)}), ("share", {})):
            cluster = LocalCluster(
                n_workers=args.workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address="127.0.0.1:0",
                env=env,
            )
            client = Client(cluster, set_as_default=False)
            if args.forward == "noop":
                register(client)  # the forward pass replaced by zeros in each worker: benchmark only
            surge_run(warm, client, scratch, model)  # the model loaded and the pool made before the clock
            arms[name] = (cluster, client)
        pools = {
            name: sorted(set(c.run(lambda: os.environ.get("RAYON_NUM_THREADS")).values()), key=str)
            for name, (_, c) in arms.items()
        }
        for r in range(args.rounds):
            if args.forward == "noop":
                report["results"].append(
                    {
                        "round": r,
                        "arm": "raw_tokenizer",
                        "seconds": tokenizer_run(texts),
                        "loadavg": os.getloadavg()[0],
                    }
                )
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                client = arms[name][1]
                (seconds, facts), cpu = run_cpu(client, lambda: surge_run(data, client, scratch, model))
                assert facts["rows"] == args.n, facts
                report["results"].append(
                    {
                        "round": r,
                        "arm": name,
                        "seconds": seconds,
                        "cpu_us_per_text": (cpu["workers"] + cpu["client"]) * 1e6 / args.n,
                        "worker_cpu_us_per_text": cpu["workers"] * 1e6 / args.n,
                        "loadavg": os.getloadavg()[0],
                    }
                )
                print(report["results"][-1], flush=True)
    finally:
        for cluster, client in arms.values():
            client.close()
            cluster.close()
        shutil.rmtree(scratch, ignore_errors=True)

    def of(arm: str, key: str) -> list[float]:
        return [x[key] for x in report["results"] if x["arm"] == arm]

    rate = {
        arm: args.n / statistics.median(of(arm, "seconds"))
        for arm in ("every_core", "share", *(("raw_tokenizer",) if args.forward == "noop" else ()))
    }
    paired = [b / a for a, b in zip(of("share", "seconds"), of("every_core", "seconds"))]
    report["summary"] = {
        "layout": layout,
        "cores": cores,
        "workers": args.workers,
        "share_threads_expected": tokenizer_threads(cores, args.workers),
        "rayon_num_threads_seen": pools,
        "texts_per_s": rate,
        "share_over_every_core": rate["share"] / rate["every_core"],
        "paired_share_over_every_core": paired,
        "share_faster_rounds": sum(p > 1 for p in paired),
        "cpu_us_per_text": {
            arm: statistics.median(of(arm, "cpu_us_per_text")) for arm in ("every_core", "share")
        },
        **(
            {
                "over_raw_tokenizer": {
                    arm: rate[arm] / rate["raw_tokenizer"] for arm in ("every_core", "share")
                }
            }
            if args.forward == "noop"
            else {}
        ),
    }
    out = _results.save(report, args.out)
    s = report["summary"]
    print(
        f"texts/s: every core {rate['every_core']:,.0f}, share {rate['share']:,.0f} "
        f"(x{s['share_over_every_core']:.3f}; paired {', '.join(f'{p:.3f}' for p in paired)}); CPU us/text "
        f"{s['cpu_us_per_text']['every_core']:.1f} -> {s['cpu_us_per_text']['share']:.1f}"
    )
    if args.forward == "noop":
        print(
            f"over the raw tokenizer: every core {s['over_raw_tokenizer']['every_core']:.3f}, "
            f"share {s['over_raw_tokenizer']['share']:.3f}"
        )
    return out


if __name__ == "__main__":
    main()
