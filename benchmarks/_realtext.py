"""Real text for benchmarks: docstring paragraphs of installed Python packages, in many small Parquet files.

Read from the sources with :mod:`ast` (nothing imported), so the texts are the same on
every machine with the same packages. Used by ``host_ceiling.py`` and ``e2e_small_files.py``;
also the tiny test encoder the benchmarks share (:func:`tiny_model`).
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

TMP = Path(__file__).resolve().parent / "results" / "tmp"  # git-ignored


def tiny_model() -> Path:
    """The benchmarks' tiny test encoder (:func:`dask_surge.testing.make_tiny_model`), built in
    :data:`TMP` on first use and reused after."""
    from dask_surge.testing import make_tiny_model

    tiny = TMP / "tiny-model"
    if not (tiny / "modules.json").is_file():
        make_tiny_model(tiny)
    return tiny


def docstring_paragraphs(n: int, *, max_chars: int = 2000) -> list[str]:
    """``n`` paragraphs of docstrings from site-packages (files in sorted order; cycled with a suffix if short)."""
    site = Path(sysconfig.get_paths()["purelib"])
    out: list[str] = []
    for path in sorted(site.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, OSError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out += [p.strip()[:max_chars] for p in doc.split("\n\n") if p.strip()]
        if len(out) >= n:
            return out[:n]
    base = list(out) or ["empty"]
    i = 0
    while len(out) < n:  # too few installed docstrings: repeat them, told apart by a suffix
        out.append(f"{base[i % len(base)]} ({i // len(base)})")
        i += 1
    return out[:n]


def small_files(n: int, files: int, *, sigma: float = 1.0, seed: int = 0) -> tuple[Path, dict]:
    """A directory of ``files`` Parquet files (log-normal sizes summing to ``n``) of real texts, cached."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dask_surge.synthetic import lognormal_sizes

    where = TMP / f"realtext-n{n}-p{files}-s{sigma}-seed{seed}"
    meta_path = where / "_layout.json"
    if meta_path.is_file():
        return where / "data", json.loads(meta_path.read_text())
    texts = docstring_paragraphs(n)
    sizes = lognormal_sizes(n, files, sigma=sigma, seed=seed)
    data = where / "data"
    data.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, size in enumerate(sizes.tolist()):
        chunk = texts[start : start + size]
        pq.write_table(
            pa.table(
                {
                    "text": pa.array(chunk, pa.string()),
                    "doc_id": pa.array(np.arange(start, start + size), pa.int64()),
                }
            ),
            data / f"part-{i:05d}.parquet",
        )
        start += size
    layout = {
        "texts": n,
        "files": files,
        "sigma": sigma,
        "median_rows_per_file": float(np.median(sizes)),
        "mean_chars": float(np.mean([len(t) for t in texts])),
        "source": f"docstring paragraphs of {sysconfig.get_paths()['purelib']} (ast, sorted files)",
        "python": sys.version.split()[0],
    }
    meta_path.write_text(json.dumps(layout, indent=2))  # outside data/: readers never see it
    return data, layout


def read_texts(data: Path) -> list[str]:
    """The texts of a :func:`small_files` directory, in file and row order."""
    import pyarrow.parquet as pq

    return pq.read_table(str(data), columns=["text"]).column("text").to_pylist()
