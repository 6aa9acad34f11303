"""Configuration under ``surge.`` in ``dask.config``, with shipped defaults.

Every option can be set in Dask's YAML config, with ``dask.config.set``, or
through environment variables such as ``DASK_SURGE__B_MIN=50000``. Values are
resolved when a function runs, never frozen at import.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

from .errors import SurgeValueError
from .options import COMPRESSIONS, DTYPES, ENGINES, ON_NULLS, PRECISIONS

__all__ = ["DEFAULTS_PATH", "OPTIONS", "get"]

DEFAULTS_PATH = os.path.join(os.path.dirname(__file__), "surge.yaml")

with open(DEFAULTS_PATH) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)

#: option name (as in the YAML) -> allowed values, or a type check; the vocabularies
#: come from the ``Literal`` types of :mod:`dask_surge.options`
OPTIONS: dict[str, Any] = {
    "b-min": ("positive-int", "auto"),
    "b-max": ("positive-int", "auto"),
    "model": "str",
    "device": ("str", None),
    "dtype": DTYPES,
    "engine": ENGINES,
    "batch-size": "positive-int",
    "max-tokens": ("positive-int", None),
    "normalize": "bool",
    "precision": PRECISIONS,
    "compression": COMPRESSIONS,
    "truncate-dim": ("positive-int", None),
    "on-null": ON_NULLS,
    "progress": "bool",
    "in-flight": ("positive-int", None),
    "ttfo-target": "positive-number",
    "memory-budget": ("positive-int", None),
    "max-bytes": ("bytes", None),
    "token-sample": ("positive-int", None),
}


def _check(name: str, value: Any) -> Any:
    rule = OPTIONS[name]
    allowed = rule if isinstance(rule, tuple) else (rule,)
    for option in allowed:
        if option is None and value is None:
            return value
        if option == "positive-int" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        if option == "str" and isinstance(value, str):
            return value
        if option == "positive-number" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value > 0:
            return value
        if option == "bool" and isinstance(value, bool):
            return value
        if option == "bytes" and (size := _bytes(value)) is not None:
            return size
        if isinstance(option, str) and option not in ("positive-int", "positive-number", "str", "bool", "bytes") \
                and value == option:
            return value
    raise SurgeValueError(
        f"surge.{name}={value!r} is not allowed: expected {' or '.join(map(str, allowed))}. "
        f"Fix: dask.config.set({{'surge.{name}': ...}}) or the DASK_SURGE__{name.upper().replace('-', '_')} "
        "environment variable."
    )


def _bytes(value: Any) -> int | None:
    """A positive byte count from an int or a string such as ``"512 MiB"``; None if neither."""
    from dask.utils import parse_bytes

    if isinstance(value, str):
        try:
            value = parse_bytes(value)
        except ValueError:
            return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


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
    if name not in OPTIONS:
        raise SurgeValueError(f"unknown option surge.{name!r}. Fix: use one of {sorted(OPTIONS)}.")
    if value is None:
        value = dask.config.get(f"surge.{name}")
    return _check(name, value)
