"""Lance table output: workers write fragments, the claim holder commits them.

A SuperBatch task writes its rows as Lance data files under the table's ``data/``
(:func:`lance.fragment.write_fragments`, no commit): invisible to every reader until a
manifest version names them. Its commit record (``_surge/`` inside the table) carries the
fragments' metadata (:meth:`LanceTable.write`'s payload). The process holding the run's
claim appends batches of them (:meth:`LanceTable.commit`: one
``LanceOperation.Append`` per batch, a new table version) with the run id, the
SuperBatch keys and its claim token in the transaction's properties, so the table's own
history says which SuperBatches it holds (:meth:`LanceTable.history`).

**Fencing.** A claim holder's first version is a *fence* (:meth:`LanceTable.fence`): the
table's creation (``mode="create"``, which fails when a table exists), or a
``LanceOperation.Project`` onto the table's own schema, which changes no row but conflicts
with every ``Append`` read at an earlier version. So an ``Append`` that a paused process
prepared before another process took its claim over is refused by Lance itself
(``CommitConflictError``), whatever the paused process checked before it stopped.
"""

from __future__ import annotations

import json
import math
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
    schema_text,
)
from .locations import TableLocation

__all__ = ["LanceTable", "KEEPS_ROWS", "lance_index_params", "lancedb_function"]

#: operations of another writer that leave every committed row in place (a run goes on after them)
KEEPS_ROWS = frozenset({"Append", "CreateIndex", "Rewrite", "UpdateConfig", "UpdateMap"})


