"""The input graph, and the one task of each unit of work over it: what the lazy frame
(:mod:`dask_surge.execution.graph`) and the written run (:mod:`dask_surge.execution.runner`)
both build their tasks with.

A **unit** is one Dask task over some input partitions (one SuperBatch of the lazy frame;
a SuperBatch, the slices of one large partition, or a range of partitions of a written
run). :class:`InputGraph` collects the input's tasks once, optimized with the partitioning
that was planned, and gives the task of any unit: ``func(source, values, unit)``, where
``source.iterate(partitions, values)`` yields the unit's partitions one at a time.

- A plain ``read_parquet`` input is read by the unit task itself
  (:class:`dask_surge.io.parquet.ParquetPartitions`: one Arrow scan of its files), so the
  graph has no per-partition tasks.
- Any other input: each partition's private upstream tasks (those that feed only it,
  directly or through each other) are fused into one node, held as data inside the unit
  task (so Dask does not schedule them) and run there when the partition is needed.

Upstream tasks several partitions need, persisted results, and partitions that several
units consume (the slices of a partition larger than ``b_max`` in separate SuperBatches)
stay separate tasks, computed once; the unit task is given their values.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._compat import (
    Alias,
    BaseExpr,
    GraphNode,
    List,
    Task,
    TaskRef,
    convert_legacy_graph,
    expr_operands,
    is_dask_future,
    untuned,
)
from ..errors import SurgeError
from ..io.parquet import ParquetPartitions, check_sources
from ..io.store import is_posix
from ..planning.policy import SuperBatch

__all__ = [
    "InputGraph",
    "Unit",
    "UnitSource",
    "cull",
    "dependents_of",
    "filed_as",
    "input_files",
    "private_tasks",
    "task_arguments",
    "task_spec_graph",
]


@dataclass(frozen=True)
class Unit:
    """One task's work: input ``partitions`` (in order), the SuperBatches planned over
    them (``None``: formed as the partitions stream in), and the keys of SuperBatches
    already committed (a resumed slice of a partition larger than ``b_max``)."""

    partitions: tuple[int, ...]
    plan: tuple[SuperBatch, ...] | None = None
    done: frozenset[str] = frozenset()
    sizes: tuple[int, ...] | None = None  # planned rows of each partition (planned mode)
    #: ``(partition, rows, digest)`` committed for partitions this unit covers in part (resume)
    expect: tuple[tuple[int, int, str | None], ...] = ()

    def __dask_tokenize__(self) -> tuple:
        # plain tuples, not Dask's field-by-field walk of each dataclass (see Span.__dask_tokenize__)
        plan = None if self.plan is None else tuple(sb.__dask_tokenize__() for sb in self.plan)
        return ("Unit", self.partitions, plan, tuple(sorted(self.done)), self.sizes, self.expect)

    @classmethod
    def of(cls, sb: SuperBatch, sizes: Sequence[int] | Mapping[int, int]) -> Unit:
        """The unit of one planned SuperBatch (``sizes``: planned rows of each input partition).

        Examples
        --------
        >>> from dask_surge.planning.policy import plan_superbatches
        >>> sb = plan_superbatches([3, 4, 20], b_min=5, b_max=8)[0]
        >>> Unit.of(sb, [3, 4, 20]).partitions, Unit.of(sb, [3, 4, 20]).sizes
        ((0, 1), (3, 4))
        """
        partitions = tuple(sorted({s.partition for s in sb.spans}))
        return cls(partitions, (sb,), sizes=tuple(int(sizes[p]) for p in partitions))


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


def task_spec_graph(graph: Mapping) -> dict:
    """``graph`` with every task as a task-spec node: some Dask layers still build legacy tuple
    tasks (a repartition to fewer partitions, the disk shuffle of a local scheduler's merge or
    shuffle), whose dependencies only the scheduler can tell, by looking up every key in the
    graph. Persisted results (Futures: Dask's, or another library's ``__dask_future__``) stay as
    they are: they are not tasks to fuse.

    Examples
    --------
    >>> from operator import add
    >>> g = task_spec_graph({"a": 1, "b": (add, "a", 10), "c": Task("c", add, TaskRef("b"), 1)})
    >>> [type(g[k]).__name__ for k in "abc"], g["b"].dependencies
    (['DataNode', 'Task', 'Task'], frozenset({'a'}))
    >>> g["c"]({"b": 11})
    12
    """
    persisted = {key: value for key, value in graph.items() if is_dask_future(value)}
    converted = convert_legacy_graph(
        {k: v for k, v in graph.items() if k not in persisted}, all_keys=set(graph)
    )
    return {**{k: filed_as(k, v) for k, v in converted.items()}, **persisted}


def filed_as(key, node):
    """``node`` keyed as the graph files it: Dask's ``from_delayed`` (without ``verify_meta``)
    files ``Alias(delayed key)`` under its own partition key, which its scheduler runs by the
    graph's key but fusing (which chains nodes by their own keys) cannot.

    Examples
    --------
    >>> node = filed_as(("fromdelayed", 0), Alias(("delayed", 0)))
    >>> node.key, node.dependencies
    (('fromdelayed', 0), frozenset({('delayed', 0)}))
    """
    if not isinstance(node, GraphNode) or node.key == key:
        return node
    if isinstance(node, Alias):
        return Alias(key, node.target)
    return node.substitute({}, key=key)


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
        if (
            dep not in private
            and isinstance(upstream.get(dep), GraphNode)
            and dependents.get(dep, set()) <= private
        ):
            private.add(dep)
            stack.extend(upstream[dep].dependencies)
    return private


def task_arguments(sb: SuperBatch, sizes: Sequence[int] | Mapping[int, int]) -> tuple[list[int], tuple]:
    """The input partitions a SuperBatch consumes (in order) and its ``(span, planned rows
    of that partition)`` pairs, as the per-SuperBatch functions take them.

    Examples
    --------
    >>> from dask_surge.planning.policy import plan_superbatches
    >>> inputs, spans = task_arguments(plan_superbatches([3, 4], b_min=5, b_max=8)[0], [3, 4])
    >>> inputs, [(s.partition, s.start, s.stop, n) for s, n in spans]
    ([0, 1], [(0, 0, 3, 3), (1, 0, 4, 4)])
    """
    inputs = sorted({s.partition for s in sb.spans})
    return inputs, tuple((span, int(sizes[span.partition])) for span in sb.spans)


class UnitSource:
    """The partitions of one unit task, computed inside it (see module docstring).

    ``external`` are the keys whose values the task is given (in order: ``values``);
    ``shared`` maps partitions other tasks also consume to their key among them; ``nodes``
    holds the fused upstream task of each other partition (generic input) and ``reader``
    reads the rest from their Parquet files.
    """

    def __init__(
        self,
        external: tuple = (),
        nodes: Mapping[int, GraphNode] | None = None,
        reader: ParquetPartitions | None = None,
        shared: Mapping[int, Any] | None = None,
    ) -> None:
        self.external = external
        self.nodes = dict(nodes or {})
        self.reader = reader
        self.shared = dict(shared or {})

    def iterate(self, partitions: Sequence[int], values: Sequence) -> Iterator[tuple[int, Any]]:
        """``(partition, frame)`` for each of ``partitions``, in order, computed as it is asked for
        (the Parquet files of the unit are read together, at the first of them, and their
        partitions come as :class:`~dask_surge.io.frames.FrameRows` of that one frame)."""
        known = dict(zip(self.external, values))
        partitions = list(partitions)
        read = [p for p in partitions if p not in self.shared and p not in self.nodes]
        if read and self.reader is None:
            raise KeyError(f"partitions {read[:5]} are not part of this unit")
        frames = self.reader.rows(read) if read and self.reader is not None else iter(())
        for p in partitions:
            if p in self.shared:
                yield p, known[self.shared[p]]
            elif p in self.nodes:
                node = self.nodes[p]
                yield p, node({k: known[k] for k in node.dependencies})
            else:
                got, frame = next(frames)
                assert got == p
                yield p, frame

    def __repr__(self) -> str:
        return (
            f"UnitSource({len(self.nodes)} fused, {len(self.shared)} shared, "
            f"{len(self.reader.pieces) if self.reader is not None else 0} read)"
        )


def _read_partition(reader: ParquetPartitions, partition: int):
    """The task of a Parquet partition several units consume: read it once."""
    return next(iter(reader.iterate([partition], [])))[1]


class InputGraph:
    """The input's tasks, optimized once with the partitioning that was planned, and the task
    of any unit over them (see module docstring).

    Parameters
    ----------
    frame : dask.dataframe.DataFrame or its expression
        The input as the run reads it.
    planned : int, optional
        The partitions the SuperBatches were planned for (default: ``frame``'s).

    Raises
    ------
    SurgeError
        When the optimized input has another number of partitions than was planned.
    SurgeInputError
        When the files of a ``read_parquet`` among its sources disagree on a column's kind of values,
        or miss a column it reads (see :func:`dask_surge.io.parquet.check_sources`).
    """

    def __init__(self, frame, planned: int | None = None) -> None:
        expr = frame if isinstance(frame, BaseExpr) else frame.expr
        planned = expr.npartitions if planned is None else planned
        self.reader = ParquetPartitions.of(expr)
        self.name = expr._name  # the key of a partition other tasks need: (name, partition)
        self.graph: dict = {}
        self.dependents: dict = {}
        npartitions = expr.npartitions
        if self.reader is None:
            check_sources(
                expr
            )  # Parquet files whose types conflict, before any task (a plain read: when planned)
            with untuned():  # keep the planned partitions
                opt = expr.optimize(fuse=True)
            self.name, npartitions = opt._name, opt.npartitions
            self.graph = task_spec_graph(dict(opt.__dask_graph__()))
            self.dependents = dependents_of(self.graph)
        if npartitions != planned:
            raise SurgeError(
                f"the input now has {npartitions} partitions but the SuperBatch plan was made for "
                f"{planned}: Dask re-partitioned it after planning. Fix: call .surge.encode on the final "
                "DataFrame (after repartition/merge), or persist it first."
            )
        self.npartitions = npartitions

    @property
    def is_parquet(self) -> bool:
        """Whether the unit tasks read their Parquet files themselves."""
        return self.reader is not None

    def task(self, key, func, unit: Unit, shared: frozenset[int] | set[int] = frozenset()) -> dict:
        """The graph to submit for ``unit``: its task, ``func(source, values, unit)``, and the
        tasks it needs that others may need too. ``shared``: partitions that other units also
        consume (their task, keyed ``(self.name, partition)``, is among those returned)."""
        nodes: dict[int, GraphNode] = {}
        shared_keys: dict[int, Any] = {}
        external: set = set()
        extra: dict = {}
        for p in unit.partitions:
            root = (self.name, p)
            if p in shared:
                shared_keys[p] = root
                external.add(root)
                if self.reader is not None:
                    extra[root] = Task(root, _read_partition, self.reader.subset([p]), p)
            elif self.reader is None:
                private = private_tasks(self.graph, self.dependents, root, self.graph[root].dependencies)
                nodes[p] = Task.fuse(*(self.graph[k] for k in private), key=root)
                external |= set(nodes[p].dependencies)
        ext = tuple(sorted(external, key=str))
        reader = None
        if self.reader is not None:
            reader = self.reader.subset([p for p in unit.partitions if p not in shared])
        source = UnitSource(ext, nodes, reader, shared_keys)
        task = Task(key, func, source, List(*(TaskRef(k) for k in ext)), unit, _data_producer=True)
        return {key: task, **extra, **cull(self.graph, ext)}


#: operands of Dask's readers that never name a file (a column named like a directory is no input)
_NOT_PATHS = frozenset(
    {
        "columns", "index", "filters", "categories", "engine", "filesystem", "split_row_groups",
        "blocksize", "aggregate_files", "parquet_file_extension", "label", "user_meta", "meta",
        "user_divisions", "columns_arg_required", "enforce_metadata", "prefix", "storage_options",
        "dtype_backend",
    }
)  # fmt: skip


_GLOB = re.compile(r"[*?\[]")


def _filesystem(value: Any) -> Any:
    """``value`` as an fsspec filesystem when it is one (a ``pyarrow.fs`` one wrapped), else None."""
    fsspec, pafs = sys.modules.get("fsspec"), sys.modules.get("pyarrow.fs")
    if fsspec is not None and isinstance(value, fsspec.AbstractFileSystem):
        return value
    if pafs is not None and isinstance(value, pafs.FileSystem):
        from fsspec.implementations.arrow import ArrowFSWrapper

        return ArrowFSWrapper(value)
    return None


def _operand_values(value: Any, seen: set[int], depth: int = 0) -> Iterator[Any]:
    """The strings, path-like objects and fsspec ``OpenFile`` objects in an operand of a source: inside
    lists, tuples, dict values, ``functools.partial`` arguments, task-spec nodes (``read_csv``'s
    blocks) and the tasks of a ``Delayed`` (``read_json``'s)."""
    if isinstance(value, (str, os.PathLike)) or _is_open_file(value):
        yield value
        return
    if depth > 12 or id(value) in seen:
        return
    seen.add(id(value))
    children: Any = ()
    if isinstance(value, (list, tuple, set, frozenset)):
        children = value
    elif isinstance(value, dict):
        children = [v for k, v in value.items() if k not in _NOT_PATHS]
    elif isinstance(value, functools.partial):
        children = [value.args, value.keywords]
    elif isinstance(value, GraphNode):
        children = [getattr(value, "args", ()), getattr(value, "kwargs", {}), getattr(value, "value", None)]
    elif not isinstance(value, BaseExpr) and callable(getattr(value, "__dask_graph__", None)):
        with contextlib.suppress(Exception):  # a Delayed: the tasks of its graph
            children = list(dict(value.__dask_graph__()).values())
    for child in children:
        yield from _operand_values(child, seen, depth + 1)


def _is_open_file(value: Any) -> bool:
    core = sys.modules.get("fsspec.core")
    return core is not None and isinstance(value, core.OpenFile)


def _here() -> frozenset[str]:
    """The names in the working directory (a bare name is a path when one of them: one listing, not a
    ``stat`` per string of a ``from_map`` over millions of texts)."""
    try:
        return frozenset([*os.listdir("."), ".", ".."])
    except OSError:
        return frozenset()


def _located(
    text: str, *, path: bool, leaf_fs: Any, storage_options: Any, here: frozenset[str] = frozenset()
) -> tuple[Any, str] | None:
    """``(filesystem, path)`` of a string a source names, or None when it names no location.

    ``path``: the reader's own ``path`` operand, a location however it is spelled (``"in"``, relative
    to the working directory, as the reader reads it). Any other string is one when it is a URL, holds
    a separator or a glob character, or is one of ``here`` (the working directory's names:
    ``from_map(f, ["in"])``).
    """
    from fsspec.core import url_to_fs

    if not text or "\n" in text or len(text) > 4096:
        return None
    if not path and not (
        "://" in text or "::" in text or "/" in text or os.sep in text or _GLOB.search(text) or text in here
    ):
        return None
    try:
        if path and leaf_fs is not None and not is_posix(leaf_fs):
            fs = leaf_fs
            name = fs._strip_protocol(text) if hasattr(fs, "_strip_protocol") else text
            return fs, name.rstrip("/") or name
        options = dict(storage_options) if isinstance(storage_options, Mapping) else {}
        fs, name = url_to_fs(text, **options)
        if is_posix(fs):  # fsspec makes it absolute but keeps ".." ("/cwd/../data")
            name = os.path.normpath(name)
    except Exception:  # noqa: BLE001 - an unknown protocol, a string merely holding "://", a store client that cannot start
        return None
    return fs, name.rstrip("/") or name


def input_files(frame) -> list[tuple[Any, str]]:
    """Paths that the input's readers name, each with its fsspec filesystem (and as that
    filesystem names it: absolute, ``.``, ``..`` and repeated slashes collapsed; the output compares
    them with links resolved, :meth:`~dask_surge.io.store.OutputStore.contains`): a file, a directory
    or a glob for each path operand of the expression's sources (a reader's ``path`` however it is
    spelled, ``"in"`` as much as ``"/data/in/"``; a string ``from_map`` is given that holds a
    separator or names an existing file; the files ``read_csv`` and ``read_json`` open), and a plain
    ``read_parquet``'s files. Nothing is read (used to keep outputs out of inputs:
    :func:`dask_surge.io.directory.check_output`).

    Examples
    --------
    >>> import os, tempfile, pandas as pd, dask.dataframe as dd
    >>> d = tempfile.mkdtemp()
    >>> pd.DataFrame({"text": ["a"]}).to_parquet(os.path.join(d, "x.parquet"))
    >>> any(p.endswith("x.parquet") for _, p in input_files(dd.read_parquet(d)))
    True
    >>> from_map = dd.from_map(pd.read_parquet, [os.path.relpath(d)])  # relative, a directory that exists
    >>> os.path.abspath(d) in [p for _, p in input_files(from_map)]
    True
    """
    found: dict[tuple[int, str], tuple[Any, str]] = {}
    here = _here()

    def add(fs, path: str) -> None:
        found.setdefault((id(fs), path), (fs, path))

    for expr in frame.expr.walk():
        if expr.dependencies():
            continue
        params = expr_operands(expr)
        if not params and expr.operands:  # a source whose operands have no names (Delayed objects)
            params = {f"operand {i}": op for i, op in enumerate(expr.operands)}
        leaf_fs = next((fs for fs in map(_filesystem, params.values()) if fs is not None), None)
        storage_options = params.get("storage_options")
        for name, value in params.items():
            if name in _NOT_PATHS or name.startswith("_"):  # Dask's own: _partitions, caches
                continue
            for item in _operand_values(value, set()):
                if _is_open_file(item):
                    add(item.fs, os.path.normpath(item.path) if is_posix(item.fs) else item.path)
                    continue
                located = _located(
                    os.fspath(item),
                    path=name == "path",
                    leaf_fs=leaf_fs,
                    storage_options=storage_options,
                    here=here,
                )
                if located is not None:
                    add(*located)
        info = getattr(expr, "_dataset_info", None) if "Parquet" in type(expr).__name__ else None
        if isinstance(info, dict) and info.get("fs") is not None:
            for part in info.get("plan", {}).get("parts", []):
                if "piece" in part:
                    add(info["fs"], part["piece"][0])
    return list(found.values())
