"""The run manifest: fingerprint, claim, commit records, resume. The only source of truth.

Layout of an output directory ``out/``::

    out/part-<run>-<sb>-<attempt>.parquet        one file per committed SuperBatch
    out/_surge/CURRENT                           id of the run whose rows are current
    out/_surge/CLAIM                             the live run's claim: host, pid, heartbeat
    out/_surge/runs/<run>/run.json               fingerprint, resolved thresholds, partitions
    out/_surge/runs/<run>/staging/<sb>-<a>.parquet  a SuperBatch's data before its commit
    out/_surge/runs/<run>/commits/<sb>.json      one commit record per SuperBatch
    out/_surge/runs/<run>/skipped/<sb>-<a>.parquet  (partition, row) of nulls it skipped
    out/_surge/runs/<run>/COMPLETE               written once every partition is accounted for
    out/_surge/runs/<run>/STOPPED                the last process stopped on an error
    out/_surge/retired/<run>-<ns>/               a replaced run, fenced off, then deleted

``<sb>`` is :func:`sb_key` of the SuperBatch's first row. This module alone spells
these paths.

**Ownership.** A run writes only into a directory that is new, empty, or holds
nothing but dask-surge's own files (:func:`check_output`), claims it exclusively
before writing (:class:`Claim`), and deletes only files it can prove are its own:
data files named by this layout, staging files and the metadata of runs it replaced.

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
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from fsspec.core import url_to_fs

from ..errors import SurgeInputError, SurgeOutputError
from .atomic import (
    LinkRefused,
    is_local,
    links_below,
    listdir,
    protocols,
    remove_tree,
    rename,
    unlink,
    write_atomic,
)

__all__ = ["FORMAT_VERSION", "Manifest", "RunPlan", "CommitRecord", "Coverage", "Claim", "sb_key", "text_counts", "index_dir", "fingerprint_digest",
           "open_run", "current_run", "existing_run", "find_run", "finish_run", "check_output", "check_writable_store", "repair",
           "verify", "LOCAL_PROTOCOLS", "owned", "discard", "relocate", "LinkRefused", "write_bytes_atomic",
           "create_exclusive", "check_store", "output_fs", "STORE_PROTOCOLS", "settle", "settled",
           "refuse_links"]

FORMAT_VERSION = 2  # 2: SuperBatches keyed by their first row; recorded thresholds
META_DIR = "_surge"
#: filesystems whose rename and exclusive create the commit protocol relies on (tested)
LOCAL_PROTOCOLS = ("file", "local", "memory")
#: object stores written with one PUT per file and conditional PUTs for exclusive creates,
#: where the installed fsspec filesystem offers them (proven on the store by :func:`check_store`)
STORE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "abfs", "az")
#: a claim whose heartbeat is older than this is stale (its process is gone or hung)
CLAIM_TTL_S = 60.0
#: how often a live run refreshes its claim
HEARTBEAT_S = 10.0
_RUN_ID = re.compile(r"^[0-9a-f]{16}$")
_SB = r"\d{9}-\d{12}"
_DATA_FILE = re.compile(rf"^part-(?P<run>[0-9a-f]{{8}})-(?P<sb>{_SB})-(?P<attempt>[0-9a-f]{{8}})\.parquet$")
_SIDE_FILE = re.compile(rf"^(?P<sb>{_SB})-(?P<attempt>[0-9a-f]{{8}})\.parquet$")


def fingerprint_digest(fingerprint: dict) -> str:
    """Stable 16-hex-digit id of a fingerprint (keys sorted, JSON-encoded)."""
    blob = json.dumps(fingerprint, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


_RUN = r"[0-9a-f]{16}"
#: what this layout writes, relative to the output root: the only names a run deletes or moves
_OWNED = re.compile(
    rf"^(?:part-[0-9a-f]{{8}}-{_SB}-[0-9a-f]{{8}}\.parquet"
    rf"|{META_DIR}/(?:CURRENT|CLAIM|\.heartbeat-[0-9a-f]{{32}}|\.stale-claim-\d+|\.takeover-[0-9a-f]{{32}}-\d+"
    rf"|\.probe-[0-9a-f]{{32}}|\.reach-[0-9a-f]{{32}}(?:-\d+)?)"
    rf"|{META_DIR}/(?:retired|index/{_RUN})"
    rf"|{META_DIR}/(?:runs/{_RUN}|retired/{_RUN}-\d+)"
    rf"(?:/(?:run\.json|COMPLETE|STOPPED|commits/{_SB}\.json|(?:staging|skipped)/{_SB}-[0-9a-f]{{8}}\.parquet))?"
    rf"|{META_DIR}/index/{_RUN}/(?:meta\.json|BUILDING|bucket-\d{{6}}\.npy))$"
)
_WRAPPED = re.compile(r"^(?P<dir>(?:.*/)?)\.(?:(?P<tmp>.+)\.tmp-\d+-\d+|torn-(?P<torn>.+)-\d+)$")


def owned(rel: str) -> bool:
    """True when ``rel`` (a path relative to an output root) is a name this layout writes: a
    data file, a manifest file, a run's directory, or the temporary or set-aside (``.torn-``)
    form of one. :func:`discard` and :func:`relocate` act on nothing else.

    Examples
    --------
    >>> owned("part-0123abcd-000000000-000000000000-89abcdef.parquet"), owned("notes.txt")
    (True, False)
    >>> owned("_surge/runs/0123456789abcdef/staging/000000000-000000000000-89abcdef.parquet")
    True
    >>> owned("_surge/runs/0123456789abcdef/commits/.torn-000000000-000000000000.json-17")
    True
    >>> owned("_surge/runs/0123456789abcdef/staging/../../../../etc/passwd")
    False
    """
    if _OWNED.match(rel):
        return True
    m = _WRAPPED.match(rel)
    return m is not None and _OWNED.match(m.group("dir") + (m.group("tmp") or m.group("torn"))) is not None


def _check_owned(root: str, path: str) -> None:
    base = root.rstrip("/") + "/"
    if not path.startswith(base) or not owned(path[len(base):]):
        raise SurgeOutputError(
            f"refusing to delete or move {path!r}: it is not a file dask-surge writes in the output {root!r} "
            "(a run deletes and moves only its own files). Nothing was changed. This is a bug: please report it."
        )


def discard(fs, root: str, path: str) -> bool:
    """Delete ``path``, a file of this layout below the output ``root``; False if it was not there.

    Every delete of the package goes through here: a name the layout does not write is
    refused, and so is a path through a symbolic link below ``root``
    (:func:`dask_surge.io.atomic.unlink`).
    """
    _check_owned(root, path)
    return unlink(fs, root, path)


def relocate(fs, root: str, src: str, dst: str) -> None:
    """Move ``src`` to ``dst``, both of this layout below ``root`` (FileNotFoundError when
    ``src`` is gone). Every move of the package goes through here (see :func:`discard`)."""
    _check_owned(root, src)
    _check_owned(root, dst)
    rename(fs, root, src, dst)


def _discard_tree(fs, root: str, path: str) -> list[str]:
    """Delete the files of this layout below ``path``, then the directories left empty;
    returns what was left (anything else, links included)."""
    _check_owned(root, path)
    return remove_tree(fs, root, path, owned)


def _aside(fs, root: str, path: str) -> str:
    """Rename a damaged manifest file to ``.torn-<name>-<ns>`` beside it; returns the new path."""
    parent, name = path.rsplit("/", 1)
    new = f"{parent}/.torn-{name}-{time.time_ns()}"
    relocate(fs, root, path, new)
    return new


def write_bytes_atomic(fs, path: str, data: builtins.bytes | memoryview) -> None:
    """Write ``data`` to ``path`` via a temporary name: fsync, then rename over (one PUT on a store)."""
    write_atomic(fs, path, data)


def create_exclusive(fs, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist; True if we created it.

    A reader never sees a torn record (see :func:`dask_surge.io.atomic.write_atomic`).
    """
    return write_atomic(fs, path, data, exclusive=True)


