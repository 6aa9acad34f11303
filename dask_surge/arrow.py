"""Arrow helpers: embeddings as zero-copy fixed-size lists."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["embedding_array", "embedding_type", "PRECISIONS"]

PRECISIONS = {"float32": pa.float32(), "float16": pa.float16()}


def embedding_type(dimension: int, precision: str = "float32") -> pa.DataType:
    """The Arrow type of an embedding column: ``fixed_size_list<precision>[dimension]``."""
    return pa.list_(PRECISIONS[precision], dimension)


def embedding_array(emb: np.ndarray, precision: str = "float32") -> pa.FixedSizeListArray:
    """Wrap an ``(n, d)`` array as a ``FixedSizeListArray`` without copying (float32).

    Examples
    --------
    >>> import numpy as np
    >>> arr = embedding_array(np.ones((2, 3), dtype=np.float32))
    >>> arr.type
    FixedSizeListType(fixed_size_list<item: float>[3])
    """
    np_dtype = np.float16 if precision == "float16" else np.float32
    flat = np.ascontiguousarray(emb, dtype=np_dtype).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=PRECISIONS[precision]), emb.shape[1])
