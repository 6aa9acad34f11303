"""A stable identity of a Dask DataFrame's input, for run fingerprints.

Dask's own expression names are not stable across processes for every input
(``read_parquet``'s differs between two runs over the same files), so a resumed
run could not recognise itself. This identity is built from what defines the
data instead: the expression's structure with its plain operands (paths,
columns, filters...), and, for file sources, each file's path, size and
modification time; in-memory sources use Dask's deterministic content token.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["input_identity"]

_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (*_PLAIN, list, tuple)) for v in value):
        return [_plain(v) for v in value]
    return None


def _file_stats(paths: list[str]) -> list:
    from fsspec.core import url_to_fs

    stats = []
    for path in paths:
        fs, root = url_to_fs(path)
        files = sorted(fs.find(root, detail=True).items()) if fs.isdir(root) else [(root, fs.info(root))]
        for name, info in files:
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
            stats.append([name, info.get("size"), str(mtime)])
    return stats


def _paths_in(value: Any) -> list[str] | None:
    """The file paths an operand names (a path, or a possibly nested list of them)."""
    import os

    if isinstance(value, str):
        return [value] if os.path.exists(value) else None
    if isinstance(value, (list, tuple)) and value:
        found = [_paths_in(v) for v in value]
        if all(f is not None for f in found):
            return [p for f in found for p in f]  # type: ignore[union-attr]
    return None


def _leaf_identity(expr) -> Any:
    for op in expr.operands:
        paths = _paths_in(op)
        if paths:
            return {"files": _file_stats(paths)}
    from dask.base import tokenize

    try:
        return {"token": tokenize(expr, ensure_deterministic=True)}
    except Exception:  # noqa: BLE001 - any tokenize failure means: not reproducible
        return {"name": expr._name}  # not reproducible: a rerun in a new process will not resume


def input_identity(frame) -> str:
    """Digest of the input's structure and sources (stable across processes).

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> a = dd.from_pandas(pd.DataFrame({"t": ["x", "y"]}), npartitions=1)
    >>> input_identity(a) == input_identity(dd.from_pandas(pd.DataFrame({"t": ["x", "y"]}), npartitions=1))
    True
    """
    expr = frame.expr.simplify()
    nodes = []
    for e in expr.walk():
        # operands named with a leading underscore are Dask's caches (e.g. FromPandas'
        # ``_pd_length_stats``, filled once lengths were asked for), not the input's definition
        operands = [_plain(op) for name, op in zip(e._parameters, e.operands) if not name.startswith("_pd_")]
        nodes.append([type(e).__name__, operands])
        if not e.dependencies():
            nodes.append(_leaf_identity(e))
    return hashlib.sha256(json.dumps(nodes, default=str).encode()).hexdigest()[:16]
