"""The reuse index (issue 25, item 4): hash cost, index build and lookup rates, memory vs the old output's size.

Usage::

    python -m benchmarks.reuse_index [--rows 1000000 10000000] [--rows-per-file 50000] [--row-group 5000]
                                     [--queries 200000] [--sb 20000] [--hash-texts 200000]
                                     [--out benchmarks/results/reuse_index.json]

For each size an old output is written as a run writes it (part files with a row group per
``--row-group`` rows, commit records, ``COMPLETE``) holding random 128-bit ``text_hash``
values and 8-float embeddings (the index reads only the hashes; lookups copy the
embeddings). Then, in a fresh process per size (so its peak memory is its own):
``ReuseIndex`` builds the index (the default bucket size, 64 MiB spill buffer), a
``find`` of ``--queries`` random hashes (90% present, 10% not) runs, and a SuperBatch-like
``lookup`` (find + fetch of embeddings) of ``--sb`` hashes taken from a contiguous stretch
of the old output, shuffled, 10% edited. Reported per size: build rows/s, find and
lookup rows/s, the process's peak RSS above its RSS after imports, and tracemalloc's peak
of Python/NumPy allocations (Arrow buffers are not traced) during build and lookups.
Hashing: ``text_hashes`` against pandas' SipHash (``hash_array`` with two keys) on
``--hash-texts`` synthetic texts (~120 characters).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from . import _results
from dask_surge.io.store import OutputStore


def write_old_output(path: str, rows: int, rows_per_file: int, row_group: int, seed: int = 0) -> None:
    """An output of ``rows`` random hashes, as a run lays it out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dask_surge.io.directory import sb_key
    from dask_surge.io.hashing import hash_column, text_hash_field
    from dask_surge.io.manifest import CommitRecord, RunPlan, finish_run, open_run

    rng = np.random.default_rng(seed)
    files = -(-rows // rows_per_file)
    fp = {
        "input": uuid.uuid4().hex[:16],
        "column": "text",
        "model": {"kind": "object", "digest": "00"},
        "precision": "float32",
        "dimension": 8,
        "partitions": files,
    }
    manifest, _ = open_run(
        OutputStore.open(path),
        fp,
        plan=RunPlan(b_min=1, b_max=rows_per_file, mode="planned", partitions=files),
    )
    for i in range(files):
        n = min(rows_per_file, rows - i * rows_per_file)
        h = rng.integers(0, 2**64 - 1, size=(n, 2), dtype=np.uint64, endpoint=True)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 8, dtype=np.float32)), 8)
        table = pa.Table.from_arrays(
            [pa.array(np.full(n, i, np.int64)), pa.array(np.arange(n, dtype=np.int64)), hash_column(h), emb],
            schema=pa.schema(
                [
                    pa.field("partition", pa.int64()),
                    pa.field("row", pa.int64()),
                    text_hash_field(),
                    pa.field("embedding", emb.type),
                ]
            ),
        )
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=row_group)
        data = buf.getvalue()
        key, attempt = sb_key(i, 0), f"{i:08x}"
        target = manifest.data_path(key, attempt)
        manifest.store.write(target, data)
        manifest.commit(
            CommitRecord(
                sb=key,
                run=manifest.run_id,
                file=target.rsplit("/", 1)[-1],
                rows=n,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                spans=((i, 0, n, n),),
                attempt=attempt,
            )
        )
    finish_run(
        manifest,
        manifest.committed(),
        {"rows": rows, "superbatches": files, "nulls_skipped": 0, "partitions": files},
    )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _rss_parts() -> tuple[int, int]:
    """``(anonymous, file-backed)`` resident bytes of this process (Linux)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                parts[key] = int(value.split()[0]) * 1024
    return parts.get("RssAnon", 0), parts.get("RssFile", 0)


class _Sampler:
    """Peak anonymous and file-backed RSS, sampled every 5 ms on a thread."""

    def __init__(self) -> None:
        import threading

        self.anon, self.file = _rss_parts()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            a, f = _rss_parts()
            self.anon, self.file = max(self.anon, a), max(self.file, f)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.anon, self.file


def measure(path: str, queries: int, sb: int, seed: int = 1) -> dict:
    """In this process: build the index of ``path``, then time find and lookup; memory peaks."""
    import resource
    import tracemalloc

    import pyarrow.parquet as pq

    from dask_surge.io.hashing import hashes_of
    from dask_surge.io.manifest import existing_run
    from dask_surge.io.reuse import ReuseIndex

    base = _rss()
    anon0, file0 = _rss_parts()
    sampler = _Sampler()
    tracemalloc.start()
    t0 = time.perf_counter()
    index = ReuseIndex(path, rebuild=True)
    build_s = time.perf_counter() - t0
    build_peak = tracemalloc.get_traced_memory()[1]
    build_anon, build_file = sampler.stop()
    # queries: hashes read back from a few files (present) plus random ones (absent)
    rng = np.random.default_rng(seed)
    manifest = existing_run(OutputStore.open(path))
    files = [r.file for r in manifest.committed().values()]
    picked = [
        hashes_of(pq.read_table(f"{manifest.root}/{files[i]}", columns=["text_hash"]).column("text_hash"))
        for i in rng.choice(len(files), size=min(len(files), 8), replace=False)
    ]
    present = np.concatenate(picked)
    present = present[rng.choice(len(present), size=int(queries * 0.9))]
    absent = rng.integers(0, 2**64 - 1, size=(queries - len(present), 2), dtype=np.uint64, endpoint=True)
    q = np.concatenate([present, absent])[rng.permutation(queries)]
    tracemalloc.reset_peak()
    index.close()  # cold: no bucket mapped yet
    sampler = _Sampler()
    t0 = time.perf_counter()
    m = index.find(q)
    find_s = time.perf_counter() - t0
    # a SuperBatch-like lookup: a stretch of the old output, shuffled, 10% edited
    stretch = hashes_of(
        pq.read_table(f"{manifest.root}/{files[len(files) // 2]}", columns=["text_hash"]).column("text_hash")
    )[:sb]
    stretch = stretch[rng.permutation(len(stretch))]
    stretch[: len(stretch) // 10, 1] ^= np.uint64(1)
    t0 = time.perf_counter()
    got = index.lookup(stretch)
    lookup_s = time.perf_counter() - t0
    lookup_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    lookup_anon, lookup_file = sampler.stop()
    return {
        "rows": int(index.indexes[0].meta["rows"]),
        "buckets": 1 << index.indexes[0].bits,
        "build_s": build_s,
        "build_rows_per_s": index.indexes[0].meta["rows"] / build_s,
        "find_queries": queries,
        "find_hits": m.hits,
        "find_s": find_s,
        "find_rows_per_s": queries / find_s,
        "lookup_queries": len(stretch),
        "lookup_hits": int(got.found.sum()),
        "lookup_s": lookup_s,
        "lookup_rows_per_s": len(stretch) / lookup_s,
        "build_tracemalloc_peak_bytes": build_peak,
        "lookup_tracemalloc_peak_bytes": lookup_peak,
        "build_peak_rss_anon_above_start_bytes": build_anon - anon0,
        "lookup_peak_rss_anon_above_start_bytes": lookup_anon - anon0,
        "build_peak_rss_file_bytes": build_file - file0,
        "lookup_peak_rss_file_bytes": lookup_file - file0,
        "peak_rss_above_start_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
    }


def hash_rates(n: int) -> dict:
    import pandas as pd
    import pyarrow as pa
    from pandas.util import hash_array

    from dask_surge.io.hashing import text_hashes
    from dask_surge.testing import make_texts

    texts = make_texts(n)
    inputs = {
        "list of str": texts,
        "pandas Series (Arrow strings)": pd.Series(texts, dtype="string[pyarrow]"),
        "pyarrow string array": pa.array(texts),
    }
    out: dict = {"texts": n, "mean_chars": float(np.mean([len(t) for t in texts]))}

    def best(f) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times) / n * 1e6

    for name, values in inputs.items():
        out[f"text_hashes us/text, {name}"] = best(lambda v=values: text_hashes(v))
    obj = np.array(texts, dtype=object)
    out["pandas hash_array x2 (SipHash, 128 bits) us/text, object array"] = best(
        lambda: (
            hash_array(obj, hash_key="0123456789abcdef", categorize=False),
            hash_array(obj, hash_key="fedcba9876543210", categorize=False),
        )
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--rows-per-file", type=int, default=50_000)
    parser.add_argument("--row-group", type=int, default=5_000)
    parser.add_argument("--queries", type=int, default=200_000)
    parser.add_argument("--sb", type=int, default=20_000)
    parser.add_argument("--hash-texts", type=int, default=200_000)
    parser.add_argument("--out", default="benchmarks/results/reuse_index.json")
    args = parser.parse_args(argv)
    report = _results.new_report(__spec__.name if __spec__ else "benchmarks.reuse_index", argv, args)
    report["summary"]["hashing"] = hash_rates(args.hash_texts)
    print(json.dumps(report["summary"]["hashing"], indent=1))
    for rows in args.rows:
        with tempfile.TemporaryDirectory(prefix="surge-reuse-bench-") as tmp:
            t0 = time.perf_counter()
            write_old_output(f"{tmp}/old", rows, args.rows_per_file, args.row_group)
            written_s = time.perf_counter() - t0
            code = (
                "import json, sys; from benchmarks.reuse_index import measure; "
                f"print(json.dumps(measure({tmp + '/old'!r}, {args.queries}, {args.sb})))"
            )
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            result = {**json.loads(proc.stdout.strip().splitlines()[-1]), "write_old_output_s": written_s}
        report["results"].append(result)
        print(json.dumps(result))
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
