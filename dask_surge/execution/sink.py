"""Writing SuperBatches: Parquet files committed through the manifest."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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

from ..config import get
from ..errors import SurgeOutputError
from ..io.arrow import to_host
from ..io.layout import EMBEDDING, PARTITION, ROW, TEXT_HASH
from ..io.manifest import CommitRecord, Manifest, discard, sb_key, write_bytes_atomic
from ..io.reuse import text_hash_field
from ..results import SuperBatchReport
from .events import announce
from .superbatch import Encoded, SuperBatchEncoder, partition_digest

__all__ = ["EncodedBatch", "SuperBatchWriter", "ROW_GROUP_ROWS", "row_groups", "table_of", "parquet_bytes",
           "skipped_bytes"]

#: Rows a part file's row group holds at least (but the file's last): whole source partitions, in order,
#: are gathered until this many: a row group per partition costs several times the write time and more
#: bytes (``docs/ab_studies.md``, "Row groups"), and readers pay per row group too.
ROW_GROUP_ROWS = 1024


def table_of(frame: pd.DataFrame) -> pa.Table:
    """Arrow table of an encoded frame; the embedding column is not copied.

    No pandas metadata is stored: the file is plain Arrow types that every
    Parquet reader understands.
    """
    table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)
    i = table.schema.get_field_index(TEXT_HASH)
    if i >= 0:  # the field records the hash algorithm (dask_surge.io.reuse reads it)
        table = table.set_column(i, text_hash_field(), table.column(i))
    return table


def skipped_bytes(skipped) -> bytes:
    """Parquet bytes of the ``(partition, row)`` pairs of skipped nulls (int64 columns).

    Examples
    --------
    >>> import io, pyarrow.parquet as pq
    >>> pq.read_table(io.BytesIO(skipped_bytes([(0, 1), (2, 5)]))).to_pylist()
    [{'partition': 0, 'row': 1}, {'partition': 2, 'row': 5}]
    """
    pairs = np.asarray(skipped, dtype=np.int64).reshape(-1, 2)
    table = pa.table({PARTITION: pairs[:, 0], ROW: pairs[:, 1]})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def row_groups(partition_rows, floor: int = ROW_GROUP_ROWS) -> list[int]:
    """Rows of each row group of a part file whose source partitions have ``partition_rows`` rows, in order.

    A row group holds whole partitions, consecutive ones, and closes once it holds at
    least ``floor`` rows: no partition is split across row groups, so the ``partition``
    column's statistics in the footer name the one row group that holds a partition.

    Parameters
    ----------
    partition_rows : sequence of int
        Rows of each source partition in the file, in file order (zeros are left out).
    floor : int, default ROW_GROUP_ROWS
        Rows a row group gathers at least, but the last.

    Returns
    -------
    list of int
        Rows of each row group; they sum to ``sum(partition_rows)``.

    Examples
    --------
    >>> row_groups([600, 300, 200, 5000, 10, 10], floor=1024)
    [1100, 5000, 20]
    >>> row_groups([])
    []
    """
    groups, rows = [], 0
    for n in partition_rows:
        rows += int(n)
        if rows >= floor:
            groups.append(rows)
            rows = 0
    if rows:
        groups.append(rows)
    return groups


def parquet_bytes(table: pa.Table, group_rows, compression: str | None = None) -> memoryview:
    """Serialize ``table`` to Parquet in row groups of ``group_rows`` rows each, in order
    (a part file's are :func:`row_groups`).

    Dictionary encoding and statistics are off for the embedding column (they
    cost write time and help no reader); statistics are on for ``partition`` and
    ``row`` so a reader can find a partition's row group from the footer alone.
    ``text_hash`` (random 16-byte values) is written plain: a dictionary of
    distinct hashes only costs write time (about 0.25 us a row) and bytes.

    Parameters
    ----------
    table : pyarrow.Table
    group_rows : sequence of int
        Rows of each row group, in order.
    compression : {"none", "snappy", "lz4", "zstd"}, optional
        Codec of the embedding column; None reads ``surge.compression`` (default
        ``"none"``: float vectors barely compress, see README "Performance"). The
        other columns are always zstd.

    Returns
    -------
    memoryview
        The file's bytes, a view of the Arrow buffer they were written into
        (no copy); ``bytes(...)`` makes one if needed.

    Examples
    --------
    >>> import pyarrow as pa, pyarrow.parquet as pq
    >>> t = pa.table({"partition": [0, 0], "row": [0, 1], "embedding": [[1.0, 2.0], [3.0, 4.0]]})
    >>> data = parquet_bytes(t, [2], compression="none")
    >>> pq.read_table(pa.BufferReader(data)).num_rows
    2
    """

    codec = get("compression", compression)
    sink = pa.BufferOutputStream()
    other = [c for c in table.column_names if c != EMBEDDING]
    codecs = {leaf: (codec if leaf.split(".", 1)[0] == EMBEDDING else "zstd") for leaf in _leaf_paths(table.schema)}
    with pq.ParquetWriter(
        sink, table.schema, use_dictionary=[c for c in other if c not in (PARTITION, ROW, TEXT_HASH)],
        write_statistics=other, compression=codecs,
    ) as writer:
        offset = 0
        for rows in group_rows:
            if rows:
                writer.write_table(table.slice(offset, rows), row_group_size=rows)
                offset += rows
        if table.num_rows == 0:
            writer.write_table(table)
    return memoryview(sink.getvalue())


@functools.lru_cache(maxsize=32)
def _leaf_paths(schema: pa.Schema) -> tuple[str, ...]:
    """Parquet leaf column paths of ``schema`` (``embedding.list.element``...), as per-column options key them."""
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    parquet_schema = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    return tuple(parquet_schema.column(i).path for i in range(len(parquet_schema)))


@dataclass(frozen=True)
class EncodedBatch:
    """A SuperBatch encoded and not yet written: what :meth:`SuperBatchWriter.commit` takes.

    Attributes
    ----------
    encoded : Encoded
        The output rows and counts.
    spans : tuple of (Span, int)
        The SuperBatch's spans, with their partitions' rows.
    digests : tuple of (int, str)
        Digests of the partitions it covers in part (see ``CommitRecord.digests``).
    started_at : float
        Wall clock (``time.time()``) when its encoding started.
    encode_s : float
        Seconds its encoding took.
    """

    encoded: Encoded
    spans: tuple
    digests: tuple[tuple[int, str], ...]
    started_at: float
    encode_s: float


@dataclass(frozen=True)
class SuperBatchWriter:
    """Encodes, writes and commits one SuperBatch; returns its :class:`~dask_surge.results.SuperBatchReport`."""

    encoder: SuperBatchEncoder
    manifest: Manifest
    #: codec of the embedding column, resolved where the run starts (None: the worker's surge.compression)
    compression: str | None = None

    def __dask_tokenize__(self):
        return ("SuperBatchWriter", self.encoder.__dask_tokenize__(), self.manifest.root, self.manifest.run_id,
                self.compression)

    def _digests(self, parts, spans) -> tuple[tuple[int, str], ...]:
        """``(partition, digest of its whole text column)`` of the partitions that this SuperBatch
        shares with another (only those can be recomputed on resume after a partial commit).
        A SuperBatch holds one span per partition, in partition order, as ``parts`` are."""
        return tuple((span.partition, partition_digest(to_host(part)[self.encoder.column]))
                     for part, (span, n) in zip(parts, spans) if span.start > 0 or span.stop < n)

    def __call__(self, parts, spans) -> SuperBatchReport:
        """Encode ``spans`` (``(Span, partition rows)`` pairs) of ``parts`` (their input
        partitions, in order) and commit them as the SuperBatch keyed by the first span."""
        return self.commit(self.encode(parts, spans))

    def encode(self, parts, spans) -> EncodedBatch:
        """The first half of :meth:`__call__`: encode the SuperBatch (what needs its input partitions)."""
        started_at, t0 = time.time(), time.perf_counter()
        encoded = self.encoder.encode(parts, spans)
        return EncodedBatch(encoded, tuple(spans), self._digests(parts, spans), started_at,
                            time.perf_counter() - t0)

    def commit(self, batch: EncodedBatch) -> SuperBatchReport:
        """The second half of :meth:`__call__`: write the encoded SuperBatch's Parquet file, commit it
        (exclusive, fsynced record) and publish it. Needs nothing of the input, so a unit runs it on its
        writer thread while it encodes its next SuperBatch (see :class:`dask_surge.execution.runner.UnitRunner`)."""
        t1 = time.perf_counter()
        encoded, spans = batch.encoded, batch.spans
        first = spans[0][0]
        key = sb_key(first.partition, first.start)
        frame, skipped = encoded.frame, encoded.skipped
        # rows of each source partition (one span each); skipped nulls are not among them
        groups = row_groups(np.unique(frame[PARTITION].to_numpy(), return_counts=True)[1])
        data = parquet_bytes(table_of(frame), groups, self.compression)
        attempt = uuid.uuid4().hex[:8]
        manifest, fs = self.manifest, self.manifest.fs
        staged, path = manifest.staging_path(key, attempt), manifest.data_path(key, attempt)
        skip_path, skip_data = manifest.skipped_path(key, attempt), skipped_bytes(skipped)
        record = CommitRecord(
            sb=key, run=manifest.run_id, file=path.rsplit("/", 1)[-1], rows=encoded.texts, bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            spans=tuple((s.partition, s.start, s.stop, int(n)) for s, n in spans),
            skipped=len(skipped), skipped_file=skip_path.rsplit("/", 1)[-1] if skipped else "",
            skipped_sha256=hashlib.sha256(skip_data).hexdigest() if skipped else "",
            attempt=attempt, pid=os.getpid(), committed_at=0.0, digests=batch.digests,
            output_rows=len(frame), truncated=encoded.truncated, encoded=encoded.encoded, reused=encoded.reused,
        )
        won, step = False, f"writing {staged!r}"
        try:
            if skipped:  # the ids of skipped nulls, beside the commit record (any number of them)
                fs.makedirs(skip_path.rsplit("/", 1)[0], exist_ok=True)
                write_bytes_atomic(fs, skip_path, skip_data)
            write_bytes_atomic(fs, staged, data)  # not where readers look: _surge/runs/<run>/staging/
            step = f"creating the commit record {manifest.record_path(key)!r}"
            record = dataclasses.replace(record, committed_at=time.time())
            won = manifest.commit(record)
            if won and manifest.tasks_publish:  # else the claim holder publishes it (see Manifest.tasks_publish)
                step = f"publishing {path!r}"
                manifest.publish(record)  # now, and only now, under its part-*.parquet name
        except OSError as err:
            if not won:
                for leftover in (staged, skip_path):
                    with contextlib.suppress(OSError):
                        discard(fs, manifest.root, leftover)
            if isinstance(err, FileNotFoundError) and not fs.exists(manifest.run_dir):
                raise SurgeOutputError(
                    f"SuperBatch {key} of run {manifest.run_id} was not committed: the run's directory "
                    f"{manifest.run_dir!r} is gone, so another run replaced it. Nothing of this task was kept."
                ) from err
            raise SurgeOutputError(
                f"{step} for SuperBatch {key} ({encoded.texts} rows, {len(data):,} bytes) failed: "
                f"{type(err).__name__}: {err}. " + (
                    "The commit is recorded; a rerun publishes its file. " if won else
                    "Committed SuperBatches are kept and no partial or uncommitted file is left where "
                    "readers look. ") +
                "Fix: free disk space or fix permissions, then rerun the same call to resume."
            ) from err
        if not won:  # another attempt of this SuperBatch committed first: ours is an orphan
            discard(fs, manifest.root, staged)
            if skipped:
                discard(fs, manifest.root, skip_path)
        else:  # the client's progress moves now, not when the whole unit ends
            announce(manifest.run_id, key, encoded.texts + len(skipped), record.file)
        return SuperBatchReport(
            sb=key, rows=encoded.texts, skipped=len(skipped), file=record.file if won else "", bytes=len(data),
            spans=record.spans, started_at=batch.started_at, encode_s=batch.encode_s, write_s=time.perf_counter() - t1,
            committed=won, committed_at=record.committed_at,
            engine=self.encoder.encoder.backend,  # what encoded on this worker
            output_rows=len(frame), truncated=encoded.truncated, encoded=encoded.encoded, reused=encoded.reused,
        )
