"""The on-disk hash index of one earlier output: its layout, its build and its lookups.

:class:`OutputIndex` is what :class:`dask_surge.io.reuse.ReuseIndex` holds per output it reuses.

Index layout, under the old output's metadata (``<run>`` from ``_surge/CURRENT``)::

    out/_surge/index/<run>/meta.json             written last: files (their sha256, bytes and
                                                 texts cut at the window), bucket bits, entries
    out/_surge/index/<run>/bucket-<b>.npy        (4, n) uint64: hash hi, hash lo,
                                                 file << 32 | first row, rows in the run
    out/_surge/index/<run>/BUILDING              while a process builds it: time, host, pid

Entries are bucketed by the top ``bits`` bits of the hash (``bits`` chosen from the
output's row count so a bucket holds ~2**19 entries, 16 MiB), each bucket sorted by
hash, one entry per distinct hash (the first occurrence by file and row). A lookup
memory-maps the buckets it needs (a bounded LRU of them) and runs ``np.searchsorted``
on their contiguous ``hi`` row, so its memory does not grow with the old output. The
index is built once, lazily, when first opened: a streaming pass over the ``text_hash``
(and ``chunk``) columns of the committed files into per-bucket spill files in a local
temporary directory (memory bounded by ``spill_bytes``), then each bucket is sorted,
de-duplicated and written with :meth:`dask_surge.io.store.OutputStore.write`. Its
content is a function of the output alone, so two processes building it at once write
the same bytes; still, one that finds another's fresh ``BUILDING`` note waits for it
(the builder refreshes it every :data:`BUILD_BEAT_S`; a note older than
:data:`BUILD_STALE_S`, or of a dead process on this host, is ignored). A damaged or stale index (files missing or torn, meta unreadable, part
files it names gone) is rebuilt.

Scale: at 10**9 rows the index is ~2,000 buckets and ~32 GB on disk (2% of 384-float
embeddings); a build reads 16 bytes per row; a lookup touches ~log2(2**19) pages of one
bucket per query.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SurgeInputError, SurgeOutputError
from .directory import discard, index_dir
from .hashing import HASH_ALGORITHM, HASH_METADATA_KEY, hashes_of
from .layout import CHUNK, TEXT_HASH
from .lease import holder_info, stale, store_age
from .manifest import existing_run
from .store import OutputStore

__all__ = [
    "INDEX_FORMAT",
    "BUCKET_ENTRIES",
    "BUILD_BEAT_S",
    "BUILD_STALE_S",
    "LRU",
    "OutputIndex",
    "IndexDamaged",
]

INDEX_FORMAT = 2
#: entries per bucket the bucket count aims at (a bucket file is then ~16 MiB; sorting one takes ~4x that)
BUCKET_ENTRIES = 1 << 19
#: a process building an index refreshes its ``BUILDING`` note this often; others wait for it
BUILD_BEAT_S = 10.0
#: ... unless its note is older than this (the builder died): they then build it themselves
BUILD_STALE_S = 60.0


def _bucket_bits(rows: int, per_bucket: int = BUCKET_ENTRIES) -> int:
    """Bits of hash prefix so buckets hold ~``per_bucket`` entries.

    Examples
    --------
    >>> _bucket_bits(10), _bucket_bits(1 << 19), _bucket_bits(10**9)
    (0, 0, 11)
    """
    return max(0, int(np.ceil(np.log2(max(rows, 1) / per_bucket))))


def _bucket_of(hi: np.ndarray, bits: int) -> np.ndarray:
    if bits == 0:
        return np.zeros(len(hi), dtype=np.int64)
    return (hi >> np.uint64(64 - bits)).astype(np.int64)


class LRU(OrderedDict):
    """A small least-recently-used map bounded by entries and by a byte total."""

    def __init__(self, max_items: int, max_bytes: float = float("inf")) -> None:
        super().__init__()
        self.max_items, self.max_bytes, self.nbytes = max_items, max_bytes, 0
        self._sizes: dict = {}

    def get_or(self, key, make, size=lambda v: 0):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        n = size(value)
        if n > self.max_bytes:
            return value  # larger than the whole cache: used once, not kept
        self[key], self._sizes[key] = value, n
        self.nbytes += n
        while len(self) > self.max_items or self.nbytes > self.max_bytes:
            old, _ = self.popitem(last=False)
            self.nbytes -= self._sizes.pop(old)
        return value

    def discard(self, key) -> None:
        """Drop ``key`` (if held)."""
        if key in self:
            del self[key]
            self.nbytes -= self._sizes.pop(key)

    def clear(self) -> None:
        super().clear()
        self._sizes.clear()
        self.nbytes = 0


class OutputIndex:
    """The index of one earlier output (see the module docstring)."""

    def __init__(
        self,
        store: OutputStore,
        *,
        bits: int | None,
        spill_bytes: int,
        max_buckets: int,
        rebuild: bool,
        bucket_entries: int = BUCKET_ENTRIES,
    ) -> None:
        self.bucket_entries = bucket_entries
        path = store.location
        manifest = existing_run(store)
        done = manifest.completion()
        if done is None:
            raise SurgeInputError(
                f"reuse={path!r}: its run {manifest.run_id} is not complete, so its rows may still change. "
                "Only a complete output is reused. Fix: finish it first (rerun the call that wrote it), "
                "or leave it out of reuse=."
            )
        self.path, self.manifest, self.store = path, manifest, store
        self.fs, self.root = store.fs, store.root
        self.dir = index_dir(self.root, manifest.run_id)
        self.complete = done
        self._buckets = LRU(max_buckets)
        self._old_bits: int | None = None  # of an index found invalid: rebuilt with them
        self.meta = None if rebuild else self.valid_meta()
        if self.meta is None and not rebuild:
            self.meta = self._wait_for_builder()
        if self.meta is None:
            self.meta = self.build(bits=bits if bits is not None else self._old_bits, spill_bytes=spill_bytes)
        self.files: list[str] = self.meta["files"]
        self.chunked = bool(self.meta.get("chunked"))
        self.bits: int = self.meta["bits"]
        self.entries = np.asarray(self.meta["bucket_entries"], dtype=np.int64)
        self.sha256: list[str] = self.meta["sha256"]  # per file, from its commit record
        self.sizes: list[int] = self.meta["bytes"]
        self.may_be_cut = np.asarray(self.meta["truncated"], dtype=np.int64) != 0  # per file (-1: unknown)

    # -- one builder at a time (an optimization only: two builders write the same bytes)
    @property
    def _lock_path(self) -> str:
        return f"{self.dir}/BUILDING"

    def _beat(self) -> None:
        """Claim (or refresh the claim of) building this index: the time, host and pid."""
        with contextlib.suppress(OSError):
            self.store.write(self._lock_path, json.dumps(holder_info()).encode())

    def _builder_alive(self) -> bool:
        """True while another process builds this index and beat within :data:`BUILD_STALE_S`."""
        try:
            with self.fs.open(self._lock_path, "rb") as f:
                info = json.loads(f.read())
            if info.get("host") == socket.gethostname() and int(info.get("pid")) == os.getpid():
                return False  # our own (a build of ours that failed): not someone else's
            return not stale(info, BUILD_STALE_S, age=store_age(self.store, self._lock_path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def _wait_for_builder(self) -> dict | None:
        """Wait while another live process builds the index; its meta once valid, else None (build it)."""
        while self._builder_alive():
            time.sleep(0.2)
            meta = self.valid_meta()
            if meta is not None:
                return meta
        return self.valid_meta()

    # -- validity
    def valid_meta(self) -> dict | None:
        try:
            with self.fs.open(f"{self.dir}/meta.json", "rb") as f:
                meta = json.loads(f.read())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError):
            return None  # torn or damaged: rebuilt
        try:
            if isinstance(meta.get("bits"), int) and 0 <= meta["bits"] <= 24:
                self._old_bits = meta["bits"]
            if (
                meta.get("format") != INDEX_FORMAT
                or meta.get("algorithm") != HASH_ALGORITHM
                or meta.get("run") != self.manifest.run_id
                or meta.get("complete") != self.complete
            ):
                return None
            if not len(meta["sha256"]) == len(meta["bytes"]) == len(meta["truncated"]) == len(meta["files"]):
                return None
            present = set(self.store.listdir(self.root))
            if not set(meta["files"]) <= present:
                return None  # a file it names is gone (repaired and rerun): stale
            names = set(self.store.listdir(self.dir))
            for b, n in enumerate(meta["bucket_entries"]):
                if n and _bucket_name(b) not in names:
                    return None
            if len(meta["bucket_entries"]) != 1 << int(meta["bits"]):
                return None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return meta

    def clear(self) -> None:
        """Drop the memory-mapped buckets this index holds."""
        self._buckets.clear()

    # -- build
    def _records(self) -> list:
        return list(self.manifest.committed().values())

    def build(self, *, bits: int | None = None, spill_bytes: int = 32 << 20) -> dict:
        """Build (or rebuild) the index; returns its meta. Memory: ~2.5x ``spill_bytes`` while spilling
        (plus one row group's hashes), then ~4x one bucket while sorting it."""
        records = self._records()
        files = [r.file for r in records]
        checks = {
            "sha256": [r.sha256 for r in records],
            "bytes": [r.bytes for r in records],
            "truncated": [r.truncated for r in records],
        }
        rows = sum(r.rows for r in records)
        bits = _bucket_bits(rows, self.bucket_entries) if bits is None else int(bits)
        nb = 1 << bits
        spill = tempfile.mkdtemp(prefix="surge-reuse-spill-")
        counts = np.zeros(nb, dtype=np.int64)
        with contextlib.suppress(OSError):
            self.store.makedirs(self.dir)
        self._beat()
        last_beat = time.monotonic()
        try:
            buffer: list[np.ndarray] = []
            buffered = 0
            chunked = None

            def flush() -> None:
                # one split by bucket, one append per bucket (~2.5x spill_bytes of memory)
                nonlocal buffered
                if not buffer:
                    return
                block = np.concatenate(buffer)
                buffer.clear()
                bucket = _bucket_of(block[:, 0], bits)
                order = np.argsort(bucket, kind="stable")
                block, bucket = block[order], bucket[order]
                del order
                bounds = np.searchsorted(bucket, np.arange(nb + 1))
                for b in np.flatnonzero(np.diff(bounds)).tolist():
                    with open(os.path.join(spill, f"{b}.bin"), "ab") as f:
                        f.write(block[bounds[b] : bounds[b + 1]].tobytes())
                    counts[b] += bounds[b + 1] - bounds[b]
                buffered = 0

            for file_id, name in enumerate(files):
                if time.monotonic() - last_beat > BUILD_BEAT_S:
                    self._beat()
                    last_beat = time.monotonic()
                for entries, is_chunked in self._file_entries(file_id, name):
                    if chunked is None:
                        chunked = is_chunked
                    elif chunked != is_chunked:
                        raise self._layout_error(name, "some files have a 'chunk' column and some do not")
                    entries = _dedupe(entries)  # a text repeated in the batch: kept once
                    buffer.append(entries)
                    buffered += entries.nbytes
                    if buffered >= spill_bytes:
                        flush()
            flush()
            try:
                self.store.makedirs(self.dir)
                bucket_entries = []
                for b in range(nb):
                    if time.monotonic() - last_beat > BUILD_BEAT_S:
                        self._beat()
                        last_beat = time.monotonic()
                    if not counts[b]:
                        bucket_entries.append(0)
                        continue
                    block = np.fromfile(os.path.join(spill, f"{b}.bin"), dtype=np.uint64).reshape(-1, 4)
                    os.unlink(os.path.join(spill, f"{b}.bin"))
                    block = np.ascontiguousarray(_dedupe(block).T)
                    buf = io.BytesIO()
                    np.save(buf, block, allow_pickle=False)
                    self.store.write(f"{self.dir}/{_bucket_name(b)}", buf.getbuffer())
                    bucket_entries.append(int(block.shape[1]))
                    del block, buf
                meta = {
                    "format": INDEX_FORMAT,
                    "algorithm": HASH_ALGORITHM,
                    "run": self.manifest.run_id,
                    "complete": self.complete,
                    "bits": bits,
                    "rows": rows,
                    "files": files,
                    **checks,
                    "chunked": bool(chunked),
                    "bucket_entries": bucket_entries,
                    "built": time.time(),
                }
                self.store.write(f"{self.dir}/meta.json", json.dumps(meta, sort_keys=True).encode())
                keep = {_bucket_name(b) for b in range(nb) if bucket_entries[b]}
                for name in self.store.listdir(self.dir):  # buckets of an index built before with other bits
                    if name.startswith("bucket-") and name.endswith(".npy") and name not in keep:
                        discard(self.store, f"{self.dir}/{name}")
            except OSError as err:
                raise SurgeOutputError(
                    f"reuse={self.path!r}: writing its reuse index to {self.dir!r} failed "
                    f"({type(err).__name__}: {err}). The index is built once into the old output's _surge/ "
                    "directory. Fix: make that directory writable (or free disk space), or copy the old "
                    "output to a writable place and pass that path to reuse=."
                ) from err
        finally:
            shutil.rmtree(spill, ignore_errors=True)
            with contextlib.suppress(OSError):
                discard(self.store, self._lock_path)
        self._buckets.clear()
        return meta

    def _damaged(self, name: str, what: str) -> SurgeInputError:
        """The error for part file ``name`` of this output that cannot be copied from: ``what`` it is."""
        return SurgeInputError(
            f"reuse={self.path!r}: its data file {name} {what}, so no row is copied from it: the output was "
            "changed or damaged after its run wrote it. Fix: run `dask-surge status --verify "
            f"{self.path}` to list what is damaged, then `dask-surge status --repair {self.path}` and "
            "rerun the call that wrote it (it encodes the rows of damaged files again); or leave it out "
            "of reuse=."
        )

    def unreadable(self, name: str, err: Exception) -> SurgeInputError:
        """:meth:`_damaged` for a failure to read part file ``name`` (``err``)."""
        if isinstance(err, FileNotFoundError):
            return self._damaged(name, "is missing")
        return self._damaged(name, f"cannot be read ({type(err).__name__}: {str(err)[:200]})")

    def _layout_error(self, name: str, what: str) -> SurgeInputError:
        return self._damaged(name, f"is not of the layout dask-surge writes ({what})")

    def signature(self, f: int) -> tuple:
        """What changes when part file ``f`` changes (:meth:`~dask_surge.io.store.OutputStore.signature`)."""
        return self.store.signature(f"{self.root}/{self.files[f]}")

    def check_file(self, f: int) -> None:
        """Hash part file ``f`` whole and compare it with the sha256 and size its commit record holds.

        Raises
        ------
        SurgeInputError
            The file is missing, cannot be read, or differs from its record.
        """
        name = self.files[f]
        digest, size = hashlib.sha256(), 0
        try:
            with self.fs.open(f"{self.root}/{name}", "rb") as fh:
                while block := fh.read(1 << 22):
                    digest.update(block)
                    size += len(block)
        except OSError as err:
            raise self.unreadable(name, err) from err
        want_size, want = int(self.sizes[f]), str(self.sha256[f])
        if size != want_size:
            raise self._damaged(name, f"is {size:,} bytes, its commit record says {want_size:,}")
        if digest.hexdigest() != want:
            raise self._damaged(
                name, f"has sha256 {digest.hexdigest()[:16]}..., its commit record says {want[:16]}..."
            )

    def _file_entries(self, file_id: int, name: str) -> Iterator[tuple[np.ndarray, bool]]:
        """Index entries ``(m, 4)`` uint64 of one part file, a row group at a time; chunk runs joined."""
        try:
            yield from self._read_entries(file_id, name)
        except (OSError, pa.ArrowException) as err:
            raise self.unreadable(name, err) from err

    def _read_entries(self, file_id: int, name: str) -> Iterator[tuple[np.ndarray, bool]]:
        path = f"{self.root}/{name}"
        with self.fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            if TEXT_HASH not in schema.names:
                raise SurgeInputError(
                    f"reuse={self.path!r} has no {TEXT_HASH!r} column ({name} holds {schema.names}): it was "
                    "written by a dask-surge that did not record text hashes yet, so its rows cannot be "
                    "matched to texts. Fix: re-run once without reuse= (the new output records them); "
                    "later runs can reuse that output."
                )
            algo = (
                (schema.field(TEXT_HASH).metadata or {})
                .get(HASH_METADATA_KEY, HASH_ALGORITHM.encode())
                .decode()
            )
            if algo != HASH_ALGORITHM:
                raise SurgeInputError(
                    f"reuse={self.path!r}: its {TEXT_HASH!r} column was computed with {algo!r}, this "
                    f"dask-surge uses {HASH_ALGORITHM!r}, so equal texts would not match. Fix: re-run once "
                    "without reuse= to record hashes this version can match."
                )
            chunked = CHUNK in schema.names
            columns = [TEXT_HASH] + ([CHUNK] if chunked else [])
            base = 0
            pending: np.ndarray | None = None  # the file's last run so far: it may go on in the next group
            for g in range(pf.num_row_groups):
                table = pf.read_row_group(g, columns=columns)
                n = table.num_rows
                if n == 0:
                    continue
                h = hashes_of(table.column(TEXT_HASH))
                starts = np.flatnonzero(table.column(CHUNK).to_numpy() == 0) if chunked else np.arange(n)
                lead = int(starts[0]) if len(starts) else n
                if lead:
                    if pending is None or not (h[:lead] == pending[0, :2]).all():
                        raise self._layout_error(name, f"rows at {base} continue no text's chunks")
                    pending[0, 3] += lead
                if chunked and len(starts):
                    ends = np.append(starts[1:], n)
                    run_of = np.repeat(np.arange(len(starts)), ends - starts)
                    if not (h[lead:] == h[starts][run_of]).all():
                        raise self._layout_error(name, "a text's chunk rows carry different hashes")
                if len(starts) == 0:
                    base += n
                    continue
                out = np.empty((len(starts), 4), dtype=np.uint64)
                out[:, :2] = h[starts]
                out[:, 2] = (np.uint64(file_id) << np.uint64(32)) | (starts + base).astype(np.uint64)
                out[:, 3] = np.diff(np.append(starts, n))
                if pending is not None:
                    yield pending, chunked
                pending = out[-1:].copy()
                if len(out) > 1:
                    yield out[:-1], chunked
                base += n
            if pending is not None:
                yield pending, chunked

    # -- lookup
    def _bucket(self, b: int) -> np.ndarray:
        def load() -> np.ndarray:
            path = f"{self.dir}/{_bucket_name(b)}"
            try:
                source = self.store.source(path)  # a local path (memory-mapped), else an open file
                if isinstance(source, str):
                    arr = np.load(source, mmap_mode="r", allow_pickle=False)
                else:
                    with source:
                        arr = np.load(io.BytesIO(source.read()), allow_pickle=False)
            except (OSError, ValueError, EOFError) as err:
                raise IndexDamaged(f"{path}: {type(err).__name__}: {err}") from err
            if arr.dtype != np.uint64 or arr.shape != (4, int(self.entries[b])):
                raise IndexDamaged(
                    f"{path}: shape {arr.shape} {arr.dtype}, expected (4, {int(self.entries[b])}) uint64"
                )
            return arr

        return self._buckets.get_or(b, load)

    def lookup(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For ``q`` ``(n, 2)``: found, file, row, count."""
        n = len(q)
        found = np.zeros(n, bool)
        file = np.zeros(n, np.int64)
        row = np.zeros(n, np.int64)
        count = np.zeros(n, np.int64)
        if n == 0:
            return found, file, row, count
        bucket = _bucket_of(q[:, 0], self.bits)
        order = np.argsort(bucket, kind="stable")
        sb = bucket[order]
        bounds = np.searchsorted(sb, np.arange((1 << self.bits) + 1))
        for b in np.flatnonzero(np.diff(bounds)):
            if not self.entries[b]:
                continue
            idx = order[bounds[b] : bounds[b + 1]]
            arr = self._bucket(int(b))
            hi, lo = arr[0], arr[1]
            qhi, qlo = q[idx, 0], q[idx, 1]
            left = np.searchsorted(hi, qhi, side="left")
            right = np.searchsorted(hi, qhi, side="right")
            span = right - left
            pos = np.full(len(idx), -1, np.int64)
            one = np.flatnonzero(span == 1)
            hit = np.asarray(lo[left[one]]) == qlo[one]
            pos[one[hit]] = left[one[hit]]
            for j in np.flatnonzero(span > 1):  # 64-bit prefix shared: rare (~n^2 / 2^65 pairs)
                k = int(left[j]) + int(np.searchsorted(lo[left[j] : right[j]], qlo[j]))
                if k < right[j] and lo[k] == qlo[j]:
                    pos[j] = k
            ok = pos >= 0
            if not ok.any():
                continue
            p = pos[ok]
            loc = np.asarray(arr[2][p])
            where = idx[ok]
            found[where] = True
            file[where] = (loc >> np.uint64(32)).astype(np.int64)
            row[where] = (loc & np.uint64(0xFFFFFFFF)).astype(np.int64)
            count[where] = np.asarray(arr[3][p]).astype(np.int64)
        return found, file, row, count


class IndexDamaged(Exception):
    """An index file that cannot be read as written (the index is rebuilt)."""


def _bucket_name(b: int) -> str:
    return f"bucket-{b:06d}.npy"


def _dedupe(entries: np.ndarray) -> np.ndarray:
    """Entries ``(m, 4)`` sorted by hash, one per distinct hash (the smallest file and row).

    Examples
    --------
    >>> e = np.array([[2, 0, 9, 1], [1, 5, 7, 1], [2, 0, 3, 1]], dtype=np.uint64)
    >>> _dedupe(e).tolist()
    [[1, 5, 7, 1], [2, 0, 3, 1]]
    """
    if len(entries) == 0:
        return entries
    order = np.lexsort((entries[:, 2], entries[:, 1], entries[:, 0]))
    e = entries[order]
    keep = np.ones(len(e), bool)
    keep[1:] = (e[1:, 0] != e[:-1, 0]) | (e[1:, 1] != e[:-1, 1])
    return e[keep]


# -- the public index ---------------------------------------------------------------------
