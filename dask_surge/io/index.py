"""A searchable index over an output: Lance's own ANN index on a Lance table, FAISS beside the others.

:func:`build_index` builds it once a run has completed (``encode(..., build_index=True)`` does it for
you); :func:`open_index` opens it with one call and :meth:`SurgeIndex.search` returns the ``k``
nearest rows' keys (``partition``, ``row``), their distances and, asked for, their columns. Every
index returns the same distance, Lance's, smaller is nearer (:func:`exact_distances`: cosine
1 - cosine similarity, l2 the squared Euclidean distance, dot 1 - inner product), so a threshold
means one thing on every output. :func:`recall_at_k` measures an index
against exact search on the same vectors (the figure ``docs/performance.md`` states; it is
measured, never assumed). Every location is reached through the output's
:class:`~dask_surge.io.store.OutputStore` (a local path, ``memory://`` or ``s3://`` with
``storage_options``), never as a local path.

* **Lance table** (``format="lance"``, found by its ``_versions/``): the table's own vector
  index on ``embedding`` (``IVF_PQ`` from 5,000 rows, with about ``sqrt(rows)`` partitions and
  ``dim / 8`` (or ``/ 4``, ``/ 2``, ``/ 1``) sub-vectors, what Lance's docs recommend;
  ``IVF_FLAT`` below), a new table version that readers (LanceDB,
  ``lance.dataset(...).to_table(nearest=...)``) use. It never goes stale: rows committed after it
  are searched exhaustively by Lance (slower, not wrong) until it is built again.
* **pgvector table** (``format="pgvector"``): PostgreSQL's own HNSW index (``CREATE INDEX
  CONCURRENTLY``, pgvector's ``vector_cosine_ops``, ``vector_l2_ops`` or ``vector_ip_ops``), searched
  through SQL; pgvector's ``<->`` and ``<#>`` are returned as the distances below.
* **Parquet output**, **Delta** and **Iceberg tables**: a FAISS HNSW index (``HNSW32``,
  ``efSearch`` 64; no training) of the committed rows (a Parquet output's read with
  :func:`~dask_surge.io.readers.read_embeddings`, a table's with its table library), written
  beside the output at ``<output>.faiss/`` through the store: ``index-<id>.faiss``,
  ``keys-<id>.parquet`` (the ``partition`` and ``row``, and ``chunk`` in chunk mode, of each
  vector, in index order) and
  ``index.json``, written last, which names those two files, the metric, the row count and what
  the index was built from: the output's run id and its committed rows (and a table's version).
  :func:`open_index` compares that with the output as it is now and refuses an index older than
  it (the output overwritten, resumed with more rows, or appended to): its keys would name rows
  that are not the output's. Cosine is an inner-product graph of unit vectors, l2 an L2 graph, and
  dot an L2 graph of the vectors with one more dimension (``max_norm`` in ``index.json``; an HNSW
  graph of inner products misses neighbours); each hit's distance is then computed exactly from its
  stored vector, as Lance refines its own.

cuVS is not used: nothing here has a GPU to test it on.
"""

from __future__ import annotations

import io
import json
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from ..errors import SurgeInputError
from ..families import DENSE, family_of_run
from .manifest import current_run
from .readers import read_embeddings
from .store import OutputStore
from .tables import detect_output, open_output, output_store, require
from .tables.lance import lance_index_params

__all__ = [
    "METRICS",
    "SurgeIndex",
    "build_index",
    "open_index",
    "index_for",
    "recall_at_k",
    "exact_neighbours",
    "exact_distances",
    "lance_index_params",
]

Metric = Literal["cosine", "l2", "dot"]
#: the distances an index ranks by
METRICS: tuple[str, ...] = ("cosine", "l2", "dot")
#: the FAISS index beside an output: ``<output>`` + this
FAISS_SUFFIX = ".faiss"
#: the description of a FAISS index, written last
INDEX_JSON = "index.json"


def _matrix(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.stack(list(values)).astype(np.float32))


def _normalized(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1, norms)


def _check_metric(metric: Any) -> None:
    if metric not in METRICS:
        raise SurgeInputError(
            f"metric={metric!r} is not a metric of build_index. Fix: choose cosine, l2 or dot."
        )


