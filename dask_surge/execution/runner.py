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
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from .. import config
from ..engine.tokenizing import LONE_SURROGATE
from ..errors import SurgeError, SurgeInputError, SurgeOutputError
from ..io.arrow import to_host
from ..io.directory import sb_key
from ..io.frames import FrameRows
from ..io.layout import family_of_run
from ..io.lease import Claim
from ..io.manifest import (
    Coverage,
    Manifest,
    RunPlan,
    current_run,
    find_run,
    fingerprint_digest,
    finish_run,
    open_run,
    settle,
    settled,
    text_counts,
)
from ..io.stores import check_output, check_store, output_fs
from ..io.tables import open_table
from ..io.tables.locations import TableLocation
from ..planning.policy import OnlinePlanner, Span, SuperBatch, plan_superbatches
from ..planning.sizes import PartitionSizes, known_sizes, text_bytes
from ..planning.thresholds import Requested, Thresholds
from ..planning.units import unit_partitions
from ..results import EncodeResult, SuperBatchReport
from .events import listen
from .inputs import InputGraph, Unit, UnitSource, input_files, task_arguments
from .plugins import models_ready
from .profiler import profiler_paused
from .progress import RunProgress, logging_through
from .reach import check_workers_see_output
from .sink import SuperBatchWriter
from .superbatch import SuperBatchTask, partition_digest
from .tables import TableCommitter, check_table_dir

__all__ = ["Unit", "UnitRunner", "planned_units", "streaming_units", "InputGraph", "RunRequest",
           "ThresholdResolver", "run_units", "task_resources", "write_run"]

logger = logging.getLogger(__name__)

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
                    what = (f"has {len(frame)} rows now but {rows} when part of it was committed"
                            if len(frame) != rows else "holds other texts now than when part of it was committed")
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
                spans = [(Span(held[s.partition][0], s.start, s.stop), len(held[s.partition][1])) for s in sb.spans]
                local = sorted({s.partition for s in sb.spans})
                self._commit([held[i][1] for i in local], spans, unit, committer)
                last = sb.spans[-1]
                for i in [i for i in held if i < last.partition or (i == last.partition
                                                                    and last.stop == len(held[i][1]))]:
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
    try:
        from distributed import get_worker
        from distributed.threadpoolexecutor import thread_state

        worker = get_worker()
    except (ImportError, ValueError):
        return 0
    if getattr(thread_state, "executor", None) is None or not getattr(thread_state, "proceed", False):
        return 0  # not one of the worker's pool threads, or one that already left it
    return int(worker.state.nthreads)


def _expected(partitions: Sequence[int], coverage: Coverage | None) -> tuple[tuple[int, int, str | None], ...]:
    """What was committed for the partitions among ``partitions`` that are committed in part."""
    if coverage is None:
        return ()
    found = ((p, coverage.expected(p)) for p in partitions)
    return tuple((p, e[0], e[1]) for p, e in found if e is not None)


def planned_units(superbatches: Sequence[SuperBatch], sizes: Sequence[int], done: set,
                  coverage: Coverage | None = None) -> list[Unit]:
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
        if chunks and len(sb.spans) == 1 and len(chunks[-1][-1].spans) == 1 \
                and chunks[-1][-1].spans[-1].partition == first:
            chunks[-1].append(sb)
        else:
            chunks.append([sb])
    units = []
    for chunk in chunks:
        parts = tuple(sorted({s.partition for sb in chunk for s in sb.spans}))
        units.append(Unit(parts, tuple(chunk), frozenset(), tuple(int(sizes[p]) for p in parts),
                          expect=_expected(parts, coverage)))
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


def task_resources(client) -> dict | None:
    """Worker resources for unit tasks: when workers advertise ``GPU`` (dask-cuda
    workers from :func:`dask_surge.execution.cluster.local_cluster` or :mod:`dask_surge.execution.hpc`), each
    task claims ``1 / n`` of one (``n``: ``surge.superbatches-per-gpu``, read here on the
    client), so SuperBatches run only on GPU workers, at most ``n`` at a time per GPU (the
    engine serializes the forward passes; the others read, tokenize, write and commit).
    ``None`` when no worker advertises a GPU.

    Examples
    --------
    >>> task_resources(None) is None
    True
    """
    if client is None:
        return None
    workers = client.scheduler_info(n_workers=-1).get("workers", {}).values()
    if any(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers):
        return {"GPU": 1 / int(config.get("superbatches-per-gpu"))}
    return None


