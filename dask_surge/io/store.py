"""Where an output lives: one object per location, resolved once, with the commit protocol's operations.

:meth:`OutputStore.open` turns what a user names (a path or URL, and ``storage_options``) into
one :class:`OutputStore`: the kind of store (a POSIX filesystem, fsspec's in-memory one, or an
object store), its fsspec filesystem and the output's root, normalised (``//``, ``.`` and
``..`` collapsed; a local path made absolute with its links resolved), so that two spellings
of one place compare equal. Everything that writes, reads, lists, moves or deletes in an
output goes through that object; it is the only module that asks what kind of filesystem it
holds. Adding a kind of store is one subclass here: the few operations below, and
:meth:`OutputStore.prove` where the store must show it honours them.

The operations the commit protocol needs (see :mod:`dask_surge.io.manifest`):

- :meth:`~OutputStore.write`: no reader ever sees a partial file; with ``exclusive=True``, of
  two writers of one path only one wins (a local temporary file, fsync, then a hard link or a
  rename, and the directory fsynced; one PUT, conditional for ``exclusive``, on a store);
- :meth:`~OutputStore.unlink`, :meth:`~OutputStore.rename`, :meth:`~OutputStore.remove_tree`:
  the delete and move of a path below the root, never through a symbolic link (on a POSIX
  filesystem each directory is opened with ``O_NOFOLLOW`` from a descriptor of the root: a
  link below the root is refused with :class:`LinkRefused`, so a delete cannot reach outside
  the output; the root itself may be a link, the user's choice of where the output lives);
- :meth:`~OutputStore.listdir` (fresh, never from a listing cache), :meth:`~OutputStore.read`,
  :meth:`~OutputStore.signature` (what changes when a file is written again) and
  :meth:`~OutputStore.mtime` (the store's own clock, :func:`dask_surge.io.lease.store_age`);
- :attr:`~OutputStore.renames` (a rename is atomic, so the task that commits a SuperBatch also
  publishes it) and :meth:`~OutputStore.prove` (an object store's conditional create is
  exclusive and its listings show new keys, proven on the store before the first write).

Examples
--------
>>> import os, tempfile
>>> root = tempfile.mkdtemp()
>>> store = OutputStore.open(root + "//emb/./")
>>> store.kind, store.root == os.path.realpath(root) + "/emb"
('posix', True)
>>> store.makedirs(store.root)
>>> store.write(f"{store.root}/a", b"1", exclusive=True), store.write(f"{store.root}/a", b"2", exclusive=True)
(True, False)
>>> os.mkdir(f"{root}/elsewhere"); os.symlink(f"{root}/elsewhere", f"{store.root}/link")
>>> store.unlink(f"{store.root}/link/a")
Traceback (most recent call last):
...
dask_surge.io.store.LinkRefused: ... is a symbolic link ...
>>> store.unlink(f"{store.root}/a"), store.unlink(f"{store.root}/a")
(True, False)
>>> OutputStore.open("memory://x//y/").root, OutputStore.open("memory://x//y/").kind
('/x/y', 'memory')
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import inspect
import os
import posixpath
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, ClassVar, Literal

from ..errors import SurgeOutputError

__all__ = [
    "LOCAL_PROTOCOLS",
    "STORE_PROTOCOLS",
    "GLOB_CHARACTERS",
    "LinkRefused",
    "OutputStore",
    "PosixStore",
    "MemoryStore",
    "ObjectStore",
    "canonical_path",
    "is_posix",
    "protocol_of",
    "arrow_local_fs",
]


#: filesystems whose rename and exclusive create the commit protocol relies on (tested)
LOCAL_PROTOCOLS = ("file", "local", "memory")


#: object stores written with one PUT per file and conditional PUTs for exclusive creates,
#: where the installed fsspec filesystem offers them (proven on the store by :meth:`ObjectStore.prove`)
STORE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "abfs", "az")


#: characters that Parquet readers (Dask, DuckDB, Spark, pyarrow's datasets) take for a pattern
#: in a path: an output whose location holds one would read back as nothing, or as other files
GLOB_CHARACTERS = "*?[]{}"


class LinkRefused(SurgeOutputError):
    """A path below an output's root goes through a symbolic link, which dask-surge never follows."""