def _stamp(store: OutputStore, out: Any) -> dict:
    """What an index of the output at ``store`` was built from, and what invalidates it: the
    current run's id and committed rows (rows of its files: one per window with ``long_texts="chunk"``),
    and a table's own version (:meth:`table_version`: Delta's version, Iceberg's current snapshot id). An output with no dask-surge run (a table written by another
    tool) stamps ``run`` None."""
    manifest = current_run(store)
    stamp: dict[str, Any] = {"run": None, "rows_committed": None}
    if manifest is not None:
        family = family_of_run(manifest.fingerprint)
        if family != DENSE:
            raise SurgeInputError(
                f"{store.location!r} holds a {family} output (no 'embedding' column of one vector per row); "
                "a vector index is built over dense embeddings. Fix: build the index of a dense model's output."
            )
        committed = manifest.committed().values()
        stamp = {
            "run": manifest.run_id,
            "rows_committed": sum(r.output_rows or r.rows for r in committed),
            "complete": manifest.completion() is not None,
        }
    if out.batched:  # the table's own version (Delta's, Iceberg's snapshot id): any change moves it
        stamp["table_version"] = out.table_version()
    return stamp


def _faiss_store(output: str, path: str | None, storage_options: dict | None) -> OutputStore:
    return OutputStore.open(path or f"{output}{FAISS_SUFFIX}", storage_options)


def build_index(
    output: str | os.PathLike,
    *,
    metric: Metric = "cosine",
    path: str | None = None,
    storage_options: dict | None = None,
) -> dict:
    """Build the searchable index of a completed output; returns what was built.

    Parameters
    ----------
    output : str or path
        A Lance table written with ``format="lance"``, a Parquet output directory, or a Delta or
        Iceberg table output (for Iceberg, with the ``surge.iceberg-catalog`` it was written with).
    metric : {"cosine", "l2", "dot"}
        The distance the index ranks by.
    path : str, optional
        Outputs other than Lance: where the FAISS index goes (default ``<output>.faiss``).
    storage_options : dict, optional
        fsspec options of ``output`` (and of ``path``), as :func:`dask_surge.encode` takes them.

    Returns
    -------
    dict
        ``kind`` (``"lance"`` or ``"faiss"``), ``path``, ``rows``, ``metric``, the index's
        parameters, and what it was built from (``run``, ``rows_committed``).

    Raises
    ------
    SurgeInputError
        For a metric that is not one, an output with no committed rows or no dense embeddings, or an
        output that changed while the index was built.
    """
    _check_metric(metric)
    output = os.fspath(output).rstrip("/")
    store = output_store(output, storage_options)  # a database's: its runs' state directory
    out = open_output(detect_output(store), store)
    if out.native_index:  # the format's own index, inside the table
        stamp = _stamp(store, out)
        built = out.build_native_index(metric)
        return {"kind": out.name, "path": output, "metric": metric, **built, **stamp}
    faiss = require("faiss")
    table = out if out.batched else None
    stamp = _stamp(store, out)
    if stamp["run"] is None:
        raise SurgeInputError(
            f"{output!r} holds no dask-surge run, so nothing says which rows an index of it would cover. "
            "Fix: pass the output of ddf.surge.encode(..., output=...)."
        )
    if table is None:
        key = [c for c in KEY if c in out.columns()]
        frame = read_embeddings(
            output, columns=[*key, "embedding"], storage_options=storage_options
        ).compute()
    else:
        read = table.read()
        key = [c for c in KEY if c in read.schema.names]
        frame = read.select([*key, "embedding"]).to_pandas()
    # a Parquet output holds exactly its run's committed rows; a table may also hold other writers' rows
    mismatch = table is None and len(frame) != stamp["rows_committed"]
    if mismatch or _stamp(store, out) != stamp:
        raise SurgeInputError(
            f"{output!r} changed while its index was built (a run is writing there: it held "
            f"{stamp['rows_committed']:,} committed rows, {len(frame):,} were read). Fix: build_index({output!r}) "
            "again once the run completes."
        )
    x = _matrix(frame["embedding"])
    reduction: dict[str, Any] = {}
    if metric == "cosine":  # unit vectors: the inner product is the cosine similarity
        x = _normalized(x)
    elif metric == "dot":  # searched by L2 (an HNSW graph over inner products misses neighbours)
        x, reduction["max_norm"] = _dot_as_l2(x)
    index = faiss.IndexHNSWFlat(
        x.shape[1], 32, faiss.METRIC_INNER_PRODUCT if metric == "cosine" else faiss.METRIC_L2
    )
    index.hnsw.efSearch = 64
    index.add(x)
    where = _faiss_store(output, path, storage_options)
    where.makedirs(where.root)
    keys = io.BytesIO()
    frame[key].reset_index(drop=True).to_parquet(keys)
    token = uuid.uuid4().hex[:12]
    info = {
        "kind": "faiss",
        "path": where.location,
        "rows": len(x),
        "metric": metric,
        "index": "HNSW32",
        "ef_search": 64,
        **reduction,
        "output": output,
        "output_kind": out.name,
        "index_file": f"index-{token}.faiss",
        "keys_file": f"keys-{token}.parquet",
        **stamp,
    }
    old = _read_info(where)
    # the data files under new names, index.json (atomic) last: it names them, so an index is there whole
    # or not at all, and a rebuild killed half-way leaves the previous one as it was
    where.write(f"{where.root}/{info['index_file']}", faiss.serialize_index(index).tobytes())
    where.write(f"{where.root}/{info['keys_file']}", keys.getvalue())
    where.write(f"{where.root}/{INDEX_JSON}", json.dumps(info, sort_keys=True).encode())
    for name in (old or {}).get("index_file"), (old or {}).get("keys_file"):
        if name and name not in (info["index_file"], info["keys_file"]):
            where.unlink(f"{where.root}/{name}")
    return info


