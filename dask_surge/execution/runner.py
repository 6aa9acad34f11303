"""The run of a written encode: open or resume the run in its output, stream its units through the
cluster (:mod:`dask_surge.execution.unit`, :mod:`dask_surge.execution.scheduling`), finish it.

What each unit does is :class:`~dask_surge.execution.unit.UnitRunner`; the errors a stopped run
raises are :mod:`dask_surge.execution.stops`; the output (:class:`~dask_surge.io.tables.Output`) stages
each SuperBatch's rows and makes the committed ones readable (part files published, or a table's
batches committed), the same calls for every format.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .. import config
from ..errors import SurgeError, SurgeOutputError
from ..families import family_of_run
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
from ..io.reuse import embedding_identity
from ..io.store import OutputStore
from ..io.tables import Output, detect, open_output
from ..models.modelid import directory_digest
from ..models.resolve import packaged_dir
from ..planning.run import new_ramp, superbatches_for
from ..planning.sizes import PartitionSizes, known_sizes
from ..planning.thresholds import Requested, Thresholds
from ..planning.units import unit_partitions
from ..results import EncodeResult, SuperBatchReport
from .events import listen
from .inputs import InputGraph
from .progress import RunProgress, logging_through
from .reach import check_workers_see_output
from .scheduling import run_units, task_resources
from .sink import SuperBatchWriter
from .stops import interrupted, stopped_error
from .superbatch import SuperBatchTask
from .unit import UnitRunner, planned_units, streaming_units

__all__ = ["RunRequest", "ThresholdResolver", "write_run", "complete_result", "loadable_name"]

logger = logging.getLogger(__name__)


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
    store : OutputStore
        The output, resolved once (:meth:`~dask_surge.io.store.OutputStore.open`) and checked by the
        caller (:func:`~dask_surge.io.directory.check_output`) before any worker started.
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
    store: OutputStore
    fingerprint: dict
    thresholds: ThresholdResolver
    max_bytes: int | None = None
    client: Any = None
    scheduler: Any = None
    overwrite: bool = False
    progress: bool = True
    started: float | None = None
    #: a bar the caller opened already (from the first second: while it started a cluster); None: a new one
    bar: RunProgress | None = None
    #: the output's format (:func:`dask_surge.io.tables.output_class`): part files, or a table its claim
    #: holder commits batches to (:mod:`dask_surge.io.tables.commits`)
    format: str = "parquet"
    #: ``"append"``: a table output may be one this run did not create
    mode: str = "create"

    @property
    def output(self) -> str:
        """The output as the user named it (for messages)."""
        return self.store.location

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
        store, output = request.store, request.output
        out = open_output(request.format, store)
        found = find_run(store, request.fingerprint)
        _say_recorded_thresholds(found, request)
        # before any write: what the location holds (detect: the registry's rule for a table's format)
        out.check_target(store, fingerprint_digest(request.fingerprint), request.mode, detect)
        if found is not None:
            out.bind(found)
        store.prove()  # an object store honours conditional creates, before the claim relies on one
        if (
            found is not None
            and found.completion() is not None
            and not request.overwrite
            and not found.coverage().missing(request.frame.npartitions)
            and out.settled(found)
        ):  # records (and a table's history), not the marker, are the truth
            committed = found.committed()
            if not settled(found, committed):  # a process killed while it finished: finish its clean-up
                with Claim.acquire(store, found.run_id, heartbeat=False):
                    settle(found, found.committed(), retire_others=False)
            result = complete_result(found, output, t0)
            bar.finish(result.rows + result.nulls_skipped, result.superbatches)
            return result
        if request.client is not None:  # before any work: a worker that cannot see the output stops the run
            check_workers_see_output(request.client, store)
        claim = Claim.acquire(store, fingerprint_digest(request.fingerprint))
        try:
            return _claimed_run(request, t0, wall0, claim, bar, out)
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
    differ = [
        f"{k}={v!r} (recorded: {recorded[k]!r})" for k, v in asked.items() if v != "auto" and v != recorded[k]
    ]
    if plan.max_bytes != request.max_bytes:
        differ.append(f"max_bytes={request.max_bytes!r} (recorded: {plan.max_bytes!r})")
    if differ:
        logger.warning(
            "dask-surge: resuming the run in %s with the thresholds it recorded when it started; %s "
            "apply to a new run only (write to a new output, or pass overwrite=True).",
            request.output,
            ", ".join(differ),
        )


def _new_plan(
    request: RunRequest, sizes: PartitionSizes | None, max_bytes: int | None, threads: int
) -> RunPlan:
    """What a new run records: the thresholds resolved for it, and how it runs."""
    th = request.thresholds(sizes, max_bytes)
    npartitions = request.frame.npartitions
    if sizes is None:
        return RunPlan(
            th.b_min,
            th.b_max,
            "streaming",
            npartitions,
            max_bytes,
            th.reason,
            unit_partitions=unit_partitions(npartitions, threads),
        )
    first, cut = new_ramp()
    return RunPlan(
        th.b_min,
        th.b_max,
        "planned",
        npartitions,
        max_bytes,
        th.reason,
        rows=sizes.total,
        first=first,
        cut_ramp=cut,
    )


def _follow_model(bar: RunProgress, request: RunRequest) -> None:
    """The ``loading model`` phase: per worker on a cluster (its plugin loads in the
    background), else in this process (the first SuperBatch loads it)."""
    encoder, client = request.encoder.encoder, request.client
    if client is not None:
        from .plugins import models_ready  # imports distributed: only with a Client

        bar.follow_model(lambda: models_ready(client, encoder), workers=True)
    else:
        bar.follow_model(lambda: (int(encoder.is_loaded), 1), workers=False)


def _follows_run(request: RunRequest) -> bool:
    """Whether :func:`open_run` may replace the manifest of another run: ``mode="append"`` follows
    another dask-surge run that completed (its rows stay in the table: they are committed there)."""
    if request.mode != "append":
        return False  # open_run refuses, naming what differs
    other = current_run(request.store)
    if other is None or other.run_id == fingerprint_digest(request.fingerprint):
        return False
    if other.completion() is None:
        raise SurgeOutputError(
            f"output={request.output!r} holds run {other.run_id} of dask-surge, not finished: appending another "
            "run now would leave its SuperBatches out of the table. Nothing was written. Fix: rerun that run "
            "to finish it, then append; or write to a new path."
        )
    return True


def _claimed_run(
    request: RunRequest, t0: float, wall0: float, claim: Claim, bar: RunProgress, out: Output
) -> EncodeResult:
    """:func:`write_run` once the output directory is claimed."""

    frame, sbe, output, client = request.frame, request.encoder, request.output, request.client
    npartitions, threads = frame.npartitions, request.threads
    found = find_run(request.store, request.fingerprint)
    recorded = found.plan if found is not None else None
    max_bytes = (
        recorded.max_bytes if recorded is not None else request.max_bytes
    )  # a resumed run keeps its own
    sizes = (
        None
        if recorded is not None and recorded.mode == "streaming"
        else known_sizes(frame, sbe.column, max_bytes)
    )
    manifest, resumed = open_run(
        request.store,
        request.fingerprint,
        overwrite=request.overwrite or _follows_run(request),
        plan=_new_plan(request, sizes, max_bytes, threads) if found is None else None,
        table=out.appends,  # the fix a different run there is told: mode="append", or overwrite=True
    )
    out.bind(manifest)
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
            raise SurgeError(
                f"the run in {output!r} was planned from known partition sizes, which the "
                "input no longer gives. Fix: rerun on the same input, or overwrite=True."
            )
        superbatches = superbatches_for(
            sizes, b_min, b_max, max_bytes, ramp=(plan.first, plan.cut_ramp)
        )  # the ramp this run recorded
        planned_sbs = len(superbatches)
        units = planned_units(superbatches, sizes.sizes, set(committed), coverage)
        bar.planned(
            rows=sizes.total, superbatches=planned_sbs, done_rows=done_rows, done_superbatches=len(committed)
        )
    else:
        units = streaming_units(npartitions, int(plan.unit_partitions or 1), coverage)
        bar.planned(rows=None, superbatches=None, done_rows=done_rows, done_superbatches=len(committed))
    # the codec as the caller configured it (dask.config.set on the client), not as each worker's config says
    runner = UnitRunner(
        SuperBatchWriter(sbe, manifest, config.get("compression"), out), b_min, b_max, max_bytes
    )
    reports: list[SuperBatchReport] = []
    # makes commits readable as they arrive (publishes part files, or commits to a table in batches)
    committer = out.committer(manifest, mode=request.mode, claim=claim)

    def heard(sb: str, rows: int, file: str) -> None:
        bar.commit(sb, rows)
        if file:
            committer.submit(sb, file)

    if units:
        window = config.get("in-flight") or 2 * max(1, threads)
        try:
            graph = InputGraph(frame)  # may already convert in-memory data (bad UTF-8 raises here)
            _follow_model(bar, request)
            with listen(manifest.run_id, heard, client):  # each commit as it happens (events.py)
                for report in run_units(
                    iter(units),
                    lambda key, unit: graph.task(key, runner, unit),
                    client,
                    request.scheduler,
                    window,
                    task_resources(client),
                ):
                    if report.committed:  # one whose commit was not announced
                        committer.submit(report.sb, report.file, report.committed_at)
                    reports.append(report)
                    bar.commit(report.sb, report.rows + report.skipped)  # one that was not announced
                    if claim.lost:
                        raise SurgeOutputError(
                            f"output={output!r} was claimed by another run while this one was writing (its "
                            "heartbeat could not be refreshed in time: a hung process or a full disk?). This "
                            "run stopped; what it committed is kept. Fix: let the other run finish, or rerun."
                        )
        except BaseException as err:
            committer.abandon()  # what committed is readable (a rerun commits the rest)
            # a run that stops before its first commit may then be replaced (see open_run)
            manifest.mark_stopped(f"{type(err).__name__}: {err}")
            if isinstance(err, KeyboardInterrupt):
                interrupted(manifest, output, planned_sbs)
            better = stopped_error(err, manifest, sbe.column)
            if better is not None:
                raise better from err
            raise
    committer.close()  # every committed SuperBatch readable before the run counts as complete
    ttfo = committer.first - wall0 if committer.first is not None else None
    committed = manifest.committed()
    coverage = manifest.coverage(committed)
    _check_complete(coverage, committed, npartitions, sizes, output)
    identity = embedding_identity(manifest.fingerprint)  # where the format records how vectors were made
    out.record_embedding(identity, sbe.column, loadable_name(identity.get("model")), run=manifest.run_id)
    summary = {
        "rows": coverage.total_rows,
        "superbatches": len(committed),
        "partitions": npartitions,
        "nulls_skipped": sum(r.skipped for r in committed.values()),
        **text_counts(committed.values()),
    }
    finish_run(manifest, committed, summary)
    bar.finish(coverage.total_rows, len(committed))
    return EncodeResult(
        output=str(output),
        run_id=manifest.run_id,
        rows=coverage.total_rows,
        partitions=npartitions,
        superbatches=len(committed),
        skipped_superbatches=len(committed) - sum(r.committed for r in reports),
        seconds=time.perf_counter() - t0,
        ttfo_s=ttfo,
        sizes_source=sizes.source if sizes is not None else "streamed",
        resumed=resumed,
        b_min=b_min,
        b_max=b_max,
        thresholds_reason=plan.reason,
        records=tuple(reports),
        nulls_skipped=summary["nulls_skipped"],
        engine=", ".join(sorted({r.engine for r in reports})),
        output_rows=summary["output_rows"],
        truncated=summary["truncated"],
        encoded=summary["encoded"],
        reused=summary["reused"],
        family=family_of_run(manifest.fingerprint),
    )


def loadable_name(model: Any) -> str | None:
    """The name sentence-transformers loads the model a run's identity records (``model``) by: a Hub
    model's repo id, ``"all-MiniLM-L6-v2"`` for the packaged copy; None for any other (a local
    directory, an in-memory model).

    Examples
    --------
    >>> loadable_name({"kind": "path", "repo_id": "BAAI/bge-small-en-v1.5", "commit": "c0"})
    'BAAI/bge-small-en-v1.5'
    >>> loadable_name({"kind": "object", "digest": "ab"}) is None
    True
    """
    if not isinstance(model, dict) or model.get("kind") != "path":
        return None
    if model.get("repo_id"):
        return str(model["repo_id"])
    try:
        packaged = directory_digest(packaged_dir("default"))
    except (SurgeError, OSError):
        return None
    return "all-MiniLM-L6-v2" if model.get("digest") == packaged else None


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


def complete_result(manifest: Manifest, output: str, t0: float) -> EncodeResult:
    """The result of rerunning a complete run (``output`` as the user named it): nothing is computed
    or read."""

    done = manifest.completion() or {}
    plan = manifest.plan
    return EncodeResult(
        output=str(output),
        run_id=manifest.run_id,
        rows=int(done.get("rows", 0)),
        partitions=int(done.get("partitions", plan.partitions if plan is not None else 0)),
        superbatches=int(done.get("superbatches", 0)),
        skipped_superbatches=int(done.get("superbatches", 0)),
        seconds=time.perf_counter() - t0,
        ttfo_s=None,
        sizes_source="recorded",
        resumed=True,
        b_min=plan.b_min if plan is not None else 0,
        b_max=plan.b_max if plan is not None else 0,
        thresholds_reason=plan.reason if plan is not None else "",
        nulls_skipped=int(done.get("nulls_skipped", 0)),
        output_rows=int(done.get("output_rows", 0)),
        truncated=int(done.get("truncated", 0)),
        encoded=int(done.get("encoded", 0)),
        reused=int(done.get("reused", 0)),
        family=family_of_run(manifest.fingerprint),
    )
