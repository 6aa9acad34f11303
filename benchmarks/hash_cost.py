"""Cost of a SuperBatch's text hashing and de-duplication (issue 25: "< 3% slower on a corpus without repeats").

Usage::

    python -m benchmarks.hash_cost [--n 100000] [--files 1000] [--tiny-n 40000] [--rounds 6]
                                   [--workers 2] [--out benchmarks/results/hash_cost.json]

Every SuperBatch hashes its texts (:func:`dask_surge.io.hashing.text_hashes`, XXH3-128),
de-duplicates them (:func:`dask_surge.execution.superbatch.distinct`) before encoding and
writes a ``text_hash`` column. This script measures what that costs end to end, side by
side on the same warm cluster, alternating the two variants (ABBA order):

- ``hashed``: the code as shipped;
- ``bypassed``: the same code with, in the workers only, ``text_hashes`` replaced by a
  constant-time stand-in (row numbers as hashes: every text distinct), ``distinct`` by the
  identity, and the ``text_hash`` column dropped before the Parquet write (monkeypatched
  through ``client.run``; nothing of this is in the package).

Input: ``--n`` distinct real texts (docstring paragraphs of installed packages, repeats
removed, ``_realtext.py``) in ``--files`` Parquet files of log-normal sizes (sigma 1.0, as
``host_ceiling.py``). Two stages, each on its own ``LocalCluster`` of ``--workers``
single-threaded workers with the model loaded by a warm-up run before the clock:

- ``noop``: forward pass replaced by zeros (``benchmarks/_noop_forward.py``): the host
  path alone, where the hashing weighs most;
- ``tiny``: the random 2-layer BERT of ``make_tiny_model`` with its forward (``--tiny-n`` texts).

Each run is ``dd.read_parquet(dir).surge.encode("text", output=...)`` from the call to the
last commit. Reported: per round the ratio bypassed / hashed of the wall seconds and of
the workers' CPU seconds (user + system, all threads: far less sensitive to other jobs on a
shared machine than wall time), and the median of those ratios per stage (``cost_pct``,
``cpu_cost_pct``: how much slower, or how much more CPU, hashing makes a run). Also, in this
process, the host work alone per SuperBatch-sized list of the same texts (``micro``:
``text_hashes`` + ``distinct`` + ``hash_column``, median of repeats) in us per text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def unique_files(n: int, files: int, *, sigma: float = 1.0, seed: int = 0) -> tuple[Path, dict]:
    """``files`` Parquet files of ``n`` distinct real texts (cached in ``results/tmp``)."""
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dask_surge.synthetic import lognormal_sizes

    from ._realtext import TMP, docstring_paragraphs

    where = TMP / f"realtext-unique-n{n}-p{files}-s{sigma}-seed{seed}"
    meta_path = where / "_layout.json"
    if meta_path.is_file():
        return where / "data", json.loads(meta_path.read_text())
    pool = docstring_paragraphs(3 * n)
    texts = list(dict.fromkeys(pool))[:n]
    i = 0
    while len(texts) < n:  # too few distinct paragraphs: suffixed copies, still distinct
        texts.append(f"{texts[i]} [{i}]")
        i += 1
    assert len(set(texts)) == n
    sizes = lognormal_sizes(n, files, sigma=sigma, seed=seed)
    data = where / "data"
    data.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, size in enumerate(sizes.tolist()):
        pq.write_table(
            pa.table(
                {
                    "text": pa.array(texts[start : start + size], pa.string()),
                    "doc_id": pa.array(np.arange(start, start + size), pa.int64()),
                }
            ),
            data / f"part-{k:05d}.parquet",
        )
        start += size
    layout = {
        "texts": n,
        "distinct": n,
        "files": files,
        "sigma": sigma,
        "median_rows_per_file": float(np.median(sizes)),
        "mean_chars": float(np.mean([len(t) for t in texts])),
        "repeats_in_plain_paragraphs": len(pool[:n]) - len(set(pool[:n])),
        "source": "docstring paragraphs of site-packages, repeats removed",
    }
    meta_path.write_text(json.dumps(layout, indent=2))
    return data, layout


def set_variant(name: str) -> str:
    """In a worker: ``hashed`` restores the package's functions, ``bypassed`` swaps in stand-ins."""
    import time

    import numpy as np

    from dask_surge.execution import sink, superbatch
    from dask_surge.io.layout import TEXT_HASH

    if not hasattr(superbatch, "_bench_orig"):
        superbatch._bench_orig = (superbatch.text_hashes, superbatch.distinct, sink.table_of)  # type: ignore[attr-defined]
    text_hashes, distinct, table_of = superbatch._bench_orig  # type: ignore[attr-defined]
    if name == "hashed":  # the package's functions, timed (thread CPU and wall seconds, summed per worker)
        spent = superbatch._bench_spent = {"text_hashes": [0.0, 0.0], "distinct": [0.0, 0.0]}  # type: ignore[attr-defined]

        def timed(key, fn):
            def wrapper(*args):
                c0, w0 = time.thread_time(), time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    spent[key][0] += time.thread_time() - c0
                    spent[key][1] += time.perf_counter() - w0

            return wrapper

        superbatch.text_hashes, superbatch.distinct = (
            timed("text_hashes", text_hashes),
            timed("distinct", distinct),
        )
        sink.table_of = table_of
        return name

    def fake_hashes(texts):
        h = np.zeros((len(texts), 2), np.uint64)
        h[:, 1] = np.arange(len(texts), dtype=np.uint64)
        return h

    def identity(hashes):
        idx = np.arange(len(hashes), dtype=np.int64)
        return idx, idx

    def table_without_hash(frame):
        return table_of(frame.drop(columns=[TEXT_HASH]))

    superbatch.text_hashes, superbatch.distinct, sink.table_of = fake_hashes, identity, table_without_hash
    return name


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    t = os.times()
    return t.user + t.system


