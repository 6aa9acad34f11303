"""Inputs shared by the asv benchmarks, built once per ``asv run`` (``setup_cache``).

asv runs ``setup_cache`` once for every benchmark that uses it (the key is this function's
module and line), in a scratch directory it removes afterwards, and passes the returned
value to ``setup`` and to the benchmark as the first argument after ``self``.
"""

from __future__ import annotations

import os
from pathlib import Path

# internal names in one place (the package layout is being reorganised; public names come
# from ``dask_surge`` itself in the benchmark modules)
from dask_surge.testing import lognormal_sizes, make_tiny_model, write_partitioned_parquet

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: Parquet layouts for the planning benchmarks: files -> rows (mean 20 rows a file)
FOOTER_LAYOUTS = {100: 2_000, 1_000: 20_000}
#: the small local run of ``run.py``: rows over files, log-normal sizes (sigma 1.72)
RUN_ROWS, RUN_FILES = 4_000, 40


def setup_cache() -> dict:
    """Build the tiny random BERT and the Parquet datasets; return their absolute paths."""
    root = Path.cwd()
    paths = {"tiny": make_tiny_model(root / "tiny-model")}
    for files, rows in FOOTER_LAYOUTS.items():
        path = root / f"footers-{files}"
        write_partitioned_parquet(path, lognormal_sizes(rows, files, seed=files), seed=1)
        paths[f"footers-{files}"] = str(path)
    path = root / "run-input"
    write_partitioned_parquet(path, lognormal_sizes(RUN_ROWS, RUN_FILES, seed=2), seed=2)
    paths["run-input"] = str(path)
    return paths


setup_cache.timeout = 300  # building the model takes ~6 s on 2 busy cores