def run_units(units, make_task, client, scheduler, in_flight: int,
              resources: dict | None = None) -> Iterator[SuperBatchReport]:
    """Yield SuperBatch reports as units finish, with at most ``in_flight`` units submitted.

    ``units`` is an iterator of :class:`Unit`; ``make_task(key, unit)`` gives a unit's graph. Units are submitted in order, so the first commits early (TTFO) and no
    worker holds more than a bounded number of them.
    """
    counter = iter(range(10**12))

    def submit(unit: Unit):
        key = (f"surge-unit-{id(units):x}", next(counter))
        return key, make_task(key, unit)

    if client is None:
        from dask.local import get_sync
        from dask.threaded import get as get_threads

        get = get_sync if scheduler in ("sync", "synchronous") else get_threads
        for unit in units:
            key, graph = submit(unit)
            yield from _received(get(graph, key))
        return
    from distributed import as_completed

    running = as_completed(loop=client.loop)  # this client's, which need not be the default one
    live: list = []
    waiting: set = set()  # submitted, not yet handed back by `running`
    finished = threading.Event()  # set as any of them finishes
    exhausted = False

    def submit_more() -> None:
        nonlocal exhausted
        while not exhausted and running.count() < in_flight:
            unit = next(units, None)
            if unit is None:
                exhausted = True
                return
            key, graph = submit(unit)
            future = client.get(graph, key, sync=False, resources=resources)
            live.append(future)
            waiting.add(future)
            future.add_done_callback(lambda _: finished.set())
            running.add(future)

    watch = WorkerWatch(client, config.get("no-workers-timeout"))
    try:
        submit_more()
        while not running.is_empty():
            if not running.has_ready():
                finished.clear()
                # none finished: wait for one, asking now and then whether any worker is left
                if not any(f.done() for f in waiting) and not finished.wait(watch.poll_s):
                    watch.check(len(waiting))  # raises once every worker has been gone too long
                    continue
            fut = next(running)  # (one that finished reaches `running` a moment later)
            waiting.discard(fut)
            reports = fut.result()
            fut.release()
            submit_more()
            yield from _received(reports)
    finally:
        client.cancel([f for f in live if not f.done()])


class NoWorkersLeft(RuntimeError):
    """Every worker left the cluster while SuperBatches waited, for longer than
    ``surge.no-workers-timeout`` (see :class:`WorkerWatch`); :func:`stopped_error` says what is kept."""


class WorkerWatch:
    """Watches, while a run waits on SuperBatch tasks, whether the cluster still has a worker.

    A run whose cluster had workers and then has none for ``timeout`` seconds (jobs preempted
    or cancelled, worker processes that crashed, or that closed, nanny and all, because they
    could not unpickle a task) raises :class:`NoWorkersLeft` from :meth:`check`, instead of
    waiting for ever: Dask's own ``distributed.scheduler.no-workers-timeout`` is off by default.
    A cluster that has not had a worker yet (jobs still queued) is waited for, as long as it
    takes; ``timeout`` None waits for workers in every case.

    Examples
    --------
    >>> WorkerWatch(None, None).check(1)  # no timeout: nothing to watch
    """

    poll_s = 2.0  # how often a run that waits asks the scheduler how many workers it has

    def __init__(self, client, timeout: float | None, clock=time.monotonic) -> None:
        self.client, self.timeout, self.clock = client, timeout, clock
        self.had_workers = False
        self.gone_since: float | None = None
        if timeout is not None:
            self._workers()

    def _workers(self) -> int:
        n = len(self.client.nthreads())
        self.had_workers = self.had_workers or n > 0
        return n

    def check(self, waiting: int) -> None:
        """Raise :class:`NoWorkersLeft` if every worker has been gone for ``timeout`` seconds while
        ``waiting`` SuperBatch tasks wait."""
        if self.timeout is None:
            return
        if self._workers() or not self.had_workers:
            self.gone_since = None
            return
        now = self.clock()
        if self.gone_since is None:
            self.gone_since = now
            logger.warning("every worker has left the cluster; %d SuperBatch task(s) wait for one "
                           "(the run stops after surge.no-workers-timeout=%ss)", waiting, self.timeout)
        elif now - self.gone_since >= self.timeout:
            raise NoWorkersLeft(
                f"every worker left the cluster and none came back within surge.no-workers-timeout="
                f"{self.timeout:g}s, while {waiting} SuperBatch task(s) waited"
            )