class LanceTable(TableOutput):
    """One Lance dataset as a dask-surge output (picklable: workers write through it).

    Parameters
    ----------
    location : TableLocation
        Where the dataset is (``<output>``; its manifest is ``<output>/_surge/``).
    """

    name = "lance"
    LIBRARY = "lance"
    native_index = True
    merges_columns = True
    #: the entry of a directory that says a table of this format is there
    MARKER = "_versions"
    #: what the format's own directory holds (a new output may hold these and ``_surge/`` only)
    ENTRIES = frozenset({"data", "_versions", "_transactions", "_indices", "_deletions", "_refs"})

    @classmethod
    def owns_payload(cls, payload: str) -> bool:
        """True when ``payload`` (a commit record's table data) is this format's."""
        return "fragments" in json.loads(payload)

    def __init__(self, location: TableLocation) -> None:
        self.location = location

    def __repr__(self) -> str:
        return f"LanceTable({self.location.url!r})"

    def __dask_tokenize__(self) -> tuple:
        return ("LanceTable", self.location.url)

    def keeps_rows(self, op: str) -> bool:
        """True when another writer's operation ``op`` leaves every committed row in place."""
        return op in KEEPS_ROWS

    def _open(self, version: int | None = None) -> Any:
        lance = require("lance")
        try:
            return lance.dataset(self.location.uri, version=version, storage_options=self.location.options)
        except (ValueError, OSError) as err:
            if "not found" in str(err).lower() or "does not exist" in str(err).lower():
                return None
            raise

    def exists(self) -> bool:
        """True when a Lance dataset is at the location."""
        return self._open() is not None

    # -- the worker's side -----------------------------------------------------------------------

    def write(self, data: pa.Table) -> str:
        """Write ``data`` as fragment(s) of the table, not committed; returns the payload
        (JSON: the fragments' metadata and the Arrow schema) the commit record carries."""
        from lance.fragment import write_fragments

        require("lance")
        try:
            fragments = write_fragments(
                data,
                self.location.uri,
                schema=data.schema,
                storage_options=self.location.options,
                max_rows_per_file=1 << 30,
            )
        except OSError as err:
            if "schema" not in str(err).lower():
                raise
            ds = self._open()
            table = [(f.name, str(f.type)) for f in ds.schema] if ds is not None else "other columns"
            raise SurgeOutputError(
                f"the Lance table {self.location.url!r} has columns {table}, but this run writes "
                f"{[(f.name, str(f.type)) for f in data.schema]}. Nothing was committed to it. Fix: append "
                "only runs with the same columns (keep=, model, precision), or write to a new table."
            ) from err
        return json.dumps(
            {"fragments": [f.to_json() for f in fragments], "schema": schema_text(data.schema)},
            sort_keys=True,
        )

    # -- the claim holder's side -------------------------------------------------------------------

    def history(self, run_id: str, since: int = 0) -> History:
        """What the table's versions after ``since`` say: the SuperBatches each version of run
        ``run_id`` committed, and the versions other writers made (with their operation)."""
        ds = self._open()
        if ds is None:
            return History(exists=False)
        out = History(exists=True, version=ds.version)
        for v in ds.versions():
            version = int(v["version"])
            if version <= since:
                continue
            txn = ds.read_transaction(version)
            props = (txn.transaction_properties or {}) if txn is not None else {}
            op = type(txn.operation).__name__ if txn is not None else "unknown"
            if props.get(RUN_PROPERTY) == run_id:
                sbs = json.loads(props.get(SUPERBATCHES_PROPERTY, "[]"))
                out.add_ours(
                    version,
                    sbs,
                    op,
                    props.get(FENCE_PROPERTY, ""),
                    replaces=op == "Overwrite",  # an earlier build's stale Overwrite replaced every row
                    repaired=json.loads(props.get(REPAIRED_PROPERTY, "[]")),
                )
            else:
                out.note_foreign()
                out.foreign.append((version, op, props.get(RUN_PROPERTY, "")))
        return out

    def version_rows(self) -> list[tuple[int, float, int]]:
        """``(version, commit time in epoch seconds, rows)`` of each version of the table, oldest first
        (empty: no table)."""
        ds = self._open()
        if ds is None:
            return []
        out = []
        for v in ds.versions():
            total = (v.get("metadata") or {}).get("total_rows")
            rows = int(total) if total is not None else ds.checkout_version(v["version"]).count_rows()
            out.append((int(v["version"]), v["timestamp"].timestamp(), rows))
        return out

    def table_version(self) -> int | None:
        """The table's own version now, as its library names it (None: no table): what an index of the
        table records, so that any later commit (an append or delete by anyone) makes the index stale."""
        ds = self._open()
        return None if ds is None else int(ds.version)

    def data_files(self) -> list[tuple[str, int | None]]:
        """``(path relative to the table, size in bytes or None)`` of every data file the latest
        version references."""
        ds = self._open()
        if ds is None:
            return []
        return [
            (f"data/{d.path}", int(d.file_size_bytes) if d.file_size_bytes else None)
            for frag in ds.get_fragments()
            for d in frag.data_files()
        ]

    def validate(self) -> list[str]:
        """``LanceDataset.validate``'s finding on the latest version (empty: none)."""
        try:
            self.dataset().validate()
        except (OSError, ValueError, RuntimeError) as err:
            return [f"Lance's own check of {self.location.url!r} fails: {err}"]
        return []

    def check_schema(self, payload: str) -> None:
        """Refuse ``payload``'s rows when their columns differ from the table's."""
        ds = self._open()
        if ds is None:
            return
        ours = schema_of(json.loads(payload)["schema"])
        theirs = ds.schema
        mine = [(f.name, f.type) for f in ours]
        table = [(f.name, f.type) for f in theirs]
        if mine != table:
            raise SurgeOutputError(
                f"the Lance table {self.location.url!r} has columns {table}, but this run writes {mine}. "
                "Nothing was committed to it. Fix: append only runs with the same columns (keep=, model, "
                "precision), or write to a new table."
            )

    def fence(self, run_id: str, token: str, read_version: int, payload: str) -> int:
        """Make the version that begins the commits of the claim holder ``token``: create the table
        (``read_version`` 0; refused when a table exists) or commit a ``Project`` onto its own schema
        at ``read_version`` (no row changes; every ``Append`` read earlier now conflicts). Returns the
        new version; raises :class:`~.base.CommitConflict` when Lance refuses."""
        lance = require("lance")
        from lance.commit import CommitConflictError

        props = {RUN_PROPERTY: run_id, SUPERBATCHES_PROPERTY: "[]", FENCE_PROPERTY: token}
        try:
            if read_version == 0:
                schema = schema_of(json.loads(payload)["schema"])
                ds = lance.write_dataset(
                    schema.empty_table(),
                    self.location.uri,
                    mode="create",
                    storage_options=self.location.options,
                    transaction_properties=props,
                )
            else:
                schema = self._open(read_version).schema
                ds = lance.LanceDataset.commit(
                    self.location.uri,
                    lance.Transaction(
                        read_version, lance.LanceOperation.Project(schema), transaction_properties=props
                    ),
                    storage_options=self.location.options,
                )
        except CommitConflictError as err:
            raise CommitConflict(f"Lance refused the fence at version {read_version}: {err}") from err
        except OSError as err:
            if "already exists" not in str(err):
                raise
            raise CommitConflict(f"a Lance table was created at {self.location.url!r} meanwhile") from err
        return int(ds.version)

    def repair(self, run_id: str, token: str, superbatches: list[str], read_version: int) -> int:
        """Remove the second copy of SuperBatches the table's history names twice (an earlier build's
        stale commit): the fragments a later version added when every SuperBatch it names is such a
        second copy, and every fragment that references a data file an older fragment references too,
        are deleted in one version whose :data:`~.base.REPAIRED_PROPERTY` names ``superbatches``, read
        at ``read_version``. Returns it."""
        lance = require("lance")
        from lance.commit import CommitConflictError

        ds = self._open(read_version)
        now = {f.fragment_id for f in ds.get_fragments()}
        h = self.history(run_id)
        dups = set(superbatches)
        extra: set[int] = set()
        for version in {v for sb in superbatches for v in h.held.get(sb, [])[1:]}:
            names = {sb for sb, held in h.held.items() if version in held}
            if names <= dups:  # every SuperBatch it names is a second copy: the fragments it added go
                before = {f.fragment_id for f in self._open(version - 1).get_fragments()}
                extra |= ({f.fragment_id for f in self._open(version).get_fragments()} - before) & now
        seen: set[str] = set()
        for frag in sorted(ds.get_fragments(), key=lambda f: f.fragment_id):
            paths = tuple(d.path for d in frag.data_files())
            if paths and all(p in seen for p in paths):  # the same data file twice is never two rows' worth
                extra.add(frag.fragment_id)
            seen.update(paths)
        props = {
            RUN_PROPERTY: run_id,
            SUPERBATCHES_PROPERTY: "[]",
            FENCE_PROPERTY: token,
            REPAIRED_PROPERTY: json.dumps(sorted(superbatches)),
        }
        op = (
            lance.LanceOperation.Delete([], sorted(extra), "dask-surge: a second copy of committed fragments")
            if extra
            else lance.LanceOperation.Project(ds.schema)
        )
        try:
            out = lance.LanceDataset.commit(
                self.location.uri,
                lance.Transaction(read_version, op, transaction_properties=props),
                storage_options=self.location.options,
            )
        except CommitConflictError as err:
            raise CommitConflict(f"Lance refused the repair read at version {read_version}: {err}") from err
        return int(out.version)

    def commit(self, run_id: str, token: str, batch: Sequence[tuple[str, str]], read_version: int) -> int:
        """Append the fragments of ``batch`` (``(sb, payload)`` pairs) as one table version whose
        transaction properties name ``run_id``, the SuperBatches and the claim holder ``token``, read at
        ``read_version`` (the table exists: :meth:`fence` made it). Returns the new version; raises
        :class:`~.base.CommitConflict` when Lance refuses it (a fence or a conflicting change since
        ``read_version``)."""
        lance = require("lance")
        from lance.commit import CommitConflictError
        from lance.fragment import FragmentMetadata

        fragments = [
            FragmentMetadata.from_json(json.dumps(f)) for _, p in batch for f in json.loads(p)["fragments"]
        ]
        props = {
            RUN_PROPERTY: run_id,
            SUPERBATCHES_PROPERTY: json.dumps(sorted(sb for sb, _ in batch)),
            FENCE_PROPERTY: token,
        }
        try:
            ds = lance.LanceDataset.commit(
                self.location.uri,
                lance.Transaction(
                    read_version, lance.LanceOperation.Append(fragments), transaction_properties=props
                ),
                storage_options=self.location.options,
            )
        except CommitConflictError as err:
            raise CommitConflict(f"Lance refused the commit read at version {read_version}: {err}") from err
        return int(ds.version)

    def dataset(self) -> Any:
        """The latest version (a ``lance.LanceDataset``)."""
        ds = self._open()
        if ds is None:
            raise SurgeOutputError(f"no Lance table at {self.location.url!r}. Fix: pass the output of a run.")
        return ds

    def read(self) -> pa.Table:
        """Every committed row (the latest version)."""
        return self.dataset().to_table()

    def columns(self) -> list[str]:
        """The table's columns."""
        return list(self.dataset().schema.names)

    def read_rows(self, keys: Any, on: list[str], columns: list[str]) -> Any:
        """The rows ``keys`` names (a scan of the key and asked columns, joined)."""
        found = self.dataset().to_table(columns=[*on, *columns]).to_pandas()
        return keys.merge(found, on=on, how="inner")

    # -- a column merged into the table (dask_surge.backfill) -------------------------------------

    def vector_shape(self, column: str, kind: pa.DataType) -> tuple[pa.DataType | None, int | None]:
        """``(value type, dimension)`` of the vectors ``column`` (of type ``kind``) holds; a Lance
        vector column is a fixed-size list (anything else: ``(None, None)``)."""
        return (kind.value_type, kind.list_size) if pa.types.is_fixed_size_list(kind) else (None, None)

    def holds(self, kind: pa.DataType) -> bool:
        """True: Lance stores vectors of ``kind`` as they are."""
        return True

    def recorded(self, name: str) -> str | None:
        """The table's config value ``name`` (None: not set)."""
        return self.dataset().config().get(name)

    def record(self, name: str, value: str) -> int:
        """Set the table's config value ``name`` (one version)."""
        self.dataset().update_config({name: value})
        return 1

    def merge_chunk(self, chunk: pa.Table, key: str, props: dict[str, str]) -> int:
        """Add ``chunk``'s columns when missing (one version), then merge it on ``key`` (one version whose
        transaction properties hold ``props``). Returns the versions made."""
        import dataclasses

        lance = require("lance")
        ds = self.dataset()
        missing = [f for f in chunk.schema if f.name not in ds.schema.names]
        if missing:
            ds.add_columns(missing)
            ds = self.dataset()
        txn, _ = ds.merge_insert(key).when_matched_update_all().execute_uncommitted(chunk)
        txn = dataclasses.replace(txn, transaction_properties={**(txn.transaction_properties or {}), **props})
        lance.LanceDataset.commit(self.location.uri, txn, storage_options=self.location.options)
        return 1 + bool(missing)

    def record_embedding(
        self,
        identity: dict,
        source: str,
        name: str | None,
        *,
        vector: str = "embedding",
        run: str | None = None,
    ) -> int:
        """Record in the table's schema metadata, as LanceDB's embedding-function registry reads it
        (:func:`lancedb_function`), that ``vector`` holds the embeddings of ``source``, so that
        ``lancedb.connect(...).open_table(...).search("text")`` embeds its query with the same model:
        one ``Project`` version (of run ``run``'s own: its commit metadata names it), none when
        LanceDB's ``sentence-transformers`` function would not make the same vectors or the same is
        recorded already (an entry of another model for ``vector`` is removed)."""
        lance = require("lance")

        entry = lancedb_function(identity, source, vector, name)
        ds = self.dataset()
        meta = dict(ds.schema.metadata or {})
        recorded = json.loads(meta.get(_LANCEDB_KEY, b"[]"))
        functions = [f for f in recorded if f.get("vector_column") != vector] + ([entry] if entry else [])
        if functions == recorded:
            return 0
        meta[_LANCEDB_KEY] = json.dumps(functions).encode()
        props = {RUN_PROPERTY: run, SUPERBATCHES_PROPERTY: "[]"} if run else {}
        lance.LanceDataset.commit(
            self.location.uri,
            lance.Transaction(
                ds.version,
                lance.LanceOperation.Project(ds.schema.with_metadata(meta)),
                transaction_properties=props,
            ),
            storage_options=self.location.options,
        )
        return 1

    # -- the table's own vector index ----------------------------------------------------------

    def build_native_index(self, metric: str) -> dict:
        """Build (replace) Lance's vector index on ``embedding`` for ``metric``; returns its ``rows``
        and parameters (:func:`lance_index_params`)."""
        ds = self.dataset()
        rows, dim = ds.count_rows(), ds.schema.field("embedding").type.list_size
        params = lance_index_params(rows, dim)
        ds.create_index("embedding", metric=metric, replace=True, **params)
        return {"rows": rows, **params}

    def describe_native_index(self) -> tuple[str, dict] | None:
        """``(metric, description)`` of the vector index on ``embedding`` (None: there is none)."""
        ds = self.dataset()
        indices = [i for i in _indices(ds) if "embedding" in _field_names(i)]
        if not indices:
            return None
        described = {
            "rows": ds.count_rows(),
            "rows_indexed": _get(indices[0], "num_rows_indexed"),
            "index_type": _get(indices[0], "index_type"),
        }
        return _metric_of(indices[0]), described

    def nearest(self, vector: Any, k: int, metric: str, columns: list[str]) -> Any:
        """The ``k`` rows nearest ``vector`` by the index (``metric``), with ``columns`` and Lance's
        ``_distance`` (smaller is nearer), as a pandas frame."""
        return (
            self.dataset()
            .to_table(
                # the distance asked for by name: Lance warns (on stderr) of a search that leaves it implied
                columns=[*columns, "_distance"],
                nearest={
                    "column": "embedding",
                    "q": vector,
                    "k": k,
                    "metric": metric,
                    "nprobes": 20,
                    "refine_factor": 10,
                },
            )
            .to_pandas()
        )


