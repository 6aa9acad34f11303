"""Planning time per file: the sizes of N Parquet files from their footers.

``plan`` is what a user calls before ``encode`` (and what ``encode`` does first): it reads
every file's footer once (rows and text bytes of the column) and forms the SuperBatches;
``track_plan_ms_per_file`` divides its time by the number of files.
"""

from __future__ import annotations

import time

import dask.dataframe as dd

import dask_surge

# internal names in one place (see _fixtures)
from dask_surge.planning.sizes import parquet_footer_sizes

from ._fixtures import FOOTER_LAYOUTS, setup_cache  # noqa: F401 - asv reads setup_cache from this module


class PlanParquetFooters:
    """``dask_surge.plan`` and the footer reader over ``files`` small Parquet files."""

    params = sorted(FOOTER_LAYOUTS)
    param_names = ["files"]
    number = 1
    repeat = (1, 10, 20.0)
    timeout = 120

    def setup(self, paths, files):
        self.path = paths[f"footers-{files}"]
        self.ddf = dd.read_parquet(self.path)
        dask_surge.plan(self.ddf, "text", b_min=2_000, b_max=8_000)  # warm: imports, thread pool

    def time_plan(self, paths, files):
        dask_surge.plan(dd.read_parquet(self.path), "text", b_min=2_000, b_max=8_000)

    def time_footer_sizes(self, paths, files):
        parquet_footer_sizes(self.ddf, "text")

    def track_plan_ms_per_file(self, paths, files):
        start = time.perf_counter()
        dask_surge.plan(dd.read_parquet(self.path), "text", b_min=2_000, b_max=8_000)
        return (time.perf_counter() - start) * 1e3 / files

    track_plan_ms_per_file.unit = "ms/file"
