"""What every table format shares: the commit-metadata keys, :class:`History`, :func:`require`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ...errors import SurgeError, SurgeOutputError

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
    "variable_lists",
]

#: every value of ``format=``; all but ``"parquet"`` are table formats
FORMATS = ("parquet", "lance", "delta", "iceberg")
TABLE_FORMATS = FORMATS[1:]
#: commit-metadata key holding the run id of a table commit
RUN_PROPERTY = "dask-surge.run"
#: commit-metadata key holding the JSON list of SuperBatch keys of a table commit
SUPERBATCHES_PROPERTY = "dask-surge.superbatches"
#: commit-metadata key holding the claim token of the process that made the version (every version a
#: run makes names it; a *fence* version, which holds no SuperBatch, is where a claim holder's commits begin)
FENCE_PROPERTY = "dask-surge.fence"
#: commit-metadata key of a repair version: the JSON list of SuperBatches whose second copy it removed
#: (the table's history names them twice; from then on only their first version holds them)
REPAIRED_PROPERTY = "dask-surge.repaired"

#: module -> (pip extra, the distribution that provides it)
_EXTRAS = {
    "lance": ("lance", "pylance"),
    "deltalake": ("delta", "deltalake"),
    "pyiceberg": ("iceberg", "pyiceberg"),
    "faiss": ("faiss", "faiss-cpu"),
}


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
        if "numpy._core" in str(err):  # built for NumPy 2 (faiss-cpu >= 1.12 says numpy>=1.25, but needs 2)
            import numpy

            raise SurgeError(
                f"the installed {dist!r} package was built for NumPy 2, and this environment has NumPy "
                f"{numpy.__version__} ({err}). Fix: pip install 'numpy>=2', or an older {dist} built for NumPy 1 "
                "(faiss-cpu<1.12)."
            ) from err
        how = f'pip install "dask-surge[{extra}]"' if extra else f"pip install {dist}"
        raise SurgeError(
            f"this needs the {dist!r} package, which is not installed ({err}). Fix: {how}."
        ) from err


class CommitConflict(SurgeOutputError):
    """The store refused a table commit: the table moved on since the version the commit was based on.

    Nothing of the commit landed. Raised by a format's ``fence`` and ``commit`` when the store's own
    conditional commit fails (Lance: a conflicting transaction; Delta: an application transaction of
    the run committed since; Iceberg: the branch's snapshot changed; a table created meanwhile). The
    committer reads the table's history again and decides: retry, or stop when another process's
    fence came after its own (:class:`~dask_surge.execution.tables.TableCommitter`).
    """


def variable_lists(data: Any) -> Any:
    """``data`` (a ``pyarrow.Table``) with every fixed-size list column as a list of the same values:
    the type a Delta or Iceberg table declares for a vector (neither format has a fixed-size list), so
    that the data files hold what the table's schema says and every reader (polars, DuckDB, Spark)
    reads them; the length stays constant by construction. Zero-copy (the values are shared).

    Examples
    --------
    >>> import pyarrow as pa
    >>> t = pa.table({"e": pa.FixedSizeListArray.from_arrays(pa.array([1.0, 2.0], pa.float32()), 2)})
    >>> str(variable_lists(t).schema.field("e").type)
    'list<item: float>'
    """
    import pyarrow as pa

    columns = []
    for column in data.columns:
        if pa.types.is_fixed_size_list(column.type):
            column = column.cast(pa.list_(column.type.value_field))
        columns.append(column)
    return pa.Table.from_arrays(columns, names=data.column_names)


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
    fences : list of (int, str)
        ``(version, claim token)`` of every version of this run that names the token of the process
        that made it (:data:`FENCE_PROPERTY`), in order.
    """

    exists: bool
    version: int = 0
    ours: dict[str, int] = field(default_factory=dict)
    duplicates: list[str] = field(default_factory=list)
    foreign: list[tuple[int, str, str]] = field(default_factory=list)
    first_ours: bool | None = None
    #: version -> operation, of this run's versions
    ops: dict[int, str] = field(default_factory=dict)
    #: SuperBatch key -> every version of the run that holds it (two or more: a duplicate)
    held: dict[str, list[int]] = field(default_factory=dict)
    fences: list[tuple[int, str]] = field(default_factory=list)
    #: a version of the run replaced every row (what versions before it held is gone)
    replaced: bool = False
    #: SuperBatches whose second copy a version of the run removed
    repaired: list[str] = field(default_factory=list)

    def add_ours(
        self,
        version: int,
        superbatches: list,
        op: str,
        token: str = "",
        *,
        replaces: bool = False,
        repaired: list | None = None,
    ) -> None:
        """A version of this run was read: it holds ``superbatches``; ``token``: the claim token of the
        process that made it (empty: a build that wrote none); ``replaces``: it replaced the table's
        rows (what earlier versions held is gone); ``repaired``: SuperBatches whose second copy it
        removed (see :data:`REPAIRED_PROPERTY`)."""
        if self.first_ours is None:
            self.first_ours = True
        self.ops[version] = op
        if token:
            self.fences.append((version, token))
        if replaces:
            self.replaced = True
            self.ours.clear()
            self.held.clear()
            self.duplicates.clear()
        for sb in repaired or ():
            self.repaired.append(sb)
            if sb in self.held:
                self.held[sb] = self.held[sb][:1]
                self.ours[sb] = self.held[sb][0]
            self.duplicates = [d for d in self.duplicates if d != sb]
        for sb in superbatches:
            if sb in self.ours:
                self.duplicates.append(str(sb))
            self.ours[str(sb)] = version
            self.held.setdefault(str(sb), []).append(version)

    def note_foreign(self) -> None:
        """A version of another writer was read."""
        if self.first_ours is None:
            self.first_ours = False
