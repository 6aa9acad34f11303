"""Reading a plain ``read_parquet`` input ourselves: its files and row groups per partition,
footers through Arrow fragments, and whole SuperBatches of files in one Arrow scan."""

from __future__ import annotations

from collections.abc import Sequence

from .. import _compat
from ..errors import SurgeInputError
from .frames import FrameRows

__all__ = ["parquet_pieces", "ParquetPartitions", "arrow_local_fs", "arrow_fragments", "scan_files",
           "string_types"]


def parquet_pieces(expr) -> tuple | None:
    """``(fs, [(path, row_groups), ...] per partition, columns)`` for a plain ``read_parquet``.

    Only for Dask's default (fsspec) Parquet reader without filters, hive
    partition columns or index columns; ``None`` otherwise (the generic path is used).
    """

    columns = None
    # dask does not push a projection of several columns into the read (measured: keep=
    # then lost the footer sizes and cost a full size pass): read those columns ourselves
    if isinstance(expr, _compat.Projection) and isinstance(expr.frame, _compat.ReadParquetFSSpec) \
            and isinstance(expr.operand("columns"), list):
        columns, expr = list(expr.columns), expr.frame
    if not isinstance(expr, _compat.ReadParquetFSSpec) or expr.filters:
        return None
    info = expr._dataset_info
    # index_cols is [None] for files pandas wrote with its default RangeIndex (metadata only)
    if info["partition_names"] or any(c is not None for c in info["index_cols"]) or expr._series:
        return None
    parts = info["plan"]["parts"]
    pieces = []
    for i in expr._partitions:
        piece = parts[i]["piece"]
        if piece[2]:  # per-piece filters
            return None
        pieces.append((piece[0], None if piece[1] is None else tuple(piece[1])))
    return info["fs"], pieces, columns if columns is not None else list(expr.columns)


class ParquetPartitions:
    """Reads input partitions straight from their Parquet files (``pieces``: partition ->
    ``(path, row groups or None)``), all at once, with one conversion to pandas.

    Whole local files are read in one Arrow scan (Arrow's own threads, no GIL); other
    inputs (row-group pieces, remote filesystems) file by file in Python threads.
    Measured on 250 files of ~110 rows: 0.18 s file by file through fsspec, 0.05-0.07 s
    in one scan.
    """

    def __init__(self, fs, pieces: dict, columns: tuple, dtypes: tuple) -> None:
        self.fs, self.pieces, self.columns, self.dtypes = fs, pieces, columns, dtypes

    @classmethod
    def of(cls, expr) -> ParquetPartitions | None:
        """The reader of every partition of ``expr`` (a dask-expr expression) when it is a plain
        ``read_parquet`` (see :func:`parquet_pieces`), else None."""
        found = parquet_pieces(_compat.simplified(expr))
        if found is None or len(found[1]) != expr.npartitions:
            return None
        fs, pieces, columns = found
        dtypes = tuple((c, str(t)) for c, t in expr._meta.dtypes.items())
        return cls(fs, dict(enumerate(pieces)), tuple(columns), dtypes)

    def subset(self, partitions) -> ParquetPartitions:
        """The reader of ``partitions`` alone (what one task ships)."""
        return ParquetPartitions(self.fs, {p: self.pieces[p] for p in partitions}, self.columns, self.dtypes)

    def __repr__(self) -> str:
        return f"ParquetPartitions({len(self.pieces)} partitions, columns={list(self.columns)})"

    def _read(self, piece):
        import pyarrow.parquet as pq

        path, row_groups = piece
        with self.fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            missing = [c for c in self.columns if c not in pf.schema_arrow.names]
            if missing:  # Arrow would read the file without them, and the concat fill them with nulls
                raise SurgeInputError(
                    f"{path!r} has no column {missing[0]!r} (its columns: {pf.schema_arrow.names}), but the "
                    f"run reads {list(self.columns)} from every file. Nothing was written for its "
                    "SuperBatch. Fix: drop the file from the input, or add the column to it."
                )
            if row_groups is None:
                return pf.read(columns=list(self.columns), use_threads=False)
            return pf.read_row_groups(list(row_groups), columns=list(self.columns), use_threads=False)

    def _tables(self, pieces: list) -> list:
        """One Arrow table per piece, in order."""
        from concurrent.futures import ThreadPoolExecutor

        paths = [path for path, _ in pieces]
        local = arrow_local_fs(self.fs)
        if local is not None and len(set(paths)) == len(paths) and all(rg is None for _, rg in pieces):
            tables = scan_files(local, paths, list(self.columns))
            if tables is not None:
                return tables
        with ThreadPoolExecutor(max_workers=min(8, len(pieces) or 1)) as pool:
            return list(pool.map(self._read, pieces))

    def iterate(self, partitions, values: list):
        """``(partition, frame)`` for each of ``partitions``, in order (``values``: unused)."""
        for p, rows in self.rows(partitions):
            yield p, rows.sliced()

    def rows(self, partitions):
        """``(partition, FrameRows)`` for each of ``partitions``, in order: views of one frame of
        them all (see :class:`~dask_surge.io.frames.FrameRows`)."""
        import pyarrow as pa

        partitions = list(partitions)
        tables = self._tables([self.pieces[p] for p in partitions])
        lengths = [t.num_rows for t in tables]
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        frame = table.to_pandas(types_mapper=string_types)
        cast = {c: t for c, t in self.dtypes if str(frame.dtypes[c]) != t}  # most often none: no copy
        if cast:
            frame = frame.astype(cast)
        offset = 0
        for p, n in zip(partitions, lengths):
            yield p, FrameRows(frame, offset, offset + n)
            offset += n


