"""The run manifest: fingerprint, commit records, resume. The only source of truth.

Layout of an output directory ``out/``::

    out/part-<run>-<sb>-<attempt>.parquet        one file per committed SuperBatch
    out/_surge/CURRENT                           id of the run whose rows are current
    out/_surge/runs/<run>/run.json               fingerprint, resolved thresholds, partitions
    out/_surge/runs/<run>/commits/<sb>.json      one commit record per SuperBatch
    out/_surge/runs/<run>/skipped/<sb>-<a>.parquet  (partition, row) of nulls it skipped
    out/_surge/runs/<run>/COMPLETE               written once every partition is accounted for
    out/_surge/runs/<run>/STOPPED                the last process stopped on an error

``<sb>`` is :func:`sb_key` of the SuperBatch's first row. This module alone spells
these paths.

A run id is a digest of the fingerprint, so rerunning the same call finds its
own run and resumes it. A SuperBatch is committed when its record exists; the
record is created exclusively, so of two attempts of the same SuperBatch only
one wins. Data files without a record are orphans: readers and resume ignore
them. Parquet readers pointed at ``out/`` skip ``_surge`` (``_`` prefix) and the
``.``-prefixed temporary files.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fsspec.core import url_to_fs

from .errors import SurgeInputError, SurgeOutputError

__all__ = ["FORMAT_VERSION", "Manifest", "CommitRecord", "Coverage", "sb_key", "fingerprint_digest", "open_run",
           "current_run", "existing_run", "find_run", "finish_run"]

FORMAT_VERSION = 2  # 2: SuperBatches keyed by their first row; recorded thresholds
META_DIR = "_surge"


def fingerprint_digest(fingerprint: dict) -> str:
    """Stable 16-hex-digit id of a fingerprint (keys sorted, JSON-encoded)."""
    blob = json.dumps(fingerprint, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _temp_name(path: str) -> tuple[str, str]:
    parent, name = path.rsplit("/", 1)
    return parent, f"{parent}/.{name}.tmp-{os.getpid()}-{time.monotonic_ns()}"


def _atomic_write(fs, path: str, data: builtins.bytes | memoryview, *, exclusive: bool = False) -> bool:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file.

    Local files are written to a temporary name, fsynced, then renamed over ``path``
    (or, with ``exclusive=True``, hard-linked to it, which fails if ``path`` exists),
    and the directory is fsynced. Other filesystems write the temporary file and move
    it (exclusive: their ``"xb"`` mode where they have one, else check-then-write).
    On any failure the temporary file is removed. Returns False only when
    ``exclusive`` and ``path`` already existed.
    """
    parent, tmp = _temp_name(path)
    local = _is_local(fs)
    if not local and exclusive:
        if fs.exists(path):
            return False
        try:
            with fs.open(path, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # no exclusive mode on this filesystem
            pass
    try:
        if local:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, path)  # atomic, fails if path exists
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, path)
            _fsync_dir(parent)
        else:
            with fs.open(tmp, "wb") as f:
                f.write(data)
            fs.mv(tmp, path)
    except BaseException:
        # disk full, killed write, ...: leave no partial file behind
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise
    return True


def write_bytes_atomic(fs, path: str, data: builtins.bytes | memoryview) -> None:
    """Write ``data`` to ``path`` via a temporary name: fsync, then rename over."""
    _atomic_write(fs, path, data)


def create_exclusive(fs, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist; True if we created it.

    A reader never sees a torn record (see :func:`_atomic_write`).
    """
    return _atomic_write(fs, path, data, exclusive=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
class CommitRecord:
    """The commit of one SuperBatch: its file and the input rows it accounts for.

    ``spans`` holds ``(partition, start, stop, partition_rows)`` for each input span:
    with the partition's full row count, the records alone say which partitions are
    complete (a resumed run skips them without reading them).
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

    @property
    def accounted(self) -> int:
        """Input rows this commit accounts for: written rows plus skipped nulls."""
        return self.rows + self.skipped

    def to_json(self) -> builtins.bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: builtins.bytes) -> CommitRecord:
        raw = json.loads(data)
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}
        raw["spans"] = tuple(tuple(int(x) for x in s) for s in raw["spans"])
        if any(len(s) != 4 for s in raw["spans"]):
            raise ValueError("spans need (partition, start, stop, partition_rows)")
        return cls(**raw)


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

    @classmethod
    def of(cls, span_lists) -> Coverage:
        cov = cls()
        for spans in span_lists:
            for p, start, stop, n in spans:
                cov.rows[p] = n
                cov.covered[p] = cov.covered.get(p, 0) + (stop - start)
                cov.starts.setdefault(p, set()).add(start)
        return cov

    def complete(self, partition: int) -> bool:
        """Every row of ``partition`` is in a committed SuperBatch (an empty one: recorded)."""
        return partition in self.rows and self.covered.get(partition, 0) >= self.rows[partition]

    def committed_starts(self, partition: int) -> set:
        return self.starts.get(partition, set())

    def missing(self, npartitions: int) -> list[int]:
        """Partitions ``0..npartitions-1`` not complete, in order."""
        return [p for p in range(npartitions) if not self.complete(p)]

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