def _received(reports: list[SuperBatchReport]) -> list[SuperBatchReport]:
    """``reports`` with ``committed_at`` on the client's clock (see
    :meth:`~dask_surge.results.SuperBatchReport.on_client_clock`)."""
    now = time.time()
    return [r.on_client_clock(now) for r in reports]


def stopped_error(err: BaseException, manifest: Manifest, column: str) -> BaseException | None:
    """The error to raise for a run that stopped on ``err``: what is kept and how to go on
    (``None``: raise ``err`` as it is)."""
    kept = f"{len(manifest.committed())} SuperBatches are committed and kept"
    if isinstance(err, (UnicodeDecodeError, UnicodeEncodeError)):
        return not_utf8(column, err, kept)
    if isinstance(err, SurgeInputError) and "on_null=" in str(err):  # a null text (superbatch.texts_of)
        return SurgeInputError(
            f"{err} {kept}: a rerun with on_null='empty' or on_null='skip' resumes from them (on_null is not "
            "part of the run's identity); a cleaned column is another input, a new run (write it to a new "
            "output, or pass overwrite=True)."
        )
    if isinstance(err, NoWorkersLeft):
        return SurgeError(
            f"{err}: workers were killed or exited (jobs preempted, cancelled or out of walltime; a crash, "
            "e.g. out of memory), or closed because they could not unpickle a task (their logs then say "
            "'Failed to deserialize', e.g. ModuleNotFoundError: a function of the input defined in a module "
            f"the workers cannot import). {kept}. Fix: see the workers' logs; move such functions into a "
            "module installed on the workers; start workers again (cluster.scale(n), or cluster.adapt(...) "
            "to replace lost jobs), then rerun the same call to resume (surge.no-workers-timeout=None "
            "waits for workers instead)."
        )
    if type(err).__name__ in ("NoWorkerError", "NoValidWorkerError"):
        return SurgeError(
            f"no worker was left to run the SuperBatches ({err}): jobs preempted, cancelled or out of "
            f"walltime, for longer than distributed.scheduler.no-workers-timeout. {kept}. Fix: start "
            "workers again (e.g. cluster.scale(jobs=n), or cluster.adapt(...) to replace lost jobs), then "
            "rerun the same call to resume."
        )
    if type(err).__name__ == "KilledWorker":
        return SurgeError(
            f"a SuperBatch task killed its worker repeatedly ({err}); the usual cause is running "
            f"out of memory. {kept}. Fix: lower b_min/b_max (or max_bytes for huge texts, or max_tokens), "
            "give workers more memory, then rerun the same call to resume."
        )
    return None


def not_utf8(column: str, err: UnicodeDecodeError | UnicodeEncodeError, kept: str) -> SurgeInputError:
    """The error for a text column that is not UTF-8: bytes that do not decode, or (converting
    Python strings to Arrow) a str with a lone surrogate, which has no UTF-8 form."""
    if isinstance(err, UnicodeEncodeError):
        return SurgeInputError(
            f"the text column {column!r} holds a str with a lone surrogate ({err}), {LONE_SURROGATE} "
            f"{kept}; rerun once it is fixed."
        )
    return SurgeInputError(
        f"the text column {column!r} holds bytes that are not valid UTF-8 ({err}). {kept}. Fix: decode "
        "the column yourself first, e.g. .map(lambda b: b.decode('utf-8', errors='replace')), then rerun."
    )


def interrupted(manifest: Manifest, output: str, planned: int | None) -> None:
    of = f" of {planned}" if planned is not None else ""
    logger.warning(
        "dask-surge: interrupted; %d%s SuperBatches are committed in %s and kept. "
        "Rerun the same call to resume from there.", len(manifest.committed()), of, output,
    )

class ThresholdResolver(Protocol):
    """What a run asks of its caller to start: the thresholds of a new run, resolved once the
    partition sizes known without reading data are (``sizes``: None when the input streams)."""

    @property
    def requested(self) -> tuple[Requested, Requested]:
        """``(b_min, b_max)`` as asked: ints or ``"auto"`` (a resumed run says where they differ
        from the ones it recorded)."""
        ...

    def __call__(self, sizes: PartitionSizes | None, max_bytes: int | None) -> Thresholds: ...