_ls = listdir


def sb_key(partition: int, start: int) -> str:
    """The key of the SuperBatch whose first span starts at row ``start`` of ``partition``.

    SuperBatches never overlap, so their first rows identify them, whether they were
    planned ahead (sizes known) or formed as partitions streamed in; keys sort in
    ``(partition, row)`` order, as the data does.

    Examples
    --------
    >>> sb_key(12, 0), sb_key(12, 0) < sb_key(12, 5000) < sb_key(13, 0)
    ('000000012-000000000000', True)
    """
    return f"{int(partition):09d}-{int(start):012d}"


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

    def as_dict(self) -> dict:
        """The ``plan`` of ``run.json``: ``rows``, ``unit_partitions`` and ``first`` only where set."""
        out = asdict(self)
        for key in ("rows", "unit_partitions", "first"):
            if out[key] is None:
                del out[key]
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
    output.
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
        if not _DATA_FILE.match(rec.file):
            raise ValueError(f"commit record names file {rec.file!r}, not a data file of this layout")
        if rec.skipped_file and not _SIDE_FILE.match(rec.skipped_file):
            raise ValueError(f"commit record names skipped file {rec.skipped_file!r}, not of this layout")
        if not re.fullmatch(_SB, rec.sb):
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


def _corrupt(path: str, err: Exception) -> SurgeOutputError:
    root = path.split(f"/{META_DIR}/", 1)[0]
    return SurgeOutputError(
        f"{path!r} is damaged ({type(err).__name__}: {err}); it is part of the dask-surge manifest of "
        f"{root!r} (a crash or a full disk while it was written?). Nothing was changed. Fix: run "
        f"`dask-surge status --repair {root}` (or dask_surge.io.manifest.repair(...)), then rerun the same call."
    )


def _read_json(fs, path: str) -> dict | None:
    """The JSON object in ``path``; None when it does not exist; a clear error when it is damaged."""
    try:
        data = fs.cat_file(path)  # one GET on a store
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        out = json.loads(data)
        if not isinstance(out, dict):
            raise ValueError(f"a JSON object was expected, found {type(out).__name__}")
    except ValueError as err:
        raise _corrupt(path, err) from err
    return out


