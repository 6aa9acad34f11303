"""Option vocabularies, defined once as ``Literal`` types.

The annotations of :func:`dask_surge.encode` and :class:`dask_surge.Encoder`,
the config validation (:data:`dask_surge.config.OPTIONS`) and the CLI's
``choices`` all derive from these types, so adding a value here adds it
everywhere (and forgetting to handle it somewhere fails a test, not a user).

Examples
--------
>>> from dask_surge.options import Precision, choices
>>> choices(Precision)
('float32', 'float16', 'int8', 'binary')
"""

from __future__ import annotations

from typing import Any, Literal, get_args

__all__ = [
    "COMPRESSIONS", "DTYPES", "ENGINES", "ON_NULLS", "PRECISIONS", "Compression", "Dtype", "EngineName", "OnNull",
    "Precision", "choices",
]

#: Storage type of the embedding values (see :mod:`dask_surge.io.precision`).
Precision = Literal["float32", "float16", "int8", "binary"]
#: What a null text does: raise, encode as ``""``, or leave the row out and record it.
OnNull = Literal["error", "empty", "skip"]
#: Compute dtype of the forward pass; ``"auto"`` is float16 on CUDA and float32 on CPU.
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
#: Which engine encodes: the fast tokenize-sort-forward engine, sentence-transformers' own
#: ``encode``, or ``"auto"`` (fast where the model's structure allows, else sentence-transformers).
EngineName = Literal["auto", "fast", "sentence-transformers"]
#: Parquet codec of the embedding column. ``"none"`` (the default) writes fastest: float vectors
#: barely compress (zstd saves ~7% on float32 MiniLM vectors at several times the write time).
Compression = Literal["none", "snappy", "lz4", "zstd"]


def choices(literal: Any) -> tuple[str, ...]:
    """The allowed values of a ``Literal`` type, in their declared order.

    Parameters
    ----------
    literal : typing.Literal
        One of the vocabularies of this module.

    Returns
    -------
    tuple of str

    Examples
    --------
    >>> choices(OnNull)
    ('error', 'empty', 'skip')
    """
    values = get_args(literal)
    if not values:
        raise TypeError(f"{literal!r} is not a Literal type. Fix: pass e.g. dask_surge.options.Precision.")
    return values


PRECISIONS: tuple[str, ...] = choices(Precision)
ON_NULLS: tuple[str, ...] = choices(OnNull)
DTYPES: tuple[str, ...] = choices(Dtype)
ENGINES: tuple[str, ...] = choices(EngineName)
COMPRESSIONS: tuple[str, ...] = choices(Compression)