#: the schema-metadata key of LanceDB's embedding functions (``lancedb.embeddings.registry``)
_LANCEDB_KEY = b"embedding_functions"
#: keys of an embedding identity whose value LanceDB's ``sentence-transformers`` function can reproduce
_PLAIN = {"model", "normalize", "precision", "truncate_dim", "dimension", "on_null"}


def lancedb_function(identity: dict, source: str, vector: str, name: str | None) -> dict | None:
    """LanceDB's embedding-function entry (an item of the schema metadata ``embedding_functions``: the
    registry's ``name``, the function's ``model`` arguments, ``source_column``, ``vector_column``) for
    vectors made as ``identity`` says (:func:`~dask_surge.io.reuse.embedding_identity`) by the model
    sentence-transformers loads as ``name``; None when LanceDB's ``sentence-transformers`` function
    would not make the same vectors: no such name (a local directory, an in-memory model), a prompt,
    ``model_kwargs``, ``truncate_dim``, a precision other than float32, a long-text mode or a family
    other than dense.

    Examples
    --------
    >>> model = {"kind": "path", "repo_id": "BAAI/bge-small-en-v1.5", "commit": "c0", "prompt": None}
    >>> entry = lancedb_function({"model": model, "normalize": True}, "text", "embedding", "BAAI/bge-small-en-v1.5")
    >>> entry["name"], entry["model"], entry["source_column"], entry["vector_column"]
    ('sentence-transformers', {'name': 'BAAI/bge-small-en-v1.5', 'normalize': True}, 'text', 'embedding')
    >>> lancedb_function({"model": model, "precision": "int8"}, "text", "embedding", "BAAI/bge-small-en-v1.5")
    """
    model = identity.get("model")
    if (
        name is None
        or not isinstance(model, dict)
        or set(identity) - _PLAIN
        or identity.get("precision", "float32") != "float32"
        or identity.get("truncate_dim") is not None
        or any(model.get(k) for k in ("prompt", "prompt_name", "model_kwargs", "family"))
    ):
        return None
    return {
        "name": "sentence-transformers",
        "model": {"name": name, "normalize": bool(identity.get("normalize"))},
        "source_column": source,
        "vector_column": vector,
    }


