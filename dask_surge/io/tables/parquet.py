"""Parquet output: a directory of part files, one per SuperBatch, and the manifest beside them.

The format every other builds on: a SuperBatch task writes its part file and creates its commit
record exclusively (:class:`~dask_surge.execution.sink.SuperBatchWriter`); the record *is* the
commit (:attr:`~.base.Output.batched` is False), and the manifest alone spells the layout
(:mod:`dask_surge.io.manifest`). A Parquet output holds one run: ``overwrite=True`` replaces it
(the old rows stay readable until the new run completes), ``mode="append"`` is for tables. Its
index is a FAISS index beside it, stamped with the run and its committed rows.
"""

from __future__ import annotations

from typing import Any

from ..manifest import current_run
from ..readers import read_embeddings
from ..store import OutputStore
from .base import Output

__all__ = ["ParquetOutput"]


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