def surge_run(data: Path, model: str, client, scratch: Path) -> dict:
    import dask.dataframe as dd

    out = scratch / f"out-{time.time_ns()}"
    cpu0 = sum(client.run(_cpu_seconds).values())
    t0 = time.perf_counter()
    res = dd.read_parquet(str(data)).surge.encode(
        "text", output=str(out), model=model, device="cpu", keep=["doc_id"], progress=False, scheduler=client
    )
    seconds = time.perf_counter() - t0
    cpu = sum(client.run(_cpu_seconds).values()) - cpu0
    shutil.rmtree(out, ignore_errors=True)
    return {
        "seconds": seconds,
        "worker_cpu_s": cpu,
        "superbatches": res.superbatches,
        "rows": int(sum(r.rows for r in res.records)),
        "encoded": int(sum(r.encoded for r in res.records)),
        "encode_s_sum": float(sum(r.encode_s for r in res.records)),
        "write_s_sum": float(sum(r.write_s for r in res.records)),
    }


def stage(
    name: str, model: str, data: Path, warm: Path, n: int, rounds: int, workers: int, noop: bool, report: dict
) -> dict:
    from distributed import Client, LocalCluster

    from ._noop_forward import register

    scratch = Path(tempfile.mkdtemp(prefix="hash-cost-"))
    cluster = LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
    )
    client = Client(cluster)
    ratios, cpu_ratios, seconds = [], [], {"hashed": [], "bypassed": []}
    try:
        if noop:
            register(client)  # the forward pass replaced by zeros in each worker: benchmark only
        for variant in ("bypassed", "hashed"):  # warm-up: model loaded, both code paths run once
            client.run(set_variant, variant)
            surge_run(warm, model, client, scratch)
        for r in range(rounds):
            order = ("hashed", "bypassed") if r % 2 == 0 else ("bypassed", "hashed")
            got = {}
            for variant in order:
                client.run(set_variant, variant)
                got[variant] = surge_run(data, model, client, scratch)
                if variant == "hashed":  # the seconds spent in text_hashes and distinct, summed over workers
                    spent = client.run(
                        lambda: __import__("dask_surge.execution.superbatch", fromlist=["x"])._bench_spent
                    )
                    got[variant]["spent_cpu_s"] = {
                        k: sum(w[k][0] for w in spent.values()) for k in ("text_hashes", "distinct")
                    }
                assert got[variant]["rows"] == n, got[variant]
                seconds[variant].append(got[variant]["seconds"])
                report["results"].append(
                    {"stage": name, "round": r, "variant": variant, "n": n, **got[variant]}
                )
            ratios.append(got["bypassed"]["seconds"] / got["hashed"]["seconds"])
            cpu_ratios.append(got["bypassed"]["worker_cpu_s"] / got["hashed"]["worker_cpu_s"])
            print(
                f"{name:5s} round {r}: hashed {got['hashed']['seconds']:.2f} s  bypassed "
                f"{got['bypassed']['seconds']:.2f} s  bypassed/hashed {ratios[-1]:.3f}  worker CPU "
                f"{got['hashed']['worker_cpu_s']:.2f} / {got['bypassed']['worker_cpu_s']:.2f} s, "
                f"bypassed/hashed {cpu_ratios[-1]:.3f}",
                flush=True,
            )
    finally:
        client.close()
        cluster.close()
        shutil.rmtree(scratch, ignore_errors=True)
    med = statistics.median(ratios)
    cpu_med = statistics.median(cpu_ratios)
    return {
        "model": model,
        "n": n,
        "rounds": rounds,
        "ratios_bypassed_over_hashed": ratios,
        "median_ratio": med,
        "cost_pct": (1 / med - 1) * 100,
        "cpu_ratios_bypassed_over_hashed": cpu_ratios,
        "cpu_median_ratio": cpu_med,
        "cpu_cost_pct": (1 / cpu_med - 1) * 100,
        "hashed_us_per_text_in_workers": {
            k: statistics.median(
                r["spent_cpu_s"][k]
                for r in report["results"]
                if r["stage"] == name and r["variant"] == "hashed"
            )
            * 1e6
            / n
            for k in ("text_hashes", "distinct")
        },
        "hashed_worker_cpu_us_per_text": statistics.median(
            r["worker_cpu_s"] for r in report["results"] if r["stage"] == name and r["variant"] == "hashed"
        )
        * 1e6
        / n,
        "hashed_median_s": statistics.median(seconds["hashed"]),
        "bypassed_median_s": statistics.median(seconds["bypassed"]),
        "hashed_texts_per_s": n / statistics.median(seconds["hashed"]),
        "target_cost_pct": 3.0,
        "met": (1 / med - 1) * 100 < 3.0,
        "cpu_met": (1 / cpu_med - 1) * 100 < 3.0,
    }


