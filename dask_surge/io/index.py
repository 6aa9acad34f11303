"""A searchable index over an output: Lance's own ANN index on a Lance table, FAISS beside Parquet.

:func:`build_index` builds it once a run has completed; :func:`open_index` opens it with one
call and :meth:`SurgeIndex.search` returns the ``k`` nearest rows' keys (``partition``,
``row``) and distances. :func:`recall_at_k` measures an index against exact search on the
same vectors (the figure ``docs/performance.md`` states; it is measured, never assumed).

* **Lance table** (``format="lance"``): the table's own vector index on ``embedding``
  (``IVF_PQ`` from 5,000 rows, with about ``sqrt(rows)`` partitions and ``dim / 8`` (or
  ``/ 4``, ``/ 2``, ``/ 1``) sub-vectors, what Lance's docs recommend; ``IVF_FLAT`` below), a new
  table version that readers (LanceDB, ``lance.dataset(...).to_table(nearest=...)``) use.
* **Parquet output**: a FAISS HNSW index (``HNSW32``, ``efSearch`` 64; no training) of the
  committed rows, written beside the output at ``<output>.faiss/``: ``index.faiss``,
  ``keys.parquet`` (the ``partition`` and ``row`` of each vector, in index order) and
  ``index.json`` (the run, the metric, the count). cuVS is not used (no GPU index here).
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from ..errors import SurgeInputError
from .readers import read_embeddings
from .store import OutputStore
from .tables import require

__all__ = ["SurgeIndex", "build_index", "open_index", "recall_at_k", "exact_neighbours"]

Metric = Literal["cosine", "l2", "dot"]


def _is_lance(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "_versions"))


def _matrix(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.stack(list(values)).astype(np.float32))


def _normalized(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1, norms)


def lance_index_params(rows: int, dim: int) -> dict:
    """What :func:`build_index` asks Lance for, for ``rows`` vectors of ``dim`` dimensions.

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


def build_index(output: str | os.PathLike, *, metric: Metric = "cosine", path: str | None = None) -> dict:
    """Build the searchable index of a completed output; returns what was built.

    Parameters
    ----------
    output : str or path
        A Lance table written with ``format="lance"``, or a Parquet output directory.
    metric : {"cosine", "l2", "dot"}
        The distance the index ranks by.
    path : str, optional
        Parquet outputs: where the FAISS index goes (default ``<output>.faiss``).

    Returns
    -------
    dict
        ``kind`` (``"lance"`` or ``"faiss"``), ``path``, ``rows``, and the index's parameters.
    """
    output = os.fspath(output).rstrip("/")
    if metric not in ("cosine", "l2", "dot"):
        raise SurgeInputError(
            f"metric={metric!r} is not a metric of build_index. Fix: choose cosine, l2 or dot."
        )
    if _is_lance(output):
        lance = require("lance")
        ds = lance.dataset(output)
        rows, dim = ds.count_rows(), ds.schema.field("embedding").type.list_size
        params = lance_index_params(rows, dim)
        ds.create_index("embedding", metric=metric, replace=True, **params)
        return {"kind": "lance", "path": output, "rows": rows, "metric": metric, **params}
    faiss = require("faiss")
    frame = read_embeddings(output, columns=["partition", "row", "embedding"]).compute()
    x = _matrix(frame["embedding"])
    if metric == "cosine":
        x = _normalized(x)
    index = faiss.IndexHNSWFlat(
        x.shape[1], 32, faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    )
    index.hnsw.efSearch = 64
    index.add(x)
    where = path or f"{output}.faiss"
    store = OutputStore.open(where)
    store.makedirs(store.root)
    keys = io.BytesIO()
    frame[["partition", "row"]].reset_index(drop=True).to_parquet(keys)
    info = {
        "kind": "faiss",
        "path": where,
        "rows": len(x),
        "metric": metric,
        "index": "HNSW32",
        "ef_search": 64,
        "output": output,
    }
    # each file atomic; index.json last: an index is there once its description is
    store.write(f"{store.root}/index.faiss", faiss.serialize_index(index).tobytes())
    store.write(f"{store.root}/keys.parquet", keys.getvalue())
    store.write(f"{store.root}/index.json", json.dumps(info, sort_keys=True).encode())
    return info


