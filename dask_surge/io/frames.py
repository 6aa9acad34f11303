"""Views of input partitions read together: :class:`FrameRows`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["FrameRows"]


class FrameRows:
    """Rows ``start:stop`` of ``frame``: one input partition of several read as one frame.

    A unit's Parquet files are read into one pandas frame (see
    :class:`~dask_surge.io.parquet.ParquetPartitions`); handing each partition on as this
    view instead of a sliced frame spares a SuperBatch of many small partitions a pandas
    slice, a column lookup and an index per partition: the SuperBatch's rows are one run of
    the frame, sliced once (:meth:`dask_surge.execution.superbatch.SuperBatchTask.gather`).
    Anything else takes :func:`~dask_surge.io.arrow.to_host` of it, the sliced frame.

    Examples
    --------
    >>> import pandas as pd
    >>> rows = FrameRows(pd.DataFrame({"text": list("abcd")}), 1, 3)
    >>> len(rows), rows.sliced()["text"].tolist()
    (2, ['b', 'c'])
    """

    __slots__ = ("frame", "start", "stop")

    def __init__(self, frame: pd.DataFrame, start: int, stop: int) -> None:
        self.frame, self.start, self.stop = frame, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"FrameRows({self.start}:{self.stop} of {len(self.frame)} rows)"

    def sliced(self) -> pd.DataFrame:
        """The rows as a frame of their own (a pandas slice)."""
        return self.frame.iloc[self.start : self.stop]
