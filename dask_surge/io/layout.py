"""The output's columns, stated once: their names, the types dask-surge writes, their order.

The SuperBatch frame (written, or a partition of the lazy frame), its meta, the reuse index,
the checks of ``keep=``, the Parquet sink (its skipped-rows files, its dictionary and codec
choices, its row groups) and the readers of an output take the columns from here.

The order of an output's columns (:func:`output_columns`): ``partition``, ``row``; in chunk
mode (``long_texts="chunk"``) the window's :data:`CHUNK_COLUMNS`; the kept input columns;
``text_hash``; then the columns of the model's output family (:data:`FAMILY_COLUMNS`):
``embedding`` for a dense model, ``indices`` and ``values`` for a sparse (SPLADE) one
(:mod:`dask_surge.io.sparse`), ``vectors`` and ``tokens`` for a multi-vector (ColBERT) one
(:mod:`dask_surge.io.multivector`).

Examples
--------
>>> output_columns(["doc_id"], chunked=False)
('partition', 'row', 'doc_id', 'text_hash', 'embedding')
>>> output_columns([], chunked=True)[2:6]
('chunk', 'char_start', 'char_end', 'tokens')
>>> output_columns(["doc_id"], chunked=False, family="sparse")[-3:]
('text_hash', 'indices', 'values')
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SurgeValueError
from ..families import DENSE, MULTIVECTOR, SPARSE, check_family

__all__ = [
    "PARTITION",
    "ROW",
    "CHUNK",
    "CHUNK_COLUMNS",
    "TEXT_HASH",
    "EMBEDDING",
    "INDICES",
    "VALUES",
    "VECTORS",
    "TOKENS",
    "FAMILY_COLUMNS",
    "PAYLOAD_COLUMNS",
    "reserved_columns",
    "output_columns",
]

#: the input partition a row came from, and the row's position in it
PARTITION, ROW = "partition", "row"
#: a window's number within its text, in chunk mode (the first window of a text is 0)
CHUNK = "chunk"
#: the tokens of a row: a window's tokens in chunk mode, a multi-vector row's token vectors (int32)
TOKENS = "tokens"
#: The columns a ``long_texts="chunk"`` output has beside ``partition`` and ``row``, with their types.
CHUNK_COLUMNS = {CHUNK: np.int32, "char_start": np.int64, "char_end": np.int64, TOKENS: np.int32}
#: each row's text hash (:mod:`dask_surge.io.hashing`)
TEXT_HASH = "text_hash"
#: the embedding vector (:mod:`dask_surge.io.precision`)
EMBEDDING = "embedding"
#: a sparse row's vocabulary ids, ascending (``list<int32>``), and their weights (``list<float32>``)
INDICES, VALUES = "indices", "values"
#: a multi-vector row's token vectors (``list<fixed_size_list<float32|float16>[dim]>``)
VECTORS = "vectors"

#: family (:mod:`dask_surge.families`) -> the columns that hold a row's output, last in the output, in this order
FAMILY_COLUMNS: dict[str, tuple[str, ...]] = {
    DENSE: (EMBEDDING,),
    SPARSE: (INDICES, VALUES),
    MULTIVECTOR: (VECTORS, TOKENS),
}
#: The columns of model output (the Parquet writer gives them the output codec, no dictionary, no statistics);
#: ``tokens`` is not one: a small count, compressed and with statistics like the other columns.
PAYLOAD_COLUMNS = frozenset({EMBEDDING, INDICES, VALUES, VECTORS})


def reserved_columns(chunked: bool, family: str = DENSE) -> tuple[str, ...]:
    """The output columns dask-surge writes itself (a kept column may not take their names),
    in their order in the output.

    Examples
    --------
    >>> reserved_columns(chunked=False)
    ('partition', 'row', 'text_hash', 'embedding')
    >>> len(reserved_columns(chunked=True))
    8
    >>> reserved_columns(chunked=False, family="multivector")
    ('partition', 'row', 'text_hash', 'vectors', 'tokens')
    """
    return output_columns((), chunked, family)


def output_columns(keep: Sequence[str], chunked: bool, family: str = DENSE) -> tuple[str, ...]:
    """Every column of an output that keeps ``keep``, in order (see the module docstring).

    A multi-vector output has a row per text, never per window: its ``tokens`` counts the
    text's vectors, and chunk mode's ``tokens`` would be a second column of that name.

    Examples
    --------
    >>> output_columns([], chunked=True, family="multivector")
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: long_texts='chunk' writes a row per token window, ...
    """
    payload = FAMILY_COLUMNS[check_family(family)]
    if chunked and family == MULTIVECTOR:
        raise SurgeValueError(
            "long_texts='chunk' writes a row per token window, and a multi-vector model already writes a vector "
            "per token of each text (family='multivector'): the two layouts do not combine. Fix: pass "
            "long_texts='truncate' with a multi-vector model."
        )
    return (PARTITION, ROW, *(CHUNK_COLUMNS if chunked else ()), *keep, TEXT_HASH, *payload)
