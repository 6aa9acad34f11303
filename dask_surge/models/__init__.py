"""Models as users name and hold them: the :class:`~dask_surge.Encoder` handle, Hub resolution,
the process-wide cache and object registry, and model identity.

The machinery that runs a loaded model is in :mod:`dask_surge.engine`. Its modules lived here
until 0.1.0's restructure; importing one by its old path (``dask_surge.models.engine``) still
works, with a :class:`DeprecationWarning` naming the new path (:data:`MOVED`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: old module under ``dask_surge.models`` -> the module it moved to
MOVED = {
    "allocator": "dask_surge.engine.allocator",
    "backends": "dask_surge.engine.backends",
    "batching": "dask_surge.engine.batching",
    "bert": "dask_surge.engine.bert",
    "bert_tokenizer": "dask_surge.engine.bert_tokenizer",
    "device": "dask_surge.engine.forward",
    "devices": "dask_surge.engine.placement",
    "direct": "dask_surge.engine.loading",
    "engine": "dask_surge.engine.transformer",
    "joined": "dask_surge.engine.joined",
    "prompts": "dask_surge.engine.prompts",
    "tokenize": "dask_surge.engine.tokenizing",
    "tokenpool": "dask_surge.engine.tokenpool",
    "windows": "dask_surge.engine.long_texts",
}


class _MovedLoader(importlib.abc.Loader):
    """Loads an old path as the module it moved to (the same object), with a warning."""

    spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self.spec = module.__spec__  # the import system sets the old path's spec on it: put it back after
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module was imported by :meth:`create_module`) but its own spec to restore."""
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader())


if not any(type(f).__name__ == _MovedFinder.__name__ for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
