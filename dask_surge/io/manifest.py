"""The run manifest: fingerprint, commit records, resume. The only source of truth.

A run lives in ``_surge/runs/<run>/`` of its output directory (the layout:
:mod:`dask_surge.io.directory`), claimed by one live process (:class:`~dask_surge.io.lease.Claim`).

**Ownership.** A run writes only into a directory that is new, empty, or holds
nothing but dask-surge's own files (:func:`~dask_surge.io.directory.check_output`), claims it
exclusively before writing, and deletes only files it can prove are its own: data files
named by the layout, staging files and the metadata of runs it replaced.

**Commit protocol.** A SuperBatch's file is written into the run's ``staging/``
(temporary name, fsync, rename), then its commit record is created exclusively (of
two attempts of one SuperBatch only one wins), then the file is renamed to its
``part-*.parquet`` name (:meth:`Manifest.publish`). So a ``part-*.parquet`` file never
exists without its record, and a task of a replaced run, whose run directory was
moved to ``retired/`` first, can neither commit nor publish. A run id is a digest of
the fingerprint, so rerunning the same call finds its own run and resumes it.
Parquet readers pointed at ``out/`` skip ``_surge`` (``_`` prefix).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from ..errors import SurgeInputError, SurgeOutputError
from .directory import (
    DATA_FILE,
    META_DIR,
    RUN_ID,
    SB_PATTERN,
    SIDE_FILE,
    attempt_of,
    corrupt,
    current_path,
    discard,
    discard_tree,
    index_dir,
    owned,
    read_json,
    refuse_links,
    relocate,
    set_aside,
)
from .store import OutputStore

__all__ = [
    "FORMAT_VERSION",
    "Manifest",
    "RunPlan",
    "CommitRecord",
    "Coverage",
    "text_counts",
    "fingerprint_digest",
    "open_run",
    "current_run",
    "existing_run",
    "find_run",
    "finish_run",
    "settle",
    "settled",
    "current_id",
    "load_run",
    "write_meta",
    "other_run_error",
]

FORMAT_VERSION = 2  # 2: SuperBatches keyed by their first row; recorded thresholds


def fingerprint_digest(fingerprint: dict) -> str:
    """Stable 16-hex-digit id of a fingerprint (keys sorted, JSON-encoded)."""
    blob = json.dumps(fingerprint, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class RunPlan:
    """What a run recorded when it was created (``run.json``'s ``plan``): the thresholds it
    resolved and keeps when resumed, whatever the cluster's shape is then.

    ``mode`` is ``"planned"`` (partition sizes known ahead: ``rows`` is their total) or
    ``"streaming"`` (SuperBatches formed unit by unit: ``unit_partitions`` is the unit size,
    so a resumed run cuts the same units). Serialized with the keys it always had
    (:meth:`as_dict`); :meth:`of` reads any ``run.json`` (missing keys take the defaults,
    unknown ones are ignored).

    Examples
    --------
    >>> plan = RunPlan.of({"b_min": 4, "b_max": 8, "mode": "planned", "partitions": 3, "rows": 12,
    ...                    "max_bytes": None, "reason": "given"})
    >>> plan.b_max, plan.as_dict() == {"b_min": 4, "b_max": 8, "mode": "planned", "partitions": 3,
    ...                                "rows": 12, "max_bytes": None, "reason": "given"}
    (8, True)
    >>> RunPlan.of({}) is None
    True
    """

    b_min: int
    b_max: int
    mode: Literal["planned", "streaming"]
    partitions: int
    max_bytes: int | None = None
    reason: str = ""
    rows: int | None = None  # planned mode: the rows the sizes promised
    unit_partitions: int | None = None  # streaming mode: partitions per unit
    first: int | None = None  # planned mode: the ramp's first threshold (None: b_min from the start)
    cut_ramp: bool = False  # the ramp cuts partitions at its thresholds (runs recorded before: whole ones)

    def as_dict(self) -> dict:
        """The ``plan`` of ``run.json``: ``rows``, ``unit_partitions`` and ``first`` only where set,
        ``cut_ramp`` only where true."""
        out = asdict(self)
        for key in ("rows", "unit_partitions", "first"):
            if out[key] is None:
                del out[key]
        if not out["cut_ramp"]:
            del out["cut_ramp"]
        return out

    @classmethod
    def of(cls, recorded: dict | None) -> RunPlan | None:
        """The plan a ``run.json`` recorded (None: it recorded none)."""
        if not isinstance(recorded, dict) or not recorded:
            return None
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in recorded.items() if k in known}
        for key in ("b_min", "b_max", "partitions"):
            values[key] = int(values.get(key, 0))
        values.setdefault("mode", "streaming" if "unit_partitions" in values else "planned")
        values["cut_ramp"] = values.get("cut_ramp") is True
        return cls(**values)


@dataclass(frozen=True)
class CommitRecord:
    """The commit of one SuperBatch: its file and the input rows it accounts for.

    ``spans`` holds ``(partition, start, stop, partition_rows)`` for each input span:
    with the partition's full row count, the records alone say which partitions are
    complete (a resumed run skips them without reading them). ``digests`` holds
    ``(partition, digest)``: a digest of each input partition's whole text column
    (:func:`dask_surge.execution.superbatch.partition_digest`), so a partition recomputed on
    resume is checked against what was committed for it.

    ``rows`` counts input rows written (texts); ``output_rows`` the rows of ``file`` when
    they differ (``long_texts="chunk"``: one per window; 0 means the same as ``rows``).
    ``truncated`` counts texts cut at the model's window (-1: the model cannot tell),
    ``encoded`` the distinct texts that went through the model (-1: not recorded, an
    older record) and ``reused`` the texts whose embeddings were copied from a ``reuse``
    output. ``table`` is what a table output's commit needs (a JSON string: the data files the
    task wrote into the table, uncommitted; :mod:`dask_surge.io.tables`), empty for Parquet;
    with it, ``file`` names no file (nothing is published: the table commit is the publish).
    """

    sb: str
    run: str
    file: str
    rows: int
    bytes: int
    sha256: str
    spans: tuple[tuple[int, int, int, int], ...]
    skipped: int = 0
    skipped_file: str = ""
    skipped_sha256: str = ""
    attempt: str = ""
    pid: int = 0
    committed_at: float = 0.0
    digests: tuple[tuple[int, str], ...] = ()
    output_rows: int = 0
    truncated: int = 0
    encoded: int = -1
    reused: int = 0
    table: str = ""

    @property
    def accounted(self) -> int:
        """Input rows this commit accounts for: written rows plus skipped nulls."""
        return self.rows + self.skipped

    def to_json(self) -> builtins.bytes:
        # the fields as they are: json writes tuples as lists, as asdict's deep copy (which walks
        # every span of the record, ~0.3 us of GIL per text on small files) would hand them over
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: builtins.bytes) -> CommitRecord:
        """Parse a record; raises ValueError on anything but a well-formed one (names included).

        Examples
        --------
        >>> rec = CommitRecord("000000000-000000000000", "0" * 16, "part-00000000-000000000-000000000000-"
        ...                    "0123abcd.parquet", 2, 10, "ab", ((0, 0, 2, 2),))
        >>> CommitRecord.from_json(rec.to_json()) == rec
        True
        >>> CommitRecord.from_json(rec.to_json().replace(b"part-", b"../x-"))
        Traceback (most recent call last):
        ...
        ValueError: commit record names file '../x-00000000-000000000-000000000000-0123abcd.parquet', not a data file of this layout
        """
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("a commit record is a JSON object")
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}
        raw["spans"] = tuple(tuple(int(x) for x in s) for s in raw["spans"])
        raw["digests"] = tuple((int(p), str(d)) for p, d in raw.get("digests", ()))
        if any(len(s) != 4 for s in raw["spans"]):
            raise ValueError("spans need (partition, start, stop, partition_rows)")
        rec = cls(**raw)
        # names read from disk become path parts: accept only what this layout writes
        if not DATA_FILE.match(rec.file):
            raise ValueError(f"commit record names file {rec.file!r}, not a data file of this layout")
        if rec.skipped_file and not SIDE_FILE.match(rec.skipped_file):
            raise ValueError(f"commit record names skipped file {rec.skipped_file!r}, not of this layout")
        if not re.fullmatch(SB_PATTERN, rec.sb):
            raise ValueError(f"commit record key {rec.sb!r} is not a SuperBatch key")
        return rec


def text_counts(records) -> dict[str, int]:
    """What commit records say of the texts they hold, summed: ``output_rows`` (file rows),
    ``truncated`` (-1 if any SuperBatch's model could not tell), ``encoded`` and ``reused``.

    Examples
    --------
    >>> rec = CommitRecord("000000000-000000000000", "0" * 16, "part-00000000-000000000-000000000000-"
    ...                    "0123abcd.parquet", 2, 10, "ab", ((0, 0, 2, 2),), output_rows=5, truncated=1, encoded=2)
    >>> text_counts([rec, rec])
    {'output_rows': 10, 'truncated': 2, 'encoded': 4, 'reused': 0}
    """
    records = list(records)
    truncated = [r.truncated for r in records]
    return {
        "output_rows": sum(r.output_rows or r.rows for r in records),
        "truncated": -1 if any(t < 0 for t in truncated) else sum(truncated),
        "encoded": sum(r.rows if r.encoded < 0 else r.encoded for r in records),
        "reused": sum(r.reused for r in records),
    }


@dataclass
class Coverage:
    """Which input rows the committed SuperBatches of a run account for.

    Examples
    --------
    >>> c = Coverage.of([((0, 0, 5, 5), (1, 0, 3, 8)), ((1, 3, 8, 8),), ((2, 0, 4, 9),)])
    >>> c.complete(0), c.complete(1), c.complete(2), c.complete(3)
    (True, True, False, False)
    >>> sorted(c.committed_starts(2)), sorted(c.committed_starts(3))
    ([0], [])
    """

    rows: dict[int, int] = field(default_factory=dict)  # partition -> its row count
    covered: dict[int, int] = field(default_factory=dict)  # partition -> rows covered
    starts: dict[int, set] = field(default_factory=dict)  # partition -> committed span starts
    digests: dict[int, str] = field(default_factory=dict)  # partition -> digest of its texts, where recorded

    @classmethod
    def of(cls, span_lists, digests=()) -> Coverage:
        cov = cls()
        for spans in span_lists:
            for p, start, stop, n in spans:
                cov.rows[p] = n
                cov.covered[p] = cov.covered.get(p, 0) + (stop - start)
                cov.starts.setdefault(p, set()).add(start)
        for pairs in digests:
            cov.digests.update(dict(pairs))
        return cov

    def complete(self, partition: int) -> bool:
        """Every row of ``partition`` is in a committed SuperBatch (an empty one: recorded)."""
        return partition in self.rows and self.covered.get(partition, 0) >= self.rows[partition]

    def committed_starts(self, partition: int) -> set:
        return self.starts.get(partition, set())

    def expected(self, partition: int) -> tuple[int, str | None] | None:
        """``(rows, digest)`` committed for a partially committed ``partition``, else None."""
        if partition not in self.rows or self.complete(partition):
            return None
        return self.rows[partition], self.digests.get(partition)

    def missing(self, npartitions: int) -> list[int]:
        """Partitions ``0..npartitions-1`` not complete, in order."""
        return [p for p in range(npartitions) if not self.complete(p)]

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


@dataclass
class Manifest:
    """One run inside an output directory (see module docstring)."""

    store: OutputStore
    run_id: str
    fingerprint: dict = field(default_factory=dict)
    plan: RunPlan | None = None  # what the run recorded: thresholds, partitions, mode
    format_version: int = FORMAT_VERSION
    #: True while another run is current (an overwrite): committed files stay in ``staging/``
    #: until this run completes, so a ``part-*`` reader never sees two runs' rows at once
    defer_publish: bool = False
    #: True for a table output (``format="lance"``): no file is ever published under the root; the
    #: claim holder commits to the table instead (:mod:`dask_surge.execution.tables`)
    table: bool = False
    #: when the run was created (``run.json``'s ``created``): a run that completed before it cannot have
    #: replaced it (:func:`dask_surge.execution.reach.run_gone`)
    created: float | None = None

    @property
    def fs(self) -> Any:
        """The output's fsspec filesystem (to read files: every write goes through :attr:`store`)."""
        return self.store.fs

    @property
    def root(self) -> str:
        return self.store.root

    @property
    def tasks_publish(self) -> bool:
        """True when the task that commits a SuperBatch also publishes its file (a rename on a
        local or shared filesystem). On an object store a move is a copy and a delete, which
        a retired run's late task could still make, so there only the process holding the
        claim publishes (:meth:`publish`, as each commit reaches it, and at the end)."""
        return not self.defer_publish and not self.table and self.store.renames

    @property
    def run_dir(self) -> str:
        return f"{self.root}/{META_DIR}/runs/{self.run_id}"

    @property
    def commits_dir(self) -> str:
        return f"{self.run_dir}/commits"

    @property
    def staging_dir(self) -> str:
        return f"{self.run_dir}/staging"

    def data_path(self, sb: str, attempt: str) -> str:
        """Where the committed file of an attempt of SuperBatch ``sb`` is published."""
        return f"{self.root}/part-{self.run_id[:8]}-{sb}-{attempt}.parquet"

    def staging_path(self, sb: str, attempt: str) -> str:
        """Where an attempt of SuperBatch ``sb`` writes its file before it commits."""
        return f"{self.staging_dir}/{sb}-{attempt}.parquet"

    def skipped_path(self, sb: str, attempt: str) -> str:
        """Where an attempt of SuperBatch ``sb`` lists the nulls it skipped (``on_null="skip"``)."""
        return f"{self.run_dir}/skipped/{sb}-{attempt}.parquet"

    def record_path(self, sb: str) -> str:
        return f"{self.commits_dir}/{sb}.json"

    def data_paths(self, records) -> list[str]:
        """Paths (as :attr:`store` names them) of ``records``' data files: each one's published
        name, or its ``staging/`` name while it is not published yet (a task that died, or still
        runs, between its commit and its publish; an overwrite not yet complete)."""
        records = list(records)
        published = set(self.store.listdir(self.root)) if records else set()
        return [
            f"{self.root}/{r.file}" if r.file in published else self.staging_path(r.sb, attempt_of(r.file))
            for r in records
        ]

    def skipped_files(self, records) -> list[str]:
        """Paths of the skipped-null files that ``records`` name."""
        return [f"{self.run_dir}/skipped/{r.skipped_file}" for r in records if r.skipped]

    def commit(self, record: CommitRecord) -> bool:
        """Create the commit record of ``record.sb``; False if another attempt won.

        Raises FileNotFoundError when the run's directory is gone (the run was replaced
        and retired: a late task of it must not commit).
        """
        return self.store.write(self.record_path(record.sb), record.to_json(), exclusive=True)

    def publish(self, record: CommitRecord) -> None:
        """Move a committed SuperBatch's file from ``staging/`` to its ``part-*.parquet`` name.

        Idempotent: of two publishers of one record (the task, and a later process
        finishing or repairing the run) the first moves it; the other finds it there.
        Raises FileNotFoundError when the file is in neither place (a crash destroyed it).
        """
        self.publish_file(record.sb, record.file)

    def publish_file(self, sb: str, file: str) -> None:
        """:meth:`publish` the committed file ``file`` of SuperBatch ``sb``."""
        final = f"{self.root}/{file}"
        m = DATA_FILE.match(file)
        if m is None:
            raise SurgeOutputError(
                f"{file!r} is not a data file of this layout. This is a bug: please report it."
            )
        staged = self.staging_path(sb, m.group("attempt"))
        try:
            relocate(self.store, staged, final)
        except FileNotFoundError:
            if not self.store.exists(final):
                raise

    def committed(self, *, repair: bool = False) -> dict[str, CommitRecord]:
        """Commit records by SuperBatch key, in data order. Torn or foreign records are skipped.

        With ``repair=True`` a torn record (unparseable, e.g. from a crash on a
        filesystem without atomic create) is renamed aside so its SuperBatch can
        be committed again.
        """
        out: dict[str, CommitRecord] = {}
        for name in self.store.listdir(self.commits_dir):
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = f"{self.commits_dir}/{name}"
            try:
                rec = CommitRecord.from_json(self.store.read(path))
                if name != f"{rec.sb}.json" or rec.run != self.run_id:
                    continue
            except (ValueError, KeyError, TypeError, OSError):
                # torn record: that SuperBatch is not committed
                if repair:
                    set_aside(self.store, path)
                continue
            out[rec.sb] = rec
        return out

    def coverage(self, records: dict[str, CommitRecord] | None = None) -> Coverage:
        """Which input rows the committed SuperBatches account for."""
        records = self.committed() if records is None else records
        return Coverage.of((r.spans for r in records.values()), (r.digests for r in records.values()))

    def publish_pending(self, records: dict[str, CommitRecord]) -> int:
        """Publish committed files still in ``staging/`` (their task died between commit and
        publish, or the run defers publishing, see :attr:`defer_publish`); returns how many.
        Does nothing while the run defers publishing. Raises :class:`SurgeOutputError` for a
        committed file that is nowhere (deleted by hand, or lost to a crash)."""
        if self.defer_publish or self.table:
            return 0
        present = set(self.store.listdir(self.root))
        moved = 0
        for rec in records.values():
            if rec.file in present:
                continue
            try:
                self.publish(rec)
            except FileNotFoundError as err:
                raise SurgeOutputError(
                    f"SuperBatch {rec.sb} of {self.root!r} is committed but its file {rec.file!r} is missing "
                    f"(deleted by hand?). Fix: `dask-surge status --repair {self.root}` forgets that commit, "
                    "then rerun the same call to encode those rows again."
                ) from err
            moved += 1
        return moved

    def mark_current(self) -> None:
        write_meta(self.store, current_path(self.root), self.run_id.encode())

    @property
    def _stopped_path(self) -> str:
        return f"{self.run_dir}/STOPPED"

    def mark_stopped(self, why: str) -> None:
        """Record that this run's process stopped on an error (so a run that committed
        nothing may be replaced without ``overwrite``). Best effort: never raises."""
        with contextlib.suppress(OSError):
            self.store.write(self._stopped_path, why.encode()[:2000])

    def stopped(self) -> bool:
        """True when the last process of this run stopped on an error (and none resumed it)."""
        return self.store.exists(self._stopped_path)

    def clear_stopped(self) -> None:
        discard(self.store, self._stopped_path)

    @property
    def complete_path(self) -> str:
        """Where the run's completion summary is written once it completes."""
        return f"{self.run_dir}/COMPLETE"

    def completion(self) -> dict | None:
        """The completion summary (rows, nulls skipped, SuperBatches) of a finished run, else None."""
        return read_json(self.store, self.complete_path)


def write_meta(store: OutputStore, path: str, data: bytes) -> None:
    """Write a manifest file; a failure (disk full, permissions) is a clear error that names it."""
    try:
        store.write(path, data)
    except OSError as err:
        root = path.split(f"/{META_DIR}/", 1)[0]
        raise SurgeOutputError(
            f"writing {path!r} failed ({type(err).__name__}: {err}). Committed SuperBatches are kept and "
            f"no partial file is left. Fix: free disk space or fix permissions on {root!r}, then rerun the "
            "same call to resume."
        ) from err


def current_id(store: OutputStore) -> str | None:
    """The run id in ``CURRENT``; None when there is none; a clear error when it is damaged."""
    path = current_path(store.root)
    try:
        run_id = store.read(path).decode(errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not RUN_ID.match(run_id):
        raise corrupt(path, ValueError(f"{run_id[:40]!r} is not a run id"))
    return run_id


def load_run(store: OutputStore, run_id: str) -> Manifest | None:
    """The run ``run_id`` of the output as its ``run.json`` recorded it; None when it has none."""
    root = store.root
    info = read_json(store, f"{root}/{META_DIR}/runs/{run_id}/run.json")
    if info is None:
        return None
    _check_version(info, root)
    if not isinstance(info.get("fingerprint"), dict):
        raise corrupt(f"{root}/{META_DIR}/runs/{run_id}/run.json", ValueError("no fingerprint"))
    return Manifest(
        store,
        run_id,
        info["fingerprint"],
        RunPlan.of(info.get("plan")),
        format_version=info["format_version"],
        created=_created(info),
    )


def _created(info: dict) -> float | None:
    created = info.get("created")
    return float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else None


def current_run(store: OutputStore) -> Manifest | None:
    """The run whose rows are current in the output (or None)."""
    run_id = current_id(store)
    return None if run_id is None else load_run(store, run_id)


def existing_run(store: OutputStore) -> Manifest:
    """The current run in the output for a reader, or a clear error when there is none."""
    path = store.location
    manifest = current_run(store)
    if manifest is None:
        raise SurgeInputError(
            f"{path!r} holds no dask-surge run (no {current_path(path.rstrip('/'))}). Fix: pass the output "
            "directory of ddf.surge.encode(..., output=...)."
        )
    if manifest.format_version < FORMAT_VERSION:
        raise SurgeInputError(
            f"{path!r} was written with manifest format {manifest.format_version}, older than this "
            f"library's {FORMAT_VERSION}, whose commit records it cannot trust. Fix: encode again into a "
            "new path (or the same path with overwrite=True)."
        )
    return manifest


def _check_version(info: dict, root: str) -> None:
    version = info.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise SurgeOutputError(
            f"{root!r} was written with manifest format {version!r}, newer than this library's "
            f"{FORMAT_VERSION}: reading or resuming it could mix incompatible data. "
            "Fix: upgrade dask-surge, or write to a new output path."
        )


def _differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def other_run_error(
    location: str, other: Manifest, fingerprint: dict, *, table: bool = False
) -> SurgeOutputError:
    """The refusal of a run of ``fingerprint`` in an output that holds the different run ``other``
    (``table``: the output is a table, which is never overwritten)."""
    diff = "; ".join(_differences(other.fingerprint, fingerprint)) or "(format)"
    fix = (
        "pass mode='append' to add this run's rows to the table once that run is complete (same columns)"
        if table
        else "pass overwrite=True (the old output is replaced only once the new run has completed)"
    )
    return SurgeOutputError(
        f"output={location!r} already holds a different run ({diff}). Nothing was written. "
        f"Fix: write to a new path, or {fix}."
    )


def find_run(store: OutputStore, fingerprint: dict) -> Manifest | None:
    """The run of ``fingerprint`` in the output if it was ever created there (current or
    not), with what it recorded; None otherwise. Reads only the run's ``run.json``."""
    run_id = fingerprint_digest(fingerprint)
    manifest = Manifest(store, run_id, fingerprint)
    info = read_json(store, f"{manifest.run_dir}/run.json")
    if info is None or info.get("format_version") != FORMAT_VERSION:
        return None
    manifest.plan = RunPlan.of(info.get("plan"))
    manifest.created = _created(info)
    current = current_id(store)
    if manifest.completion() is not None and current != run_id:
        return None  # a complete run that another run replaced since: not ours to trust
    return manifest


def open_run(
    store: OutputStore,
    fingerprint: dict,
    *,
    overwrite: bool = False,
    plan: RunPlan | None = None,
    table: bool = False,
) -> tuple[Manifest, bool]:
    """Open (resume) or create the run for ``fingerprint`` in the output ``store``.

    The caller holds the directory's :class:`Claim`. Returns ``(manifest, resumed)``.
    ``manifest.plan`` is what the run recorded when it was created (``plan``:
    its resolved thresholds, its partitions): a resumed run keeps them, whatever the
    cluster's shape is now. A directory holding a different current run is refused
    unless ``overwrite=True``; even then the old run's files stay until the new run
    completes (see :func:`finish_run`): until then the new run's committed files stay in its
    ``staging/`` (:attr:`Manifest.defer_publish`), so a ``part-*.parquet`` reader never sees
    two runs' rows. A different run that stopped on an error before committing anything
    (e.g. a bad input) holds no data and is replaced.

    Raises
    ------
    SurgeOutputError
        If ``path`` is not writable, holds another run (without ``overwrite``), a
        damaged manifest, or was written by a newer manifest format.
    """
    path = store.location
    run_id = fingerprint_digest(fingerprint)
    manifest = Manifest(store, run_id, fingerprint)
    current = current_run(store)
    other = current if current is not None and current.run_id != run_id else None
    empty_other = other is not None and other.stopped() and not other.committed()
    if other is not None and not overwrite and not empty_other:
        raise other_run_error(path, other, fingerprint, table=table)
    refuse_links(store)
    # while another run is current, this one's files wait in staging/ until it completes (settle)
    manifest.defer_publish = other is not None and not empty_other
    info = read_json(store, f"{manifest.run_dir}/run.json")
    try:
        if info is None:
            store.makedirs(manifest.commits_dir)
            store.makedirs(manifest.staging_dir)
            manifest.plan, manifest.created = plan, time.time()
            body = {
                "format_version": FORMAT_VERSION,
                "run": run_id,
                "fingerprint": fingerprint,
                "plan": plan.as_dict() if plan is not None else {},
                "created": manifest.created,
            }
            store.write(
                f"{manifest.run_dir}/run.json", json.dumps(body, sort_keys=True, default=str).encode()
            )
        else:
            _check_version(info, store.root)
            manifest.plan = RunPlan.of(info.get("plan"))
            manifest.created = _created(info)
            store.makedirs(manifest.staging_dir)
            manifest.clear_stopped()  # resumed
        if current is None or empty_other:
            manifest.mark_current()
    except OSError as err:
        raise SurgeOutputError(
            f"output={path!r} is not writable ({type(err).__name__}: {err}). Nothing was encoded. "
            "Fix: choose a directory you can create and write to."
        ) from err
    return manifest, info is not None


def _retire(store: OutputStore, run: str) -> None:
    """Fence off and delete another run: where renames are atomic its directory is moved to
    ``retired/`` first (a late task of it can then neither commit nor publish), then its data
    files go."""
    root = store.root
    runs = f"{root}/{META_DIR}/runs"
    retired_dir = f"{root}/{META_DIR}/retired"
    if store.renames:
        store.makedirs(retired_dir)
        with contextlib.suppress(FileNotFoundError):
            relocate(store, f"{runs}/{run}", f"{retired_dir}/{run}-{time.time_ns()}")
    prefix = run[:8]
    for name in store.listdir(root):
        m = DATA_FILE.match(name)
        if m and m.group("run") == prefix:
            discard(store, f"{root}/{name}")
    if not store.renames:  # a store has no directory to move: the run's tasks never publish there, so
        discard_tree(store, f"{runs}/{run}")  # its metadata goes now (a late record is harmless garbage)


def finish_run(manifest: Manifest, committed: dict[str, CommitRecord], summary: dict) -> None:
    """Record the run as complete and current, then :func:`settle` the directory.

    ``committed`` is ``manifest.committed()`` as just read by the caller; ``summary``
    (rows, SuperBatches, nulls skipped) is kept in the run's ``COMPLETE`` marker, so a
    rerun of a complete run does nothing and :func:`dask_surge.status` reads it.
    """
    refuse_links(manifest.store)
    if not manifest.defer_publish:
        manifest.publish_pending(committed)  # a run that publishes as it commits: readers see it whole first
    write_meta(manifest.store, manifest.complete_path, json.dumps(summary, sort_keys=True).encode())
    manifest.mark_current()
    settle(manifest, committed)


def settled(manifest: Manifest, committed: dict[str, CommitRecord]) -> bool:
    """True when the data files of the directory are exactly the committed ones of this
    complete, current run (none unpublished, none another run's or an uncommitted attempt's)."""
    data = {n for n in manifest.store.listdir(manifest.root) if DATA_FILE.match(n)}
    if manifest.table:  # no part file is ever published under the root: the table holds the rows
        return not data
    return data == {rec.file for rec in committed.values()}


def settle(manifest: Manifest, committed: dict[str, CommitRecord], *, retire_others: bool = True) -> None:
    """What follows a run's completion; idempotent, so a rerun or a repair finishes what a
    killed process left.

    Other runs in the directory are retired (fenced off, then their data files deleted);
    only then are this run's committed files still in ``staging/`` published (an overwrite
    defers them until now), so a ``part-*.parquet`` reader never sees two runs' rows at
    once. Then this run's uncommitted attempts (data files of this layout no record names,
    staging leftovers, skipped-null files of losing attempts), the reuse indexes of other
    runs and the retired runs are deleted. Everything goes through :func:`discard`: nothing
    that does not match this layout is touched, and no link is followed. Afterwards the
    ``part-*.parquet`` files are exactly the committed ones.

    With ``retire_others=False`` (a rerun or a repair of a complete run) only the runs whose
    data files are published are retired: an overwrite in progress (its files in staging) stays.
    """
    store, root = manifest.store, manifest.root
    published = {m.group("run") for m in map(DATA_FILE.match, store.listdir(root)) if m}
    for run in store.listdir(f"{root}/{META_DIR}/runs"):
        if run != manifest.run_id and RUN_ID.match(run) and (retire_others or run[:8] in published):
            _retire(store, run)
    manifest.defer_publish = False  # complete and current: its files are the output now
    manifest.publish_pending(committed)
    keep = {rec.file for rec in committed.values()}
    for name in store.listdir(root):
        if DATA_FILE.match(name) and name not in keep:  # a data file of this layout: ours, not committed
            discard(store, f"{root}/{name}")
    keep_skipped = {rec.skipped_file for rec in committed.values()}
    for side in ("staging", "skipped"):
        for name in store.listdir(f"{manifest.run_dir}/{side}"):
            path = f"{manifest.run_dir}/{side}/{name}"
            if (side == "staging" or name not in keep_skipped) and owned(path[len(root) + 1 :]):
                discard(store, path)  # staging leftovers; skipped files of attempts that lost the commit
    for run in store.listdir(index_dir(root, "").rstrip("/")):  # reuse indexes of runs now gone
        if run != manifest.run_id and RUN_ID.match(run):
            discard_tree(store, index_dir(root, run))
    discard_tree(store, f"{root}/{META_DIR}/retired")
