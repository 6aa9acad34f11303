"""The lazy frame: one Dask task per SuperBatch, consuming exactly its partitions.

:class:`SuperBatchExpr` is a dask-expr expression (a private Dask API; the
supported Dask range is pinned in ``pyproject.toml``). Output partition ``k`` is
``func(input partitions of SB k, SB index, spans of SB k)``; the input partitions
feed only their SuperBatch task, so no process ever holds all N rows. Lowered
(:class:`FusedSuperBatchExpr`), each SuperBatch is the task of a unit of
:class:`dask_surge.execution.inputs.InputGraph`, as in a written run: it reads its own
Parquet files, or runs the upstream tasks only it consumes, so the graph has one task
per SuperBatch, not one per partition. Tasks carry priorities ``G - k`` so SuperBatches
complete in plan order.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._compat import Expr, List, Task, TaskRef, new_collection
from ..planning.policy import SuperBatch
from .inputs import InputGraph, Unit, UnitSource, task_arguments
from .profiler import profiler_paused

__all__ = ["SuperBatchExpr", "FusedSuperBatchExpr", "SuperBatchFrame", "superbatch_collection"]


@dataclass(frozen=True)
class SuperBatchFrame:
    """The task function of one SuperBatch of the lazy frame: the unit of that SuperBatch
    (:class:`~dask_surge.execution.inputs.Unit`), computed and handed to ``func(partitions,
    sb_index, spans)``, whose frame it returns (where a written run's
    :class:`~dask_surge.execution.unit.UnitRunner` writes and commits it)."""

    func: Callable

    def __call__(self, source: UnitSource, values: list, unit: Unit):
        assert unit.plan is not None and unit.sizes is not None and len(unit.plan) == 1
        (sb,) = unit.plan
        with profiler_paused():
            held = dict(source.iterate(unit.partitions, values))
            inputs, spans = task_arguments(sb, dict(zip(unit.partitions, unit.sizes)))
            return self.func([held[p] for p in inputs], sb.index, spans)


class SuperBatchExpr(Expr):
    """``frame`` fused into SuperBatches; see module docstring.

    Operands: ``frame`` (input expression), ``plan`` (tuple of SuperBatch),
    ``sizes`` (planned rows per input partition), ``func`` (the per-SB
    callable) and ``meta`` (empty output frame).
    """

    _parameters = ["frame", "plan", "sizes", "func", "meta"]  # noqa: RUF012 - dask-expr declares operands so

    @functools.cached_property
    def _meta(self):
        return self.operand("meta")

    @property
    def _funcname(self) -> str:
        return "surge-superbatch"

    def _divisions(self):
        return (None,) * (len(self.operand("plan")) + 1)

    def rewrite(self, kind, rewritten):
        # Dask's "tune" pass may merge small input partitions (e.g. a projected
        # read_parquet) into fewer ones, which would shift the partition ids the
        # plan was made for. The plan *is* our tuning: keep the input as planned.
        if kind == "tune":
            return self
        return super().rewrite(kind, rewritten)

    def finalize_compute(self):
        # Dask gathers a computed frame through Repartition(frame, 1), and the scheduler reads
        # annotations from the top expression only: the SuperBatch priorities were dropped
        # and SuperBatches ran in dask.order's order, not plan order (later first output,
        # and makespans that varied with that order).
        return _GatheredSuperBatches(self)

    def _lower(self):
        return FusedSuperBatchExpr(_Upstream(self.frame), *self.operands[1:])


class _Upstream:
    """The input expression, held outside the expression tree: :class:`FusedSuperBatchExpr`
    builds its tasks itself, so Dask must not add them to the graph a second time."""

    def __init__(self, expr) -> None:
        self.wrapped = expr  # not `.expr`: Dask unwraps any operand that has one

    def __dask_tokenize__(self):
        return ("surge-upstream", self.wrapped._name)

    def __repr__(self) -> str:
        return f"upstream({self.wrapped._name})"


class FusedSuperBatchExpr(SuperBatchExpr):
    """:class:`SuperBatchExpr` lowered: one task per SuperBatch that also reads or computes
    the input partitions only it consumes.

    A partition's upstream tasks (its read, its ``map_partitions`` chain) run inside the
    task of the SuperBatch that consumes them, and a plain ``read_parquet``'s files are read
    by that task (:class:`~dask_surge.execution.inputs.InputGraph`): a graph over ``P`` tiny
    partitions has ``G`` tasks, not ``P + G`` (per-task overhead is the cost SuperBatching
    removes). Partitions several SuperBatches share (the slices of a partition larger than
    ``b_max``) or tasks an input shares with other partitions stay separate tasks. SuperBatch tasks are marked as data producers, so the
    scheduler hands each to a worker with a free slot (and, once every worker is full,
    queues them in priority order) rather than to the worker that holds its inputs.
    """

    _parameters = ["upstream", "plan", "sizes", "func", "meta"]  # noqa: RUF012 - dask-expr declares operands so

    @property
    def frame(self):
        return self.operand("upstream").wrapped

    def _lower(self):
        return None

    @functools.cached_property
    def _fused(self) -> tuple[dict, dict]:
        """``(graph, priorities)``: each SuperBatch's task (the task of its unit, built by
        :class:`~dask_surge.execution.inputs.InputGraph` as a written run's are), the tasks
        they still need (a partition sliced over several SuperBatches, read once; upstream
        tasks several partitions share), and every key's priority."""
        plan, sizes = self.operand("plan"), self.operand("sizes")
        inputs = InputGraph(self.frame, planned=len(sizes))
        units = [Unit.of(sb, sizes) for sb in plan]
        consumers = Counter(p for unit in units for p in unit.partitions)
        shared = frozenset(p for p, n in consumers.items() if n > 1)
        runner = SuperBatchFrame(self.operand("func"))
        graph, priority, top = {}, {}, len(plan)
        for position, unit in enumerate(units):  # shared tasks: the priority of their first SuperBatch
            for key, task in inputs.task((self._name, position), runner, unit, shared).items():
                if key not in graph:
                    graph[key], priority[key] = task, top - position
        return graph, priority

    def _layer(self) -> dict:
        return self._fused[0]

    def __dask_annotations__(self):
        return {"priority": self._fused[1]}


