"""Committing a run's SuperBatches to a table output: moved to :mod:`dask_surge.io.tables.commits` (it
works on the output interface alone, and :meth:`~dask_surge.io.tables.Output.committer` starts it)."""

from ..io.tables.commits import TableCommitter, check_table_output, table_settled

__all__ = ["TableCommitter", "check_table_output", "table_settled"]
