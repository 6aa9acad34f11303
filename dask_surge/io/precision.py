"""Stored precision of embeddings: float32, float16, int8 and binary, and Matryoshka truncation.

Every SuperBatch is quantized with the *same* fixed rule, so embeddings written
by different SuperBatches (or different runs) stay comparable. Rules that
calibrate ranges per batch (as ``sentence_transformers.quantize_embeddings``
does for ``int8`` by default) would give each SuperBatch its own scale.

* ``float32`` / ``float16``: the values, rounded to the type.
* ``int8``: ``round(127 x)`` of unit vectors (every component is in [-1, 1]),
  so it needs ``normalize=True``. Dot products of int8 vectors divided by
  ``127**2`` approximate cosine similarity.
* ``binary``: one bit per dimension, ``x > 0``, packed big-endian into
  ``ceil(d / 8)`` bytes (``numpy.packbits``; the same bits as
  sentence-transformers' ``"ubinary"``). Hamming distance ranks neighbours.

``truncate_dim=k`` keeps the first ``k`` dimensions (Matryoshka models are
trained for it) and re-normalizes when ``normalize=True``, as
``SentenceTransformer.encode(..., truncate_dim=k)`` does.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..errors import SurgeValueError

__all__ = [
    "PRECISIONS",
    "check_precision",
    "check_truncate_dim",
    "quantize",
    "stored_dimension",
    "truncate",
    "to_float",
]

#: precision -> (numpy dtype, Arrow value type)
PRECISIONS = {
    "float32": (np.float32, pa.float32()),
    "float16": (np.float16, pa.float16()),
    "int8": (np.int8, pa.int8()),
    "binary": (np.uint8, pa.uint8()),
}


def check_precision(precision: object, normalize: bool) -> str:
    """Validate ``precision`` against the rule above.

    Examples
    --------
    >>> check_precision("int8", normalize=True)
    'int8'
    """
    if precision not in PRECISIONS:
        raise SurgeValueError(
            f"precision={precision!r} is not supported: embeddings are stored as one of "
            f"{sorted(PRECISIONS)}. Fix: pass precision='float32' (default), 'float16', 'int8' or 'binary'."
        )
    if precision == "int8" and not normalize:
        raise SurgeValueError(
            "precision='int8' stores round(127 x) of unit vectors, one fixed scale for every SuperBatch, "
            "so it needs normalized embeddings. Fix: pass normalize=True with precision='int8' "
            "(or use 'float16'/'binary')."
        )
    return str(precision)


def check_truncate_dim(truncate_dim: object, dimension: int) -> int | None:
    """Validate ``truncate_dim`` (``None`` or ``1 <= k <= dimension``).

    Examples
    --------
    >>> check_truncate_dim(128, 384), check_truncate_dim(None, 384)
    (128, None)
    """
    if truncate_dim is None:
        return None
    if (
        isinstance(truncate_dim, bool)
        or not isinstance(truncate_dim, (int, np.integer))
        or not 1 <= truncate_dim <= dimension
    ):
        raise SurgeValueError(
            f"truncate_dim={truncate_dim!r} must be an int from 1 to the model's dimension {dimension}: it "
            f"keeps the first k dimensions. Fix: pass e.g. truncate_dim={max(1, dimension // 2)}, or None."
        )
    return int(truncate_dim)


def stored_dimension(dimension: int, precision: str) -> int:
    """Values per stored embedding: ``d``, or ``ceil(d / 8)`` bytes for ``binary``.

    Examples
    --------
    >>> stored_dimension(384, "binary"), stored_dimension(384, "int8")
    (48, 384)
    """
    return -(-dimension // 8) if precision == "binary" else dimension


def truncate(emb: np.ndarray, truncate_dim: int | None, normalize: bool) -> np.ndarray:
    """Keep the first ``truncate_dim`` dimensions, re-normalized when ``normalize``.

    Examples
    --------
    >>> truncate(np.array([[3.0, 4.0, 12.0]]), 2, normalize=True).tolist()
    [[0.6, 0.8]]
    """
    if truncate_dim is None:
        return emb
    emb = emb[:, :truncate_dim]
    if normalize:  # also when nothing was cut: the encoder was asked not to normalize
        norms = np.linalg.norm(emb, axis=1, keepdims=True)
        emb = emb / np.where(norms > 0, norms, 1.0)
    return emb


def quantize(emb: np.ndarray, precision: str) -> np.ndarray:
    """``(n, d)`` float embeddings as the stored ``(n, stored_dimension)`` array.

    Examples
    --------
    >>> x = np.array([[0.6, -0.8, 0.0]], dtype=np.float32)
    >>> quantize(x, "int8").tolist(), quantize(x, "binary").tolist()
    ([[76, -102, 0]], [[128]])
    """
    np_dtype = PRECISIONS[precision][0]
    if precision == "int8":
        return np.clip(np.rint(emb * 127.0), -127, 127).astype(np.int8)
    if precision == "binary":
        return (
            np.packbits(emb > 0, axis=1)
            if emb.shape[0]
            else np.zeros((0, stored_dimension(emb.shape[1], precision)), np.uint8)
        )
    return np.ascontiguousarray(emb, dtype=np_dtype)


def to_float(stored: np.ndarray, precision: str, dimension: int | None = None) -> np.ndarray:
    """Stored embeddings back to float32 for similarity search: ``int8 / 127``, and binary
    bits as ``+1 / -1`` (``dimension`` drops the padding bits of the last byte).

    Examples
    --------
    >>> to_float(np.array([[127, -127]], dtype=np.int8), "int8").tolist()
    [[1.0, -1.0]]
    >>> to_float(np.array([[160]], dtype=np.uint8), "binary", dimension=3).tolist()
    [[1.0, -1.0, 1.0]]
    """
    stored = np.asarray(stored)
    if precision == "int8":
        return stored.astype(np.float32) / 127.0
    if precision == "binary":
        bits = np.unpackbits(stored.astype(np.uint8), axis=1)
        if dimension is not None:
            bits = bits[:, :dimension]
        return bits.astype(np.float32) * 2.0 - 1.0
    return stored.astype(np.float32)
