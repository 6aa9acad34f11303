"""The output directory: every path a run writes, and the one way a run deletes or moves.

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
    out/_surge/index/<run>/                      the reuse index of a run (:mod:`dask_surge.io.reuse`)

``<sb>`` is :func:`sb_key` of the SuperBatch's first row. :data:`_OWNED` states these names
once: a run deletes and moves nothing else (:func:`discard`, :func:`relocate`), and never
through a symbolic link (:func:`refuse_links`, :class:`~dask_surge.io.store.OutputStore`).
:func:`check_output` refuses a location a run could not own, before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from ..errors import SurgeOutputError
from .store import LinkRefused, OutputStore

__all__ = [
    "META_DIR",
    "DATA_FILE",
    "SIDE_FILE",
    "RUN_ID",
    "SB_PATTERN",
    "owned",
    "discard",
    "relocate",
    "discard_tree",
    "set_aside",
    "refuse_links",
    "read_json",
    "corrupt",
    "check_output",
    "sb_key",
    "attempt_of",
    "index_dir",
    "current_path",
    "LinkRefused",
]


META_DIR = "_surge"


#: a run's id: 16 hex digits of its fingerprint's digest
RUN_ID = re.compile(r"^[0-9a-f]{16}$")


#: a SuperBatch key (:func:`sb_key`), as a pattern
SB_PATTERN = r"\d{9}-\d{12}"


#: a published data file: ``part-<run[:8]>-<sb>-<attempt>.parquet``
DATA_FILE = re.compile(
    rf"^part-(?P<run>[0-9a-f]{{8}})-(?P<sb>{SB_PATTERN})-(?P<attempt>[0-9a-f]{{8}})\.parquet$"
)


#: a staged or skipped-null file: ``<sb>-<attempt>.parquet``
SIDE_FILE = re.compile(rf"^(?P<sb>{SB_PATTERN})-(?P<attempt>[0-9a-f]{{8}})\.parquet$")


_RUN = r"[0-9a-f]{16}"
_SB = SB_PATTERN


#: what this layout writes, relative to the output root: the only names a run deletes or moves
_OWNED = re.compile(
    rf"^(?:part-[0-9a-f]{{8}}-{_SB}-[0-9a-f]{{8}}\.parquet"
    rf"|{META_DIR}/(?:CURRENT|CLAIM|\.heartbeat-[0-9a-f]{{32}}|\.stale-claim-\d+|\.takeover-[0-9a-f]{{32}}-\d+"
    rf"|\.probe-[0-9a-f]{{32}}|\.clock-[0-9a-f]{{32}}|\.reach-[0-9a-f]{{32}}(?:-\d+)?)"
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


def _check_owned(store: OutputStore, path: str) -> None:
    base = store.root.rstrip("/") + "/"
    if not path.startswith(base) or not owned(path[len(base) :]):
        raise SurgeOutputError(
            f"refusing to delete or move {path!r}: it is not a file dask-surge writes in the output "
            f"{store.root!r} (a run deletes and moves only its own files). Nothing was changed. This is a bug: "
            "please report it."
        )


def discard(store: OutputStore, path: str) -> bool:
    """Delete ``path``, a file of this layout below the output's root; False if it was not there.

    Every delete of the package goes through here: a name the layout does not write is
    refused, and so is a path through a symbolic link below the root
    (:meth:`~dask_surge.io.store.OutputStore.unlink`).
    """
    _check_owned(store, path)
    return store.unlink(path)


def relocate(store: OutputStore, src: str, dst: str) -> None:
    """Move ``src`` to ``dst``, both of this layout below the output's root (FileNotFoundError when
    ``src`` is gone). Every move of the package goes through here (see :func:`discard`)."""
    _check_owned(store, src)
    _check_owned(store, dst)
    store.rename(src, dst)


def discard_tree(store: OutputStore, path: str) -> list[str]:
    """Delete the files of this layout below ``path``, then the directories left empty;
    returns what was left (anything else, links included)."""
    _check_owned(store, path)
    return store.remove_tree(path, owned)


def set_aside(store: OutputStore, path: str) -> str:
    """Rename a damaged manifest file to ``.torn-<name>-<ns>`` beside it; returns the new path."""
    parent, name = path.rsplit("/", 1)
    new = f"{parent}/.torn-{name}-{time.time_ns()}"
    relocate(store, path, new)
    return new


def attempt_of(name: str) -> str:
    """The attempt a data file's name carries (``""`` for a name not of this layout).

    Examples
    --------
    >>> attempt_of("part-0123abcd-000000000-000000000000-89abcdef.parquet")
    '89abcdef'
    """
    m = DATA_FILE.match(name)
    return m.group("attempt") if m else ""


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


def corrupt(path: str, err: Exception) -> SurgeOutputError:
    """The error for a damaged manifest file ``path``: what it is, and the repair that fixes it."""
    root = path.split(f"/{META_DIR}/", 1)[0]
    return SurgeOutputError(
        f"{path!r} is damaged ({type(err).__name__}: {err}); it is part of the dask-surge manifest of "
        f"{root!r} (a crash or a full disk while it was written?). Nothing was changed. Fix: run "
        f"`dask-surge status --repair {root}` (or dask_surge.io.verify.repair(...)), then rerun the same call."
    )


def read_json(store: OutputStore, path: str) -> dict | None:
    """The JSON object in ``path``; None when it does not exist; a clear error when it is damaged."""
    try:
        data = store.read(path)  # one GET on a store
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        out = json.loads(data)
        if not isinstance(out, dict):
            raise ValueError(f"a JSON object was expected, found {type(out).__name__}")
    except ValueError as err:
        raise corrupt(path, err) from err
    return out


def index_dir(root: str, run_id: str) -> str:
    """Where the reuse index (:mod:`dask_surge.io.reuse`) of run ``run_id`` of the output ``root`` lives."""
    return f"{root}/{META_DIR}/index/{run_id}"


def current_path(root: str) -> str:
    """Where an output directory names its current run."""
    return f"{root}/{META_DIR}/CURRENT"


def refuse_links(store: OutputStore) -> None:
    """Raise :class:`LinkRefused` when anything under the output's ``_surge/`` is a symbolic
    link: a run moves and deletes files there, and never follows a link out of its output.
    One ``lstat`` walk of ``_surge/``, at the start and the end of a run (local filesystems)."""
    root = store.root
    found = store.links_below(f"{root}/{META_DIR}")
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


def check_output(
    store: OutputStore, *, inputs: Sequence[tuple[Any, str]] = (), contents: bool = True
) -> None:
    """Refuse an output location that a run could not own (before anything is written).

    The output must be a directory, not under a regular file, neither inside nor around one
    of the input's files or directories (compared in canonical form:
    :meth:`~dask_surge.io.store.OutputStore.contains`, so ``in//emb`` or a path through a link
    is the same place), and either new, empty, or holding only dask-surge's own files
    (``_surge/`` and data files named by this layout; ``.``-prefixed entries, and an object
    store's zero-byte "folder marker", are left alone). A run never deletes, overwrites or reads
    as output a file it did not write.

    Parameters
    ----------
    store : OutputStore
        The output (:meth:`~dask_surge.io.store.OutputStore.open` with ``writing=True``).
    inputs : sequence of (filesystem, str)
        The input's files, directories and globs, each with its fsspec filesystem
        (:func:`dask_surge.execution.inputs.input_files`): none may be inside the output, nor
        the output inside a directory among them.
    contents : bool
        Also refuse a directory holding entries dask-surge did not write (a Parquet output); a
        table output's own entries are the table's to judge
        (:func:`dask_surge.execution.tables.check_table_output`).

    Raises
    ------
    SurgeOutputError
        Naming the location, the rule and the fix.

    Examples
    --------
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> check_output(OutputStore.open(d))  # empty: fine
    >>> open(os.path.join(d, "part-00000.parquet"), "w").close()
    >>> check_output(OutputStore.open(d))
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeOutputError: output=... holds 1 entry that dask-surge did not write ('part-00000.parquet'); ...
    """
    path, root = store.location, store.root
    try:
        ancestor = root
        while ancestor not in ("", "/") and not store.exists(ancestor):
            ancestor = ancestor.rsplit("/", 1)[0] if "/" in ancestor else ""
        is_file = ancestor not in ("", "/") and not store.isdir(ancestor)
    except Exception as err:  # a permission error, or a store client's own (botocore's, no endpoint)
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
    for fs, directory in _input_dirs(inputs):
        if store.within(directory, fs):
            where = "" if store.contains(directory, fs) else "inside "
            raise SurgeOutputError(
                f"output={path!r} is {where}the input directory {directory!r}: a run never writes into its input "
                "(the rerun that resumes it would read the embedding files as input, and they would pollute the "
                f"dataset). Nothing was written. Fix: write beside the input, e.g. "
                f"{directory.rstrip('/') + '-embeddings'!r}."
            )
    inside = [p for fs, p in inputs if store.contains(p, fs)]
    if inside:
        raise SurgeOutputError(
            f"output={path!r} holds input file {inside[0]!r} ({len(inside)} input file(s) in all): a run "
            "never writes into its input. Nothing was written. Fix: choose another directory for the output, "
            f"e.g. {store.location.rstrip('/') + '-embeddings'!r}."
        )
    if ancestor != root or not contents:
        return
    refuse_links(store)
    names = store.listdir(root)
    ours = META_DIR in names
    foreign = [
        n for n in names if not n.startswith(".") and n != META_DIR and not (ours and DATA_FILE.match(n))
    ]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise SurgeOutputError(
            f"output={path!r} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} that dask-surge did "
            f"not write ({shown}); a run never deletes, overwrites or mixes in files it does not own, and "
            "readers of the output would read those as rows. Nothing was written. Fix: write to a new or "
            f"empty directory, e.g. {store.location.rstrip('/') + '/embeddings'!r}."
        )


def _input_dirs(inputs: Sequence[tuple[Any, str]]) -> list[tuple[Any, str]]:
    """Each input path, a glob cut to its fixed directory (``in/*.parquet`` reads ``in``): an
    output at or below one of them is inside an input directory. A path that names an existing
    file or directory is taken as it is, glob characters and all (``in[1]`` is a name)."""
    dirs = []
    for fs, p in inputs:
        exists = False
        with contextlib.suppress(Exception):
            exists = bool(fs.exists(p))
        cut = -1 if exists else min((i for i, c in enumerate(p) if c in "*?["), default=-1)
        d = p if cut < 0 else p[:cut].rsplit("/", 1)[0] if "/" in p[:cut] else ""
        if d.strip("/"):
            dirs.append((fs, d))
    return dirs
