"""Sparse (SPLADE) output: a row's vocabulary weights as two list columns, and back.

A sparse model gives each text one weight per vocabulary id, nearly all zero. The output
keeps the non-zeros in two columns that Arrow, Parquet readers and DuckDB read directly
(:mod:`dask_surge.io.layout`):

* ``indices``: ``list<int32>``, the vocabulary ids, ascending within a row;
* ``values``: ``list<float32>``, their weights, in the same order.

Pruning is optional and the same in every SuperBatch: ``threshold`` drops weights below it,
then ``top_k`` keeps a row's ``k`` largest (ties: the smaller id). :func:`to_csr` turns rows
back into a ``scipy.sparse.csr_matrix`` of ``(rows, vocab_size)``.

Examples
--------
>>> import numpy as np
>>> indices, values = sparse_arrays(np.array([[0.0, 2.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0]]))
>>> indices.to_pylist(), values.to_pylist()
([[1, 3], [0]], [[2.0, 1.0], [0.5]])
>>> to_csr(pa.table({"indices": indices, "values": values}), 4).toarray().tolist()
[[0.0, 2.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..config import check_argument
from ..errors import SurgeValueError
from .layout import INDICES, VALUES

__all__ = ["INDICES_TYPE", "VALUES_TYPE", "sparse_arrays", "check_pruning", "to_csr"]

#: the Arrow types of the two columns
INDICES_TYPE, VALUES_TYPE = pa.list_(pa.int32()), pa.list_(pa.float32())

_INT32_MAX = 2**31 - 1


def check_pruning(top_k: object = None, threshold: object = None) -> tuple[int | None, float | None]:
    """Validate the pruning of sparse rows by the ``sparse_top_k`` and ``sparse_threshold`` options' rules:
    ``top_k`` an int >= 1 or None, ``threshold`` a finite number or None.

    Examples
    --------
    >>> check_pruning(64, 0.1)
    (64, 0.1)
    >>> check_pruning(0)
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: sparse_top_k=0 must be a positive int ...
    """
    k: int | None = check_argument("sparse_top_k", top_k)
    t: float | None = check_argument("sparse_threshold", threshold)
    return k, (None if t is None else float(t))


def sparse_arrays(
    emb: Any, *, top_k: int | None = None, threshold: float | None = None, rows: int | None = None
) -> tuple[pa.ListArray, pa.ListArray]:
    """The ``indices`` and ``values`` columns of sparse model output.

    Parameters
    ----------
    emb
        The weights of ``n`` rows, one of: a torch sparse COO tensor ``(n, vocab)`` (what
        ``SparseEncoder.encode(..., convert_to_sparse_tensor=True)`` returns), a dense
        ``(n, vocab)`` array or torch tensor, a scipy sparse matrix, or a sequence of ``n``
        ``(ids, weights)`` pairs (one per row, in any order; an id given twice is summed).
        Exact zeros are never kept.
    top_k : int, optional
        Keep each row's ``top_k`` largest weights (ties: the smaller id).
    threshold : float, optional
        Drop weights below ``threshold`` (applied before ``top_k``).
    rows : int, optional
        Rows of the output: needed only for an empty sequence of pairs (else the input's).

    Returns
    -------
    (pyarrow.ListArray, pyarrow.ListArray)
        ``indices`` (``list<int32>``, ascending in each row) and ``values`` (``list<float32>``),
        sharing offsets; a row with no weight left is an empty list.

    Raises
    ------
    SurgeValueError
        A negative id, an id beyond int32, a non-2-D input, or bad pruning (:func:`check_pruning`).

    Examples
    --------
    >>> idx, val = sparse_arrays([([7, 2, 5], [0.5, 3.0, 0.5]), ([], [])], top_k=2)
    >>> idx.to_pylist(), val.to_pylist()
    ([[2, 5], []], [[3.0, 0.5], []])
    >>> sparse_arrays(np.array([[0.2, 0.05, 0.9]]), threshold=0.1)[0].to_pylist()
    [[0, 2]]
    >>> idx.type, val.type
    (ListType(list<item: int32>), ListType(list<item: float>))
    """
    top_k, threshold = check_pruning(top_k, threshold)
    n, r, c, v = _coo(emb, rows)
    keep = v != 0
    if threshold is not None:
        keep &= v >= threshold
    r, c, v = r[keep], c[keep], v[keep]
    if top_k is not None and len(v):
        order = np.lexsort((c, -v.astype(np.float64), r))  # each row's weights, largest first, then by id
        r, c, v = r[order], c[order], v[order]
        starts = np.searchsorted(r, r, side="left")
        keep = np.arange(len(r)) - starts < top_k
        r, c, v = r[keep], c[keep], v[keep]
    order = np.lexsort((c, r))
    r, c, v = r[order], c[order], v[order]
    if len(c) and (c.min() < 0 or c.max() > _INT32_MAX):
        bad = int(c.min()) if c.min() < 0 else int(c.max())
        raise SurgeValueError(
            f"a sparse row has vocabulary id {bad}: ids are stored as int32, from 0 to {_INT32_MAX}. Fix: pass "
            "the model's output as is (rows of vocabulary weights), not ids shifted or from another tokenizer."
        )
    if len(c) > _INT32_MAX:
        raise SurgeValueError(
            f"{len(c)} non-zero weights do not fit one list<int32> column (at most {_INT32_MAX}). "
            "Fix: encode fewer rows at a time (a smaller b_max), or prune with top_k / threshold."
        )
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(r, minlength=n), out=offsets[1:])
    offsets_array = pa.array(offsets, type=pa.int32())
    return (
        pa.ListArray.from_arrays(offsets_array, pa.array(c.astype(np.int32), type=pa.int32())),
        pa.ListArray.from_arrays(offsets_array, pa.array(v.astype(np.float32), type=pa.float32())),
    )


def _coo(emb: Any, rows: int | None) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """``(n, row ids, column ids, weights)`` of any input :func:`sparse_arrays` takes; duplicates summed."""
    if getattr(emb, "is_sparse", False):  # a torch sparse COO tensor (io/ never imports torch)
        emb = emb.detach().coalesce()
        ij = emb.indices().cpu().numpy()
        return (
            _check_2d(tuple(emb.shape)),
            ij[0].astype(np.int64),
            ij[1].astype(np.int64),
            emb.values().float().cpu().numpy(),
        )
    if hasattr(emb, "tocoo"):  # scipy.sparse
        coo = emb.tocoo()
        coo.sum_duplicates()
        return _check_2d(coo.shape), coo.row.astype(np.int64), coo.col.astype(np.int64), np.asarray(coo.data)
    if hasattr(emb, "detach"):  # a dense torch tensor
        emb = emb.detach().float().cpu().numpy()
    if isinstance(emb, np.ndarray):
        n = _check_2d(emb.shape)
        r, c = np.nonzero(emb)
        return n, r.astype(np.int64), c.astype(np.int64), emb[r, c]
    if isinstance(emb, Sequence):
        return _pairs(emb, rows)
    raise SurgeValueError(
        f"sparse model output of type {type(emb).__name__} is not one dask-surge reads: a torch sparse or dense "
        "tensor, a numpy array, a scipy sparse matrix, or (ids, weights) pairs per row. Fix: pass "
        "SparseEncoder.encode(texts, convert_to_sparse_tensor=True) as is."
    )


def _check_2d(shape: tuple[int, ...]) -> int:
    if len(shape) != 2:
        raise SurgeValueError(
            f"sparse model output has shape {shape}: it must be (rows, vocabulary) with one row per text. "
            "Fix: pass a list of texts to the model, not a single text."
        )
    return int(shape[0])


def _pairs(pairs: Sequence, rows: int | None) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    n = len(pairs) if rows is None or len(pairs) else rows
    ids, weights = [], []
    for i, (a, b) in enumerate(pairs):
        a, b = np.asarray(a, dtype=np.int64).reshape(-1), np.asarray(b).reshape(-1)
        if len(a) != len(b):
            raise SurgeValueError(
                f"sparse row {i} has {len(a)} ids and {len(b)} weights: each id needs its weight. Fix: pass "
                "(ids, weights) pairs of equal length."
            )
        ids.append(a)
        weights.append(b)
    r: np.ndarray = np.repeat(np.arange(len(ids), dtype=np.int64), [len(a) for a in ids])
    c: np.ndarray = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    v: np.ndarray = np.concatenate(weights).astype(np.float64) if weights else np.zeros(0)
    if len(c):  # sum an id given twice in a row, as a sparse tensor's coalesce does
        key = np.stack([r, c])
        uniq, inverse = np.unique(key, axis=1, return_inverse=True)
        v = np.bincount(inverse.reshape(-1), weights=v, minlength=uniq.shape[1])
        r, c = uniq[0], uniq[1]
    return n, r, c, v.astype(np.float32)


def _list_column(data: Any, name: str, arrow_type: pa.DataType) -> pa.ListArray:
    """Column ``name`` of an Arrow table or a pandas frame (object or ArrowDtype column), as one list array."""
    if isinstance(data, (pa.Table, pa.RecordBatch)):
        if name not in data.column_names:
            raise KeyError(name)
        col = data.column(name)
    else:
        if name not in data:
            raise KeyError(name)
        col = pa.array(data[name], type=arrow_type)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col.cast(arrow_type)


def to_csr(data: Any, vocab_size: int):
    """Sparse rows as a ``scipy.sparse.csr_matrix`` of shape ``(rows, vocab_size)``, float32.

    Parameters
    ----------
    data : pyarrow.Table, pyarrow.RecordBatch or pandas.DataFrame
        Rows with ``indices`` and ``values`` columns: a partition of
        :func:`dask_surge.read_embeddings` or a table read from a part file. A null row is empty.
    vocab_size : int
        Columns of the matrix: the model's vocabulary size (its embedding dimension).

    Returns
    -------
    scipy.sparse.csr_matrix

    Examples
    --------
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"indices": [[0, 3], []], "values": [[1.5, 2.0], []]})
    >>> m = to_csr(frame, 5)
    >>> m.shape, m.toarray().tolist()
    ((2, 5), [[1.5, 0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    """
    try:
        import scipy.sparse
    except ImportError as e:  # pragma: no cover - scipy comes with sentence-transformers
        raise ImportError("to_csr needs scipy, which is not installed. Fix: pip install scipy") from e
    try:
        indices, values = _list_column(data, INDICES, INDICES_TYPE), _list_column(data, VALUES, VALUES_TYPE)
    except KeyError as e:
        raise SurgeValueError(
            f"to_csr reads the '{INDICES}' and '{VALUES}' columns of a sparse output, and the data has no "
            f"{e.args[0]!r} column. Fix: read an output written by a sparse model, with both columns "
            f"(read_embeddings(path, columns=['{INDICES}', '{VALUES}']))."
        ) from None
    lengths = pc.fill_null(pc.list_value_length(indices), 0).to_numpy(zero_copy_only=False)
    if not np.array_equal(
        lengths, pc.fill_null(pc.list_value_length(values), 0).to_numpy(zero_copy_only=False)
    ):
        raise SurgeValueError(
            f"the '{INDICES}' and '{VALUES}' lists differ in length in some row: each id needs its weight. "
            "Fix: read both columns from the same rows of one output."
        )
    ids = indices.flatten().to_numpy(zero_copy_only=False)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise SurgeValueError(
            f"vocabulary id {int(ids.max()) if ids.max() >= vocab_size else int(ids.min())} is outside "
            f"vocab_size={vocab_size} (ids run from 0 to vocab_size - 1). Fix: pass the model's vocabulary size "
            "(its embedding dimension)."
        )
    indptr = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    weights = values.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return scipy.sparse.csr_matrix((weights, ids, indptr), shape=(len(lengths), int(vocab_size)))
