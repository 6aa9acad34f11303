"""Checking and repairing an output: every committed file against its recorded checksum.

:func:`verify` reports (``dask-surge status --verify``); :func:`repair` brings a damaged
manifest back to a state a rerun can resume from (``--repair``). Neither deletes a file
that is not dask-surge's (:func:`dask_surge.io.directory.discard`).

A table output (``format="lance"``, ``"delta"``, ``"iceberg"``; :func:`table_format`) is checked
against the table's own history instead (:func:`table_problems`): every SuperBatch the manifest
records as committed is held by exactly one version of the run, the table's rows are the
manifest's plus those other writers appended, and every data file the current version references
is in the store. A table is never repaired (:func:`repair` refuses it): its history is the
table's, and what is wrong there is put right with the table's own tools or by a rerun.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from ..errors import SurgeError, SurgeOutputError
from .directory import DATA_FILE, META_DIR, RUN_ID, attempt_of, current_path, discard, refuse_links, set_aside
from .lease import Claim
from .manifest import CommitRecord, Manifest, current_id, current_run, load_run, write_meta
from .store import OutputStore
from .tables import detect_output, open_output, output_class, output_store

__all__ = ["verify", "repair", "table_format", "table_problems", "table_summary"]


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
    store = path if isinstance(path, OutputStore) else output_store(path, storage_options)
    refuse_links(store)
    manifest = current_run(store)
    if manifest is None:
        return []
    fmt = table_format(store, manifest.committed().values())
    if fmt is not None:
        return table_problems(manifest, fmt)
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
    store = path if isinstance(path, OutputStore) else output_store(path, storage_options)
    root = store.root
    refuse_links(store)
    fmt = table_format(store)
    if fmt is not None:
        raise SurgeOutputError(
            f"{store.location!r} is a {fmt} table output: its rows and their history are the table's, which a "
            "repair does not rewrite (it would have to delete committed table versions or rows). Nothing was "
            "changed. Fix: `dask-surge status --verify` names what is wrong; rerunning the same encode call "
            "commits SuperBatches the table lacks (and sets damaged commit records aside); put other damage "
            f"right with the {fmt} library (restore the table to a good version), or encode to a new path."
        )
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


# -- table outputs ----------------------------------------------------------------------------------


def table_format(store: OutputStore, records: Iterable[CommitRecord] | None = None) -> str | None:
    """The table format of the output in ``store``, or None for an output whose SuperBatches are its
    commits (Parquet): :func:`~dask_surge.io.tables.detect_output` (from the commit records
    ``records`` when given).

    Examples
    --------
    >>> import tempfile
    >>> table_format(OutputStore.open(tempfile.mkdtemp())) is None
    True
    """
    fmt = detect_output(store, records)
    return fmt if output_class(fmt).batched else None


def _open(store: OutputStore, fmt: str) -> Any:
    return open_output(fmt, store)


def table_summary(store: OutputStore, fmt: str, run_id: str) -> dict:
    """What the table of a table output holds, for :func:`dask_surge.status`: its ``format``, ``versions``
    (how many), ``version`` (the latest, as the table's library numbers it: Delta's from 0, Iceberg's the
    snapshot's sequence number; None: no table yet), ``rows`` (now), ``run_versions`` (those of run ``run_id``) and
    ``last_commit`` (epoch seconds of the latest version; None: no table yet). A table that cannot be read
    says so in ``error``."""
    out: dict[str, Any] = {"format": fmt}
    try:
        table = _open(store, fmt)
        versions = table.version_rows()
        history = table.history(run_id)
    except (SurgeError, OSError, ValueError) as err:
        out["error"] = str(err)
        return out
    out.update(
        versions=len(versions),
        version=table.library_version(versions[-1][0])
        if versions
        else None,  # as the table's library numbers it
        rows=versions[-1][2] if versions else 0,
        run_versions=len(history.ops),
        last_commit=versions[-1][1] if versions else None,
    )
    return out


def _relative(uri: str, table_uri: str) -> str:
    """A data file's path relative to the table, when it lies under it (else the URI as given)."""
    plain = uri[len("file://") :] if uri.startswith("file://") else uri
    root = table_uri[len("file://") :] if table_uri.startswith("file://") else table_uri
    root = root.rstrip("/")
    return plain[len(root) + 1 :] if plain.startswith(root + "/") else plain


def table_problems(manifest: Manifest, fmt: str) -> list[str]:
    """What is wrong with the table of a table output, one line each (empty: all good).

    Checks that every SuperBatch the manifest records as committed is held by exactly one version of the
    run (and that the run's versions hold no SuperBatch the manifest does not record), that the table's
    rows now are the manifest's committed rows plus the rows other writers' versions added, and that every
    data file the latest version references is in the store with the size the table records (Lance: and
    ``LanceDataset.validate``).
    """
    store = manifest.store
    table = _open(store, fmt)
    where = f"the {fmt} table {table.location.url!r}"
    committed = manifest.committed()
    rerun = (
        "Fix: rerun the same encode call (a resume commits the SuperBatches whose commit records exist but "
        "which no table version holds; a run still writing commits them with its next batch)."
    )
    history = table.history(manifest.run_id)
    if not history.exists:
        if not committed:
            return []
        return [
            f"{where} does not exist, but the manifest records {len(committed)} committed SuperBatch(es). {rerun}"
        ]
    problems = []
    versions = table.version_rows()
    # versions before the first one listed were cleaned up (Lance cleanup_old_versions, Delta log
    # clean-up, Iceberg expire_snapshots): what they held cannot be named, only counted
    cut = versions[0][0] if versions and versions[0][0] > 1 else None
    missing = sorted(sb for sb in committed if sb not in history.ours)
    if missing and cut is None:
        problems.append(
            f"{len(missing)} SuperBatch(es) the manifest records as committed are in no version of {where} "
            f"(their rows are not in the table): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. "
            + rerun
        )
    for sb, holders in sorted(history.held.items()):
        if len(holders) > 1:  # the rows the table holds now are counted below: say only what the history says
            problems.append(
                f"SuperBatch {sb} of run {manifest.run_id} is committed by {len(holders)} versions of {where} "
                f"({', '.join(table.describe_version(v) for v in holders)}; a commit of a process whose claim was taken "
                "over, by a dask-surge before the fenced commits). Fix: rerun the same encode call: its start "
                "repairs the table (the second copy's rows are removed, and the repair is recorded in the "
                "table's history)."
            )
    unknown = sorted(sb for sb in history.ours if sb not in committed)
    if unknown:
        problems.append(
            f"versions of {where} hold SuperBatch(es) of run {manifest.run_id} that its manifest does not "
            f"record as committed: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} (a damaged or "
            "replaced manifest?). Fix: check those rows with the table library; the table, not the manifest, "
            "is what readers see."
        )
    added: dict[int, int] = {}
    before = 0
    for version, _, rows in versions:
        # the rows a version added (the first one listed, after a clean-up: not known)
        added[version], before = (0 if version == cut else rows - before), rows
    first = min(history.ops) if history.ops else None
    foreign_rows = 0
    for version, op, run in history.foreign:
        if first is None or version < first or table.keeps_rows(op):
            foreign_rows += added.get(version, 0)
        else:
            who = f"dask-surge run {run}" if run else "another writer"
            problems.append(
                f"{table.describe_version(version)} of {where} ({op}, by {who}) came after this run's commits and may "
                "have removed or changed its rows. Fix: if that change was meant, the table is as that writer "
                f"left it; else restore the table to the one before it with the {fmt} library."
            )
    ours = sum(_out_rows(rec) for rec in committed.values())
    now = versions[-1][2] if versions else 0
    if now != ours + foreign_rows:
        diff = now - ours - foreign_rows
        problems.append(
            f"{where} holds {now:,} rows, but the manifest records {ours:,} committed by run {manifest.run_id}"
            + (f" and other writers' versions added {foreign_rows:,}" if foreign_rows else "")
            + f": {abs(diff):,} {'more' if diff > 0 else 'fewer'} than expected"
            + (
                f" (its versions before {table.describe_version(cut)} were cleaned up, so rows other writers added then "
                "are not known, "
                f"nor which of the run's {len(missing)} SuperBatch(es) not in a version listed now they held)"
                if cut is not None
                else ""
            )
            + ". Fix: see the other lines; a table that lost rows is restored to a good version with the table "
            "library, or encoded again to a new path."
        )
    problems += _file_problems(table, where, fmt)
    return problems


def _rows_of(rec: CommitRecord | None) -> str:
    return f"{_out_rows(rec):,} " if rec is not None else ""


def _out_rows(rec: CommitRecord) -> int:
    """The rows a SuperBatch put into the table (``output_rows``; 0 means ``rows``)."""
    return rec.output_rows or rec.rows


def _file_problems(table: Any, where: str, fmt: str) -> list[str]:
    """Data files the latest version references that are missing or of another size than recorded."""
    store = table.location.store()
    problems = []
    for path, size in table.data_files():
        rel = _relative(path, table.location.uri)
        full = f"{store.root}/{rel}" if "://" not in rel and not rel.startswith("/") else rel
        try:
            actual = store.fs.info(full).get("size")
        except FileNotFoundError:
            problems.append(
                f"{full}: a data file the latest version of {where} references is missing (reading the table "
                f"fails). Fix: restore the file from a backup, or restore the table with the {fmt} library to a "
                "version that does not reference it and rerun the same encode call."
            )
            continue
        if size is not None and actual is not None and int(actual) != size:
            problems.append(
                f"{full}: {int(actual):,} bytes, but {where} records {size:,} (the file was changed or "
                "truncated). Fix: restore the file from a backup, or encode to a new path."
            )
    if not problems:  # the table library's own check, where it has one
        problems += [
            f"{where}: {found}. Fix: restore the table to a good version with the {fmt} library, or encode to "
            "a new path."
            for found in table.validate()
        ]
    return problems
