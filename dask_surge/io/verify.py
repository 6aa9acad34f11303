"""Checking and repairing an output: every committed file against its recorded checksum.

:func:`verify` reports (``dask-surge status --verify``); :func:`repair` brings a damaged
manifest back to a state a rerun can resume from (``--repair``). Neither deletes a file
that is not dask-surge's (:func:`dask_surge.io.directory.discard`).
"""

from __future__ import annotations

import hashlib

from ..errors import SurgeOutputError
from .directory import (
    _DATA_FILE,
    _RUN_ID,
    META_DIR,
    _aside,
    _ls,
    attempt_of,
    current_path,
    discard,
    refuse_links,
)
from .lease import Claim
from .manifest import CommitRecord, Manifest, _current_id, _load, _write_meta, current_run
from .stores import output_fs

__all__ = ["verify", "repair"]


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
    fs, root = output_fs(path, storage_options)
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
    at the one run left, or removed. A directory a live run is writing (its claim's
    heartbeat is fresh) is refused, naming that run: what looks damaged there is a commit in
    progress.

    Examples
    --------
    >>> import tempfile
    >>> repair(tempfile.mkdtemp())
    []
    """
    fs, root = output_fs(path, storage_options)
    refuse_links(fs, root)
    holder = Claim.holder(fs, root)
    if holder is not None and Claim.alive(fs, root, holder):
        raise SurgeOutputError(
            f"{path!r} is being written by a live run (run {holder.get('run')}, pid {holder.get('pid')} on "
            f"{holder.get('host')}): a repair now would take its commits in progress for damage and delete "
            "freshly published files. Nothing was changed. Fix: let that run finish (or stop it), then repair; "
            "a claim whose process died is passed over once its heartbeat is stale."
        )
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
            attempt = attempt_of(rec.file)
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
