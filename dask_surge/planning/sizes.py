"""Partition sizes: rows (and text bytes) from Parquet footers when possible, else one pass."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .. import _compat
from ..io.arrow import is_cudf
from ..io.parquet import check_footers, column_targets, dataset_schema, parquet_pieces, read_footers

__all__ = [
    "PartitionSizes",
    "partition_sizes",
    "known_sizes",
    "folded_sizes",
    "in_memory_sizes",
    "text_bytes",
]


@dataclass(frozen=True)
class PartitionSizes:
    """Rows per partition, text bytes per partition, and where the numbers came from.

    ``source`` is ``"metadata"`` when no data was read (Parquet footers, or
    in-memory frames whose lengths Dask knows) and ``"len-pass"`` otherwise.
    ``nbytes`` is the UTF-8 bytes of the text column per partition, or ``None``
    when not asked for. From Parquet footers it is the column's uncompressed
    size, exact for plain-encoded text and lower for dictionary-encoded repeats.
    """

    sizes: tuple[int, ...]
    source: str
    nbytes: tuple[int, ...] | None = None

    @property
    def total(self) -> int:
        return sum(self.sizes)


def metadata_lengths(expr) -> tuple[int, ...] | None:
    """Partition lengths that Dask can fold to a constant without reading data."""

    try:
        folded = _compat.Lengths(expr).simplify()
    except Exception:  # noqa: BLE001  # pragma: no cover - private API drift: fall back to counting
        return None
    if isinstance(folded, _compat.Literal) and isinstance(folded.operand("value"), (tuple, list)):
        return tuple(int(n) for n in folded.operand("value"))
    return None


def known_sizes(frame, column: str, max_bytes: int | None) -> PartitionSizes | None:
    """Partition sizes known without computing the input, or None.

    Rows and text bytes from the Parquet footers of a plain ``read_parquet`` or from the
    pandas frame of a ``dd.from_pandas``. Without a byte cap (``max_bytes=None``), rows
    alone wherever Dask folds the lengths to a constant. ``None`` for any other input:
    it is encoded in the streaming mode, which learns sizes as it computes partitions.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": list("abcde")}), npartitions=2)
    >>> known_sizes(ddf, "text", None)
    PartitionSizes(sizes=(3, 2), source='metadata', nbytes=None)
    >>> known_sizes(ddf, "text", 2**20)
    PartitionSizes(sizes=(3, 2), source='metadata', nbytes=(3, 2))
    >>> known_sizes(ddf.map_partitions(lambda d: d[d.text > "a"]), "text", 2**20) is None
    True
    """
    # a plain read_parquet: our footer read (one Arrow pass) before Dask's folding of the
    # lengths, which opens each footer again through fsspec
    footers = parquet_footer_sizes(frame, column)
    if footers is not None:
        return PartitionSizes(footers[0], "metadata", footers[1] if max_bytes else None)
    if max_bytes:  # the byte cap needs text bytes too: else the streaming mode measures them
        return in_memory_sizes(frame, column)
    return folded_sizes(frame)


def folded_sizes(frame) -> PartitionSizes | None:
    """Rows per partition where Dask folds the lengths to a constant, else None (also when the
    folded lengths do not count one per partition: Dask folded the wrong ones).

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> folded_sizes(dd.from_pandas(pd.DataFrame({"text": list("abcde")}), npartitions=2))
    PartitionSizes(sizes=(3, 2), source='metadata', nbytes=None)
    """
    lengths = metadata_lengths(frame.expr)
    if lengths is not None and len(lengths) == frame.npartitions:
        return PartitionSizes(lengths, "metadata")
    return None


def in_memory_sizes(frame, column: str) -> PartitionSizes | None:
    """Rows and text bytes of a ``dd.from_pandas`` frame, read from the pandas frame the
    client already holds (no task runs); None for any other input.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> in_memory_sizes(dd.from_pandas(pd.DataFrame({"text": ["ab", "c", "déf"]}), npartitions=2), "text")
    PartitionSizes(sizes=(2, 1), source='metadata', nbytes=(3, 4))
    """

    expr = _compat.simplified(frame.expr)
    if not isinstance(expr, _compat.FromPandas) or expr.operand("_partitions") is not None:
        return None
    data = getattr(expr.operand("frame"), "_data", None)  # dask wraps the pandas frame
    if data is None or column not in getattr(data, "columns", ()) or not data.index.is_monotonic_increasing:
        return None  # from_pandas(sort=True) reorders an unsorted frame: positions would not match
    bounds = expr._locations()
    if len(bounds) != frame.npartitions + 1:
        return None
    col = data[column]
    pairs = list(itertools.pairwise(bounds))
    return PartitionSizes(
        tuple(b - a for a, b in pairs), "metadata", tuple(text_bytes(col.iloc[a:b]) for a, b in pairs)
    )


def partition_sizes(frame, column: str | None = None) -> PartitionSizes:
    """Return the number of rows (and, with ``column``, text bytes) of each partition.

    For a plain ``dd.read_parquet`` (column projections, no filters) the
    numbers come from the Parquet footers and no data is read; row counts also
    survive element-wise operations on top. Otherwise (or when text bytes are
    asked for and the footers cannot give them) one task per partition computes
    ``len`` and the bytes of ``column`` on the current scheduler.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": list("abcde")}), npartitions=2)
    >>> partition_sizes(ddf)
    PartitionSizes(sizes=(3, 2), source='metadata', nbytes=None)
    """
    if column is not None:
        # rows and bytes from one read of the footers; without them bytes need the pass anyway
        footers = parquet_footer_sizes(frame, column)
        if footers is not None:
            return PartitionSizes(footers[0], "metadata", footers[1])
    elif (folded := folded_sizes(frame)) is not None:
        return folded
    # Not dask's Lengths expression: its constant folding can be wrong on a partition
    # subset of read_parquet (it filters the selected partitions twice). Without Dask's "tune"
    # pass, which may fuse small Parquet partitions (a read with filters or an index, a hive
    # layout): the sizes are those of the partitions the SuperBatches consume, as the
    # input graph (execution/inputs.py) computes them.
    with _compat.untuned():
        counted = frame.map_partitions(
            _count, column, enforce_metadata=False, meta={"rows": "int64", "bytes": "int64"}
        ).compute()
    rows = tuple(int(n) for n in counted["rows"])
    return PartitionSizes(rows, "len-pass", tuple(int(m) for m in counted["bytes"]) if column else None)


def _count(part, column):
    import pandas as pd

    return pd.DataFrame({"rows": [len(part)], "bytes": [text_bytes(part[column]) if column else 0]})


def text_bytes(series) -> int:
    """UTF-8 bytes of the strings in ``series`` (0 for a partition holding values that
    are not strings: those are refused, with their position, when the SuperBatch encodes).

    Examples
    --------
    >>> import pandas as pd
    >>> text_bytes(pd.Series(["ab", None, "é"]))
    4
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        # cuDF: its own Arrow export; pandas: zero-copy for Arrow-backed strings
        arr = series.to_arrow() if is_cudf(series) else pa.array(series, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError):
        return 0
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if not (
        pa.types.is_string(arr.type)
        or pa.types.is_large_string(arr.type)
        or pa.types.is_binary(arr.type)
        or pa.types.is_large_binary(arr.type)
    ):
        return 0
    return int(pc.sum(pc.binary_length(arr)).as_py() or 0)


