"""Writing SuperBatches: their rows staged by the output (:meth:`~dask_surge.io.tables.Output.stage`: a
part file, or a table's uncommitted data files), committed through the manifest."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import SurgeOutputError
from ..io.arrow import to_host
from ..io.directory import discard, sb_key
from ..io.manifest import CommitRecord, Manifest
from ..io.partfiles import skipped_bytes, table_of
from ..io.tables.parquet import ParquetOutput
from ..results import SuperBatchReport
from .events import announce
from .reach import run_gone, task_sees_run
from .superbatch import SuperBatchRows, SuperBatchTask, partition_digest

__all__ = ["PendingCommit", "SuperBatchWriter"]


@dataclass(frozen=True)
class PendingCommit:
    """A SuperBatch encoded and not yet written: what :meth:`SuperBatchWriter.commit` takes.

    Attributes
    ----------
    encoded : SuperBatchRows
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

    encoded: SuperBatchRows
    spans: tuple
    digests: tuple[tuple[int, str], ...]
    started_at: float
    encode_s: float


@dataclass(frozen=True)
class SuperBatchWriter:
    """Encodes, writes and commits one SuperBatch; returns its :class:`~dask_surge.results.SuperBatchReport`."""

    encoder: SuperBatchTask
    manifest: Manifest
    #: codec of the embedding column, resolved where the run starts (None: the worker's surge.compression)
    compression: str | None = None
    #: where the rows go (:class:`~dask_surge.io.tables.Output`: part files, or a table's uncommitted
    #: data files); default: the manifest's output as Parquet
    output: Any = None

    def __post_init__(self) -> None:
        if self.output is None:
            object.__setattr__(self, "output", ParquetOutput(self.manifest.store))

    def __dask_tokenize__(self):
        return (
            "SuperBatchWriter",
            self.encoder.__dask_tokenize__(),
            self.manifest.root,
            self.manifest.run_id,
            self.compression,
            repr(self.output),
        )

    def _digests(self, parts, spans) -> tuple[tuple[int, str], ...]:
        """``(partition, digest of its whole text column)`` of the partitions that this SuperBatch
        shares with another (only those can be recomputed on resume after a partial commit).
        A SuperBatch holds one span per partition, in partition order, as ``parts`` are."""
        return tuple(
            (span.partition, partition_digest(to_host(part)[self.encoder.column]))
            for part, (span, n) in zip(parts, spans)
            if span.start > 0 or span.stop < n
        )

    def sees_output(self) -> None:
        """Raise unless this worker process reads the run's output as the client wrote it (once per
        process and run: :func:`~dask_surge.execution.reach.task_sees_run`)."""
        task_sees_run(self.manifest)

    def __call__(self, parts, spans) -> SuperBatchReport:
        """Encode ``spans`` (``(Span, partition rows)`` pairs) of ``parts`` (their input
        partitions, in order) and commit them as the SuperBatch keyed by the first span."""
        return self.commit(self.encode(parts, spans))

    def encode(self, parts, spans) -> PendingCommit:
        """The first half of :meth:`__call__`: encode the SuperBatch (what needs its input partitions)."""
        started_at, t0 = time.time(), time.perf_counter()
        encoded = self.encoder.encode(parts, spans)
        return PendingCommit(
            encoded, tuple(spans), self._digests(parts, spans), started_at, time.perf_counter() - t0
        )

    def commit(self, batch: PendingCommit) -> SuperBatchReport:
        """The second half of :meth:`__call__`: stage the encoded SuperBatch's rows, commit them
        (exclusive, fsynced record) and publish them. Needs nothing of the input, so a unit runs it on its
        writer thread while it encodes its next SuperBatch (see :class:`dask_surge.execution.unit.UnitRunner`)."""
        t1 = time.perf_counter()
        encoded, spans = batch.encoded, batch.spans
        first = spans[0][0]
        key = sb_key(first.partition, first.start)
        frame, skipped = encoded.frame, encoded.skipped
        attempt = uuid.uuid4().hex[:8]
        manifest, store = self.manifest, self.manifest.store
        staged, path = manifest.staging_path(key, attempt), manifest.data_path(key, attempt)
        skip_path, skip_data = manifest.skipped_path(key, attempt), skipped_bytes(skipped)
        won, step, size = False, f"writing {staged!r}", 0
        try:
            if skipped:  # the ids of skipped nulls, beside the commit record (any number of them)
                store.makedirs(skip_path.rsplit("/", 1)[0])
                store.write(skip_path, skip_data)
            # not where readers look: _surge/runs/<run>/staging/, or a table's data files no version names
            written = self.output.stage(table_of(frame), store, staged, self.compression)
            size = written.size
            step = f"creating the commit record {manifest.record_path(key)!r}"
            record = CommitRecord(
                sb=key,
                run=manifest.run_id,
                file=path.rsplit("/", 1)[-1],
                rows=encoded.texts,
                bytes=size,
                sha256=written.sha256,
                spans=tuple((s.partition, s.start, s.stop, int(n)) for s, n in spans),
                skipped=len(skipped),
                skipped_file=skip_path.rsplit("/", 1)[-1] if skipped else "",
                skipped_sha256=hashlib.sha256(skip_data).hexdigest() if skipped else "",
                attempt=attempt,
                pid=os.getpid(),
                committed_at=time.time(),
                digests=batch.digests,
                output_rows=len(frame),
                truncated=encoded.truncated,
                encoded=encoded.encoded,
                reused=encoded.reused,
                table=written.payload,
            )
            won = manifest.commit(record)
            if (
                won and manifest.tasks_publish
            ):  # else the claim holder publishes it (see Manifest.tasks_publish)
                step = f"publishing {path!r}"
                manifest.publish(record)  # now, and only now, under its part-*.parquet name
        except OSError as err:
            if not won:
                for leftover in (staged, skip_path):
                    with contextlib.suppress(OSError):
                        discard(store, leftover)
            if isinstance(err, FileNotFoundError) and not store.exists(manifest.run_dir):
                raise run_gone(manifest, err) from err
            raise SurgeOutputError(
                f"{step} for SuperBatch {key} ({encoded.texts} rows{f', {size:,} bytes' if size else ''}) failed: "
                f"{type(err).__name__}: {err}. "
                + (
                    "The commit is recorded; a rerun publishes its file. "
                    if won
                    else "Committed SuperBatches are kept and no partial or uncommitted file is left where "
                    "readers look. "
                )
                + "Fix: free disk space or fix permissions, then rerun the same call to resume."
            ) from err
        if not won:  # another attempt of this SuperBatch committed first: ours is an orphan
            for leftover in (written.path, skip_path if skipped else ""):
                if leftover:
                    discard(store, leftover)
        else:  # the client's progress moves now, not when the whole unit ends
            announce(manifest.run_id, key, encoded.texts + len(skipped), record.file)
        return SuperBatchReport(
            sb=key,
            rows=encoded.texts,
            skipped=len(skipped),
            file=record.file if won else "",
            bytes=size,
            spans=record.spans,
            started_at=batch.started_at,
            encode_s=batch.encode_s,
            write_s=time.perf_counter() - t1,
            committed=won,
            committed_at=record.committed_at,
            engine=self.encoder.encoder.backend,  # what encoded on this worker
            output_rows=len(frame),
            truncated=encoded.truncated,
            encoded=encoded.encoded,
            reused=encoded.reused,
            model_s=encoded.model_s,
            **_shape_fields(encoded),
        )


def _shape_fields(encoded: SuperBatchRows) -> dict[str, int]:
    """The report's counts of what the model's call computed (-1 each where the backend does not say)."""
    shape = encoded.shape
    if shape is None:
        return {}
    return {
        "sequences": int(shape.sequences),
        "tokens": int(shape.tokens),
        "padded_tokens": int(shape.padded_tokens),
        "forwards": int(shape.forwards),
    }
