"""Arrow helpers: embeddings as zero-copy fixed-size lists; frames brought to the host."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .precision import PRECISIONS, quantize, stored_dimension

__all__ = ["embedding_array", "embedding_type", "to_host", "is_cudf", "FrameRows"]


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
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=PRECISIONS[precision][1]),
                                             stored_dimension(emb.shape[1], precision))


def is_cudf(obj) -> bool:
    """True for a cuDF DataFrame or Series (checked by module, without importing cuDF)."""
    return type(obj).__module__.split(".", 1)[0] == "cudf"


class FrameRows:
    """Rows ``start:stop`` of ``frame``: one input partition of several read as one frame.

    A unit's Parquet files are read into one pandas frame (see
    :class:`~dask_surge.io.parquet.ParquetPartitions`); handing each partition on as this
    view instead of a sliced frame spares a SuperBatch of many small partitions a pandas
    slice, a column lookup and an index per partition: the SuperBatch's rows are one run of
    the frame, sliced once (:meth:`dask_surge.execution.superbatch.SuperBatchEncoder.gather`).
    Anything else takes :func:`to_host` of it, the sliced frame.

    Examples
    --------
    >>> import pandas as pd
    >>> rows = FrameRows(pd.DataFrame({"text": list("abcd")}), 1, 3)
    >>> len(rows), to_host(rows)["text"].tolist()
    (2, ['b', 'c'])
    """

    __slots__ = ("frame", "start", "stop")

    def __init__(self, frame, start: int, stop: int) -> None:
        self.frame, self.start, self.stop = frame, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"FrameRows({self.start}:{self.stop} of {len(self.frame)} rows)"

    def sliced(self):
        """The rows as a frame of their own (a pandas slice)."""
        return self.frame.iloc[self.start : self.stop]


def to_host(obj):
    """A cuDF DataFrame or Series as pandas (texts go to the host tokenizer anyway), a
    :class:`FrameRows` as its sliced frame; others as is.

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
