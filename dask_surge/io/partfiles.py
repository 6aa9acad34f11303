"""A part file's bytes: the Arrow table of an encoded frame, its row groups, its Parquet serialization.

One module states how dask-surge writes Parquet (types, row groups, codecs, statistics), for
the SuperBatch writer (:mod:`dask_surge.execution.sink`) and the skipped-nulls files.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import get
from .hashing import text_hash_field
from .layout import FAMILY_COLUMNS, PARTITION, PAYLOAD_COLUMNS, ROW, TEXT_HASH

__all__ = ["ROW_GROUP_ROWS", "row_groups", "table_of", "parquet_bytes", "skipped_bytes"]


#: Rows a part file's row group holds at least (but the file's last): whole source partitions, in order,
#: are gathered until this many: a row group per partition costs several times the write time and more
#: bytes (``docs/ab_studies.md``, "Row groups"), and readers pay per row group too.
ROW_GROUP_ROWS = 1024


def table_of(frame: pd.DataFrame) -> pa.Table:
    """Arrow table of an encoded frame; the embedding column is not copied.

    No pandas metadata is stored: the file is plain Arrow types that every
    Parquet reader understands.
    """
    table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)
    i = table.schema.get_field_index(TEXT_HASH)
    if i >= 0:  # the field records the hash algorithm (dask_surge.io.hashing)
        table = table.set_column(i, text_hash_field(), table.column(i))
    return table


def skipped_bytes(skipped) -> bytes:
    """Parquet bytes of the ``(partition, row)`` pairs of skipped nulls (int64 columns).

    Examples
    --------
    >>> import io, pyarrow.parquet as pq
    >>> pq.read_table(io.BytesIO(skipped_bytes([(0, 1), (2, 5)]))).to_pylist()
    [{'partition': 0, 'row': 1}, {'partition': 2, 'row': 5}]
    """
    pairs = np.asarray(skipped, dtype=np.int64).reshape(-1, 2)
    table = pa.table({PARTITION: pairs[:, 0], ROW: pairs[:, 1]})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def row_groups(partition_rows, floor: int = ROW_GROUP_ROWS) -> list[int]:
    """Rows of each row group of a part file whose source partitions have ``partition_rows`` rows, in order.

    A row group holds whole partitions, consecutive ones, and closes once it holds at
    least ``floor`` rows: no partition is split across row groups, so the ``partition``
    column's statistics in the footer name the one row group that holds a partition.

    Parameters
    ----------
    partition_rows : sequence of int
        Rows of each source partition in the file, in file order (zeros are left out).
    floor : int, default ROW_GROUP_ROWS
        Rows a row group gathers at least, but the last.

    Returns
    -------
    list of int
        Rows of each row group; they sum to ``sum(partition_rows)``.

    Examples
    --------
    >>> row_groups([600, 300, 200, 5000, 10, 10], floor=1024)
    [1100, 5000, 20]
    >>> row_groups([])
    []
    """
    groups, rows = [], 0
    for n in partition_rows:
        rows += int(n)
        if rows >= floor:
            groups.append(rows)
            rows = 0
    if rows:
        groups.append(rows)
    return groups


def parquet_bytes(table: pa.Table, group_rows, compression: str | None = None) -> memoryview:
    """Serialize ``table`` to Parquet in row groups of ``group_rows`` rows each, in order
    (a part file's are :func:`row_groups`).

    Dictionary encoding and statistics are off for the model's output columns
    (``embedding``; a sparse output's ``indices`` and ``values``; a multi-vector
    output's ``vectors``: :data:`~dask_surge.io.layout.PAYLOAD_COLUMNS`): they
    cost write time and help no reader. Statistics are on for ``partition`` and
    ``row`` so a reader can find a partition's row group from the footer alone.
    ``text_hash`` (random 16-byte values) is written plain: a dictionary of
    distinct hashes only costs write time and bytes.

    Parameters
    ----------
    table : pyarrow.Table
    group_rows : sequence of int
        Rows of each row group, in order.
    compression : {"none", "snappy", "lz4", "zstd"}, optional
        Codec of the model's output columns; None reads ``surge.compression`` (default
        ``"none"``: float vectors barely compress, see README "Performance"). The
        other columns are always zstd.

    Returns
    -------
    memoryview
        The file's bytes, a view of the Arrow buffer they were written into
        (no copy); ``bytes(...)`` makes one if needed.

    Examples
    --------
    >>> import pyarrow as pa, pyarrow.parquet as pq
    >>> t = pa.table({"partition": [0, 0], "row": [0, 1], "embedding": [[1.0, 2.0], [3.0, 4.0]]})
    >>> data = parquet_bytes(t, [2], compression="none")
    >>> pq.read_table(pa.BufferReader(data)).num_rows
    2
    """

    codec = get("compression", compression)
    sink = pa.BufferOutputStream()
    payload = _payload(tuple(table.column_names))
    other = [c for c in table.column_names if c not in payload]
    codecs = {
        leaf: (codec if leaf.split(".", 1)[0] in payload else "zstd") for leaf in _leaf_paths(table.schema)
    }
    with pq.ParquetWriter(
        sink,
        table.schema,
        use_dictionary=[c for c in other if c not in (PARTITION, ROW, TEXT_HASH)],
        write_statistics=other,
        compression=codecs,
    ) as writer:
        offset = 0
        for rows in group_rows:
            if rows:
                writer.write_table(table.slice(offset, rows), row_group_size=rows)
                offset += rows
        if table.num_rows == 0:
            writer.write_table(table)
    return memoryview(sink.getvalue())


def _payload(names: tuple[str, ...]) -> frozenset[str]:
    """The model's output columns among ``names``: those of the first family (dense, sparse, multi-vector)
    whose columns are all there, so a kept input column named ``values`` stays an ordinary column of a
    dense output.

    Examples
    --------
    >>> sorted(_payload(("row", "values", "embedding"))), sorted(_payload(("row", "indices", "values")))
    (['embedding'], ['indices', 'values'])
    """
    for columns in FAMILY_COLUMNS.values():
        if all(c in names for c in columns):
            return frozenset(columns) & PAYLOAD_COLUMNS
    return frozenset()


@functools.lru_cache(maxsize=32)
def _leaf_paths(schema: pa.Schema) -> tuple[str, ...]:
    """Parquet leaf column paths of ``schema`` (``embedding.list.element``...), as per-column options key them."""
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    parquet_schema = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    return tuple(parquet_schema.column(i).path for i in range(len(parquet_schema)))
