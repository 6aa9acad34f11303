"""What a written run can tell before any worker starts.

Starting a local cluster costs seconds (each worker imports torch), so :func:`dask_surge.encode`
asks here first:

- :func:`preflight`: the checks that need no worker (an output inside the input, other
  files in the output, a different run already there) fail at once, and a run that is
  already complete answers without starting anything ("complete: N rows, nothing to do").
- :func:`runs_in_process` (and, for inputs whose rows are not known ahead, the command
  line's :func:`small_files`): an input small enough that starting workers would cost more
  than encoding it runs in this process instead (``scheduler="threads"``), unless the
  caller chose where it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..io.manifest import current_run, find_run, fingerprint_digest, other_run_error, settled
from ..io.store import OutputStore
from ..planning.sizes import known_sizes
from ..results import EncodeResult
from .runner import complete_result

__all__ = [
    "preflight",
    "runs_in_process",
    "say_in_process",
    "small_files",
    "IN_PROCESS_ROWS",
    "IN_PROCESS_BYTES",
]

logger = logging.getLogger(__name__)

#: an input of at most this many rows (known from metadata) runs in this process when no
#: cluster is given: on 2 cores a local cluster takes 6-10 s to start, more than such an
#: input takes to encode (``docs/performance.md``, a new user's small run)
IN_PROCESS_ROWS = 5_000

#: the same for an input whose rows are not known ahead (CSV, JSON lines): its files' total size
IN_PROCESS_BYTES = 2 * 1024**2


def preflight(
    store: OutputStore,
    frame: Any,
    fingerprint: dict,
    *,
    overwrite: bool,
    started: float,
    output: Any,
) -> EncodeResult | None:
    """Check the output for the run of ``fingerprint`` before workers start (the location itself
    was checked when it was opened: :func:`~dask_surge.io.directory.check_output`).

    ``output``: the run's :class:`~dask_surge.io.tables.Output` at ``store`` (it says whether what a
    complete run committed is all there and readable: a table's history holds each SuperBatch once).

    Returns
    -------
    EncodeResult or None
        The result of a run that is already complete there (nothing is computed, no worker
        starts); None when there is work to do.

    Raises
    ------
    SurgeOutputError
        As the run itself would (:func:`~dask_surge.io.manifest.open_run`), but at once: the
        output holds a different run (without ``overwrite``).
    """
    found = find_run(store, fingerprint)
    if found is not None:
        output.bind(found)
    # a complete run answers here unless a killed process left its clean-up (the run's own path finishes it)
    if (
        found is not None
        and found.completion() is not None
        and not overwrite
        and not found.coverage().missing(frame.npartitions)
        and settled(found, found.committed())
        and output.settled(found)
    ):
        return complete_result(found, store.location, started)
    current = current_run(store)
    if (
        current is not None
        and current.run_id != fingerprint_digest(fingerprint)
        and not overwrite
        and not (current.stopped() and not current.committed())
    ):
        raise other_run_error(store.location, current, fingerprint, table=output.appends)
    return None


def runs_in_process(frame: Any, column: str) -> int | None:
    """Rows of ``frame`` when they are known from metadata (Parquet footers, in-memory data)
    and at most :data:`IN_PROCESS_ROWS`, so that encoding them in this process takes less
    than starting a local cluster would; None otherwise (an input whose rows are not known
    ahead: see :func:`small_files`)."""
    sizes = known_sizes(frame[[column]], column, None)
    return sizes.total if sizes is not None and sizes.total <= IN_PROCESS_ROWS else None


def small_files(paths: Sequence[str]) -> bool:
    """Whether the input files ``paths`` (local paths or fsspec URLs) hold at most
    :data:`IN_PROCESS_BYTES` in all: how the command line judges an input whose rows are not
    known ahead (CSV, JSON lines). A path that cannot be sized counts as large."""
    from fsspec.core import url_to_fs

    total = 0
    try:
        for name in paths:
            fs, path = url_to_fs(name)
            total += int(fs.size(path) or 0)
            if total > IN_PROCESS_BYTES:
                return False
    except (OSError, ValueError, TypeError):
        return False
    return bool(paths)


def say_in_process(rows: int) -> None:
    """Tell the user where a small run goes (and how to send it to a cluster)."""
    what = f"{rows:,} rows" if rows >= 0 else "a small input"
    logger.warning(
        "dask-surge: %s: encoding in this process (starting workers would take longer); pass a "
        "distributed Client or scheduler= to run elsewhere",
        what,
    )
