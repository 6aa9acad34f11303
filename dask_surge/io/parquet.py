"""Reading a plain ``read_parquet`` input ourselves: its files and row groups per partition,
footers through Arrow fragments, and whole SuperBatches of files in one Arrow scan.

The files of one input may disagree on a column's type where it holds no value (pandas writes
an empty text column as ``double``): each column is read as one type for the whole run, its
**target** (:func:`column_targets`), to which an empty or all-null column is cast. Files that
disagree where they hold values (integers in one, strings in another) are refused, from their
footers before anything is encoded (:func:`check_footers`), else when the files are read.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _compat
from ..errors import SurgeInputError
from .frames import FrameRows
from .store import arrow_local_fs

__all__ = [
    "parquet_pieces",
    "ParquetPartitions",
    "arrow_fragments",
    "scan_files",
    "string_types",
    "dataset_schema",
    "read_footers",
    "column_targets",
    "check_footers",
    "check_sources",
    "type_family",
]


def parquet_pieces(expr) -> tuple | None:
    """``(fs, [(path, row_groups), ...] per partition, columns)`` for a plain ``read_parquet``.

    Only for Dask's default (fsspec) Parquet reader without filters, hive
    partition columns or index columns; ``None`` otherwise (the generic path is used).
    """

    columns = None
    # dask does not push a projection of several columns into the read (keep= would then lose
    # the footer sizes and cost a full size pass): read those columns ourselves
    if (
        isinstance(expr, _compat.Projection)
        and isinstance(expr.frame, _compat.ReadParquetFSSpec)
        and isinstance(expr.operand("columns"), list)
    ):
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
    inputs (row-group pieces, remote filesystems) file by file in Python threads: one scan
    of many small local files is several times faster than reading them one by one.
    """

    def __init__(self, fs, pieces: dict, columns: tuple, dtypes: tuple, targets: tuple = ()) -> None:
        self.fs, self.pieces, self.columns, self.dtypes = fs, pieces, columns, dtypes
        #: ``(column, Arrow type, file that holds it)`` each file's columns are resolved to (see
        #: :func:`column_targets`); ``()``: none (the files are concatenated as they are)
        self.targets = targets

    @classmethod
    def of(cls, expr) -> ParquetPartitions | None:
        """The reader of every partition of ``expr`` (a dask-expr expression) when it is a plain
        ``read_parquet`` (see :func:`parquet_pieces`), else None.

        Reads the footer of the input's first file (of more, in order, while a column it reads is
        empty or all null in those): what each column's type is across the files."""
        simple = _compat.simplified(expr)
        found = parquet_pieces(simple)
        if found is None or len(found[1]) != expr.npartitions:
            return None
        fs, pieces, columns = found
        paths = list(dict.fromkeys(path for path, _ in pieces))
        schema = dataset_schema(simple)
        targets = column_targets(schema, columns, paths, lambda path: read_footers(fs, [path])[path])
        # a column whose type the meta took from an empty file (double for an empty text column) is read
        # as its target, not cast to the meta's dtype, which its values do not fit
        weak = {c for c, t, _ in targets if type_family(schema.field(c).type) != type_family(t)}
        dtypes = tuple((c, str(t)) for c, t in expr._meta.dtypes.items() if c not in weak)
        return cls(fs, dict(enumerate(pieces)), tuple(columns), dtypes, tuple(targets))

    def subset(self, partitions) -> ParquetPartitions:
        """The reader of ``partitions`` alone (what one task ships)."""
        return ParquetPartitions(
            self.fs, {p: self.pieces[p] for p in partitions}, self.columns, self.dtypes, self.targets
        )

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

    def _resolved(self, table, path: str):
        """``table`` (read from ``path``) with each column as its target type: an empty or all-null
        column takes it, a column of the same kind is cast to it (``string`` to ``large_string``,
        ``int32`` to ``int64``). Raises :class:`SurgeInputError` where values disagree."""
        import pyarrow as pa

        for column, target, origin in self.targets:
            i = table.schema.get_field_index(column)
            have = table.column(i)
            if have.type == target:
                continue
            if have.null_count == len(have):
                table = table.set_column(i, column, pa.chunked_array([pa.nulls(len(have), target)]))
                continue
            if type_family(have.type) == type_family(target):
                try:
                    table = table.set_column(i, column, _cast(have, target))
                    continue
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
                    raise SurgeInputError(
                        _conflict(
                            path,
                            column,
                            have.type,
                            origin,
                            target,
                            f" ({err}); nothing of its SuperBatch was written",
                        )
                    ) from None
            raise SurgeInputError(
                _conflict(path, column, have.type, origin, target, "; nothing of its SuperBatch was written")
            )
        return table

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
        pieces = [self.pieces[p] for p in partitions]
        tables = [self._resolved(t, path) for t, (path, _) in zip(self._tables(pieces), pieces)]
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


