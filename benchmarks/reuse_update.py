"""Updating a corpus (issue 25): an update run (``reuse=`` the old output) against a full run of the new corpus.

Usage::

    python -m benchmarks.reuse_update [--n 1000000] [--minilm-n 8000] [--mem-old 100000 1000000]
                                      [--mem-new 100000] [--rows-per-file 500] [--workers 2]
                                      [--distinct 250000] [--quick]
                                      [--out benchmarks/results/reuse_update.json]

Issue 25's benchmark: "10^6 rows with 10% new or edited, update run vs full run, with MiniLM
on CPU: >= 5x faster; peak worker memory flat as the old output grows 10x".

Corpus (real text: docstring paragraphs of the installed packages, ``_realtext.py``;
``--distinct`` of them, told apart by a suffix when more rows are needed, so every text is
distinct): the old corpus is ``N`` texts in Parquet files of log-normal sizes (mean
``--rows-per-file``, sigma 1.0) with a ``doc_id``. The new corpus is the old one with 5%
of its rows edited (a sentence appended), 2% deleted, and new files (mean size as the old
ones) holding 5.5% N brand-new texts and 2% N copies of old texts (moved rows): ~10% of
the new corpus is new or edited.

(a) **Speed**, per model, side by side on one ``LocalCluster(n_workers=--workers,
threads_per_worker=1)`` started, with the model loaded on every worker (a warm-up
encode), before any clock: the old corpus is encoded once (setup; its time is reported),
then the **full run** (``dask_surge.encode(new, "text", output=...)``) and the **update
run** (the same with ``reuse=old output``) of the new corpus, ``dd.read_parquet`` on the
measured path for both. The old output's reuse index is deleted before every update run,
so each update pays for building it (the first reuse of an output does; later ones do
not). Models:

- ``minilm``: the packaged all-MiniLM-L6-v2 (``model="default"``, ``device="cpu"``) at
  ``--minilm-n`` rows: 10^6 rows of MiniLM on 2 CPU cores take hours, so N is what fits a few
  minutes; the ratio is what the issue's target is about;
- ``tiny``: ``dask_surge.testing.make_tiny_model`` (random-weight 2-layer BERT, the real
  MiniLM tokenizer) at ``--n`` rows (10^6): compute-light, so the ratio shows the update
  path's own cost at scale (hashing, index build, lookup, fetch, write) against a cheap encode.

(b) **Memory**: the update run of one new corpus (``--mem-new`` rows: an update of the old
corpus's first ``--mem-new`` rows, as above) against old outputs of each size in
``--mem-old`` (the first of them a prefix of the others' corpus, so every run reuses and
encodes the same texts; only the old output, and its index, grows), tiny model. Each in a
fresh process with a fresh cluster and a warm-up encode; the index of the old output is
deleted first (the client builds it during the run). A thread samples the resident memory
(RSS) of each worker process and of the client process every 20 ms with psutil; reported:
each one's peak, and peak above its RSS just before the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EDIT, DELETE, NEW, COPIES = 0.05, 0.02, 0.055, 0.02
TARGET_SPEEDUP = 5.0


# -- corpus ------------------------------------------------------------------------------


def texts(n: int, distinct: int) -> list[str]:
    """``n`` distinct texts: the first ``distinct`` distinct docstring paragraphs (cached in
    ``results/tmp``), cycled with a `` (k)`` suffix when ``n`` is larger."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ._realtext import TMP, docstring_paragraphs

    cache = TMP / f"reuse-update-paragraphs-{distinct}.parquet"
    if cache.is_file():
        base = pq.read_table(cache).column("text").to_pylist()
    else:
        base = list(dict.fromkeys(docstring_paragraphs(int(distinct * 1.3) + 100)))[:distinct]
        cache.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": base}), cache)
    if n <= len(base):
        return base[:n]
    return base + [f"{base[i % len(base)]} ({i // len(base)})" for i in range(n - len(base))]


