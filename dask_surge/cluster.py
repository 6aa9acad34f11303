"""Deprecated home of :func:`dask_surge.local_cluster`.

``from dask_surge.cluster import local_cluster`` keeps working, with a
:class:`DeprecationWarning`: import it from the package instead
(``from dask_surge import local_cluster``).
"""

from __future__ import annotations

import warnings
from typing import Any

from .execution import cluster as _cluster

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    if name == "local_cluster":
        warnings.warn(
            "dask_surge.cluster.local_cluster is deprecated: import it from the package, "
            "`from dask_surge import local_cluster`.", DeprecationWarning, stacklevel=2,
        )
        return _cluster.local_cluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
