"""Configuration under ``surge.`` in ``dask.config``, with shipped defaults.

Every option can be set in Dask's YAML config, with ``dask.config.set``, or
through environment variables such as ``DASK_SURGE__B_MIN=50000``. Values are
resolved when a function runs, never frozen at import. The options, their defaults
(``surge.yaml``, checked against them), validation and schema (``surge-schema.yaml``,
generated) are declared once, in :data:`dask_surge.options.OPTIONS`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from typing import Any

import dask.config
import yaml

from .errors import SurgeValueError
from .options import Invalid, Option, config_options, option, options_of
from .options import bind as bind_given

__all__ = ["DEFAULTS_PATH", "OPTIONS", "get", "given", "bind", "check_argument"]

DEFAULTS_PATH = os.path.join(os.path.dirname(__file__), "surge.yaml")

with open(DEFAULTS_PATH) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)

#: option name (as in the YAML) -> its :class:`~dask_surge.options.Option` (validator, vocabulary,
#: default): the one declaration the API, the CLI and the schema also use. :func:`get` reads the
#: table itself, so an option declared later (a test's) is known too.
OPTIONS: dict[str, Option] = config_options()


#: ``surge.<key>`` -> the value a running call was given for it (:func:`given`): this thread's, this call's
_GIVEN: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("surge_given", default={})


def _check(name: str, value: Any) -> Any:
    opt = config_options()[name]
    try:
        return opt.check_config(value)
    except Invalid as err:
        raise SurgeValueError(opt.config_error(value, err)) from None


@contextlib.contextmanager
def given(values: Mapping[str, Any]) -> Iterator[None]:
    """While the block runs, :func:`get` of each ``surge.<key>`` in ``values`` answers the value a call was
    given for it (None leaves the key to the config), in this thread and this process only.

    For what a call names that dask.config cannot hold: a pyiceberg ``Catalog`` object given as
    ``encode(..., iceberg_catalog=catalog)`` is read where the config would be (opening the table,
    building its index) but is never put in dask.config, which is shipped to every worker. The values
    are the caller's, checked as arguments (:func:`check_argument`).

    Examples
    --------
    >>> with given({"iceberg-table": "search.docs"}):
    ...     get("iceberg-table")
    'search.docs'
    >>> get("iceberg-table") is None
    True
    """
    token = _GIVEN.set({**_GIVEN.get(), **{k: v for k, v in values.items() if v is not None}})
    try:
        yield
    finally:
        _GIVEN.reset(token)


def get(name: str, value: Any = None) -> Any:
    """Return ``value`` if given, else the configured ``surge.<name>``, validated.

    Examples
    --------
    >>> get("b-max", 1000)
    1000
    >>> get("precision", "float16")
    'float16'
    >>> get("max-bytes", "1 MiB")
    1048576
    """
    known = config_options()
    if name not in known:
        raise SurgeValueError(f"unknown option surge.{name!r}. Fix: use one of {sorted(known)}.")
    if value is None:
        if name in _GIVEN.get():  # a running call's own value (see given), checked as its argument
            return _GIVEN.get()[name]
        value = dask.config.get(f"surge.{name}")
    return _check(name, value)


def check_argument(name: str, value: Any, *, shown: Any = None) -> Any:
    """``value`` of the keyword argument ``name``, checked by its option's validator (the one rule for it).

    Parameters
    ----------
    name : str
        The option's argument name (``"chunk_overlap"``), declared in :data:`dask_surge.options.OPTIONS`.
    value : object
        The value given.
    shown : object, optional
        What the error shows instead of ``value`` (e.g. with credentials redacted); None shows ``value``.

    Returns
    -------
    object
        The value to use (a validator may normalize it).

    Raises
    ------
    SurgeValueError
        Naming the argument, the value, the rule and the fix.

    Examples
    --------
    >>> check_argument("chunk_overlap", 16)
    16
    >>> check_argument("chunk_overlap", -1)
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: chunk_overlap=-1 must be an int >= 0. Fix: ...
    """
    opt = option(name)
    try:
        return opt.check(value)
    except Invalid as err:
        raise SurgeValueError(opt.argument_error(value, err, shown=shown)) from None


def bind(taker: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option ``taker`` takes -> its value as the call resolves it, checked by its validator.

    An option given as None (or not given) takes its configured ``surge.<name>`` where it has
    one (checked as :func:`get` checks it), else its default; a given value is checked by its
    option's validator, and an error names the argument. The options of the
    :class:`~dask_surge.Encoder` are left as given (it resolves and checks them itself, and refuses
    them beside a ready Encoder); the model is only resolved (a loaded model or an Encoder passes as
    it is). The other options are checked by their validators, in place (a validator may normalize,
    e.g. ``reuse`` to a tuple).

    Raises
    ------
    TypeError
        For a keyword ``taker`` does not take (as Python would).
    SurgeValueError
        For a value its option refuses, naming the value, the rule and the fix.

    Examples
    --------
    >>> opts = bind("plan", {"b_min": 5})
    >>> opts["b_min"], opts["max_bytes"], opts["long_texts"]
    (5, 536870912, 'truncate')
    >>> with dask.config.set({"surge.long-texts": "chunk"}):
    ...     bind("plan", {})["long_texts"]
    'chunk'
    >>> bind("plan", {"chunk_overlap": -1})["chunk_overlap"]
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: ...
    """
    opts = bind_given(taker, given)
    for opt in options_of(taker):
        value = opts[opt.name]
        if "Encoder" in opt.takers:
            continue
        if opt.name == "model":
            opts[opt.name] = dask.config.get(f"surge.{opt.config}") if value is None else value
        elif opt.config and value is None:
            opts[opt.name] = get(opt.config)
        elif opt.validator is not None:
            opts[opt.name] = check_argument(opt.name, value)
    return opts