@dataclass
class Manifest:
    """One run inside an output directory (see module docstring)."""

    fs: Any
    root: str
    run_id: str
    fingerprint: dict = field(default_factory=dict)
    plan: RunPlan | None = None  # what the run recorded: thresholds, partitions, mode
    format_version: int = FORMAT_VERSION
    #: True while another run is current (an overwrite): committed files stay in ``staging/``
    #: until this run completes, so a ``part-*`` reader never sees two runs' rows at once
    defer_publish: bool = False

    @property
    def tasks_publish(self) -> bool:
        """True when the task that commits a SuperBatch also publishes its file (a rename on a
        local or shared filesystem). On an object store a move is a copy and a delete, which
        a retired run's late task could still make, so there only the process holding the
        claim publishes (:meth:`publish`, as each commit reaches it, and at the end)."""
        return not self.defer_publish and (is_local(self.fs) or "memory" in protocols(self.fs))

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

    def data_urls(self, records) -> list[str]:
        """Paths of ``records``' data files that any fsspec or Parquet reader opens."""
        proto = protocols(self.fs)[0]
        files = [f"{self.root}/{r.file}" for r in records]
        return files if proto in ("file", "local") else [f"{proto}://{f}" for f in files]

    def skipped_files(self, records) -> list[str]:
        """Paths of the skipped-null files that ``records`` name."""
        return [f"{self.run_dir}/skipped/{r.skipped_file}" for r in records if r.skipped]

    def commit(self, record: CommitRecord) -> bool:
        """Create the commit record of ``record.sb``; False if another attempt won.

        Raises FileNotFoundError when the run's directory is gone (the run was replaced
        and retired: a late task of it must not commit).
        """
        return create_exclusive(self.fs, self.record_path(record.sb), record.to_json())

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
        m = _DATA_FILE.match(file)
        if m is None:
            raise SurgeOutputError(f"{file!r} is not a data file of this layout. This is a bug: please report it.")
        staged = self.staging_path(sb, m.group("attempt"))
        try:
            relocate(self.fs, self.root, staged, final)
        except FileNotFoundError:
            if not self.fs.exists(final):
                raise

    def committed(self, *, repair: bool = False) -> dict[str, CommitRecord]:
        """Commit records by SuperBatch key, in data order. Torn or foreign records are skipped.

        With ``repair=True`` a torn record (unparseable, e.g. from a crash on a
        filesystem without atomic create) is renamed aside so its SuperBatch can
        be committed again.
        """
        out: dict[str, CommitRecord] = {}
        for name in _ls(self.fs, self.commits_dir):
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = f"{self.commits_dir}/{name}"
            try:
                rec = CommitRecord.from_json(self.fs.cat_file(path))
                if name != f"{rec.sb}.json" or rec.run != self.run_id:
                    continue
            except (ValueError, KeyError, TypeError, OSError):
                # torn record: that SuperBatch is not committed
                if repair:
                    _aside(self.fs, self.root, path)
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
        if self.defer_publish:
            return 0
        present = set(_ls(self.fs, self.root))
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
        _write_meta(self.fs, current_path(self.root), self.run_id.encode())

    @property
    def _stopped_path(self) -> str:
        return f"{self.run_dir}/STOPPED"

    @property
    def _complete_path(self) -> str:
        return f"{self.run_dir}/COMPLETE"

    def mark_stopped(self, why: str) -> None:
        """Record that this run's process stopped on an error (so a run that committed
        nothing may be replaced without ``overwrite``). Best effort: never raises."""
        with contextlib.suppress(OSError):
            write_bytes_atomic(self.fs, self._stopped_path, why.encode()[:2000])

    def stopped(self) -> bool:
        """True when the last process of this run stopped on an error (and none resumed it)."""
        return self.fs.exists(self._stopped_path)

    def clear_stopped(self) -> None:
        discard(self.fs, self.root, self._stopped_path)

    def completion(self) -> dict | None:
        """The completion summary (rows, nulls skipped, SuperBatches) of a finished run, else None."""
        return _read_json(self.fs, self._complete_path)


def _write_meta(fs, path: str, data: bytes) -> None:
    """Write a manifest file; a failure (disk full, permissions) is a clear error that names it."""
    try:
        write_bytes_atomic(fs, path, data)
    except OSError as err:
        root = path.split(f"/{META_DIR}/", 1)[0]
        raise SurgeOutputError(
            f"writing {path!r} failed ({type(err).__name__}: {err}). Committed SuperBatches are kept and "
            f"no partial file is left. Fix: free disk space or fix permissions on {root!r}, then rerun the "
            "same call to resume."
        ) from err


def index_dir(root: str, run_id: str) -> str:
    """Where the reuse index (:mod:`dask_surge.io.reuse`) of run ``run_id`` of the output ``root`` lives."""
    return f"{root}/{META_DIR}/index/{run_id}"


def current_path(root: str) -> str:
    """Where an output directory names its current run."""
    return f"{root}/{META_DIR}/CURRENT"