@dataclass(frozen=True)
class RunRequest:
    """A written run as :func:`dask_surge.encode` resolved it: what :func:`write_run` does.

    Attributes
    ----------
    frame : dask.dataframe.DataFrame
        The input as the run reads it (the text column and the kept columns).
    encoder : SuperBatchTask
        What each SuperBatch task runs.
    output : str
        The output directory.
    fingerprint : dict
        The run's identity (:func:`dask_surge.api.fingerprint`): a rerun of the same one resumes.
    thresholds : ThresholdResolver
        The thresholds of a new run; a resumed run keeps the ones it recorded.
    max_bytes : int or None
        The byte cap asked for; a resumed run keeps the one it recorded.
    client : distributed.Client or None
        Runs the units; None: the local ``scheduler`` (``"sync"`` or ``"threads"``) does.
    started : float, optional
        ``time.perf_counter()`` when the caller was called: times and TTFO count from there.
    """

    frame: Any
    encoder: SuperBatchTask
    output: str
    fingerprint: dict
    thresholds: ThresholdResolver
    max_bytes: int | None = None
    client: Any = None
    scheduler: Any = None
    overwrite: bool = False
    storage_options: dict | None = None
    progress: bool = True
    started: float | None = None
    #: a bar the caller opened already (from the first second: while it started a cluster); None: a new one
    bar: RunProgress | None = None
    #: ``"parquet"`` (part files), or a table format (:mod:`dask_surge.execution.tables`)
    format: str = "parquet"
    #: ``"append"``: a table output may be one this run did not create
    mode: str = "create"

    def table(self) -> Any:
        """The table of a table output (None for Parquet)."""
        if self.format == "parquet":
            return None
        return open_table(self.format, TableLocation.of(self.output, self.storage_options))

    @property
    def threads(self) -> int:
        """Worker threads that run the units (one for the local schedulers)."""
        return sum(self.client.nthreads().values()) if self.client is not None else 1


def write_run(request: RunRequest) -> EncodeResult:
    """Encode ``request.frame`` into ``request.output``: open or resume the run, stream its
    units, finish it. Returns an :class:`~dask_surge.results.EncodeResult`."""
    t0 = time.perf_counter() if request.started is None else request.started
    wall0 = time.time() - (time.perf_counter() - t0)  # the same instant on the wall clock
    with contextlib.ExitStack() as stack:
        bar = request.bar  # a bar the caller opened stays the caller's to close
        if bar is None:
            bar = stack.enter_context(RunProgress(enabled=request.progress))
            stack.enter_context(logging_through(bar))
        bar.phase("planning")
        output, storage_options = request.output, request.storage_options
        table = request.table()
        if table is None:
            check_output(output, storage_options, inputs=input_files(request.frame))
        found = find_run(output, request.fingerprint, storage_options)
        _say_recorded_thresholds(found, request)
        fs, root = output_fs(output, storage_options)
        if table is not None:  # a new or empty directory, or a table (whose history decides)
            check_table_dir(fs, root, table.exists())
            if found is not None:
                found.table = True
        check_store(fs, root)  # an object store honours conditional creates, before the claim relies on one
        if found is not None and found.completion() is not None and not request.overwrite \
                and not found.coverage().missing(request.frame.npartitions):  # records, not the marker, are the truth
            committed = found.committed()
            if not settled(found, committed):  # a process killed while it finished: finish its clean-up
                with Claim.acquire(fs, root, found.run_id, heartbeat=False):
                    settle(found, found.committed(), retire_others=False)
            result = _complete_result(found, output, t0)
            bar.finish(result.rows + result.nulls_skipped, result.superbatches)
            return result
        if request.client is not None:  # before any work: a worker that cannot see the output stops the run
            check_workers_see_output(request.client, fs, root, str(output))
        claim = Claim.acquire(fs, root, fingerprint_digest(request.fingerprint))
        try:
            return _claimed_run(request, t0, wall0, claim, bar, table)
        finally:
            claim.release()