def arrow_local_fs(fs):
    """A ``pyarrow.fs.LocalFileSystem`` for fsspec's local filesystem, else None.

    Examples
    --------
    >>> import fsspec
    >>> type(arrow_local_fs(fsspec.filesystem("file"))).__name__
    'LocalFileSystem'
    >>> arrow_local_fs(fsspec.filesystem("memory")) is None
    True
    """
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return None
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def arrow_fragments(filesystem, paths: Sequence[str]) -> list:
    """A Parquet fragment per file of ``paths`` (nothing read yet)."""
    import pyarrow.dataset as ds

    fmt = ds.ParquetFileFormat()
    return [fmt.make_fragment(path, filesystem) for path in paths]


def scan_files(filesystem, paths: Sequence[str], columns: list) -> list | None:
    """``columns`` of each whole file of ``paths`` as one table each, from one Arrow scan.

    None unless every file holds ``columns`` with the same types (a scan would fill a
    missing column with nulls and cast the rest): the caller then reads file by file,
    which raises or promotes types as a plain read does.
    """
    import pyarrow as pa
    import pyarrow.dataset as ds

    fragments = arrow_fragments(filesystem, paths)
    try:
        schemas = [f.physical_schema for f in fragments]  # the footers, which the scan then reuses
        if any(c not in sc.names for sc in schemas for c in columns):
            return None
        fields = [schemas[0].field(c) for c in columns]
        if any(sc.field(c).type != f.type for sc in schemas[1:] for c, f in zip(columns, fields)):
            return None
        dataset = ds.FileSystemDataset(fragments, schemas[0], ds.ParquetFileFormat(), filesystem)
        batches: dict[str, list] = {path: [] for path in paths}
        for tagged in dataset.scanner(columns=columns, use_threads=True).scan_batches():
            batches[tagged.fragment.path].append(tagged.record_batch)  # in order within a file
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError):
        return None
    return [pa.Table.from_batches(batches[path], schema=pa.schema(fields)) for path in paths]


def string_types(pa_type):
    import pandas as pd
    import pyarrow as pa

    if pa.types.is_string(pa_type) or pa.types.is_large_string(pa_type):
        return pd.StringDtype("pyarrow")
    return None
