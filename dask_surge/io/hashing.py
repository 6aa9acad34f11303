"""Text hashes: what every output row carries in :data:`~dask_surge.io.layout.TEXT_HASH`.

A row's ``text_hash`` is the 128-bit XXH3 hash of its text's UTF-8 bytes (:func:`text_hashes`),
stored as 16 big-endian bytes (:func:`hash_column`), so byte order sorts like the ``(hi, lo)``
pair. Every run writes it; the reuse index (:mod:`dask_surge.io.reuse`) looks rows up by it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from ..errors import SurgeValueError
from .layout import TEXT_HASH
from .texts import ArrowTexts, as_list, is_string_view

__all__ = [
    "HASH_ALGORITHM",
    "TEXT_HASH_TYPE",
    "text_hashes",
    "arrow_strings",
    "hash_column",
    "hashes_of",
    "text_hash_field",
]


#: what :func:`text_hashes` computes; recorded in the column's field metadata and the index
HASH_ALGORITHM = "xxh3_128-utf8"


#: Arrow type of :data:`TEXT_HASH`: 16 bytes, big-endian, so byte order sorts like ``(hi, lo)``
TEXT_HASH_TYPE = pa.binary(16)


#: the field metadata key of :data:`TEXT_HASH` that names :data:`HASH_ALGORITHM`
HASH_METADATA_KEY = b"dask_surge.hash"


def _digests_of_str(values: Iterable) -> bytes:
    digest = xxhash.xxh3_128_digest
    try:
        return b"".join(map(digest, map(str.encode, values)))
    except UnicodeEncodeError:  # a lone surrogate: its UTF-8 bytes as Python keeps them
        return b"".join(digest(v.encode("utf-8", "surrogatepass")) for v in values)


def _digests_of_arrow(arr: pa.Array) -> bytes:
    offsets, data = ArrowTexts(arr).utf8()  # no null here: text_hashes refused them
    bounds = offsets.tolist()
    digest = xxhash.xxh3_128_digest
    return b"".join([digest(data[bounds[i] : bounds[i + 1]]) for i in range(len(arr))])


def _null_error(n: int, first: int) -> SurgeValueError:
    return SurgeValueError(
        f"text_hashes got {n} null value(s) (first at position {first}); a null is not a text and must "
        "never share a hash with one. Fix: hash only the non-null texts (the rows that are encoded)."
    )


def text_hashes(values) -> np.ndarray:
    """The 128-bit content hash of each text: XXH3-128 of its UTF-8 bytes, as ``(n, 2)`` uint64.

    Column 0 holds the high 64 bits, column 1 the low ones, so rows sort as the hashes do.
    The same text hashes the same from a list, a pandas Series (object or Arrow-backed),
    a NumPy object array or an Arrow string array, in every process and platform.
    Its cost per text is in ``docs/performance.md``.

    Parameters
    ----------
    values : sequence of str, pandas.Series, numpy.ndarray or pyarrow (Chunked)Array
        The texts; no nulls (a null is not a text).

    Returns
    -------
    numpy.ndarray
        ``(n, 2)`` uint64.

    Raises
    ------
    SurgeValueError
        A value is null or not a string.

    Examples
    --------
    >>> import pyarrow as pa
    >>> h = text_hashes(["a", "b", "a"])
    >>> h.shape, h.dtype, bool((h[0] == h[2]).all()), bool((h[0] == h[1]).all())
    ((3, 2), dtype('uint64'), True, False)
    >>> bool((text_hashes(pa.array(["a", "b", "a"])) == h).all())
    True
    >>> text_hashes(["a", None])
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: text_hashes got 1 null value(s) (first at position 1); ...
    """
    arrow = None if isinstance(values, ArrowTexts) else arrow_strings(values)
    if arrow is not None:
        if arrow.null_count:
            valid = np.asarray(arrow.is_valid())
            raise _null_error(arrow.null_count, int(np.argmin(valid)))
        chunks = arrow.chunks if isinstance(arrow, pa.ChunkedArray) else [arrow]
        blob = b"".join(_digests_of_arrow(c) for c in chunks)
    else:
        # Python strings hash faster than Arrow's bytes sliced one by one: an ArrowTexts gives its list
        seq = values.tolist() if isinstance(values, np.ndarray) else as_list(values)
        try:
            blob = _digests_of_str(seq)
        except TypeError:
            bad = [i for i, v in enumerate(seq) if not isinstance(v, str)]
            nulls = [i for i in bad if _is_null(seq[i])]
            if nulls:
                raise _null_error(len(nulls), nulls[0]) from None
            raise SurgeValueError(
                f"text_hashes got {type(seq[bad[0]]).__name__} value {seq[bad[0]]!r:.60} at position {bad[0]}; "
                "only str texts are hashed. Fix: pass the text column's strings."
            ) from None
    return np.frombuffer(blob, dtype=">u8").astype(np.uint64).reshape(-1, 2)


def _is_null(value: Any) -> bool:
    """True for None, NaN and pandas' NA (the nulls a text column may hold)."""
    if value is None:
        return True
    try:
        return bool(value != value)
    except (TypeError, ValueError):
        return True  # pandas.NA: its comparison is NA, whose truth value raises


