"""The output interface: :class:`Output` (every format) and :class:`TableOutput` (formats whose claim
holder commits batches), with what they share: the commit-metadata keys, :class:`History`,
:class:`CommitConflict`, :func:`require`."""

from __future__ import annotations

import hashlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ... import config
from ...errors import SurgeError, SurgeValueError
from .commits import CommitConflict, TableCommitter, check_table_output, table_settled
from .locations import TableLocation

__all__ = [
    "FORMATS",
    "TABLE_FORMATS",
    "RUN_PROPERTY",
    "SUPERBATCHES_PROPERTY",
    "FENCE_PROPERTY",
    "REPAIRED_PROPERTY",
    "CommitConflict",
    "History",
    "Output",
    "Staged",
    "TableOutput",
    "require",
    "variable_lists",
    "write_data_file",
    "schema_text",
    "schema_of",
]

#: every value of ``format=``; all but ``"parquet"`` are table formats
FORMATS = ("parquet", "lance", "delta", "iceberg", "pgvector")
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
#: table property (Delta), config key (Lance) or key of the column's comment (PostgreSQL) prefix:
#: ``<prefix><column>`` holds the JSON embedding identity (model, prompt, normalization, precision,
#: truncate_dim...) that made a backfilled column's vectors (:func:`dask_surge.backfill.backfill`)
EMBEDDING_PROPERTY = "dask-surge.embedding."

