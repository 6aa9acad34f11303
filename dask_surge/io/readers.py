"""Reading a run back: its committed rows, its skipped nulls and its progress.

Only commit records are trusted: a directory listing never is (see :mod:`dask_surge.io.manifest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import pandas as pd

from ..errors import SurgeInputError, SurgeValueError
from ..families import family_of_run
from .layout import PARTITION, PAYLOAD_COLUMNS, ROW, TEXT_HASH
from .manifest import current_run, existing_run, text_counts
from .store import OutputStore

__all__ = ["read_embeddings", "skipped_rows", "status", "model_name", "frame_of"]


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
    manifest = current_run(OutputStore.open(output, storage_options))
    if manifest is None:
        return {"output": output, "state": "empty"}
    planned, done = manifest.plan, manifest.completion()
    committed = manifest.committed()
    coverage = manifest.coverage(committed)
    partitions = planned.partitions if planned is not None else None
    rows = sum(r.rows for r in committed.values())
    skipped = sum(r.skipped for r in committed.values())
    return {
        "output": output,
        "run": manifest.run_id,
        # the COMPLETE marker, and every partition still accounted for by a commit record
        "state": "complete" if done is not None and not coverage.missing(partitions or 0) else "incomplete",
        "mode": planned.mode if planned else None,
        "b_min": planned.b_min if planned else None,
        "b_max": planned.b_max if planned else None,
        "partitions_planned": partitions,
        "partitions_committed": sum(1 for p in range(partitions or 0) if coverage.complete(p)),
        "superbatches_committed": len(committed),
        # a run records its SuperBatches' number only once it completes (streamed ones form as they go)
        "superbatches_planned": done["superbatches"] if done else None,
        "rows_committed": rows,
        "rows_planned": done["rows"] if done else (planned.rows if planned else None),
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
    manifest = existing_run(OutputStore.open(output, storage_options))
    import pyarrow.parquet as pq

    frames = []
    for path in manifest.skipped_files(manifest.committed().values()):
        frames.append(pq.read_table(manifest.store.source(path)).to_pandas())
    empty = pd.DataFrame({PARTITION: pd.Series([], dtype="int64"), ROW: pd.Series([], dtype="int64")})
    out = pd.concat(frames, ignore_index=True) if frames else empty
    return out.sort_values([PARTITION, ROW], ignore_index=True)


def read_embeddings(
    path: str,
    *,
    partition: int | None = None,
    columns: Sequence[str] | None = None,
    storage_options: dict | None = None,
    backend: Literal["pandas", "cudf"] = "pandas",
):
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

    if backend not in ("pandas", "cudf"):
        raise SurgeValueError(f"backend={backend!r} is not supported. Fix: use backend='pandas' or 'cudf'.")
    store = OutputStore.open(path, storage_options)
    manifest = existing_run(store)
    records = list(manifest.committed().values())  # in data order
    # a table output (format="lance"/"delta"/"iceberg"): the table holds the rows
    if any(r.table for r in records):
        raise SurgeInputError(
            f"{path!r} is a table output (format='lance', 'delta' or 'iceberg'); its rows are in the table, not "
            f"in part files. Fix: read it with lance.dataset({path!r}).to_table() (or LanceDB), "
            f"deltalake.DeltaTable({path!r}).to_pandas(), or an Iceberg catalog's load_table(...).scan()."
        )
    if partition is not None:
        records = [r for r in records if any(s[0] == partition and s[2] > s[1] for s in r.spans)]
    files = manifest.data_paths(records)
    if not files:
        raise SurgeInputError(
            f"{path!r} has no committed rows"
            + (f" for partition {partition}" if partition is not None else "")
            + ". Fix: run (or resume) "
            "the encode into it first, or check the partition id against dask_surge.status(path)."
        )
    names = list(columns) if columns else None
    if backend == "cudf" and names is None:
        names = [n for n in _PartReader(store).schema(files[0]).names if n != TEXT_HASH]
    reader = _PartReader(store, partition, names)
    meta = reader.meta(files[0], names)
    import dask

    # the frame's dtypes are Arrow's mapping (frame_of): text columns already str, text_hash bytes; Dask's
    # convert-string would cast those bytes to str (and fail on them)
    with dask.config.set({"dataframe.convert-string": False}):
        frame = dd.from_map(reader, files, meta=meta, enforce_metadata=False, label="read-embeddings")
    if backend == "cudf":
        if names is not None and TEXT_HASH in names:
            frame = frame.map_partitions(_split_hash)
        return frame.to_backend("cudf")
    return frame


class _PartReader:
    """Reads one committed part file as pandas (``dd.from_map``'s function): each file is opened
    by its path through the output's store, never matched as a pattern (a directory named
    ``emb[1]`` reads as itself), its ``partition`` filter applied to row groups, and the model's
    output columns mapped zero-copy to pandas ArrowDtype columns. A column selection on the frame
    reads only those columns (``columns=``, as Dask projects them)."""

    def __init__(
        self, store: OutputStore, partition: int | None = None, columns: Sequence[str] | None = None
    ) -> None:
        self.store, self.partition, self.columns = (
            store,
            partition,
            None if columns is None else list(columns),
        )

    def __dask_tokenize__(self) -> tuple:
        return ("read-embeddings", self.store.__dask_tokenize__(), self.partition, self.columns)

    def schema(self, path: str):
        import pyarrow.parquet as pq

        return pq.read_schema(self.store.source(path))

    def meta(self, path: str, columns: Sequence[str] | None) -> pd.DataFrame:
        table = self.schema(path).empty_table()
        return frame_of(table.select(list(columns)) if columns else table)

    def __call__(self, path: str, columns: Sequence[str] | None = None) -> pd.DataFrame:
        import pyarrow.parquet as pq

        filters = [(PARTITION, "==", self.partition)] if self.partition is not None else None
        wanted = list(columns) if columns is not None else self.columns
        return frame_of(pq.read_table(self.store.source(path), columns=wanted, filters=filters))


def frame_of(table) -> pd.DataFrame:
    """A part file's Arrow ``table`` as :func:`read_embeddings` gives its partitions: the model's
    output columns (fixed-size lists, lists) as pandas ArrowDtype columns, zero-copy.

    Examples
    --------
    >>> import pyarrow as pa
    >>> emb = pa.FixedSizeListArray.from_arrays(pa.array([1.0, 2.0], pa.float32()), 2)
    >>> frame_of(pa.table({"row": [0], "embedding": emb})).dtypes["embedding"]
    fixed_size_list<item: float>[2][pyarrow]
    """
    return table.to_pandas(types_mapper=_embedding_types)


def _split_hash(part):
    """``text_hash`` (16 bytes) as two int64 columns, for engines without a binary type (cuDF)."""
    import numpy as np

    col = part.pop(TEXT_HASH)
    raw = (
        np.frombuffer(b"".join(col.tolist()), dtype=">u8").reshape(-1, 2)
        if len(col)
        else np.zeros((0, 2), ">u8")
    )
    at = next((part.columns.get_loc(c) for c in part.columns if c in PAYLOAD_COLUMNS), len(part.columns))
    part.insert(at, "text_hash_hi", raw[:, 0].astype(np.uint64).view(np.int64))
    part.insert(at + 1, "text_hash_lo", raw[:, 1].astype(np.uint64).view(np.int64))
    return part


def _embedding_types(pa_type):
    """Read the model's output columns as pandas ArrowDtype columns, zero-copy: fixed-size lists
    (embeddings) and lists (a sparse row's ``indices`` and ``values``, a multi-vector row's ``vectors``)."""
    import pyarrow as pa

    return (
        pd.ArrowDtype(pa_type) if pa.types.is_fixed_size_list(pa_type) or pa.types.is_list(pa_type) else None
    )
