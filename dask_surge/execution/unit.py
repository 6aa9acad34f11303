"""The run loop of a written encode: work units streamed through the cluster, a bounded
window at a time, each committing its SuperBatches as they close.

A **unit** is one Dask task over a contiguous range of input partitions, built by
:class:`dask_surge.execution.inputs.InputGraph` as the lazy frame's SuperBatch tasks are.
It computes each of its partitions once (it reads their Parquet files, or runs their
upstream tasks, so the graph has one task per unit, not one per partition), forms
SuperBatches over them with the two-threshold policy, and encodes, writes and commits
each SuperBatch as it closes (:class:`UnitRunner`). Two modes:

- **planned** (partition sizes known without reading data: Parquet footers, in-memory
  frames): SuperBatches are planned ahead (:func:`dask_surge.planning.policy.plan_superbatches`);
  a unit is one SuperBatch, or all the slices of one partition larger than ``b_max``
  (so that partition is read once). The first SuperBatches ramp up from
  ``surge.first-superbatch`` rows to ``b_min`` (the run records the ramp), so the first
  output comes after one small SuperBatch.
- **streaming** (any other input: ``map_partitions`` chains, CSV/JSON, filters, joins):
  no size pass. A unit applies :class:`dask_surge.planning.policy.OnlinePlanner` to its partitions
  as it computes them, holding at most ``b_min + n_max`` rows; only its last SuperBatch
  may be under ``b_min``. Units are a fixed grid of partition ranges (:func:`dask_surge.planning.units.unit_partitions`),
  recorded with the run so a resumed run cuts the same ones.

Commit records name the rows they account for, partition by partition, so a rerun
skips every complete partition without computing it (see :class:`dask_surge.io.manifest.Coverage`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from .._compat import worker_pool_threads
from ..errors import SurgeInputError
from ..io.arrow import to_host
from ..io.directory import sb_key
from ..io.frames import FrameRows
from ..io.manifest import Coverage
from ..planning.policy import OnlinePlanner, Span, SuperBatch
from ..planning.sizes import text_bytes
from ..results import SuperBatchReport
from .inputs import Unit, UnitSource, task_arguments
from .profiler import current_worker, profiler_paused
from .sink import SuperBatchWriter
from .superbatch import partition_digest

__all__ = ["UnitRunner", "planned_units", "streaming_units"]


@dataclass(frozen=True)
class UnitRunner:
    """The task function of a unit (runs on a worker): see module docstring."""

    writer: SuperBatchWriter
    b_min: int
    b_max: int
    max_bytes: int | None

    def __dask_tokenize__(self):
        return ("UnitRunner", self.writer.__dask_tokenize__(), self.b_min, self.b_max, self.max_bytes)

    def __call__(self, source: UnitSource, values: list, unit: Unit) -> list[SuperBatchReport]:
        self.writer.sees_output()  # a worker that joined late without the output: said before any work
        frames = self._checked(source.iterate(unit.partitions, values), unit)
        with profiler_paused(), _Committer(self.writer) as committer:
            if unit.plan is not None:
                self._planned(frames, unit, committer)
            else:
                self._streaming(frames, unit, committer)
        ended = time.time()  # this worker's clock: the client maps commit times onto its own with it
        return [r.with_task_end(ended) for r in committer.reports]

    def _checked(self, frames: Iterator[tuple[int, Any]], unit: Unit) -> Iterator[tuple[int, Any]]:
        """``frames``, each partition that was committed in part checked against its commits."""

        expect = {p: (n, d) for p, n, d in unit.expect}
        for partition, frame in frames:
            if partition in expect:
                rows, digest = expect[partition]
                texts = to_host(frame)[self.writer.encoder.column]
                if len(frame) != rows or (digest is not None and partition_digest(texts) != digest):
                    what = (
                        f"has {len(frame)} rows now but {rows} when part of it was committed"
                        if len(frame) != rows
                        else "holds other texts now than when part of it was committed"
                    )
                    raise SurgeInputError(
                        f"partition {partition} {what}: the input changed since the run started "
                        "(non-deterministic partitions?), so resuming would mix old and new rows. Nothing "
                        "was written for it. Fix: make the input deterministic (persist it, or write it to "
                        "Parquet first), or pass overwrite=True to encode it again from the start."
                    )
            yield partition, frame

    @staticmethod
    def _commit(parts: list, spans: list[tuple[Span, int]], unit: Unit, committer: _Committer) -> None:
        first = spans[0][0]
        if sb_key(first.partition, first.start) not in unit.done:
            committer(parts, tuple(spans))

    def _planned(self, frames: Iterator[tuple[int, Any]], unit: Unit, committer: _Committer) -> None:
        held = dict(frames)
        assert unit.plan is not None and unit.sizes is not None
        planned = dict(zip(unit.partitions, unit.sizes))
        for sb in unit.plan:
            inputs, spans = task_arguments(sb, planned)
            self._commit([held[p] for p in inputs], list(spans), unit, committer)

    def _streaming(self, frames: Iterator[tuple[int, Any]], unit: Unit, committer: _Committer) -> None:
        column = self.writer.encoder.column
        planner = OnlinePlanner(self.b_min, self.b_max, self.max_bytes)
        held: dict[int, tuple[int, Any]] = {}  # planner's partition index -> (partition, frame)

        def emit(sbs: list[SuperBatch]) -> None:
            for sb in sbs:
                spans = [
                    (Span(held[s.partition][0], s.start, s.stop), len(held[s.partition][1])) for s in sb.spans
                ]
                local = sorted({s.partition for s in sb.spans})
                self._commit([held[i][1] for i in local], spans, unit, committer)
                last = sb.spans[-1]
                for i in [
                    i
                    for i in held
                    if i < last.partition or (i == last.partition and last.stop == len(held[i][1]))
                ]:
                    del held[i]  # consumed: release its rows

        for i, (partition, frame) in enumerate(frames):
            frame = frame.sliced() if isinstance(frame, FrameRows) else frame
            held[i] = (partition, frame)
            nbytes = text_bytes(frame[column]) if self.max_bytes else None
            emit(planner.push(len(frame), nbytes))
        emit(planner.finish())


class _Committer:
    """A unit's SuperBatches, encoded in the task's thread and committed on a writer thread.

    Calling it encodes one SuperBatch (in the calling thread: it needs the input partitions,
    and the engine's device work), then hands the encoded rows to one writer thread that
    serializes them to Parquet, hashes, writes, fsyncs and commits them
    (:meth:`~dask_surge.execution.sink.SuperBatchWriter.commit`), so the unit reads and
    encodes its next SuperBatch meanwhile. At most one commit is pending: the next call waits
    for it before it queues its own (so commits keep their order, and a unit holds at most two
    encoded SuperBatches), and leaving the ``with`` block waits for the last. A failed commit
    raises from the next call or from the block's end; an error in the block waits for the
    pending commit before it propagates, so no write outlives the task.
    """

    def __init__(self, writer: SuperBatchWriter) -> None:
        self.writer = writer
        self.reports: list[SuperBatchReport] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def __call__(self, parts: list, spans: tuple) -> None:
        batch = self.writer.encode(parts, spans)
        self._wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="surge-commit")
        # the worker's context (distributed's get_worker(), used to announce the commit) goes with it
        self._pending = self._pool.submit(contextvars.copy_context().run, self.writer.commit, batch)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self.reports.append(pending.result())

    def __enter__(self) -> _Committer:
        return self

    def __exit__(self, kind, err, tb) -> None:
        try:
            if kind is None:
                with _thread_handed_over(self._pending):
                    self._wait()
            elif self._pending is not None:
                wait([self._pending])  # the task's own error wins; the write must not outlive it
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


_handed_over_lock = threading.Lock()
_handed_over = 0  # tasks of this worker process waiting for their last commit out of its thread pool


@contextlib.contextmanager
def _thread_handed_over(pending: Future | None) -> Iterator[None]:
    """While a task waits for its last commit, the worker runs its next task in its place.

    A unit's last SuperBatch has nothing left to encode while the writer thread serializes,
    hashes, writes and fsyncs it, and a planned run's unit is mostly one SuperBatch: without
    this, the worker's thread would idle through every commit. In a distributed worker's
    thread, with that commit still running, the task secedes (:func:`distributed.secede`):
    the worker starts its next task on a fresh thread, which reads and encodes meanwhile. The
    task still returns only once its commit is durable (its report says so), and its errors
    still fail it. At most as many tasks as the worker has threads wait so at a time (each
    holds one encoded SuperBatch: memory stays bounded); past that, and anywhere else (the
    local schedulers, a task called by hand), the task waits in its slot.

    Worker resources (``resources={"GPU": 1}``) are held until the task ends, so a worker whose
    tasks each need all of a resource still runs them one after the other.
    """
    global _handed_over
    nthreads = _worker_threads() if pending is not None and not pending.done() else 0
    with _handed_over_lock:
        seceding = _handed_over < nthreads
        _handed_over += seceding
    try:
        if seceding:
            from distributed import secede

            secede()
        yield
    finally:
        if seceding:
            with _handed_over_lock:
                _handed_over -= 1


def _worker_threads() -> int:
    """Threads of the distributed worker whose thread pool runs this thread (0: none does)."""
    return worker_pool_threads(current_worker())


def _expected(
    partitions: Sequence[int], coverage: Coverage | None
) -> tuple[tuple[int, int, str | None], ...]:
    """What was committed for the partitions among ``partitions`` that are committed in part."""
    if coverage is None:
        return ()
    found = ((p, coverage.expected(p)) for p in partitions)
    return tuple((p, e[0], e[1]) for p, e in found if e is not None)


def planned_units(
    superbatches: Sequence[SuperBatch], sizes: Sequence[int], done: set, coverage: Coverage | None = None
) -> list[Unit]:
    """Units of the planned mode: each uncommitted SuperBatch alone, except that the slices
    of one partition larger than ``b_max`` travel together (so it is read once).

    Examples
    --------
    >>> from dask_surge.planning.policy import plan_superbatches
    >>> plan = plan_superbatches([3, 4, 20, 1], b_min=5, b_max=8)
    >>> [u.partitions for u in planned_units(plan, [3, 4, 20, 1], set())]
    [(0, 1), (2,), (3,)]
    """
    chunks: list[list[SuperBatch]] = []
    for sb in superbatches:
        if sb_key(sb.spans[0].partition, sb.spans[0].start) in done:
            continue
        first = sb.spans[0].partition
        if (
            chunks
            and len(sb.spans) == 1
            and len(chunks[-1][-1].spans) == 1
            and chunks[-1][-1].spans[-1].partition == first
        ):
            chunks[-1].append(sb)
        else:
            chunks.append([sb])
    units = []
    for chunk in chunks:
        parts = tuple(sorted({s.partition for sb in chunk for s in sb.spans}))
        units.append(
            Unit(
                parts,
                tuple(chunk),
                frozenset(),
                tuple(int(sizes[p]) for p in parts),
                expect=_expected(parts, coverage),
            )
        )
    return units


def streaming_units(npartitions: int, per_unit: int, coverage: Coverage) -> list[Unit]:
    """The units a streaming run still has to run: the fixed grid of ``per_unit``
    partitions, each unit starting at its first partition not yet committed.

    SuperBatches formed inside a unit depend only on the sizes from where the unit
    starts, and a unit's commits end at a flush point (empty buffer), so a unit resumed
    from its first uncommitted partition forms the same SuperBatches as the first attempt
    (committed ones are skipped by key): a rerun never duplicates or loses rows, even while
    a task of the killed run is still finishing.

    Examples
    --------
    >>> cov = Coverage.of([((0, 0, 5, 5), (1, 0, 5, 5))])
    >>> [u.partitions for u in streaming_units(6, 3, cov)]
    [(2,), (3, 4, 5)]
    """
    units = []
    for start in range(0, npartitions, per_unit):
        stop = min(npartitions, start + per_unit)
        first = next((p for p in range(start, stop) if not coverage.complete(p)), None)
        if first is None:
            continue
        parts = tuple(range(first, stop))
        done = frozenset(sb_key(p, s) for p in parts for s in coverage.committed_starts(p))
        units.append(Unit(parts, None, done, expect=_expected(parts, coverage)))
    return units
