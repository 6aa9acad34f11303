"""Exceptions raised by dask-surge.

Every message names the bad value, the rule it breaks and how to fix it.
"""

from __future__ import annotations

__all__ = ["SurgeError", "SurgeValueError", "SurgeInputError", "SurgeModelError", "SurgeOutputError"]


class SurgeError(Exception):
    """Base class of every dask-surge error."""


class SurgeValueError(SurgeError, ValueError):
    """An option or threshold has a bad value."""


class SurgeInputError(SurgeError, ValueError):
    """The input data breaks a rule (missing column, null text, ...)."""


class SurgeModelError(SurgeError, ValueError):
    """The model cannot be found or is not a text encoder."""


class SurgeOutputError(SurgeError, OSError):
    """The output location cannot hold this run (exists, unwritable, other run)."""