def _write_files(where: Path, texts_: list[str], ids: np.ndarray, sizes: list[int], first: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    where.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, size in enumerate(sizes):
        pq.write_table(
            pa.table(
                {
                    "doc_id": pa.array(ids[start : start + size], pa.int64()),
                    "text": pa.array(texts_[start : start + size], pa.string()),
                }
            ),
            where / f"part-{first + i:06d}.parquet",
        )
        start += size


def _sizes(n: int, rows_per_file: int, seed: int) -> list[int]:
    from dask_surge.synthetic import lognormal_sizes

    files = max(1, round(n / rows_per_file))
    return [int(s) for s in lognormal_sizes(n, files, sigma=1.0, seed=seed) if s > 0]


def make_corpus(
    where: Path,
    pool: list[str],
    n_old: int,
    n_new_from: int,
    rows_per_file: int,
    seed: int = 0,
    old_files: list[int] | None = None,
) -> dict:
    """Write ``old/`` (``pool[:n_old]`` in log-normal files; not written when their sizes
    ``old_files`` are given: they exist) and ``new/`` (an update of the old files holding the
    first ``n_new_from`` rows: edits, deletions, new files of texts ``pool[n_old:]`` and
    copies of old ones); return the layout and counts."""
    rng = np.random.default_rng(seed)
    old = pool[:n_old]
    sizes = old_files or _sizes(n_old, rows_per_file, seed)
    if not old_files:
        _write_files(where / "old", old, np.arange(n_old), sizes)
    # the update of the old files that hold the first n_new_from rows
    keep_files = int(np.searchsorted(np.cumsum(sizes), n_new_from) + 1)
    base_sizes = sizes[:keep_files]
    m = int(sum(base_sizes))
    new = list(old[:m])
    edited = rng.choice(m, int(EDIT * m), replace=False)
    for i in edited:
        new[i] = f"{new[i]} This paragraph was revised in the update."
    deleted = np.zeros(m, bool)
    deleted[rng.choice(np.setdiff1d(np.arange(m), edited), int(DELETE * m), replace=False)] = True
    new_sizes = []
    start = 0
    for s in base_sizes:
        new_sizes.append(int((~deleted[start : start + s]).sum()))
        start += s
    kept = [t for t, d in zip(new, deleted) if not d]
    kept_ids = np.arange(m)[~deleted]
    n_fresh, n_copies = int(NEW * m), int(COPIES * m)
    if n_old + n_fresh > len(pool):
        raise ValueError("text pool too small")
    added = pool[n_old : n_old + n_fresh] + [old[i] for i in rng.choice(m, n_copies, replace=False)]
    added = [added[i] for i in rng.permutation(len(added))]
    _write_files(
        where / "new",
        kept + added,
        np.concatenate([kept_ids, np.arange(n_old, n_old + len(added))]),
        [s for s in new_sizes if s > 0] + _sizes(len(added), rows_per_file, seed + 1),
    )
    rows = len(kept) + len(added)
    changed = len(edited) + n_fresh
    return {
        "old_rows": n_old,
        "old_files": len(sizes),
        "new_rows": rows,
        "new_files": len(list((where / "new").glob("*.parquet"))),
        "edited": len(edited),
        "deleted": int(deleted.sum()),
        "added_new": n_fresh,
        "added_copies": n_copies,
        "changed": changed,
        "changed_fraction": changed / rows,
        "sizes": sizes,
    }


# -- measuring ---------------------------------------------------------------------------


class PeakRSS:
    """Sample the RSS of some processes every ``every`` seconds in a thread; ``peaks`` by name."""

    def __init__(self, pids: dict[str, int], every: float = 0.02) -> None:
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.before = {name: p.memory_info().rss for name, p in self.procs.items()}
        self.peaks = dict(self.before)
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, p in self.procs.items():
                with contextlib.suppress(Exception):  # a process gone: keep its peak
                    self.peaks[name] = max(self.peaks[name], p.memory_info().rss)
            time.sleep(self.every)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def record(self) -> dict:
        workers = [k for k in self.peaks if k != "client"]
        return {
            "peak_rss_bytes": dict(self.peaks),
            "rss_before_bytes": dict(self.before),
            "peak_above_before_bytes": {k: self.peaks[k] - self.before[k] for k in self.peaks},
            "max_worker_peak_rss_bytes": max(self.peaks[k] for k in workers),
            "max_worker_peak_above_before_bytes": max(self.peaks[k] - self.before[k] for k in workers),
        }


def _cluster(workers: int):
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
    )
    client = Client(cluster)
    pids = {"client": os.getpid()}
    pids.update({f"worker-{i}": pid for i, pid in enumerate(sorted(client.run(os.getpid).values()))})
    return cluster, client, pids


def _drop_index(output: str) -> None:
    shutil.rmtree(Path(output) / "_surge" / "index", ignore_errors=True)