def _say_recorded_thresholds(found: Manifest | None, request: RunRequest) -> None:
    """Warn when a rerun asks for other thresholds than its run recorded.

    Thresholds do not change the embeddings, so they are not part of a run's identity:
    a rerun that asks for others resumes the same run with the thresholds it recorded
    (its SuperBatches, committed or not, keep their boundaries), and says so.
    """
    plan = found.plan if found is not None else None
    if plan is None:
        return
    recorded = {"b_min": plan.b_min, "b_max": plan.b_max}
    asked = dict(zip(recorded, request.thresholds.requested))
    differ = [f"{k}={v!r} (recorded: {recorded[k]!r})" for k, v in asked.items() if v != "auto" and v != recorded[k]]
    if plan.max_bytes != request.max_bytes:
        differ.append(f"max_bytes={request.max_bytes!r} (recorded: {plan.max_bytes!r})")
    if differ:
        logger.warning(
            "dask-surge: resuming the run in %s with the thresholds it recorded when it started; %s "
            "apply to a new run only (write to a new output, or pass overwrite=True).", request.output,
            ", ".join(differ))


def _new_plan(request: RunRequest, sizes: PartitionSizes | None, max_bytes: int | None, threads: int) -> RunPlan:
    """What a new run records: the thresholds resolved for it, and how it runs."""
    th = request.thresholds(sizes, max_bytes)
    npartitions = request.frame.npartitions
    if sizes is None:
        return RunPlan(th.b_min, th.b_max, "streaming", npartitions, max_bytes, th.reason,
                       unit_partitions=unit_partitions(npartitions, threads))
    return RunPlan(th.b_min, th.b_max, "planned", npartitions, max_bytes, th.reason, rows=sizes.total,
                   first=config.get("first-superbatch"))


def _follow_model(bar: RunProgress, request: RunRequest) -> None:
    """The ``loading model`` phase: per worker on a cluster (its plugin loads in the
    background), else in this process (the first SuperBatch loads it)."""
    encoder, client = request.encoder.encoder, request.client
    if client is not None:
        bar.follow_model(lambda: models_ready(client, encoder), workers=True)
    else:
        bar.follow_model(lambda: (int(encoder.is_loaded), 1), workers=False)


def _table_overwrite(request: RunRequest) -> bool:
    """``overwrite`` for :func:`open_run` of a table output: ``mode="append"`` replaces the manifest of
    another dask-surge run that completed (its rows stay in the table: they are committed there)."""
    other = current_run(request.output, request.storage_options)
    if other is None or other.run_id == fingerprint_digest(request.fingerprint):
        return False
    if request.mode != "append":
        return False  # open_run refuses, naming what differs
    if other.completion() is None:
        raise SurgeOutputError(
            f"output={request.output!r} holds run {other.run_id} of dask-surge, not finished: appending another "
            "run now would leave its SuperBatches out of the table. Nothing was written. Fix: rerun that run "
            "to finish it, then append; or write to a new path.")
    return True


