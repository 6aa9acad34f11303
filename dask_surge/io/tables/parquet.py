"""Parquet output: a directory of part files, one per SuperBatch, and the manifest beside them.

The format every other builds on: a SuperBatch task writes its part file and creates its commit
record exclusively (:class:`~dask_surge.execution.sink.SuperBatchWriter`); the record *is* the
commit (:attr:`~.base.Output.batched` is False), and the manifest alone spells the layout
(:mod:`dask_surge.io.manifest`). A Parquet output holds one run: ``overwrite=True`` replaces it
(the old rows stay readable until the new run completes), ``mode="append"`` is for tables. Its
index is a FAISS index beside it, stamped with the run and its committed rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..layout import PARTITION
from ..manifest import Manifest, current_run
from ..partfiles import parquet_bytes, row_groups
from ..readers import read_embeddings
from ..store import OutputStore
from .base import Output, Staged

__all__ = ["ParquetOutput", "PartFiles"]

logger = logging.getLogger(__name__)


class ParquetOutput(Output):
    """The Parquet output in ``store`` (see the module's docstring).

    Examples
    --------
    >>> import tempfile
    >>> out = ParquetOutput(OutputStore.open(tempfile.mkdtemp()))
    >>> out.exists(), out.batched, out.overwrites, out.appends
    (False, False, True, False)
    """

    name = "parquet"
    batched = False
    appends = False
    overwrites = True

    def __init__(self, store: OutputStore) -> None:
        self.store = store

    @classmethod
    def at(cls, store: OutputStore) -> ParquetOutput:
        """The output in ``store``."""
        return cls(store)

    def __repr__(self) -> str:
        return f"ParquetOutput({self.store.location!r})"

    def exists(self) -> bool:
        """True when a dask-surge run is current in the directory."""
        return current_run(self.store) is not None

    def read(self) -> Any:
        """Every committed row (the current run's part files), as a ``pyarrow.Table``."""
        import pyarrow as pa

        return pa.Table.from_pandas(self._frame().compute(), preserve_index=False)

    def table_version(self) -> None:
        """None: an index of a Parquet output is stamped with the run's id and committed rows."""
        return None

    def _frame(self, **kw: Any) -> Any:
        return read_embeddings(self.store.location, storage_options=self.store.storage_options or None, **kw)

    def columns(self) -> list[str]:
        """The columns of the current run's part files."""
        return list(self._frame().columns)

    def read_rows(self, keys: Any, on: list[str], columns: list[str]) -> Any:
        """The rows ``keys`` names, read from the part files of their partitions only."""
        import dask
        import pandas as pd

        parts = sorted(int(p) for p in keys.partition.unique())
        frames = dask.compute(
            *(self._frame(partition=p, columns=[*on, *columns]) for p in parts), scheduler="threads"
        )
        return keys.merge(pd.concat(frames, ignore_index=True), on=on, how="inner")

    # -- a run -----------------------------------------------------------------------------------

    def stage(self, data: Any, store: OutputStore, path: str, compression: str | None) -> Staged:
        """Write ``data`` as the SuperBatch's part file at ``path`` (its run's ``staging/``: readers see it
        once it is published under its ``part-*.parquet`` name), a row group per run of whole partitions
        (:func:`~dask_surge.io.partfiles.row_groups`)."""
        import numpy as np

        # rows of each source partition (one span each, in order); skipped nulls are not among them
        groups = row_groups(np.unique(data.column(PARTITION).to_numpy(), return_counts=True)[1])
        blob = parquet_bytes(data, groups, compression)
        store.write(path, blob)
        return Staged("", len(blob), hashlib.sha256(blob).hexdigest(), path)

    def committer(self, manifest: Manifest, *, mode: str, claim: Any) -> PartFiles:
        """:class:`PartFiles` of ``manifest``: each SuperBatch's commit record is its commit."""
        return PartFiles(manifest)


class PartFiles:
    """How a Parquet run's committed part files become readable: their tasks publish them (a rename on a
    filesystem); on an object store this process does, on one thread, as it hears of each commit, so the
    client's event loop never waits on the store (:attr:`Manifest.tasks_publish`); for an overwrite the
    run's end does (:attr:`Manifest.defer_publish`). The end of the run publishes whatever is left.

    ``first`` is the wall clock when the first part file became readable (None: not yet)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.first: float | None = None
        publishes = not (manifest.tasks_publish or manifest.defer_publish)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dask-surge-publish") if publishes else None
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, sb: str, file: str, at: float | None = None) -> None:
        """SuperBatch ``sb`` committed ``file`` (``at``: when, where its task published it): publish it
        soon, once per SuperBatch."""
        if self._pool is None:
            if at is not None:
                self.first = at if self.first is None else min(self.first, at)
            return
        with self._lock:
            if not file or sb in self._seen:
                return
            self._seen.add(sb)
        with contextlib.suppress(RuntimeError):  # closed: the end of the run publishes it
            self._pool.submit(self._publish, sb, file)

    def _publish(self, sb: str, file: str) -> None:
        try:
            self.manifest.publish_file(sb, file)
        except Exception as err:  # noqa: BLE001 - the end of the run (or a rerun) publishes it, or says why
            logger.warning("dask-surge: publishing %s waits for the end of the run: %s", file, err)
            return
        if self.first is None:
            self.first = time.time()

    def close(self) -> None:
        """Wait for the files submitted so far."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """On an error: what committed is readable by ``part-*`` globs, as on a filesystem."""
        self.close()
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self.manifest.publish_pending(self.manifest.committed())