def _encode(data: Path, output: str, model: str, client, reuse: str | None = None) -> dict:
    import dask.dataframe as dd

    import dask_surge

    opts = {"reuse": reuse} if reuse else {}
    t0 = time.perf_counter()
    res = dask_surge.encode(
        dd.read_parquet(str(data)),
        "text",
        output=output,
        model=model,
        device="cpu",
        keep=["doc_id"],
        progress=False,
        scheduler=client,
        **opts,
    )
    return {
        "seconds": time.perf_counter() - t0,
        "rows": int(res.rows),
        "encoded": int(res.encoded),
        "reused": int(res.reused),
        "superbatches": int(res.superbatches),
    }


def _warm_up(client, model: str, work: Path) -> None:
    """Import the model stack and load the model on every worker (not measured)."""
    import dask.dataframe as dd
    import pandas as pd

    import dask_surge

    n = 64 * len(client.scheduler_info()["workers"])
    frame = dd.from_pandas(
        pd.DataFrame({"text": [f"warm-up text number {i}" for i in range(n)]}),
        npartitions=2 * len(client.scheduler_info()["workers"]),
    )
    dask_surge.encode(
        frame,
        "text",
        output=str(work / f"warm-{time.monotonic_ns()}"),
        model=model,
        device="cpu",
        progress=False,
        scheduler=client,
        b_min=32,
        b_max=64,
    )


def speed(
    name: str, model: str, n: int, pool: list[str], args, work: Path, cluster, keep: bool = False
) -> tuple[list[dict], dict, dict | None]:
    """(a) for one model on ``cluster`` (client, pids): the old output (setup), then full and
    update runs of the new corpus. With ``keep`` the old corpus and output stay (for the
    memory part) and are returned: ``{"dir", "output", "sizes", "rows"}``."""
    here = work / name
    t0 = time.perf_counter()
    layout = make_corpus(here, pool, n, n, args.rows_per_file)
    corpus_s = time.perf_counter() - t0
    sizes = layout.pop("sizes")
    print(f"[{name}] corpus {layout} ({corpus_s:.1f} s)", flush=True)
    records = []
    client, pids = cluster
    try:
        _warm_up(client, model, here)
        old = str(here / "out-old")
        setup = _encode(here / "old", old, model, client)
        print(f"[{name}] old output: {setup['rows']:,} rows in {setup['seconds']:.1f} s", flush=True)
        records.append({"part": "speed", "encoder": name, "method": "old", **layout, **setup})
        for rep in range(args.repeats):
            for method in ("full", "update"):
                out = str(here / f"out-{method}-{rep}")
                if method == "update":
                    _drop_index(old)
                client.run(__import__("gc").collect)
                with PeakRSS(pids) as rss:
                    r = _encode(here / "new", out, model, client, reuse=old if method == "update" else None)
                assert r["rows"] == layout["new_rows"], (r, layout)
                records.append(
                    {
                        "part": "speed",
                        "encoder": name,
                        "method": method,
                        "repeat": rep,
                        **layout,
                        **r,
                        **rss.record(),
                        "texts_per_s": r["rows"] / r["seconds"],
                    }
                )
                print(
                    f"[{name}] {method:6s} {r['rows']:,} rows in {r['seconds']:.1f} s "
                    f"(encoded {r['encoded']:,}, reused {r['reused']:,})",
                    flush=True,
                )
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(here, ignore_errors=True)
    full = float(np.median([r["seconds"] for r in records if r["method"] == "full"]))
    upd = float(np.median([r["seconds"] for r in records if r["method"] == "update"]))
    upd_r = [r for r in records if r["method"] == "update"][-1]
    summary = {
        "model": model,
        "n_old": n,
        "n_new": layout["new_rows"],
        "changed_fraction": layout["changed_fraction"],
        "full_s": full,
        "update_s": upd,
        "old_output_s": setup["seconds"],
        "speedup_update_over_full": full / upd,
        "encoded": upd_r["encoded"],
        "reused": upd_r["reused"],
        "full_encoded": [r for r in records if r["method"] == "full"][-1]["encoded"],
        # the target is MiniLM's; the tiny model shows the update path's own cost
        **(
            {"target_speedup": TARGET_SPEEDUP, "met": full / upd >= TARGET_SPEEDUP}
            if name == "minilm"
            else {}
        ),
    }
    print(
        f"[{name}] speedup update over full: {full / upd:.2f}x (full {full:.1f} s, update {upd:.1f} s)",
        flush=True,
    )
    kept = {"dir": here / "old", "output": old, "sizes": sizes, "rows": n} if keep else None
    return records, summary, kept


