"""File operations on an output: atomic writes, exclusive creates, and links never followed.

Every write of dask-surge's output goes through :func:`write_atomic` (a reader never sees a
partial file; with ``exclusive=True`` of two writers of one path only one wins), and every
delete and move through :func:`unlink` and :func:`rename`, which the manifest
(:mod:`dask_surge.io.manifest`) calls once it has checked that the names are its own.

On a local or shared POSIX filesystem a path below the output root is reached one directory
at a time from a descriptor of the root, each opened with ``O_NOFOLLOW``: a symbolic link
anywhere below the root (a ``staging/`` pointed at scratch space, say) is refused with a
:class:`LinkRefused`, never followed, so a delete or a move cannot reach outside the output.
The root itself may be a link: it is the user's choice of where the output lives. Object
stores have no links: there the operations act on the key as named.

Examples
--------
>>> import os, tempfile, fsspec
>>> fs, root = fsspec.filesystem("file"), tempfile.mkdtemp()
>>> write_atomic(fs, f"{root}/a", b"1"), write_atomic(fs, f"{root}/a", b"2", exclusive=True)
(True, False)
>>> os.mkdir(f"{root}/elsewhere"); os.symlink(f"{root}/elsewhere", f"{root}/link")
>>> unlink(fs, root, f"{root}/link/a")
Traceback (most recent call last):
...
dask_surge.io.atomic.LinkRefused: ... is a symbolic link ...
>>> unlink(fs, root, f"{root}/a"), unlink(fs, root, f"{root}/a")
(True, False)
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import SurgeOutputError

__all__ = ["LinkRefused", "is_local", "protocols", "write_atomic", "listdir", "unlink", "rename", "remove_tree",
           "links_below", "file_signature"]


class LinkRefused(SurgeOutputError):
    """A path below an output's root goes through a symbolic link, which dask-surge never follows."""


def protocols(fs: Any) -> tuple[str, ...]:
    """The protocol names of an fsspec filesystem, as a tuple."""
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_local(fs: Any) -> bool:
    """True for the local (and shared POSIX) filesystem, where links, renames and fsync exist."""
    return "file" in protocols(fs) or "local" in protocols(fs)


