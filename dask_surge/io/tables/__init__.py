"""Outputs: every format a run writes, behind one interface, found through one registry.

:class:`~.base.Output` is the interface (its docstring is the contract); each format is one class
in one module: :class:`~.parquet.ParquetOutput` (part files and the manifest),
:class:`~.lance.LanceTable`, :class:`~.delta.DeltaOutput` and :class:`~.iceberg.IcebergTable`
(:class:`~.base.TableOutput` s: workers write the table's uncommitted data files, the claim holder
commits them in fenced batches, :mod:`dask_surge.execution.tables`) and
:class:`~.pgvector.PgVectorTable` (a PostgreSQL table: workers stage rows with binary COPY, the claim
holder moves them in one transaction per batch; its run's state lives in a state directory, not at
the output). This module is the registry: :func:`output_class` by ``format=``, :func:`output_store`
of what a user names, :func:`open_output` on a store, :func:`detect` of what a directory holds. Nothing outside this package asks which format an output is; what differs is
what the classes declare (:attr:`~.base.Output.batched`, :attr:`~.base.Output.native_index`,
:attr:`~.base.Output.merges_columns`, ...). Where a table lives is :mod:`.locations`' job.
"""

from __future__ import annotations

from typing import Any

from ...errors import SurgeOutputError, SurgeValueError
from ..manifest import current_run
from ..store import OutputStore
from .base import (
    FENCE_PROPERTY,
    FORMATS,
    REPAIRED_PROPERTY,
    RUN_PROPERTY,
    SUPERBATCHES_PROPERTY,
    TABLE_FORMATS,
    CommitConflict,
    History,
    Output,
    TableOutput,
    require,
)
from .delta import DeltaOutput
from .iceberg import IcebergTable, named_catalog
from .lance import LanceTable
from .parquet import ParquetOutput
from .pgvector import PgVectorTable, is_address, redact_uri, state_store

__all__ = [
    "FORMATS",
    "TABLE_FORMATS",
    "RUN_PROPERTY",
    "SUPERBATCHES_PROPERTY",
    "FENCE_PROPERTY",
    "REPAIRED_PROPERTY",
    "CommitConflict",
    "History",
    "require",
    "Output",
    "TableOutput",
    "output_class",
    "open_output",
    "output_store",
    "detect",
    "detect_output",
    "table_class",
    "named_catalog",
    "display_name",
]

#: format -> its class: the registry (``format=`` takes these names)
_CLASSES: dict[str, Any] = {
    "parquet": ParquetOutput,
    "lance": LanceTable,
    "delta": DeltaOutput,
    "iceberg": IcebergTable,
    "pgvector": PgVectorTable,
}


def output_class(fmt: str) -> Any:
    """The class of the ``fmt`` output.

    Examples
    --------
    >>> output_class("delta").__name__, output_class("parquet").batched
    ('DeltaOutput', False)
    """
    try:
        return _CLASSES[fmt]
    except KeyError:
        raise SurgeValueError(
            f"format={fmt!r} is not an output format. Fix: choose one of {FORMATS}."
        ) from None


def display_name(fmt: str) -> str:
    """The ``fmt`` format as messages name it: its class's ``DISPLAY``, else its name capitalized.

    Examples
    --------
    >>> display_name("lance"), display_name("pgvector")
    ('Lance', 'pgvector')
    """
    cls = _CLASSES.get(fmt)
    return (cls.DISPLAY if cls is not None else None) or str(fmt).capitalize()


def table_class(fmt: str) -> Any:
    """The class of the ``fmt`` table output (:func:`output_class` of a batched format)."""
    cls = output_class(fmt)
    if not cls.batched:
        raise SurgeValueError(f"format={fmt!r} is not a table format. Fix: choose one of {TABLE_FORMATS}.")
    return cls


def output_store(
    output: Any,
    storage_options: dict | None = None,
    *,
    fmt: str | None = None,
    table: str | None = None,
    writing: bool = False,
) -> OutputStore:
    """The store of the output a user names: ``output`` itself (a path or URL), or for a database
    (``postgresql://...``) the state directory its runs keep their manifest in
    (:func:`~.pgvector.state_store`, ``table`` naming the table, else the URI's ``#schema.table``, else
    ``surge.table``). ``fmt``: the format asked for, which a database's URI must be.

    Examples
    --------
    >>> import tempfile
    >>> output_store(tempfile.mkdtemp()).kind
    'posix'
    """
    if is_address(output):
        if fmt is not None and fmt != PgVectorTable.name:
            raise SurgeValueError(
                f"output={redact_uri(output)!r} is a PostgreSQL database, and format={fmt!r} writes "
                "files. Fix: pass format='pgvector' and table='name' (or an output path for this format)."
            )
        return state_store(output, table, storage_options, writing=writing)
    if table is not None:
        raise SurgeValueError(
            f"table={table!r} names a PostgreSQL table, and output={str(output)!r} is not a PostgreSQL URI. Fix: "
            "pass format='pgvector' with output='postgresql://user@host:5432/db', or leave table out."
        )
    return OutputStore.open(output, storage_options, writing=writing)


def open_output(fmt: str, store: OutputStore) -> Any:
    """The ``fmt`` output at ``store``; an error naming the extra to install when the format's
    library is missing."""
    cls = output_class(fmt)
    if cls.LIBRARY:
        require(cls.LIBRARY)
    return cls.at(store)


def detect_output(store: OutputStore, records: Any = None) -> str:
    """The format of the output at ``store``, the one rule by which an existing output's format is
    recognised: the format whose table data the run's commit records carry (``records``, else the
    current run's; a table killed before its first commit has no marker yet), else the format whose
    marker the root holds (a table another tool wrote), else Parquet. A database's store
    (:func:`output_store` of a ``postgresql://`` URI: its location is the URI) is its format's, also
    before any run made its state directory.

    Examples
    --------
    >>> import tempfile
    >>> detect_output(OutputStore.open(tempfile.mkdtemp()))
    'parquet'
    """
    if is_address(getattr(store, "location", None)):
        return PgVectorTable.name
    if records is None:
        try:
            manifest = current_run(store) if store.isdir(store.root) else None
            records = manifest.committed().values() if manifest is not None else ()
        except SurgeOutputError:  # a damaged manifest: the root's markers decide (what reads it next says so)
            records = ()
    for rec in records:
        if not rec.table:
            return "parquet"
        return next(
            (fmt for fmt, cls in _CLASSES.items() if cls.batched and cls.owns_payload(rec.table)), "parquet"
        )
    names = store.listdir(store.root) if store.isdir(store.root) else []
    return detect(names) or "parquet"


def detect(names: Any) -> str | None:
    """The table format whose marker (Lance ``_versions/``, Delta ``_delta_log/``, Iceberg
    ``metadata/``) is among ``names`` (a directory's entries), or None: the one rule by which an
    existing table's format is recognised.

    Examples
    --------
    >>> detect(["_delta_log", "part-0.parquet"]), detect(["data", "_versions"]), detect(["x"])
    ('delta', 'lance', None)
    """
    names = set(names)
    return next((fmt for fmt, cls in _CLASSES.items() if cls.can_open(names)), None)
