"""The SuperBatch graph: one Dask task per SuperBatch, consuming exactly its partitions.

:class:`SuperBatchExpr` is a dask-expr expression (a private Dask API; the
supported Dask range is pinned in ``pyproject.toml``). Output partition ``k`` is
``func(input partitions of SB k, SB index, spans of SB k)``; the input partition tasks
feed only their SuperBatch task, so no process ever holds all N rows. Tasks
carry priorities ``G - k`` so SuperBatches complete in plan order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from dask._task_spec import List, Task, TaskRef
from dask.dataframe.dask_expr import new_collection
from dask.dataframe.dask_expr._expr import Expr

from .errors import SurgeError
from .policy import SuperBatch

__all__ = ["SuperBatchExpr", "superbatch_collection"]


class SuperBatchExpr(Expr):
    """``frame`` fused into SuperBatches; see module docstring.

    Operands: ``frame`` (input expression), ``plan`` (tuple of SuperBatch),
    ``sizes`` (planned rows per input partition), ``func`` (the per-SB
    callable) and ``meta`` (empty output frame).
    """

    _parameters = ["frame", "plan", "sizes", "func", "meta"]

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

    def _spans(self, sb: SuperBatch) -> tuple:
        sizes = self.operand("sizes")
        return tuple((span, sizes[span.partition]) for span in sb.spans)

    def _layer(self) -> dict:
        frame, plan = self.frame, self.operand("plan")
        if frame.npartitions != len(self.operand("sizes")):
            raise SurgeError(
                f"the input now has {frame.npartitions} partitions but the SuperBatch plan was made "
                f"for {len(self.operand('sizes'))}: Dask re-partitioned it after planning. "
                "Fix: call .surge.encode on the final DataFrame (after repartition/merge), "
                "or persist it first."
            )
        func = self.operand("func")
        dsk = {}
        for position, sb in enumerate(plan):
            key = (self._name, position)
            inputs = sorted({s.partition for s in sb.spans})
            refs = List(*(TaskRef((frame._name, p)) for p in inputs))
            dsk[key] = Task(key, func, refs, sb.index, self._spans(sb))
        return dsk

    def _upstream_names(self) -> list[str]:
        """Names of the partition-aligned expressions feeding ``frame`` (itself included).

        Blockwise chains are not always fused into one task per partition
        (``persist`` keeps them apart), so every stage of partition ``i`` gets
        the priority of the SuperBatch that consumes it.
        """
        names, stack, seen = [], [self.frame], set()
        while stack:
            expr = stack.pop()
            if expr._name in seen or expr.npartitions != self.frame.npartitions:
                continue
            seen.add(expr._name)
            names.append(expr._name)
            stack.extend(expr.dependencies())
        return names

    def __dask_annotations__(self):
        plan = self.operand("plan")
        top = len(plan)
        priority = {}
        names = self._upstream_names()
        for position, sb in enumerate(plan):
            for span in sb.spans:
                for name in names:
                    # an input partition shared by several slices takes its first SB's priority
                    priority.setdefault((name, span.partition), top - position)
            priority[(self._name, position)] = top - position
        return {"priority": priority}


def superbatch_collection(frame, plan: Sequence[SuperBatch], sizes: Sequence[int], func: Callable, meta):
    """Wrap ``frame`` (a Dask DataFrame) into a DataFrame with one partition per SuperBatch.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> from dask_surge.policy import plan_superbatches
    >>> ddf = dd.from_pandas(pd.DataFrame({"x": range(10)}), npartitions=5)
    >>> plan = plan_superbatches([2] * 5, b_min=4, b_max=6)
    >>> fused = superbatch_collection(ddf, plan, [2] * 5, _concat_rows, ddf._meta)
    >>> fused.npartitions, fused.map_partitions(len).compute().tolist()
    (3, [4, 4, 2])
    """
    expr = SuperBatchExpr(frame.expr, tuple(plan), tuple(int(n) for n in sizes), func, meta)
    return new_collection(expr)


def _concat_rows(parts, sb_index, spans):
    """Example per-SB function: concatenate the planned rows (used in doctests)."""
    import pandas as pd

    by_partition = dict(zip(sorted({s.partition for s, _ in spans}), parts))
    return pd.concat([by_partition[s.partition].iloc[s.start : s.stop] for s, _ in spans])