def one_memory(spec: dict) -> dict:
    """(b): one update run against one old output, in this fresh process."""
    work = Path(spec["work"])
    cluster, client, pids = _cluster(spec["workers"])
    try:
        _warm_up(client, spec["model"], work)
        _drop_index(spec["old"])
        client.run(__import__("gc").collect)
        __import__("gc").collect()
        out = str(work / f"out-mem-{spec['old_rows']}")
        with PeakRSS(pids) as rss:
            r = _encode(Path(spec["new"]), out, spec["model"], client, reuse=spec["old"])
        shutil.rmtree(out, ignore_errors=True)
        return {**r, **rss.record()}
    finally:
        client.close()
        cluster.close()


def memory_setup(model: str, pool: list[str], args, work: Path, client, base: dict | None) -> dict:
    """(b)'s inputs: old outputs of each size in ``--mem-old`` (prefixes of one old corpus:
    ``base``, the tiny speed part's, when it is as large as the largest, else a new one) and
    the new corpus, an update of the first ``--mem-new`` rows; encoded on ``client``."""
    here = work / "memory"
    big = max(args.mem_old)
    t0 = time.perf_counter()
    if base is None or base["rows"] < big:
        layout = make_corpus(here, pool, big, args.mem_new, args.rows_per_file)
        base = {"dir": here / "old", "output": None, "sizes": layout["sizes"], "rows": big}
    else:
        layout = make_corpus(
            here, pool, base["rows"], args.mem_new, args.rows_per_file, old_files=base["sizes"]
        )
    layout.pop("sizes")
    olds = {}
    _warm_up(client, model, here)
    for rows in args.mem_old:
        if rows == base["rows"] and base["output"]:
            olds[rows] = (base["output"], base["rows"])
            continue
        data = base["dir"]
        if rows < base["rows"]:  # the first files of the old corpus, ~rows rows
            k = int(np.searchsorted(np.cumsum(base["sizes"]), rows) + 1)
            data = here / f"old-{rows}"
            data.mkdir(parents=True)
            for f in sorted(base["dir"].glob("*.parquet"))[:k]:
                os.link(f, data / f.name)
        out = str(here / f"out-old-{rows}")
        r = _encode(data, out, model, client)
        print(f"[memory] old output of {r['rows']:,} rows in {r['seconds']:.1f} s", flush=True)
        olds[rows] = (out, r["rows"])
    print(
        f"[memory] setup {time.perf_counter() - t0:.1f} s; new corpus {layout['new_rows']:,} rows", flush=True
    )
    return {"here": str(here), "olds": olds, "layout": layout, "model": model}


def memory(setup: dict, args) -> tuple[list[dict], dict]:
    """(b): the same new corpus updated against old outputs of growing size, each in a fresh process."""
    here, olds, layout, model = Path(setup["here"]), setup["olds"], setup["layout"], setup["model"]
    records = []
    try:
        for rows in sorted(args.mem_old):
            old, old_rows = olds[rows]
            spec = {
                "work": str(here),
                "workers": args.workers,
                "model": model,
                "old": old,
                "old_rows": old_rows,
                "new": str(here / "new"),
            }
            cmd = [sys.executable, "-m", __spec__.name, "--one-memory", json.dumps(spec)]
            r = _results.run_one(cmd, what="memory")
            assert r["rows"] == layout["new_rows"], (r, layout)
            records.append(
                {
                    "part": "memory",
                    "encoder": "tiny",
                    "method": "update",
                    "old_output_rows": old_rows,
                    "new_rows": layout["new_rows"],
                    **r,
                }
            )
            print(
                f"[memory] old {old_rows:>9,} rows: update {r['seconds']:.1f} s, worker peaks "
                + ", ".join(
                    f"{r['peak_rss_bytes'][k] / 2**20:.0f} MiB (+{r['peak_above_before_bytes'][k] / 2**20:.0f})"
                    for k in sorted(r["peak_rss_bytes"])
                    if k != "client"
                )
                + f"; client +{r['peak_above_before_bytes']['client'] / 2**20:.0f} MiB",
                flush=True,
            )
    finally:
        shutil.rmtree(here, ignore_errors=True)
    first, last = records[0], records[-1]
    summary = {
        "new_rows": layout["new_rows"],
        "old_output_rows": [r["old_output_rows"] for r in records],
        "max_worker_peak_rss_mib": [r["max_worker_peak_rss_bytes"] / 2**20 for r in records],
        "max_worker_peak_above_before_mib": [
            r["max_worker_peak_above_before_bytes"] / 2**20 for r in records
        ],
        "client_peak_above_before_mib": [r["peak_above_before_bytes"]["client"] / 2**20 for r in records],
        "worker_peak_ratio_last_over_first": last["max_worker_peak_rss_bytes"]
        / first["max_worker_peak_rss_bytes"],
        "old_rows_ratio_last_over_first": last["old_output_rows"] / first["old_output_rows"],
    }
    return records, summary