@dataclass
class Manifest:
    """One run inside an output directory (see module docstring)."""

    fs: Any
    root: str
    run_id: str
    fingerprint: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)  # what the run recorded: thresholds, partitions, mode
    format_version: int = FORMAT_VERSION

    @property
    def run_dir(self) -> str:
        return f"{self.root}/{META_DIR}/runs/{self.run_id}"

    @property
    def commits_dir(self) -> str:
        return f"{self.run_dir}/commits"

    def data_path(self, sb: str, attempt: str) -> str:
        return f"{self.root}/part-{self.run_id[:8]}-{sb}-{attempt}.parquet"

    def skipped_path(self, sb: str, attempt: str) -> str:
        """Where an attempt of SuperBatch ``sb`` lists the nulls it skipped (``on_null="skip"``)."""
        return f"{self.run_dir}/skipped/{sb}-{attempt}.parquet"

    def record_path(self, sb: str) -> str:
        return f"{self.commits_dir}/{sb}.json"

    def data_urls(self, records) -> list[str]:
        """Paths of ``records``' data files that any fsspec or Parquet reader opens."""
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        files = [f"{self.root}/{r.file}" for r in records]
        return files if proto in ("file", "local") else [f"{proto}://{f}" for f in files]

    def skipped_files(self, records) -> list[str]:
        """Paths of the skipped-null files that ``records`` name."""
        return [f"{self.run_dir}/skipped/{r.skipped_file}" for r in records if r.skipped]

    def commit(self, record: CommitRecord) -> bool:
        """Create the commit record of ``record.sb``; False if another attempt won."""
        return create_exclusive(self.fs, self.record_path(record.sb), record.to_json())

    def committed(self, *, repair: bool = False) -> dict[str, CommitRecord]:
        """Commit records by SuperBatch key, in data order. Torn or foreign records are skipped.

        With ``repair=True`` a torn record (unparseable, e.g. from a crash on a
        filesystem without atomic create) is renamed aside so its SuperBatch can
        be committed again.
        """
        out: dict[str, CommitRecord] = {}
        try:
            names = self.fs.ls(self.commits_dir, detail=False)
        except FileNotFoundError:
            return out
        for path in sorted(names):
            name = path.rsplit("/", 1)[-1]
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                with self.fs.open(path, "rb") as f:
                    rec = CommitRecord.from_json(f.read())
                if name != f"{rec.sb}.json" or rec.run != self.run_id:
                    continue
            except (ValueError, KeyError, TypeError, OSError):
                # torn record: that SuperBatch is not committed
                if repair:
                    self.fs.mv(path, f"{self.commits_dir}/.torn-{name}-{time.time_ns()}")
                continue
            out[rec.sb] = rec
        return out

    def coverage(self, records: dict[str, CommitRecord] | None = None) -> Coverage:
        """Which input rows the committed SuperBatches account for."""
        records = self.committed() if records is None else records
        return Coverage.of(r.spans for r in records.values())

    def mark_current(self) -> None:
        write_bytes_atomic(self.fs, current_path(self.root), self.run_id.encode())

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
        if self.fs.exists(self._stopped_path):
            self.fs.rm(self._stopped_path)

    def completion(self) -> dict | None:
        """The completion summary (rows, nulls skipped, SuperBatches) of a finished run, else None."""
        return _read_json(self.fs, self._complete_path)


def current_path(root: str) -> str:
    """Where an output directory names its current run."""
    return f"{root}/{META_DIR}/CURRENT"


def _read_json(fs, path: str) -> dict | None:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, NotADirectoryError):
        return None


def current_run(path: str, storage_options: dict | None = None) -> Manifest | None:
    """The run whose rows are current in the output directory ``path`` (or None)."""
    fs, root = url_to_fs(path, **(storage_options or {}))
    root = root.rstrip("/")
    try:
        with fs.open(current_path(root), "rb") as f:
            run_id = f.read().decode().strip()
    except FileNotFoundError:
        return None
    info = _read_json(fs, f"{root}/{META_DIR}/runs/{run_id}/run.json")
    if info is None:
        return None
    _check_version(info, root)
    return Manifest(fs, root, run_id, info["fingerprint"], info.get("plan", {}),
                    format_version=info["format_version"])


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