def _current_id(fs, root: str) -> str | None:
    """The run id in ``CURRENT``; None when there is none; a clear error when it is damaged."""
    path = current_path(root)
    try:
        run_id = fs.cat_file(path).decode(errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not _RUN_ID.match(run_id):
        raise _corrupt(path, ValueError(f"{run_id[:40]!r} is not a run id"))
    return run_id


def _load(fs, root: str, run_id: str) -> Manifest | None:
    info = _read_json(fs, f"{root}/{META_DIR}/runs/{run_id}/run.json")
    if info is None:
        return None
    _check_version(info, root)
    if not isinstance(info.get("fingerprint"), dict):
        raise _corrupt(f"{root}/{META_DIR}/runs/{run_id}/run.json", ValueError("no fingerprint"))
    return Manifest(fs, root, run_id, info["fingerprint"], RunPlan.of(info.get("plan")),
                    format_version=info["format_version"])


def output_fs(path: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """The filesystem and root of an output ``path``: an object store's without a listing
    cache (a commit made by another process must never be hidden by a stale listing)."""
    from fsspec.core import split_protocol

    options = dict(storage_options or {})
    if split_protocol(str(path))[0] in STORE_PROTOCOLS:
        options.setdefault("use_listings_cache", False)
    fs, root = url_to_fs(path, **options)
    return fs, root.rstrip("/") or "/"


_fs_root = output_fs


def current_run(path: str, storage_options: dict | None = None) -> Manifest | None:
    """The run whose rows are current in the output directory ``path`` (or None)."""
    fs, root = _fs_root(path, storage_options)
    run_id = _current_id(fs, root)
    return None if run_id is None else _load(fs, root, run_id)


def existing_run(path: str, storage_options: dict | None = None) -> Manifest:
    """The current run in ``path`` for a reader, or a clear error when there is none."""
    manifest = current_run(path, storage_options)
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


def _create_mode(protocol: str) -> bool:
    """True when the installed fsspec filesystem of ``protocol`` offers an exclusive create
    (``pipe_file(..., mode="create")``: a conditional PUT with ``If-None-Match: *``)."""
    import inspect

    from fsspec.registry import get_filesystem_class

    try:
        cls = get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return False
    for name in ("_pipe_file", "pipe_file"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            if "mode" in inspect.signature(getattr(cls, name)).parameters:
                return True
    return False


def check_writable_store(path: str) -> None:
    """Refuse to write where the commit protocol cannot hold.

    Local and shared POSIX filesystems (:data:`LOCAL_PROTOCOLS`) are accepted, and object
    stores (:data:`STORE_PROTOCOLS`) whose installed fsspec filesystem offers an exclusive
    create; those are proven on the store itself before the first write
    (:func:`check_store`). Anything else, and chained URLs, are refused. Reading any
    store (a finished output copied there) is fine; only writing is checked.

    Examples
    --------
    >>> check_writable_store("/tmp/emb")
    >>> check_writable_store("ftp://host/emb")
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeOutputError: output='ftp://host/emb' is on a 'ftp' filesystem. ...
    """
    from fsspec.core import split_protocol

    protocol = split_protocol(str(path))[0] or "file"  # before any filesystem is built (none may be installed)
    if protocol in LOCAL_PROTOCOLS and "::" not in str(path):
        return
    if protocol in STORE_PROTOCOLS and "::" not in str(path):
        if _create_mode(protocol):
            return
        raise SurgeOutputError(
            f"output={path!r} is on a {protocol!r} store, but the installed fsspec filesystem for it gives no "
            "exclusive create (pipe_file(..., mode='create'), a conditional PUT), which dask-surge's commit "
            "protocol needs. Nothing was written. Fix: install or upgrade its package (s3fs, gcsfs or adlfs, "
            "2024.12 or newer), or write to a shared filesystem path."
        )
    raise SurgeOutputError(
        f"output={path!r} is on a {protocol!r} filesystem. dask-surge's exactly-once commit needs an atomic "
        "write and an exclusive create, which it uses on local and shared POSIX filesystems (local disks, NFS, "
        f"Lustre, GPFS) and on object stores ({', '.join(STORE_PROTOCOLS)}) only, so it refuses other "
        "filesystems (and chained URLs) rather than risk lost or duplicated rows. Nothing was written. Fix: "
        "write to a shared filesystem path or an object-store URL such as 's3://bucket/prefix'."
    )


def check_store(fs, root: str) -> None:
    """Prove on an object store's own prefix that an exclusive create is exclusive (some
    S3-compatible servers ignore ``If-None-Match`` and answer 200 to both writers) and that a
    listing shows a new key; a :class:`SurgeOutputError` naming the store otherwise. Costs
    two PUTs, one LIST and one DELETE, once per run; does nothing on a local filesystem."""
    if is_local(fs) or "memory" in protocols(fs):
        return
    probe = f"{root}/{META_DIR}/.probe-{uuid.uuid4().hex}"
    store = f"{protocols(fs)[0]}://{root}"
    try:
        first = create_exclusive(fs, probe, b"1")
        second = create_exclusive(fs, probe, b"2")
        listed = probe.rsplit("/", 1)[1] in _ls(fs, f"{root}/{META_DIR}")
        discard(fs, root, probe)
    except SurgeOutputError:
        raise
    except OSError as err:
        raise SurgeOutputError(
            f"output={store!r} cannot be written ({type(err).__name__}: {err}). Nothing was encoded. Fix: check "
            "the bucket exists and the credentials (storage_options, the environment or the store's config) "
            "allow PUT, GET, LIST and DELETE under that prefix."
        ) from err
    if not first or second:
        raise SurgeOutputError(
            f"output={store!r}: the store ignored a conditional create (a second exclusive PUT of one key "
            f"{'succeeded' if second else 'failed although the key was new'}). dask-surge commits each SuperBatch "
            "and claims the output with conditional PUTs (If-None-Match: *); on this store two writers could both "
            "win and rows could be duplicated or lost. Nothing was written. Fix: use a store that honours "
            "If-None-Match (AWS S3, recent MinIO, GCS, Azure), or write to a shared filesystem path."
        )
    if not listed:
        raise SurgeOutputError(
            f"output={store!r}: a key just written did not appear in a listing of its prefix, so resume could "
            "miss committed SuperBatches. Nothing was written. Fix: turn off any listing cache of the store "
            "(storage_options={'use_listings_cache': False}) or use a store with consistent listings."
        )


def check_output(path: str, storage_options: dict | None = None, *, inputs: Sequence[str] = ()) -> None:
    """Refuse an output location that a run could not own (before anything is written).

    The output must be a directory on a filesystem whose commit protocol is proven
    (:data:`LOCAL_PROTOCOLS`), not under a regular file, not one of the input files'
    directories, and either new, empty, or holding only dask-surge's own files
    (``_surge/`` and data files named by this layout; ``.``-prefixed entries are left
    alone). A run never deletes, overwrites or reads as output a file it did not write.

    Parameters
    ----------
    path : str
        The output directory (local path or fsspec URL).
    storage_options : dict, optional
        fsspec options for ``path``.
    inputs : list of str
        Input files (as their filesystem names them): none may be inside ``path``.

    Raises
    ------
    SurgeOutputError
        Naming the path, the rule and the fix.

    Examples
    --------
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> check_output(d)  # empty: fine
    >>> open(os.path.join(d, "part-00000.parquet"), "w").close()
    >>> check_output(d)
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeOutputError: output=... holds 1 entry that dask-surge did not write ('part-00000.parquet'); ...
    """
    check_writable_store(path)
    fs, root = _fs_root(path, storage_options)
    try:
        ancestor = root
        while ancestor not in ("", "/") and not fs.exists(ancestor):
            ancestor = ancestor.rsplit("/", 1)[0] if "/" in ancestor else ""
        is_file = ancestor not in ("", "/") and not fs.isdir(ancestor)
    except Exception as err:
        if is_local(fs):
            raise
        raise SurgeOutputError(
            f"output={path!r} cannot be reached ({type(err).__name__}: {err}). Nothing was written. Fix: check the "
            "URL, the endpoint and the credentials (storage_options, the environment or the store's config)."
        ) from err
    if is_file:
        what = "is a file" if ancestor == root else f"is under {ancestor!r}, which is a file"
        raise SurgeOutputError(
            f"output={path!r} {what}; the output must be a directory (one Parquet file per SuperBatch plus "
            "a manifest). Nothing was written. Fix: choose a new directory path."
        )
    inside = [p for p in inputs if p.rstrip("/").startswith(root.rstrip("/") + "/")]
    around = [d for d in _input_dirs(inputs) if (root.rstrip("/") + "/").startswith(d.rstrip("/") + "/")]
    if around:
        raise SurgeOutputError(
            f"output={path!r} is {'' if around[0].rstrip('/') == root.rstrip('/') else 'inside '}the input "
            f"directory {around[0]!r}: a run never writes into its input (the rerun that resumes it would read the "
            "embedding files as input, and they would pollute the dataset). Nothing was written. Fix: "
            f"write beside the input, e.g. {around[0].rstrip('/') + '-embeddings'!r}."
        )
    if inside:
        raise SurgeOutputError(
            f"output={path!r} holds input file {inside[0]!r} ({len(inside)} input file(s) in all): a run "
            "never writes into its input. Nothing was written. Fix: choose another directory for the output, "
            f"e.g. {root.rstrip('/') + '-embeddings'!r}."
        )
    if ancestor != root:
        return
    refuse_links(fs, root)
    names = _ls(fs, root)
    ours = META_DIR in names
    foreign = [n for n in names if not n.startswith(".") and n != META_DIR and not (ours and _DATA_FILE.match(n))]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise SurgeOutputError(
            f"output={path!r} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} that dask-surge did "
            f"not write ({shown}); a run never deletes, overwrites or mixes in files it does not own, and "
            "readers of the output would read those as rows. Nothing was written. Fix: write to a new or "
            f"empty directory, e.g. {root.rstrip('/') + '/embeddings'!r}."
        )


def _input_dirs(inputs: Sequence[str]) -> list[str]:
    """Each input path, with a glob cut to its fixed directory (``in/*.parquet`` reads ``in``):
    an output below one of them is inside an input directory."""
    dirs = []
    for p in inputs:
        cut = min((i for i, c in enumerate(p) if c in "*?["), default=-1)
        dirs.append(p if cut < 0 else p[:cut].rsplit("/", 1)[0] if "/" in p[:cut] else "")
    return [d for d in dirs if d not in ("", "/")]


@dataclass
class Claim:
    """An exclusive, heartbeated claim of an output directory by one live run.

    ``_surge/CLAIM`` holds the run, host, pid and a random token, and is never rewritten;
    the holder's heartbeat is the time written in its own ``_surge/.heartbeat-<token>``,
    so refreshing it can never overwrite another run's claim. :meth:`acquire` creates
    the claim exclusively; a claim whose process is gone (same host, pid not alive) or
    whose heartbeat is older than :data:`CLAIM_TTL_S` is stale and is taken over
    (:meth:`_take_over`: of several processes taking it over, one wins). While held, a
    daemon thread refreshes the heartbeat and notices a lost claim (:attr:`lost`);
    :meth:`release` removes the claim if it is still ours.

    Examples
    --------
    >>> import tempfile, fsspec
    >>> fs, root = fsspec.filesystem("file"), tempfile.mkdtemp()
    >>> claim = Claim.acquire(fs, root, "0123456789abcdef", heartbeat=False)
    >>> Claim.acquire(fs, root, "fedcba9876543210", heartbeat=False)
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeOutputError: output=... is being written by another run (...
    >>> claim.release(); Claim.holder(fs, root) is None
    True
    """

    fs: Any
    root: str
    run_id: str
    token: str
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    lost: bool = False

    @staticmethod
    def path(root: str) -> str:
        return f"{root}/{META_DIR}/CLAIM"

    @staticmethod
    def _beat_path(root: str, token: str) -> str:
        return f"{root}/{META_DIR}/.heartbeat-{token}"

    @staticmethod
    def holder(fs, root: str) -> dict | None:
        """What the claim of ``root`` says, with its last ``heartbeat`` (None: unclaimed; a torn
        claim reads as stale)."""
        try:
            info = _read_json(fs, Claim.path(root))
        except SurgeOutputError:
            return {"heartbeat": 0.0, "host": "?", "pid": 0, "run": "?", "token": "?"}
        if info is None:
            return None
        token = str(info.get("token", ""))
        if re.fullmatch(r"[0-9a-f]{32}", token):
            with contextlib.suppress(FileNotFoundError, ValueError):  # no beat yet: the time the claim was made
                info["heartbeat"] = float(fs.cat_file(Claim._beat_path(root, token)).decode())
        info.setdefault("heartbeat", info.get("started", 0.0))
        return info

    @staticmethod
    def _stale(info: dict) -> bool:
        if time.time() - float(info.get("heartbeat", 0)) > CLAIM_TTL_S:
            return True
        if info.get("host") == socket.gethostname():
            try:
                os.kill(int(info.get("pid", 0)), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, ValueError, OverflowError):
                return False
        return False

    def _body(self) -> bytes:
        return json.dumps({"run": self.run_id, "token": self.token, "host": socket.gethostname(),
                           "pid": os.getpid(), "started": time.time()}, sort_keys=True).encode()

    def _beat_once(self) -> None:
        write_bytes_atomic(self.fs, Claim._beat_path(self.root, self.token), repr(time.time()).encode())

    @classmethod
    def acquire(cls, fs, root: str, run_id: str, *, heartbeat: bool = True) -> Claim:
        """Claim ``root`` for ``run_id`` or raise :class:`SurgeOutputError` naming the live holder."""
        claim = cls(fs, root, run_id, uuid.uuid4().hex)
        meta = f"{root}/{META_DIR}"
        try:
            fs.makedirs(meta, exist_ok=True)
            for _ in range(5):
                if create_exclusive(fs, cls.path(root), claim._body()):
                    break
                info = cls.holder(fs, root)
                if info is None:
                    continue  # released meanwhile
                if not cls._stale(info):
                    age = time.time() - float(info.get("heartbeat", 0))
                    raise SurgeOutputError(
                        f"output={root!r} is being written by another run (run {info.get('run')}, pid "
                        f"{info.get('pid')} on {info.get('host')}, last heartbeat {age:.0f} s ago). Nothing "
                        "was written. Fix: wait for it to finish, or write to another directory; a claim "
                        f"whose process died is taken over at once on the same host, else after "
                        f"{CLAIM_TTL_S:.0f} s without a heartbeat."
                    )
                claim._take_over(info)
            else:
                raise SurgeOutputError(f"output={root!r}: could not claim it after 5 tries (another run "
                                       "keeps claiming it). Fix: rerun when the other run is done.")
        except SurgeOutputError:
            raise  # our own refusal (an OSError subclass): not a filesystem failure
        except OSError as err:
            raise SurgeOutputError(
                f"output={root!r} is not writable ({type(err).__name__}: {err}). Nothing was encoded. "
                "Fix: choose a directory you can create and write to."
            ) from err
        for name in _ls(fs, meta):  # what takeovers of stale claims left
            if name.startswith((".stale-claim-", ".takeover-")):
                with contextlib.suppress(OSError):
                    discard(fs, root, f"{meta}/{name}")
        with contextlib.suppress(OSError):
            claim._beat_once()
        if heartbeat:
            claim._thread = threading.Thread(target=claim._beat, name="dask-surge-claim", daemon=True)
            claim._thread.start()
        return claim

    def _take_over(self, stale: dict) -> None:
        """Remove the stale claim ``stale`` so that :meth:`acquire` may create its own.

        Of several processes taking over one stale claim, only the one that creates the
        takeover marker ``.takeover-<its token>-<k>`` exclusively removes it, and only if
        the claim still carries that token; the others are refused while that process lives
        (a marker of a dead one is passed over by the next ``k``). So a takeover never has
        two winners: a process that did not remove the stale claim can only win by creating
        ``CLAIM`` exclusively, which fails once any other process has.
        """
        fs, root = self.fs, self.root
        old = str(stale.get("token", ""))
        token = old if re.fullmatch(r"[0-9a-f]{32}", old) else "0" * 32
        for k in range(8):
            marker = f"{root}/{META_DIR}/.takeover-{token}-{k}"
            if create_exclusive(fs, marker, self._body()):
                break
            try:
                taker = _read_json(fs, marker)
            except SurgeOutputError:
                taker = None  # torn: its writer died while writing it
            if taker is not None and not self._stale({**taker, "heartbeat": taker.get("started", 0.0)}):
                raise SurgeOutputError(
                    f"output={root!r} is being claimed by another run (pid {taker.get('pid')} on "
                    f"{taker.get('host')} is taking over the stale claim of run {stale.get('run')}). Nothing "
                    "was written. Fix: wait for that run to finish, or write to another directory."
                )
        else:
            raise SurgeOutputError(f"output={root!r}: its stale claim could not be taken over (8 takeovers "
                                   "died). Fix: remove _surge/CLAIM and _surge/.takeover-* by hand, then rerun.")
        info = Claim.holder(fs, root)
        if info is not None and str(info.get("token", "")) == old:
            discard(fs, root, Claim.path(root))
        if token == old:
            discard(fs, root, Claim._beat_path(root, old))

    def held(self) -> bool:
        """True while the claim file still carries our token."""
        info = Claim.holder(self.fs, self.root)
        return info is not None and info.get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.held():
                    self.lost = True
                    return
                self._beat_once()  # our own file: a claim taken over meanwhile is never overwritten
            except OSError:  # a full disk: the next beat tries again; the claim goes stale if it persists
                continue

    def release(self) -> None:
        """Stop the heartbeat and remove the claim if it is still ours (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            if self.held():
                discard(self.fs, self.root, Claim.path(self.root))
        with contextlib.suppress(OSError):
            discard(self.fs, self.root, Claim._beat_path(self.root, self.token))

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def find_run(path: str, fingerprint: dict, storage_options: dict | None = None) -> Manifest | None:
    """The run of ``fingerprint`` in ``path`` if it was ever created there (current or
    not), with what it recorded; None otherwise. Reads only the run's ``run.json``."""
    check_writable_store(path)  # it is asked by a run about to write there
    fs, root = _fs_root(path, storage_options)
    run_id = fingerprint_digest(fingerprint)
    manifest = Manifest(fs, root, run_id, fingerprint)
    info = _read_json(fs, f"{manifest.run_dir}/run.json")
    if info is None or info.get("format_version") != FORMAT_VERSION:
        return None
    manifest.plan = RunPlan.of(info.get("plan"))
    current = _current_id(fs, root)
    if manifest.completion() is not None and current != run_id:
        return None  # a complete run that another run replaced since: not ours to trust
    return manifest


def open_run(
    path: str, fingerprint: dict, *, overwrite: bool = False, storage_options: dict | None = None,
    plan: RunPlan | None = None,
) -> tuple[Manifest, bool]:
    """Open (resume) or create the run for ``fingerprint`` in output directory ``path``.

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
    check_writable_store(path)
    fs, root = _fs_root(path, storage_options)
    run_id = fingerprint_digest(fingerprint)
    manifest = Manifest(fs, root, run_id, fingerprint)
    current = current_run(path, storage_options)
    other = current if current is not None and current.run_id != run_id else None
    empty_other = other is not None and other.stopped() and not other.committed()
    if other is not None and not overwrite and not empty_other:
        diff = "; ".join(_differences(other.fingerprint, fingerprint)) or "(format)"
        raise SurgeOutputError(
            f"output={path!r} already holds a different run ({diff}). Nothing was written. "
            "Fix: write to a new path, or pass overwrite=True (the old output is replaced "
            "only once the new run has completed)."
        )
    refuse_links(fs, root)
    # while another run is current, this one's files wait in staging/ until it completes (settle)
    manifest.defer_publish = other is not None and not empty_other
    info = _read_json(fs, f"{manifest.run_dir}/run.json")
    try:
        if info is None:
            fs.makedirs(manifest.commits_dir, exist_ok=True)
            fs.makedirs(manifest.staging_dir, exist_ok=True)
            manifest.plan = plan
            body = {"format_version": FORMAT_VERSION, "run": run_id, "fingerprint": fingerprint,
                    "plan": plan.as_dict() if plan is not None else {}, "created": time.time()}
            write_bytes_atomic(fs, f"{manifest.run_dir}/run.json",
                               json.dumps(body, sort_keys=True, default=str).encode())
        else:
            _check_version(info, root)
            manifest.plan = RunPlan.of(info.get("plan"))
            fs.makedirs(manifest.staging_dir, exist_ok=True)
            manifest.clear_stopped()  # resumed
        if current is None or empty_other:
            manifest.mark_current()
    except OSError as err:
        raise SurgeOutputError(
            f"output={path!r} is not writable ({type(err).__name__}: {err}). Nothing was encoded. "
            "Fix: choose a directory you can create and write to."
        ) from err
    return manifest, info is not None


def _retire(fs, root: str, run: str) -> None:
    """Fence off and delete another run: on a filesystem its directory is moved to ``retired/``
    first (a late task of it can then neither commit nor publish), then its data files go."""
    runs = f"{root}/{META_DIR}/runs"
    retired_dir = f"{root}/{META_DIR}/retired"
    if is_local(fs) or "memory" in protocols(fs):
        fs.makedirs(retired_dir, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            relocate(fs, root, f"{runs}/{run}", f"{retired_dir}/{run}-{time.time_ns()}")
    prefix = run[:8]
    for name in _ls(fs, root):
        m = _DATA_FILE.match(name)
        if m and m.group("run") == prefix:
            discard(fs, root, f"{root}/{name}")
    if not is_local(fs):  # a store has no directory to move: the run's tasks never publish there, so
        _discard_tree(fs, root, f"{runs}/{run}")  # its metadata goes now (a late record is harmless garbage)


def refuse_links(fs, root: str) -> None:
    """Raise :class:`LinkRefused` when anything under the output's ``_surge/`` is a symbolic
    link: a run moves and deletes files there, and never follows a link out of its output.
    One ``lstat`` walk of ``_surge/``, at the start and the end of a run (local filesystems)."""
    found = links_below(fs, root, f"{root}/{META_DIR}")
    if found:
        where = found[0]
        with contextlib.suppress(OSError):
            where += f" -> {os.readlink(found[0])!r}"
        raise LinkRefused(
            f"output={root!r}: {where} is a symbolic link inside dask-surge's manifest ({len(found)} link(s) in "
            "all). A run moves and deletes files there and never follows a link out of its output, so it "
            f"refuses to start. Nothing was written or deleted. Fix: remove the link (`rm {found[0]}` removes "
            "the link only, not its target), then rerun; to keep the output on another disk, point the output "
            "path itself there."
        )


def finish_run(manifest: Manifest, committed: dict[str, CommitRecord], summary: dict) -> None:
    """Record the run as complete and current, then :func:`settle` the directory.

    ``committed`` is ``manifest.committed()`` as just read by the caller; ``summary``
    (rows, SuperBatches, nulls skipped) is kept in the run's ``COMPLETE`` marker, so a
    rerun of a complete run does nothing and :func:`dask_surge.status` reads it.
    """
    fs, root = manifest.fs, manifest.root
    refuse_links(fs, root)
    if not manifest.defer_publish:
        manifest.publish_pending(committed)  # a run that publishes as it commits: readers see it whole first
    _write_meta(fs, manifest._complete_path, json.dumps(summary, sort_keys=True).encode())
    manifest.mark_current()
    settle(manifest, committed)


def settled(manifest: Manifest, committed: dict[str, CommitRecord]) -> bool:
    """True when the data files of the directory are exactly the committed ones of this
    complete, current run (none unpublished, none another run's or an uncommitted attempt's)."""
    fs, root = manifest.fs, manifest.root
    data = {n for n in _ls(fs, root) if _DATA_FILE.match(n)}
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
    fs, root = manifest.fs, manifest.root
    published = {m.group("run") for m in map(_DATA_FILE.match, _ls(fs, root)) if m}
    for run in _ls(fs, f"{root}/{META_DIR}/runs"):
        if run != manifest.run_id and _RUN_ID.match(run) and (retire_others or run[:8] in published):
            _retire(fs, root, run)
    manifest.defer_publish = False  # complete and current: its files are the output now
    manifest.publish_pending(committed)
    keep = {rec.file for rec in committed.values()}
    for name in _ls(fs, root):
        if _DATA_FILE.match(name) and name not in keep:  # a data file of this layout: ours, not committed
            discard(fs, root, f"{root}/{name}")
    keep_skipped = {rec.skipped_file for rec in committed.values()}
    for side in ("staging", "skipped"):
        for name in _ls(fs, f"{manifest.run_dir}/{side}"):
            path = f"{manifest.run_dir}/{side}/{name}"
            if (side == "staging" or name not in keep_skipped) and owned(path[len(root) + 1:]):
                discard(fs, root, path)  # staging leftovers; skipped files of attempts that lost the commit
    for run in _ls(fs, index_dir(root, "").rstrip("/")):  # reuse indexes of runs now gone
        if run != manifest.run_id and _RUN_ID.match(run):
            _discard_tree(fs, root, index_dir(root, run))
    _discard_tree(fs, root, f"{root}/{META_DIR}/retired")


def _problems(manifest: Manifest) -> list[tuple[CommitRecord, str]]:
    """Each committed file of ``manifest`` (data and skipped-null files) that is missing or whose
    sha256 differs from its record, with a line that says so."""
    problems = []
    for rec in manifest.committed().values():
        for name, digest, where in ((rec.file, rec.sha256, manifest.root),
                                    (rec.skipped_file, rec.skipped_sha256, f"{manifest.run_dir}/skipped")):
            if not name:
                continue
            h = hashlib.sha256()
            try:
                with manifest.fs.open(f"{where}/{name}", "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
            except FileNotFoundError:
                problems.append((rec, f"{where}/{name}: missing (SuperBatch {rec.sb})"))
                continue
            if h.hexdigest() != digest:
                problems.append((rec, f"{where}/{name}: sha256 {h.hexdigest()[:16]}... differs from the recorded "
                                      f"{digest[:16]}... (SuperBatch {rec.sb})"))
    return problems


def verify(path: str, storage_options: dict | None = None) -> list[str]:
    """Check every committed file of the current run in ``path`` against its recorded
    ``sha256``; returns one line per problem (empty: all good).

    Examples
    --------
    >>> import tempfile
    >>> verify(tempfile.mkdtemp())
    []
    """
    fs, root = _fs_root(path, storage_options)
    refuse_links(fs, root)
    manifest = current_run(path, storage_options)
    if manifest is None:
        return []
    strays = [f"{manifest.root}/{n}: a data file that no commit record of the current run names (left by a "
              "replaced or killed run; `part-*` readers would read its rows); --repair deletes it"
              for n in _strays(manifest)]
    return [line for _, line in _problems(manifest)] + strays


def repair(path: str, storage_options: dict | None = None) -> list[str]:
    """Bring a damaged manifest back to a state a rerun can resume from; returns what was done.

    Never deletes a file that is not dask-surge's: damaged manifest files and commit
    records are renamed aside (``.torn-*``), committed files left in staging are
    published, and a commit whose data file is gone (or fails its checksum) is
    forgotten, so a rerun encodes those rows again. A damaged ``CURRENT`` is pointed
    at the one run left, or removed. Repair a directory no run is writing.

    Examples
    --------
    >>> import tempfile
    >>> repair(tempfile.mkdtemp())
    []
    """
    fs, root = _fs_root(path, storage_options)
    refuse_links(fs, root)
    done: list[str] = []
    meta = f"{root}/{META_DIR}"

    def aside(p: str) -> None:
        _aside(fs, root, p)
        done.append(f"moved damaged {p} aside")

    def forget(manifest: Manifest, rec: CommitRecord, why: str) -> None:
        aside(manifest.record_path(rec.sb))
        discard(fs, root, manifest._complete_path)
        done.append(f"forgot SuperBatch {rec.sb} of run {manifest.run_id}: {why}; a rerun encodes those rows again")

    valid: dict[str, Manifest] = {}
    for run in [r for r in _ls(fs, f"{meta}/runs") if _RUN_ID.match(r)]:
        try:
            loaded = _load(fs, root, run)
        except SurgeOutputError:
            aside(f"{meta}/runs/{run}/run.json")
            continue
        if loaded is not None:
            valid[run] = loaded
    try:
        current = _current_id(fs, root)
    except SurgeOutputError:
        aside(current_path(root))
        current = None
    if current is not None and current not in valid:
        discard(fs, root, current_path(root))
        done.append(f"removed {current_path(root)} (it named run {current}, which has no valid run.json)")
        current = None
    if current is None and len(valid) == 1:
        current = next(iter(valid))
        _write_meta(fs, current_path(root), current.encode())
        done.append(f"pointed {current_path(root)} at run {current}")
    for manifest in valid.values():
        before = {n for n in _ls(fs, manifest.commits_dir) if n.startswith(".torn-")}
        records = manifest.committed(repair=True)
        done += [f"moved damaged commit record {n} aside" for n in
                 {n for n in _ls(fs, manifest.commits_dir) if n.startswith(".torn-")} - before]
        try:
            manifest.completion()
        except SurgeOutputError:
            aside(manifest._complete_path)
        present, staged = set(_ls(fs, root)), set(_ls(fs, manifest.staging_dir))
        for rec in records.values():
            if rec.file in present:
                continue
            attempt = rec.file.rsplit("-", 1)[-1].removesuffix(".parquet")
            if f"{rec.sb}-{attempt}.parquet" not in staged:
                forget(manifest, rec, f"its file {rec.file} is missing")
            elif manifest.run_id == current:  # another run's files wait in staging until it completes
                manifest.publish(rec)
                done.append(f"published committed {rec.file} from staging")
    if current is not None:
        manifest = valid[current]
        for rec, line in _problems(manifest):
            if fs.exists(manifest.record_path(rec.sb)):  # a record with two bad files is forgotten once
                forget(manifest, rec, line)
        for name in _strays(manifest):
            discard(fs, root, f"{root}/{name}")
            done.append(f"deleted {name}: a data file of this layout that no commit record of the current run "
                        "names (left by a replaced or killed run)")
    return done


def _strays(manifest: Manifest) -> list[str]:
    """Data files of this layout in the output that no commit record of ``manifest`` names
    (listed before the records are read, so a file published meanwhile is named)."""
    names = [n for n in _ls(manifest.fs, manifest.root) if _DATA_FILE.match(n)]
    named = {rec.file for rec in manifest.committed().values()}
    return [n for n in names if n not in named]
