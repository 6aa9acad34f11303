"""Apache Iceberg table output: workers write Parquet data files, the claim holder commits them.

A SuperBatch task writes its rows as one Parquet file under the table location's ``data/``
(named by no manifest of the table: no reader sees it) and its commit record carries the
file's path, size, rows and Arrow schema (:meth:`IcebergTable.write`). The process holding the
run's claim commits batches of them (:meth:`IcebergTable.commit`: one pyiceberg ``add_files``
per batch, a fast append: a new snapshot whose manifest lists the files, made current by the
catalog's compare-and-swap of the table's metadata pointer), with the run id, the SuperBatch
keys and the claim holder's token in the snapshot summary, so the table's own snapshots say which
SuperBatches it holds (:meth:`IcebergTable.history`).

**Fencing.** A commit is made only onto the snapshot its history was read at: the table is
loaded, its current version compared with that one, and the append carries pyiceberg's
``assert-ref-snapshot-id`` requirement, with pyiceberg's own retry (which would rebase the append
onto a newer snapshot) turned off for it, so the catalog refuses the swap when any snapshot
landed since. A claim holder's first commit is a *fence* (:meth:`IcebergTable.fence`: an append
of no file), so a commit a paused process prepared before its claim was taken over is refused by
the catalog.

**Which catalog, which table.** The output path is the table's location (its ``metadata/``,
``data/`` and dask-surge's ``_surge/``). The catalog is named as pyiceberg users name one, by
``encode(..., iceberg_catalog=...)`` (``--iceberg-catalog``), else ``surge.iceberg-catalog``: a
catalog's name (``"prod"``: ``pyiceberg.catalog.load_catalog("prod")``, configured in
``.pyiceberg.yaml`` or ``PYICEBERG_CATALOG__PROD__*``), a dict of its properties (``name``,
``"default"`` unless given; the rest merged by pyiceberg with its own configuration of that name),
a ``pyiceberg.catalog.Catalog`` object (the argument only: it is used in the calling process, never
put in dask.config, which is shipped to workers, nor pickled with the table, since workers write
data files only: :meth:`IcebergTable.__reduce__`), or None (pyiceberg's configured default
catalog). The table identifier is ``iceberg_table`` / ``surge.iceberg-table``
(``"namespace.name"``), or when that is None ``default.<name>``, ``<name>`` being the output
path's last component without its extension (``.../emb.iceberg`` -> ``default.emb``).

Versions are the snapshots' sequence numbers (a format-v1 table: their 1-based position), so 0
means "no snapshot". Creating the table makes no snapshot in Iceberg: the run that creates it
names itself in the table's properties (:data:`~.base.RUN_PROPERTY`), which is how a later run
knows the table is not its own. Iceberg has no fixed-size list: ``embedding`` is a
``list<float>`` of constant length in the table's schema, ``text_hash`` a ``fixed[16]``.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from ...config import check_argument, get, given
from ...errors import SurgeOutputError, SurgeValueError
from .base import (
    FENCE_PROPERTY,
    REPAIRED_PROPERTY,
    RUN_PROPERTY,
    SUPERBATCHES_PROPERTY,
    CommitConflict,
    History,
    TableOutput,
    require,
    schema_of,
    write_data_file,
)
from .locations import TableLocation

__all__ = ["IcebergTable", "DATA_DIR", "KEEPS_ROWS", "table_identifier"]

#: where the workers' data files go, under the table's location (Iceberg's own convention)
DATA_DIR = "data"
#: snapshot operations of another writer that leave every committed row in place
#: (``replace``: compaction, the same rows in other files)
KEEPS_ROWS = frozenset({"append", "replace"})
#: object_store keys (:attr:`TableLocation.options`) -> pyiceberg FileIO properties
_FILEIO_KEYS = {
    "aws_access_key_id": "s3.access-key-id",
    "aws_secret_access_key": "s3.secret-access-key",
    "aws_session_token": "s3.session-token",
    "aws_endpoint": "s3.endpoint",
    "aws_region": "s3.region",
}


def _plain(uri: str) -> str:
    """``uri`` without ``file://`` and a trailing ``/`` (to compare table locations)."""
    return (uri[len("file://") :] if uri.startswith("file://") else uri).rstrip("/")