def projection(summary: dict) -> None:
    """MiniLM's speedup at the tiny part's N (10^6), projected, not measured: MiniLM's measured
    seconds per encoded text for every encoded text, plus the tiny update run's seconds less
    its own (cheap) encoding, for the update path's cost at that N."""
    m, t = summary.get("minilm"), summary.get("tiny")
    if not (m and t):
        return
    per_text = m["full_s"] / m["full_encoded"]  # MiniLM seconds per encoded text, in a full run
    tiny_per_text = t["full_s"] / t["full_encoded"]
    full = per_text * t["full_encoded"]
    update = t["update_s"] - tiny_per_text * t["encoded"] + per_text * t["encoded"]
    summary["minilm_projected_at_tiny_n"] = {
        "n_new": t["n_new"],
        "full_s": full,
        "update_s": update,
        "speedup_update_over_full": full / update,
        "how": "projected, not measured: MiniLM's full-run seconds per encoded text x texts encoded; the update "
        "adds the tiny update run's time less its own encoding at the tiny full run's rate",
    }
    print(f"MiniLM projected at {t['n_new']:,} rows: {full / update:.2f}x", flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--n", type=int, default=1_000_000, help="old corpus rows for the tiny model (0: skip)"
    )
    parser.add_argument("--minilm-n", type=int, default=8_000, help="old corpus rows for MiniLM (0: skip)")
    parser.add_argument(
        "--mem-old",
        type=int,
        nargs="+",
        default=[100_000, 1_000_000],
        help="old output sizes for the memory part (0: skip)",
    )
    parser.add_argument("--mem-new", type=int, default=100_000, help="new corpus size of the memory part")
    parser.add_argument("--rows-per-file", type=int, default=500)
    parser.add_argument(
        "--distinct", type=int, default=250_000, help="distinct real paragraphs (cycled beyond)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    parser.add_argument("--workdir", default=None, help="where corpora and outputs go (default: a temp dir)")
    parser.add_argument("--out", default=str(_results.RESULTS / "reuse_update.json"))
    parser.add_argument("--one-memory", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.mem_old = sorted(r for r in args.mem_old if r > 0)
    if args.one_memory:
        _results.emit(one_memory(json.loads(args.one_memory)))
        return {}
    if args.quick:
        args.n, args.minilm_n, args.mem_old, args.mem_new = 3000, 150, [1000, 3000], 1000
        args.rows_per_file, args.distinct = 100, 5000

    import dask_surge  # noqa: F401
    from dask_surge.testing import packaged_model_dir

    from ._realtext import tiny_model

    report = _results.new_report(__spec__.name, argv, args)
    tiny = tiny_model()
    t0 = time.perf_counter()
    need = max([args.n, args.minilm_n, *args.mem_old])
    pool = texts(int(need * (1 + NEW)) + 10, args.distinct)
    report["summary"]["texts"] = {
        "rows": len(pool),
        "distinct_real_paragraphs": min(args.distinct, len(pool)),
        "mean_chars": float(np.mean([len(t) for t in pool])),
        "seconds": time.perf_counter() - t0,
    }
    print(f"texts: {len(pool):,} ({time.perf_counter() - t0:.1f} s)", flush=True)
    tmp = tempfile.mkdtemp(prefix="reuse-update-", dir=args.workdir)
    try:
        work = Path(tmp)
        # one cluster for (a), both models, and (b)'s setup, started before any clock
        cluster, client, pids = _cluster(args.workers)
        try:
            base, mem = None, None
            if args.minilm_n:
                rec, report["summary"]["minilm"], _ = speed(
                    "minilm", str(packaged_model_dir()), args.minilm_n, pool, args, work, (client, pids)
                )
                report["results"] += rec
            if args.n:
                rec, report["summary"]["tiny"], base = speed(
                    "tiny", str(tiny), args.n, pool, args, work, (client, pids), keep=bool(args.mem_old)
                )
                report["results"] += rec
            if args.mem_old:
                mem = memory_setup(str(tiny), pool, args, work, client, base)
        finally:
            client.close()
            cluster.close()
        if mem:
            rec, report["summary"]["memory"] = memory(mem, args)
            report["results"] += rec
        projection(report["summary"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
