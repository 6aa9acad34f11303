"""The ``.surge`` accessor on Dask DataFrames: a thin shell over :mod:`dask_surge.api`."""

from __future__ import annotations

from dask.dataframe.extensions import register_dataframe_accessor

from . import api


@register_dataframe_accessor("surge")
class SurgeAccessor:
    """``ddf.surge.encode(...)`` and ``ddf.surge.plan(...)``.

    Examples
    --------
    >>> import dask.dataframe as dd, pandas as pd, dask_surge
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    >>> ddf.surge.plan("text", b_min=1, b_max=2).summary()["superbatches"]
    1
    """

    def __init__(self, ddf) -> None:
        self._ddf = ddf

    def encode(self, column: str, output: str | None = None, **kwargs):
        """See :func:`dask_surge.api.encode`."""
        return api.encode(self._ddf, column, output, **kwargs)

    def plan(self, column: str, **kwargs) -> api.SurgePlan:
        """See :func:`dask_surge.api.plan`."""
        return api.plan(self._ddf, column, **kwargs)

