"""What one SuperBatch task does: gather its rows, encode them in one call, frame the result."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from ..engine.batching import CallShape
from ..engine.long_texts import TextEmbeddings, TextTooLong, no_tokenizer
from ..engine.tokenizing import unreadable_text
from ..errors import SurgeInputError, SurgeModelError, SurgeValueError
from ..families import DENSE, MULTIVECTOR, SPARSE
from ..io.arrow import embedding_array, to_host
from ..io.frames import FrameRows
from ..io.hashing import arrow_strings, hash_column, text_hashes
from ..io.layout import (
    CHUNK_COLUMNS,
    EMBEDDING,
    FAMILY_COLUMNS,
    INDICES,
    PARTITION,
    ROW,
    TEXT_HASH,
    TOKENS,
    VALUES,
    VECTORS,
)
from ..io.multivector import multivector_arrays
from ..io.precision import truncate
from ..io.reuse import open_index
from ..io.sparse import sparse_arrays
from ..io.texts import ArrowTexts, join_texts, take_texts
from ..models.encoders import Encoder
from ..options import DEFAULT_CHUNK_OVERLAP, LongTexts
from ..planning.policy import Span

__all__ = [
    "SuperBatchRows",
    "SuperBatchTask",
    "distinct",
    "expand",
    "texts_of",
    "arrow_texts",
    "partition_digest",
    "concat_column",
]


def distinct(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first occurrence of each distinct row of ``hashes`` (``(n, 2)`` uint64), in order of
    appearance, and for each row the index of its distinct row in that list.

    Examples
    --------
    >>> h = np.array([[1, 2], [3, 4], [1, 2], [5, 6]], dtype=np.uint64)
    >>> first, inverse = distinct(h)
    >>> first.tolist(), inverse.tolist()
    ([0, 1, 3], [0, 1, 0, 2])
    >>> [a.tolist() for a in distinct(np.array([[1, 2], [1, 3], [4, 2]], dtype=np.uint64))]  # high halves equal
    [[0, 1, 2], [0, 1, 2]]
    """
    n = len(hashes)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    hi = np.sort(hashes[:, 0])
    if not (hi[1:] == hi[:-1]).any():  # distinct high halves: every row is distinct (the usual case)
        return np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    order = np.lexsort((np.arange(n), hashes[:, 1], hashes[:, 0]))  # stable: equal hashes by position
    s = hashes[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (s[1:] != s[:-1]).any(axis=1)
    group = np.cumsum(new) - 1  # group of each sorted row; the group's first row is its first occurrence
    firsts = order[new]
    rank = np.empty(len(firsts), np.int64)
    rank[np.argsort(firsts, kind="stable")] = np.arange(len(firsts))  # groups renumbered by appearance
    inverse = np.empty(n, np.int64)
    inverse[order] = rank[group]
    return np.sort(firsts), inverse


def expand(counts: np.ndarray, which: np.ndarray) -> np.ndarray:
    """Row indices of the blocks ``which`` (in order) when block ``i`` is ``counts[i]`` consecutive rows.

    Examples
    --------
    >>> expand(np.array([2, 0, 3]), np.array([2, 0, 0])).tolist()
    [2, 3, 4, 0, 1, 0, 1]
    """
    starts = (
        np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        if len(counts)
        else np.zeros(0, np.int64)
    )
    reps = counts[which].astype(np.int64)
    total = int(reps.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.repeat(starts[which] - (np.cumsum(reps) - reps), reps)
    return first + np.arange(total, dtype=np.int64)


def concat_column(frames: Sequence[pd.DataFrame], column: str) -> pd.Series:
    """Column ``column`` of ``frames`` end to end, indexed 0..n-1 (as ``pd.concat(..., ignore_index=True)``).

    When every frame holds it with one dtype, its arrays are joined directly (one
    ``_concat_same_type`` of the pandas extension-array interface), without the index
    alignment ``pd.concat`` does per piece (a SuperBatch of small partitions has many).
    Otherwise ``pd.concat``, which promotes mixed dtypes.

    Examples
    --------
    >>> a, b = pd.DataFrame({"x": [1, 2]}), pd.DataFrame({"x": [3]}, index=[7])
    >>> concat_column([a, b], "x").tolist(), concat_column([a, b], "x").index.tolist()
    ([1, 2, 3], [0, 1, 2])
    >>> concat_column([a, pd.DataFrame({"x": [0.5]})], "x").tolist()  # int64 and float64: promoted
    [1.0, 2.0, 0.5]
    """
    series = [frame[column] for frame in frames]
    if not series:
        return pd.Series([], dtype=object, name=column)
    arrays = [s.array for s in series]
    if all(a.dtype == arrays[0].dtype for a in arrays[1:]):
        return pd.Series(type(arrays[0])._concat_same_type(arrays), name=column)
    return pd.concat(series, ignore_index=True)


def partition_digest(series: pd.Series) -> str:
    """A digest of a partition's texts, in order (nulls included): what a commit records for a
    partition it covers in part, so a recomputation on resume is checked against it.

    Examples
    --------
    >>> import pandas as pd
    >>> a = partition_digest(pd.Series(["x", None, "y"]))
    >>> a == partition_digest(pd.Series(["x", None, "y"])), a == partition_digest(pd.Series(["x", None, "z"]))
    (True, False)
    >>> len(a)
    32
    """
    import hashlib

    hashes = pd.util.hash_pandas_object(series.reset_index(drop=True), index=False).to_numpy()
    return hashlib.blake2b(hashes.tobytes() + len(series).to_bytes(8, "little"), digest_size=16).hexdigest()


def arrow_texts(series: pd.Series) -> ArrowTexts | None:
    """The texts of an Arrow-backed string column with no null, kept in Arrow; else None.

    Every value of such a column is a str and none is null, so it needs none of the checks
    :func:`texts_of` makes otherwise (``isna()`` and the type checks), and the tokenizer helpers take its UTF-8 bytes whole (:class:`~dask_surge.io.texts.ArrowTexts`).

    Examples
    --------
    >>> arrow_texts(pd.Series(["a", "b"], dtype="string[pyarrow]")).tolist()
    ['a', 'b']
    >>> arrow_texts(pd.Series(["a", None], dtype="string[pyarrow]")) is None
    True
    """
    strings = arrow_strings(series)
    return ArrowTexts(strings) if strings is not None and strings.null_count == 0 else None


def texts_of(
    series: pd.Series, partition: int, start: int, on_null: str
) -> tuple[list[str] | ArrowTexts, np.ndarray | None]:
    """Return the texts of ``series`` as a sequence of ``str`` (an :class:`~dask_surge.io.texts.ArrowTexts`
    for Arrow strings with no null, else a list), enforcing the null policy, and the mask of
    rows kept (``None``: all of them).

    ``on_null`` is ``"error"`` (raise), ``"empty"`` (encode ``""``) or ``"skip"``
    (leave the row out: the mask is False there).

    Raises
    ------
    SurgeInputError
        On a null text (with ``on_null="error"``) or a value that is not a string,
        naming the first offending ``(partition, row)``.

    Examples
    --------
    >>> import pandas as pd
    >>> texts_of(pd.Series(["a", None, "c"]), 0, 0, "skip")
    (['a', 'c'], array([ True, False,  True]))
    >>> texts, kept = texts_of(pd.Series(["a", "b"], dtype="string[pyarrow]"), 0, 0, "error")  # Arrow, no null
    >>> texts.tolist(), kept
    (['a', 'b'], None)
    """
    values = arrow_texts(series)
    if values is not None:
        return values, None
    nulls = series.isna().to_numpy()
    kept = None
    if nulls.any():
        if on_null == "error":
            first = int(np.flatnonzero(nulls)[0])
            raise SurgeInputError(
                f"text column {series.name!r} has {int(nulls.sum())} null value(s) in partition "
                f"{partition}, first at row {start + first}: null texts are refused by default so "
                "that no row is silently dropped or invented. Fix: clean the column, or pass "
                "on_null='empty' to encode nulls as the empty string, or on_null='skip' to leave "
                "them out and record their (partition, row)."
            )
        if on_null == "skip":
            kept = ~nulls
            series = series[kept]
        else:
            if isinstance(series.dtype, pd.CategoricalDtype):  # "" is rarely one of its categories
                series = series.astype(object)
            series = series.where(~nulls, "")
    values = series.tolist()
    rows = np.flatnonzero(kept) if kept is not None else None  # positions of the kept rows
    for i, v in enumerate(values):
        if type(v) is not str:
            if isinstance(v, str):  # str subclass (e.g. numpy.str_)
                values[i] = str(v)
                continue
            raise SurgeInputError(
                f"text column {series.name!r} holds a {type(v).__name__} ({v!r:.60}) in partition "
                f"{partition}, row {start + (i if rows is None else int(rows[i]))}: only strings can be encoded. Fix: convert the "
                f"column first, e.g. ddf[{series.name!r}] = ddf[{series.name!r}].astype(str)."
            )
    return values, kept


@dataclass(frozen=True)
class SuperBatchRows:
    """What one SuperBatch encoded.

    Attributes
    ----------
    frame : pandas.DataFrame
        The output rows (see :class:`SuperBatchTask`).
    skipped : list of (int, int)
        ``(partition, row)`` of the null texts left out (``on_null="skip"``).
    texts : int
        Input rows written (one or more output rows each).
    truncated : int
        Texts written here that were over the model's window and cut (``long_texts="truncate"``),
        those copied from a ``reuse`` output included; -1 when the model cannot tell (a callable
        without a tokenizer).
    encoded : int
        Distinct texts that went through the model (repeats are encoded once).
    reused : int
        Texts whose embeddings were copied from a ``reuse`` output.
    model_s : float
        Seconds the model's call took (tokenizing and forward passes; not gathering, hashing or
        framing): what the cost model's encode curve describes.
    shape : CallShape or None
        What that call's forward passes computed (sequences, real and padded tokens, forward
        passes), where the backend counts it (the fast engine); None otherwise.
    """

    frame: pd.DataFrame
    skipped: list
    texts: int
    truncated: int = 0
    encoded: int = 0
    reused: int = 0
    model_s: float = 0.0
    shape: CallShape | None = None


def _too_long(where: str, tokens: int, window: int) -> SurgeInputError:
    """The error for the text at ``where`` (partition and row), ``tokens`` long, with ``long_texts="error"``."""
    return SurgeInputError(
        f"the text at {where} is {tokens:,} tokens long, over the model's window of {window:,} tokens, and "
        "long_texts='error' refuses to cut it. What was committed before is kept. Fix: rerun with "
        "long_texts='truncate' (resumes this run: texts are cut at the window, as sentence-transformers "
        "does, and counted), or encode every token with long_texts='chunk' (a row per window) or 'mean' "
        "(their average), which make a new run (another output, or overwrite=True)."
    )


@dataclass(frozen=True)
class _Blocks:
    """The output rows of some distinct texts: ``counts[i]`` consecutive rows each (several in chunk mode);
    ``payload``: the model's output columns (``FAMILY_COLUMNS`` of its family), one value per row."""

    counts: np.ndarray
    payload: dict[str, pa.Array]
    chunks: dict[str, np.ndarray] | None = None  # CHUNK_COLUMNS, one value per row, in chunk mode

    @staticmethod
    def concat(blocks: list[_Blocks]) -> _Blocks:
        if len(blocks) == 1:  # nothing reused: no copy (one huge document's windows are many)
            return blocks[0]
        chunks = None
        if blocks[0].chunks is not None:
            chunks = {k: np.concatenate([b.chunks[k] for b in blocks]) for k in CHUNK_COLUMNS}  # type: ignore[index]
        return _Blocks(
            np.concatenate([b.counts for b in blocks]),
            {k: pa.concat_arrays([b.payload[k] for b in blocks]) for k in blocks[0].payload},
            chunks,
        )


def _runs(spans: Sequence[tuple[Span, int]], by_partition: dict) -> list[list[tuple[Span, int]]]:
    """``spans`` cut into runs of consecutive spans whose partitions are :class:`FrameRows` of one
    frame and whose rows follow each other there; any other span is a run of its own."""
    runs: list[list[tuple[Span, int]]] = []
    frame, end = None, -1
    for item in spans:
        span, part = item[0], by_partition[item[0].partition]
        if isinstance(part, FrameRows):
            if runs and part.frame is frame and part.start + span.start == end:
                runs[-1].append(item)
            else:
                runs.append([item])
            frame, end = part.frame, part.start + span.stop
        else:
            runs.append([item])
            frame, end = None, -1
    return runs


def _check_finite_values(values: np.ndarray, family: str) -> None:
    """Raise when a sparse or multi-vector model's values hold NaN or inf (as dense embeddings are checked)."""
    if values.size and not np.isfinite(values).all():
        raise SurgeModelError(
            f"the {family} model produced NaN or inf values in this SuperBatch: its output must be finite. This "
            "usually means a half-precision overflow or broken weights. Fix: pass dtype='float32', and check the model."
        )


@dataclass(frozen=True)
class SuperBatchTask:
    """Callable run by each SuperBatch task: ``(partitions, sb_index, spans) -> DataFrame``.

    The result has columns ``partition`` (int64), ``row`` (int64, offset within the
    partition), with ``long_texts="chunk"`` also ``chunk`` (int32), ``char_start`` and
    ``char_end`` (int64, so ``text[char_start:char_end]`` is the window's text) and
    ``tokens`` (int32), then the kept columns, ``text_hash`` (16 bytes: the text's
    content hash, :func:`dask_surge.io.hashing.text_hashes`) and the model's output: for a
    dense model ``embedding`` (fixed-size list of the stored precision: float32 by default),
    for a sparse one ``indices`` and ``values`` (pruned by ``sparse_top_k`` and
    ``sparse_threshold``, :mod:`dask_surge.io.sparse`), for a multi-vector one ``vectors`` and
    ``tokens`` (:mod:`dask_surge.io.multivector`); sorted by ``(partition, row[, chunk])``. With ``on_null="skip"`` null rows are left out;
    :meth:`encode` returns their ``(partition, row)``. Texts repeated within the
    SuperBatch go through the model once; texts a ``reuse`` output holds not at all:
    their stored rows are copied. With ``long_texts="truncate"`` or ``"error"`` the copied
    texts that may be over the window (from a file whose commit record counts texts cut
    there) are tokenized, only to count them as truncated or refuse them as an encoded
    text would be.
    """

    column: str
    keep: tuple[str, ...]
    encoder: Encoder
    normalize: bool = False
    precision: str = "float32"
    on_null: str = "error"
    truncate_dim: int | None = None
    long_texts: LongTexts = "truncate"
    chunk_overlap: int = DEFAULT_CHUNK_OVERLAP
    reuse: tuple[str, ...] = ()
    #: fsspec options of the ``reuse`` outputs on an object store (credentials: never in the token)
    reuse_storage_options: dict | None = field(default=None, repr=False)
    #: a sparse model's pruning: the most non-zeros a row keeps, and the weight below which one is dropped
    sparse_top_k: int | None = None
    sparse_threshold: float | None = None

    def __dask_tokenize__(self):
        return (
            "SuperBatchTask",
            self.column,
            self.keep,
            self.encoder.spec,
            self.normalize,
            self.precision,
            self.on_null,
            self.truncate_dim,
            self.long_texts,
            self.chunk_overlap,
            self.reuse,
            self.sparse_top_k,
            self.sparse_threshold,
        )

    @property
    def family(self) -> str:
        """What one text becomes (:attr:`~dask_surge.models.encoders.Encoder.family`), so which columns hold it."""
        return self.encoder.family

    @property
    def dimension(self) -> int:
        """Dimensions of the embeddings written (after ``truncate_dim``)."""
        return self.truncate_dim or self.encoder.dimension

    @property
    def chunked(self) -> bool:
        """True when the output has a row per token window (``long_texts="chunk"``)."""
        return self.long_texts == "chunk"

    def gather(self, parts: Sequence[pd.DataFrame], spans: Sequence[tuple[Span, int]]):
        """Slice the planned rows out of the input partitions, checking their sizes.

        Returns ``(blocks, texts, skipped)``: ``(partition of each row, row of each, frame
        of those rows)`` per block of rows, the texts to encode, and ``(partition, row)`` of
        skipped nulls. Consecutive spans whose partitions are :class:`~dask_surge.io.frames.FrameRows`
        of one frame, one after the other there (a unit's Parquet files, read together),
        are one block: one slice and one column of texts for all of them, not one per
        partition. A block whose texts are not all Arrow strings, or hold a null, is taken
        span by span, so that errors and skipped rows name their partition and row."""
        blocks, pieces, skipped = [], [], []
        by_partition = dict(zip(sorted({s.partition for s, _ in spans}), parts))
        for span, planned in spans:
            part = by_partition[span.partition]
            if len(part) != planned:
                raise SurgeInputError(
                    f"partition {span.partition} has {len(part)} rows but {planned} were planned: "
                    "the input changed between planning and execution (non-deterministic "
                    "partitions?). Nothing was written for it. Fix: persist or write the input "
                    "to Parquet first so every read returns the same rows."
                )
        for run in _runs(spans, by_partition):
            if len(run) > 1:
                block, values = self._run_block(run, by_partition)
                if values is not None:
                    blocks.append(block)
                    pieces.append(values)
                    continue
            for span, _ in run:
                part = to_host(by_partition[span.partition])
                piece = (
                    part if span.start == 0 and span.stop == len(part) else part.iloc[span.start : span.stop]
                )
                values, kept = texts_of(piece[self.column], span.partition, span.start, self.on_null)
                rows = np.arange(span.start, span.stop, dtype=np.int64)
                if kept is not None:
                    skipped += [(span.partition, int(r)) for r in rows[~kept]]
                    rows, piece = rows[kept], piece[kept]
                pieces.append(values)
                blocks.append((np.full(len(rows), span.partition, dtype=np.int64), rows, piece))
        return blocks, join_texts(pieces), skipped

    def _run_block(self, run, by_partition):
        """``((partitions, rows, frame), texts)`` of a run of spans over one frame, sliced once;
        ``(None, None)`` when its texts are not all Arrow strings without a null (see
        :func:`arrow_texts`: the caller then goes span by span)."""
        first, last = by_partition[run[0][0].partition], by_partition[run[-1][0].partition]
        frame = first.frame.iloc[first.start + run[0][0].start : last.start + run[-1][0].stop]
        texts = arrow_texts(frame[self.column])
        if texts is None:
            return None, None
        starts = np.array([s.start for s, _ in run], dtype=np.int64)
        counts = np.array([s.stop - s.start for s, _ in run], dtype=np.int64)
        ends = np.cumsum(counts)
        rows = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - counts - starts, counts)
        partitions = np.repeat(np.array([s.partition for s, _ in run], dtype=np.int64), counts)
        return (partitions, rows, frame), texts

    def payload(self, out: object) -> dict[str, pa.Array]:
        """The model's output (``encode_long(...).embeddings``) as written, by its family: embeddings
        truncated (``truncate_dim``), normalized, in the stored precision; sparse rows pruned; token
        vectors truncated and normalized as embeddings are, in the stored precision."""
        family = self.family
        if family == SPARSE:
            indices, values = sparse_arrays(out, top_k=self.sparse_top_k, threshold=self.sparse_threshold)
            _check_finite_values(values.values.to_numpy(zero_copy_only=False), family)
            return {INDICES: indices, VALUES: values}
        if family == MULTIVECTOR:
            mats = [truncate(np.asarray(m, dtype=np.float32), self.truncate_dim, self.normalize) for m in out]  # type: ignore[attr-defined]
            vectors, tokens = multivector_arrays(mats, self.precision, dimension=self.dimension)
            _check_finite_values(vectors.flatten().flatten().to_numpy(zero_copy_only=False), family)
            return {VECTORS: vectors, TOKENS: tokens}
        return {EMBEDDING: embedding_array(truncate(out, self.truncate_dim, self.normalize), self.precision)}  # type: ignore[arg-type]

    def _encode_blocks(
        self, texts: Sequence[str], where: Callable[[int], str]
    ) -> tuple[_Blocks, np.ndarray | None, TextEmbeddings, float]:
        """Run the model on distinct ``texts``; ``where(i)`` names text ``i`` in errors. Returns the
        blocks, which texts were cut at the window (None: the model cannot tell), the model's output
        and the seconds its call took."""
        t0 = time.perf_counter()
        try:  # truncate first, then normalize what is kept (as sentence-transformers' truncate_dim)
            out = self.encoder.encode_long(
                texts,
                normalize=self.normalize and self.truncate_dim is None,
                long_texts=self.long_texts,
                chunk_overlap=self.chunk_overlap,
            )
        except TextTooLong as err:
            raise _too_long(where(err.index), err.tokens, err.window) from None
        except SurgeInputError:
            # a text no tokenizer reads: named by partition and row (the tokenizer's texts[i] is its own call's)
            if (bad := unreadable_text(texts, lambda i: f"the text at {where(i)}")) is None:
                raise
            raise bad from None
        model_s = time.perf_counter() - t0
        truncated = None if out.truncated is None else np.asarray(out.truncated, dtype=bool)
        if out.windows is None:
            return (
                _Blocks(np.ones(len(texts), np.int64), self.payload(out.embeddings)),
                truncated,
                out,
                model_s,
            )
        w = out.windows
        counts = np.bincount(w.text, minlength=len(texts)).astype(np.int64)
        return (
            _Blocks(
                counts,
                self.payload(out.embeddings),  # the windows' fields bear the columns' names
                {k: np.asarray(getattr(w, k), dtype=t) for k, t in CHUNK_COLUMNS.items()},
            ),
            truncated,
            out,
            model_s,
        )

    def _reused_blocks(self, hashes: np.ndarray) -> tuple[np.ndarray, _Blocks | None, np.ndarray]:
        """Which of the distinct ``hashes`` a ``reuse`` output holds, their rows there, and which of
        those found may be over the model's window (see :attr:`dask_surge.io.reuse.Reused.may_be_cut`)."""
        hit = open_index(self.reuse, self.reuse_storage_options).lookup(
            hashes, columns=tuple(CHUNK_COLUMNS) if self.chunked else (), payload=FAMILY_COLUMNS[self.family]
        )
        if not hit.found.any():
            return hit.found, None, hit.may_be_cut
        chunks = None
        if self.chunked:
            chunks = {k: np.asarray(hit.columns[k], dtype=t) for k, t in CHUNK_COLUMNS.items()}
        return hit.found, _Blocks(np.asarray(hit.counts, np.int64), hit.payload, chunks), hit.may_be_cut

    def _reused_over(self, texts: Sequence[str], where: Callable[[int], str]) -> np.ndarray | None:
        """Which of ``texts`` (copied from a ``reuse`` output) are over the model's window, tokenized
        only to count, as :meth:`_encode_blocks` would have found them; None when the model cannot
        tell. With ``long_texts="error"`` the first such text is refused (``where(i)`` names text ``i``)."""
        if not len(texts):
            return np.zeros(0, dtype=bool)
        try:
            w = self.encoder.windows(texts, chunk_overlap=0)  # overlap 0: a text's windows share no token
        except SurgeValueError:  # a plain callable: no tokenizer to count with
            if self.long_texts == "error":
                raise no_tokenizer("error", "the model has none to count the reused texts' tokens") from None
            return None
        over = np.bincount(w.text, minlength=len(texts)) > 1
        if self.long_texts == "error" and over.any():
            first = int(np.argmax(over))
            tokens = int(w.tokens[w.text == first].sum())
            raise _too_long(where(first), tokens, int(self.encoder.window_capacity or 0))
        return over

    def encode(self, parts: Sequence[pd.DataFrame], spans: Sequence[tuple[Span, int]]) -> SuperBatchRows:
        """Encode the planned rows of ``parts``: see :class:`SuperBatchRows`."""
        gathered, texts, skipped = self.gather(parts, spans)
        partition = np.concatenate([p for p, _, _ in gathered]) if gathered else np.zeros(0, dtype=np.int64)
        row = np.concatenate([r for _, r, _ in gathered]) if gathered else np.zeros(0, dtype=np.int64)
        hashes = text_hashes(texts)
        first, inverse = distinct(hashes)
        found = np.zeros(len(first), dtype=bool)
        parts_: list[tuple[np.ndarray, _Blocks]] = []  # (distinct ids, their blocks)
        cut = np.zeros(len(first), dtype=bool)  # distinct texts cut at the window
        uncounted = False  # the model cannot tell which were

        def where(ids: np.ndarray) -> Callable[[int], str]:
            return lambda i: f"partition {partition[first[ids[i]]]}, row {row[first[ids[i]]]}"

        if self.reuse and len(first):
            found, old, may_be_cut = self._reused_blocks(hashes[first])
            if old is not None:
                parts_.append((np.flatnonzero(found), old))
                if self.long_texts in ("truncate", "error"):  # chunk and mean rows are never cut
                    check = np.flatnonzero(found)[may_be_cut]
                    over = self._reused_over(take_texts(texts, first[check]), where(check))
                    if over is None:
                        uncounted = True
                    else:
                        cut[check] = over
        todo = np.flatnonzero(~found)
        model_s, shape = 0.0, None
        if len(todo) or not parts_:
            fresh, mask, model_out, model_s = self._encode_blocks(
                texts if len(todo) == len(texts) else take_texts(texts, first[todo]), where(todo)
            )
            shape = model_out.shape
            parts_.append((todo, fresh))
            if mask is None:
                uncounted = True
            else:
                cut[todo] = mask
        ids = np.concatenate([d for d, _ in parts_])
        blocks = _Blocks.concat([b for _, b in parts_])
        position = np.empty(len(first), np.int64)  # where each distinct text's block is among ``blocks``
        position[ids] = np.arange(len(ids))
        counts = blocks.counts
        take = expand(counts, position[inverse])  # output rows, text by text, in order
        in_order = len(take) == int(counts.sum()) and bool((take == np.arange(len(take))).all())
        reps = counts[position[inverse]]
        data: dict = {PARTITION: np.repeat(partition, reps), ROW: np.repeat(row, reps)}
        if self.chunked:
            data.update({k: v if in_order else v[take] for k, v in blocks.chunks.items()})  # type: ignore[union-attr]
        src = np.repeat(np.arange(len(texts)), reps) if self.chunked else None
        for col in self.keep:
            values = concat_column([frame for _, _, frame in gathered], col)
            data[col] = values if src is None else values.take(src).reset_index(drop=True)
        out = pd.DataFrame(data)
        hash_array = hash_column(hashes)
        out[TEXT_HASH] = pd.arrays.ArrowExtensionArray(hash_array if src is None else hash_array.take(src))
        for name, column in blocks.payload.items():
            out[name] = pd.arrays.ArrowExtensionArray(column if in_order else column.take(pa.array(take)))
        truncated = -1 if uncounted else int(np.count_nonzero(cut[inverse]))  # each written text counts
        return SuperBatchRows(
            out,
            skipped,
            texts=len(texts),
            truncated=truncated,
            encoded=len(todo),
            reused=int(np.count_nonzero(found[inverse])),
            model_s=model_s,
            shape=shape,
        )

    def __call__(
        self, parts: Sequence[pd.DataFrame], sb_index: int, spans: Sequence[tuple[Span, int]]
    ) -> pd.DataFrame:
        return self.encode(parts, spans).frame

    def rows(self, texts: Sequence[str]) -> dict[str, pa.Array]:
        """The output columns of ``texts`` (a list of str) encoded in one call, as written: the model's
        own call and its framing, without gathering, hashing or reuse (what calibration times).

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> rows = SuperBatchTask("text", (), Encoder("default", device="cpu")).rows(["a", "b"])
        >>> list(rows), len(rows["embedding"])
        (['embedding'], 2)
        """
        out = self.encoder.encode_long(texts, normalize=self.normalize and self.truncate_dim is None)
        return self.payload(out.embeddings)

    def meta(self, frame_meta: pd.DataFrame) -> pd.DataFrame:
        """Empty frame with the output schema (pandas, also for cuDF input)."""
        frame_meta = to_host(frame_meta)
        data = {PARTITION: np.zeros(0, np.int64), ROW: np.zeros(0, np.int64)}
        if self.chunked:
            data.update({k: np.zeros(0, t) for k, t in CHUNK_COLUMNS.items()})
        out = pd.DataFrame(data)
        for col in self.keep:
            out[col] = frame_meta[col].iloc[:0].reset_index(drop=True)
        out[TEXT_HASH] = pd.arrays.ArrowExtensionArray(hash_column(np.zeros((0, 2), np.uint64)))
        for name, column in self.empty_payload().items():
            out[name] = pd.arrays.ArrowExtensionArray(column)
        return out

    def empty_payload(self) -> dict[str, pa.Array]:
        """The model's output columns of no rows, typed as written (the model is not loaded for it).

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> {k: str(v.type) for k, v in SuperBatchTask("text", (), Encoder("default")).empty_payload().items()}
        {'embedding': 'fixed_size_list<item: float>[384]'}
        """
        family = self.family
        empty: object = (
            []
            if family == MULTIVECTOR
            # no token matrices; no sparse rows, of any width
            else np.zeros((0, self.dimension if family == DENSE else 1), dtype=np.float32)
        )
        return self.payload(empty)