def _cast(column, target):
    """``column`` (a ChunkedArray) as ``target``, a type of its family (:func:`type_family`). Arrow has no
    cast between some string types (``string_view`` and dictionaries): those go through
    ``large_string`` (``large_binary``), a dictionary decoded first."""
    import pyarrow as pa

    try:
        return column.cast(target)
    except pa.ArrowNotImplementedError:
        if type_family(target) not in ("string", "binary"):
            raise
    if pa.types.is_dictionary(column.type):
        column = pa.chunked_array(
            [chunk.dictionary_decode() for chunk in column.chunks], column.type.value_type
        )
    plain = pa.large_string() if type_family(target) == "string" else pa.large_binary()
    return column.cast(plain).cast(target)


def dataset_schema(expr):
    """The Arrow schema Dask took the input's meta from (its first file's, or ``_metadata``'s), of a
    ``read_parquet`` or a projection of one (what :func:`parquet_pieces` accepts)."""
    if isinstance(expr, _compat.Projection):
        expr = expr.frame
    return expr._dataset_info["schema"]


def type_family(pa_type) -> str:
    """What kind of values an Arrow type holds: types of one family cast into each other without
    changing what the values mean (``string``, ``large_string``, ``string_view`` and dictionaries
    of them; integers and floats; each time unit...); ``"null"`` holds none.

    Examples
    --------
    >>> import pyarrow as pa
    >>> type_family(pa.string_view()), type_family(pa.dictionary(pa.int8(), pa.large_string()))
    ('string', 'string')
    >>> type_family(pa.int32()) == type_family(pa.float64()), type_family(pa.timestamp("ms", "UTC"))
    (True, 'timestamp')
    """
    import pyarrow as pa

    t = pa_type.value_type if pa.types.is_dictionary(pa_type) else pa_type
    kinds = (
        ("null", pa.types.is_null),
        ("string", pa.types.is_string),
        ("string", pa.types.is_large_string),
        ("string", pa.types.is_string_view),
        ("binary", pa.types.is_binary),
        ("binary", pa.types.is_large_binary),
        ("binary", pa.types.is_binary_view),
        ("number", pa.types.is_integer),
        ("number", pa.types.is_floating),
        ("number", pa.types.is_decimal),
        ("bool", pa.types.is_boolean),
        ("timestamp", pa.types.is_timestamp),
        ("date", pa.types.is_date),
        ("time", pa.types.is_time),
        ("duration", pa.types.is_duration),
    )
    return next((kind for kind, test in kinds if test(t)), str(t))


