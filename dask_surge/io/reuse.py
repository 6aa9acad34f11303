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

The index of each output is :class:`~dask_surge.io.hashindex.OutputIndex` (its layout on disk,
its build and its lookups: :mod:`dask_surge.io.hashindex`).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SurgeInputError, SurgeValueError
from .hashindex import BUCKET_ENTRIES, LRU, IndexDamaged, OutputIndex
from .layout import CHUNK_COLUMNS, EMBEDDING
from .manifest import current_run, existing_run
from .readers import model_name
from .store import OutputStore

__all__ = [
    "identity_difference",
    "embedding_identity",
    "compatible",
    "Matches",
    "Reused",
    "ReuseIndex",
    "open_index",
]

#: fingerprint keys that identify the input or the output's shape, not how a text is embedded
NON_EMBEDDING_KEYS = ("input", "column", "keep", "partitions", "library")


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
        extras = (
            {
                k: v
                for k, v in (value or {}).items()
                if k not in ("kind", "repo_id", "commit", "digest", "object") and v is not None
            }
            if isinstance(value, dict)
            else {}
        )
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
    return identity_difference(embedding_identity(existing_run(old_output).fingerprint), identity)


def identity_difference(old: dict, new: dict, *, now: str = "this run uses") -> str | None:
    """How the embedding identity ``new`` differs from ``old``, in words (None: the same).

    Examples
    --------
    >>> identity_difference({"normalize": False}, {"normalize": True})
    'it was made with normalize=False, this run uses normalize=True'
    >>> identity_difference({"normalize": False}, {"normalize": False}) is None
    True
    """
    keys = sorted(set(old) | set(new), key=lambda k: (k != "model", k))
    diffs = [k for k in keys if old.get(k) != new.get(k)]
    if not diffs:
        return None
    return "; ".join(f"it was made with {_show(k, old.get(k))}, {now} {_show(k, new.get(k))}" for k in diffs)


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

    found: np.ndarray  # bool (n,)
    source: np.ndarray  # int32 (n,): index into the index's outputs, -1 when not found
    file: np.ndarray  # int64 (n,): file id within that output
    row: np.ndarray  # int64 (n,): first row of the run in that file
    count: np.ndarray  # int64 (n,): rows in the run, 0 when not found

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
        return cls(
            np.zeros(n, bool),
            np.full(n, -1, np.int32),
            np.zeros(n, np.int64),
            np.zeros(n, np.int64),
            np.zeros(n, np.int64),
        )


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

    def __init__(
        self,
        outputs: str | Sequence[str],
        *,
        identity: dict | None = None,
        storage_options: dict | None = None,
        bits: int | None = None,
        bucket_entries: int = BUCKET_ENTRIES,
        spill_bytes: int = 32 << 20,
        cache_bytes: int = 64 << 20,
        max_open: int = 16,
        rebuild: bool = False,
    ) -> None:
        paths = [outputs] if isinstance(outputs, (str, os.PathLike)) else list(outputs)
        if not paths:
            raise SurgeValueError(
                "reuse=[] names no output. Fix: pass one or more earlier output paths, or leave reuse= out."
            )
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
        self._opts = {
            "bits": bits,
            "spill_bytes": spill_bytes,
            "max_buckets": max_open,
            "bucket_entries": bucket_entries,
        }
        self.indexes = [OutputIndex(store, rebuild=rebuild, **self._opts) for store in stores]  # type: ignore[arg-type]
        self._files = LRU(max_open)
        self._groups = LRU(1 << 16, cache_bytes)
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

    def lookup(
        self, hashes: np.ndarray, columns: Sequence[str] | None = None, payload: Sequence[str] = (EMBEDDING,)
    ) -> Reused:
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
        return Reused(
            matches,
            matches.count[hit],
            {c: table.column(c).combine_chunks() for c in payload},
            {c: table.column(c).to_numpy() for c in extra},
            may_be_cut,
        )

    def _reopen_rebuilt(self) -> bool:
        """Reopen the outputs whose index on disk is no longer the one open here (it was rebuilt
        since: the output was repaired and rerun); True when there was one."""
        stale = [s for s, ix in enumerate(self.indexes) if ix.valid_meta() != ix.meta]
        for s in stale:
            self.indexes[s] = OutputIndex(self.stores[s], rebuild=False, **self._opts)  # type: ignore[arg-type]
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
            except IndexDamaged:  # rebuilt as it was (its bucket count)
                opts = {**self._opts, "bits": ix.bits}
                self.indexes[s] = ix = OutputIndex(self.stores[s], rebuild=True, **opts)  # type: ignore[arg-type]
                self._verified = {k: v for k, v in self._verified.items() if k[0] != s}
                found, file, row, count = ix.lookup(q[todo])
            at = todo[found]
            m.found[at], m.source[at], m.file[at], m.row[at], m.count[at] = (
                True,
                s,
                file[found],
                row[found],
                count[found],
            )
            todo = todo[~found]
        return m

    def _group(self, s: int, f: int, g: int, columns: tuple[str, ...]) -> pa.Table:
        pf, _ = self._files.get_or((s, f), lambda: self._open(s, f))
        return self._groups.get_or(
            (s, f, g, columns), lambda: pf.read_row_group(g, columns=list(columns)), lambda t: t.nbytes
        )

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
        starts = np.concatenate(
            [[0], np.cumsum([pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])]
        ).astype(np.int64)
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
            ix.clear()

    def __enter__(self) -> ReuseIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN: OrderedDict = OrderedDict()
_OPEN_LOCK = threading.Lock()
#: indexes :func:`open_index` keeps open per process
OPEN_INDEXES = 4


def open_index(
    outputs: str | Sequence[str], storage_options: dict | None = None, identity: dict | None = None
) -> ReuseIndex:
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
            if all(
                m is not None and m.run_id == ix.manifest.run_id for m, ix in zip(current, cached.indexes)
            ):
                _OPEN.move_to_end(key)
                return cached
            _OPEN.pop(key).close()  # an output was replaced since (an in-place update completed)
        index = ReuseIndex(paths, storage_options=storage_options, identity=identity)
        _OPEN[key] = index
        while len(_OPEN) > OPEN_INDEXES:
            _OPEN.popitem(last=False)[1].close()
        return index
