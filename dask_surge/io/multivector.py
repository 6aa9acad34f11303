"""Multi-vector (late-interaction, ColBERT) output: a vector per kept token of each text, and back.

A late-interaction model gives each text a ``(tokens, dim)`` matrix: one vector per token
its scoring mask keeps (markers and skiplist applied by the model). The output has one row
per text (:mod:`dask_surge.io.layout`):

* ``vectors``: ``list<fixed_size_list<float32|float16>[dim]>``, the token vectors in token order;
* ``tokens``: ``int32``, how many (the list's length, stored so a reader need not open the vectors).

:func:`to_matrices` reads rows back as ``(tokens, dim)`` numpy arrays.

Examples
--------
>>> import numpy as np
>>> mats = [np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32)]
>>> vectors, tokens = multivector_arrays(mats)
>>> vectors.type, tokens.to_pylist()
(ListType(list<item: fixed_size_list<item: float>[3]>), [2, 1])
>>> [m.shape for m in to_matrices(vectors)]
[(2, 3), (1, 3)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SurgeValueError
from ..families import FAMILY_PRECISIONS, MULTIVECTOR
from .arrow import embedding_array, embedding_type
from .layout import VECTORS
from .precision import PRECISIONS

__all__ = ["MULTIVECTOR_PRECISIONS", "vectors_type", "multivector_arrays", "to_matrices"]

#: precision -> (numpy dtype, Arrow value type) of the token vectors
MULTIVECTOR_PRECISIONS = {p: PRECISIONS[p] for p in FAMILY_PRECISIONS[MULTIVECTOR]}

_INT32_MAX = 2**31 - 1


def vectors_type(dimension: int, precision: str = "float32") -> pa.DataType:
    """The Arrow type of the ``vectors`` column.

    Examples
    --------
    >>> vectors_type(128, "float16")
    ListType(list<item: fixed_size_list<item: halffloat>[128]>)
    """
    _precision(precision)
    return pa.list_(embedding_type(int(dimension), precision))


def _precision(precision: object) -> tuple[Any, pa.DataType]:
    if precision not in MULTIVECTOR_PRECISIONS:
        raise SurgeValueError(
            f"precision={precision!r} is not one a multi-vector output stores: token vectors are "
            f"{sorted(MULTIVECTOR_PRECISIONS)} (int8 and binary need a scale rule per token, not defined yet). "
            "Fix: pass precision='float32' (default) or 'float16'."
        )
    return MULTIVECTOR_PRECISIONS[str(precision)]


def multivector_arrays(
    matrices: Sequence[Any], precision: str = "float32", dimension: int | None = None
) -> tuple[pa.ListArray, pa.Int32Array]:
    """The ``vectors`` and ``tokens`` columns of multi-vector model output.

    Parameters
    ----------
    matrices : sequence
        One ``(tokens_i, dim)`` array (numpy or torch, on any device) per text, as
        ``MultiVectorEncoder.encode`` returns; ``tokens_i`` may be 0.
    precision : {"float32", "float16"}
        The stored value type (float16 halves the bytes; the vectors are unit vectors, so the
        rounding costs well under 1e-4 of cosine).
    dimension : int, optional
        ``dim``: needed only when there are no matrices, else checked against theirs.

    Returns
    -------
    (pyarrow.ListArray, pyarrow.Int32Array)
        ``vectors`` (:func:`vectors_type`) and ``tokens`` (each row's count).

    Raises
    ------
    SurgeValueError
        A matrix that is not 2-D or whose ``dim`` differs from the others', or an unknown precision.

    Examples
    --------
    >>> vectors, tokens = multivector_arrays([np.full((3, 2), 0.5)], precision="float16")
    >>> vectors.type.value_type, tokens.to_pylist(), vectors.to_pylist()[0][0]
    (FixedSizeListType(fixed_size_list<item: halffloat>[2]), [3], [0.5, 0.5])
    >>> multivector_arrays([], dimension=4)[0].type
    ListType(list<item: fixed_size_list<item: float>[4]>)
    """
    np_dtype = _precision(precision)[0]
    mats = [_numpy(m) for m in matrices]
    for i, m in enumerate(mats):
        if m.ndim != 2 or (dimension is not None and m.shape[1] != dimension):
            raise SurgeValueError(
                f"multi-vector output {i} has shape {m.shape}: each text's must be (tokens, "
                f"{dimension if dimension is not None else 'dim'}), one dimension for every text. Fix: pass the "
                "model's per-text token embeddings (MultiVectorEncoder.encode returns them) unpooled and unstacked."
            )
        dimension = m.shape[1] if dimension is None else dimension
    if dimension is None:
        raise SurgeValueError(
            "multi-vector output of no texts has no dimension to type its column by. Fix: pass dimension= "
            "(the model's token vector size)."
        )
    counts = np.array([m.shape[0] for m in mats], dtype=np.int64)
    if counts.sum() > _INT32_MAX:
        raise SurgeValueError(
            f"{int(counts.sum())} token vectors do not fit one list column (at most {_INT32_MAX}). Fix: encode "
            "fewer rows at a time (a smaller b_max)."
        )
    offsets = np.zeros(len(mats) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    stacked = (
        np.concatenate([m.astype(np_dtype, copy=False) for m in mats])
        if mats
        else np.zeros((0, int(dimension)), np_dtype)
    )
    inner = embedding_array(stacked, precision)  # every token vector, as an embedding column stores a row
    vectors = pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), inner)
    return vectors, pa.array(counts.astype(np.int32), type=pa.int32())


def _numpy(m: Any) -> np.ndarray:
    """A matrix as numpy: a torch tensor (io/ never imports torch) is detached and brought to the host."""
    if hasattr(m, "detach"):
        m = m.detach().float().cpu().numpy()
    return np.asarray(m)


def to_matrices(data: Any, dtype: Any = np.float32) -> list[np.ndarray]:
    """Rows of a multi-vector output as ``(tokens, dim)`` numpy arrays, in row order.

    Parameters
    ----------
    data : pyarrow.Table, pyarrow.RecordBatch, pandas.DataFrame, pyarrow array or pandas Series
        The ``vectors`` column, or rows that have it (a partition of
        :func:`dask_surge.read_embeddings`, a table read from a part file). A null row reads
        as ``(0, dim)``.
    dtype : numpy dtype, default float32
        The arrays' type (float16 vectors are widened).

    Returns
    -------
    list of numpy.ndarray

    Examples
    --------
    >>> import pandas as pd
    >>> vectors, _ = multivector_arrays([np.eye(2), np.ones((1, 2))])
    >>> frame = pd.DataFrame({"vectors": vectors.to_pylist()})
    >>> [m.tolist() for m in to_matrices(frame)]
    [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0]]]
    """
    if isinstance(data, (pa.Table, pa.RecordBatch)):
        col = data.column(VECTORS)
    elif hasattr(data, "columns") and VECTORS in data.columns:
        col = data[VECTORS]
    elif hasattr(data, "columns"):
        raise SurgeValueError(
            f"to_matrices reads the '{VECTORS}' column of a multi-vector output, and the data has none (columns "
            f"{list(data.columns)}). Fix: read an output written by a multi-vector model, with its "
            f"'{VECTORS}' column."
        )
    else:
        col = data
    if not isinstance(
        col, (pa.Array, pa.ChunkedArray)
    ):  # a pandas column: object (nested lists) or ArrowDtype
        col = pa.array(col)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
        raise SurgeValueError(
            f"the '{VECTORS}' column has type {col.type}, not a list of token vectors. "
            "Fix: pass a multi-vector output's vectors column."
        )
    inner_type = col.type.value_type
    if pa.types.is_fixed_size_list(inner_type):
        dim = inner_type.list_size
    else:  # a pandas round trip lost the fixed size: lists of equal-length lists
        first = next((r for r in col.to_pylist() if r), None)
        dim = len(first[0]) if first else 0
        col = col.cast(pa.list_(pa.list_(pa.float32(), dim)))
    lengths = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    values = col.flatten().flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    flat = values.reshape(-1, dim) if dim else np.zeros((int(lengths.sum()), 0), dtype)
    return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
