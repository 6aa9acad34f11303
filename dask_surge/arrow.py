"""Arrow helpers: embeddings as zero-copy fixed-size lists."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .precision import PRECISIONS, quantize, stored_dimension

__all__ = ["embedding_array", "embedding_type"]


def embedding_type(dimension: int, precision: str = "float32") -> pa.DataType:
    """The Arrow type of an embedding column: ``fixed_size_list<value>[stored dimension]``.

    Examples
    --------
    >>> embedding_type(384, "binary")
    FixedSizeListType(fixed_size_list<item: uint8>[48])
    """
    return pa.list_(PRECISIONS[precision][1], stored_dimension(dimension, precision))


def embedding_array(emb: np.ndarray, precision: str = "float32") -> pa.FixedSizeListArray:
    """Wrap ``(n, d)`` float embeddings as a ``FixedSizeListArray`` of the stored precision
    (see :mod:`dask_surge.precision`); float32 input is not copied.

    Examples
    --------
    >>> import numpy as np
    >>> arr = embedding_array(np.ones((2, 3), dtype=np.float32))
    >>> arr.type
    FixedSizeListType(fixed_size_list<item: float>[3])
    """
    stored = quantize(emb, precision)
    flat = np.ascontiguousarray(stored).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=PRECISIONS[precision][1]),
                                             stored_dimension(emb.shape[1], precision))
