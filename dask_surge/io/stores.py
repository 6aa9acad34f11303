"""Where an output can live: the filesystems whose commit protocol holds, proven before a write.

Local and shared POSIX filesystems (:data:`LOCAL_PROTOCOLS`) commit with a temporary name,
fsync and rename; object stores (:data:`STORE_PROTOCOLS`) with one PUT per file and
conditional PUTs (``If-None-Match: *``) for exclusive creates, where the installed fsspec
filesystem offers them, proven on the store itself before the first write (:func:`check_store`).
:func:`check_output` refuses a location a run could not own.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

from fsspec.core import url_to_fs

from ..errors import SurgeOutputError
from .atomic import is_local, protocols
from .directory import _DATA_FILE, META_DIR, _ls, create_exclusive, discard, refuse_links

__all__ = ["LOCAL_PROTOCOLS", "STORE_PROTOCOLS", "output_fs", "check_writable_store", "check_store", "check_output"]


#: filesystems whose rename and exclusive create the commit protocol relies on (tested)
LOCAL_PROTOCOLS = ("file", "local", "memory")


#: object stores written with one PUT per file and conditional PUTs for exclusive creates,
#: where the installed fsspec filesystem offers them (proven on the store by :func:`check_store`)
STORE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "abfs", "az")


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
