"""The output's columns, stated once: their names, the types dask-surge writes, their order.

The SuperBatch frame (written, or a partition of the lazy frame), its meta, the reuse index,
the checks of ``keep=``, the Parquet sink (its skipped-rows files, its dictionary and codec
choices, its row groups) and the readers of an output take the columns from here.

The order of an output's columns (:func:`output_columns`): ``partition``, ``row``; in chunk
mode (``long_texts="chunk"``) the window's :data:`CHUNK_COLUMNS`; the kept input columns;
``text_hash``; then the columns of the model's output family (:data:`FAMILY_COLUMNS`):
``embedding`` for a dense model, ``indices`` and ``values`` for a sparse (SPLADE) one
(:mod:`dask_surge.io.sparse`), ``vectors`` and ``tokens`` for a multi-vector (ColBERT) one
(:mod:`dask_surge.io.multivector`).

Examples
--------
>>> output_columns(["doc_id"], chunked=False)
('partition', 'row', 'doc_id', 'text_hash', 'embedding')
>>> output_columns([], chunked=True)[2:6]
('chunk', 'char_start', 'char_end', 'tokens')
>>> output_columns(["doc_id"], chunked=False, family="sparse")[-3:]
('text_hash', 'indices', 'values')
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SurgeValueError
from ..options import LongTexts, Precision, choices

__all__ = ["PARTITION", "ROW", "CHUNK", "CHUNK_COLUMNS", "TEXT_HASH", "EMBEDDING", "INDICES", "VALUES", "VECTORS",
           "TOKENS", "DENSE", "SPARSE", "MULTIVECTOR", "FAMILIES", "FAMILY_COLUMNS", "PAYLOAD_COLUMNS",
           "FAMILY_PRECISIONS", "FAMILY_LONG_TEXTS", "family_of_run", "check_family", "check_family_options", "reserved_columns",
           "output_columns"]

#: the input partition a row came from, and the row's position in it
PARTITION, ROW = "partition", "row"
#: a window's number within its text, in chunk mode (the first window of a text is 0)
CHUNK = "chunk"
#: the tokens of a row: a window's tokens in chunk mode, a multi-vector row's token vectors (int32)
TOKENS = "tokens"
#: The columns a ``long_texts="chunk"`` output has beside ``partition`` and ``row``, with their types.
CHUNK_COLUMNS = {CHUNK: np.int32, "char_start": np.int64, "char_end": np.int64, TOKENS: np.int32}
#: each row's text hash (:mod:`dask_surge.io.hashing`)
TEXT_HASH = "text_hash"
#: the embedding vector (:mod:`dask_surge.io.precision`)
EMBEDDING = "embedding"
#: a sparse row's vocabulary ids, ascending (``list<int32>``), and their weights (``list<float32>``)
INDICES, VALUES = "indices", "values"
#: a multi-vector row's token vectors (``list<fixed_size_list<float32|float16>[dim]>``)
VECTORS = "vectors"

#: The output families: what one text becomes, as a run's identity records it.
DENSE, SPARSE, MULTIVECTOR = "dense", "sparse", "multivector"
#: family -> the columns that hold a row's output, last in the output, in this order
FAMILY_COLUMNS: dict[str, tuple[str, ...]] = {
    DENSE: (EMBEDDING,), SPARSE: (INDICES, VALUES), MULTIVECTOR: (VECTORS, TOKENS)}
FAMILIES = tuple(FAMILY_COLUMNS)
#: The columns of model output (the Parquet writer gives them the output codec, no dictionary, no statistics);
#: ``tokens`` is not one: a small count, compressed and with statistics like the other columns.
PAYLOAD_COLUMNS = frozenset({EMBEDDING, INDICES, VALUES, VECTORS})

#: family -> the stored precisions it writes (a sparse row's weights are float32; int8 and binary need a
#: scale rule per token vector that is not defined)
FAMILY_PRECISIONS: dict[str, tuple[str, ...]] = {
    DENSE: choices(Precision), SPARSE: ("float32",), MULTIVECTOR: ("float32", "float16")}
#: family -> the long-text modes it takes: a sparse or multi-vector row is not a vector windows could share
FAMILY_LONG_TEXTS: dict[str, tuple[str, ...]] = {
    DENSE: choices(LongTexts), SPARSE: ("truncate", "error"), MULTIVECTOR: ("truncate", "error")}


def family_of_run(fingerprint: object) -> str:
    """The output family a run's fingerprint records (its model identity's ``family``; a dense run,
    and every run made before families, records none).

    Examples
    --------
    >>> family_of_run({"model": {"kind": "path", "family": "sparse"}}), family_of_run({"model": {"kind": "path"}})
    ('sparse', 'dense')
    """
    model = fingerprint.get("model") if isinstance(fingerprint, dict) else None
    family = model.get("family") if isinstance(model, dict) else None
    return family if family in FAMILY_COLUMNS else DENSE


def check_family_options(family: str, *, precision: str = "float32", normalize: bool = False,
                         truncate_dim: int | None = None, long_texts: str = "truncate",
                         sparse_top_k: int | None = None, sparse_threshold: float | None = None) -> None:
    """Refuse the output options a model's family cannot honour, naming the option, the family and the fix.

    Raises
    ------
    SurgeValueError

    Examples
    --------
    >>> check_family_options("multivector", precision="float16", truncate_dim=8)
    >>> check_family_options("sparse", precision="int8")
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: precision='int8' is not for a sparse model: ...
    """
    model = {DENSE: "a dense model", SPARSE: "a sparse (SPLADE) model", MULTIVECTOR: "a multi-vector model"}[family]
    if precision not in FAMILY_PRECISIONS[family]:
        raise SurgeValueError(
            f"precision={precision!r} is not for a {family} model: it writes "
            f"{list(FAMILY_PRECISIONS[family])} values ({', '.join(FAMILY_COLUMNS[family])} columns). "
            f"Fix: pass precision='float32'{' or ' + repr('float16') if family == MULTIVECTOR else ''}.")
    if long_texts not in FAMILY_LONG_TEXTS[family]:
        raise SurgeValueError(
            f"long_texts={long_texts!r} is not for {model}: its rows are not vectors that token windows could "
            "share. Fix: pass long_texts='truncate' (texts over the window are cut, and counted) or 'error'.")
    if family == SPARSE and (normalize or truncate_dim is not None):
        given = "normalize=True" if normalize else f"truncate_dim={truncate_dim!r}"
        raise SurgeValueError(
            f"{given} is not for {model}: its rows are vocabulary weights, not a vector to normalize or cut. "
            "Fix: leave it out; prune rows with sparse_top_k= or sparse_threshold= instead.")
    if family != SPARSE and (sparse_top_k is not None or sparse_threshold is not None):
        given = f"sparse_top_k={sparse_top_k!r}" if sparse_top_k is not None else f"sparse_threshold={sparse_threshold!r}"
        raise SurgeValueError(
            f"{given} prunes the rows of a sparse (SPLADE) model, but the model is {model}. Fix: leave it out, "
            "or pass a SparseEncoder model.")


def check_family(family: object) -> str:
    """Validate an output family: one of :data:`FAMILIES`.

    Examples
    --------
    >>> check_family("sparse")
    'sparse'
    >>> check_family("splade")
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: family='splade' is not an output family: ...
    """
    if family not in FAMILY_COLUMNS:
        raise SurgeValueError(
            f"family={family!r} is not an output family: one of {list(FAMILIES)} (a vector per text, "
            f"vocabulary weights per text, a vector per token). Fix: pass family='dense', 'sparse' or 'multivector'.")
    return str(family)


def reserved_columns(chunked: bool, family: str = DENSE) -> tuple[str, ...]:
    """The output columns dask-surge writes itself (a kept column may not take their names),
    in their order in the output.

    Examples
    --------
    >>> reserved_columns(chunked=False)
    ('partition', 'row', 'text_hash', 'embedding')
    >>> len(reserved_columns(chunked=True))
    8
    >>> reserved_columns(chunked=False, family="multivector")
    ('partition', 'row', 'text_hash', 'vectors', 'tokens')
    """
    return output_columns((), chunked, family)


def output_columns(keep: Sequence[str], chunked: bool, family: str = DENSE) -> tuple[str, ...]:
    """Every column of an output that keeps ``keep``, in order (see the module docstring).

    A multi-vector output has a row per text, never per window: its ``tokens`` counts the
    text's vectors, and chunk mode's ``tokens`` would be a second column of that name.

    Examples
    --------
    >>> output_columns([], chunked=True, family="multivector")
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: long_texts='chunk' writes a row per token window, ...
    """
    payload = FAMILY_COLUMNS[check_family(family)]
    if chunked and family == MULTIVECTOR:
        raise SurgeValueError(
            "long_texts='chunk' writes a row per token window, and a multi-vector model already writes a vector "
            "per token of each text (family='multivector'): the two layouts do not combine. Fix: pass "
            "long_texts='truncate' with a multi-vector model.")
    return (PARTITION, ROW, *(CHUNK_COLUMNS if chunked else ()), *keep, TEXT_HASH, *payload)