@dataclass
class SurgeIndex:
    """An opened index (:func:`open_index`)."""

    kind: str
    path: str
    metric: str
    _index: Any
    _keys: pd.DataFrame | None = None

    def search(self, queries: Any, k: int = 10) -> tuple[np.ndarray, pd.DataFrame]:
        """The ``k`` nearest rows of each query: ``(distances (q, k), keys)``; ``keys`` holds
        ``query``, ``rank``, ``partition`` and ``row``."""
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        if self.kind == "faiss":
            if self.metric == "cosine":
                q = _normalized(q)
            dist, ids = self._index.search(np.ascontiguousarray(q), k)
            assert self._keys is not None
            keys = self._keys.iloc[ids.ravel()].reset_index(drop=True)
            keys.insert(0, "rank", np.tile(np.arange(k), len(q)))
            keys.insert(0, "query", np.repeat(np.arange(len(q)), k))
            return dist, keys
        out, dists = [], []
        for i, v in enumerate(q):
            t = self._index.to_table(
                columns=["partition", "row"],
                nearest={
                    "column": "embedding",
                    "q": v,
                    "k": k,
                    "metric": self.metric,
                    "nprobes": 20,
                    "refine_factor": 10,
                },
            ).to_pandas()
            dists.append(t.pop("_distance").to_numpy())
            t.insert(0, "rank", np.arange(len(t)))
            t.insert(0, "query", i)
            out.append(t)
        return np.stack(dists), pd.concat(out, ignore_index=True)


def _lance_metric(index: Any) -> str:
    """The metric a Lance vector index ranks by (``describe_indices``' ``details``); cosine where the
    installed Lance does not say."""
    details = index.get("details") if isinstance(index, dict) else getattr(index, "details", None)
    metric = str(details.get("metric_type", "cosine")).lower() if isinstance(details, dict) else "cosine"
    return metric if metric in ("cosine", "l2", "dot") else "cosine"


def open_index(output: str | os.PathLike, *, path: str | None = None) -> SurgeIndex:
    """Open the index :func:`build_index` built for ``output`` (one call)."""
    output = os.fspath(output).rstrip("/")
    if _is_lance(output):
        lance = require("lance")
        ds = lance.dataset(output)
        indices = ds.describe_indices() if hasattr(ds, "describe_indices") else ds.list_indices()
        if not indices:
            raise SurgeInputError(
                f"the Lance table {output!r} has no vector index. Fix: build_index({output!r})."
            )
        return SurgeIndex("lance", output, _lance_metric(indices[0]), ds)
    faiss = require("faiss")
    where = path or f"{output}.faiss"
    try:
        with open(os.path.join(where, "index.json")) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise SurgeInputError(
            f"no index at {where!r}. Fix: dask_surge.io.index.build_index({output!r})."
        ) from None
    return SurgeIndex(
        "faiss",
        where,
        info["metric"],
        faiss.read_index(os.path.join(where, "index.faiss")),
        pd.read_parquet(os.path.join(where, "keys.parquet")),
    )


def exact_neighbours(
    vectors: np.ndarray, queries: np.ndarray, k: int, metric: Metric = "cosine"
) -> np.ndarray:
    """Row numbers of the exact ``k`` nearest ``vectors`` of each query (brute force)."""
    x, q = np.asarray(vectors, np.float32), np.asarray(queries, np.float32)
    if metric == "cosine":
        x, q = _normalized(x), _normalized(q)
    scores = -(q @ x.T) if metric != "l2" else ((q**2).sum(1)[:, None] - 2 * q @ x.T + (x**2).sum(1)[None])
    return np.argsort(scores, axis=1, kind="stable")[:, :k]


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean fraction of the exact ``k`` neighbours among the ``k`` found (row numbers, one row per query).

    Examples
    --------
    >>> recall_at_k(np.array([[1, 2], [3, 4]]), np.array([[2, 1], [3, 5]]))
    0.75
    """
    k = exact.shape[1]
    return float(np.mean([len(set(f[:k]) & set(e)) / k for f, e in zip(found, exact)]))