def _read_info(where: OutputStore) -> dict | None:
    try:
        return json.loads(where.read(f"{where.root}/{INDEX_JSON}"))
    except (FileNotFoundError, NotADirectoryError):
        return None


#: the columns that name a row of an output: ``chunk`` too with ``long_texts="chunk"``
KEY = ("partition", "row", "chunk")


def _dot_as_l2(x: np.ndarray) -> tuple[np.ndarray, float]:
    """``x`` with one more dimension, ``sqrt(M**2 - |x|**2)`` (``M`` the largest norm, returned): the
    nearest of them by L2 to a query with a 0 there are its largest inner products, so a dot index is
    an L2 graph (Bachrach et al., 2014), which HNSW searches as well as any other."""
    sq = (x.astype(np.float64) ** 2).sum(1)
    top = float(sq.max()) if len(sq) else 0.0
    extra = np.sqrt(np.maximum(top - sq, 0)).astype(np.float32)[:, None]
    return np.ascontiguousarray(np.hstack([x, extra])), math.sqrt(top)


@dataclass
class SurgeIndex:
    """An opened index (:func:`open_index`)."""

    kind: str
    path: str
    metric: str
    _index: Any
    _keys: pd.DataFrame | None = None
    #: what :func:`build_index` recorded (a FAISS index), or the Lance index's description
    info: dict | None = None
    #: the output the index is of (an :class:`~dask_surge.io.tables.Output`: its rows' columns are read from it)
    _output: Any = None

    def search(
        self, queries: Any, k: int = 10, *, columns: list[str] | bool | None = None
    ) -> tuple[np.ndarray, pd.DataFrame]:
        """The ``k`` nearest rows of each query, nearest first.

        Every index kind (Lance's own, FAISS beside a Parquet, Delta or Iceberg output, on a local
        path, ``memory://`` or ``s3://``) returns the same distance for the metric the index was
        built with (:attr:`metric`), **smaller is nearer**, as Lance returns it
        (:func:`exact_distances` computes it exactly):

        * ``cosine``: 1 - cosine similarity, in [0, 2] (pgvector's ``<=>``);
        * ``l2``: the **squared** Euclidean distance (FAISS's and Lance's; its square root is
          the Euclidean distance, pgvector's ``<->``);
        * ``dot``: 1 - inner product (Lance's; pgvector's ``<#>`` is the negative inner
          product, this minus 1), negative for close vectors of length above 1.

        Parameters
        ----------
        queries : array-like
            One query vector, or a ``(q, dim)`` matrix of them.
        k : int
            How many rows each query finds.
        columns : list of str, True or None
            The output's columns to add to each hit, read from the output by the hit's key
            (``partition``, ``row``; ``chunk`` too in chunk mode). Can be a list of column names,
            True for every column but ``embedding`` (the ``keep`` columns, ``text_hash``, ...), or
            None to return the keys and distances only.

        Returns
        -------
        distances : numpy.ndarray
            ``(q, k)``, rising along each row; ``inf`` where a query found fewer than ``k`` rows
            (an output of fewer rows).
        hits : pandas.DataFrame
            One row per hit, in ``query`` then ``rank`` order: ``query``, ``rank``, ``partition``,
            ``row`` (``chunk``), ``distance`` (the same as ``distances``), then ``columns``.

        Raises
        ------
        SurgeInputError
            When ``columns`` names a column the output does not have.
        """
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        wanted = self._columns(columns)
        if self.kind == "faiss":
            dist, ids = self._faiss_search(q, k)
            assert self._keys is not None
            hit = ids.ravel() >= 0
            keys = self._keys.iloc[ids.ravel()[hit]].reset_index(drop=True)
            keys.insert(0, "rank", np.tile(np.arange(k), len(q))[hit])
            keys.insert(0, "query", np.repeat(np.arange(len(q)), k)[hit])
            keys["distance"] = dist.ravel()[hit]
            if wanted:
                keys = self._with_columns(keys, wanted)
            return dist, keys
        key = [c for c in KEY if c in self._output.columns()]
        out, dists = [], np.full((len(q), k), np.inf)
        for i, v in enumerate(q):
            t = self._output.nearest(v, k, self.metric, [*key, *(c for c in wanted if c not in key)])
            d = t.pop("_distance").to_numpy(np.float64)
            dists[i, : len(d)] = d
            t.insert(0, "rank", np.arange(len(t)))
            t.insert(0, "query", i)
            t.insert(2 + len(key), "distance", d)
            out.append(t)
        return dists, pd.concat(out, ignore_index=True)

    def _faiss_search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The FAISS index's ``k`` nearest ids of each query, with their exact distances (the hits'
        stored vectors against the query, as Lance refines its own), nearest first; -1 and inf past
        the rows there are."""
        stored = q
        if self.metric == "cosine":
            q = stored = _normalized(q)
        elif self.metric == "dot" and "max_norm" in (self.info or {}):  # an L2 graph: the query with a 0
            q = np.hstack([q, np.zeros((len(q), 1), np.float32)])
        _, ids = self._index.search(np.ascontiguousarray(q), k)
        found = ids >= 0
        vectors = self._index.reconstruct_batch(np.where(found, ids, 0).ravel()).reshape(len(q), k, -1)
        vectors = vectors[..., : stored.shape[1]].astype(np.float64)
        if self.metric == "l2":
            dist = ((vectors - stored.astype(np.float64)[:, None, :]) ** 2).sum(-1)
        else:
            dist = 1 - np.einsum("qkd,qd->qk", vectors, stored.astype(np.float64))
        dist = np.where(found, dist, np.inf)
        order = np.argsort(dist, axis=1, kind="stable")
        return np.take_along_axis(dist, order, 1), np.take_along_axis(ids, order, 1)

    def _columns(self, columns: list[str] | bool | None) -> list[str]:
        """The column names ``columns`` asks for (checked against the output's)."""
        if columns is None or columns is False:
            return []
        names = self._output.columns()
        if columns is True:
            return [c for c in names if c not in KEY and c != "embedding"]
        wanted = [columns] if isinstance(columns, str) else list(columns)
        missing = [c for c in wanted if c not in names]
        if missing:
            raise SurgeInputError(
                f"columns={missing!r}: the output has no such column. Fix: choose among {names}, or pass "
                "columns=True for all of them but embedding."
            )
        return wanted

    def _with_columns(self, keys: pd.DataFrame, wanted: list[str]) -> pd.DataFrame:
        """``keys`` with the ``wanted`` columns of the rows they name, read from the output."""
        assert self._output is not None
        on = [c for c in KEY if c in keys.columns]
        extra = [c for c in wanted if c not in on]
        rows = self._output.read_rows(keys[on].drop_duplicates(), on, extra)
        return keys.merge(rows.drop_duplicates(on), on=on, how="left")


def open_index(
    output: str | os.PathLike, *, path: str | None = None, storage_options: dict | None = None
) -> SurgeIndex:
    """Open the index :func:`build_index` built for ``output`` (one call).

    Parameters
    ----------
    output : str or path
        The output the index was built for.
    path : str, optional
        Where the FAISS index is, when it was built with ``path=``.
    storage_options : dict, optional
        fsspec options of ``output`` (and of ``path``).

    Raises
    ------
    SurgeInputError
        When there is no index, or the FAISS index is older than the output (built from another
        run, or from fewer committed rows, or from another table version): it would return keys of
        rows that are not the output's.
    """
    output = os.fspath(output).rstrip("/")
    store = output_store(output, storage_options)  # a database's: its runs' state directory
    out = open_output(detect_output(store), store)
    if out.native_index:  # the format's own index, inside the table
        found = out.describe_native_index()
        if found is None:
            raise SurgeInputError(
                f"the {out.name} table {output!r} has no vector index. Fix: build_index({output!r})."
            )
        metric, described = found
        return SurgeIndex(out.name, output, metric, None, info=described, _output=out)
    faiss = require("faiss")
    where = _faiss_store(output, path, storage_options)
    info = _read_info(where)
    if info is None:
        raise SurgeInputError(
            f"no index at {where.location!r}. Fix: dask_surge.io.index.build_index({output!r})."
        )
    now = _stamp(store, out)
    built = {k: info.get(k) for k in now}
    if built != now:
        raise SurgeInputError(
            f"the index at {where.location!r} is older than the output {output!r}: it was built from "
            f"{_said(built)}, the output now holds {_said(now)} (overwritten, resumed or appended to since), so "
            f"its keys would not name the output's rows. Fix: build_index({output!r}) again "
            "(or encode(..., build_index=True))."
        )
    index = faiss.deserialize_index(np.frombuffer(where.read(f"{where.root}/{info['index_file']}"), np.uint8))
    keys = pd.read_parquet(io.BytesIO(where.read(f"{where.root}/{info['keys_file']}")))
    if index.ntotal != info["rows"] or len(keys) != info["rows"]:
        raise SurgeInputError(
            f"the index at {where.location!r} is damaged: index.json says {info['rows']:,} rows, its index "
            f"holds {index.ntotal:,} and its keys {len(keys):,}. Fix: build_index({output!r}) again."
        )
    return SurgeIndex("faiss", where.location, info["metric"], index, keys, info, _output=out)


def _said(stamp: dict) -> str:
    words = f"run {stamp.get('run')} with {stamp.get('rows_committed') or 0:,} committed rows"
    return words + (f" at table version {stamp['table_version']}" if "table_version" in stamp else "")


def index_for(
    output: str | os.PathLike, metric: Metric = "cosine", *, storage_options: dict | None = None
) -> dict:
    """The index of ``output`` with ``metric``: the one there when it is up to date, else a new one
    (:func:`build_index`). What :func:`dask_surge.encode` calls with ``build_index=...``.

    Returns
    -------
    dict
        :func:`build_index`'s description, with ``built`` False when the index there was kept.
    """
    _check_metric(metric)
    try:
        found = open_index(output, storage_options=storage_options)
    except SurgeInputError:
        found = None
    if found is not None and found.metric == metric:
        if found.kind == "faiss" and found.info is not None:
            return {**found.info, "built": False}
        if found.info is not None and found.info.get("rows_indexed") == found.info.get("rows"):
            return {"kind": found.kind, "path": found.path, "metric": metric, **found.info, "built": False}
    return {**build_index(output, metric=metric, storage_options=storage_options), "built": True}


def exact_distances(vectors: Any, queries: Any, metric: Metric = "cosine") -> np.ndarray:
    """The distance of each query to each vector, ``(queries, vectors)``, as :meth:`SurgeIndex.search`
    returns it: ``cosine`` 1 - cosine similarity, ``l2`` the squared Euclidean distance, ``dot``
    1 - inner product (what Lance returns for each; smaller is nearer).

    Examples
    --------
    >>> v, q = np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[3.0, 4.0]])
    >>> exact_distances(v, q, "cosine").round(3).tolist(), exact_distances(v, q, "l2").tolist()
    ([[0.4, 0.2]], [[20.0, 13.0]])
    >>> exact_distances(v, q, "dot").tolist()
    [[-2.0, -7.0]]
    """
    _check_metric(metric)
    x, q = np.atleast_2d(np.asarray(vectors, np.float64)), np.atleast_2d(np.asarray(queries, np.float64))
    if metric == "l2":
        return np.maximum((q**2).sum(1)[:, None] - 2 * q @ x.T + (x**2).sum(1)[None], 0)
    if metric == "cosine":
        x, q = _normalized(x), _normalized(q)
    return 1 - q @ x.T


def exact_neighbours(
    vectors: np.ndarray, queries: np.ndarray, k: int, metric: Metric = "cosine"
) -> np.ndarray:
    """Row numbers of the exact ``k`` nearest ``vectors`` of each query (brute force)."""
    return np.argsort(exact_distances(vectors, queries, metric), axis=1, kind="stable")[:, :k]


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean fraction of the exact ``k`` neighbours among the ``k`` found (row numbers, one row per query).

    Examples
    --------
    >>> recall_at_k(np.array([[1, 2], [3, 4]]), np.array([[2, 1], [3, 5]]))
    0.75
    """
    k = exact.shape[1]
    return float(np.mean([len(set(f[:k]) & set(e)) / k for f, e in zip(found, exact)]))
