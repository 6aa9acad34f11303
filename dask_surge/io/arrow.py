"""Arrow helpers: embeddings as zero-copy fixed-size lists; frames brought to the host."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .frames import FrameRows
from .precision import PRECISIONS, quantize, stored_dimension

__all__ = ["embedding_array", "embedding_type", "to_host", "is_cudf"]


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
    (see :mod:`dask_surge.io.precision`); float32 input is not copied.

    Examples
    --------
    >>> import numpy as np
    >>> arr = embedding_array(np.ones((2, 3), dtype=np.float32))
    >>> arr.type
    FixedSizeListType(fixed_size_list<item: float>[3])
    """
    stored = quantize(emb, precision)
    flat = np.ascontiguousarray(stored).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(
        pa.array(flat, type=PRECISIONS[precision][1]), stored_dimension(emb.shape[1], precision)
    )


def is_cudf(obj) -> bool:
    """True for a cuDF DataFrame or Series (checked by module, without importing cuDF)."""
    return type(obj).__module__.split(".", 1)[0] == "cudf"


def to_host(obj):
    """A cuDF DataFrame or Series as pandas (texts go to the host tokenizer anyway), a
    :class:`~dask_surge.io.frames.FrameRows` as its sliced frame; others as is.

    Examples
    --------
    >>> import pandas as pd
    >>> df = pd.DataFrame({"text": ["a"]})
    >>> to_host(df) is df
    True
    """
    if isinstance(obj, FrameRows):
        return obj.sliced()
    if is_cudf(obj):
        return obj.to_pandas()
    return obj
