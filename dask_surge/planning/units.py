"""The fixed grid of streaming units: contiguous ranges of partitions, each one Dask task that
applies the two-threshold policy to its partitions as they are computed (see
:mod:`dask_surge.execution.unit`). A run records its unit size, so a resumed run cuts the
same units whatever its cluster; :func:`streamed_plan` is what such a run forms over known sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .policy import Span, SuperBatch, plan_superbatches

__all__ = ["unit_partitions", "streamed_plan", "MIN_UNITS_PER_WORKER", "MAX_UNIT_PARTITIONS"]

#: streaming units are cut so that each worker thread gets at least this many of them
#: (only a unit's last SuperBatch may be under b_min)
MIN_UNITS_PER_WORKER = 4
#: ... and hold at most this many partitions (the task carries their upstream tasks)
MAX_UNIT_PARTITIONS = 4096


def unit_partitions(npartitions: int, threads: int) -> int:
    """Partitions per streaming unit: with several worker threads each gets
    :data:`MIN_UNITS_PER_WORKER` units (balance); one thread runs one unit (fusion); and no
    unit holds more than :data:`MAX_UNIT_PARTITIONS` partitions. A run records it (with its
    thresholds), so a resumed run cuts the same units whatever its cluster.

    Examples
    --------
    >>> unit_partitions(200, 2), unit_partitions(10, 8), unit_partitions(200, 1), unit_partitions(10**6, 2)
    (25, 1, 200, 4096)
    """
    share = npartitions if threads <= 1 else math.ceil(npartitions / (MIN_UNITS_PER_WORKER * threads))
    return max(1, min(MAX_UNIT_PARTITIONS, share))


def streamed_plan(
    sizes: Sequence[int],
    b_min: int,
    b_max: int,
    per_unit: int,
    *,
    nbytes: Sequence[int] | None = None,
    max_bytes: int | None = None,
) -> list[SuperBatch]:
    """The SuperBatches the streaming mode forms over these sizes: the policy applied
    inside each unit of ``per_unit`` partitions (what :func:`dask_surge.plan` shows).

    Examples
    --------
    >>> [sb.rows for sb in streamed_plan([3, 4, 20, 1], b_min=5, b_max=8, per_unit=2)]
    [7, 8, 8, 4, 1]
    >>> [sb.rows for sb in streamed_plan([3, 3, 3, 3], b_min=5, b_max=8, per_unit=3)]
    [6, 3, 3]
    """
    out: list[SuperBatch] = []
    for start in range(0, len(sizes), per_unit):
        stop = start + per_unit
        unit_bytes = list(nbytes[start:stop]) if nbytes is not None and max_bytes else None
        for sb in plan_superbatches(
            list(sizes[start:stop]),
            b_min,
            b_max,
            nbytes=unit_bytes,
            max_bytes=max_bytes if unit_bytes is not None else None,
        ):
            spans = tuple(Span(s.partition + start, s.start, s.stop) for s in sb.spans)
            out.append(SuperBatch(len(out), spans))
    return out