#: module -> (pip extra, the distribution that provides it)
_EXTRAS = {
    "lance": ("lance", "pylance"),
    "deltalake": ("delta", "deltalake"),
    "pyiceberg": ("iceberg", "pyiceberg"),
    "faiss": ("faiss", "faiss-cpu"),
    "psycopg": ("pgvector", "psycopg"),
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


class Output(ABC):
    """One output format: where a run's rows go, and everything a user does with them after.

    Each format is one subclass in one module of this package, found through one registry
    (:func:`dask_surge.io.tables.output_class`, :func:`~dask_surge.io.tables.detect`); nothing
    outside the package asks which format it holds. What differs between formats is said by the
    class attributes below (capabilities), never by the format's name.

    The contract every format keeps (asked of each by ``tests/test_output_contract.py``):

    * every row of a run once, with the columns ``partition``, ``row``, kept columns, ``text_hash``
      and ``embedding``; a rerun resumes and never commits a SuperBatch twice, also after a kill
      or a pause of the claim holder (:class:`TableOutput`: fenced commits);
    * options the format cannot hold are refused before any work (:meth:`check_options`), and an
      output that is not the run's to write (someone else's table, a table of another format) is
      refused before anything is written;
    * the vector column's type is one the format's own schema declares, which DuckDB, polars and
      pyarrow read as a list or array of floats;
    * an index's search returns a distance for its metric, smaller is nearer.

    Attributes
    ----------
    name : str
        The value of ``format=``.
    MARKER : str or None
        The entry of a directory that says an output of this format is there (None: none, e.g. a
        Parquet output, recognised by its run, or a database).
    ENTRIES : frozenset of str
        What the format's own directory holds (a new output may hold these and ``_surge/`` only).
    batched : bool
        True: the claim holder commits SuperBatches to the format in batches (:class:`TableOutput`);
        False: a SuperBatch's commit record is its commit (Parquet's part files).
    native_index : bool
        True: the format's own vector index; False: a FAISS index beside the output.
    appends : bool
        ``mode="append"`` adds a run's rows to an output of this format that another run made.
    overwrites : bool
        ``overwrite=True`` replaces an output of this format (its rows stay readable until the new
        run completes).
    merges_columns : bool
        :func:`dask_surge.backfill.backfill` adds or refreshes a column of a table of this format.
    database : bool
        Addressed by a database URI (and ``table=``), not by a directory holding a :attr:`MARKER`.
    DISPLAY : str or None
        The format as messages name it (None: its :attr:`name` capitalized).
    precisions : frozenset of str
        The ``precision=`` values whose vectors the format can hold.
    """

    name: ClassVar[str]
    MARKER: ClassVar[str | None] = None
    ENTRIES: ClassVar[frozenset[str]] = frozenset()
    batched: ClassVar[bool] = True
    native_index: ClassVar[bool] = False
    appends: ClassVar[bool] = True
    overwrites: ClassVar[bool] = False
    merges_columns: ClassVar[bool] = False
    database: ClassVar[bool] = False
    DISPLAY: ClassVar[str | None] = None
    precisions: ClassVar[frozenset[str]] = frozenset({"float32", "float16", "int8", "binary"})
    #: the module the format needs (an optional dependency; None: none)
    LIBRARY: ClassVar[str | None] = None
    #: the output is found through a catalog, not by its location alone (Iceberg)
    catalogued: ClassVar[bool] = False

    @classmethod
    def at(cls, store: Any) -> Output:
        """The output of this format in ``store`` (an :class:`~dask_surge.io.store.OutputStore`)."""
        return cls(TableLocation.of(store))  # type: ignore[call-arg]

    @classmethod
    def can_open(cls, names: Iterable[str]) -> bool:
        """True when a directory holding ``names`` holds an output of this format (xarray's
        ``guess_can_open``)."""
        return cls.MARKER is not None and cls.MARKER in set(names)

    @classmethod
    def check_options(cls, *, output: Any, mode: str, overwrite: bool, precision: str) -> None:
        """Refuse, before any work, options this format cannot honour.

        Examples
        --------
        >>> from dask_surge.io.tables import output_class
        >>> output_class("delta").check_options(output="t", mode="create", overwrite=False, precision="float16")
        Traceback (most recent call last):
        ...
        dask_surge.errors.SurgeValueError: format='delta' cannot hold precision='float16' vectors ...
        """
        if output is None and cls.batched:
            raise SurgeValueError(
                f"format={cls.name!r} writes a table at output=...; output=None returns a lazy frame. Fix: pass "
                "output='path/table'."
            )
        if overwrite and not cls.overwrites:
            raise SurgeValueError(
                f"format={cls.name!r} writes a table at output=..., which it never replaces: overwrite=True is "
                "for Parquet. Fix: pass output='path/table' and no overwrite (a new path, or mode='append' to "
                "add to a table)."
            )
        if mode == "append" and not cls.appends:
            raise SurgeValueError(
                f"mode='append' adds rows to a table output; a {cls.name} output holds one run. Fix: pass "
                "format='lance', 'delta' or 'iceberg', or leave mode='create'."
            )
        if precision not in cls.precisions:
            raise SurgeValueError(
                f"format={cls.name!r} cannot hold precision={precision!r} vectors (its types: "
                f"{sorted(cls.precisions)}). Nothing was encoded. Fix: pass precision='float32', or "
                "format='lance' or 'parquet'."
            )

    @abstractmethod
    def exists(self) -> bool:
        """True when an output of this format is at the location."""

    @abstractmethod
    def read(self) -> Any:
        """Every committed row, as a ``pyarrow.Table``."""

    @abstractmethod
    def table_version(self) -> Any:
        """What an index of the output records so that any later change makes it stale (None: the
        run's id and rows say it: a Parquet output)."""

    @abstractmethod
    def columns(self) -> list[str]:
        """The names of the output's columns."""

    @abstractmethod
    def read_rows(self, keys: Any, on: list[str], columns: list[str]) -> Any:
        """The ``on`` + ``columns`` of the rows whose ``on`` values ``keys`` (a pandas frame) names,
        read only from where they can be, as a pandas frame (an index's hits joined to their rows)."""

    # -- a run (dask_surge.execution: the same calls on every format) ----------------------------------

    @abstractmethod
    def stage(self, data: Any, store: Any, path: str, compression: str | None) -> Staged:
        """On a worker: a SuperBatch's rows (``data``, a ``pyarrow.Table``) written where no reader sees
        them until its commit record is created (``path``: the record's staging file in ``store``, an
        :class:`~dask_surge.io.store.OutputStore`; ``compression``: the vectors' Parquet codec)."""

    def check_target(self, store: Any, run_id: str, mode: str, detect: Callable[[Any], str | None]) -> None:
        """Before anything is written: refuse an output run ``run_id`` cannot write (``detect``: the
        registry's rule naming the table format a directory's entries hold,
        :func:`~dask_surge.io.tables.detect`; the caller's :func:`~dask_surge.io.directory.check_output`
        checked the location already)."""

    def bind(self, manifest: Any) -> None:
        """Set ``manifest`` (a run in this output, :class:`~dask_surge.io.manifest.Manifest`) to how this
        format makes committed rows readable (part files published under the root, or none)."""

    def settled(self, manifest: Any) -> bool:
        """True when the output holds every SuperBatch ``manifest`` records as committed, each once (a
        complete run then needs no work)."""
        return True

    @abstractmethod
    def committer(self, manifest: Any, *, mode: str, claim: Any) -> Any:
        """What makes the run's committed SuperBatches readable, started: ``submit(sb, file, at=None)`` as
        each commit is heard (``at``: when its record was created, from the unit's report), ``close()``
        at the run's end, ``abandon()`` on its error, ``first``: the wall clock when rows first became
        readable (None: not by this process)."""

    def record_embedding(
        self,
        identity: dict,
        source: str,
        name: str | None,
        *,
        vector: str = "embedding",
        run: str | None = None,
    ) -> int:
        """Record, where the format has a convention for it (LanceDB's embedding functions), that
        ``vector`` holds the embeddings of ``source`` made as ``identity`` says
        (:func:`~dask_surge.io.reuse.embedding_identity`) by the model sentence-transformers loads as
        ``name`` (None: none it loads by name), in a version of run ``run``'s own (None: of no run);
        returns the versions made (0: none)."""
        return 0


class TableOutput(Output):
    """A format whose rows are committed by the claim holder in batches (Lance, Delta, Iceberg, a
    database): workers :meth:`write` data nobody reads yet, the claim holder :meth:`fence` s and
    :meth:`commit` s them, conditional on the version its :meth:`history` was read at, so the store
    refuses a commit prepared before another process took the claim over
    (:class:`~.commits.TableCommitter`)."""

    def stage(self, data: Any, store: Any, path: str, compression: str | None) -> Staged:
        """The table's uncommitted data files (:meth:`write`); the commit record carries their payload."""
        payload = self.write(data)
        blob = payload.encode()
        return Staged(payload, len(blob), hashlib.sha256(blob).hexdigest())

    def check_target(self, store: Any, run_id: str, mode: str, detect: Callable[[Any], str | None]) -> None:
        """Refuse a table of another format, a directory holding anything else, or a table this run did
        not create without ``mode="append"`` (:func:`~.commits.check_table_output`)."""
        check_table_output(store, self, run_id, mode, detect)

    def bind(self, manifest: Any) -> None:
        """No part file is ever published: the claim holder commits the rows to the table."""
        manifest.table = True

    def settled(self, manifest: Any) -> bool:
        """True when the table's history holds every committed SuperBatch once
        (:func:`~.commits.table_settled`)."""
        return table_settled(self, manifest)

    def committer(self, manifest: Any, *, mode: str, claim: Any) -> Any:
        """A started :class:`~.commits.TableCommitter`: it commits what a killed process
        left first, then batches (``surge.table-commit-every``, ``surge.table-commit-seconds``)."""
        committer = TableCommitter(
            self,
            manifest,
            mode=mode,
            every=config.get("table-commit-every"),
            seconds=config.get("table-commit-seconds"),
            claim=claim,
        )
        committer.start()
        return committer

    @classmethod
    @abstractmethod
    def owns_payload(cls, payload: str) -> bool:
        """True when ``payload`` (a commit record's table data, :meth:`write`'s) is this format's: how
        a table output killed before its first commit is recognised (no table there yet)."""

    @abstractmethod
    def write(self, data: Any) -> str:
        """On a worker: ``data``'s rows as the format's uncommitted data; returns the payload (JSON)
        the SuperBatch's commit record carries."""

    @abstractmethod
    def fence(self, run_id: str, token: str, read_version: int, payload: str) -> int:
        """The claim holder ``token``'s first version (creating the table at ``read_version`` 0);
        :class:`CommitConflict` when the store refuses."""

    @abstractmethod
    def commit(self, run_id: str, token: str, batch: Sequence[tuple[str, str]], read_version: int) -> int:
        """One version holding ``batch``'s SuperBatches, only if no version of the run came after
        ``read_version``; :class:`CommitConflict` when the store refuses."""

    @abstractmethod
    def repair(self, run_id: str, token: str, superbatches: list[str], read_version: int) -> int:
        """Remove (or record the absence of) a second copy of ``superbatches``."""

    @abstractmethod
    def history(self, run_id: str, since: int = 0) -> History:
        """What the versions after ``since`` say of run ``run_id`` and of other writers."""

    @abstractmethod
    def keeps_rows(self, op: str) -> bool:
        """True when another writer's operation ``op`` leaves every committed row in place."""

    @abstractmethod
    def check_schema(self, payload: str) -> None:
        """Refuse ``payload``'s rows when their columns differ from the table's."""

    @abstractmethod
    def version_rows(self) -> list[tuple[int, float, int]]:
        """``(version, commit time, rows)`` of each version, oldest first."""

    @abstractmethod
    def data_files(self) -> list[tuple[str, int | None]]:
        """``(path, size)`` of every data file the latest version references."""

    def library_version(self, version: int) -> int:
        """``version`` (as :meth:`history` counts, 0 meaning no table) as the table's own library
        numbers it."""
        return version

    def describe_version(self, version: int) -> str:
        """``version`` in the words of the table's own library (for messages)."""
        return f"version {self.library_version(version)}"

    def validate(self) -> list[str]:
        """What the table's library finds wrong with the latest version, one line each (empty: all good,
        or the library has no check)."""
        return []


@dataclass(frozen=True)
class Staged:
    """A SuperBatch's rows as :meth:`Output.stage` wrote them, for its commit record."""

    #: what the record carries for the format's commit (:attr:`~dask_surge.io.manifest.CommitRecord.table`;
    #: ``""``: the record is the commit)
    payload: str
    #: bytes and SHA-256 of what was written (the record's ``bytes``, ``sha256``)
    size: int
    sha256: str
    #: the file an attempt that lost its commit removes (``""``: none; a table's data files are named by
    #: no version)
    path: str = ""


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


def schema_text(schema: Any) -> str:
    """An Arrow schema as the text a payload carries (its IPC bytes, base64).

    Examples
    --------
    >>> import pyarrow as pa
    >>> schema_of(schema_text(pa.schema([("row", pa.int64())]))).names
    ['row']
    """
    import base64

    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_of(text: str) -> Any:
    """The Arrow schema of :func:`schema_text`'s ``text``."""
    import base64

    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def write_data_file(location: Any, data: Any, rel: str) -> str:
    """Write ``data`` (a ``pyarrow.Table``) as one Parquet file at ``rel`` below the table ``location``
    (a :class:`~.locations.TableLocation`), its vectors as the lists a Delta or Iceberg schema declares
    (:func:`variable_lists`): one atomic write (one PUT on an object store), referenced by nothing until
    a commit names it. Returns the payload its commit record carries (JSON: ``path``, ``size``, ``rows``
    and the Arrow ``schema``)."""
    import io
    import json

    import pyarrow.parquet as pq

    data = variable_lists(data)
    buf = io.BytesIO()
    pq.write_table(data, buf, compression="zstd")
    blob = buf.getvalue()
    store = location.store()
    store.makedirs(f"{store.root}/{rel.rsplit('/', 1)[0]}")
    store.write(f"{store.root}/{rel}", blob)
    return json.dumps(
        {"path": rel, "size": len(blob), "rows": data.num_rows, "schema": schema_text(data.schema)},
        sort_keys=True,
    )


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
