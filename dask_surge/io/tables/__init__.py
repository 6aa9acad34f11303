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
    "CommitConflict",
    "History",
    "require",
    "open_table",
]


def open_table(fmt: str, location: Any) -> Any:
    """The table object of format ``fmt`` at ``location`` (a :class:`~.locations.TableLocation`).

    Raises an error naming the extra to install when the format's package is missing.
    """
    if fmt == "lance":
        require("lance")
        return LanceTable(location)
    if fmt == "delta":
        require("deltalake")
        return DeltaOutput(location)
    if fmt == "iceberg":  # the catalog and the identifier: surge.iceberg-catalog, surge.iceberg-table
        require("pyiceberg")
        return IcebergTable(location, get("iceberg-catalog"), get("iceberg-table"))
    raise SurgeValueError(f"format={fmt!r} is not a table format. Fix: choose one of {TABLE_FORMATS}.")
