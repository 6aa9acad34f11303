"""The SuperBatch graph: one Dask task per SuperBatch, consuming exactly its partitions.

:class:`SuperBatchExpr` is a dask-expr expression (a private Dask API; the
supported Dask range is pinned in ``pyproject.toml``). Output partition ``k`` is
``func(input partitions of SB k, SB index, spans of SB k)``; the input partitions
feed only their SuperBatch task, so no process ever holds all N rows. Lowered
(:class:`FusedSuperBatchExpr`), each SuperBatch task also runs the upstream tasks only
it consumes, so the graph has one task per SuperBatch, not one per partition. Tasks
carry priorities ``G - k`` so SuperBatches complete in plan order.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from .._compat import Expr, GraphNode, List, Task, TaskRef, new_collection
from ..errors import SurgeError
from ..io.parquet import ParquetPartitions, parquet_pieces
from ..planning.policy import SuperBatch

__all__ = ["SuperBatchExpr", "cull", "superbatch_collection", "private_tasks", "dependents_of", "input_files"]


def cull(dsk: dict, keys) -> dict:
    """The tasks ``keys`` need, and nothing else (keys not in ``dsk``, such as
    persisted results, are left to the scheduler).

    Examples
    --------
    >>> from dask._task_spec import Task, TaskRef
    >>> dsk = {"a": Task("a", int, "1"), "b": Task("b", int, TaskRef("a")), "c": Task("c", int, "2")}
    >>> sorted(cull(dsk, ["b"]))
    ['a', 'b']
    """
    out, stack = {}, list(keys)
    while stack:
        key = stack.pop()
        if key in out or key not in dsk:
            continue
        out[key] = task = dsk[key]
        stack.extend(getattr(task, "dependencies", ()))
    return out


def dependents_of(graph: dict) -> dict:
    """Each key's dependents in ``graph`` (a dict of task-spec nodes)."""
    dependents: dict = {}
    for key, task in graph.items():
        for dep in getattr(task, "dependencies", ()):
            dependents.setdefault(dep, set()).add(key)
    return dependents


def private_tasks(upstream: dict, dependents: dict, root, deps) -> set:
    """``root`` and the upstream tasks that feed only it (directly or through each other):
    the tasks to fuse into ``root``'s task. Tasks other keys also need, and persisted
    results (Futures: not task-spec nodes), stay outside.

    Examples
    --------
    >>> from dask._task_spec import Task, TaskRef
    >>> up = {"a": Task("a", int, "1"), "s": Task("s", int, "2"),
    ...       "p0": Task("p0", max, TaskRef("a"), TaskRef("s")), "p1": Task("p1", int, TaskRef("s"))}
    >>> sorted(private_tasks(up, dependents_of(up), "p0", up["p0"].dependencies))
    ['a', 'p0']
    """
    private, stack = {root}, list(deps)
    while stack:  # a key is pushed again by each dependent: the last push decides
        dep = stack.pop()
        if dep not in private and isinstance(upstream.get(dep), GraphNode) \
                and dependents.get(dep, set()) <= private:
            private.add(dep)
            stack.extend(upstream[dep].dependencies)
    return private


def task_arguments(sb: SuperBatch, sizes: Sequence[int] | Mapping[int, int]) -> tuple[list[int], tuple]:
    """The input partitions a SuperBatch task consumes (in order) and its
    ``(span, planned rows of that partition)`` pairs, as the per-SB function takes them."""
    inputs = sorted({s.partition for s in sb.spans})
    return inputs, tuple((span, int(sizes[span.partition])) for span in sb.spans)


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
        # and SuperBatches ran in dask.order's order (measured: 7 of them in the order
        # 3, 1, 2, 6, 0, 4, 5, and one layout 7.6 s or 9.2 s depending on it).
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
    """:class:`SuperBatchExpr` lowered: one task per SuperBatch that also runs the input
    tasks only it consumes.

    A partition's upstream tasks (its read, its ``map_partitions`` chain) are fused into
    the task of the SuperBatch that consumes them, as the Parquet fast path reads its own
    files: a graph over ``P`` tiny partitions has ``G`` tasks, not ``P + G`` (per-task
    overhead is the cost SuperBatching removes). Inputs several SuperBatches share (the
    slices of a partition larger than ``b_max``) or tasks an input shares with other
    partitions stay separate tasks. SuperBatch tasks are marked as data producers, so the
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
        """``(graph, priorities)``: the SuperBatch tasks with their private upstream tasks
        fused in, the upstream tasks they still need, and every key's priority."""
        import dask

        with dask.config.set({"optimization.tune.active": False}):  # keep the planned partitions
            frame = self.frame.optimize(fuse=True)
        plan, sizes = self.operand("plan"), self.operand("sizes")
        if frame.npartitions != len(sizes):
            raise SurgeError(
                f"the input now has {frame.npartitions} partitions but the SuperBatch plan was made "
                f"for {len(sizes)}: Dask re-partitioned it after planning. "
                "Fix: call .surge.encode on the final DataFrame (after repartition/merge), "
                "or persist it first."
            )
        upstream = dict(frame.__dask_graph__())
        func = self.operand("func")
        tasks = {}
        for position, sb in enumerate(plan):
            key = (self._name, position)
            inputs, spans = task_arguments(sb, sizes)
            refs = List(*(TaskRef((frame._name, p)) for p in inputs))
            tasks[key] = Task(key, func, refs, sb.index, spans, _data_producer=True)

        dependents = dependents_of({**upstream, **tasks})
        graph, priority, top = {}, {}, len(plan)
        for position, (key, task) in enumerate(tasks.items()):
            private = private_tasks(upstream, dependents, key, task.dependencies)
            fused = Task.fuse(*(upstream[k] for k in private if k != key), task, key=key)
            if not fused.data_producer:
                assert isinstance(fused, Task)  # a fused task is a Task
                fused = Task(key, fused.func, *fused.args, _data_producer=True, **fused.kwargs)
            graph[key] = fused
            priority[key] = top - position
        for key in tasks:  # shared upstream tasks: the priority of their first SuperBatch
            for dep, node in cull(upstream, graph[key].dependencies).items():
                if dep not in graph:
                    graph[dep] = node
                    priority[dep] = priority[key]
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
    fast = parquet_superbatch_collection(frame, plan, sizes, func, meta)
    if fast is not None:
        return fast
    expr = SuperBatchExpr(frame.expr, tuple(plan), tuple(int(n) for n in sizes), func, meta)
    return new_collection(expr)


