"""Delta Lake table output: workers write Parquet data files, the claim holder commits them.

A SuperBatch task writes its rows as one Parquet file under the table's ``surge-data/``
(not referenced by the Delta log: no reader sees it) and its commit record carries the
file's add-action facts (:meth:`DeltaOutput.write`). The process holding the run's claim
commits batches of them (:meth:`DeltaOutput.commit`: one ``create_write_transaction`` of
``AddAction`` s in append mode per batch, a new ``_delta_log/N.json``, written only if absent),
with the run id, the SuperBatch keys and the claim holder's token in the commit's ``commitInfo``
(custom metadata) and an application-transaction action (``txn``: app id ``dask-surge-<run>``), so
the table's own history says which SuperBatches it holds (:meth:`DeltaOutput.history`).

**Fencing.** Every commit of the run carries that ``txn``, and is made from the table as of the
version its history was read at (never the latest): delta-rs's conflict checker refuses a commit
when a commit that won since carries a ``txn`` of the same app id, while other writers' appends
(no such ``txn``) are rebased over. A claim holder's first commit is a *fence*
(:meth:`DeltaOutput.fence`: the table's creation, which fails when one exists, or an empty commit
with the ``txn``), so a commit a paused process prepared before its claim was taken over is refused
by the table itself.

Delta has no fixed-size list type: ``embedding`` is an ``array<float>`` of constant length in
the Delta schema (the Parquet files keep the fixed-size list), and ``text_hash`` is ``binary``.
Table versions are reported shifted by one (Delta's version 0 is this module's 1), so 0 means
"no table" as for Lance.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ...errors import SurgeOutputError
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

__all__ = ["DeltaOutput", "DATA_DIR"]

#: where the workers' data files go, under the table's root (not the Parquet layout's part-* names)
DATA_DIR = "surge-data"
#: operations of another writer that leave every committed row in place
_KEEPS_ROWS = frozenset(
    {
        "WRITE (Append)",
        "OPTIMIZE",
        "VACUUM START",
        "VACUUM END",
        "SET TBLPROPERTIES",
        "ADD CONSTRAINT",
        "CREATE CHECKPOINT",
    }
)


class DeltaOutput(TableOutput):
    """One Delta table as a dask-surge output (picklable: workers write through it).

    Parameters
    ----------
    location : TableLocation
        Where the table is (its manifest is ``<output>/_surge/``).
    """

    name = "delta"
    LIBRARY = "deltalake"
    merges_columns = True
    precisions = frozenset({"float32", "int8", "binary"})  # Delta has no float16
    #: the entry of a directory that says a table of this format is there
    MARKER = "_delta_log"
    #: what the format's own directory holds (a new output may hold these and ``_surge/`` only)
    ENTRIES = frozenset({"_delta_log", DATA_DIR})

    @classmethod
    def owns_payload(cls, payload: str) -> bool:
        """True when ``payload`` (a commit record's table data) is this format's."""
        return str(json.loads(payload).get("path", "")).startswith(f"{DATA_DIR}/")

    def __init__(self, location: TableLocation) -> None:
        self.location = location

    def __repr__(self) -> str:
        return f"DeltaOutput({self.location.url!r})"

    def __dask_tokenize__(self) -> tuple:
        return ("DeltaOutput", self.location.url)

    def keeps_rows(self, op: str) -> bool:
        """True when another writer's operation ``op`` leaves every committed row in place."""
        return op in _KEEPS_ROWS

    def _open(self) -> Any:
        deltalake = require("deltalake")
        if not deltalake.DeltaTable.is_deltatable(self.location.uri, storage_options=self.location.options):
            return None
        return deltalake.DeltaTable(self.location.uri, storage_options=self.location.options)

    def exists(self) -> bool:
        """True when a Delta table is at the location."""
        return self._open() is not None

    # -- the worker's side -----------------------------------------------------------------------

    def write(self, data: pa.Table) -> str:
        """Write ``data`` as one Parquet file under ``surge-data/``, not committed; returns the payload
        (JSON: its path relative to the table, size, rows and the Arrow schema)."""
        require("deltalake")
        return write_data_file(self.location, data, f"{DATA_DIR}/{uuid.uuid4().hex}.parquet")

    # -- the claim holder's side -------------------------------------------------------------------

    def history(self, run_id: str, since: int = 0) -> History:
        """What the table's versions after ``since`` say (see :class:`~.base.History`)."""
        dt = self._open()
        if dt is None:
            return History(exists=False)
        out = History(exists=True, version=dt.version() + 1)
        for entry in sorted(dt.history(), key=lambda e: e["version"]):
            version = int(entry["version"]) + 1
            if version <= since:
                continue
            mode = (entry.get("operationParameters") or {}).get("mode")
            op = (
                f"{entry.get('operation')} ({mode})"
                if entry.get("operation") == "WRITE" and mode
                else str(entry.get("operation"))
            )
            if entry.get(RUN_PROPERTY) == run_id:
                sbs = json.loads(entry.get(SUPERBATCHES_PROPERTY) or "[]")
                repaired = json.loads(entry.get(REPAIRED_PROPERTY) or "[]")
                out.add_ours(version, sbs, op, str(entry.get(FENCE_PROPERTY) or ""), repaired=repaired)
            else:
                out.note_foreign()
                out.foreign.append((version, op, str(entry.get(RUN_PROPERTY) or "")))
        return out

    def version_rows(self) -> list[tuple[int, float, int]]:
        """``(version, commit time in epoch seconds, rows)`` of each version of the table, oldest first
        (empty: no table); rows from the add actions' ``numRecords``."""
        dt = self._open()
        if dt is None:
            return []
        out = []
        for entry in sorted(dt.history(), key=lambda e: e["version"]):
            version = int(entry["version"])
            at = deltalake_version(self.location, version)
            out.append((version + 1, int(entry.get("timestamp") or 0) / 1000, _records(at)))
        return out

    def table_version(self) -> int | None:
        """The table's own version now, as its library names it (None: no table): what an index of the
        table records, so that any later commit (an append or delete by anyone) makes the index stale."""
        dt = self._open()
        return None if dt is None else int(dt.version())

    def data_files(self) -> list[tuple[str, int | None]]:
        """``(path relative to the table or a URI, size in bytes)`` of every data file the latest version
        references."""
        dt = self._open()
        if dt is None:
            return []
        adds = _actions(dt)
        return [(str(p), int(n)) for p, n in zip(adds["path"], adds["size_bytes"], strict=True)]

    def library_version(self, version: int) -> int:
        """Delta numbers its versions from 0 (this module from 1, 0 meaning no table)."""
        return version - 1

    def check_schema(self, payload: str) -> None:
        """Refuse ``payload``'s rows when their column names differ from the table's."""
        dt = self._open()
        if dt is None:
            return
        mine = [f.name for f in schema_of(json.loads(payload)["schema"])]
        table = [f.name for f in dt.schema().fields]
        if mine != table:
            raise SurgeOutputError(
                f"the Delta table {self.location.url!r} has columns {table}, but this run writes {mine}. Nothing "
                "was committed to it. Fix: append only runs with the same columns, or write to a new table."
            )

    def _transact(
        self,
        run_id: str,
        token: str,
        sbs: list[str],
        adds: list,
        schema: pa.Schema | None,
        read_version: int,
        extra: dict | None = None,
    ) -> int:
        """One commit of ``adds`` onto the table as of ``read_version`` (this module's numbering), with
        the run's ``txn`` (see the module's docstring); :class:`~.base.CommitConflict` when refused."""
        deltalake = require("deltalake")
        from deltalake.exceptions import CommitFailedError
        from deltalake.transaction import CommitProperties, Transaction

        dt = deltalake.DeltaTable(
            self.location.uri, version=read_version - 1, storage_options=self.location.options
        )
        props = CommitProperties(
            custom_metadata={
                RUN_PROPERTY: run_id,
                SUPERBATCHES_PROPERTY: json.dumps(sorted(sbs)),
                FENCE_PROPERTY: token,
                **(extra or {}),
            },
            app_transactions=[Transaction(f"dask-surge-{run_id}", read_version)],
        )
        try:
            dt.create_write_transaction(
                adds, mode="append", schema=dt.schema() if schema is None else schema, commit_properties=props
            )
        except CommitFailedError as err:
            raise CommitConflict(
                f"Delta refused the commit read at version {read_version - 1}: {err}"
            ) from err
        latest = deltalake.DeltaTable(self.location.uri, storage_options=self.location.options)
        for entry in latest.history(16):  # newest first: ours, unless other writers committed since
            if entry.get(FENCE_PROPERTY) == token and entry.get(SUPERBATCHES_PROPERTY) == json.dumps(
                sorted(sbs)
            ):
                return int(entry["version"]) + 1
        return int(latest.version()) + 1

    def fence(self, run_id: str, token: str, read_version: int, payload: str) -> int:
        """Make the version that begins the commits of the claim holder ``token``: create the table
        (``read_version`` 0; refused when a table exists), else an empty commit carrying the run's
        ``txn`` at ``read_version``. Returns the new version; raises :class:`~.base.CommitConflict`
        when the table refuses."""
        deltalake = require("deltalake")
        from deltalake.exceptions import DeltaError
        from deltalake.transaction import CommitProperties

        if read_version > 0:
            return self._transact(run_id, token, [], [], None, read_version)
        try:
            deltalake.DeltaTable.create(
                self.location.uri,
                schema_of(json.loads(payload)["schema"]),
                mode="error",  # exclusive: the log's first entry is written only if absent
                storage_options=self.location.options,
                commit_properties=CommitProperties(
                    custom_metadata={RUN_PROPERTY: run_id, SUPERBATCHES_PROPERTY: "[]", FENCE_PROPERTY: token}
                ),
            )
        except DeltaError as err:
            if "already exists" not in str(err):
                raise
            raise CommitConflict(f"a Delta table was created at {self.location.url!r} meanwhile") from err
        return 1

    def repair(self, run_id: str, token: str, superbatches: list[str], read_version: int) -> int:
        """Record that ``superbatches``, which the history names twice, are in the table once: a Delta
        snapshot holds each file path once (the log's replay keeps one add per path), so a stale second
        commit of the same files added no row. One empty commit whose :data:`~.base.REPAIRED_PROPERTY`
        names them, read at ``read_version``. Returns its version; refuses (changing nothing) when a
        second commit added other files (its rows are in the table twice)."""
        h = self.history(run_id)
        for version in sorted({v for sb in superbatches for v in h.held.get(sb, [])[1:]}):
            before = set(_actions(deltalake_version(self.location, version - 2))["path"])
            added = set(_actions(deltalake_version(self.location, version - 1))["path"]) - before
            if added:
                raise SurgeOutputError(
                    f"version {version - 1} of the Delta table {self.location.url!r} added file(s) "
                    f"{sorted(added)[:3]} holding SuperBatch(es) {sorted(superbatches)[:5]} a second time: its "
                    "rows are in the table twice, and Delta cannot drop those files without rewriting them. "
                    "Nothing was changed. Fix: encode to a new path (or delete those rows with deltalake and "
                    "write to a new path: a run stops on a table whose rows others deleted)."
                )
        extra = {REPAIRED_PROPERTY: json.dumps(sorted(superbatches))}
        return self._transact(run_id, token, [], [], None, read_version, extra)

    def commit(self, run_id: str, token: str, batch: Sequence[tuple[str, str]], read_version: int) -> int:
        """Commit the files of ``batch`` (``(sb, payload)`` pairs) as one append whose commit info names
        ``run_id``, the SuperBatches and the claim holder ``token``, onto the table as of
        ``read_version`` (it exists: :meth:`fence` made it). Returns the new version; raises
        :class:`~.base.CommitConflict` when the table refuses (a commit of the run since)."""
        from deltalake.transaction import AddAction

        payloads = [json.loads(p) for _, p in batch]
        schema = schema_of(payloads[0]["schema"])
        now = int(time.time() * 1000)
        adds = [
            AddAction(p["path"], int(p["size"]), {}, now, True, json.dumps({"numRecords": int(p["rows"])}))
            for p in payloads
        ]
        return self._transact(run_id, token, [sb for sb, _ in batch], adds, schema, read_version)

    def dataset(self) -> Any:
        """The latest version as a ``pyarrow.dataset.Dataset``."""
        dt = self._open()
        if dt is None:
            raise SurgeOutputError(f"no Delta table at {self.location.url!r}. Fix: pass the output of a run.")
        return dt.to_pyarrow_dataset()

    def columns(self) -> list[str]:
        """The table's columns."""
        return list(self.dataset().schema.names)

    def read_rows(self, keys: Any, on: list[str], columns: list[str]) -> Any:
        """The rows ``keys`` names, through a filter on ``partition`` and ``row``."""
        import pyarrow.compute as pc

        parts = sorted(int(p) for p in keys.partition.unique())
        rows = sorted(int(r) for r in keys.row.unique())
        wanted = pc.field("partition").isin(parts) & pc.field("row").isin(rows)
        found = self.dataset().to_table(columns=[*on, *columns], filter=wanted).to_pandas()
        return keys.merge(found, on=on, how="inner")

    # -- a column merged into the table (dask_surge.backfill) -------------------------------------

    def vector_shape(self, column: str, kind: pa.DataType) -> tuple[pa.DataType | None, int | None]:
        """``(value type, dimension)`` of the vectors ``column`` (of type ``kind``) holds: Delta has no
        fixed-size list, so the dimension is the first vector's length (None: no vector yet)."""
        import pyarrow.compute as pc

        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
            return None, None
        first = self.dataset().head(1, columns=[column], filter=pc.field(column).is_valid())
        return kind.value_type, (len(first.column(0)[0]) if first.num_rows else None)

    def holds(self, kind: pa.DataType) -> bool:
        """True: Delta stores vectors of ``kind`` as they are (it has no float16 and no unsigned type)."""
        return not (pa.types.is_float16(kind) or pa.types.is_unsigned_integer(kind))

    def recorded(self, name: str) -> str | None:
        """The table property ``name`` (None: not set)."""
        dt = self._open()
        return None if dt is None else dt.metadata().configuration.get(name)

    def record(self, name: str, value: str) -> int:
        """Set the table property ``name`` (one commit, ``SET TBLPROPERTIES``)."""
        self._open().alter.set_table_properties({name: value}, raise_if_not_exists=False)
        return 1

    def merge_chunk(self, chunk: pa.Table, key: str, props: dict[str, str]) -> int:
        """One ``MERGE`` on ``key`` that updates ``chunk``'s columns (added by schema evolution when
        missing, in the same commit), with ``props`` in its commit info. Returns the versions made."""
        from deltalake.transaction import CommitProperties

        updates = {f"`{n}`": f"s.`{n}`" for n in chunk.schema.names if n != key}
        merge = self._open().merge(
            chunk,
            f"t.`{key}` = s.`{key}`",
            source_alias="s",
            target_alias="t",
            merge_schema=True,
            commit_properties=CommitProperties(custom_metadata=props),
        )
        merge.when_matched_update(updates).execute()
        return 1

    def read(self) -> pa.Table:
        """Every committed row (the latest version)."""
        dt = self._open()
        if dt is None:
            raise SurgeOutputError(f"no Delta table at {self.location.url!r}. Fix: pass the output of a run.")
        return dt.to_pyarrow_table()


def _actions(dt: Any) -> dict[str, list]:
    """The add actions of ``dt``'s version as columns (``path``, ``size_bytes``, ``num_records``)."""
    table = pa.table(dt.get_add_actions(flatten=True))
    return {name: table.column(name).to_pylist() for name in ("path", "size_bytes", "num_records")}


def _records(dt: Any) -> int:
    """The rows of ``dt``'s version (its add actions' ``numRecords``; counted where one has no statistics)."""
    counts = _actions(dt)["num_records"]
    if any(c is None for c in counts):
        return int(dt.to_pyarrow_dataset().count_rows())
    return int(sum(counts))


def deltalake_version(location: TableLocation, version: int) -> Any:
    """The Delta table at ``location`` as of its (Delta, 0-based) ``version``."""
    deltalake = require("deltalake")
    return deltalake.DeltaTable(location.uri, version=version, storage_options=location.options)
