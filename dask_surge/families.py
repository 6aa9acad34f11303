"""The output families: what one text becomes, and the options each one takes.

A dense model writes a vector per text, a sparse (SPLADE) model vocabulary weights per text, a
multi-vector (ColBERT) model a vector per token. The engine tells a model's family
(:mod:`dask_surge.engine.family`), the output lays out each family's columns
(:data:`dask_surge.io.layout.FAMILY_COLUMNS`) and a run's identity records it: all reach the
family here, below both.

Examples
--------
>>> FAMILIES
('dense', 'sparse', 'multivector')
>>> check_family_options("multivector", precision="float16", truncate_dim=8)
"""

from __future__ import annotations

from .errors import SurgeValueError
from .options import LongTexts, Precision, choices

__all__ = [
    "DENSE",
    "SPARSE",
    "MULTIVECTOR",
    "FAMILIES",
    "FAMILY_PRECISIONS",
    "FAMILY_LONG_TEXTS",
    "check_family",
    "check_family_options",
    "family_of_run",
]

#: The output families: what one text becomes, as a run's identity records it.
DENSE, SPARSE, MULTIVECTOR = "dense", "sparse", "multivector"
FAMILIES = (DENSE, SPARSE, MULTIVECTOR)
#: family -> what one row of it holds, in words
_ROWS = {DENSE: "a vector per text", SPARSE: "vocabulary weights per text", MULTIVECTOR: "a vector per token"}

#: family -> the stored precisions it writes (a sparse row's weights are float32; int8 and binary need a
#: scale rule per token vector that is not defined)
FAMILY_PRECISIONS: dict[str, tuple[str, ...]] = {
    DENSE: choices(Precision),
    SPARSE: ("float32",),
    MULTIVECTOR: ("float32", "float16"),
}
#: family -> the long-text modes it takes: a sparse or multi-vector row is not a vector windows could share
FAMILY_LONG_TEXTS: dict[str, tuple[str, ...]] = {
    DENSE: choices(LongTexts),
    SPARSE: ("truncate", "error"),
    MULTIVECTOR: ("truncate", "error"),
}


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
    return family if family in FAMILIES else DENSE


def check_family_options(
    family: str,
    *,
    precision: str = "float32",
    normalize: bool = False,
    truncate_dim: int | None = None,
    long_texts: str = "truncate",
    sparse_top_k: int | None = None,
    sparse_threshold: float | None = None,
) -> None:
    """Refuse the output options a model's family cannot honour, naming the option, the family and the fix.

    Raises
    ------
    SurgeValueError

    Examples
    --------
    >>> check_family_options("sparse", precision="int8")
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: precision='int8' is not for a sparse model: ...
    """
    model = {DENSE: "a dense model", SPARSE: "a sparse (SPLADE) model", MULTIVECTOR: "a multi-vector model"}[
        family
    ]
    if precision not in FAMILY_PRECISIONS[family]:
        raise SurgeValueError(
            f"precision={precision!r} is not for a {family} model: it writes "
            f"{list(FAMILY_PRECISIONS[family])} values ({_ROWS[family]}). "
            f"Fix: pass precision='float32'{' or ' + repr('float16') if family == MULTIVECTOR else ''}."
        )
    if long_texts not in FAMILY_LONG_TEXTS[family]:
        raise SurgeValueError(
            f"long_texts={long_texts!r} is not for {model}: its rows are not vectors that token windows could "
            "share. Fix: pass long_texts='truncate' (texts over the window are cut, and counted) or 'error'."
        )
    if family == SPARSE and (normalize or truncate_dim is not None):
        given = "normalize=True" if normalize else f"truncate_dim={truncate_dim!r}"
        raise SurgeValueError(
            f"{given} is not for {model}: its rows are vocabulary weights, not a vector to normalize or cut. "
            "Fix: leave it out; prune rows with sparse_top_k= or sparse_threshold= instead."
        )
    if family != SPARSE and (sparse_top_k is not None or sparse_threshold is not None):
        given = (
            f"sparse_top_k={sparse_top_k!r}"
            if sparse_top_k is not None
            else f"sparse_threshold={sparse_threshold!r}"
        )
        raise SurgeValueError(
            f"{given} prunes the rows of a sparse (SPLADE) model, but the model is {model}. Fix: leave it out, "
            "or pass a SparseEncoder model."
        )


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
    if family not in FAMILIES:
        raise SurgeValueError(
            f"family={family!r} is not an output family: one of {list(FAMILIES)} ({', '.join(_ROWS.values())}). "
            "Fix: pass family='dense', 'sparse' or 'multivector'."
        )
    return str(family)