def find_run(path: str, fingerprint: dict, storage_options: dict | None = None) -> Manifest | None:
    """The run of ``fingerprint`` in ``path`` if it was ever created there (current or
    not), with what it recorded; None otherwise. Reads only the run's ``run.json``."""
    fs, root = url_to_fs(path, **(storage_options or {}))
    root = root.rstrip("/") or "/"
    run_id = fingerprint_digest(fingerprint)
    manifest = Manifest(fs, root, run_id, fingerprint)
    info = _read_json(fs, f"{manifest.run_dir}/run.json")
    if info is None or info.get("format_version") != FORMAT_VERSION:
        return None
    manifest.plan = info.get("plan", {})
    current = current_run(path, storage_options)
    if manifest.completion() is not None and (current is None or current.run_id != run_id):
        return None  # a complete run that another run replaced since: not ours to trust
    return manifest


def open_run(
    path: str, fingerprint: dict, *, overwrite: bool = False, storage_options: dict | None = None,
    plan_summary: dict | None = None,
) -> tuple[Manifest, bool]:
    """Open (resume) or create the run for ``fingerprint`` in output directory ``path``.

    Returns ``(manifest, resumed)``. ``manifest.plan`` is what the run recorded when it
    was created (``plan_summary``: its resolved thresholds, its partitions): a resumed
    run keeps them, whatever the cluster's shape is now. A directory holding a different current
    run is refused unless ``overwrite=True``; even then the old run's files stay
    until the new run completes (see :func:`finish_run`). A different run that
    stopped on an error before committing anything (e.g. a bad input) holds no
    data and is replaced; one that may still be running (no ``STOPPED`` marker)
    is not.

    Raises
    ------
    SurgeOutputError
        If ``path`` is a file, is not writable, holds another run (without
        ``overwrite``) or was written by a newer manifest format.
    """
    fs, root = url_to_fs(path, **(storage_options or {}))
    root = root.rstrip("/") or "/"
    if fs.exists(root) and not fs.isdir(root):
        raise SurgeOutputError(
            f"output={path!r} is a file; the output must be a directory (one Parquet file per "
            "SuperBatch plus a manifest). Fix: choose a new directory path."
        )
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
    info = _read_json(fs, f"{manifest.run_dir}/run.json")
    try:
        if info is None:
            fs.makedirs(manifest.commits_dir, exist_ok=True)
            manifest.plan = dict(plan_summary or {})
            body = {"format_version": FORMAT_VERSION, "run": run_id, "fingerprint": fingerprint,
                    "plan": manifest.plan, "created": time.time()}
            write_bytes_atomic(fs, f"{manifest.run_dir}/run.json",
                               json.dumps(body, sort_keys=True, default=str).encode())
        else:
            _check_version(info, root)
            manifest.plan = info.get("plan", {})
            manifest.clear_stopped()  # resumed
        if current is None or empty_other:
            manifest.mark_current()
    except OSError as err:
        raise SurgeOutputError(
            f"output={path!r} is not writable ({type(err).__name__}: {err}). Nothing was encoded. "
            "Fix: choose a directory you can create and write to."
        ) from err
    return manifest, info is not None


def finish_run(manifest: Manifest, committed: dict[str, CommitRecord], summary: dict) -> None:
    """Record the run as complete, make it current and delete other runs' files (after
    success only).

    ``committed`` is ``manifest.committed()`` as just read by the caller; ``summary``
    (rows, SuperBatches, nulls skipped) is kept in the run's ``COMPLETE`` marker, so a
    rerun of a complete run does nothing and :func:`dask_surge.status` reads it.
    """
    fs, root = manifest.fs, manifest.root
    write_bytes_atomic(fs, manifest._complete_path, json.dumps(summary, sort_keys=True).encode())
    manifest.mark_current()
    prefix = f"part-{manifest.run_id[:8]}-"
    keep = {rec.file for rec in committed.values()}
    for path in fs.ls(root, detail=False):
        name = path.rsplit("/", 1)[-1]
        if name.startswith("part-") and name.endswith(".parquet") and (not name.startswith(prefix) or name not in keep):
            fs.rm(path)
    keep_skipped = {rec.skipped_file for rec in committed.values()}
    try:
        for path in fs.ls(f"{manifest.run_dir}/skipped", detail=False):
            if path.rsplit("/", 1)[-1] not in keep_skipped:  # of attempts that lost the commit
                fs.rm(path)
    except FileNotFoundError:
        pass
    for run in fs.ls(f"{root}/{META_DIR}/runs", detail=False):
        if run.rstrip("/").rsplit("/", 1)[-1] != manifest.run_id:
            fs.rm(run, recursive=True)
