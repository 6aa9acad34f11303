"""Checks on what a backend returns: one finite float32 row per text, or an error that names the rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SurgeModelError

__all__ = ["check_finite", "checked"]


def checked(raw: Any, rows: int, backend: str) -> np.ndarray:
    """A backend's output as a float32 C-contiguous ``(rows, d)`` array, checked (shape; finite unless
    the fast engine checked on its device).

    Raises
    ------
    SurgeModelError
        Not one row per text, or NaN or inf in a row.

    Examples
    --------
    >>> checked([[1, 2], [3, 4]], 2, "callable").dtype
    dtype('float32')
    """
    emb = np.ascontiguousarray(raw, dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] != rows:
        raise SurgeModelError(
            f"the encoder returned shape {emb.shape} for {rows} texts; an encoder must "
            f"return one row per text, shape ({rows}, d). Fix: make the callable return one "
            "embedding per input text."
        )
    if backend != "fast":  # the fast engine checks on its device
        check_finite(emb)
    return emb


def check_finite(emb: np.ndarray) -> None:
    """Raise when embeddings hold NaN or inf, naming the rows of the call.

    Raises
    ------
    SurgeModelError

    Examples
    --------
    >>> check_finite(np.zeros((2, 3), dtype=np.float32))
    """
    finite = np.isfinite(emb).all(axis=1) if emb.ndim == 2 else np.isfinite(emb)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    raise SurgeModelError(
        f"the encoder produced NaN or inf embeddings for {bad.size} of {len(finite)} texts of this call "
        f"(rows {bad[:10].tolist()}{' ...' if bad.size > 10 else ''}, 0-based in the call, i.e. in the "
        "SuperBatch): embeddings must be finite. This usually means a half-precision overflow or broken "
        "weights. Fix: pass dtype='float32' (or 'bfloat16' for a bfloat16 checkpoint), and check the model."
    )
