"""Backfill an embedding column into an existing Lance, Delta or PostgreSQL table, in place, resumably.

:func:`backfill` embeds every row of a table whose embedding is missing or was made from another
text than the row holds now (the row's text hash against the hash recorded beside its embedding,
as ``reuse=`` matches texts), and writes the embeddings into the table in place, one table
version per chunk of rows: a merge on a key column (Lance ``merge_insert``, Delta ``MERGE``,
PostgreSQL ``UPDATE ... FROM`` a binary-COPYed temporary table, one transaction) whose commit names
the backfill (:data:`BACKFILL_PROPERTY`). Each version is atomic: readers see
the table as it was or with one more chunk embedded, never a half-written chunk. A kill loses at
most the chunk in flight: a rerun finds the rows still missing and embeds only them. Rows added
to the table later (with the column null) are picked up by the next backfill, and only they are
encoded.

The loop is shared; what differs per format is the output class's (:attr:`~dask_surge.io.tables.Output.merges_columns`:
:class:`~dask_surge.io.tables.lance.LanceTable`, :class:`~dask_surge.io.tables.delta.DeltaOutput`,
:class:`~dask_surge.io.tables.pgvector.PgVectorTable`): its dataset,
the shape of its vector column, the types it holds, its recorded options, and one chunk's merge.

The encoding itself is :func:`dask_surge.encode` without an output (on the active Dask client, or
the scheduler given), so every encoder option applies.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from . import config
from .api import embedding_identity_for, encode
from .errors import SurgeInputError, SurgeValueError
from .execution.progress import RunProgress, logging_through
from .execution.runner import loadable_name
from .io.hashing import hash_column, text_hashes
from .io.reuse import identity_difference
from .io.store import OutputStore
from .io.tables import FORMATS, detect, detect_output, display_name, open_output, output_class, output_store
from .io.tables.base import EMBEDDING_PROPERTY
from .io.tables.pgvector import is_address
from .options import Invalid, option

__all__ = ["BACKFILL_PROPERTY", "BackfillResult", "backfill"]

#: commit-metadata key of a backfill's table versions: JSON ``{"id", "text", "column", "chunk", "rows"}``
BACKFILL_PROPERTY = "dask-surge.backfill"
#: options of :func:`dask_surge.encode` that mean nothing to a backfill (it writes one column in place)
_NOT_FOR_BACKFILL = ("output", "format", "mode", "overwrite", "keep", "reuse", "build_index", "input_token")


@dataclass(frozen=True)
class BackfillResult:
    """What :func:`backfill` did: rows of the table, rows it encoded, table versions it made."""

    rows: int
    encoded: int
    versions: int
    column: str


def _open_table(store: OutputStore) -> Any:
    """The table at ``store`` (:func:`~dask_surge.io.tables.detect_output`), if its format merges a column
    (:attr:`~dask_surge.io.tables.Output.merges_columns`); else an error naming what is there."""
    root = store.root
    fmt = detect_output(store)
    if output_class(fmt).merges_columns:
        return open_output(fmt, store)
    able = [name for name in FORMATS if output_class(name).merges_columns]
    databases = [f for f in able if output_class(f).database]
    able = [f for f in able if f not in databases]
    names = store.listdir(root) if store.isdir(root) else []
    if not store.exists(root):
        what = "nothing is there"
    elif not store.isdir(root):
        what = "it is a file"
    elif output_class(fmt).batched or detect(names):
        what = f"it is a table of format {detect(names) or fmt!r}, which backfill does not write"
    else:
        what = (
            f"a directory holding {names[:5]}{' ...' if len(names) > 5 else ''}"
            if names
            else "an empty directory"
        )
    markers = " or ".join(f"{output_class(f).MARKER}/ ({f})" for f in able)
    raise SurgeInputError(
        f"{store.location!r} is not a table backfill writes ({', '.join(able)}): {what}. Fix: pass the root "
        f"of such a table (holding {markers})"
        + "".join(f", or a PostgreSQL URI with table= ({f})" for f in databases)
        + "."
    )


def _check_columns(schema: pa.Schema, text: str, key: str, url: str) -> None:
    names = schema.names
    for name, what in ((text, "text"), (key, "key")):
        if name not in names:
            raise SurgeInputError(
                f"the table {url!r} has no {what} column {name!r} (it has {names}). Nothing was written. "
                f"Fix: pass {what}= one of its columns."
            )
    kind = schema.field(text).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise SurgeInputError(
            f"the text column {text!r} of {url!r} holds {kind}, not strings. Nothing was written. Fix: pass "
            "text= a string column."
        )


def _check_keys(keys: pa.ChunkedArray, key: str, url: str) -> None:
    """Refuse keys a MERGE cannot match one to one, compared as the table compares them: null or NaN
    keys (they equal no key: the row is never written back) and keys equal to another (``0.0`` and
    ``-0.0`` are one key: a MERGE would write one embedding into several rows, or fail)."""
    where = f"the key column {key!r} of {url!r}"
    fix = "Nothing was written. Fix: pass key= a column with a unique value in every row (an integer or string id)."
    if keys.null_count:
        raise SurgeInputError(
            f"{where} has {keys.null_count} null value(s); a row without a key cannot be written back. {fix}"
        )
    signed_zeros = False
    if pa.types.is_floating(keys.type):
        values = keys.to_numpy()
        nans = int(np.isnan(values).sum())
        if nans:
            raise SurgeInputError(
                f"{where} has {nans} NaN value(s); NaN equals no key (not even itself), so the write-back "
                f"would match no row and its embedding would never be written. {fix}"
            )
        signed_zeros = bool(np.any((values == 0) & np.signbit(values)))
        keys = pa.chunked_array(
            [pa.array(values + values.dtype.type(0))]
        )  # -0.0 + 0.0 is 0.0, as a MERGE sees it
    counts = pc.value_counts(keys)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        example, times = repeated[0]["values"].as_py(), repeated[0]["counts"].as_py()
        rule = " as the table compares keys" if signed_zeros else ""
        note = "; 0.0 and -0.0 are one key" if signed_zeros and example == 0 else ""
        raise SurgeInputError(
            f"{where} is not unique{rule}: {len(repeated)} value(s) occur more than once (e.g. {example!r}, "
            f"{times} times{note}); the write-back matches rows on the key. {fix}"
        )


def _check_vectors(table: Any, schema: pa.Schema, column: str, got: pa.FixedSizeListType, url: str) -> None:
    """Refuse vectors of type ``got`` that the table cannot hold, or its existing ``column`` cannot."""
    value, dim = got.value_type, got.list_size
    if not table.holds(value):
        name = {"halffloat": "float16"}.get(str(value), str(value))
        raise SurgeInputError(
            f"the model gives {name} vectors, and a {display_name(table.name)} table has no {name} type. Nothing was "
            f"written to {url!r}. Fix: pass precision='float32' (or 'int8' where it applies), or backfill a "
            "Lance table."
        )
    if column not in schema.names:
        return
    kind = schema.field(column).type
    have_value, have_dim = table.vector_shape(column, kind)
    if have_value != value or have_dim not in (None, dim):
        shape = f" holding vectors of dimension {have_dim}" if have_dim is not None else ""
        raise SurgeInputError(
            f"the column {column!r} of {url!r} is {kind}{shape}, and the model gives {value} vectors of "
            f"dimension {dim}. Nothing was written. Fix: pass another column=, or drop {column!r} (and "
            f"{column + '_text_hash'!r}) from the table."
        )


def _location(location: Any) -> str:
    """A path or URL, or the path of a ``deltalake.DeltaTable``, a ``lance`` dataset or a LanceDB table."""
    if isinstance(location, (str, os.PathLike)):
        return os.fspath(location)
    for attr in ("table_uri", "uri"):  # deltalake.DeltaTable, lance.LanceDataset
        value = getattr(location, attr, None)
        if isinstance(value, str):
            return value
    if callable(getattr(location, "to_lance", None)):  # a LanceDB table
        return str(location.to_lance().uri)
    raise SurgeValueError(
        f"backfill({type(location).__name__} ...): the location is a path or URL of a Lance or Delta table, a "
        "PostgreSQL URI (with table=), a "
        "deltalake.DeltaTable, a lance dataset or a LanceDB table. Fix: pass one of those."
    )


def backfill(
    location: Any,
    text: str,
    *,
    key: str,
    table: str | None = None,
    column: str = "embedding",
    chunk_rows: int = 10_000,
    rebuild: bool = False,
    storage_options: dict | None = None,
    **options: Any,
) -> BackfillResult:
    """Embed ``text`` into ``column`` of the table at ``location`` where it is missing or stale, in place.

    Parameters
    ----------
    location : str, path, or table object
        A Lance or Delta table: a local path or ``s3://`` URL (the format is read from what its root
        holds: ``_versions/`` or ``_delta_log/``), or a ``deltalake.DeltaTable``, a ``lance`` dataset or
        a LanceDB table (its path is used; pass ``storage_options`` for an object store). Or a
        PostgreSQL database, ``"postgresql://user@host:5432/db"`` (the password through ``PGPASSWORD``
        or ``~/.pgpass``; one in the URI is shown nowhere), whose table ``table`` names.
    text : str
        Its text column (rows with a null text are left alone).
    key : str
        A column whose values identify rows uniquely (the write-back matches rows on it; a
        PostgreSQL table's primary key).
    table : str, optional
        For a PostgreSQL ``location``: the existing table, as ``encode``'s ``table=`` names one
        (``"name"`` or ``"schema.name"``; else the URI's ``#schema.name``, else ``surge.table``).
        Each chunk is one transaction: ``ALTER TABLE ... ADD COLUMN`` (the first: ``vector(d)``, or
        ``halfvec(d)`` for float16, and ``bytea`` for the hash), a binary ``COPY`` into a temporary
        table and ``UPDATE ... FROM`` it joined on ``key``; the model and options are the JSON of the
        column's ``COMMENT``.
    column : str
        The embedding column to add or update; ``<column>_text_hash`` beside it records the hash of
        the text each embedding was made from, and the table records the model and options that made
        the column (a table property ``dask-surge.embedding.<column>``; PostgreSQL: that key of the
        column's comment).
    chunk_rows : int
        Rows embedded and written per table version.
    rebuild : bool
        Can be True to re-encode every row with these options (and record them), or False (default)
        to encode only new or changed rows, refusing options other than those the column was made with.
    storage_options : dict, optional
        fsspec-style options of an ``s3://`` table, or None for a local one.
    **options
        Options of :func:`dask_surge.encode` that make embeddings or run them (``model``,
        ``normalize``, ``prompt``, ``precision``, ``truncate_dim``, ``scheduler``, ``progress``...);
        those that mean nothing here (``output``, ``format``, ``mode``, ``overwrite``, ``keep``,
        ``reuse``, ``build_index``) are refused.

    Returns
    -------
    BackfillResult

    Raises
    ------
    SurgeInputError
        Not a Lance, Delta or PostgreSQL table; no such text or key column; a key that is null or repeated;
        an existing ``column`` of another type or dimension than the model's vectors, or made with
        other options (the difference is named).
    """
    given = sorted(k for k in _NOT_FOR_BACKFILL if k in options)
    if given:
        raise SurgeValueError(
            f"backfill(..., {', '.join(f'{k}=' for k in given)}): {'these options mean' if len(given) > 1 else 'this option means'} "
            "nothing to a backfill, which writes one column of the table in place. Nothing was written. Fix: "
            "leave them out (build an index of the table with its own library, e.g. lance's create_index)."
        )
    if options.get("long_texts") == "chunk":
        raise SurgeValueError(
            "backfill(..., long_texts='chunk'): a chunked text is several vectors, and a backfill writes one per "
            "row. Nothing was written. Fix: long_texts='truncate' (default) or 'error'."
        )
    place = _location(location)
    try:
        option("table").check(table)
    except Invalid as err:
        raise SurgeValueError(option("table").argument_error(table, err) + " Nothing was written.") from None
    if table is not None and not is_address(place):
        raise SurgeValueError(
            f"backfill(..., table={table!r}) names a PostgreSQL table, and {place!r} is not a PostgreSQL URI. "
            "Nothing was written. Fix: pass 'postgresql://user@host:5432/db' first, or leave table= out for a "
            "Lance or Delta table."
        )
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise SurgeValueError(f"chunk_rows={chunk_rows!r}: rows per table version. Fix: pass an int >= 1.")
    identity = embedding_identity_for(**options)  # every option checked (progress= too), nothing encoded
    with RunProgress(enabled=config.get("progress", options.get("progress"))) as bar, logging_through(bar):
        # a database's: the state directory its runs keep (a backfill writes nothing there)
        store = output_store(place, storage_options, table=table)
        target = _open_table(store)
        url, hash_col = target.location.url, f"{column}_text_hash"  # a database's: without its password
        schema = target.dataset().schema
        _check_columns(schema, text, key, url)
        name = EMBEDDING_PROPERTY + column
        recorded = target.recorded(name)
        if recorded is not None and not rebuild:
            differ = identity_difference(json.loads(recorded), identity, now="this backfill uses")
            if differ:
                raise SurgeInputError(
                    f"the column {column!r} of {url!r} was made with other options: {differ}. Its vectors and new "
                    "ones would not be comparable. Nothing was written. Fix: pass the options it was made with, "
                    "rebuild=True to re-encode every row with these, or another column=."
                )
        have = column in schema.names and hash_col in schema.names
        scan = target.dataset().to_table(columns=[key, text, *([hash_col] if have else [])])
        _check_keys(scan.column(key), key, url)
        texts = scan.column(text)
        valid = np.flatnonzero(np.asarray(texts.is_valid()))  # a row without a text has nothing to embed
        current = hash_column(text_hashes(texts.take(valid))).cast(pa.binary())
        if have and not rebuild:
            hashes = scan.column(hash_col).take(valid).cast(pa.binary())
            stale = ~np.asarray(pc.fill_null(pc.equal(hashes, current), False), dtype=bool)
        else:
            stale = np.ones(len(valid), dtype=bool)
        todo, todo_hashes = valid[stale], current.filter(pa.array(stale))
        chunks = -(-len(todo) // chunk_rows)
        bar.planned(rows=len(todo), superbatches=chunks)
        bar.phase("encoding")
        props = {"id": uuid.uuid4().hex, "text": text, "column": column}
        versions = 0
        record = (
            recorded is None or rebuild
        )  # before the first chunk's rows: a killed backfill's column is named too
        for n, start in enumerate(range(0, len(todo), chunk_rows)):
            rows = todo[start : start + chunk_rows]
            part = pd.DataFrame({"text": texts.take(rows).to_pandas()})
            got = encode(dd.from_pandas(part, npartitions=1), "text", **options).compute().sort_values("row")
            # fixed_size_list of the model's dtype, as encode() made it
            emb = pa.array(got["embedding"].array)
            emb = emb.combine_chunks() if isinstance(emb, pa.ChunkedArray) else emb
            if not pa.types.is_fixed_size_list(emb.type):
                raise SurgeInputError(
                    f"backfill writes one dense vector per row, and this model gives {emb.type}. Nothing was "
                    f"written to {url!r}. Fix: backfill with a dense embedding model."
                )
            if n == 0:
                _check_vectors(target, schema, column, emb.type, url)
                if record:
                    versions += target.record(name, json.dumps(identity, sort_keys=True, default=str))
                    record = False
            chunk = pa.table(
                {
                    key: scan.column(key).take(rows),
                    column: emb,
                    hash_col: todo_hashes[start : start + len(rows)].cast(pa.binary(16)),
                }
            )
            meta = {BACKFILL_PROPERTY: json.dumps({**props, "chunk": n, "rows": len(rows)}, sort_keys=True)}
            versions += target.merge_chunk(chunk, key, meta)
            bar.commit(f"chunk-{n}", len(rows))
        if (
            record and column in schema.names
        ):  # nothing to encode: the column (of an earlier build) gets its record
            versions += target.record(name, json.dumps(identity, sort_keys=True, default=str))
        if column in schema.names or len(todo):  # where the format records how vectors were made (LanceDB)
            versions += target.record_embedding(
                identity, text, loadable_name(identity.get("model")), vector=column
            )
        bar.finish(len(todo), chunks)
        return BackfillResult(rows=scan.num_rows, encoded=len(todo), versions=versions, column=column)