def table_identifier(url: str, configured: str | None) -> str:
    """The Iceberg identifier of the table at ``url``: ``configured``, else ``default.<last component>``.

    Examples
    --------
    >>> table_identifier("/data/emb.iceberg", None)
    'default.emb'
    >>> table_identifier("s3://bucket/tables/my-embeddings/", None)
    'default.my_embeddings'
    >>> table_identifier("/data/emb.iceberg", "search.docs")
    'search.docs'
    """
    if configured:
        if "." not in configured.strip("."):
            raise SurgeValueError(
                f"surge.iceberg-table={configured!r} is not an Iceberg identifier: it needs a namespace. "
                "Fix: dask.config.set({'surge.iceberg-table': 'namespace.table'}), or None to derive "
                "'default.<name>' from the output path."
            )
        return configured
    last = url.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    name = re.sub(r"\W", "_", last)
    if not name:
        raise SurgeValueError(
            f"output={url!r} has no last path component to name its Iceberg table after. Fix: "
            "dask.config.set({'surge.iceberg-table': 'namespace.table'}), or a path such as 'tables/emb.iceberg'."
        )
    return f"default.{name}"


def _versions(metadata: Any) -> list[tuple[int, Any]]:
    """``(version, snapshot)`` of the table's snapshots, oldest first (see the module's docstring)."""
    snaps = sorted(metadata.snapshots, key=lambda s: (s.sequence_number or 0, s.timestamp_ms))
    if int(metadata.format_version) >= 2:
        return [(int(s.sequence_number), s) for s in snaps]
    return [(i + 1, s) for i, s in enumerate(snaps)]


def _shown(spec: Any) -> str:
    """How a message names the catalog ``spec``."""
    if spec is None or isinstance(spec, str | dict):
        return f"iceberg_catalog={spec!r}"
    return f"iceberg_catalog={type(spec).__name__}({getattr(spec, 'name', '?')!r})"


def load_catalog(spec: Any, defaults: Mapping[str, str] | None = None) -> Any:
    """The pyiceberg catalog ``spec`` names: a name, a dict of properties (``name`` and the rest), a
    ``Catalog`` (itself) or None (pyiceberg's default); ``defaults``: properties the spec's own win over.

    A catalog that cannot be opened is one :class:`~dask_surge.errors.SurgeValueError` line naming it and
    the fix (pyiceberg's reason, first line, inside).
    """
    if spec is not None and not isinstance(spec, str | dict):
        return spec  # a Catalog object: the caller's, as it is
    require("pyiceberg")
    from pyiceberg.catalog import load_catalog as load

    given = dict(spec) if isinstance(spec, dict) else {}
    name = spec if isinstance(spec, str) else given.pop("name", None)
    try:
        from pyiceberg import catalog as module

        if name is None:  # pyiceberg's default-catalog, else "default", as its load_catalog(None)
            name = module._ENV_CONFIG.get_default_catalog_name()
        configured = module._ENV_CONFIG.get_catalog_config(str(name)) or {}  # .pyiceberg.yaml, PYICEBERG_*
        props = {k: v for k, v in (defaults or {}).items() if k not in configured}  # the catalog's own win
        props.update({k: str(v) for k, v in given.items() if v is not None})
        return load(str(name), **props)
    except Exception as err:  # any reason the catalog does not open is one line
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        env = "PYICEBERG_CATALOG__" + re.sub(r"\W", "_", str(name)).upper() + "__URI"
        configure = f"configure catalog {name!r} in ~/.pyiceberg.yaml (or $PYICEBERG_HOME's) or {env}"
        if spec is None:
            what = f"pyiceberg's default catalog {name!r} (neither iceberg_catalog= nor surge.iceberg-catalog names one)"
            fix = f"name the table's catalog, iceberg_catalog='NAME' (from .pyiceberg.yaml), or {configure}"
        elif isinstance(spec, dict):
            what = f"the Iceberg catalog {name!r} of iceberg_catalog={{...}} (or surge.iceberg-catalog)"
            fix = "correct its properties (e.g. {'type': 'sql', 'uri': 'sqlite:///catalog.db'}), or pass its name"
        else:
            what = f"{_shown(spec)} (or surge.iceberg-catalog)"
            fix = f"{configure}, or pass the name of a configured catalog or its properties"
        raise SurgeValueError(
            f"{what} could not be opened as an Iceberg catalog: {why}. Fix: {fix}; from Python a pyiceberg "
            "Catalog object also does."
        ) from err