def _claimed_run(request: RunRequest, t0: float, wall0: float, claim: Claim, bar: RunProgress,
                 table: Any = None) -> EncodeResult:
    """:func:`write_run` once the output directory is claimed."""

    frame, sbe, output, client = request.frame, request.encoder, request.output, request.client
    npartitions, threads = frame.npartitions, request.threads
    found = find_run(output, request.fingerprint, request.storage_options)
    recorded = found.plan if found is not None else None
    max_bytes = recorded.max_bytes if recorded is not None else request.max_bytes  # a resumed run keeps its own
    sizes = None if recorded is not None and recorded.mode == "streaming" else known_sizes(frame, sbe.column, max_bytes)
    overwrite = request.overwrite if table is None else _table_overwrite(request)
    manifest, resumed = open_run(output, request.fingerprint, overwrite=overwrite,
                                 storage_options=request.storage_options,
                                 plan=_new_plan(request, sizes, max_bytes, threads) if found is None else None)
    manifest.table = table is not None  # a table output publishes nothing: its claim holder commits to the table
    plan = manifest.plan
    if plan is None:  # pragma: no cover - a run of write_run always records one
        raise SurgeError(f"the run in {output!r} recorded no plan. Fix: rerun with overwrite=True.")
    b_min, b_max = plan.b_min, plan.b_max
    committed = manifest.committed(repair=True)
    manifest.publish_pending(committed)  # commits whose task died before publishing their file
    coverage = manifest.coverage(committed)
    done_rows = sum(r.accounted for r in committed.values())
    planned_sbs = None
    if plan.mode == "planned":
        if sizes is None:  # pragma: no cover - a planned run's input keeps its metadata sizes
            raise SurgeError(f"the run in {output!r} was planned from known partition sizes, which the "
                             "input no longer gives. Fix: rerun on the same input, or overwrite=True.")
        cap = max_bytes if sizes.nbytes is not None else None
        superbatches = plan_superbatches(sizes.sizes, b_min, b_max, nbytes=sizes.nbytes, max_bytes=cap,
                                         first=plan.first)  # the ramp this run recorded
        planned_sbs = len(superbatches)
        units = planned_units(superbatches, sizes.sizes, set(committed), coverage)
        bar.planned(rows=sizes.total, superbatches=planned_sbs, done_rows=done_rows,
                    done_superbatches=len(committed))
    else:
        units = streaming_units(npartitions, int(plan.unit_partitions or 1), coverage)
        bar.planned(rows=None, superbatches=None, done_rows=done_rows, done_superbatches=len(committed))
    # the codec as the caller configured it (dask.config.set on the client), not as each worker's config says
    runner = UnitRunner(SuperBatchWriter(sbe, manifest, config.get("compression"), table), b_min, b_max, max_bytes)
    reports: list[SuperBatchReport] = []
    ttfo = None
    # on an object store this process publishes each commit as it hears of it (Manifest.tasks_publish)
    publisher = None if manifest.tasks_publish or manifest.defer_publish or table else Publisher(manifest)
    committer = None
    if table is not None:  # commits what a killed process left first, then batches as commits arrive
        committer = TableCommitter(table, manifest, mode=request.mode, every=config.get("table-commit-every"),
                                   seconds=config.get("table-commit-seconds"), claim=claim)
        committer.start()

    def heard(sb: str, rows: int, file: str) -> None:
        bar.commit(sb, rows)
        if publisher is not None and file:
            publisher.submit(sb, file)
        if committer is not None and file:
            committer.submit(sb)

    if units:
        window = config.get("in-flight") or 2 * max(1, threads)
        try:
            graph = InputGraph(frame)  # may already convert in-memory data (bad UTF-8 raises here)
            _follow_model(bar, request)
            with listen(manifest.run_id, heard, client):  # each commit as it happens (events.py)
                for report in run_units(iter(units), lambda key, unit: graph.task(key, runner, unit), client,
                                        request.scheduler, window, task_resources(client)):
                    if report.committed and committer is not None:
                        committer.submit(report.sb)  # one whose commit was not announced
                    elif report.committed and publisher is not None:
                        publisher.submit(report.sb, report.file)  # one whose commit was not announced
                    elif report.committed:  # when its file became readable, not when the client heard
                        first = report.committed_at - wall0
                        ttfo = first if ttfo is None else min(ttfo, first)
                    reports.append(report)
                    bar.commit(report.sb, report.rows + report.skipped)  # one that was not announced
                    if claim.lost:
                        raise SurgeOutputError(
                            f"output={output!r} was claimed by another run while this one was writing (its "
                            "heartbeat could not be refreshed in time: a hung process or a full disk?). This "
                            "run stopped; what it committed is kept. Fix: let the other run finish, or rerun."
                        )
        except BaseException as err:
            if committer is not None:  # what committed is readable in the table (a rerun commits the rest)
                committer.abandon()
            if publisher is not None:  # what committed is readable by part-* globs, as on a filesystem
                publisher.close()
                with contextlib.suppress(Exception):
                    manifest.publish_pending(manifest.committed())
            # a run that stops before its first commit may then be replaced (see open_run)
            manifest.mark_stopped(f"{type(err).__name__}: {err}")
            if isinstance(err, KeyboardInterrupt):
                interrupted(manifest, output, planned_sbs)
            better = stopped_error(err, manifest, sbe.column)
            if better is not None:
                raise better from err
            raise
    if publisher is not None:
        publisher.close()
        if publisher.first is not None:
            ttfo = publisher.first - wall0
    if committer is not None:  # every committed SuperBatch into the table before the run counts as complete
        committer.close()
        ttfo = committer.first - wall0 if committer.first is not None else None
    committed = manifest.committed()
    coverage = manifest.coverage(committed)
    _check_complete(coverage, committed, npartitions, sizes, output)
    summary = {"rows": coverage.total_rows, "superbatches": len(committed), "partitions": npartitions,
               "nulls_skipped": sum(r.skipped for r in committed.values()), **text_counts(committed.values())}
    finish_run(manifest, committed, summary)
    bar.finish(coverage.total_rows, len(committed))
    return EncodeResult(
        output=str(output), run_id=manifest.run_id, rows=coverage.total_rows, partitions=npartitions,
        superbatches=len(committed), skipped_superbatches=len(committed) - sum(r.committed for r in reports),
        seconds=time.perf_counter() - t0, ttfo_s=ttfo,
        sizes_source=sizes.source if sizes is not None else "streamed", resumed=resumed, b_min=b_min, b_max=b_max,
        thresholds_reason=plan.reason, records=tuple(reports), nulls_skipped=summary["nulls_skipped"],
        engine=", ".join(sorted({r.engine for r in reports})),
        output_rows=summary["output_rows"], truncated=summary["truncated"], encoded=summary["encoded"],
        reused=summary["reused"], family=family_of_run(manifest.fingerprint),
    )