def arrow_strings(values) -> pa.Array | pa.ChunkedArray | None:
    """``values`` (an Arrow array, or a pandas Series backed by one) as an Arrow string array when
    it is one already (no copy), else None.

    Raises
    ------
    SurgeValueError
        If ``values`` is an Arrow array of another type.

    Examples
    --------
    >>> import pandas as pd
    >>> arrow_strings(pd.Series(["a", None], dtype="string[pyarrow]")).null_count
    1
    >>> arrow_strings(pd.Series(["a"], dtype=object)) is None
    True
    """
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if not (
            pa.types.is_string(values.type)
            or pa.types.is_large_string(values.type)
            or is_string_view(values.type)
        ):
            raise SurgeValueError(
                f"text_hashes got an Arrow {values.type} array; only strings are hashed. "
                "Fix: pass the text column."
            )
        return values
    array = getattr(values, "array", None)  # a pandas Series backed by Arrow
    pa_array = getattr(array, "_pa_array", None)
    if pa_array is None:
        with contextlib.suppress(Exception):
            if "pyarrow" in str(getattr(values, "dtype", "")):
                pa_array = pa.chunked_array(pa.array(values))
    if pa_array is not None and (
        pa.types.is_string(pa_array.type) or pa.types.is_large_string(pa_array.type)
    ):
        return pa_array
    return None


def hash_column(hashes: np.ndarray) -> pa.FixedSizeBinaryArray:
    """The :data:`TEXT_HASH` column of ``hashes`` (``(n, 2)`` uint64): 16 big-endian bytes per row.

    Byte order sorts like the ``(hi, lo)`` pair (a Parquet reader's min/max statistics are
    meaningful). :func:`hashes_of` is the inverse.

    Examples
    --------
    >>> h = text_hashes(["a", "b"])
    >>> col = hash_column(h)
    >>> col.type, len(col), bool((hashes_of(col) == h).all())
    (FixedSizeBinaryType(fixed_size_binary[16]), 2, True)
    >>> col[0].as_py() == __import__("xxhash").xxh3_128_digest(b"a")
    True
    """
    h = np.asarray(hashes)
    if h.ndim != 2 or h.shape[1] != 2:
        raise SurgeValueError(
            f"hash_column needs an (n, 2) uint64 array, got shape {h.shape}. "
            "Fix: pass what text_hashes returns."
        )
    blob = np.ascontiguousarray(h.astype(">u8", copy=False)).tobytes()
    return pa.Array.from_buffers(TEXT_HASH_TYPE, len(h), [None, pa.py_buffer(blob)])


def hashes_of(array) -> np.ndarray:
    """``(n, 2)`` uint64 hashes of a :data:`TEXT_HASH` column (Array or ChunkedArray), no nulls.

    Examples
    --------
    >>> hashes_of(hash_column(text_hashes(["x"]))).tolist() == text_hashes(["x"]).tolist()
    True
    """
    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    parts = []
    for c in chunks:
        if c.type != TEXT_HASH_TYPE:
            raise SurgeValueError(
                f"a {TEXT_HASH} column is fixed_size_binary[16], got {c.type}. "
                "Fix: pass the column hash_column wrote."
            )
        if c.null_count:
            raise SurgeValueError(
                f"the {TEXT_HASH} column has {c.null_count} null(s); every written row "
                "carries its text's hash. Fix: pass the column hash_column wrote."
            )
        buf = c.buffers()[1]
        parts.append(np.frombuffer(buf, dtype=">u8")[2 * c.offset : 2 * (c.offset + len(c))])
    if not parts:
        return np.empty((0, 2), dtype=np.uint64)
    return np.concatenate(parts).astype(np.uint64).reshape(-1, 2)


def text_hash_field() -> pa.Field:
    """The schema field of :data:`TEXT_HASH`, naming :data:`HASH_ALGORITHM` in its metadata.

    Examples
    --------
    >>> f = text_hash_field()
    >>> f.name, f.nullable, f.metadata
    ('text_hash', False, {b'dask_surge.hash': b'xxh3_128-utf8'})
    """
    return pa.field(
        TEXT_HASH, TEXT_HASH_TYPE, nullable=False, metadata={HASH_METADATA_KEY: HASH_ALGORITHM.encode()}
    )
