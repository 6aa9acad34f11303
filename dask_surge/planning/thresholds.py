"""The SuperBatch thresholds of a run: one resolver that :func:`~dask_surge.api.plan`,
:func:`~dask_surge.api.encode` and the CLI all call, so they always agree.

A threshold is requested as a positive row count or ``"auto"`` (argument, else the
``surge.b-min`` / ``surge.b-max`` config). ``"auto"`` is resolved from, in order:

1. a calibration of this model and cluster (:mod:`dask_surge.execution.calibrate`), through
   :func:`dask_surge.planning.costmodel.auto_thresholds` (memory budget, TTFO target);
2. else the defaults below, chosen as a few seconds of work per SuperBatch:
   100,000 / 400,000 rows on a GPU (the paper's setting), 8,192 / 32,768 on a CPU.

A given threshold is kept as given; an automatic one never contradicts it (an automatic
``b_min`` is at most a given ``b_max``, an automatic ``b_max`` at least a given ``b_min``).
When the total number of rows is known, an automatic ``b_min`` is also lowered so that
every worker thread gets :data:`MIN_SUPERBATCHES_PER_WORKER` SuperBatches, then, where
the plan can be replayed, balanced so the threads' last SuperBatches end together
(:func:`balanced_b_min`).

A written run records the thresholds it resolved in its manifest, and a resumed run
reuses them whatever the cluster's shape is now (see :mod:`dask_surge.io.manifest`).
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .. import config
from ..errors import SurgeValueError
from .costmodel import auto_thresholds
from .policy import validate_thresholds

__all__ = [
    "Thresholds",
    "requested_thresholds",
    "resolve_thresholds",
    "DEFAULTS",
    "window_byte_cap",
    "MIN_SUPERBATCHES_PER_WORKER",
    "balanced_b_min",
    "makespan",
]

#: ``(b_min, b_max)`` for ``"auto"`` without a calibration, by device kind. On a CPU a
#: SuperBatch is also the fast engine's sorting window: smaller ones pad more (a micro-batch
#: of a narrow model holds up to 8,192 tokens, ~250 texts, a tenth of a 2,800-text window) and
#: pay their fixed cost (task, read setup, write, fsync, commit) more often; 8,192 rows of
#: MiniLM are still a few seconds of work a core. The A/B against 4,096 / 16,384 is in
#: ``docs/ab_studies.md`` ("Automatic CPU thresholds").
DEFAULTS = {"gpu": (100_000, 400_000), "cpu": (8_192, 32_768)}

#: an automatic b_min gives each worker thread at least this many SuperBatches: with fewer,
#: the last one runs alone while the others idle (the ``bmin`` suite of the paper's
#: reproduction shows it, ``docs/performance.md``)
MIN_SUPERBATCHES_PER_WORKER = 4

#: balancing looks at plans with at most this many SuperBatches per worker thread: beyond, the
#: last round is under 1/16 of the run
BALANCE_MAX_SUPERBATCHES_PER_WORKER = 16

#: partitions x candidate plans that balancing may replan (bounds the client's planning time)
BALANCE_WORK = 200_000

#: characters per token a byte cap on token windows assumes: few, so the cap errs small (prose runs ~4)
CHARS_PER_TOKEN = 3

Requested = int | Literal["auto"]


def window_byte_cap(
    max_bytes: int | None, b_max: Requested, capacity: int, overlap: int, *, gpu: bool
) -> int:
    """The byte cap of a SuperBatch whose texts are cut into token windows (``long_texts="chunk"``
    or ``"mean"``): what is encoded at once is windows, not texts, so the text bytes are capped
    at about ``b_max`` windows' worth (``b_max`` as requested, ``"auto"`` meaning its default),
    and at ``max_bytes``.

    Examples
    --------
    >>> window_byte_cap(None, 1000, 254, 32, gpu=False)
    666000
    >>> window_byte_cap(100_000, "auto", 254, 32, gpu=False)
    100000
    """
    rows = DEFAULTS["gpu" if gpu else "cpu"][1] if b_max == "auto" else int(b_max)
    cap = rows * max(1, capacity - overlap) * CHARS_PER_TOKEN
    return cap if max_bytes is None else min(max_bytes, cap)


@dataclass(frozen=True)
class Thresholds:
    """Resolved thresholds and a sentence saying where they came from."""

    b_min: int
    b_max: int
    reason: str


def _requested_one(name: str, value: Any) -> Requested:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise SurgeValueError(
            f"{name}={value!r} is neither a positive number of rows nor 'auto'. "
            f"Fix: pass a positive int, e.g. {name}=100_000, or {name}='auto'."
        )
    if operator.index(value) <= 0:
        raise SurgeValueError(
            f"{name}={value!r} must be positive: a SuperBatch holds at least one row. "
            f"Fix: pass a positive int, e.g. {name}=100_000, or {name}='auto'."
        )
    return operator.index(value)


def requested_thresholds(b_min: Any = None, b_max: Any = None) -> tuple[Requested, Requested]:
    """The thresholds as asked for (argument, else config), checked, ``"auto"`` kept.

    Raises
    ------
    SurgeValueError
        If a value is neither a positive int nor ``"auto"``, or both are given and
        ``b_min > b_max``.

    Examples
    --------
    >>> requested_thresholds(5000, None)
    (5000, 'auto')
    """
    raw_min = _requested_one("b_min", config.get("b-min") if b_min is None else b_min)
    raw_max = _requested_one("b_max", config.get("b-max") if b_max is None else b_max)
    if raw_min != "auto" and raw_max != "auto":
        validate_thresholds(raw_min, raw_max)
    return raw_min, raw_max


def resolve_thresholds(
    b_min: Any = None,
    b_max: Any = None,
    *,
    gpu: bool,
    workers: int = 1,
    total_rows: int | None = None,
    n_max: int | None = None,
    params: Any = None,
    superbatch_work: Callable[[int, int], Sequence[int]] | None = None,
    partitions: int = 0,
) -> Thresholds:
    """Resolve ``b_min`` / ``b_max`` for a run (see module docstring).

    Parameters
    ----------
    b_min, b_max : int, "auto" or None
        As requested; None reads ``surge.b-min`` / ``surge.b-max``.
    gpu : bool
        Whether the SuperBatches encode on a GPU (picks the defaults).
    workers : int
        Worker threads that run SuperBatches.
    total_rows, n_max : int or None
        Rows in the input and in its largest partition, when known (None in the
        streaming mode, where sizes arrive as partitions are computed).
    params : dask_surge.planning.costmodel.CostParams or None
        A calibration of this model and cluster; None uses the defaults.
    superbatch_work : callable or None
        ``(b_min, b_max) -> work of each SuperBatch`` of the run's plan (its rows, or its
        text bytes where known), where sizes are known: an automatic ``b_min`` is then
        balanced over the worker threads (:func:`balanced_b_min`). None skips that.
    partitions : int
        Input partitions (bounds the replanning balancing may do).

    Examples
    --------
    >>> resolve_thresholds(None, 5, gpu=False, total_rows=12)
    Thresholds(b_min=3, b_max=5, reason='the CPU default for b_min (no calibration of this model on a cluster of this shape); b_min lowered to 3 to spread 12 rows over 1 worker thread (aiming at 4 SuperBatches each)')
    >>> resolve_thresholds(100, "auto", gpu=True).b_max
    400000
    """
    raw_min, raw_max = requested_thresholds(b_min, b_max)
    candidates = min(9, BALANCE_WORK // max(1, partitions))
    if candidates < 2:
        superbatch_work = None  # too many partitions to replan: the tail is left as planned
    autos = [name for name, raw in (("b_min", raw_min), ("b_max", raw_max)) if raw == "auto"]
    given_min = None if raw_min == "auto" else raw_min
    given_max = None if raw_max == "auto" else raw_max
    if not autos:
        lo, hi = validate_thresholds(raw_min, raw_max)
        return Thresholds(lo, hi, "as given")
    if params is not None:
        budget = config.get("memory-budget") or 2 * 1024**3
        # n_max unknown (streaming): the resident rows are bounded by b_max alone
        lo, hi, why = auto_thresholds(
            params,
            memory_budget_bytes=budget,
            ttfo_target_s=config.get("ttfo-target"),
            n_max=n_max or 2**62,
            b_min=given_min,
            b_max=given_max,
        )
    else:
        auto_min, auto_max = DEFAULTS["gpu" if gpu else "cpu"]
        lo = given_min if given_min is not None else min(auto_min, given_max or auto_min)
        hi = given_max if given_max is not None else max(auto_max, lo)
        why = (
            f"the {'GPU' if gpu else 'CPU'} default for {' and '.join(autos)} (no calibration of this model "
            "on a cluster of this shape)"
        )
    if raw_min == "auto" and total_rows:
        spread = max(1, math.ceil(total_rows / (MIN_SUPERBATCHES_PER_WORKER * max(1, workers))))
        if spread < lo:
            lo = spread
            threads = f"{workers} worker thread{'s' if workers != 1 else ''}"
            why += (
                f"; b_min lowered to {lo:,} to spread {total_rows:,} rows over {threads} (aiming at "
                f"{MIN_SUPERBATCHES_PER_WORKER} SuperBatches each)"
            )
    lo, hi = validate_thresholds(lo, hi)
    if (
        raw_min == "auto"
        and superbatch_work is not None
        and workers > 1
        and total_rows
        and total_rows <= BALANCE_MAX_SUPERBATCHES_PER_WORKER * workers * hi
    ):
        best = balanced_b_min(lo, hi, workers, superbatch_work, candidates=candidates)
        if best != lo:
            why += f"; b_min {lo:,} -> {best:,} so the last SuperBatches of {workers} worker threads end together"
            lo = best
    return Thresholds(lo, hi, why)


def makespan(work: Sequence[int], workers: int) -> int:
    """When the last of SuperBatches of ``work`` ends (in units of work) if each of
    ``workers`` threads takes the next one in plan order as soon as it is free (as Dask
    runs them by priority).

    Examples
    --------
    >>> makespan([4, 4, 4], 2), makespan([3, 3, 3, 3], 2)
    (8, 6)
    """
    free = [0] * max(1, workers)
    for n in work:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free)


def balanced_b_min(
    b_min: int,
    b_max: int,
    workers: int,
    superbatch_work: Callable[[int, int], Sequence[int]],
    *,
    candidates: int = 9,
) -> int:
    """The automatic ``b_min`` whose plan ends soonest on ``workers`` threads.

    With a few SuperBatches per thread, the last ones run alone while the other threads
    idle (``docs/ab_studies.md``, "Balance an automatic b_min"). This tries ``b_min`` and ``candidates - 1`` values down to
    half of it, replans each (``superbatch_work(b_min, b_max)``: the work of each
    SuperBatch the run would plan, e.g. its rows) and keeps the largest whose :func:`makespan` is within
    1% of the best (fewer, larger calls on a tie). The two-threshold policy is unchanged:
    only the value of ``b_min`` it is given. A plan's work sums to the same total whatever
    ``b_min`` (each row is in one SuperBatch), so no plan ends before ``total / workers``:
    when ``b_min``'s own plan is within 1% of that, it is kept without replanning (the same
    answer, without replanning before the first task).

    Examples
    --------
    >>> from dask_surge.planning.policy import plan_superbatches
    >>> rows = lambda lo, hi: [sb.rows for sb in plan_superbatches([10] * 70, lo, hi)]
    >>> len(rows(100, 400)), balanced_b_min(100, 400, 2, rows), len(rows(69, 400))
    (7, 69, 10)
    >>> makespan(rows(100, 400), 2), makespan(rows(69, 400), 2)
    (400, 350)
    >>> balanced_b_min(100, 400, 2, lambda lo, hi: [sb.rows for sb in plan_superbatches([10] * 80, lo, hi)])
    100
    """
    work = superbatch_work(b_min, b_max)
    if makespan(work, workers) * max(1, workers) <= sum(work) * 1.01:
        return b_min  # within 1% of total / workers, which no plan beats (each row is in one SuperBatch)
    tried = sorted(
        {max(1, b_min - (b_min * i) // (2 * (candidates - 1))) for i in range(max(2, candidates))},
        reverse=True,
    )
    spans = {lo: makespan(work if lo == b_min else superbatch_work(lo, b_max), workers) for lo in tried}
    best = min(spans.values())
    return next(lo for lo in tried if spans[lo] <= best * 1.01)
