"""Reading a run back: its committed rows, its skipped nulls and its progress.

Only commit records are trusted: a directory listing never is (see :mod:`dask_surge.io.manifest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import pandas as pd

from ..errors import SurgeInputError, SurgeValueError
from .layout import PARTITION, PAYLOAD_COLUMNS, ROW, TEXT_HASH, family_of_run
from .manifest import current_run, existing_run, text_counts

__all__ = ["read_embeddings", "skipped_rows", "status", "model_name"]


def status(output: str, storage_options: dict | None = None) -> dict:
    """Progress of the run in ``output``: partitions, SuperBatches and rows committed.

    ``state`` is ``"complete"`` once the run accounted for every input row (its
    ``COMPLETE`` marker), ``"incomplete"`` before, ``"empty"`` when there is no run.
    ``rows_planned`` and ``superbatches_planned`` are known ahead only when the run
    planned from known sizes (else None until it completes). ``model`` names the model the
    run recorded (:func:`model_name`). ``output_rows`` counts the rows of the files (one per
    token window with ``long_texts="chunk"``), ``truncated`` the texts cut at the model's
    window (-1: the model could not tell), ``encoded`` the distinct texts that went through the
    model and ``reused`` those copied from a ``reuse`` output; ``long_texts`` is the run's mode.

    Examples
    --------
    >>> status("/nonexistent/path")["state"]
    'empty'
    """
    manifest = current_run(output, storage_options)
    if manifest is None:
        return {"output": output, "state": "empty"}
    planned, done = manifest.plan, manifest.completion()
    committed = manifest.committed()
    coverage = manifest.coverage(committed)
    partitions = planned.partitions if planned is not None else None
    rows = sum(r.rows for r in committed.values())
    skipped = sum(r.skipped for r in committed.values())
    return {
        "output": output, "run": manifest.run_id,
        # the COMPLETE marker, and every partition still accounted for by a commit record
        "state": "complete" if done is not None and not coverage.missing(partitions or 0) else "incomplete",
        "mode": planned.mode if planned else None, "b_min": planned.b_min if planned else None,
        "b_max": planned.b_max if planned else None, "partitions_planned": partitions,
        "partitions_committed": sum(1 for p in range(partitions or 0) if coverage.complete(p)),
        "superbatches_committed": len(committed),
        # a run records its SuperBatches' number only once it completes (streamed ones form as they go)
        "superbatches_planned": done["superbatches"] if done else None,
        "rows_committed": rows, "rows_planned": done["rows"] if done else (planned.rows if planned else None),
        "nulls_skipped": skipped,
        "last_commit": max((r.committed_at for r in committed.values()), default=None),
        "model": model_name(manifest.fingerprint.get("model")),
        "long_texts": (manifest.fingerprint.get("long_texts") or {}).get("mode", "truncate"),
        "family": family_of_run(manifest.fingerprint),
        **text_counts(committed.values()),
    }


def model_name(identity) -> str | None:
    """A short name of the model a run recorded in its fingerprint (``model`` of :func:`status`).

    Examples
    --------
    >>> model_name({"kind": "path", "repo_id": "org/m", "commit": "0123456789abcdef"})
    'org/m@0123456789ab'
    >>> model_name({"kind": "path", "digest": "ab" * 32})
    'local model directory (sha256 abababababab)'
    >>> model_name({"kind": "object", "object": "mod.Model", "digest": "cd" * 32})
    'in-memory mod.Model (digest cdcdcdcdcdcd)'
    """
    if not isinstance(identity, dict):
        return None
    if identity.get("repo_id"):
        commit = identity.get("commit")
        return f"{identity['repo_id']}@{str(commit)[:12]}" if commit else str(identity["repo_id"])
    digest = str(identity.get("digest") or "")[:12]
    if identity.get("kind") == "object":
        return f"in-memory {identity.get('object', 'model')} (digest {digest})"
    return f"local model directory (sha256 {digest})"


def skipped_rows(output: str, storage_options: dict | None = None) -> pd.DataFrame:
    """The ``(partition, row)`` of the null texts a run left out (``on_null="skip"``).

    Read from the files that the commit records of the current run in ``output``
    name (one small Parquet file per SuperBatch that skipped any), sorted.

    Examples
    --------
    >>> import tempfile, dask.dataframe as dd, pandas as pd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", None, "c"]}), npartitions=1)
    >>> out = tempfile.mkdtemp()
    >>> from dask_surge import encode
    >>> res = encode(ddf, "text", out, b_min=2, b_max=4, on_null="skip", scheduler="sync", progress=False,
    ...              model=lambda texts: [[float(len(t))] for t in texts])
    >>> skipped_rows(out).values.tolist()
    [[0, 1]]
    """
    manifest = existing_run(output, storage_options)
    import pyarrow.parquet as pq

    frames = []
    for path in manifest.skipped_files(manifest.committed().values()):
        with manifest.fs.open(path, "rb") as f:
            frames.append(pq.read_table(f).to_pandas())
    empty = pd.DataFrame({PARTITION: pd.Series([], dtype="int64"), ROW: pd.Series([], dtype="int64")})
    out = pd.concat(frames, ignore_index=True) if frames else empty
    return out.sort_values([PARTITION, ROW], ignore_index=True)


def read_embeddings(path: str, *, partition: int | None = None, columns: Sequence[str] | None = None,
                    storage_options: dict | None = None, backend: Literal["pandas", "cudf"] = "pandas"):
    """Read the committed rows of an output directory as a Dask DataFrame.

    Only files named by commit records of the current run are read; orphan or
    half-written files are never a source of rows.

    Parameters
    ----------
    path : str
        Output directory of :func:`encode`.
    partition : int, optional
        Only this input partition's rows (only the files that hold it are read).
    columns : sequence of str, optional
        Columns to read.
    backend : {"pandas", "cudf"}
        ``"cudf"`` returns a dask-cuDF DataFrame (needs RAPIDS). cuDF has no fixed-size binary
        type, so there the ``text_hash`` column is read only when ``columns`` names it (as
        two int64 columns ``text_hash_hi`` and ``text_hash_lo``, the hash's halves).

    Examples
    --------
    >>> ddf = read_embeddings("emb/")          # doctest: +SKIP
    >>> ddf.partition.nunique().compute()      # doctest: +SKIP
    """
    import dask.dataframe as dd

    manifest = existing_run(path, storage_options)
    records = list(manifest.committed().values())  # in data order
    if any(r.table for r in records):  # a table output (format="lance"/"delta"): the table holds the rows
        raise SurgeInputError(
            f"{path!r} is a table output (format='lance' or 'delta'); its rows are in the table, not in part "
            f"files. Fix: read it with lance.dataset({path!r}).to_table() (or LanceDB), or "
            f"deltalake.DeltaTable({path!r}).to_pandas().")
    if partition is not None:
        records = [r for r in records if any(s[0] == partition and s[2] > s[1] for s in r.spans)]
    files = manifest.data_urls(records)
    if not files:
        raise SurgeInputError(f"{path!r} has no committed rows" + (
            f" for partition {partition}" if partition is not None else "") + ". Fix: run (or resume) "
            "the encode into it first, or check the partition id against dask_surge.status(path).")
    filters = [(PARTITION, "==", partition)] if partition is not None else None
    if backend not in ("pandas", "cudf"):
        raise SurgeValueError(f"backend={backend!r} is not supported. Fix: use backend='pandas' or 'cudf'.")
    if backend == "cudf":
        names = list(columns) if columns else [n for n in _schema_names(files[0], storage_options) if n != TEXT_HASH]
        frame = dd.read_parquet(files, columns=names, filters=filters, storage_options=storage_options)
        if TEXT_HASH in names:
            frame = frame.map_partitions(_split_hash)
        return frame.to_backend("cudf")
    return dd.read_parquet(files, columns=list(columns) if columns else None, filters=filters,
                           storage_options=storage_options,
                           arrow_to_pandas=_ArrowToPandas(types_mapper=_embedding_types))


def _schema_names(path: str, storage_options: dict | None) -> list[str]:
    import pyarrow.parquet as pq
    from fsspec.core import url_to_fs

    fs, p = url_to_fs(path, **(storage_options or {}))
    with fs.open(p, "rb") as f:
        return list(pq.read_schema(f).names)


def _split_hash(part):
    """``text_hash`` (16 bytes) as two int64 columns, for engines without a binary type (cuDF)."""
    import numpy as np

    col = part.pop(TEXT_HASH)
    raw = np.frombuffer(b"".join(col.tolist()), dtype=">u8").reshape(-1, 2) if len(col) else np.zeros((0, 2), ">u8")
    at = next((part.columns.get_loc(c) for c in part.columns if c in PAYLOAD_COLUMNS), len(part.columns))
    part.insert(at, "text_hash_hi", raw[:, 0].astype(np.uint64).view(np.int64))
    part.insert(at + 1, "text_hash_lo", raw[:, 1].astype(np.uint64).view(np.int64))
    return part


def _embedding_types(pa_type):
    """Read the model's output columns as pandas ArrowDtype columns, zero-copy: fixed-size lists
    (embeddings) and lists (a sparse row's ``indices`` and ``values``, a multi-vector row's ``vectors``)."""
    import pyarrow as pa

    return pd.ArrowDtype(pa_type) if pa.types.is_fixed_size_list(pa_type) or pa.types.is_list(pa_type) else None


class _ArrowToPandas(dict[str, Any]):
    """``read_parquet``'s ``arrow_to_pandas`` options, whose ``types_mapper`` Dask cannot nest.

    Dask's pyarrow engine builds its own types mapper around the one given, then stores it back
    into this dict, which its plan cache shares with every later ``read_parquet`` of the same
    files: each partition read in this process wrapped the mapper once more, until tokenizing
    the chain of wrappers failed (``TokenizationError``, after about 110). Dask asks for the
    given mapper with ``get``: here it gets :func:`_embedding_types` every time, so the mapper
    it builds (and stores) stays one wrapper deep.

    Examples
    --------
    >>> opts = _ArrowToPandas(types_mapper=_embedding_types)
    >>> opts["types_mapper"] = len  # as Dask stores its wrapper
    >>> opts.get("types_mapper") is _embedding_types, opts["types_mapper"] is len
    (True, True)
    """

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return _embedding_types if key == "types_mapper" else super().get(key, default)