def _concat_rows(parts, sb_index, spans):
    """Example per-SB function: concatenate the planned rows (used in doctests)."""
    import pandas as pd

    by_partition = dict(zip(sorted({s.partition for s, _ in spans}), parts))
    return pd.concat([by_partition[s.partition].iloc[s.start : s.stop] for s, _ in spans])


# -- Parquet fast path ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ParquetSuperBatch:
    """One SuperBatch task that reads its own Parquet files (no per-partition tasks)."""

    func: Callable
    fs: object
    columns: tuple
    dtypes: tuple

    def __dask_tokenize__(self):
        from dask.base import tokenize

        return ("ParquetSuperBatch", tokenize(self.func), tokenize(self.fs), self.columns, self.dtypes)

    def __call__(self, spec) -> pd.DataFrame:
        sb_index, pieces, spans = spec
        source = ParquetPartitions(self.fs, dict(enumerate(pieces)), self.columns, self.dtypes)
        return self.func([frame for _, frame in source.iterate(range(len(pieces)), [])], sb_index, spans)


def parquet_superbatch_collection(frame, plan, sizes, func, meta):
    """Like :func:`superbatch_collection` for a plain ``read_parquet``: each SuperBatch task
    reads its own files, so the graph has one task per SuperBatch and nothing else.
    Returns ``None`` when ``frame`` is not such an input."""
    import dask.dataframe as dd

    found = parquet_pieces(frame.expr.simplify())
    if found is None or len(found[1]) != len(sizes):
        return None
    if any(sb.spans[0].start > 0 or sb.spans[-1].stop < sizes[sb.spans[-1].partition] for sb in plan):
        return None  # a partition sliced over SuperBatches: the generic graph reads it once
    fs, pieces, columns = found
    dtypes = tuple((c, str(t)) for c, t in frame._meta.dtypes.items())
    reader = ParquetSuperBatch(func, fs, tuple(columns), dtypes)
    specs = []
    for sb in plan:
        inputs, spans = task_arguments(sb, sizes)
        specs.append((sb.index, tuple(pieces[p] for p in inputs), spans))
    return dd.from_map(reader, specs, meta=meta, enforce_metadata=False, label="surge-superbatch",
                       divisions=(None,) * (len(specs) + 1))


def input_files(frame) -> list[str]:
    """Paths (as their filesystem names them) that the input's readers name: a file, a
    directory or a glob for each path operand of the expression's leaves, and a plain
    ``read_parquet``'s files. Nothing is listed or read (used to keep outputs out of inputs).

    Examples
    --------
    >>> import os, tempfile, pandas as pd, dask.dataframe as dd
    >>> d = tempfile.mkdtemp()
    >>> pd.DataFrame({"text": ["a"]}).to_parquet(os.path.join(d, "x.parquet"))
    >>> any(p.endswith("x.parquet") for p in input_files(dd.read_parquet(d)))
    True
    """
    from fsspec.core import url_to_fs

    found: list[str] = []

    def strings(value) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            return list(value)
        return []

    for expr in frame.expr.walk():
        if expr.dependencies():
            continue
        for value in expr.operands:
            for s in strings(value):
                if "/" in s or os.sep in s or "://" in s:
                    try:
                        found.append(url_to_fs(s)[1].rstrip("/"))
                    except (ValueError, ImportError):  # not a path after all
                        continue
        info = getattr(expr, "_dataset_info", None) if "Parquet" in type(expr).__name__ else None
        if isinstance(info, dict):
            found += [part["piece"][0] for part in info.get("plan", {}).get("parts", []) if "piece" in part]
    return found
