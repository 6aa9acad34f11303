"""The run manifest: fingerprint, commit records, resume. The only source of truth.

Layout of an output directory ``out/``::

    out/part-<run>-<sb>-<attempt>.parquet     one file per committed SuperBatch
    out/_surge/CURRENT                        id of the run whose rows are current
    out/_surge/runs/<run>/run.json            the run's fingerprint and plan summary
    out/_surge/runs/<run>/commits/<sb>.json   one commit record per SuperBatch

A run id is a digest of the fingerprint, so rerunning the same call finds its
own run and resumes it. A SuperBatch is committed when its record exists; the
record is created exclusively, so of two attempts of the same SuperBatch only
one wins. Data files without a record are orphans: readers and resume ignore
them. Parquet readers pointed at ``out/`` skip ``_surge`` (``_`` prefix) and the
``.``-prefixed temporary files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs

from .errors import SurgeOutputError

__all__ = ["FORMAT_VERSION", "Manifest", "fingerprint_digest", "open_run", "current_run", "finish_run"]

FORMAT_VERSION = 1
META_DIR = "_surge"


def fingerprint_digest(fingerprint: dict) -> str:
    """Stable 16-hex-digit id of a fingerprint (keys sorted, JSON-encoded)."""
    blob = json.dumps(fingerprint, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def write_bytes_atomic(fs, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name: fsync, then rename over."""
    parent, name = path.rsplit("/", 1)
    tmp = f"{parent}/.{name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        if _is_local(fs):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
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


