"""Content-addressed reuse: an on-disk index of an earlier output's text hashes.

A row's ``text_hash`` (:mod:`dask_surge.io.hashing`) together
with the run's embedding identity (:func:`embedding_identity`, checked by
:func:`compatible`) it says which embedding a row has, so a later run can copy that
embedding instead of encoding the text again (issue 25).

:class:`ReuseIndex` finds, for a batch of hashes, a committed row of one or more earlier
complete outputs with that hash, wherever it is (rows that moved between partitions
are found: the lookup is by hash only), and :meth:`ReuseIndex.fetch` copies the stored
Arrow values (embedding, chunk columns) byte for byte. With long-text chunking an
output holds several rows per text (``chunk`` 0, 1, ...; each carrying the hash of the
whole text); a hash then maps to the *run* of that text's chunk rows, in chunk order.

What is copied is checked: before the first row of a part file is copied, the whole file
is hashed and compared with the sha256 its commit record holds (recorded in the index's
meta), once per file per open index (:func:`open_index` keeps a process's indexes open,
so a worker hashes a file once, not per SuperBatch). A file damaged, truncated or gone,
and any failure to read one, is a :class:`~dask_surge.errors.SurgeInputError` naming the
output and ``dask-surge status --verify``. The meta also keeps each file's count of texts
cut at the model's window (its commit record's ``truncated``): :attr:`Reused.may_be_cut`
says which copied texts come from a file that counted some, so a run in
``long_texts="truncate"`` or ``"error"`` tokenizes only those to apply its rule.

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
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SurgeInputError, SurgeOutputError, SurgeValueError
from .directory import discard, index_dir
from .hashing import HASH_ALGORITHM, HASH_METADATA_KEY, hashes_of
from .layout import CHUNK, CHUNK_COLUMNS, EMBEDDING, TEXT_HASH
from .lease import holder_info, stale, store_age
from .manifest import current_run, existing_run
from .readers import model_name
from .store import OutputStore

__all__ = ["embedding_identity", "compatible", "Matches", "Reused", "ReuseIndex", "open_index"]

#: fingerprint keys that identify the input or the output's shape, not how a text is embedded
NON_EMBEDDING_KEYS = ("input", "column", "keep", "partitions", "library")
INDEX_FORMAT = 2
#: entries per bucket the bucket count aims at (a bucket file is then ~16 MiB; sorting one takes ~4x that)
BUCKET_ENTRIES = 1 << 19
#: a process building an index refreshes its ``BUILDING`` note this often; others wait for it
BUILD_BEAT_S = 10.0
#: ... unless its note is older than this (the builder died): they then build it themselves
BUILD_STALE_S = 60.0


# -- identity -----------------------------------------------------------------------------


def embedding_identity(fingerprint: dict) -> dict:
    """The part of a run's fingerprint that says how a text was embedded.

    Everything in ``run.json``'s fingerprint except what identifies the input or the
    output's shape (:data:`NON_EMBEDDING_KEYS`: ``input``, ``column``, ``keep``,
    ``partitions``, ``library``): so the model (content or repo and commit, prompt,
    prompt name, ``model_kwargs``, compute dtype), ``normalize``, ``precision``,
    ``truncate_dim``, ``dimension``, and any option declared later that changes embeddings
    (long-text mode...: the fingerprint records those by name), are all compared.
    Conservative: an unknown key counts.

    Examples
    --------
    >>> fp = {"input": "ab12", "column": "text", "keep": [], "partitions": 3, "library": "0.1.0",
    ...       "model": {"kind": "path", "repo_id": "org/m", "commit": "c0"}, "normalize": False,
    ...       "precision": "float32", "truncate_dim": None, "dimension": 384}
    >>> sorted(embedding_identity(fp))
    ['dimension', 'model', 'normalize', 'precision', 'truncate_dim']
    """
    return {k: v for k, v in fingerprint.items() if k not in NON_EMBEDDING_KEYS}


def _show(key: str, value: Any) -> str:
    if key == "model":
        name = model_name(value) or repr(value)
        extras = {k: v for k, v in (value or {}).items()
                  if k not in ("kind", "repo_id", "commit", "digest", "object") and v is not None} \
            if isinstance(value, dict) else {}
        return name + (f" ({', '.join(f'{k}={v!r}' for k, v in sorted(extras.items()))})" if extras else "")
    return f"{key}={value!r}"


def compatible(old_output: OutputStore, identity: dict) -> str | None:
    """None when ``old_output``'s current run embedded texts as ``identity`` says, else a one-line reason.

    Parameters
    ----------
    old_output : OutputStore
        An earlier output.
    identity : dict
        The new run's :func:`embedding_identity` (of its fingerprint).

    Raises
    ------
    SurgeInputError
        ``old_output`` holds no dask-surge run.

    Examples
    --------
    >>> import tempfile, pandas as pd, dask.dataframe as dd, dask_surge
    >>> from dask_surge.testing import checksum_model
    >>> out = tempfile.mkdtemp()
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    >>> _ = dask_surge.encode(ddf, "text", output=out, model=checksum_model, scheduler="sync", progress=False)
    >>> from dask_surge.io.manifest import existing_run
    >>> old = OutputStore.open(out)
    >>> ident = embedding_identity(existing_run(old).fingerprint)
    >>> compatible(old, ident) is None
    True
    >>> compatible(old, {**ident, "precision": "float16"})
    "it was made with precision='float32', this run uses precision='float16'"
    """
    old = embedding_identity(existing_run(old_output).fingerprint)
    keys = sorted(set(old) | set(identity), key=lambda k: (k != "model", k))
    diffs = [k for k in keys if old.get(k) != identity.get(k)]
    if not diffs:
        return None
    return "; ".join(f"it was made with {_show(k, old.get(k))}, this run uses {_show(k, identity.get(k))}"
                     for k in diffs)


# -- matches ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matches:
    """What :meth:`ReuseIndex.lookup` found for each query hash.

    Query ``i`` was found when ``found[i]``; its old rows are the run of ``count[i]``
    consecutive rows from row ``row[i]`` of file ``file[i]`` of old output ``source[i]``
    (one row per text; a text's chunk rows in chunk order with long-text chunking).
    :meth:`ReuseIndex.fetch` returns the found queries' runs one after another:
    query ``i``'s rows are ``offsets[i]:offsets[i + 1]`` there.
    """

    found: np.ndarray   # bool (n,)
    source: np.ndarray  # int32 (n,): index into the index's outputs, -1 when not found
    file: np.ndarray    # int64 (n,): file id within that output
    row: np.ndarray     # int64 (n,): first row of the run in that file
    count: np.ndarray   # int64 (n,): rows in the run, 0 when not found

    @property
    def offsets(self) -> np.ndarray:
        """``(n + 1,)`` int64: where each query's rows start in :meth:`ReuseIndex.fetch`'s table."""
        return np.concatenate([[0], np.cumsum(self.count)]).astype(np.int64)

    @property
    def hits(self) -> int:
        return int(self.found.sum())

    @property
    def rows(self) -> int:
        return int(self.count.sum())

    def __len__(self) -> int:
        return len(self.found)

    @classmethod
    def empty(cls, n: int) -> Matches:
        return cls(np.zeros(n, bool), np.full(n, -1, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64),
                   np.zeros(n, np.int64))


@dataclass(frozen=True)
class Reused:
    """What :meth:`ReuseIndex.lookup` found and copied.

    ``found[i]`` says whether query ``i`` was found; the found queries' runs follow one
    another, in query order, in ``payload`` (the model's output columns, their stored Arrow
    values: ``embedding`` for a dense model) and ``columns``
    (NumPy arrays, e.g. the chunk columns): the ``j``-th found query has ``counts[j]``
    rows there (1, or its chunks). ``may_be_cut[j]`` is True when the file it was copied from
    holds texts cut at the model's window (its commit record counts some, or could not tell):
    whether this one was is known only by tokenizing it. Where it is False the text was not cut.
    """

    matches: Matches
    counts: np.ndarray  # int64 (hits,)
    payload: dict[str, pa.Array]
    columns: dict[str, np.ndarray]
    may_be_cut: np.ndarray  # bool (hits,)

    @property
    def embedding(self) -> pa.Array:
        """A dense output's ``embedding`` values."""
        return self.payload[EMBEDDING]

    @property
    def found(self) -> np.ndarray:
        return self.matches.found


# -- the index of one output --------------------------------------------------------------


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


class _LRU(OrderedDict):
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


class _OutputIndex:
    """The index of one earlier output (see the module docstring)."""

    def __init__(self, store: OutputStore, *, bits: int | None, spill_bytes: int,
                 max_buckets: int, rebuild: bool, bucket_entries: int = BUCKET_ENTRIES) -> None:
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
        self._buckets = _LRU(max_buckets)
        self._old_bits: int | None = None  # of an index found invalid: rebuilt with them
        self.meta = None if rebuild else self._valid_meta()
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
            meta = self._valid_meta()
            if meta is not None:
                return meta
        return self._valid_meta()

    # -- validity
    def _valid_meta(self) -> dict | None:
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
            if meta.get("format") != INDEX_FORMAT or meta.get("algorithm") != HASH_ALGORITHM \
                    or meta.get("run") != self.manifest.run_id or meta.get("complete") != self.complete:
                return None
            if not len(meta["sha256"]) == len(meta["bytes"]) == len(meta["truncated"]) == len(meta["files"]):
                return None
            present = set(self._ls(self.root))
            if not set(meta["files"]) <= present:
                return None  # a file it names is gone (repaired and rerun): stale
            names = set(self._ls(self.dir))
            for b, n in enumerate(meta["bucket_entries"]):
                if n and _bucket_name(b) not in names:
                    return None
            if len(meta["bucket_entries"]) != 1 << int(meta["bits"]):
                return None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return meta

    def _ls(self, path: str) -> list[str]:
        return self.store.listdir(path)

    # -- build
    def _records(self) -> list:
        return list(self.manifest.committed().values())

    def build(self, *, bits: int | None = None, spill_bytes: int = 32 << 20) -> dict:
        """Build (or rebuild) the index; returns its meta. Memory: ~2.5x ``spill_bytes`` while spilling
        (plus one row group's hashes), then ~4x one bucket while sorting it."""
        records = self._records()
        files = [r.file for r in records]
        checks = {"sha256": [r.sha256 for r in records], "bytes": [r.bytes for r in records],
                  "truncated": [r.truncated for r in records]}
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
                        f.write(block[bounds[b]: bounds[b + 1]].tobytes())
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
                meta = {"format": INDEX_FORMAT, "algorithm": HASH_ALGORITHM, "run": self.manifest.run_id,
                        "complete": self.complete, "bits": bits, "rows": rows, "files": files, **checks,
                        "chunked": bool(chunked), "bucket_entries": bucket_entries, "built": time.time()}
                self.store.write(f"{self.dir}/meta.json", json.dumps(meta, sort_keys=True).encode())
                keep = {_bucket_name(b) for b in range(nb) if bucket_entries[b]}
                for name in self._ls(self.dir):  # buckets of an index built before with other bits
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
            raise self._damaged(name, f"has sha256 {digest.hexdigest()[:16]}..., its commit record says "
                                      f"{want[:16]}...")

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
            algo = (schema.field(TEXT_HASH).metadata or {}).get(HASH_METADATA_KEY, HASH_ALGORITHM.encode()).decode()
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
                raise _Damaged(f"{path}: {type(err).__name__}: {err}") from err
            if arr.dtype != np.uint64 or arr.shape != (4, int(self.entries[b])):
                raise _Damaged(f"{path}: shape {arr.shape} {arr.dtype}, expected (4, {int(self.entries[b])}) uint64")
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
            idx = order[bounds[b]: bounds[b + 1]]
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
                k = int(left[j]) + int(np.searchsorted(lo[left[j]: right[j]], qlo[j]))
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


class _Damaged(Exception):
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


class ReuseIndex:
    """Find texts of earlier complete outputs by hash and copy their stored embeddings.

    Parameters
    ----------
    outputs : str or sequence of str
        Earlier output directories, in order of preference (a hash found in several is
        taken from the first).
    identity : dict, optional
        The new run's :func:`embedding_identity`: an output made otherwise is refused
        (:func:`compatible`'s reason in the error). None: not checked.
    storage_options : dict, optional
        fsspec options for the outputs.
    bits : int, optional
        Buckets ``2**bits`` of a newly built index (default: from the row count, so a
        bucket holds ~``bucket_entries``); an existing index keeps its own.
    bucket_entries : int
        Entries per bucket a newly built index aims at (:data:`BUCKET_ENTRIES`).
    spill_bytes : int
        Memory a build buffers before spilling to disk.
    cache_bytes : int
        Bound on the row groups :meth:`fetch` keeps decoded (an LRU per index).
    max_open : int
        Bound on open part files and memory-mapped buckets (each an LRU per output).
    rebuild : bool
        Rebuild the indexes even when valid ones exist.

    Raises
    ------
    SurgeInputError
        An output holds no run, is not complete, has no ``text_hash`` column (written
        before text hashes were recorded), or was embedded otherwise than ``identity``.

    Examples
    --------
    Given ``old``, an earlier complete output, and ``texts``, a SuperBatch's texts::

        index = ReuseIndex(old, identity=embedding_identity(new_fingerprint))
        got = index.lookup(text_hashes(texts))
        got.found        # bool per text
        got.counts       # rows per found text (1, or its chunks), in order
        got.embedding    # their stored embeddings, one run per found text, byte for byte
        got.columns      # with chunking: chunk, char_start, char_end, tokens

    >>> import tempfile
    >>> ReuseIndex(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeInputError: ... holds no dask-surge run (...
    """

    def __init__(self, outputs: str | Sequence[str], *, identity: dict | None = None,
                 storage_options: dict | None = None, bits: int | None = None,
                 bucket_entries: int = BUCKET_ENTRIES, spill_bytes: int = 32 << 20,
                 cache_bytes: int = 64 << 20, max_open: int = 16, rebuild: bool = False) -> None:
        paths = [outputs] if isinstance(outputs, (str, os.PathLike)) else list(outputs)
        if not paths:
            raise SurgeValueError("reuse=[] names no output. Fix: pass one or more earlier output paths, or "
                                  "leave reuse= out.")
        stores = [OutputStore.open(p, storage_options) for p in paths]
        if identity is not None:
            for p, store in zip(paths, stores):
                why = compatible(store, identity)
                if why is not None:
                    raise SurgeInputError(
                        f"reuse={str(p)!r} cannot be reused: {why}. Its embeddings would differ from this "
                        "run's. Fix: leave it out of reuse=, or run with the options it was made with."
                    )
        self.outputs = [str(p) for p in paths]
        self.stores = stores
        self._opts = {"bits": bits, "spill_bytes": spill_bytes, "max_buckets": max_open,
                      "bucket_entries": bucket_entries}
        self.indexes = [_OutputIndex(store, rebuild=rebuild, **self._opts) for store in stores]  # type: ignore[arg-type]
        self._files = _LRU(max_open)
        self._groups = _LRU(1 << 16, cache_bytes)
        # (output, file) -> the file's signature (size, mtime, inode or ETag...) when it was hashed and
        # found as recorded: a file is hashed again, and its cached row groups dropped, once it changes
        self._verified: dict[tuple[int, int], tuple] = {}
        self._lock = threading.RLock()  # a worker's SuperBatch tasks share one index from several threads

    def __repr__(self) -> str:
        return f"ReuseIndex({self.outputs!r}, entries={self.entries})"

    @property
    def entries(self) -> int:
        """Distinct hashes indexed, over all outputs."""
        return int(sum(ix.entries.sum() for ix in self.indexes))

    @property
    def chunked(self) -> bool:
        """True when the outputs hold several rows per text (long-text chunking)."""
        return any(ix.chunked for ix in self.indexes)

    def lookup(self, hashes: np.ndarray, columns: Sequence[str] | None = None,
               payload: Sequence[str] = (EMBEDDING,)) -> Reused:
        """:meth:`find` then :meth:`fetch`: which of ``hashes`` were committed, and their stored rows.

        ``columns``: what to copy besides the model's output; default: the chunk columns
        (``chunk``, ``char_start``, ``char_end``, ``tokens``) when the outputs are chunked, else none.
        ``payload``: the model's output columns (:data:`~dask_surge.io.layout.FAMILY_COLUMNS` of its
        family: ``embedding`` for a dense model), copied as stored.
        """
        extra = tuple(columns) if columns is not None else (tuple(CHUNK_COLUMNS) if self.chunked else ())
        wanted = (*extra, *payload)
        with self._lock:
            matches = self.find(hashes)
            try:
                table = self.fetch(matches, wanted)
            except SurgeInputError:
                if not self._reopen_rebuilt():
                    raise
                matches = self.find(hashes)  # found again in the index as it is now
                table = self.fetch(matches, wanted)
        hit = matches.found
        may_be_cut = np.zeros(matches.hits, dtype=bool)
        for s, ix in enumerate(self.indexes):
            here = matches.source[hit] == s
            may_be_cut[here] = ix.may_be_cut[matches.file[hit][here]]
        return Reused(matches, matches.count[hit], {c: table.column(c).combine_chunks() for c in payload},
                      {c: table.column(c).to_numpy() for c in extra}, may_be_cut)

    def _reopen_rebuilt(self) -> bool:
        """Reopen the outputs whose index on disk is no longer the one open here (it was rebuilt
        since: the output was repaired and rerun); True when there was one."""
        stale = [s for s, ix in enumerate(self.indexes) if ix._valid_meta() != ix.meta]
        for s in stale:
            self.indexes[s] = _OutputIndex(self.stores[s], rebuild=False, **self._opts)  # type: ignore[arg-type]
            self._verified = {k: v for k, v in self._verified.items() if k[0] != s}
        if stale:
            self._files.clear()
            self._groups.clear()
        return bool(stale)

    def find(self, hashes: np.ndarray) -> Matches:
        """Where each of ``hashes`` (``(n, 2)`` uint64, as :func:`text_hashes` returns) was committed.

        Vectorized per bucket; memory: the queries plus the touched pages of the buckets.
        An index file found damaged is rebuilt once, and the lookup repeated.
        """
        with self._lock:
            return self._find(hashes)

    def _find(self, hashes: np.ndarray) -> Matches:
        q = np.ascontiguousarray(np.asarray(hashes, dtype=np.uint64).reshape(-1, 2))
        m = Matches.empty(len(q))
        todo = np.arange(len(q))
        for s, ix in enumerate(self.indexes):
            if not len(todo):
                break
            try:
                found, file, row, count = ix.lookup(q[todo])
            except _Damaged:  # rebuilt as it was (its bucket count)
                opts = {**self._opts, "bits": ix.bits}
                self.indexes[s] = ix = _OutputIndex(self.stores[s], rebuild=True, **opts)  # type: ignore[arg-type]
                self._verified = {k: v for k, v in self._verified.items() if k[0] != s}
                found, file, row, count = ix.lookup(q[todo])
            at = todo[found]
            m.found[at], m.source[at], m.file[at], m.row[at], m.count[at] = True, s, file[found], row[found], count[found]
            todo = todo[~found]
        return m

    def _group(self, s: int, f: int, g: int, columns: tuple[str, ...]) -> pa.Table:
        pf, _ = self._files.get_or((s, f), lambda: self._open(s, f))
        return self._groups.get_or((s, f, g, columns), lambda: pf.read_row_group(g, columns=list(columns)),
                                   lambda t: t.nbytes)

    def fetch(self, matches: Matches, columns: Sequence[str] = ("embedding",)) -> pa.Table:
        """The stored rows of the found queries' runs, in query order (``matches.offsets``).

        Reads only the row groups holding those rows (each decoded once while in the LRU
        of ``cache_bytes``); values are the stored Arrow values, byte for byte. Each file is
        first checked against its commit record's sha256 (once while this index is open).

        Parameters
        ----------
        matches : Matches
            From :meth:`lookup`.
        columns : sequence of str
            Columns to copy, e.g. ``("embedding",)`` or, with chunking,
            ``("chunk", "char_start", "char_end", "tokens", "embedding")``.

        Raises
        ------
        SurgeInputError
            A file to copy from differs from its commit record, is missing or cannot be read.
        """
        with self._lock:
            return self._fetch(matches, tuple(columns))

    def _fetch(self, matches: Matches, columns: tuple[str, ...]) -> pa.Table:
        sel = np.flatnonzero(matches.found)
        counts = matches.count[sel]
        total = int(counts.sum())
        # every old row, in output order: (source, file, row)
        rep = np.repeat(np.arange(len(sel)), counts)
        within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        src = matches.source[sel][rep].astype(np.int64)
        fil = matches.file[sel][rep]
        row = matches.row[sel][rep] + within
        order = np.lexsort((row, fil, src))
        pieces: list[pa.Table] = []
        if total:
            s_o, f_o, r_o = src[order], fil[order], row[order]
            change = np.flatnonzero((np.diff(s_o) != 0) | (np.diff(f_o) != 0)) + 1
            for a, b in zip(np.concatenate([[0], change]), np.concatenate([change, [total]])):
                s, f = int(s_o[a]), int(f_o[a])
                self._check_unchanged(s, f)
                try:
                    pieces += self._rows(s, f, r_o[a:b], columns)
                except (OSError, pa.ArrowException) as err:
                    ix = self.indexes[s]
                    raise ix.unreadable(ix.files[f], err) from err
        if not pieces:
            schema = self._schema(columns)
            return schema.empty_table()
        table = pa.concat_tables(pieces).combine_chunks()
        inverse = np.empty(total, dtype=np.int64)
        inverse[order] = np.arange(total)
        return table.take(pa.array(inverse))

    def _check_unchanged(self, s: int, f: int) -> None:
        """Hash file ``f`` of output ``s`` against its commit record unless it was hashed already and
        has not changed since (same signature: size, mtime and inode locally, ETag on a store). A file
        changed behind this index's back (damaged, replaced) is hashed again, and what was cached of
        it (its open handle, its decoded row groups) is dropped first."""
        ix = self.indexes[s]
        try:
            signature = ix.signature(f)
        except OSError as err:
            raise ix.unreadable(ix.files[f], err) from err
        if self._verified.get((s, f)) == signature:
            return
        self._verified.pop((s, f), None)
        self._files.pop((s, f), None)
        for key in [k for k in self._groups if k[:2] == (s, f)]:
            self._groups.discard(key)
        ix.check_file(f)
        self._verified[(s, f)] = signature

    def _rows(self, s: int, f: int, rows: np.ndarray, columns: tuple[str, ...]) -> list[pa.Table]:
        """``columns`` of rows ``rows`` (sorted) of file ``f`` of output ``s``, a table per row group."""
        _, starts = self._files.get_or((s, f), lambda: self._open(s, f))
        g_of = np.searchsorted(starts, rows, side="right") - 1
        cuts = np.flatnonzero(np.diff(g_of)) + 1
        pieces = []
        for c0, c1 in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(rows)]])):
            g = int(g_of[c0])
            pieces.append(self._group(s, f, g, columns).take(pa.array(rows[c0:c1] - starts[g])))
        return pieces

    def _open(self, s: int, f: int):
        ix = self.indexes[s]
        path = f"{ix.root}/{ix.files[f]}"
        pf = pq.ParquetFile(ix.store.source(path))
        starts = np.concatenate([[0], np.cumsum([pf.metadata.row_group(i).num_rows
                                                 for i in range(pf.num_row_groups)])]).astype(np.int64)
        return pf, starts

    def _schema(self, columns: tuple[str, ...]) -> pa.Schema:
        for s, ix in enumerate(self.indexes):
            if ix.files:
                try:
                    pf, _ = self._files.get_or((s, 0), lambda s=s: self._open(s, 0))
                except (OSError, pa.ArrowException) as err:
                    raise ix.unreadable(ix.files[0], err) from err
                return pa.schema([pf.schema_arrow.field(c) for c in columns])
        return pa.schema([pa.field(c, pa.null()) for c in columns])

    def close(self) -> None:
        """Drop cached row groups, open files and mapped buckets."""
        self._groups.clear()
        self._files.clear()
        for ix in self.indexes:
            ix._buckets.clear()

    def __enter__(self) -> ReuseIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN: OrderedDict = OrderedDict()
