"""The ``.surge`` accessor on Dask DataFrames: a thin shell over :mod:`dask_surge.api`.

``ddf.surge.encode`` and ``ddf.surge.plan`` are :func:`dask_surge.api.encode` and
:func:`dask_surge.api.plan` with the frame bound: they show those functions' own
signature (less ``ddf``) and docstring, so ``ddf.surge.encode?`` in a notebook tells
the whole story, and they can never drift from them. (Those functions' signatures and
Parameters are in turn derived from :data:`dask_surge.options.OPTIONS`.)

This module imports :mod:`dask_surge.api` when a method is first looked up, not when it is
imported: ``import dask_surge`` registers the accessor as soon as ``dask.dataframe`` is
imported, which may happen in the middle of importing a dask-surge module (a Dask worker
running a dask-surge task), where importing the API's layers would be circular.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from dask.dataframe.extensions import register_dataframe_accessor


class _BoundToFrame:
    """Descriptor: the ``api`` function ``name`` with the accessor's frame as first argument.

    Looked up when accessed, so the signature and docstring are always the live
    function's. (A descriptor rather than a method: the docstring's examples belong
    to, and are tested with, the function in :mod:`dask_surge.api`.)
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, accessor: Any, owner: type | None = None) -> Any:
        func = getattr(importlib.import_module("dask_surge.api"), self.name)
        if accessor is None:
            return func
        ddf = accessor._ddf

        def bound(*args: Any, **kwargs: Any) -> Any:
            return func(ddf, *args, **kwargs)

        signature = inspect.signature(func)
        bound.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=list(signature.parameters.values())[1:]
        )
        bound.__name__ = func.__name__
        bound.__qualname__ = f"SurgeAccessor.{func.__name__}"
        bound.__doc__ = func.__doc__
        bound.__module__ = func.__module__
        return bound


@register_dataframe_accessor("surge")
class SurgeAccessor:
    """``ddf.surge.encode(...)`` and ``ddf.surge.plan(...)``: :func:`dask_surge.api.encode` and
    :func:`dask_surge.api.plan` on this frame, with their signatures and docstrings.

    Examples
    --------
    >>> import inspect, dask.dataframe as dd, pandas as pd, dask_surge
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    >>> ddf.surge.plan("text", b_min=1, b_max=2).summary()["superbatches"]
    1
    >>> list(inspect.signature(ddf.surge.encode).parameters)[:3]
    ['column', 'output', 'model']
    """

    encode: Callable[..., Any] = _BoundToFrame("encode")  # type: ignore[assignment]
    plan: Callable[..., Any] = _BoundToFrame("plan")  # type: ignore[assignment]

    def __init__(self, ddf) -> None:
        self._ddf = ddf
