"""Parquet write of one SuperBatch: ``parquet_bytes`` (serialize + compress in memory) of
the table SURGE writes (``partition``, ``row``, a 384-d float32 ``embedding``), in the row
groups a run writes (``row_groups`` of 250-row source partitions), for the default codec
(``none``) and zstd."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd

# internal names in one place (see _fixtures)
from dask_surge.io.arrow import embedding_array
from dask_surge.io.partfiles import parquet_bytes, row_groups, table_of

ROWS, DIM, GROUP = 20_000, 384, 250


class ParquetWrite:
    params = ["none", "zstd"]
    param_names = ["compression"]
    number = 1
    repeat = (1, 10, 20.0)

    def setup(self, compression):
        emb = np.random.default_rng(0).standard_normal((ROWS, DIM), dtype=np.float32)
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        frame = pd.DataFrame(
            {
                "partition": np.repeat(np.arange(ROWS // GROUP), GROUP),
                "row": np.tile(np.arange(GROUP), ROWS // GROUP),
            }
        )
        frame["embedding"] = pd.arrays.ArrowExtensionArray(embedding_array(emb))
        self.table = table_of(frame)
        self.groups = row_groups([GROUP] * (ROWS // GROUP))

    def time_parquet_bytes(self, compression):
        parquet_bytes(self.table, self.groups, compression=compression)

    def track_mb_per_s(self, compression):
        start = time.perf_counter()
        parquet_bytes(self.table, self.groups, compression=compression)
        return ROWS * DIM * 4 / 1e6 / (time.perf_counter() - start)

    track_mb_per_s.unit = "MB/s"

    def track_bytes_per_row(self, compression):
        return len(parquet_bytes(self.table, self.groups, compression=compression)) / ROWS

    track_bytes_per_row.unit = "bytes/row"
