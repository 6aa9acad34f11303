"""Every private Dask and distributed name dask-surge uses, in this one place.

dask-expr has no public extension point for what dask-surge does (a graph expression that
fuses planned partitions into one task per SuperBatch, row counts from Parquet footers
without a pass), so it subclasses and inspects private classes; and a SuperBatch task asks
its distributed worker what no public API says (its thread count, whether this thread is
one of its pool's, its profiler's callback). The classes are imported here only, and the
private attributes read here only (:func:`expr_operands`, :func:`worker_pool_threads`,
:func:`profile_callback`), so a Dask release that moves them breaks one module:
``tests/test_layout.py`` checks each against the pinned Dask range (``pyproject.toml``:
``dask>=2026.8.0,<2026.12``), and that no other module imports them or reads such an attribute.
distributed is imported inside the functions that need it: a process that runs no worker
never loads it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dask._expr import Expr as BaseExpr
from dask._expr import LLGExpr
from dask._task_spec import Alias, DataNode, GraphNode, List, Task, TaskRef, convert_legacy_graph
from dask._task_spec import _is_dask_future as is_dask_future

if TYPE_CHECKING:
    from dask.dataframe.dask_expr import new_collection
    from dask.dataframe.dask_expr._expr import Expr, Lengths, Literal, Projection
    from dask.dataframe.dask_expr.io.io import FromPandas
    from dask.dataframe.dask_expr.io.parquet import ReadParquetFSSpec

__all__ = [
    "Alias",
    "BaseExpr",
    "DataNode",
    "Expr",
    "FromPandas",
    "GraphNode",
    "Lengths",
    "List",
    "Literal",
    "Projection",
    "ReadParquetFSSpec",
    "Task",
    "TaskRef",
    "convert_legacy_graph",
    "expr_operands",
    "is_dask_future",
    "named_graph",
    "new_collection",
    "profile_callback",
    "simplified",
    "untuned",
    "worker_pool_threads",
]

#: dask.dataframe's names, imported on first use (PEP 562): a worker running SuperBatch tasks
#: needs the task spec above but not dask.dataframe, whose import (pandas, dask.array, dask-expr,
#: with the GIL held) would otherwise run beside its model load on a cold start
_DATAFRAME = {
    "new_collection": "dask.dataframe.dask_expr",
    "Expr": "dask.dataframe.dask_expr._expr",
    "Lengths": "dask.dataframe.dask_expr._expr",
    "Literal": "dask.dataframe.dask_expr._expr",
    "Projection": "dask.dataframe.dask_expr._expr",
    "FromPandas": "dask.dataframe.dask_expr.io.io",
    "ReadParquetFSSpec": "dask.dataframe.dask_expr.io.parquet",
}


def __getattr__(name: str) -> Any:
    if name in _DATAFRAME:
        value = getattr(importlib.import_module(_DATAFRAME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def named_graph(graph: dict, token: str) -> Any:
    """``graph`` as the expression ``Client.get`` submits, named by ``token``.

    ``Client.get`` wraps a dict graph in ``LLGExpr(graph)``, whose name Dask computes by
    tokenizing the whole graph: it pickles every value the graph embeds, so a unit over an
    in-memory input's partitions paid a pickle round trip of its data on the client before it
    was submitted. A graph whose keys no other
    graph has can be named by a token as unique as they are.

    Examples
    --------
    >>> expr = named_graph({"a": 1}, "surge-unit-0")
    >>> expr._name.endswith("surge-unit-0"), expr.__dask_keys__()
    (True, ['a'])
    """
    return LLGExpr(graph, _determ_token=token)


#: the attribute :func:`simplified` keeps its result in
_SIMPLIFIED = "_dask_surge_simplified"


def simplified(expr: Any) -> Any:
    """``expr.simplify()``, computed once per expression object.

    A run asks for the simplified input several times before its first task (its identity,
    its partition sizes, its Parquet reader), and each ``simplify()`` builds new expressions,
    which Dask tokenizes, all before any worker has work. The result is kept on ``expr`` itself, as Dask keeps its own cached
    properties (``_name``, ``_meta``): it lives exactly as long as ``expr``, and every caller
    gets the same object.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> expr = dd.from_pandas(pd.DataFrame({"t": ["a", "b"]}), npartitions=1)[["t"]].expr
    >>> simplified(expr) is simplified(expr), type(simplified(expr)).__name__
    (True, 'FromPandas')
    """
    cache = getattr(expr, "__dict__", None)
    if cache is None:  # pragma: no cover - an expression without a __dict__: nowhere to keep it
        return expr.simplify()
    done = cache.get(_SIMPLIFIED)
    if done is None:
        done = cache[_SIMPLIFIED] = expr.simplify()  # two threads at once compute the same, harmlessly
    return done


def untuned() -> Any:
    """Dask's config without its "tune" optimization pass, which may fuse small input
    partitions (Parquet files) into fewer: where the input is computed on the partitions the
    SuperBatches were planned for (the input graph, and the pass that sizes them).

    Examples
    --------
    >>> import dask
    >>> with untuned():
    ...     dask.config.get("optimization.tune.active")
    False
    """
    import dask

    return dask.config.set({"optimization.tune.active": False})


def expr_operands(expr: Any) -> dict[str, Any]:
    """A dask-expr expression's operands by name (its private ``_parameters`` beside ``operands``).

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> ops = expr_operands(dd.from_pandas(pd.DataFrame({"t": ["a"]}), npartitions=1)[["t"]].expr)
    >>> ops["columns"]
    ['t']
    """
    return dict(zip(expr._parameters, expr.operands))


def worker_pool_threads(worker: Any) -> int:
    """Threads of ``worker``'s pool when this thread is one of them and still in it, else 0.

    distributed marks its pool threads in the private ``thread_state`` (``executor``, and
    ``proceed`` until the thread secedes); ``worker.state.nthreads`` is its thread count.

    Examples
    --------
    >>> worker_pool_threads(None)  # not on a worker's pool thread
    0
    """
    if worker is None:
        return 0
    from distributed.threadpoolexecutor import thread_state

    if getattr(thread_state, "executor", None) is None or not getattr(thread_state, "proceed", False):
        return 0  # not one of the worker's pool threads, or one that already left it
    return int(worker.state.nthreads)


def profile_callback(worker: Any) -> Any:
    """``worker``'s statistical profiler callback (a tornado ``PeriodicCallback``), or None when
    it runs without one (``distributed.worker.profile.enabled: False``) or is not a worker.

    Examples
    --------
    >>> profile_callback(None) is None
    True
    """
    callbacks = getattr(worker, "periodic_callbacks", None)
    return None if callbacks is None else callbacks.get("profile")