def read_footers(fs, paths: Sequence[str]) -> dict:
    """``{path: pyarrow.parquet.FileMetaData}`` of each file of ``paths``: local files through Arrow
    fragments (GIL-free), others through ``fs`` in threads (the latency of each footer overlaps)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    paths = list(dict.fromkeys(paths))
    local = arrow_local_fs(fs)
    if local is not None:  # Arrow's own listing: several times faster than through fsspec
        fragments = arrow_fragments(local, paths)
        for fragment in fragments:
            fragment.ensure_complete_metadata()
        return {path: fragment.metadata for path, fragment in zip(paths, fragments)}

    def footer(path):
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata

    with ThreadPoolExecutor(max_workers=min(16, len(paths) or 1)) as pool:
        return dict(zip(paths, pool.map(footer, paths)))


def _column_counts(md, column: str) -> tuple[int, int | None]:
    """``(rows, nulls)`` of ``column`` in a file (``nulls``: None where a row group has no statistics)."""
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    col = names.index(column)
    nulls: int | None = 0
    for r in range(md.num_row_groups):
        stats = md.row_group(r).column(col).statistics
        if stats is None or not stats.has_null_count or nulls is None:
            nulls = None
        else:
            nulls += stats.null_count
    return md.num_rows, nulls


def _holds_values(md, column: str) -> bool | None:
    """Whether ``column`` holds a value in the file of ``md`` (None: its footer cannot tell)."""
    rows, nulls = _column_counts(md, column)
    if rows == 0:
        return False
    return None if nulls is None else nulls < rows


def column_targets(schema, columns: Sequence[str], paths: Sequence[str], footer) -> list[tuple]:
    """``(column, Arrow type, file)`` for each of ``columns``: the type every file's column is read as.

    It is ``schema``'s (the type Dask's meta took from the input's first file), unless that file
    holds no value in the column (an empty file: pandas writes an empty text column as ``double``):
    then the type of the first file of ``paths`` that holds one, read with ``footer(path)`` (a
    ``FileMetaData``). ``file`` is the file that holds the type, for messages (``""`` where no file
    holds a value in the column).
    """
    targets: dict[str, tuple] = {}
    pending = [c for c in columns if c in schema.names]
    for path in paths:
        if not pending:
            break
        md = footer(path)
        arrow = md.schema.to_arrow_schema()
        for c in list(pending):
            if c not in arrow.names:
                continue  # refused by check_footers, or when the file is read
            own = arrow.field(c).type
            held = type_family(own) != "null" and _holds_values(md, c)  # (a null column has no statistics)
            if held is not False:  # values, or no statistics to tell: its own type is what the column is
                meta = schema.field(c).type
                targets[c] = (meta if type_family(meta) == type_family(own) else own, path)
                pending.remove(c)
    for c in pending:  # no file holds a value: the meta's type (and no file to name)
        targets[c] = (schema.field(c).type, "")
    return [(c, *targets[c]) for c in columns if c in targets]


def check_footers(
    targets: Sequence[tuple], columns: Sequence[str], footers: dict, text: str | None = None
) -> None:
    """Refuse, from their footers, files that miss a column the run reads or hold values of another
    kind in it than its target (:func:`column_targets`), and a ``text`` column whose files hold values
    that are not strings: before anything is encoded.

    Raises
    ------
    SurgeInputError
        Naming the file, the column, its type there and the file that holds the target type.
    """
    wanted = {c: (t, origin) for c, t, origin in targets}
    if (
        text in wanted
        and wanted[text][1]
        and type_family(wanted[text][0]) not in ("string", "binary", "null")
    ):
        origin = wanted[text][1]
        held = (
            footers[origin].schema.to_arrow_schema().field(text).type
            if origin in footers
            else wanted[text][0]
        )
        raise SurgeInputError(
            f"the text column {text!r} holds {held} values ({origin!r}): only strings can be encoded. Nothing "
            f"was encoded. Fix: pass the column that holds the texts, or convert it first, e.g. "
            f"ddf[{text!r}] = ddf[{text!r}].astype(str)."
        )
    for path, md in footers.items():
        arrow = md.schema.to_arrow_schema()
        missing = [c for c in columns if c not in arrow.names]
        if missing:
            raise SurgeInputError(
                f"{path!r} has no column {missing[0]!r} (its columns: {arrow.names}), but the run reads "
                f"{list(columns)} from every file. Nothing was encoded. Fix: drop the file from the input, "
                "or add the column to it."
            )
        for c, (target, origin) in wanted.items():
            have = arrow.field(c).type
            if (
                type_family(have) != type_family(target)
                and type_family(have) != "null"
                and _holds_values(md, c)
            ):
                raise SurgeInputError(_conflict(path, c, have, origin, target, "; nothing was encoded"))


def check_sources(expr) -> None:
    """:func:`check_footers` for each plain ``read_parquet`` among the sources of ``expr`` (a dask-expr
    expression), whatever steps follow it (Dask reads their files then, one partition at a time).

    Raises
    ------
    SurgeInputError
        As :func:`check_footers`: before any of the input is computed.
    """
    for leaf in _compat.simplified(expr).walk():
        found = parquet_pieces(leaf) if isinstance(leaf, _compat.ReadParquetFSSpec) else None
        if found is None:
            continue
        fs, pieces, columns = found
        paths = list(dict.fromkeys(path for path, _ in pieces))
        footers = read_footers(fs, paths)
        check_footers(
            column_targets(dataset_schema(leaf), columns, paths, footers.__getitem__), columns, footers
        )


def _conflict(path: str, column: str, have, origin: str, target, what: str) -> str:
    return (
        f"{path!r} holds column {column!r} as {have}, but {origin!r} holds {type_family(target)} values in "
        f"it (the run reads it as {target}){what}. The files of one input must agree on each column's kind "
        "of values where they hold any (an empty or all-null column may be of any type). Fix: rewrite "
        f"{path!r} with {column!r} as {target}, or leave the file out of the input."
    )


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
