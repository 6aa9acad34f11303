"""In-memory models by token: how a loaded ``SentenceTransformer`` or a callable rides in a pickled encoder.

An encoder of an in-memory model pickles as a token (:func:`token_for`); the object itself
reaches each Dask worker once, through :class:`dask_surge.execution.plugins.EncoderPlugin`,
which installs it there under the same token (:func:`install_object`).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from ..errors import SurgeModelError

__all__ = ["install_object", "installed", "lookup", "token_for", "uninstall_object"]

# the objects installed in this process, by token
_OBJECTS: dict[str, Any] = {}
_counter = itertools.count()


def token_for(obj: Any) -> str:
    """The token of ``obj``, installing it under a new one (unique to this process) the first time.

    Examples
    --------
    >>> fn = lambda texts: [[0.0]] * len(texts)
    >>> token_for(fn) == token_for(fn), installed(token_for(fn)) is fn
    (True, True)
    """
    for token, known in _OBJECTS.items():
        if known is obj:
            return token
    token = f"obj-{os.getpid()}-{id(obj):x}-{next(_counter)}"
    _OBJECTS[token] = obj
    return token


def installed(token: str) -> Any:
    """The object installed under ``token`` in this process, or None."""
    return _OBJECTS.get(token)


def lookup(token: str) -> Any:
    """The object installed under ``token``.

    Raises
    ------
    SurgeModelError
        Nothing is installed under ``token`` in this process (the plugin never shipped it here).
    """
    try:
        return _OBJECTS[token]
    except KeyError:
        raise SurgeModelError(
            f"the in-memory model {token!r} was never shipped to this process "
            f"(pid {os.getpid()}). In-memory models reach Dask workers through "
            "dask_surge.execution.plugins.EncoderPlugin, which ddf.surge.encode registers for you. "
            "Fix: register it with client.register_plugin(EncoderPlugin(encoder)), or pass "
            "the model as a Hub name or local path so each worker loads it itself."
        ) from None


def install_object(token: str, obj: Any) -> None:
    """Make an in-memory model available in this process under ``token`` (plugin use)."""
    _OBJECTS[token] = obj


def uninstall_object(token: str) -> bool:
    """Forget the in-memory model installed under ``token`` (plugin teardown); True if it was there."""
    return _OBJECTS.pop(token, None) is not None
