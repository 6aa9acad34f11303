"""Every private Dask name dask-surge uses, imported in this one place.

dask-expr has no public extension point for what dask-surge does (a graph expression that
fuses planned partitions into one task per SuperBatch, row counts from Parquet footers
without a pass), so it subclasses and inspects private classes. They are imported here
only, so a Dask release that moves them breaks one module, and ``tests/test_compat.py``
checks each against the pinned Dask range (``pyproject.toml``: ``dask>=2026.8.0,<2026.12``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dask._expr import Expr as BaseExpr
from dask._task_spec import Alias, DataNode, GraphNode, List, Task, TaskRef

if TYPE_CHECKING:
    from dask.dataframe.dask_expr import new_collection
    from dask.dataframe.dask_expr._expr import Expr, Lengths, Literal, Projection
    from dask.dataframe.dask_expr.io.io import FromPandas
    from dask.dataframe.dask_expr.io.parquet import ReadParquetFSSpec

__all__ = ["Alias", "BaseExpr", "DataNode", "Expr", "FromPandas", "GraphNode", "Lengths", "List", "Literal",
           "Projection", "ReadParquetFSSpec", "Task", "TaskRef", "new_collection"]

#: dask.dataframe's names, imported on first use (PEP 562): a worker running SuperBatch tasks
#: needs the task spec above but not dask.dataframe, whose import (pandas, dask.array, dask-expr:
#: ~0.7 s of CPU with the GIL held) would otherwise run beside its model load on a cold start
_DATAFRAME = {
    "new_collection": "dask.dataframe.dask_expr",
    "Expr": "dask.dataframe.dask_expr._expr", "Lengths": "dask.dataframe.dask_expr._expr",
    "Literal": "dask.dataframe.dask_expr._expr", "Projection": "dask.dataframe.dask_expr._expr",
    "FromPandas": "dask.dataframe.dask_expr.io.io",
    "ReadParquetFSSpec": "dask.dataframe.dask_expr.io.parquet",
}


def __getattr__(name: str) -> Any:
    if name in _DATAFRAME:
        value = getattr(importlib.import_module(_DATAFRAME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
