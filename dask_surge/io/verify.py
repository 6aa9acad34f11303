"""Checking and repairing an output: every committed file against its recorded checksum.

:func:`verify` reports (``dask-surge status --verify``); :func:`repair` brings a damaged
manifest back to a state a rerun can resume from (``--repair``). Neither deletes a file
that is not dask-surge's (:func:`dask_surge.io.directory.discard`).
"""

from __future__ import annotations

import hashlib

from ..errors import SurgeOutputError
from .directory import DATA_FILE, META_DIR, RUN_ID, attempt_of, current_path, discard, refuse_links, set_aside
from .lease import Claim
from .manifest import CommitRecord, Manifest, current_id, current_run, load_run, write_meta
from .store import OutputStore

__all__ = ["verify", "repair"]


def _problems(manifest: Manifest) -> list[tuple[CommitRecord, str]]:
    """Each committed file of ``manifest`` (data and skipped-null files) that is missing or whose
    sha256 differs from its record, with a line that says so."""
    problems = []
    for rec in manifest.committed().values():
        for name, digest, where in (
            (rec.file, rec.sha256, manifest.root),
            (rec.skipped_file, rec.skipped_sha256, f"{manifest.run_dir}/skipped"),
        ):
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
                problems.append(
                    (
                        rec,
                        f"{where}/{name}: sha256 {h.hexdigest()[:16]}... differs from the recorded "
                        f"{digest[:16]}... (SuperBatch {rec.sb})",
                    )
                )
    return problems


def verify(path: str | OutputStore, storage_options: dict | None = None) -> list[str]:
    """Check every committed file of the current run in ``path`` against its recorded
    ``sha256``; returns one line per problem (empty: all good). Files that are not committed but
    that readers of the directory would read as rows (``part-*`` globs, or the directory as a
    dataset) are named too: a data file of a replaced or killed run (``--repair`` deletes it), or
    a file dask-surge did not write (left as it is: not dask-surge's to delete).

    Examples
    --------
    >>> import tempfile
    >>> verify(tempfile.mkdtemp())
    []
    """
    store = path if isinstance(path, OutputStore) else OutputStore.open(path, storage_options)
    refuse_links(store)
    manifest = current_run(store)
    if manifest is None:
        return []
    strays = [
        f"{manifest.root}/{n}: a data file that no commit record of the current run names (left by a "
        "replaced or killed run; `part-*` readers would read its rows); --repair deletes it"
        for n in _strays(manifest)
    ]
    foreign = [
        f"{manifest.root}/{n}: a file dask-surge did not write, which readers of the output "
        f"({'`part-*` globs and ' if n.startswith('part-') else ''}the directory as a dataset) would read "
        "as rows; move it out of the output (--repair leaves it: it is not dask-surge's)"
        for n in _foreign(manifest)
    ]
    return [line for _, line in _problems(manifest)] + strays + foreign


def repair(path: str | OutputStore, storage_options: dict | None = None) -> list[str]:
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
    store = path if isinstance(path, OutputStore) else OutputStore.open(path, storage_options)
    root = store.root
    refuse_links(store)
    holder = Claim.holder(store)
    if holder is not None and Claim.alive(store, holder):
        raise SurgeOutputError(
            f"{store.location!r} is being written by a live run (run {holder.get('run')}, pid {holder.get('pid')} on "
            f"{holder.get('host')}): a repair now would take its commits in progress for damage and delete "
            "freshly published files. Nothing was changed. Fix: let that run finish (or stop it), then repair; "
            "a claim whose process died is passed over once its heartbeat is stale."
        )
    done: list[str] = []
    meta = f"{root}/{META_DIR}"

    def aside(p: str) -> None:
        set_aside(store, p)
        done.append(f"moved damaged {p} aside")

    def forget(manifest: Manifest, rec: CommitRecord, why: str) -> None:
        aside(manifest.record_path(rec.sb))
        discard(store, manifest.complete_path)
        done.append(
            f"forgot SuperBatch {rec.sb} of run {manifest.run_id}: {why}; a rerun encodes those rows again"
        )

    valid: dict[str, Manifest] = {}
    for run in [r for r in store.listdir(f"{meta}/runs") if RUN_ID.match(r)]:
        try:
            loaded = load_run(store, run)
        except SurgeOutputError:
            aside(f"{meta}/runs/{run}/run.json")
            continue
        if loaded is not None:
            valid[run] = loaded
    try:
        current = current_id(store)
    except SurgeOutputError:
        aside(current_path(root))
        current = None
    if current is not None and current not in valid:
        discard(store, current_path(root))
        done.append(f"removed {current_path(root)} (it named run {current}, which has no valid run.json)")
        current = None
    if current is None and len(valid) == 1:
        current = next(iter(valid))
        write_meta(store, current_path(root), current.encode())
        done.append(f"pointed {current_path(root)} at run {current}")
    for manifest in valid.values():
        before = {n for n in store.listdir(manifest.commits_dir) if n.startswith(".torn-")}
        records = manifest.committed(repair=True)
        done += [
            f"moved damaged commit record {n} aside"
            for n in {n for n in store.listdir(manifest.commits_dir) if n.startswith(".torn-")} - before
        ]
        try:
            manifest.completion()
        except SurgeOutputError:
            aside(manifest.complete_path)
        present, staged = set(store.listdir(root)), set(store.listdir(manifest.staging_dir))
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
            if store.exists(manifest.record_path(rec.sb)):  # a record with two bad files is forgotten once
                forget(manifest, rec, line)
        for name in _strays(manifest):
            discard(store, f"{root}/{name}")
            done.append(
                f"deleted {name}: a data file of this layout that no commit record of the current run "
                "names (left by a replaced or killed run)"
            )
    return done


def _strays(manifest: Manifest) -> list[str]:
    """Data files of this layout in the output that no commit record of ``manifest`` names
    (listed before the records are read, so a file published meanwhile is named)."""
    names = [n for n in manifest.store.listdir(manifest.root) if DATA_FILE.match(n)]
    named = {rec.file for rec in manifest.committed().values()}
    return [n for n in names if n not in named]


def _foreign(manifest: Manifest) -> list[str]:
    """Entries of the output that dask-surge did not write and that readers would take for data:
    anything but ``_``- or ``.``-prefixed names (which Parquet readers skip) and data files of this layout."""
    return [
        n
        for n in manifest.store.listdir(manifest.root)
        if not n.startswith(("_", ".")) and not DATA_FILE.match(n)
    ]