def protocol_of(fs: Any) -> str:
    """The first protocol name of an fsspec filesystem (``"file"``, ``"s3"``, ...), or a
    ``pyarrow.fs`` filesystem's type name.

    Examples
    --------
    >>> import fsspec
    >>> protocol_of(fsspec.filesystem("file")), protocol_of(fsspec.filesystem("memory"))
    ('file', 'memory')
    """
    if not hasattr(fs, "protocol") and hasattr(fs, "type_name"):
        return str(fs.type_name)
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def is_posix(fs: Any) -> bool:
    """True for this machine's filesystem, a local disk or a shared POSIX one (NFS, Lustre, GPFS),
    as fsspec's or pyarrow's (wrapped in fsspec's ``ArrowFSWrapper``) names it: where links,
    inodes, renames and fsync exist."""
    if protocol_of(fs) in ("file", "local"):
        return True
    inner = getattr(fs, "fs", None)
    return getattr(inner, "type_name", None) == "local"


def arrow_local_fs(fs: Any) -> Any:
    """A ``pyarrow.fs.LocalFileSystem`` for a POSIX fsspec filesystem (pyarrow then reads local
    files by itself), else None.

    Examples
    --------
    >>> import fsspec
    >>> type(arrow_local_fs(fsspec.filesystem("file"))).__name__
    'LocalFileSystem'
    >>> arrow_local_fs(fsspec.filesystem("memory")) is None
    True
    """
    if not is_posix(fs):
        return None
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def _spellings(path: str, fs: Any) -> set[str]:
    """``path`` as it is spelled (absolute, ``..``, ``.`` and repeated slashes collapsed) and, on a POSIX
    filesystem, with its links resolved: a path through a link is in both places at once."""
    if not is_posix(fs):
        return {canonical_path(path, fs)}
    spelled = os.path.abspath(os.path.expanduser(path))
    return {spelled, os.path.realpath(spelled)}


def _at_or_below(path: str, top: str) -> bool:
    """True when ``path`` is ``top`` or below it (both normalised)."""
    top = top.rstrip("/")
    return path.rstrip("/") == top or path.startswith(top + "/")


def canonical_path(path: str, fs: Any) -> str:
    """``path`` on ``fs`` in the form two spellings of one place share: on a POSIX filesystem
    absolute, with ``..``, ``.``, repeated slashes and links resolved (:func:`os.path.realpath`);
    elsewhere with ``..``, ``.`` and repeated slashes collapsed, without a trailing slash.

    Examples
    --------
    >>> import fsspec
    >>> canonical_path("bucket/in//emb/../x/", fsspec.filesystem("memory"))
    '/bucket/in/x'
    """
    if is_posix(fs):
        return os.path.realpath(os.path.expanduser(path))
    stripped = fs._strip_protocol(path) if hasattr(fs, "_strip_protocol") else path
    lead = "/" if stripped.startswith("/") else ""
    normal = posixpath.normpath("/" + stripped).lstrip("/")
    return lead + normal if normal not in ("", ".") else (lead or ".")