class Publisher:
    """Publishes committed SuperBatch files on an object store as their commits reach the
    client (announced, or in a unit's reports), on one thread so that the client's event loop
    never waits on the store; the end of the run publishes whatever is left.

    ``first`` is the wall-clock time the first file became readable (None before).
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.first: float | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dask-surge-publish")
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, sb: str, file: str) -> None:
        """Publish ``file`` of SuperBatch ``sb`` soon (once per SuperBatch)."""
        with self._lock:
            if sb in self._seen:
                return
            self._seen.add(sb)
        with contextlib.suppress(RuntimeError):  # closed: the end of the run publishes it
            self._pool.submit(self._publish, sb, file)

    def _publish(self, sb: str, file: str) -> None:
        try:
            self.manifest.publish_file(sb, file)
        except Exception as err:  # noqa: BLE001 - the end of the run (or a rerun) publishes it, or says why
            logger.warning("dask-surge: publishing %s waits for the end of the run: %s", file, err)
            return
        if self.first is None:
            self.first = time.time()

    def close(self) -> None:
        """Wait for the files submitted so far."""
        self._pool.shutdown(wait=True)


def _check_complete(coverage: Coverage, committed: dict, npartitions: int, sizes, output: str) -> None:
    """Refuse to mark a run complete unless its commits account for every input row once."""
    missing = coverage.missing(npartitions)
    if missing:  # pragma: no cover - each unit either raised or committed every partition
        raise SurgeError(
            f"{len(missing)} partition(s) have no committed SuperBatch (first: {missing[:5]}); the output "
            "is incomplete. Fix: rerun the same call to resume."
        )
    accounted = sum(r.accounted for r in committed.values())
    expected = coverage.total_rows if sizes is None else sizes.total
    if accounted != expected or accounted != coverage.total_rows:  # pragma: no cover - a bug guard
        raise SurgeError(
            f"the committed SuperBatches hold {accounted:,} rows (written + skipped nulls) but the input "
            f"has {expected:,}; the run is left incomplete rather than marked done. Fix: rerun the "
            f"same call; if it happens again, please report it with {output}/_surge."
        )


def _complete_result(manifest: Manifest, output: str, t0: float) -> EncodeResult:
    """The result of rerunning a complete run: nothing is computed or read."""

    done = manifest.completion() or {}
    plan = manifest.plan
    return EncodeResult(
        output=str(output), run_id=manifest.run_id, rows=int(done.get("rows", 0)),
        partitions=int(done.get("partitions", plan.partitions if plan is not None else 0)),
        superbatches=int(done.get("superbatches", 0)), skipped_superbatches=int(done.get("superbatches", 0)),
        seconds=time.perf_counter() - t0, ttfo_s=None, sizes_source="recorded", resumed=True,
        b_min=plan.b_min if plan is not None else 0, b_max=plan.b_max if plan is not None else 0,
        thresholds_reason=plan.reason if plan is not None else "", nulls_skipped=int(done.get("nulls_skipped", 0)),
        output_rows=int(done.get("output_rows", 0)), truncated=int(done.get("truncated", 0)),
        encoded=int(done.get("encoded", 0)), reused=int(done.get("reused", 0)),
        family=family_of_run(manifest.fingerprint),
    )
