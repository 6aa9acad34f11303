"""Configuration under ``surge.`` in ``dask.config``, with shipped defaults.

Every option can be set in Dask's YAML config, with ``dask.config.set``, or
through environment variables such as ``DASK_SURGE__B_MIN=50000``. Values are
resolved when a function runs, never frozen at import. The options, their defaults
(``surge.yaml``, checked against them), validation and schema (``surge-schema.yaml``,
generated) are declared once, in :data:`dask_surge.options.OPTIONS`.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

from .errors import SurgeValueError
from .options import Invalid, Option, config_options

__all__ = ["DEFAULTS_PATH", "OPTIONS", "get"]

DEFAULTS_PATH = os.path.join(os.path.dirname(__file__), "surge.yaml")

with open(DEFAULTS_PATH) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)

#: option name (as in the YAML) -> its :class:`~dask_surge.options.Option` (validator, vocabulary,
#: default): the one declaration the API, the CLI and the schema also use. :func:`get` reads the
#: table itself, so an option declared later (a test's) is known too.
OPTIONS: dict[str, Option] = config_options()


def _check(name: str, value: Any) -> Any:
    opt = config_options()[name]
    try:
        return opt.check(value)
    except Invalid as err:
        raise SurgeValueError(opt.config_error(value, err)) from None


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
        value = dask.config.get(f"surge.{name}")
    return _check(name, value)
