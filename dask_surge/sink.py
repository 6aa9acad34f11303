"""Writing SuperBatches: Parquet files committed through the manifest."""

from __future__ import annotations

import hashlib
import io
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import SurgeOutputError
from .manifest import Manifest, write_bytes_atomic
from .superbatch import SuperBatchEncoder

__all__ = ["SuperBatchWriter", "table_of", "parquet_bytes", "skipped_bytes"]

def table_of(frame: pd.DataFrame) -> pa.Table:
    """Arrow table of an encoded frame; the embedding column is not copied.

    No pandas metadata is stored: the file is plain Arrow types that every
    Parquet reader understands.
    """
    return pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)


def skipped_bytes(skipped) -> bytes:
    """Parquet bytes of the ``(partition, row)`` pairs of skipped nulls (int64 columns).

    Examples
    --------
    >>> import io, pyarrow.parquet as pq
    >>> pq.read_table(io.BytesIO(skipped_bytes([(0, 1), (2, 5)]))).to_pylist()
    [{'partition': 0, 'row': 1}, {'partition': 2, 'row': 5}]
    """
    pairs = np.asarray(skipped, dtype=np.int64).reshape(-1, 2)
    table = pa.table({"partition": pairs[:, 0], "row": pairs[:, 1]})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def parquet_bytes(table: pa.Table, group_rows) -> bytes:
    """Serialize ``table`` to Parquet: one row group per source partition
    (``group_rows``: the rows of each, in order).

    Dictionary encoding and statistics are off for the embedding column (they
    cost write time and help no reader); on for ``partition`` and ``row`` so a
    reader can find one partition's row group from the footer alone.
    """
    buf = io.BytesIO()
    other = [c for c in table.column_names if c != "embedding"]
    with pq.ParquetWriter(
        buf, table.schema, use_dictionary=[c for c in other if c not in ("partition", "row")],
        write_statistics=other, compression="zstd",
    ) as writer:
        offset = 0
        for rows in group_rows:
            if rows:
                writer.write_table(table.slice(offset, rows), row_group_size=rows)
                offset += rows
        if table.num_rows == 0:
            writer.write_table(table)
    return buf.getvalue()


@dataclass(frozen=True)
class SuperBatchWriter:
    """Per-SuperBatch task that encodes, writes and commits; returns its commit record."""

    encoder: SuperBatchEncoder
    manifest: Manifest

    def __dask_tokenize__(self):
        return ("SuperBatchWriter", self.encoder.__dask_tokenize__(), self.manifest.root, self.manifest.run_id)

    def __call__(self, parts, sb_index: int, spans) -> pd.DataFrame:
        t0 = time.perf_counter()
        frame, skipped = self.encoder.encode(parts, spans)
        t1 = time.perf_counter()
        # rows of each source partition (one span each); skipped nulls are not among them
        data = parquet_bytes(table_of(frame), np.unique(frame["partition"].to_numpy(), return_counts=True)[1])
        attempt = uuid.uuid4().hex[:8]
        path = self.manifest.data_path(sb_index, attempt)
        skip_path, skip_data = self.manifest.skipped_path(sb_index, attempt), skipped_bytes(skipped)
        try:
            if skipped:  # the ids of skipped nulls, beside the commit record (any number of them)
                self.manifest.fs.makedirs(skip_path.rsplit("/", 1)[0], exist_ok=True)
                write_bytes_atomic(self.manifest.fs, skip_path, skip_data)
            write_bytes_atomic(self.manifest.fs, path, data)
        except OSError as err:
            raise SurgeOutputError(
                f"writing SuperBatch {sb_index} ({len(frame)} rows, {len(data):,} bytes) to {path!r} "
                f"failed: {type(err).__name__}: {err}. Committed SuperBatches are kept and no partial "
                "file is left. Fix: free disk space or fix permissions, then rerun the same call to resume."
            ) from err
        name = path.rsplit("/", 1)[-1]
        record = {
            "sb": sb_index, "run": self.manifest.run_id, "file": name, "rows": len(frame),
            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "spans": [[s.partition, s.start, s.stop] for s, _ in spans],
            "skipped": len(skipped),
            "skipped_file": skip_path.rsplit("/", 1)[-1] if skipped else "",
            "skipped_sha256": hashlib.sha256(skip_data).hexdigest() if skipped else "",
            "attempt": attempt, "pid": os.getpid(), "committed_at": time.time(),
        }
        won = self.manifest.commit(record)
        if not won:  # another attempt of this SuperBatch committed first: ours is an orphan
            self.manifest.fs.rm(path)
            if skipped:
                self.manifest.fs.rm(skip_path)
        t2 = time.perf_counter()
        return pd.DataFrame([{
            "sb": sb_index, "rows": len(frame), "skipped": len(skipped), "file": name if won else "",
            "bytes": len(data),
            "encode_s": t1 - t0, "write_s": t2 - t1, "committed": won, "committed_at": record["committed_at"],
        }])

    @staticmethod
    def meta() -> pd.DataFrame:
        return pd.DataFrame({
            "sb": pd.Series([], dtype="int64"), "rows": pd.Series([], dtype="int64"),
            "skipped": pd.Series([], dtype="int64"), "file": pd.Series([], dtype=object), "bytes": pd.Series([], dtype="int64"),
            "encode_s": pd.Series([], dtype="float64"), "write_s": pd.Series([], dtype="float64"),
            "committed": pd.Series([], dtype=bool), "committed_at": pd.Series([], dtype="float64"),
        })