def create_exclusive(fs, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist; True if we created it.

    Local files use ``O_CREAT | O_EXCL`` on a fully written temporary file
    (``os.link``), so a reader never sees a torn record. Other filesystems use
    their ``"xb"`` mode when they have one, else check-then-write.
    """
    if _is_local(fs):
        parent, name = path.rsplit("/", 1)
        tmp = f"{parent}/.{name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, fails if path exists
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        _fsync_dir(parent)
        return True
    if fs.exists(path):
        return False
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        return False
    except (ValueError, NotImplementedError):  # no exclusive mode on this filesystem
        with fs.open(path, "wb") as f:
            f.write(data)
    return True


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Manifest:
    """One run inside an output directory (see module docstring)."""

    fs: Any
    root: str
    run_id: str
    fingerprint: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)  # the run's plan summary (superbatches, rows, ...)

    @property
    def run_dir(self) -> str:
        return f"{self.root}/{META_DIR}/runs/{self.run_id}"

    @property
    def commits_dir(self) -> str:
        return f"{self.run_dir}/commits"

    def data_path(self, sb: int, attempt: str) -> str:
        return f"{self.root}/part-{self.run_id[:8]}-{sb:06d}-{attempt}.parquet"

    def skipped_path(self, sb: int, attempt: str) -> str:
        """Where an attempt of SuperBatch ``sb`` lists the nulls it skipped (``on_null="skip"``)."""
        return f"{self.run_dir}/skipped/{sb:06d}-{attempt}.parquet"

    def record_path(self, sb: int) -> str:
        return f"{self.commits_dir}/{sb:06d}.json"

    def commit(self, record: dict) -> bool:
        """Create the commit record of ``record["sb"]``; False if another attempt won."""
        data = json.dumps(record, sort_keys=True).encode()
        return create_exclusive(self.fs, self.record_path(record["sb"]), data)

    def committed(self, *, repair: bool = False) -> dict[int, dict]:
        """Commit records by SuperBatch index. Torn or foreign records are skipped.

        With ``repair=True`` a torn record (unparseable, e.g. from a crash on a
        filesystem without atomic create) is renamed aside so its SuperBatch can
        be committed again.
        """
        out: dict[int, dict] = {}
        try:
            names = self.fs.ls(self.commits_dir, detail=False)
        except FileNotFoundError:
            return out
        for path in names:
            name = path.rsplit("/", 1)[-1]
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                with self.fs.open(path, "rb") as f:
                    rec = json.loads(f.read())
                sb = int(rec["sb"])
                if name != f"{sb:06d}.json" or rec.get("run") != self.run_id:
                    continue
            except (ValueError, KeyError, TypeError, OSError):
                # torn record: that SuperBatch is not committed
                if repair:
                    self.fs.mv(path, f"{self.commits_dir}/.torn-{name}-{time.time_ns()}")
                continue
            out[sb] = rec
        return out

    def mark_current(self) -> None:
        write_bytes_atomic(self.fs, f"{self.root}/{META_DIR}/CURRENT", self.run_id.encode())

    @property
    def _stopped_path(self) -> str:
        return f"{self.run_dir}/STOPPED"

    def mark_stopped(self, why: str) -> None:
        """Record that this run's process stopped on an error (so a run that committed
        nothing may be replaced without ``overwrite``). Best effort: never raises."""
        try:
            write_bytes_atomic(self.fs, self._stopped_path, why.encode()[:2000])
        except OSError:
            pass

    def stopped(self) -> bool:
        """True when the last process of this run stopped on an error (and none resumed it)."""
        return self.fs.exists(self._stopped_path)

    def clear_stopped(self) -> None:
        if self.fs.exists(self._stopped_path):
            self.fs.rm(self._stopped_path)


def _read_json(fs, path: str) -> dict | None:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def current_run(path: str, storage_options: dict | None = None) -> Manifest | None:
    """The run whose rows are current in the output directory ``path`` (or None)."""
    fs, root = url_to_fs(path, **(storage_options or {}))
    root = root.rstrip("/")
    try:
        with fs.open(f"{root}/{META_DIR}/CURRENT", "rb") as f:
            run_id = f.read().decode().strip()
    except FileNotFoundError:
        return None
    info = _read_json(fs, f"{root}/{META_DIR}/runs/{run_id}/run.json")
    if info is None:
        return None
    _check_version(info, root)
    return Manifest(fs, root, run_id, info["fingerprint"], info.get("plan", {}))


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


def open_run(
    path: str, fingerprint: dict, *, overwrite: bool = False, storage_options: dict | None = None,
    plan_summary: dict | None = None,
) -> tuple[Manifest, bool]:
    """Open (resume) or create the run for ``fingerprint`` in output directory ``path``.

    Returns ``(manifest, resumed)``. A directory holding a different current
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
    other = current is not None and current.run_id != run_id
    empty_other = other and current.stopped() and not current.committed()
    if other and not overwrite and not empty_other:
        diff = "; ".join(_differences(current.fingerprint, fingerprint)) or "(format)"
        raise SurgeOutputError(
            f"output={path!r} already holds a different run ({diff}). Nothing was written. "
            "Fix: write to a new path, or pass overwrite=True (the old output is replaced "
            "only once the new run has completed)."
        )
    info = _read_json(fs, f"{manifest.run_dir}/run.json")
    try:
        if info is None:
            fs.makedirs(manifest.commits_dir, exist_ok=True)
            body = {"format_version": FORMAT_VERSION, "run": run_id, "fingerprint": fingerprint,
                    "plan": plan_summary or {}, "created": time.time()}
            write_bytes_atomic(fs, f"{manifest.run_dir}/run.json",
                               json.dumps(body, sort_keys=True, default=str).encode())
        else:
            _check_version(info, root)
            manifest.clear_stopped()  # resumed
        if current is None or empty_other:
            manifest.mark_current()
    except OSError as err:
        raise SurgeOutputError(
            f"output={path!r} is not writable ({type(err).__name__}: {err}). Nothing was encoded. "
            "Fix: choose a directory you can create and write to."
        ) from err
    return manifest, info is not None


def finish_run(manifest: Manifest, committed: dict[int, dict]) -> None:
    """Make ``manifest``'s run current and delete other runs' files (after success only).

    ``committed`` is ``manifest.committed()`` as just read by the caller.
    """
    fs, root = manifest.fs, manifest.root
    manifest.mark_current()
    prefix = f"part-{manifest.run_id[:8]}-"
    keep = {rec["file"] for rec in committed.values()}
    for path in fs.ls(root, detail=False):
        name = path.rsplit("/", 1)[-1]
        if name.startswith("part-") and name.endswith(".parquet") and (not name.startswith(prefix) or name not in keep):
            fs.rm(path)
    keep_skipped = {rec.get("skipped_file") for rec in committed.values()}
    try:
        for path in fs.ls(f"{manifest.run_dir}/skipped", detail=False):
            if path.rsplit("/", 1)[-1] not in keep_skipped:  # of attempts that lost the commit
                fs.rm(path)
    except FileNotFoundError:
        pass
    for run in fs.ls(f"{root}/{META_DIR}/runs", detail=False):
        if run.rstrip("/").rsplit("/", 1)[-1] != manifest.run_id:
            fs.rm(run, recursive=True)