def micro(data: Path, sb_rows: int = 65_536, repeats: int = 7) -> dict:
    """us per text of ``text_hashes`` + ``distinct`` + ``hash_column`` on SuperBatch-sized lists, in this process."""
    import pyarrow.parquet as pq

    from dask_surge.execution.superbatch import distinct
    from dask_surge.io.hashing import hash_column, text_hashes

    texts = pq.read_table(str(data), columns=["text"]).column("text").to_pylist()[:sb_rows]
    parts = {"text_hashes": [], "distinct": [], "hash_column": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = text_hashes(texts)
        t1 = time.perf_counter()
        distinct(h)
        t2 = time.perf_counter()
        hash_column(h)
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[k].append(v)
    us = {k: statistics.median(v) * 1e6 / len(texts) for k, v in parts.items()}
    return {"texts": len(texts), "us_per_text": us, "total_us_per_text": sum(us.values())}


def inprocess(data: Path, model: str, rounds: int, sb_rows: int = 20_000) -> dict:
    """One SuperBatch of ``sb_rows`` texts through :meth:`SuperBatchTask.encode` with the tiny model's
    forward, in this process, hashed against bypassed (the module's ``text_hashes``/``distinct`` swapped
    for stand-ins), ABBA: process CPU seconds (no cluster, no other process's noise in the figure)."""
    import numpy as np
    import pandas as pd
    import pyarrow.parquet as pq

    import dask_surge.execution.superbatch as sbm
    from dask_surge import Encoder
    from dask_surge.planning.policy import Span

    texts = pq.read_table(str(data), columns=["text"]).column("text").to_pylist()[:sb_rows]
    sbe = sbm.SuperBatchTask("text", (), Encoder(model, device="cpu"))
    part, spans = pd.DataFrame({"text": texts}), [(Span(0, 0, len(texts)), len(texts))]
    real = (sbm.text_hashes, sbm.distinct)
    stand_in = (
        lambda v: np.stack([np.arange(len(v), dtype=np.uint64)] * 2, 1),
        lambda h: (np.arange(len(h)), np.arange(len(h))),
    )
    sbe.encode([part], spans)  # warm-up
    cpu: dict[str, list[float]] = {"hashed": [], "bypassed": []}
    try:
        for r in range(rounds):
            for mode in ("hashed", "bypassed") if r % 2 == 0 else ("bypassed", "hashed"):
                sbm.text_hashes, sbm.distinct = real if mode == "hashed" else stand_in
                t0 = time.process_time()
                sbe.encode([part], spans)
                cpu[mode].append(time.process_time() - t0)
    finally:
        sbm.text_hashes, sbm.distinct = real
    ratio = statistics.median(cpu["bypassed"]) / statistics.median(cpu["hashed"])
    return {
        "texts": len(texts),
        "rounds": rounds,
        "cpu_s": cpu,
        "cpu_median_ratio": ratio,
        "cpu_cost_pct": (1 / ratio - 1) * 100,
        "target_cost_pct": 3.0,
        "met": (1 / ratio - 1) * 100 < 3.0,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument(
        "--tiny-n", type=int, default=40_000, help="texts for the tiny model stage (0: skip it)"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--inprocess-only",
        action="store_true",
        help="only the in-process stage (one SuperBatch, tiny model, hashed vs bypassed)",
    )
    parser.add_argument("--out", default=str(_results.RESULTS / "hash_cost.json"))
    args = parser.parse_args(argv)

    from ._realtext import tiny_model

    tiny = tiny_model()
    report = _results.new_report(__spec__.name, argv, args)
    data, layout = unique_files(args.n, args.files)
    warm, _ = unique_files(2000, 20, seed=1)
    report["summary"]["layout"] = layout
    report["summary"]["inprocess"] = inprocess(data, str(tiny), args.rounds)
    print(f"in process: CPU cost {report['summary']['inprocess']['cpu_cost_pct']:+.1f}%", flush=True)
    if args.inprocess_only:
        return _results.save(report, args.out)
    report["summary"]["micro"] = micro(data)
    print(f"micro: {report['summary']['micro']}", flush=True)
    report["summary"]["noop"] = stage(
        "noop", str(tiny), data, warm, args.n, args.rounds, args.workers, True, report
    )
    print(
        f"noop: wall cost {report['summary']['noop']['cost_pct']:+.1f}%, worker CPU cost "
        f"{report['summary']['noop']['cpu_cost_pct']:+.1f}%",
        flush=True,
    )
    if args.tiny_n:
        tdata, tlayout = unique_files(args.tiny_n, max(1, args.files * args.tiny_n // args.n))
        report["summary"]["tiny_layout"] = tlayout
        report["summary"]["tiny"] = stage(
            "tiny", str(tiny), tdata, warm, args.tiny_n, args.rounds, args.workers, False, report
        )
        print(
            f"tiny: wall cost {report['summary']['tiny']['cost_pct']:+.1f}%, worker CPU cost "
            f"{report['summary']['tiny']['cpu_cost_pct']:+.1f}%",
            flush=True,
        )
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
