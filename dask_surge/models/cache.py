"""The process-wide cache of loaded models: each spec loaded once, at most ``surge.max-loaded-models`` kept.

Every equal :class:`~dask_surge.Encoder` in a process shares one loaded model (keyed by its
:class:`~dask_surge.models.spec.EncoderSpec`). Beyond the bound the least recently used model
is closed; closing happens outside the lock, so a close never holds up another model's load.
A model loaded from a directory is loaded again once that directory's files change (their
names, sizes and mtimes: :func:`~dask_surge.models.modelid.files_signature`), so a long-lived
process never encodes with weights that are no longer the ones its runs record.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import config
from ..engine.backends import Backend, free_memory
from .loader import load
from .modelid import files_signature
from .spec import EncoderSpec

__all__ = ["Loaded", "cached", "forget", "get", "loaded", "release"]

logger = logging.getLogger(__name__)

# process-wide state: loaded models by spec (at most surge.max-loaded-models)
_LOADED: dict[EncoderSpec, Loaded] = {}
_LOAD_LOCK = threading.Lock()
_uses = itertools.count()


@dataclass
class Loaded:
    """A loaded model: the backend that encodes with it, why that one, and when it was last used."""

    impl: Backend
    reason: str
    used: int = 0  # a tick of ``_uses``: the least recently used model is closed first
    files: tuple = ()  # a directory model's files when it was loaded (:func:`files_signature`)

    @property
    def backend(self) -> str:
        return self.impl.name

    @property
    def dimension(self) -> int:
        return self.impl.dimension

    @property
    def engine(self) -> Any:
        """The TransformerEngine when the backend is the fast one, else None."""
        return getattr(self.impl, "engine", None)

    def encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        return self.impl.encode(texts, normalize)

    def close(self) -> None:
        self.impl.close()


def _files(spec: EncoderSpec) -> tuple:
    """The files of a directory model as they are now (nothing for an in-memory one)."""
    if spec.kind != "path":
        return ()
    try:
        return files_signature(spec.source)
    except OSError:
        return ()


def _load(spec: EncoderSpec) -> Loaded:
    """Load ``spec`` (see :func:`dask_surge.models.loader.load`); the caller caches it."""
    files = _files(spec)
    return Loaded(*load(spec), files=files)


def cached(spec: EncoderSpec) -> Loaded | None:
    """The model loaded for ``spec`` in this process, or None (nothing is loaded to answer)."""
    return _LOADED.get(spec)


def loaded() -> list[Loaded]:
    """Every model loaded in this process, least recently used first (for diagnosis: nothing is loaded to answer)."""
    with _LOAD_LOCK:
        return sorted(_LOADED.values(), key=lambda m: m.used)


def get(spec: EncoderSpec) -> Loaded:
    """The model loaded for ``spec``, loading it (once, whichever thread asks first) if need be.

    Loading one beyond ``surge.max-loaded-models`` closes the least recently used others.
    """
    loaded = _LOADED.get(spec)
    if loaded is not None and loaded.files and _files(spec) != loaded.files:  # the directory changed since
        logger.info(
            "dask-surge: the files of model %r changed since it was loaded: loading it again", spec.source
        )
        with _LOAD_LOCK:
            if _LOADED.get(spec) is loaded:
                del _LOADED[spec]
        loaded.close()
        loaded = None
    if loaded is None:
        with _LOAD_LOCK:
            loaded = _LOADED.get(spec)
            if loaded is None:
                loaded = _load(spec)
                _LOADED[spec] = loaded
                evicted = _over_the_bound(spec)
            else:
                evicted = []
        if evicted:  # closed outside the lock: a close may wait for nothing, but never holds up a load
            for old in evicted:
                old.close()
            free_memory()
    loaded.used = next(_uses)
    return loaded


def forget(spec: EncoderSpec, loaded: Loaded) -> None:
    """Drop ``loaded`` from the cache if it is still the model cached for ``spec`` (it was closed directly)."""
    with _LOAD_LOCK:
        if _LOADED.get(spec) is loaded:
            del _LOADED[spec]


def release(spec: EncoderSpec) -> bool:
    """Close the model loaded for ``spec`` and give its memory back; True when one was loaded."""
    with _LOAD_LOCK:
        loaded = _LOADED.pop(spec, None)
    if loaded is None:
        return False
    loaded.close()
    del loaded
    free_memory()
    return True


def _over_the_bound(keep: EncoderSpec) -> list[Loaded]:
    """Take the least recently used models out of ``_LOADED`` beyond ``surge.max-loaded-models`` (``keep`` stays).

    The caller holds ``_LOAD_LOCK`` and closes what this returns.
    """
    evicted = []
    bound = config.get("max-loaded-models")
    while len(_LOADED) > bound:
        spec = min((k for k in _LOADED if k != keep), key=lambda k: _LOADED[k].used)
        evicted.append(_LOADED.pop(spec))
        logger.info("dask-surge: closing the least recently used model %r (%d loaded at most)", spec, bound)
    return evicted