_OPEN_LOCK = threading.Lock()
#: indexes :func:`open_index` keeps open per process
OPEN_INDEXES = 4


def open_index(outputs: str | Sequence[str], storage_options: dict | None = None,
               identity: dict | None = None) -> ReuseIndex:
    """The process's :class:`ReuseIndex` of ``outputs``, opened (and built, if absent) once.

    For a worker's SuperBatch tasks: each call with the same outputs returns the same
    open index (the last :data:`OPEN_INDEXES` are kept), so buckets and row groups stay
    cached between SuperBatches; an output whose current run changed since (an in-place
    update completed) is opened afresh, and one whose index was rebuilt since (the output was
    repaired and rerun) when a file the open index names is found gone or changed. Build the
    index on the client first (``ReuseIndex(outputs)``) so that workers only open it.

    Examples
    --------
    >>> import tempfile
    >>> open_index(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeInputError: ... holds no dask-surge run (...
    """
    paths = (str(outputs),) if isinstance(outputs, (str, os.PathLike)) else tuple(str(p) for p in outputs)
    key = (paths, json.dumps(storage_options or {}, sort_keys=True, default=str))
    with _OPEN_LOCK:
        if key in _OPEN:
            cached = _OPEN[key]
            current = [current_run(store) for store in cached.stores]
            if all(m is not None and m.run_id == ix.manifest.run_id for m, ix in zip(current, cached.indexes)):
                _OPEN.move_to_end(key)
                return cached
            _OPEN.pop(key).close()  # an output was replaced since (an in-place update completed)
        index = ReuseIndex(paths, storage_options=storage_options, identity=identity)
        _OPEN[key] = index
        while len(_OPEN) > OPEN_INDEXES:
            _OPEN.popitem(last=False)[1].close()
        return index
