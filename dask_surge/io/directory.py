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
through a symbolic link (:func:`refuse_links`, :mod:`dask_surge.io.atomic`).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import time

from ..errors import SurgeOutputError
from .atomic import LinkRefused, links_below, listdir, remove_tree, rename, unlink, write_atomic

__all__ = ["META_DIR", "owned", "discard", "relocate", "refuse_links", "write_bytes_atomic", "create_exclusive",
           "sb_key", "index_dir", "current_path", "LinkRefused"]


META_DIR = "_surge"


_RUN_ID = re.compile(r"^[0-9a-f]{16}$")


_SB = r"\d{9}-\d{12}"


_DATA_FILE = re.compile(rf"^part-(?P<run>[0-9a-f]{{8}})-(?P<sb>{_SB})-(?P<attempt>[0-9a-f]{{8}})\.parquet$")


_SIDE_FILE = re.compile(rf"^(?P<sb>{_SB})-(?P<attempt>[0-9a-f]{{8}})\.parquet$")


_RUN = r"[0-9a-f]{16}"


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


def attempt_of(name: str) -> str:
    """The attempt a data file's name carries (``""`` for a name not of this layout).

    Examples
    --------
    >>> attempt_of("part-0123abcd-000000000-000000000000-89abcdef.parquet")
    '89abcdef'
    """
    m = _DATA_FILE.match(name)
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


def _corrupt(path: str, err: Exception) -> SurgeOutputError:
    root = path.split(f"/{META_DIR}/", 1)[0]
    return SurgeOutputError(
        f"{path!r} is damaged ({type(err).__name__}: {err}); it is part of the dask-surge manifest of "
        f"{root!r} (a crash or a full disk while it was written?). Nothing was changed. Fix: run "
        f"`dask-surge status --repair {root}` (or dask_surge.io.verify.repair(...)), then rerun the same call."
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


def index_dir(root: str, run_id: str) -> str:
    """Where the reuse index (:mod:`dask_surge.io.reuse`) of run ``run_id`` of the output ``root`` lives."""
    return f"{root}/{META_DIR}/index/{run_id}"


def current_path(root: str) -> str:
    """Where an output directory names its current run."""
    return f"{root}/{META_DIR}/CURRENT"


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