def parquet_footer_sizes(frame, column: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Rows and uncompressed bytes of ``column`` in each partition, from the Parquet footers
    of a plain ``read_parquet`` (``None`` for any other input). Footers are read once per
    file (see :func:`~dask_surge.io.parquet.read_footers`).

    Raises
    ------
    SurgeInputError
        A file misses a column the run reads, or holds values of another kind in it than the
        other files, or the files hold values that are not strings in ``column`` (see
        :func:`~dask_surge.io.parquet.check_footers`): before anything is encoded.
    """
    expr = _compat.simplified(frame.expr)
    found = parquet_pieces(expr)
    if found is None or len(found[1]) != frame.npartitions:
        return None
    fs, pieces, columns = found
    paths = list(dict.fromkeys(path for path, _ in pieces))
    footers = read_footers(fs, paths)
    check_footers(
        column_targets(dataset_schema(expr), columns, paths, footers.__getitem__),
        columns,
        footers,
        text=column,
    )

    def groups(md):
        names = [md.schema.column(i).path for i in range(md.num_columns)]
        if column not in names:
            return None
        col = names.index(column)
        return [
            (md.row_group(r).num_rows, md.row_group(r).column(col).total_uncompressed_size)
            for r in range(md.num_row_groups)
        ]

    per_file = {path: groups(md) for path, md in footers.items()}
    rows, nbytes = [], []
    for path, row_groups in pieces:
        found_groups = per_file[path]
        if found_groups is None:
            return None
        chosen = found_groups if row_groups is None else [found_groups[r] for r in row_groups]
        rows.append(sum(n for n, _ in chosen))
        nbytes.append(sum(m for _, m in chosen))
    return tuple(rows), tuple(nbytes)