def _fsync_dir(path: str | None = None, *, fd: int | None = None) -> None:
    try:
        own = fd is None
        if fd is None:
            fd = os.open(path or ".", os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        if own:
            os.close(fd)


def write_atomic(fs: Any, path: str, data: builtins.bytes | memoryview, *, exclusive: bool = False) -> bool:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file.

    Local files are written to a temporary name beside ``path``, fsynced, then renamed over
    ``path`` (or, with ``exclusive=True``, hard-linked to it, which fails if ``path``
    exists), and the directory is fsynced. An object store writes one PUT (atomic there);
    with ``exclusive=True`` a conditional one (``If-None-Match: *``, fsspec's
    ``mode="create"``), which the store refuses when the key exists. The in-memory
    filesystem (one process) checks, writes a temporary key and moves it. On any failure
    the temporary file is removed.

    Returns
    -------
    bool
        False only when ``exclusive`` and ``path`` already existed.
    """
    if not is_local(fs) and "memory" not in protocols(fs):
        return _put(fs, path, bytes(data), exclusive)
    parent, name = path.rsplit("/", 1)
    tmp = f"{parent}/.{name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        if is_local(fs):
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
            if exclusive and fs.exists(path):  # one process: no other writer between check and move
                return False
            with fs.open(tmp, "wb") as f:
                f.write(data)
            fs.mv(tmp, path)
    except BaseException:
        # disk full, killed write, ...: leave no partial file behind
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise
    return True


def _put(fs: Any, path: str, data: bytes, exclusive: bool) -> bool:
    """One PUT of ``data`` at ``path`` on an object store; conditional when ``exclusive``."""
    if not exclusive:
        fs.pipe_file(path, data)
        return True
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except OSError as err:  # s3fs raises PermissionError/OSError for some 412 Precondition Failed answers
        if "PreconditionFailed" in str(err) or "412" in str(err) or "At least one of the pre-conditions" in str(err):
            return False
        raise
    return True


#: what an object store's ``info`` says of a key that changes when the key is written again
_STORE_SIGNATURE = ("size", "ETag", "etag", "LastModified", "last_modified", "mtime", "generation", "md5Hash",
                    "created", "version_id", "VersionId")


def file_signature(fs: Any, path: str) -> tuple:
    """What changes whenever the file ``path`` is written: its size, modification and change
    times and inode on a local or shared filesystem (one ``stat``), its ETag, size and time on an
    object store (one HEAD, never from a cache). A memo of a file checked once is valid while
    this stays the same (:class:`dask_surge.io.reuse.ReuseIndex`).

    Examples
    --------
    >>> import fsspec, tempfile, os
    >>> fs, path = fsspec.filesystem("file"), os.path.join(tempfile.mkdtemp(), "f")
    >>> _ = write_atomic(fs, path, b"one")
    >>> before = file_signature(fs, path)
    >>> _ = write_atomic(fs, path, b"two")
    >>> file_signature(fs, path) != before
    True
    """
    if is_local(fs):
        st = os.stat(path)
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    with contextlib.suppress(AttributeError, TypeError):
        fs.invalidate_cache(path)
    info = fs.info(path)
    return tuple((key, str(info[key])) for key in _STORE_SIGNATURE if key in info)


def listdir(fs: Any, path: str) -> list[str]:
    """Names in ``path`` (fresh: never from a listing cache); [] when it does not exist."""
    with contextlib.suppress(AttributeError, TypeError):
        fs.invalidate_cache(path)
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _parts(root: str, path: str) -> list[str]:
    """``path``'s components below ``root``; a :class:`SurgeOutputError` if it is not below it."""
    base = root.rstrip("/") + "/"
    rel = path[len(base):] if path.startswith(base) else None
    parts = rel.split("/") if rel else []
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise SurgeOutputError(f"{path!r} is not a path below the output {root!r}; dask-surge deletes and moves only "
                               "inside its output. This is a bug: please report it.")
    return parts


def _refused(root: str, parts: list[str], depth: int) -> LinkRefused:
    where = f"{root.rstrip('/')}/{'/'.join(parts[:depth + 1])}"
    target = ""
    with contextlib.suppress(OSError):
        target = f" -> {os.readlink(where)!r}"
    return LinkRefused(
        f"{where!r}{target} is a symbolic link (or not a directory) inside the output {root!r}. dask-surge never "
        "follows a link inside its output: a run deletes and moves files there, and must not reach what the link "
        f"points to. Nothing was deleted or moved through it. Fix: remove the link (`rm {where}` removes the link "
        "only, not its target) and rerun; to put the output on another disk, point the output path itself there."
    )


@contextlib.contextmanager
def _parent_fd(root: str, parts: list[str]) -> Iterator[int]:
    """A descriptor of the directory holding ``root/parts``, reached without following a link below ``root``."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth, name in enumerate(parts[:-1]):
            try:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise _refused(root, parts, depth) from err
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def unlink(fs: Any, root: str, path: str) -> bool:
    """Delete the file ``path`` below ``root`` without following any link; False if it was not there.

    A directory, or a link below ``root`` on the way, is refused (:class:`LinkRefused`);
    ``path`` itself, if a link, is removed as a link (its target is not touched).
    """
    parts = _parts(root, path)
    if not is_local(fs):
        try:
            fs.rm_file(path) if hasattr(fs, "rm_file") else fs.rm(path)
        except FileNotFoundError:
            return False
        return True
    try:
        with _parent_fd(root, parts) as fd:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise SurgeOutputError(f"{path!r} is a directory where dask-surge expects one of its files; it is "
                                       "left as it is. Fix: move it out of the output.")
            os.unlink(parts[-1], dir_fd=fd)
    except FileNotFoundError:
        return False
    return True


def rename(fs: Any, root: str, src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` (both below ``root``) atomically where the filesystem can, never
    through a link; raises FileNotFoundError when ``src`` is gone.

    On an object store a move is a copy then a delete (not atomic): the manifest only moves
    what no reader relies on yet, or what a retry may move again.
    """
    sparts, dparts = _parts(root, src), _parts(root, dst)
    if "memory" in protocols(fs):
        if not fs.exists(src):
            raise FileNotFoundError(src)
        fs.mv(src, dst, recursive=fs.isdir(src))
        return
    if not is_local(fs):  # a file: one server-side copy (FileNotFoundError when src is gone), one delete
        fs.cp_file(src, dst)
        fs.rm_file(src)
        return
    with _parent_fd(root, sparts) as sfd, _parent_fd(root, dparts) as dfd:
        os.rename(sparts[-1], dparts[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
        _fsync_dir(fd=dfd)


def remove_tree(fs: Any, root: str, path: str, owned: Callable[[str], bool]) -> list[str]:
    """Delete the files below ``path`` (itself below ``root``) for which ``owned(relative path)``
    holds, then the directories left empty; returns what it left (relative paths).

    Never follows a link (a link is left where it is, and so is its target) and never
    deletes a file ``owned`` does not claim, so a directory holding anything else stays.
    """
    parts = _parts(root, path)
    base = root.rstrip("/") + "/"
    left: list[str] = []
    if not is_local(fs):
        with contextlib.suppress(AttributeError, TypeError):
            fs.invalidate_cache(path)
        try:
            found = fs.find(path)
        except FileNotFoundError:
            return []
        for key in found:
            rel = key[len(base):] if key.startswith(base) else key
            if owned(rel):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(key)
            else:
                left.append(rel)
        return left

    def sweep(pfd: int, name: str, rel: str) -> bool:  # True when the directory ``name`` in ``pfd`` is gone
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
        try:
            empty = walk(fd, rel)
        finally:
            os.close(fd)
        if empty:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=pfd)
                return True
        return False

    def walk(dfd: int, rel: str) -> bool:  # True when the directory is now empty
        empty = True
        with os.scandir(dfd) as entries:
            listed = list(entries)
        for entry in listed:
            child = f"{rel}/{entry.name}"
            if entry.is_symlink():
                left.append(child)
                empty = False
            elif entry.is_dir(follow_symlinks=False):
                empty = sweep(dfd, entry.name, child) and empty
            elif owned(child):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=dfd)
            else:
                left.append(child)
                empty = False
        return empty

    try:
        with _parent_fd(root, parts) as pfd:
            try:
                sweep(pfd, parts[-1], "/".join(parts))
            except FileNotFoundError:
                return []
            except OSError as err:
                if err.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise _refused(root, parts, len(parts) - 1) from err
                raise
    except FileNotFoundError:
        return []
    return left


def links_below(fs: Any, root: str, path: str) -> list[str]:
    """Symbolic links at or below ``path`` (below ``root``), as paths; [] on an object store.

    Walks with ``lstat`` only (never into a link), so a link to a large tree costs nothing.
    """
    if not is_local(fs):
        return []
    found: list[str] = []
    parts = _parts(root, path)
    probe = root.rstrip("/")
    for name in parts:  # the components on the way down
        probe = f"{probe}/{name}"
        try:
            if stat.S_ISLNK(os.lstat(probe).st_mode):
                return [probe]
        except FileNotFoundError:
            return []
    for top, dirs, files in os.walk(path, followlinks=False):
        found += [f"{top}/{n}" for n in dirs + files if os.path.islink(f"{top}/{n}")]
    return found