def _mtime(info: dict) -> float | None:
    """The modification time an fsspec ``info`` gives (local ``mtime``, S3 ``LastModified``, GCS
    ``updated``, the in-memory filesystem's ``created``), as a POSIX timestamp; None if none."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


#: what an object store's ``info`` says of a key that changes when the key is written again
_STORE_SIGNATURE = (
    "size",
    "ETag",
    "etag",
    "LastModified",
    "last_modified",
    "mtime",
    "generation",
    "md5Hash",
    "created",
    "version_id",
    "VersionId",
)


class OutputStore:
    """An output location resolved once (see the module docstring): kind, filesystem and root.

    Built by :meth:`open`; pickles (a SuperBatch task carries its run's store to the worker).

    Attributes
    ----------
    kind : {"posix", "memory", "object"}
        What kind of store this is.
    fs : fsspec.AbstractFileSystem
        Its filesystem (an object store's without a listing cache).
    root : str
        The output's root as ``fs`` names it, normalised (:func:`canonical_path`).
    location : str
        The location as the user named it (for messages).
    storage_options : dict
        The fsspec options it was opened with.
    """

    kind: ClassVar[Literal["posix", "memory", "object"]]
    #: a rename is atomic here, so the task that commits a SuperBatch also publishes its file
    renames: ClassVar[bool] = True

    def __init__(
        self,
        fs: Any,
        root: str,
        location: str,
        storage_options: dict | None = None,
        spelled: str | None = None,
    ) -> None:
        self.fs, self.root, self.location = fs, root.rstrip("/") or "/", str(location)
        self.storage_options = dict(storage_options or {})
        #: the root as spelled (normalised, links not resolved): the same place where no link is on the way
        self.spelled = spelled or self.root

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, OutputStore)
            and (self.kind, self.root) == (other.kind, other.root)
            and protocol_of(self.fs) == protocol_of(other.fs)
        )

    def __hash__(self) -> int:
        return hash((self.kind, protocol_of(self.fs), self.root))

    def __dask_tokenize__(self) -> tuple:
        return ("OutputStore", self.kind, protocol_of(self.fs), self.root)

    # -- resolving a location
    @staticmethod
    def open(
        location: str | os.PathLike, storage_options: dict | None = None, *, writing: bool = False
    ) -> OutputStore:
        """The store of ``location`` (a local path or an fsspec URL) with ``storage_options``.

        ``writing=True`` refuses, before any filesystem is built, a location where the commit
        protocol cannot hold (another kind of filesystem, a chained URL, an object store whose
        installed fsspec filesystem has no exclusive create, a path holding a glob character).

        Raises
        ------
        SurgeOutputError
            Naming the location, the rule and the fix.
        """
        from fsspec.core import split_protocol, url_to_fs

        text = os.fspath(location)
        protocol = split_protocol(text)[0] or "file"
        if writing:
            _check_writable(text, protocol)
        options = dict(storage_options or {})
        if protocol in STORE_PROTOCOLS:
            options.setdefault("use_listings_cache", False)  # a commit of another process is never hidden
        fs, root = url_to_fs(text, **options)
        cls: type[OutputStore]
        if is_posix(fs):
            cls = PosixStore
        elif protocol_of(fs) == "memory":
            cls = MemoryStore
        else:
            cls = ObjectStore
        spelled = os.path.abspath(os.path.expanduser(root)) if cls is PosixStore else None
        return cls(fs, canonical_path(root, fs), text, storage_options, spelled)

    def url(self, path: str) -> str:
        """``path`` (as :attr:`fs` names it) as any fsspec or Parquet reader opens it."""
        if self.kind == "posix":
            return path
        return f"{protocol_of(self.fs)}://{path.lstrip('/') if self.kind == 'object' else path}"

    def contains(self, path: str, fs: Any = None) -> bool:
        """True when ``path`` (on ``fs``, by default this store's) is the root or below it, on the
        same kind of filesystem, compared as spelled and with links resolved (:func:`canonical_path`)."""
        return any(_at_or_below(other, root) for other, root in self._pairs(path, fs))

    def within(self, path: str, fs: Any = None) -> bool:
        """True when the root is ``path`` (on ``fs``, by default this store's) or below it: the
        output would be inside that directory (compared as :meth:`contains` does)."""
        return any(_at_or_below(root, other) for other, root in self._pairs(path, fs))

    def _pairs(self, path: str, fs: Any) -> list[tuple[str, str]]:
        """Each spelling of ``path`` with each of the root's; none on another kind of filesystem."""
        fs = self.fs if fs is None else fs
        if not self._same_kind(fs):
            return []
        return [(other, root) for other in _spellings(path, fs) for root in {self.root, self.spelled}]

    def _same_kind(self, fs: Any) -> bool:
        if is_posix(fs):
            return self.kind == "posix"
        return self.kind != "posix" and protocol_of(fs) == protocol_of(self.fs)

    def below(self, path: str) -> list[str]:
        """``path``'s components below the root; a :class:`SurgeOutputError` if it is not below it."""
        base = self.root.rstrip("/") + "/"
        rel = path[len(base) :] if path.startswith(base) else None
        parts = rel.split("/") if rel else []
        if not parts or any(p in ("", ".", "..") for p in parts):
            raise SurgeOutputError(
                f"{path!r} is not a path below the output {self.root!r}; dask-surge deletes and "
                "moves only inside its output. This is a bug: please report it."
            )
        return parts

    # -- reading
    def read(self, path: str) -> bytes:
        """The bytes of ``path`` (one GET on a store); FileNotFoundError when it is not there."""
        return self.fs.cat_file(path)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        """Names in the directory ``path``, sorted (fresh: never from a listing cache); [] when it
        does not exist. An object store's zero-byte "folder marker" of ``path`` itself is not listed."""
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache(path)
        try:
            listed = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        own = path.rstrip("/")
        return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in listed if p.rstrip("/") != own})

    def signature(self, path: str) -> tuple:
        """What changes whenever the file ``path`` is written again (a memo of a file checked once
        is valid while this stays the same: :class:`dask_surge.io.reuse.ReuseIndex`)."""
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        return tuple((key, str(info[key])) for key in _STORE_SIGNATURE if key in info)

    def mtime(self, path: str) -> float | None:
        """When ``path`` was last written, on the store's clock (None: the store does not say)."""
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache(path)
        return _mtime(self.fs.info(path))

    def source(self, path: str) -> Any:
        """What a reader opens ``path`` from: an open binary file here; a local path (which pyarrow and
        NumPy read, memory-mapped, by themselves) on a POSIX filesystem."""
        return self.fs.open(path, "rb")

    # -- writing
    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def write(self, path: str, data: builtins.bytes | memoryview, *, exclusive: bool = False) -> bool:
        """Write ``data`` to ``path`` so that no reader ever sees a partial file; with
        ``exclusive=True`` only if ``path`` does not exist. Returns False only when ``exclusive``
        and ``path`` already existed. On any failure no partial or temporary file is left."""
        raise NotImplementedError

    def unlink(self, path: str) -> bool:
        """Delete the file ``path`` below the root (never through a link); False if it was not there."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (both below the root); FileNotFoundError when ``src`` is gone."""
        raise NotImplementedError

    def remove_tree(self, path: str, owned: Callable[[str], bool]) -> list[str]:
        """Delete the files below ``path`` (itself below the root) for which ``owned(relative path)``
        holds, then the directories left empty; returns what it left (relative paths)."""
        raise NotImplementedError

    def links_below(self, path: str) -> list[str]:
        """Symbolic links at or below ``path`` (below the root); [] where there are no links."""
        return []

    def prove(self) -> None:
        """Show on the store itself that the commit protocol holds there (nothing to show on a
        filesystem with atomic renames); a :class:`SurgeOutputError` naming the store otherwise."""

    @staticmethod
    def _tmp(path: str) -> str:
        parent, name = path.rsplit("/", 1)
        return f"{parent}/.{name}.tmp-{os.getpid()}-{time.monotonic_ns()}"


def _check_writable(location: str, protocol: str) -> None:
    """Refuse to write where the commit protocol cannot hold (see :meth:`OutputStore.open`)."""
    found = sorted({c for c in location if c in GLOB_CHARACTERS})
    if found:
        raise SurgeOutputError(
            f"output={location!r} holds {' '.join(repr(c) for c in found)}, which Parquet readers (Dask, DuckDB, "
            "Spark) take for a pattern in a path: the output would read back as nothing, or as other files. "
            "Nothing was written. Fix: choose a location without any of " + " ".join(GLOB_CHARACTERS) + "."
        )
    if protocol in LOCAL_PROTOCOLS and "::" not in location:
        return
    if protocol in STORE_PROTOCOLS and "::" not in location:
        if _create_mode(protocol):
            return
        raise SurgeOutputError(
            f"output={location!r} is on a {protocol!r} store, but the installed fsspec filesystem for it gives no "
            "exclusive create (pipe_file(..., mode='create'), a conditional PUT), which dask-surge's commit "
            "protocol needs. Nothing was written. Fix: install or upgrade its package (s3fs, gcsfs or adlfs, "
            "2024.12 or newer), or write to a shared filesystem path."
        )
    raise SurgeOutputError(
        f"output={location!r} is on a {protocol!r} filesystem. dask-surge's exactly-once commit needs an atomic "
        "write and an exclusive create, which it uses on local and shared POSIX filesystems (local disks, NFS, "
        f"Lustre, GPFS) and on object stores ({', '.join(STORE_PROTOCOLS)}) only, so it refuses other "
        "filesystems (and chained URLs) rather than risk lost or duplicated rows. Nothing was written. Fix: "
        "write to a shared filesystem path or an object-store URL such as 's3://bucket/prefix'."
    )


def _create_mode(protocol: str) -> bool:
    """True when the installed fsspec filesystem of ``protocol`` offers an exclusive create
    (``pipe_file(..., mode="create")``: a conditional PUT with ``If-None-Match: *``)."""
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


class PosixStore(OutputStore):
    """A local disk or a shared POSIX filesystem (NFS, Lustre, GPFS): temporary file, fsync,
    rename (or hard link, for an exclusive create); links below the root are never followed."""

    kind = "posix"

    def write(self, path: str, data: builtins.bytes | memoryview, *, exclusive: bool = False) -> bool:
        parent = path.rsplit("/", 1)[0]
        tmp = self._tmp(path)
        try:
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
        except BaseException:
            # disk full, killed write, ...: leave no partial file behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return True

    def signature(self, path: str) -> tuple:
        st = os.stat(path)
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def mtime(self, path: str) -> float | None:
        return os.stat(path).st_mtime

    def source(self, path: str) -> Any:
        return path  # pyarrow's own local reads (memory-mapped where it can)

    def _refused(self, parts: list[str], depth: int) -> LinkRefused:
        where = f"{self.root.rstrip('/')}/{'/'.join(parts[: depth + 1])}"
        target = ""
        with contextlib.suppress(OSError):
            target = f" -> {os.readlink(where)!r}"
        return LinkRefused(
            f"{where!r}{target} is a symbolic link (or not a directory) inside the output {self.root!r}. dask-surge "
            "never follows a link inside its output: a run deletes and moves files there, and must not reach what "
            f"the link points to. Nothing was deleted or moved through it. Fix: remove the link (`rm {where}` "
            "removes the link only, not its target) and rerun; to put the output on another disk, point the "
            "output path itself there."
        )

    @contextlib.contextmanager
    def _parent_fd(self, parts: list[str]) -> Iterator[int]:
        """A descriptor of the directory holding ``root/parts``, reached without following a link below the root."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for depth, name in enumerate(parts[:-1]):
                try:
                    nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as err:
                    if err.errno in (errno.ENOTDIR, errno.ELOOP):
                        raise self._refused(parts, depth) from err
                    raise
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    def unlink(self, path: str) -> bool:
        parts = self.below(path)
        try:
            with self._parent_fd(parts) as fd:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise SurgeOutputError(
                        f"{path!r} is a directory where dask-surge expects one of its files; it "
                        "is left as it is. Fix: move it out of the output."
                    )
                os.unlink(parts[-1], dir_fd=fd)
        except FileNotFoundError:
            return False
        return True

    def rename(self, src: str, dst: str) -> None:
        sparts, dparts = self.below(src), self.below(dst)
        with self._parent_fd(sparts) as sfd, self._parent_fd(dparts) as dfd:
            os.rename(sparts[-1], dparts[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
            _fsync_dir(fd=dfd)

    def remove_tree(self, path: str, owned: Callable[[str], bool]) -> list[str]:
        parts = self.below(path)
        left: list[str] = []

        def sweep(
            pfd: int, name: str, rel: str
        ) -> bool:  # True when the directory ``name`` in ``pfd`` is gone
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
            with self._parent_fd(parts) as pfd:
                try:
                    sweep(pfd, parts[-1], "/".join(parts))
                except FileNotFoundError:
                    return []
                except OSError as err:
                    if err.errno in (errno.ENOTDIR, errno.ELOOP):
                        raise self._refused(parts, len(parts) - 1) from err
                    raise
        except FileNotFoundError:
            return []
        return left

    def links_below(self, path: str) -> list[str]:
        """Walks with ``lstat`` only (never into a link), so a link to a large tree costs nothing."""
        found: list[str] = []
        probe = self.root.rstrip("/")
        for name in self.below(path):  # the components on the way down
            probe = f"{probe}/{name}"
            try:
                if stat.S_ISLNK(os.lstat(probe).st_mode):
                    return [probe]
            except FileNotFoundError:
                return []
        for top, dirs, files in os.walk(path, followlinks=False):
            found += [f"{top}/{n}" for n in dirs + files if os.path.islink(f"{top}/{n}")]
        return found


class MemoryStore(OutputStore):
    """fsspec's in-memory filesystem (one process; tests and notebooks): checks, writes a
    temporary key and moves it; no links."""

    kind = "memory"

    def write(self, path: str, data: builtins.bytes | memoryview, *, exclusive: bool = False) -> bool:
        tmp = self._tmp(path)
        try:
            if exclusive and self.fs.exists(path):  # one process: no other writer between check and move
                return False
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise
        return True

    def unlink(self, path: str) -> bool:
        self.below(path)
        if not self.fs.exists(path):
            return False
        if self.fs.isdir(path):
            raise SurgeOutputError(
                f"{path!r} is a directory where dask-surge expects one of its files; it is left "
                "as it is. Fix: move it out of the output."
            )
        self.fs.rm_file(path)
        return True

    def rename(self, src: str, dst: str) -> None:
        self.below(src), self.below(dst)
        if not self.fs.exists(src):
            raise FileNotFoundError(src)
        self.fs.mv(src, dst, recursive=self.fs.isdir(src))

    def remove_tree(self, path: str, owned: Callable[[str], bool]) -> list[str]:
        return _remove_keys(self, path, owned)


def _remove_keys(store: OutputStore, path: str, owned: Callable[[str], bool]) -> list[str]:
    """:meth:`OutputStore.remove_tree` where directories are only key prefixes (no links)."""
    store.below(path)
    base = store.root.rstrip("/") + "/"
    with contextlib.suppress(AttributeError, TypeError):
        store.fs.invalidate_cache(path)
    try:
        found = store.fs.find(path)
    except FileNotFoundError:
        return []
    left = []
    for key in found:
        rel = key[len(base) :] if key.startswith(base) else key
        if owned(rel):
            with contextlib.suppress(FileNotFoundError):
                store.fs.rm_file(key)
        else:
            left.append(rel)
    return left


class ObjectStore(OutputStore):
    """An object store (S3, GCS, Azure): one PUT per file, a conditional PUT (``If-None-Match: *``)
    for an exclusive create, proven on the store before the first write (:meth:`prove`). A move is
    a copy and a delete (not atomic), so only the process holding the run's claim publishes."""

    kind = "object"
    renames = False

    def write(self, path: str, data: builtins.bytes | memoryview, *, exclusive: bool = False) -> bool:
        if not exclusive:
            self.fs.pipe_file(path, bytes(data))
            return True
        try:
            self.fs.pipe_file(path, bytes(data), mode="create")
        except FileExistsError:
            return False
        except OSError as err:  # s3fs raises PermissionError/OSError for some 412 Precondition Failed answers
            if (
                "PreconditionFailed" in str(err)
                or "412" in str(err)
                or "At least one of the pre-conditions" in str(err)
            ):
                return False
            raise
        return True

    def unlink(self, path: str) -> bool:
        self.below(path)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True

    def rename(self, src: str, dst: str) -> None:
        self.below(src), self.below(dst)
        self.fs.cp_file(src, dst)  # one server-side copy (FileNotFoundError when src is gone), one delete
        self.fs.rm_file(src)

    def remove_tree(self, path: str, owned: Callable[[str], bool]) -> list[str]:
        return _remove_keys(self, path, owned)

    def prove(self) -> None:
        """Prove on the output's own prefix that an exclusive create is exclusive (some
        S3-compatible servers ignore ``If-None-Match`` and answer 200 to both writers) and that a
        listing shows a new key. Costs two PUTs, one LIST and one DELETE, once per run."""
        meta = f"{self.root}/_surge"
        probe = f"{meta}/.probe-{uuid.uuid4().hex}"
        where = self.url(self.root)
        try:
            first = self.write(probe, b"1", exclusive=True)
            second = self.write(probe, b"2", exclusive=True)
            listed = probe.rsplit("/", 1)[1] in self.listdir(meta)
            self.unlink(probe)
        except SurgeOutputError:
            raise
        except OSError as err:
            raise SurgeOutputError(
                f"output={where!r} cannot be written ({type(err).__name__}: {err}). Nothing was encoded. Fix: check "
                "the bucket exists and the credentials (storage_options, the environment or the store's config) "
                "allow PUT, GET, LIST and DELETE under that prefix."
            ) from err
        if not first or second:
            raise SurgeOutputError(
                f"output={where!r}: the store ignored a conditional create (a second exclusive PUT of one key "
                f"{'succeeded' if second else 'failed although the key was new'}). dask-surge commits each "
                "SuperBatch and claims the output with conditional PUTs (If-None-Match: *); on this store two "
                "writers could both win and rows could be duplicated or lost. Nothing was written. Fix: use a store "
                "that honours If-None-Match (AWS S3, recent MinIO, GCS, Azure), or write to a shared filesystem path."
            )
        if not listed:
            raise SurgeOutputError(
                f"output={where!r}: a key just written did not appear in a listing of its prefix, so resume could "
                "miss committed SuperBatches. Nothing was written. Fix: turn off any listing cache of the store "
                "(storage_options={'use_listings_cache': False}) or use a store with consistent listings."
            )