def lance_index_params(rows: int, dim: int) -> dict:
    """What :meth:`LanceTable.build_native_index` asks Lance for, for ``rows`` vectors of ``dim``
    dimensions.

    Examples
    --------
    >>> lance_index_params(100_000, 384)
    {'index_type': 'IVF_PQ', 'num_partitions': 316, 'num_sub_vectors': 48}
    >>> lance_index_params(1_000, 32)
    {'index_type': 'IVF_FLAT', 'num_partitions': 31}
    """
    partitions = max(1, int(math.sqrt(rows)))
    if rows < 5_000:
        return {"index_type": "IVF_FLAT", "num_partitions": partitions}
    sub = next(d for d in (8, 4, 2, 1) if dim % d == 0)
    return {"index_type": "IVF_PQ", "num_partitions": partitions, "num_sub_vectors": dim // sub}


#: the metrics Lance's index ranks by, as dask-surge names them
_METRICS = ("cosine", "l2", "dot")


def _metric_of(index: Any) -> str:
    """The metric a Lance vector index ranks by (``describe_indices``' ``details``); cosine where the
    installed Lance does not say."""
    details = index.get("details") if isinstance(index, dict) else getattr(index, "details", None)
    metric = str(details.get("metric_type", "cosine")).lower() if isinstance(details, dict) else "cosine"
    return metric if metric in _METRICS else "cosine"


def _indices(ds: Any) -> list:
    return list(ds.describe_indices() if hasattr(ds, "describe_indices") else ds.list_indices())


def _get(index: Any, name: str) -> Any:
    return index.get(name) if isinstance(index, dict) else getattr(index, name, None)


def _field_names(index: Any) -> list[str]:
    names = _get(index, "field_names") or _get(index, "fields") or ["embedding"]
    return [str(n) for n in names] if all(isinstance(n, str) for n in names) else ["embedding"]