class _GatheredSuperBatches(Expr):
    """Every SuperBatch's output in one partition (what ``compute()`` returns), keeping their priorities."""

    _parameters = ["frame"]  # noqa: RUF012 - dask-expr declares operands so

    @functools.cached_property
    def _meta(self):
        return self.frame._meta

    def _divisions(self):
        return (None, None)

    def _layer(self) -> dict:
        from dask.dataframe.core import _concat

        key = (self._name, 0)
        parts = List(*(TaskRef((self.frame._name, i)) for i in range(self.frame.npartitions)))
        return {key: Task(key, _concat, parts)}

    def __dask_annotations__(self):
        return self.frame.__dask_annotations__()


def superbatch_collection(frame, plan: Sequence[SuperBatch], sizes: Sequence[int], func: Callable, meta):
    """Wrap ``frame`` (a Dask DataFrame) into a DataFrame with one partition per SuperBatch.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> from dask_surge.planning.policy import plan_superbatches
    >>> ddf = dd.from_pandas(pd.DataFrame({"x": range(10)}), npartitions=5)
    >>> plan = plan_superbatches([2] * 5, b_min=4, b_max=6)
    >>> fused = superbatch_collection(ddf, plan, [2] * 5, _concat_rows, ddf._meta)
    >>> fused.npartitions, fused.map_partitions(len).compute().tolist()
    (3, [4, 4, 2])
    """
    if not plan:  # nothing to encode: an empty frame of the output schema
        import dask.dataframe as dd

        return dd.from_pandas(meta, npartitions=1)
    expr = SuperBatchExpr(frame.expr, tuple(plan), tuple(int(n) for n in sizes), func, meta)
    return new_collection(expr)


def _concat_rows(parts, sb_index, spans):
    """Example per-SB function: concatenate the planned rows (used in doctests)."""
    import pandas as pd

    by_partition = dict(zip(sorted({s.partition for s, _ in spans}), parts))
    return pd.concat([by_partition[s.partition].iloc[s.start : s.stop] for s, _ in spans])
