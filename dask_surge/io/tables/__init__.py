"""Table outputs: the rows of a run committed to a Lance, Delta or Iceberg table instead of part files.

What a table format offers dask-surge (:class:`~dask_surge.io.tables.lance.LanceTable`,
:class:`~dask_surge.io.tables.delta.DeltaOutput`, :class:`~dask_surge.io.tables.iceberg.IcebergTable`):

* ``write(arrow_table) -> payload``: on a worker, the SuperBatch's rows as the table's data
  files, not committed (no reader sees them); the payload (a JSON string) goes into the
  SuperBatch's commit record in the manifest (``<output>/_surge/``);
* ``commit(run_id, [(sb, payload), ...], read_version) -> version``: in the process holding
  the run's claim, one table version holding those SuperBatches, its commit metadata naming
  the run (:data:`RUN_PROPERTY`) and the SuperBatches (:data:`SUPERBATCHES_PROPERTY`);
* ``history(run_id, since) -> History``: what the table's own history says: which
  SuperBatches of the run it holds, and what other writers did.

The policy (when to commit, what a resume does, what another writer's change does) is
:mod:`dask_surge.execution.tables`'. Where a table lives is :mod:`.locations`' job.
"""

from __future__ import annotations

from typing import Any

from ...config import get
from ...errors import SurgeValueError
from .base import (
    FENCE_PROPERTY,
    FORMATS,
    REPAIRED_PROPERTY,
    RUN_PROPERTY,
    SUPERBATCHES_PROPERTY,
    TABLE_FORMATS,
    CommitConflict,
    History,
    require,
)
from .delta import DeltaOutput
from .iceberg import IcebergTable
from .lance import LanceTable

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
    "open_table",
    "detect",
    "table_class",
]

#: format -> the class of its table output
_CLASSES: dict[str, Any] = {"lance": LanceTable, "delta": DeltaOutput, "iceberg": IcebergTable}


def table_class(fmt: str) -> Any:
    """The class of a ``fmt`` table output.

    Examples
    --------
    >>> table_class("delta").__name__
    'DeltaOutput'
    """
    try:
        return _CLASSES[fmt]
    except KeyError:
        raise SurgeValueError(
            f"format={fmt!r} is not a table format. Fix: choose one of {TABLE_FORMATS}."
        ) from None


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
    return next((fmt for fmt, cls in _CLASSES.items() if cls.MARKER in names), None)


def open_table(fmt: str, location: Any) -> Any:
    """The table object of format ``fmt`` at ``location`` (a :class:`~.locations.TableLocation`).

    Raises an error naming the extra to install when the format's package is missing.
    """
    cls = table_class(fmt)
    require({"lance": "lance", "delta": "deltalake", "iceberg": "pyiceberg"}[fmt])
    if fmt == "iceberg":  # the catalog and the identifier: surge.iceberg-catalog, surge.iceberg-table
        return cls(location, get("iceberg-catalog"), get("iceberg-table"))
    return cls(location)
