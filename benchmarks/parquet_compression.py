"""Size and write time of the embedding column under each Parquet codec (issue 17 item 6).

Usage::

    python benchmarks/parquet_compression.py [--rows 100000] [--real 4000] [--repeats 5]
                                             [--out benchmarks/results/parquet_compression_cpu.json]

Two inputs, each written as SURGE writes a SuperBatch (``dask_surge.execution.sink.parquet_bytes``:
``partition``, ``row``, a fixed-size list of float32 ``embedding``; one row group per
source partition of 200 rows):

- ``real``: ``--real`` all-MiniLM-L6-v2 embeddings (384-d, unit norm) of docstrings of
  installed packages, computed here with the fast engine;
- ``synthetic``: ``--rows`` random unit vectors of the same size (float32 mantissas look
  like noise either way, which is why a general-purpose codec saves little).

For each codec, the median write time (serialize + compress, in memory) over
``--repeats`` runs, interleaved, and bytes per row. The JSON holds the exact command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab import script_header  # the benchmarks folder, put on the path above

CODECS = ("none", "snappy", "lz4", "zstd")


def docstrings(limit: int) -> list[str]:
    """Paragraphs of docstrings of installed packages (real English-and-code text)."""
    import importlib
    import inspect

    out: list[str] = []
    for name in ("pandas", "numpy", "dask", "distributed", "pyarrow", "torch", "transformers", "fsspec"):
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a package that does not import is skipped
            continue
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj)
            if doc:
                out += [p.strip() for p in doc.split("\n\n") if p.strip()]
            if len(out) >= limit:
                return out[:limit]
    return out[:limit]


def frame_of(emb: np.ndarray):
    import pandas as pd

    from dask_surge.io.arrow import embedding_array

    n = len(emb)
    data = {"partition": np.arange(n, dtype=np.int64) // 200, "row": np.arange(n, dtype=np.int64) % 200}
    frame = pd.DataFrame(data)
    frame["embedding"] = pd.arrays.ArrowExtensionArray(embedding_array(emb))
    return frame


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--real", type=int, default=4000, help="real MiniLM embeddings to compute (0: none)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/parquet_compression_cpu.json")
    args = parser.parse_args(argv)

    from dask_surge.execution.sink import parquet_bytes, table_of

    inputs = {}
    rng = np.random.default_rng(0)
    syn = rng.standard_normal((args.rows, 384)).astype(np.float32)
    inputs["synthetic"] = syn / np.linalg.norm(syn, axis=1, keepdims=True)
    if args.real:
        from dask_surge import Encoder

        inputs["real"] = Encoder("default", device="cpu").encode(docstrings(args.real))
    results = {}
    for name, emb in inputs.items():
        table = table_of(frame_of(emb))
        groups = np.unique(table.column("partition").to_numpy(), return_counts=True)[1]
        times: dict[str, list[float]] = {c: [] for c in CODECS}
        sizes: dict[str, int] = {}
        for _ in range(args.repeats):
            for codec in CODECS:
                t0 = time.perf_counter()
                data = parquet_bytes(table, groups, compression=codec)
                times[codec].append(time.perf_counter() - t0)
                sizes[codec] = len(data)
        base_t, base_b = statistics.median(times["none"]), sizes["none"]
        results[name] = {
            "rows": len(emb),
            "codecs": {
                c: {
                    "write_s": statistics.median(times[c]),
                    "write_s_per_100k_rows": statistics.median(times[c]) * 100_000 / len(emb),
                    "bytes": sizes[c],
                    "bytes_per_row": sizes[c] / len(emb),
                    "size_vs_none": sizes[c] / base_b,
                    "time_vs_none": statistics.median(times[c]) / base_t,
                }
                for c in CODECS
            },
        }
    out = {
        **script_header(argv),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for name, r in results.items():
        for c, v in r["codecs"].items():
            print(f"{name:9s} {c:6s} {v['write_s_per_100k_rows']:.3f} s/100k rows  {v['bytes_per_row']:.0f} B/row  "
                  f"size {v['size_vs_none']:.3f}x  time {v['time_vs_none']:.2f}x")
    return out


if __name__ == "__main__":
    main()
