"""Backfill an embedding column into an existing Lance table, in place, resumably.

:func:`backfill` embeds every row of a Lance table whose embedding is missing or was made from
another text than the row holds now (the row's text hash against the hash recorded beside its
embedding, as ``reuse=`` matches texts), and writes the embeddings into the table in place, one
table version per chunk of rows (``LanceDataset.merge_insert`` on a key column). Each version is
atomic: readers see the table as it was or with one more chunk embedded, never a half-written
chunk. A kill loses at most the chunk in flight: a rerun finds the rows still missing and embeds
only them. Rows added to the table later (with the column null) are picked up by the next
backfill, and only they are encoded.

The encoding itself is :func:`dask_surge.encode` without an output (on the active Dask client, or
the scheduler given), so every encoder option applies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa

from .api import encode
from .errors import SurgeInputError
from .io.hashing import hash_column, text_hashes
from .io.store import OutputStore
from .io.tables import require
from .io.tables.locations import TableLocation

__all__ = ["BackfillResult", "backfill"]


@dataclass(frozen=True)
class BackfillResult:
    """What :func:`backfill` did: rows of the table, rows it encoded, table versions it made."""

    rows: int
    encoded: int
    versions: int
    column: str


def backfill(
    table: str | os.PathLike,
    text: str,
    *,
    key: str,
    column: str = "embedding",
    chunk_rows: int = 10_000,
    storage_options: dict | None = None,
    **options: Any,
) -> BackfillResult:
    """Embed ``table[text]`` into ``table[column]`` where it is missing or stale, in place.

    Parameters
    ----------
    table : str or path
        A Lance table (local path or ``s3://`` URL).
    text : str
        Its text column.
    key : str
        A column whose values identify rows uniquely (the write-back matches rows on it).
    column : str
        The embedding column to add or update; ``<column>_text_hash`` beside it records the hash of
        the text each embedding was made from.
    chunk_rows : int
        Rows embedded and written per table version.
    storage_options : dict, optional
        fsspec-style options of an ``s3://`` table.
    **options
        Options of :func:`dask_surge.encode` (``model``, ``normalize``, ``scheduler``...).

    Returns
    -------
    BackfillResult
    """
    lance = require("lance")
    where = TableLocation.of(OutputStore.open(table, storage_options))
    hash_col = f"{column}_text_hash"
    try:
        ds = lance.dataset(where.uri, storage_options=where.options)
    except (ValueError, OSError) as err:
        raise SurgeInputError(
            f"no Lance table at {where.url!r} ({err}). Fix: pass a Lance table's path."
        ) from err
    names = ds.schema.names
    for name, what in ((text, "text"), (key, "key")):
        if name not in names:
            raise SurgeInputError(
                f"the table {where.url!r} has no {what} column {name!r} (it has {names}). "
                f"Fix: pass {what}= one of its columns."
            )
    have = column in names and hash_col in names
    scan = ds.to_table(columns=[key, text, *([hash_col] if have else [])]).to_pandas()
    current = text_hashes(scan[text].fillna("").astype(object).to_numpy())
    current_bytes = hash_column(current).to_pylist()
    stale = (
        np.ones(len(scan), dtype=bool)
        if not have
        else np.array([h is None or h != c for h, c in zip(scan[hash_col], current_bytes)], dtype=bool)
    )
    stale &= scan[text].notna().to_numpy()
    todo = np.flatnonzero(stale)
    versions = 0
    for start in range(0, len(todo), chunk_rows):
        rows = todo[start : start + chunk_rows]
        part = pd.DataFrame({"text": scan[text].to_numpy()[rows]})
        got = encode(dd.from_pandas(part, npartitions=1), "text", **options).compute()
        got = got.sort_values("row")
        vectors = got["embedding"].to_numpy()
        dim = len(vectors[0])
        flat = np.concatenate([np.asarray(v) for v in vectors]) if len(vectors) else np.empty(0, np.float32)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(flat), dim)
        hashes = pa.array([current_bytes[i] for i in rows], pa.binary(16))
        ds = lance.dataset(where.uri, storage_options=where.options)
        if column not in ds.schema.names:
            ds.add_columns([pa.field(column, emb.type), pa.field(hash_col, pa.binary(16))])
            versions += 1
        keys = pa.array(scan[key].to_numpy()[rows], type=ds.schema.field(key).type)
        chunk = pa.table({key: keys, column: emb, hash_col: hashes})
        ds = lance.dataset(where.uri, storage_options=where.options)
        ds.merge_insert(key).when_matched_update_all().execute(chunk)
        versions += 1
    return BackfillResult(rows=len(scan), encoded=len(todo), versions=versions, column=column)
