"""Committing a run's SuperBatches to a table output (``format="lance"``, ``"delta"``, ``"iceberg"``), exactly once.

The SuperBatch tasks write their rows as the table's uncommitted data files and create
their commit records in the manifest (``<output>/_surge/``) as for Parquet; the record
carries what the table commit needs (:class:`~dask_surge.io.manifest.CommitRecord.table`).
This process, which holds the run's claim, then commits them to the table in batches
(:class:`TableCommitter`): a table version holds several SuperBatches, and its commit
metadata names the run and every SuperBatch in it.

**Exactly once.** The table's history is the truth of what it holds. Before its first
commit, and before each later one, the committer reads the versions it has not seen: a
SuperBatch a version of this run already holds is never committed again, also when the
process that committed it died before anything else recorded it; a resume (a rerun of the
same call) commits the SuperBatches whose records exist but which no version holds.

**Fenced.** Of two processes of one run only the claim holder's commits land, also when the other
was paused (SIGSTOP, a suspended job, a VM pause) between reading the history and committing, and
wakes after its claim was taken over. A check of the claim cannot do this (the process can stop
right after it), so the table itself refuses: every commit is conditional on the version its
history was read at (each format's conditional commit, see :mod:`dask_surge.io.tables`), and a
claim holder's first version is a *fence* naming its claim token, which makes every commit
prepared before it fail in the store (:class:`~dask_surge.io.tables.CommitConflict`). A committer
whose commit is refused reads the history again: a version another claim holder made after its
own start means its claim is gone, and it stops; otherwise (another writer's append won the race)
it commits again on the new version.

**Batching.** A batch is committed once it holds ``surge.table-commit-every``
SuperBatches, or ``surge.table-commit-seconds`` after its first one arrived, whichever
comes first; the run's first SuperBatch is committed on its own at once (its rows are
readable within seconds); the end of the run commits the rest.

**Other writers.** A table that this run did not create is written only with
``mode="append"`` (same columns). Versions other writers make while the run goes on are
merged when they keep every row (appends, compaction, index builds); any other change
(delete, update, overwrite, restore, schema change) stops the run, naming the version,
and a rerun refuses the table.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import SurgeOutputError
from ..directory import META_DIR
from ..manifest import CommitRecord, Manifest
from ..store import OutputStore

logger = logging.getLogger("dask_surge")

__all__ = ["CommitConflict", "TableCommitter", "check_table_output", "table_settled"]

#: commits refused in a row by the store (other writers winning each race) before the run stops
_ATTEMPTS = 12


class CommitConflict(SurgeOutputError):
    """The store refused a table commit: the table moved on since the version the commit was based on.

    Nothing of the commit landed. Raised by a format's ``fence`` and ``commit`` when the store's own
    conditional commit fails (Lance: a conflicting transaction; Delta: an application transaction of
    the run committed since; Iceberg: the branch's snapshot changed; a table created meanwhile). The
    committer reads the table's history again and decides: retry, or stop when another process's
    fence came after its own (:class:`~.commits.TableCommitter`).
    """


def _foreign_table(table: Any, h: Any) -> SurgeOutputError:
    """The refusal of a table (history ``h``) that this run did not create, without ``mode="append"``."""
    version, op, run = h.foreign[0]
    return SurgeOutputError(
        f"output={table.location.url!r} is a {table.name} table that this run did not create (version "
        f"{version}: {op}{' by dask-surge run ' + run if run else ''}). Nothing was written. Fix: write to a "
        "new path, or pass mode='append' to add this run's rows to it (same columns)."
    )


def check_table_output(
    store: OutputStore, table: Any, run_id: str, mode: str, detect: Callable[[Any], str | None]
) -> bool:
    """Refuse, before anything is written, an output a ``table.name`` run of ``run_id`` cannot write:
    a table of another format (``detect``: the registry's rule naming it, :func:`~dask_surge.io.tables.detect`);
    a directory holding anything but the format's own entries and ``_surge/``; a table this run did
    not create, unless ``mode="append"``. Returns whether the table exists (then its history decides
    what the run commits)."""
    root = store.root
    names = set(store.listdir(root)) if store.isdir(root) else set()
    other = detect(names)
    if other is not None and other != table.name:
        raise SurgeOutputError(
            f"output={root!r} holds a {other} table; this run writes format={table.name!r}, which cannot go "
            f"into it. Nothing was written. Fix: pass format={other!r} (with mode='append' to add rows to "
            "that table, same columns), or write to a new path."
        )
    exists = bool(table.exists())
    if not exists:
        foreign = sorted(
            n for n in names if n not in table.ENTRIES and n != META_DIR and not n.startswith(".")
        )
        if foreign:
            raise SurgeOutputError(
                f"output={root!r} holds {foreign[:5]}, which is neither a {table.name} table nor dask-surge's "
                "own; a table output is written only into a new directory, an empty one, or a table. Nothing "
                "was written. Fix: choose a new path for the table."
            )
        return False
    h = table.history(run_id)
    if h.first_ours is False and mode != "append":
        raise _foreign_table(table, h)
    return True


def table_settled(table: Any, manifest: Manifest) -> bool:
    """True when the table's history holds every SuperBatch ``manifest`` records as committed, each in
    one version: a complete run needs no work. False sends a rerun into the run, whose committer
    commits what is missing and repairs what an earlier build left twice."""
    h = table.history(manifest.run_id)
    return not h.duplicates and all(sb in h.ours for sb in manifest.committed())


class TableCommitter:
    """Commits the SuperBatches of one run to its table, in batches, on one thread.

    Parameters
    ----------
    table : LanceTable
        The table (see :mod:`dask_surge.io.tables`).
    manifest : Manifest
        The run's manifest: commit records carry the table payloads.
    mode : {"create", "append"}
        ``"append"`` lets the run add its rows to a table it did not create.
    every : int
        SuperBatches per table commit at most.
    seconds : float
        Seconds a SuperBatch waits for others before its batch is committed.
    claim : Claim, optional
        The run's claim: once it is lost, nothing more is committed; its token names this process's
        versions (a random token without one).
    """

    def __init__(
        self,
        table: Any,
        manifest: Manifest,
        *,
        mode: str = "create",
        every: int = 16,
        seconds: float = 5.0,
        claim: Any = None,
    ) -> None:
        self.table, self.manifest, self.mode = table, manifest, mode
        self.every, self.seconds, self.claim = max(1, int(every)), float(seconds), claim
        self.run_id = manifest.run_id
        self.token: str = claim.token if claim is not None else uuid.uuid4().hex
        self._floor: int | None = (
            None  # the version read at start: another token's version after it fences us
        )
        self._fenced = False  # this process's fence version is in the table
        self.done: set[str] = set()
        self.duplicates: list[str] = []
        self._read_held: set[str] = set()  # SuperBatches the history reads found held
        self.seen = 0  # the table version whose history this process has read up to
        self.exists = False
        self.first: float | None = None  # wall clock of the first commit of this process
        self.versions = 0  # table versions this process made
        self._ours_first: int | None = None
        self._schema_checked = False
        self._pending: list[str] = []
        self._since: float | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- the table's history -------------------------------------------------------------------

    def _read(self) -> None:
        """Read the versions after :attr:`seen`: ours into :attr:`done`; refuse what others did."""
        h = self.table.history(self.run_id, since=self.seen)
        if not h.exists:
            if self.exists:
                raise SurgeOutputError(
                    f"the table {self.table.location.url!r} is gone (deleted while the run wrote it). What the "
                    "run committed to its manifest is kept. Fix: write to a new path."
                )
            return
        if self.seen == 0 and h.first_ours is False and self.mode != "append":
            raise _foreign_table(self.table, h)
        taken = [
            v for v, tok in h.fences if tok != self.token and self._floor is not None and v > self._floor
        ]
        if taken:
            raise self._lost(
                f"version {taken[0]} of the table was made by the process that took the claim over"
            )
        if h.ops and self._ours_first is None:
            self._ours_first = min(h.ops)
        for version, op, run in h.foreign:
            if self._ours_first is not None and version > self._ours_first and not self.table.keeps_rows(op):
                who = f"dask-surge run {run}" if run else "another writer"
                raise SurgeOutputError(
                    f"the table {self.table.location.url!r} was changed by {who} while this run wrote it "
                    f"(version {version}: {op}), which may have removed or changed rows this run committed. "
                    "The run stops rather than guess which rows are still there; what it committed to its "
                    "manifest is kept. Fix: write to a new path (appends, compaction and index builds by "
                    "others are merged; other changes are not)."
                )
        if h.replaced:  # an earlier build's stale Overwrite: what versions before it held is gone
            self.done.clear()
            self._read_held.clear()
        # two versions of the run hold them (also across reads): repaired at start
        twice = set(self.duplicates) | set(h.duplicates) | {sb for sb in h.held if sb in self._read_held}
        self.duplicates = sorted(twice - set(h.repaired))
        self._read_held.update(h.ours)
        self.done.update(h.ours)
        self.exists, self.seen = True, max(self.seen, h.version)

    def _lost(self, why: str) -> SurgeOutputError:
        return SurgeOutputError(
            f"the claim on {self.manifest.root!r} was taken over by another process ({why}); this process "
            "commits nothing more to the table, and the table refuses what it had prepared. What it committed "
            "before is kept. Fix: let the other run finish, or rerun the same call."
        )

    def start(self) -> None:
        """Read the table's history, fence it, commit what a killed process left (records no version
        holds), then commit in the background as :meth:`submit` hands SuperBatches over."""
        self._read()
        self._floor = self.seen
        if self.exists:  # else the first commit creates the table, which fences it
            self._attempt(None)
        while self.duplicates:  # an earlier build's stale commit: the second copy goes
            self._repair()
        left = [sb for sb in self.manifest.committed() if sb not in self.done]
        for i in range(0, len(left), self.every):
            self._commit(left[i : i + self.every])
        self._thread = threading.Thread(target=self._loop, name="dask-surge-table-commit", daemon=True)
        self._thread.start()

    # -- committing ------------------------------------------------------------------------------

    def _payloads(self, sbs: Iterable[str]) -> list[tuple[str, str]]:
        out = []
        for sb in sbs:
            record = CommitRecord.from_json(self.manifest.store.read(self.manifest.record_path(sb)))
            if not record.table:
                raise SurgeOutputError(
                    f"SuperBatch {sb} of {self.manifest.root!r} was committed without table data files (a "
                    "Parquet run's record?). Fix: write the table to a new path."
                )
            out.append((sb, record.table))
        return out

    def _repair(self) -> None:
        """Remove the second copy of the SuperBatches two versions of the run hold (an earlier build's
        commit by a process whose claim was taken over), in one version of this (fenced) process."""
        for tries in range(_ATTEMPTS):
            sbs = list(self.duplicates)
            try:
                version = self.table.repair(self.run_id, self.token, sbs, self.seen)
            except CommitConflict:
                time.sleep(min(0.05 * 2**tries, 2.0))
                self._read()
                continue
            logger.warning(
                "dask-surge: the table %s held SuperBatch(es) %s of run %s twice (committed by an earlier "
                "version of dask-surge after its claim was taken over); version %s removed the second copy.",
                self.table.location.url,
                ", ".join(sbs[:5]),
                self.run_id,
                version,
            )
            self._read()
            return
        raise SurgeOutputError(
            f"the table {self.table.location.url!r} refused {_ATTEMPTS} repairs in a row. Fix: rerun the same call."
        )

    def _commit(self, sbs: list[str]) -> None:
        """Commit the SuperBatches ``sbs`` that no version holds yet (after this process's fence)."""
        while not self._attempt(sbs):
            pass

    def _attempt(self, sbs: list[str] | None) -> bool:
        """One try: read the versions made since, then make this process's fence when it has none yet,
        else commit what of ``sbs`` (None: nothing) no version holds. False: the fence was made now,
        or the store refused the commit (read again and retry)."""
        for tries in range(_ATTEMPTS):
            if self.claim is not None and self.claim.lost:
                raise self._lost("its heartbeat found the claim file replaced")
            self._read()  # versions made since: ours, another process's of this run, others'
            if self.duplicates and sbs is not None:  # pragma: no cover - a fenced table cannot get one
                raise SurgeOutputError(
                    f"the table {self.table.location.url!r} holds SuperBatch(es) {self.duplicates[:5]} of run "
                    f"{self.run_id} in two versions, committed while this run wrote it. What the run committed "
                    "is kept. Fix: rerun the same call (its start repairs the table: the second copy is removed)."
                )
            batch = [sb for sb in dict.fromkeys(sbs or ()) if sb not in self.done]
            if self._fenced and not batch:
                return True
            payloads = self._payloads(batch) if batch else []
            if self.mode == "append" and self.exists and payloads and not self._schema_checked:
                self.table.check_schema(payloads[0][1])
                self._schema_checked = True
            read = self.seen if self.exists else 0
            try:
                if not self._fenced:
                    if not payloads and not self.exists:
                        return True  # nothing to create the table with yet: the first commit fences it
                    if self.claim is not None and not self.claim.held():
                        raise self._lost("the claim file names another process")
                    version = self.table.fence(
                        self.run_id, self.token, read, payloads[0][1] if payloads else ""
                    )
                    self._fenced = True
                    done = not batch  # the batch goes in with the next try, read after the fence
                else:
                    version = self.table.commit(self.run_id, self.token, payloads, read)
                    self.done.update(batch)
                    self.versions += 1
                    if self.first is None:
                        self.first = time.time()
                    done = True
            except CommitConflict as err:
                logger.debug("dask-surge: table commit refused (%s); reading its history again", err)
                time.sleep(min(0.05 * 2**tries, 2.0))
                continue
            self.exists = True
            if self._ours_first is None:
                self._ours_first = version
            return done
        raise SurgeOutputError(
            f"the table {self.table.location.url!r} refused {_ATTEMPTS} commits in a row: other writers commit "
            "to it faster than this run can. What the run committed is kept. Fix: rerun the same call."
        )

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while True:
                        due = self._since is not None and time.monotonic() - self._since >= self.seconds
                        if (
                            self._closing
                            or len(self._pending) >= self.every
                            or due
                            or (self._pending and self.first is None)
                        ):
                            break
                        self._cond.wait(
                            None
                            if self._since is None
                            else max(0.0, self.seconds - (time.monotonic() - self._since))
                        )
                    batch, self._pending = self._pending[: self.every], self._pending[self.every :]
                    self._since = time.monotonic() if self._pending else None
                    closing = self._closing and not self._pending
                if batch:
                    self._commit(batch)
                if closing:
                    return
        except BaseException as err:  # noqa: BLE001 - handed to the run's thread (submit, close)
            with self._cond:
                self._error = err

    def submit(self, sb: str, file: str = "", at: float | None = None) -> None:
        """Commit SuperBatch ``sb`` (its commit record exists) with the next batch (``file``, ``at``: as
        :meth:`~dask_surge.io.tables.Output.committer` hands them over; the table needs neither)."""
        self._raise()
        with self._cond:
            if sb in self.done or sb in self._pending:
                return
            self._pending.append(sb)
            if self._since is None:
                self._since = time.monotonic()
            self._cond.notify()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self, *, final: bool = True) -> None:
        """Commit what was handed over, then (``final``) every committed record no version holds
        (SuperBatches whose commit never reached this process: a task of a killed process)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self._raise()
        if final:
            left = [sb for sb in self.manifest.committed() if sb not in self.done]
            for i in range(0, len(left), self.every):
                self._commit(left[i : i + self.every])

    def abandon(self) -> None:
        """On an error: commit what can be committed, never raise (a rerun commits the rest)."""
        try:
            self.close(final=True)
        except Exception as err:  # noqa: BLE001 - the run's own error is the one to raise
            logger.warning("dask-surge: committing to the table waits for a rerun: %s", err)