@contextlib.contextmanager
def named_catalog(options: Mapping[str, Any]) -> Iterator[None]:
    """While an ``encode`` call with keyword ``options`` runs, the Iceberg catalog and identifier it was
    given are the ones its table is opened with, in this thread only (:func:`dask_surge.config.given`):
    a Catalog object is never put in dask.config. With ``format="iceberg"`` the catalog is opened first,
    so a catalog that cannot be used is one line before any worker starts; given beside another format,
    an error."""
    import dask

    catalog, identifier = options.get("iceberg_catalog"), options.get("iceberg_table")
    configured = get("iceberg-catalog")  # always: a Catalog object there would break any cluster's start
    catalog = check_argument("iceberg_catalog", catalog)
    identifier = check_argument("iceberg_table", identifier)
    fmt = options.get("format") or dask.config.get("surge.format", None)
    if fmt != "iceberg":
        named = [_shown(catalog)] if catalog is not None else []
        named += [f"iceberg_table={identifier!r}"] if identifier is not None else []
        if named:
            raise SurgeValueError(
                f"{' and '.join(named)} {'names' if len(named) == 1 else 'name'} an Iceberg output's table, "
                f"and format={fmt!r} writes none. Fix: pass format='iceberg', or leave "
                f"{'it' if len(named) == 1 else 'them'} out."
            )
        yield
        return
    load_catalog(configured if catalog is None else catalog)  # fails here, in one line
    with given({"iceberg-catalog": catalog, "iceberg-table": identifier}):
        yield


