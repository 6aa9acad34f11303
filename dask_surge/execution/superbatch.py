"""What one SuperBatch task does: gather its rows, encode them in one call, frame the result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..errors import SurgeInputError
from ..io.arrow import embedding_array, to_host
from ..io.precision import truncate
from ..models.encoders import Encoder
from ..planning.policy import Span

__all__ = ["SuperBatchEncoder", "texts_of", "partition_digest"]


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


def texts_of(series: pd.Series, partition: int, start: int, on_null: str) -> tuple[list[str], np.ndarray | None]:
    """Return the texts of ``series`` as a list of ``str``, enforcing the null policy,
    and the mask of rows kept (``None``: all of them).

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
    """
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
class SuperBatchEncoder:
    """Callable run by each SuperBatch task: ``(partitions, sb_index, spans) -> DataFrame``.

    The result has columns ``partition`` (int64), ``row`` (int64, offset within
    the partition), the kept columns, and ``embedding`` (fixed-size list of
    the stored precision: float32 by default), sorted by ``(partition, row)``. With ``on_null="skip"``
    null rows are left out; :meth:`encode` returns their ``(partition, row)``.
    """

    column: str
    keep: tuple[str, ...]
    encoder: Encoder
    normalize: bool = False
    precision: str = "float32"
    on_null: str = "error"
    truncate_dim: int | None = None

    def __dask_tokenize__(self):
        return ("SuperBatchEncoder", self.column, self.keep, self.encoder.spec, self.normalize,
                self.precision, self.on_null, self.truncate_dim)

    @property
    def dimension(self) -> int:
        """Dimensions of the embeddings written (after ``truncate_dim``)."""
        return self.truncate_dim or self.encoder.dimension

    def gather(self, parts: Sequence[pd.DataFrame], spans: Sequence[tuple[Span, int]]):
        """Slice the planned rows out of the input partitions, checking their sizes.

        Returns ``(pieces, texts, skipped)``: ``(span, rows kept, frame of them)``
        per span, the texts to encode, and ``(partition, row)`` of skipped nulls."""
        pieces, texts, skipped = [], [], []
        by_partition = dict(zip(sorted({s.partition for s, _ in spans}), map(to_host, parts)))
        for span, planned in spans:
            part = by_partition[span.partition]
            if len(part) != planned:
                raise SurgeInputError(
                    f"partition {span.partition} has {len(part)} rows but {planned} were planned: "
                    "the input changed between planning and execution (non-deterministic "
                    "partitions?). Nothing was written for it. Fix: persist or write the input "
                    "to Parquet first so every read returns the same rows."
                )
            piece = part.iloc[span.start : span.stop]
            values, kept = texts_of(piece[self.column], span.partition, span.start, self.on_null)
            rows = np.arange(span.start, span.stop, dtype=np.int64)
            if kept is not None:
                skipped += [(span.partition, int(r)) for r in rows[~kept]]
                rows, piece = rows[kept], piece[kept]
            texts += values
            pieces.append((span, rows, piece))
        return pieces, texts, skipped

    def frame(self, pieces, emb: np.ndarray) -> pd.DataFrame:
        """Assemble the output DataFrame (embedding column built zero-copy)."""
        partition = np.concatenate(
            [np.full(len(rows), span.partition, dtype=np.int64) for span, rows, _ in pieces]
        ) if pieces else np.zeros(0, dtype=np.int64)
        row = np.concatenate([rows for _, rows, _ in pieces]) if pieces else np.zeros(0, dtype=np.int64)
        data = {"partition": partition, "row": row}
        for col in self.keep:
            kept = [piece[col] for _, _, piece in pieces]
            data[col] = pd.concat(kept, ignore_index=True) if kept else pd.Series([], dtype=object)
        out = pd.DataFrame(data)
        out["embedding"] = pd.arrays.ArrowExtensionArray(embedding_array(emb, self.precision))
        return out

    def encode(self, parts: Sequence[pd.DataFrame], spans: Sequence[tuple[Span, int]]):
        """Encode the planned rows: ``(output frame, [(partition, row) skipped]).``"""
        pieces, texts, skipped = self.gather(parts, spans)
        if not texts:
            return self.frame(pieces, np.zeros((0, self.dimension), dtype=np.float32)), skipped
        # truncate first, then normalize what is kept (as sentence-transformers' truncate_dim)
        emb = self.encoder.encode(texts, normalize=self.normalize and self.truncate_dim is None)
        return self.frame(pieces, truncate(emb, self.truncate_dim, self.normalize)), skipped

    def __call__(self, parts: Sequence[pd.DataFrame], sb_index: int, spans: Sequence[tuple[Span, int]]) -> pd.DataFrame:
        return self.encode(parts, spans)[0]

    def meta(self, frame_meta: pd.DataFrame) -> pd.DataFrame:
        """Empty frame with the output schema (pandas, also for cuDF input)."""
        frame_meta = to_host(frame_meta)
        data = {"partition": np.zeros(0, np.int64), "row": np.zeros(0, np.int64)}
        out = pd.DataFrame(data)
        for col in self.keep:
            out[col] = frame_meta[col].iloc[:0].reset_index(drop=True)
        emb = np.zeros((0, self.dimension), dtype=np.float32)
        out["embedding"] = pd.arrays.ArrowExtensionArray(embedding_array(emb, self.precision))
        return out
