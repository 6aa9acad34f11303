"""The output's columns, stated once: their names, the types dask-surge writes, their order.

The SuperBatch frame (written, or a partition of the lazy frame), its meta, the reuse index,
the checks of ``keep=``, the Parquet sink (its skipped-rows files, its dictionary and codec
choices, its row groups) and the readers of an output take the columns from here.

The order of an output's columns (:func:`output_columns`): ``partition``, ``row``; in chunk
mode (``long_texts="chunk"``) the window's :data:`CHUNK_COLUMNS`; the kept input columns;
``text_hash``; ``embedding``.

Examples
--------
>>> output_columns(["doc_id"], chunked=False)
('partition', 'row', 'doc_id', 'text_hash', 'embedding')
>>> output_columns([], chunked=True)[2:6]
('chunk', 'char_start', 'char_end', 'tokens')
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PARTITION", "ROW", "CHUNK", "CHUNK_COLUMNS", "TEXT_HASH", "EMBEDDING", "reserved_columns",
           "output_columns"]

#: the input partition a row came from, and the row's position in it
PARTITION, ROW = "partition", "row"
#: a window's number within its text, in chunk mode (the first window of a text is 0)
CHUNK = "chunk"
#: The columns a ``long_texts="chunk"`` output has beside ``partition`` and ``row``, with their types.
CHUNK_COLUMNS = {CHUNK: np.int32, "char_start": np.int64, "char_end": np.int64, "tokens": np.int32}
#: each row's text hash (:mod:`dask_surge.io.hashing`)
TEXT_HASH = "text_hash"
#: the embedding vector (:mod:`dask_surge.io.precision`)
EMBEDDING = "embedding"


def reserved_columns(chunked: bool) -> tuple[str, ...]:
    """The output columns dask-surge writes itself (a kept column may not take their names),
    in their order in the output.

    Examples
    --------
    >>> reserved_columns(chunked=False)
    ('partition', 'row', 'text_hash', 'embedding')
    >>> len(reserved_columns(chunked=True))
    8
    """
    return output_columns((), chunked)


def output_columns(keep: Sequence[str], chunked: bool) -> tuple[str, ...]:
    """Every column of an output that keeps ``keep``, in order (see the module docstring)."""
    return (PARTITION, ROW, *(CHUNK_COLUMNS if chunked else ()), *keep, TEXT_HASH, EMBEDDING)