class IcebergTable(TableOutput):
    """One Iceberg table as a dask-surge output (picklable: workers write through it).

    Parameters
    ----------
    location : TableLocation
        Where the table is (its manifest is ``<output>/_surge/``).
    catalog : dict, optional
        ``surge.iceberg-catalog``: the catalog's ``name`` and properties (see the module's docstring).
    identifier : str, optional
        ``surge.iceberg-table``; None derives it from the location (:func:`table_identifier`).
    """

    name = "iceberg"
    LIBRARY = "pyiceberg"
    catalogued = True
    precisions = frozenset({"float32", "int8", "binary"})  # Iceberg has no float16
    #: the entry of a directory that says a table of this format is there
    MARKER = "metadata"
    #: what the format's own directory holds (a new output may hold these and ``_surge/`` only)
    ENTRIES = frozenset({"metadata", DATA_DIR})

    @classmethod
    def owns_payload(cls, payload: str) -> bool:
        """True when ``payload`` (a commit record's table data) is this format's."""
        return str(json.loads(payload).get("path", "")).startswith(f"{DATA_DIR}/surge-")

    def __init__(self, location: TableLocation, catalog: Any = None, identifier: str | None = None) -> None:
        self.location = location
        #: the catalog as named: a name, a dict of properties, a pyiceberg Catalog, or None (the default)
        self.catalog_spec = catalog
        self.identifier = table_identifier(location.url, identifier)
        # loaded once, in the process that commits (a Catalog object given is that catalog)
        self._catalog: Any = None if catalog is None or isinstance(catalog, str | dict) else catalog

    @classmethod
    def at(cls, store: Any) -> IcebergTable:
        """The table at ``store``'s location, in the catalog ``surge.iceberg-catalog`` names, under the
        identifier ``surge.iceberg-table`` (None: derived from the path)."""
        return cls(TableLocation.of(store), get("iceberg-catalog"), get("iceberg-table"))

    def __repr__(self) -> str:
        return f"IcebergTable({self.location.url!r}, {self.identifier!r})"

    def __dask_tokenize__(self) -> tuple:
        return ("IcebergTable", self.location.url, self.identifier)

    def __reduce__(self):  # a worker writes data files only: the catalog (a Catalog object too) stays here
        return (IcebergTable, (self.location, None, self.identifier))

    def keeps_rows(self, op: str) -> bool:
        """True when another writer's snapshot operation ``op`` leaves every committed row in place."""
        return op in KEEPS_ROWS

    # -- the catalog -------------------------------------------------------------------------------

    def catalog(self) -> Any:
        """The catalog (:func:`load_catalog` of :attr:`catalog_spec`), loaded once."""
        if self._catalog is None:
            self._catalog = self._load_catalog()
        return self._catalog

    def _load_catalog(self) -> Any:
        props: dict[str, str] = {}
        for key, value in self.location.options.items():  # the data files' store, unless the catalog says
            if key in _FILEIO_KEYS:
                props[_FILEIO_KEYS[key]] = value
        if self.location.options:  # an object store: fsspec (s3fs), as for dask-surge's own files
            props["py-io-impl"] = "pyiceberg.io.fsspec.FsspecFileIO"
        return load_catalog(self.catalog_spec, props)

    def _open(self, catalog: Any = None) -> Any:
        """The table, or None when the catalog does not name it; refuses one that lives elsewhere."""
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        catalog = catalog if catalog is not None else self.catalog()
        try:
            table = catalog.load_table(self.identifier)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None
        if _plain(table.location()) != _plain(self.location.uri):
            raise SurgeOutputError(
                f"the Iceberg catalog's table {self.identifier!r} lives at {table.location()!r}, not at "
                f"output={self.location.url!r}. Nothing was written. Fix: "
                "dask.config.set({'surge.iceberg-table': 'namespace.other_name'}) for a new table at this path, "
                "or pass that table's location as output."
            )
        return table

    def exists(self) -> bool:
        """True when the catalog names the table (at this location).

        Refuses a location that holds an Iceberg table's ``metadata/`` the catalog does not name:
        that table belongs to another catalog or identifier.
        """
        if self._open() is not None:
            return True
        store = self.location.store()
        if store.exists(f"{store.root}/metadata"):
            raise SurgeOutputError(
                f"output={self.location.url!r} holds an Iceberg table's metadata/, but the catalog has no table "
                f"{self.identifier!r} there. Nothing was written. Fix: set surge.iceberg-table (and "
                "surge.iceberg-catalog) to that table's name, register it (catalog.register_table), or write "
                "to a new path."
            )
        return False

    # -- the worker's side -----------------------------------------------------------------------

    def write(self, data: pa.Table) -> str:
        """Write ``data`` as one Parquet file under ``data/``, not committed; returns the payload
        (JSON: its path relative to the table, size, rows and the Arrow schema)."""
        require("pyiceberg")
        return write_data_file(self.location, data, f"{DATA_DIR}/surge-{uuid.uuid4().hex}.parquet")

    # -- the claim holder's side -------------------------------------------------------------------

    def history(self, run_id: str, since: int = 0) -> History:
        """What the table's snapshots after ``since`` say (see :class:`~.base.History`); with
        ``since=0`` the table's creation counts as its first version (ours when its properties name
        ``run_id``)."""
        table = self._open()
        if table is None:
            return History(exists=False)
        versions = _versions(table.metadata)
        out = History(exists=True, version=versions[-1][0] if versions else 0)
        if since == 0:
            creator = str(table.properties.get(RUN_PROPERTY) or "")
            if creator == run_id:
                out.first_ours = True
            else:
                out.note_foreign()
                out.foreign.append((0, "create", creator))
        for version, snap in versions:
            if version <= since:
                continue
            summary = snap.summary
            props = dict(summary.additional_properties) if summary is not None else {}
            op = str(summary.operation.value) if summary is not None else "unknown"
            if props.get(RUN_PROPERTY) == run_id:
                sbs = json.loads(props.get(SUPERBATCHES_PROPERTY) or "[]")
                repaired = json.loads(props.get(REPAIRED_PROPERTY) or "[]")
                out.add_ours(version, sbs, op, str(props.get(FENCE_PROPERTY) or ""), repaired=repaired)
            else:
                out.note_foreign()
                out.foreign.append((version, op, str(props.get(RUN_PROPERTY) or "")))
        return out

    def describe_version(self, version: int) -> str:
        """An Iceberg version is a snapshot's sequence number."""
        return f"the snapshot of sequence number {version}"

    def check_schema(self, payload: str) -> None:
        """Refuse ``payload``'s rows when their column names differ from the table's."""
        table = self._open()
        if table is None:
            return
        mine = [f.name for f in schema_of(json.loads(payload)["schema"])]
        theirs = [f.name for f in table.schema().fields]
        if mine != theirs:
            raise SurgeOutputError(
                f"the Iceberg table {self.identifier!r} at {self.location.url!r} has columns {theirs}, but this "
                f"run writes {mine}. Nothing was committed to it. Fix: append only runs with the same columns "
                "(keep=, model, precision), or write to a new table."
            )

    def _create(self, catalog: Any, run_id: str, schema: pa.Schema) -> Any:
        from pyiceberg.exceptions import TableAlreadyExistsError

        namespace = self.identifier.rsplit(".", 1)[0]
        catalog.create_namespace_if_not_exists(namespace)
        try:
            return catalog.create_table(
                self.identifier, schema, location=self.location.uri, properties={RUN_PROPERTY: run_id}
            )
        except TableAlreadyExistsError as err:
            table = self._open(catalog)
            if table is not None and str(table.properties.get(RUN_PROPERTY) or "") == run_id:
                raise CommitConflict(f"another process of run {run_id} created {self.identifier!r}") from err
            raise SurgeOutputError(  # someone else created it meanwhile: not ours to write
                f"the Iceberg table {self.identifier!r} was created by another writer while this run started. "
                "Nothing was committed to it. Fix: write to a new path, or rerun with mode='append'."
            ) from err
        except (ValueError, TypeError) as err:  # a type Iceberg has no counterpart for
            raise SurgeOutputError(
                f"this run's columns {[(f.name, str(f.type)) for f in schema]} cannot be an Iceberg table's "
                f"schema ({err}). Nothing was committed. Fix: pass precision='float32', or format='parquet'."
            ) from err

    def _append(self, table: Any, read_version: int, paths: list[str], props: dict) -> int:
        """A fast append of ``paths`` onto ``table`` as loaded, only if its current version is
        ``read_version`` and no snapshot lands before the catalog's swap (see the module's docstring)."""
        from pyiceberg.exceptions import CommitFailedException

        versions = _versions(table.metadata)
        current = versions[-1][0] if versions else 0
        if current != read_version:
            raise CommitConflict(f"the Iceberg table is at version {current}, not {read_version}")
        # pyiceberg retries a failed swap on the newest snapshot unless the table says not to: this commit's
        # own view of the properties says so (nothing of it is written to the table)
        table.metadata = table.metadata.model_copy(
            update={"properties": {**table.metadata.properties, "commit.retry.num-retries": "0"}}
        )
        try:
            with table.transaction() as tx:
                if paths:
                    tx.add_files(paths, snapshot_properties=props)
                else:
                    with tx.update_snapshot(snapshot_properties=props).fast_append():
                        pass
        except CommitFailedException as err:
            raise CommitConflict(
                f"the Iceberg catalog refused the commit read at version {read_version}"
            ) from err
        return _versions(table.metadata)[-1][0]

    def fence(self, run_id: str, token: str, read_version: int, payload: str) -> int:
        """Make the version that begins the commits of the claim holder ``token``: an append of no file
        onto the snapshot at ``read_version``, creating the table first when the catalog does not name
        it. Returns the new version; raises :class:`~.base.CommitConflict` when the catalog refuses."""
        catalog = self.catalog()
        table = self._open(catalog)
        if table is None:
            table = self._create(catalog, run_id, schema_of(json.loads(payload)["schema"]))
        props = {RUN_PROPERTY: run_id, SUPERBATCHES_PROPERTY: "[]", FENCE_PROPERTY: token}
        return self._append(table, read_version, [], props)

    def repair(self, run_id: str, token: str, superbatches: list[str], read_version: int) -> int:
        """Record that ``superbatches``, which the history names twice, are in the table once when the
        later snapshots that name them added no data file (pyiceberg refuses to add a file the table
        already references): an append of no file whose :data:`~.base.REPAIRED_PROPERTY` names them,
        onto ``read_version``; refuses (changing nothing) when one added files."""
        table = self._open()
        if table is None:
            raise CommitConflict(f"the Iceberg table {self.identifier!r} is gone")
        h = self.history(run_id)
        later = {v for sb in superbatches for v in h.held.get(sb, [])[1:]}
        for version, snap in _versions(table.metadata):
            added = dict(snap.summary.additional_properties).get("added-data-files") if snap.summary else None
            if version in later and int(added or 0) > 0:
                raise SurgeOutputError(
                    f"snapshot {snap.snapshot_id} of the Iceberg table {self.identifier!r} added {added} data "
                    f"file(s) holding SuperBatch(es) {sorted(superbatches)[:5]} a second time: their rows are in "
                    "the table twice. Nothing was changed. Fix: encode to a new path."
                )
        props = {
            RUN_PROPERTY: run_id,
            SUPERBATCHES_PROPERTY: "[]",
            FENCE_PROPERTY: token,
            REPAIRED_PROPERTY: json.dumps(sorted(superbatches)),
        }
        return self._append(table, read_version, [], props)

    def commit(self, run_id: str, token: str, batch: Sequence[tuple[str, str]], read_version: int) -> int:
        """Commit the files of ``batch`` (``(sb, payload)`` pairs) as one fast append whose snapshot summary
        names ``run_id``, the SuperBatches and the claim holder ``token``, onto the snapshot at
        ``read_version`` (the table exists: :meth:`fence` made it). Returns the new version (the
        snapshot's sequence number); raises :class:`~.base.CommitConflict` when the catalog refuses.
        """
        table = self._open()
        if table is None:
            raise CommitConflict(f"the Iceberg table {self.identifier!r} is gone")
        root = self.location.uri.rstrip("/")
        paths = [f"{root}/{json.loads(p)['path']}" for _, p in batch]
        props = {
            RUN_PROPERTY: run_id,
            SUPERBATCHES_PROPERTY: json.dumps(sorted(sb for sb, _ in batch)),
            FENCE_PROPERTY: token,
        }
        return self._append(table, read_version, paths, props)

    def version_rows(self) -> list[tuple[int, float, int]]:
        """``(version, commit time in epoch seconds, rows)`` of each snapshot, oldest first (empty: no
        table or no snapshot); rows from the snapshot summary's ``total-records``."""
        table = self._open()
        if table is None:
            return []
        out = []
        for version, snap in _versions(table.metadata):
            summary = dict(snap.summary.additional_properties) if snap.summary is not None else {}
            total = summary.get("total-records")
            rows = (
                int(total) if total is not None else len(table.scan(snapshot_id=snap.snapshot_id).to_arrow())
            )
            out.append((version, snap.timestamp_ms / 1000, rows))
        return out

    def table_version(self) -> int | None:
        """The table's own version now, as its library names it (None: no table): what an index of the
        table records, so that any later commit (an append or delete by anyone) makes the index stale."""
        table = self._open()
        snap = None if table is None else table.current_snapshot()
        return None if snap is None else int(snap.snapshot_id)

    def data_files(self) -> list[tuple[str, int | None]]:
        """``(URI, size in bytes)`` of every data file the current snapshot references."""
        table = self._open()
        if table is None or table.current_snapshot() is None:
            return []
        return [(t.file.file_path, int(t.file.file_size_in_bytes)) for t in table.scan().plan_files()]

    def _loaded(self) -> Any:
        table = self._open()
        if table is None:
            raise SurgeOutputError(
                f"no Iceberg table {self.identifier!r} at {self.location.url!r}. Fix: pass the output of a run."
            )
        return table

    def columns(self) -> list[str]:
        """The table's columns."""
        return [f.name for f in self._loaded().schema().fields]

    def read_rows(self, keys: Any, on: list[str], columns: list[str]) -> Any:
        """The rows ``keys`` names, through a scan filtered on ``partition`` and ``row``."""
        from pyiceberg import expressions

        parts = sorted(int(p) for p in keys.partition.unique())
        rows = sorted(int(r) for r in keys.row.unique())
        among: Any = expressions.In  # typed by pydantic's fields, called by its own signature
        scan = self._loaded().scan(
            row_filter=expressions.And(among("partition", parts), among("row", rows)),
            selected_fields=(*on, *columns),
        )
        return keys.merge(scan.to_arrow().to_pandas(), on=on, how="inner")

    def read(self) -> pa.Table:
        """Every committed row (the current snapshot)."""
        table = self._open()
        if table is None:
            raise SurgeOutputError(
                f"no Iceberg table {self.identifier!r} at {self.location.url!r}. Fix: pass the output of a run."
            )
        return table.scan().to_arrow()
