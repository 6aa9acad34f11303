"""dask-surge: SuperBatch embedding of Dask DataFrame text columns.

Importing the package registers the ``.surge`` accessor on Dask DataFrames::

    import dask_surge
    ddf.surge.encode("text", output="emb/")

The package imports lazily (PEP 562): ``import dask_surge`` loads only its configuration,
errors and version; the public names below are imported on first use. The accessor is
registered at once when ``dask.dataframe`` is already imported, else as soon as it is (in
whichever order a notebook imports the two). So a Dask worker that unpickles a dask-surge
plugin or task imports what that needs, not ``dask.dataframe`` and the planning layers,
which a fresh worker would pay before it starts loading the model (see the cold-start study
in ``docs/ab_studies.md``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from . import config  # noqa: F401  (registers surge.* defaults in dask.config)
from ._version import __version__
from .errors import SurgeError, SurgeInputError, SurgeModelError, SurgeOutputError, SurgeValueError

if TYPE_CHECKING:
    from .api import EncodeResult, SurgePlan, encode, plan, read_embeddings, skipped_rows, status
    from .execution.cluster import local_cluster
    from .models.encoders import Encoder
    from .planning.policy import OnlinePlanner, SuperBatch, plan_superbatches

__all__ = [
    "__version__",
    "encode",
    "plan",
    "read_embeddings",
    "skipped_rows",
    "status",
    "Encoder",
    "EncodeResult",
    "SurgePlan",
    "local_cluster",
    "OnlinePlanner",
    "SuperBatch",
    "plan_superbatches",
    "SurgeError",
    "SurgeInputError",
    "SurgeModelError",
    "SurgeOutputError",
    "SurgeValueError",
]

#: the public names imported on first use, and the module each is taken from
_LAZY = {
    **dict.fromkeys(
        ("encode", "plan", "read_embeddings", "skipped_rows", "status", "EncodeResult", "SurgePlan"),
        "dask_surge.api",
    ),
    "Encoder": "dask_surge.models.encoders",
    "local_cluster": "dask_surge.execution.cluster",
    **dict.fromkeys(("OnlinePlanner", "SuperBatch", "plan_superbatches"), "dask_surge.planning.policy"),
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then a plain attribute); or a
    submodule (``dask_surge.api``), imported as the eager package did."""
    home = _LAZY.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# Why the accessor is not registered plainly here (``from . import accessor``): the registration is
# Dask's extension API (``register_dataframe_accessor``, in dask_surge/accessor.py), which imports
# ``dask.dataframe``; a fresh Dask worker imports this package to unpickle the encoder plugin and its
# first task, and would pay that import before it starts loading the model. Measured side by side in
# fresh interpreters that imported ``distributed`` (docs/ab_studies.md, "The accessor's registration"):
# importing the worker's modules takes 0.39 s deferred against
# 2.75 s with the plain registration (median of 10 alternating pairs, +2.45 s, on the 2-core machine
# under load; issue 27's cold-start target is 5 s to the first output). So the registration waits for
# ``dask.dataframe``: at once when it is imported already, else from a one-shot import hook.
def _register_accessor() -> None:
    """Register ``.surge`` on Dask DataFrames (imports :mod:`dask_surge.accessor`; needs ``dask.dataframe``)."""
    importlib.import_module("dask_surge.accessor")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_accessor` right after ``dask.dataframe`` is first imported, then leaves
    ``sys.meta_path``.

    It finds nothing itself: it asks the finders after it for the module's spec and wraps that
    spec's loader, so the module is loaded exactly as it would be without it.
    """

    module = "dask.dataframe"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        _remove_hooks()  # once: whatever the outcome, later imports are untouched
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        real = getattr(loader, "exec_module", None)
        if real is None:  # not a source package's loader (never so for dask): left as found
            return spec

        def exec_module(module: Any) -> None:
            real(module)
            _register_accessor()

        loader.exec_module = exec_module  # this spec's loader instance only
        return spec


def _remove_hooks() -> None:
    sys.meta_path[:] = [
        f
        for f in sys.meta_path
        if type(f).__name__ != _AfterImport.__name__ or getattr(f, "module", None) != _AfterImport.module
    ]


if "dask.dataframe" in sys.modules:
    _register_accessor()
else:
    _remove_hooks()  # a reload of this package: one hook, not two
    sys.meta_path.insert(0, _AfterImport())
