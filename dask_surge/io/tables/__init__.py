"""Table outputs: the rows of a run committed to a Lance table instead of part files.

What a table format offers dask-surge (:class:`~dask_surge.io.tables.lance.LanceTable`):

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

import importlib
from dataclasses import dataclass, field
from typing import Any

from ...errors import SurgeError, SurgeValueError

__all__ = ["FORMATS", "TABLE_FORMATS", "RUN_PROPERTY", "SUPERBATCHES_PROPERTY", "History", "require", "open_table"]

#: every value of ``format=``; all but ``"parquet"`` are table formats
FORMATS = ("parquet", "lance")
TABLE_FORMATS = FORMATS[1:]
#: commit-metadata key holding the run id of a table commit
RUN_PROPERTY = "dask-surge.run"
#: commit-metadata key holding the JSON list of SuperBatch keys of a table commit
SUPERBATCHES_PROPERTY = "dask-surge.superbatches"

#: module -> (pip extra, the distribution that provides it)
_EXTRAS = {"lance": ("lance", "pylance"), "deltalake": ("delta", "deltalake"),
           "pyiceberg": ("iceberg", "pyiceberg"), "faiss": ("faiss", "faiss-cpu")}


def require(module: str) -> Any:
    """Import ``module`` (an optional dependency), or raise an error naming the extra to install.

    Examples
    --------
    >>> require("json").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra, dist = _EXTRAS.get(module, (None, module))
        how = f'pip install "dask-surge[{extra}]"' if extra else f"pip install {dist}"
        raise SurgeError(f"this needs the {dist!r} package, which is not installed ({err}). Fix: {how}.") from err


@dataclass
class History:
    """What a table's history says to a run (see :meth:`LanceTable.history`).

    Attributes
    ----------
    exists : bool
        False: there is no table yet.
    version : int
        The table's latest version when it was read.
    ours : dict of str to int
        SuperBatch key -> the version of the run that committed it.
    duplicates : list of str
        SuperBatches that two versions of the run both hold (never, unless the claim failed).
    foreign : list of (int, str, str)
        ``(version, operation, run)`` of every version another writer made (run: its
        dask-surge run id, or ``""``), in order.
    first_ours : bool or None
        Whether the first version read was this run's (None: none read).
    """

    exists: bool
    version: int = 0
    ours: dict[str, int] = field(default_factory=dict)
    duplicates: list[str] = field(default_factory=list)
    foreign: list[tuple[int, str, str]] = field(default_factory=list)
    first_ours: bool | None = None
    #: version -> operation, of this run's versions
    ops: dict[int, str] = field(default_factory=dict)

    def add_ours(self, version: int, superbatches: list, op: str) -> None:
        """A version of this run was read: it holds ``superbatches``."""
        if self.first_ours is None:
            self.first_ours = True
        self.ops[version] = op
        for sb in superbatches:
            if sb in self.ours:
                self.duplicates.append(str(sb))
            self.ours[str(sb)] = version

    def note_foreign(self) -> None:
        """A version of another writer was read."""
        if self.first_ours is None:
            self.first_ours = False


def open_table(fmt: str, location: Any) -> Any:
    """The table object of format ``fmt`` at ``location`` (a :class:`~.locations.TableLocation`).

    Raises an error naming the extra to install when the format's package is missing.
    """
    if fmt == "lance":
        require("lance")
        from .lance import LanceTable

        return LanceTable(location)
    raise SurgeValueError(f"format={fmt!r} is not a table format. Fix: choose one of {TABLE_FORMATS}.")
