"""The SuperBatch two-threshold policy (SURGE, Lemma 3).

This module is pure: no Dask, no I/O. It turns a sequence of partition sizes
into SuperBatches, either all at once (:func:`plan_superbatches`, sizes known
up front) or incrementally (:class:`OnlinePlanner`, sizes arriving one by one as
partitions finish). Both produce exactly the same SuperBatches for the same
sizes.

The rule, walking partitions in order with a buffer of ``b`` rows (and ``m``
text bytes, when partition byte sizes ``m_i`` and a byte cap ``max_bytes`` are
given):

1. if ``n_i > b_max`` or ``m_i > max_bytes``: flush the buffer (if non-empty),
   then emit row-slices of partition ``i`` of ``r`` rows each (the last may be
   shorter), ``r = min(b_max, floor(n_i max_bytes / m_i))`` but at least 1;
2. else if ``b + n_i > b_max`` or ``m + m_i > max_bytes``: flush, then start
   the buffer with ``i``;
3. else add ``i``; if now ``b >= b_min``, flush;
4. at the end, flush what remains.

Every SuperBatch then holds at most ``min(b_max, b_min - 1 + n_max)`` rows, so
the memory a worker needs for one SuperBatch does not grow with the number of
rows ``N``. With a byte cap, a SuperBatch of whole partitions also holds at
most ``max_bytes`` bytes of text, and a slice about ``max_bytes`` (slices
assume the partition's bytes spread evenly over its rows; one row larger than
``max_bytes`` is a SuperBatch of its own). The byte cap bounds every SuperBatch;
without it (``max_bytes=None``) or when it never binds, the plan is exactly the
rows-only plan (when it binds, later boundaries may shift either way).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import SurgeValueError

__all__ = [
    "Span",
    "SuperBatch",
    "plan_superbatches",
    "OnlinePlanner",
    "validate_thresholds",
    "validate_max_bytes",
]


@dataclass(frozen=True, slots=True)
class Span:
    """Rows ``[start, stop)`` of input partition ``partition``."""

    partition: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def __dask_tokenize__(self) -> tuple:
        # Dask tokenizes task arguments field by field through dataclasses.fields, slow for many
        # Spans on the client before the first task; three ints say it all
        return ("Span", self.partition, self.start, self.stop)


@dataclass(frozen=True, slots=True)
class SuperBatch:
    """One encode call: consecutive spans of consecutive partitions.

    Attributes
    ----------
    index : int
        Position of this SuperBatch in the plan (0, 1, 2, ...). Deterministic:
        the same sizes and thresholds always give the same indices.
    spans : tuple of Span
        The row ranges it covers, in input order. Either whole partitions, or
        a single row-slice of one partition larger than ``b_max``.
    """

    index: int
    spans: tuple[Span, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.spans)

    def __dask_tokenize__(self) -> tuple:
        return ("SuperBatch", self.index, tuple((s.partition, s.start, s.stop) for s in self.spans))

    @property
    def partitions(self) -> tuple[int, ...]:
        return tuple(s.partition for s in self.spans)


def validate_max_bytes(max_bytes: object) -> int | None:
    """Check the byte cap of a SuperBatch: ``None`` (no cap) or a positive int.

    Examples
    --------
    >>> validate_max_bytes(2**20), validate_max_bytes(None)
    (1048576, None)
    """
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not hasattr(max_bytes, "__index__") or operator.index(max_bytes) <= 0:
        raise SurgeValueError(
            f"max_bytes={max_bytes!r} must be a positive integer number of bytes (or None for no "
            "byte cap): it caps the text bytes of one SuperBatch. Fix: pass e.g. max_bytes=256 * 2**20, "
            "or set surge.max-bytes to a size such as '256 MiB'."
        )
    return operator.index(max_bytes)  # type: ignore[arg-type]


def validate_thresholds(b_min: object, b_max: object) -> tuple[int, int]:
    """Check the two thresholds and return them as ints.

    Raises
    ------
    SurgeValueError
        If either is not a positive integer or ``b_min > b_max``.

    Examples
    --------
    >>> validate_thresholds(100, 1000)
    (100, 1000)
    """
    for name, value in (("b_min", b_min), ("b_max", b_max)):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise SurgeValueError(
                f"{name}={value!r} is not an integer: thresholds count rows. "
                f"Fix: pass a positive int, e.g. {name}=100_000."
            )
        if operator.index(value) <= 0:  # type: ignore[arg-type]
            raise SurgeValueError(
                f"{name}={value!r} must be positive: a SuperBatch holds at least one row. "
                f"Fix: pass a positive int, e.g. {name}=100_000."
            )
    b_min, b_max = operator.index(b_min), operator.index(b_max)  # type: ignore[arg-type]
    if b_min > b_max:
        raise SurgeValueError(
            f"b_min={b_min} is larger than b_max={b_max}: the flush threshold must not "
            f"exceed the hard cap. Fix: lower b_min or raise b_max (e.g. b_max={4 * b_min})."
        )
    return b_min, b_max


def validate_first(first: object) -> int | None:
    """Check the ramp's first threshold (see :class:`OnlinePlanner`): a positive int or None.

    Raises
    ------
    SurgeValueError
        If ``first`` is neither.

    Examples
    --------
    >>> validate_first(256), validate_first(None)
    (256, None)
    """
    if first is None:
        return None
    if isinstance(first, bool) or not hasattr(first, "__index__") or operator.index(first) <= 0:  # type: ignore[arg-type]
        raise SurgeValueError(
            f"first={first!r} is not a positive integer: it is the rows of the first SuperBatch, whose "
            "threshold doubles up to b_min. Fix: pass e.g. first=256, or None for no ramp."
        )
    return operator.index(first)  # type: ignore[arg-type]


class OnlinePlanner:
    """Form SuperBatches as partition sizes arrive, one at a time.

    Parameters
    ----------
    b_min, b_max : int
        Flush threshold and hard cap, in rows.
    max_bytes : int, optional
        Cap on the text bytes of one SuperBatch (used when :meth:`push` is given
        byte sizes); ``None``: rows only.
    first : int, optional
        A ramp: the flush threshold of SuperBatch ``k`` is ``min(b_min, first * 2**k)``,
        so the first ones are small and the first output comes early (the work before
        it is one small SuperBatch, not ``b_min`` rows), then the thresholds double up to
        ``b_min``; ``b_max`` caps them all. Can be a positive int, or None (the default)
        for ``b_min`` from the start.
    cut : bool
        With a ramp: while it lasts, a SuperBatch also holds at most its threshold, the
        partition that would overflow it cut at the threshold (the rest goes on to the next
        ones), so the first SuperBatch holds exactly ``first`` rows however large the
        partitions are. A new run's ramp cuts; a run recorded with whole-partition ramps
        (False, the default) re-plans them as it made them.

    Examples
    --------
    >>> p = OnlinePlanner(b_min=5, b_max=8)
    >>> [sb.rows for sb in p.push(3)], [sb.rows for sb in p.push(4)]
    ([], [7])
    >>> [sb.rows for sb in p.push(20)], [sb.rows for sb in p.finish()]
    ([8, 8, 4], [])

    A partition of a few huge texts: 3 rows of 1 MB each, under a 2 MB cap.

    >>> p = OnlinePlanner(b_min=5, b_max=8, max_bytes=2_000_000)
    >>> [sb.rows for sb in p.push(3, nbytes=3_000_000) + p.finish()]
    [2, 1]

    A ramp from 1 row: thresholds 1, 2, 4, then ``b_min``.

    >>> p = OnlinePlanner(b_min=5, b_max=8, first=1)
    >>> [sb.rows for n in [1, 1, 1, 1, 3, 2, 2, 2] for sb in p.push(n)] + [sb.rows for sb in p.finish()]
    [1, 2, 4, 6]

    A cut ramp over partitions of 10 rows: the first SuperBatches hold 2, then 4 rows.

    >>> p = OnlinePlanner(b_min=5, b_max=8, first=2, cut=True)
    >>> [(sb.rows, sb.spans[0].start) for sb in p.push(10) + p.finish()]
    [(2, 0), (4, 2), (4, 6)]
    """

    def __init__(
        self,
        b_min: int,
        b_max: int,
        max_bytes: int | None = None,
        *,
        first: int | None = None,
        cut: bool = False,
    ) -> None:
        self.b_min, self.b_max = validate_thresholds(b_min, b_max)
        self.max_bytes = validate_max_bytes(max_bytes)
        self.first = validate_first(first)
        self.cut = bool(cut)
        self._buffer: list[Span] = []
        self._rows = 0
        self._bytes = 0
        self._next_partition = 0
        self._next_index = 0
        self._finished = False

    @property
    def threshold(self) -> int:
        """The flush threshold of the next SuperBatch: ``b_min``, or less while the ramp lasts."""
        if self.first is None or self.first >= self.b_min:
            return self.b_min
        return min(self.b_min, self.first << min(self._next_index, 62))

    @property
    def partitions_seen(self) -> int:
        return self._next_partition

    @property
    def buffered_rows(self) -> int:
        return self._rows

    def _emit(self, spans: Sequence[Span]) -> SuperBatch:
        sb = SuperBatch(self._next_index, tuple(spans))
        self._next_index += 1
        return sb

    def _flush(self) -> list[SuperBatch]:
        if not self._buffer:
            return []
        sb = self._emit(self._buffer)
        self._buffer, self._rows, self._bytes = [], 0, 0
        return [sb]

    def push(self, size: int, nbytes: int | None = None) -> list[SuperBatch]:
        """Add the next partition (``size`` rows, ``nbytes`` bytes of text if known);
        return the SuperBatches it completes."""
        if self._finished:
            raise SurgeValueError(
                "push() after finish(): this planner's plan is complete. Fix: create a new OnlinePlanner per run."
            )
        for name, value in (("size", size), ("nbytes", 0 if nbytes is None else nbytes)):
            if isinstance(value, bool) or int(value) != value or value < 0:
                raise SurgeValueError(
                    f"partition {self._next_partition} has {name} {value!r}: sizes must be "
                    f"non-negative integers (rows, bytes). Fix: pass the row count (and text bytes) of each partition."
                )
        total, i = int(size), self._next_partition
        m = int(nbytes or 0) if self.max_bytes and total else 0  # an empty partition holds no text
        cap = self.max_bytes or 0
        self._next_partition += 1
        out: list[SuperBatch] = []
        base = 0  # rows of this partition the ramp took (a cut ramp)
        while self.cut and self.threshold < self.b_min and self._rows + (total - base) > self.threshold:
            if cap and m > cap:  # a partition over the byte cap is sliced by it, not by the ramp
                break
            take = self.threshold - self._rows  # >= 1: the buffer is flushed once it reaches it
            if cap and self._buffer and self._bytes + m * take // total > cap:
                out += self._flush()  # the piece would overflow the byte cap: it starts the next one
                continue
            self._buffer.append(Span(i, base, base + take))
            self._rows += take
            base += take
            out += self._flush()
        n = total - base
        if base:  # the rest of a cut partition: its share of the bytes
            m = m * n // total
        if n > self.b_max or (cap and m > cap):
            out += self._flush()
            step = self.b_max if not (cap and m > cap) else max(1, min(self.b_max, n * cap // m))
            for start in range(base, total, step):
                out.append(self._emit([Span(i, start, min(start + step, total))]))
        elif self._rows + n > self.b_max or (cap and self._bytes + m > cap):
            out += self._flush()
            self._buffer, self._rows, self._bytes = [Span(i, base, total)], n, m
            # b_min <= b_max and n <= b_max: a lone partition may itself reach b_min
            if self._rows >= self.threshold:
                out += self._flush()
        elif n or not base:  # (nothing left of a cut partition: it is all in the ramp's SuperBatches)
            self._buffer.append(Span(i, base, total))
            self._rows += n
            self._bytes += m
            if self._rows >= self.threshold:
                out += self._flush()
        return out

    def finish(self) -> list[SuperBatch]:
        """Flush what remains (the last, possibly under-filled, SuperBatch)."""
        self._finished = True
        return self._flush()


def iter_superbatches(
    sizes: Iterable[int],
    b_min: int,
    b_max: int,
    *,
    nbytes: Iterable[int] | None = None,
    max_bytes: int | None = None,
    first: int | None = None,
    cut: bool = False,
) -> Iterator[SuperBatch]:
    """Lazily yield the SuperBatches for ``sizes`` (see :class:`OnlinePlanner`)."""
    planner = OnlinePlanner(b_min, b_max, max_bytes if nbytes is not None else None, first=first, cut=cut)
    sizes = list(sizes)
    byte_sizes = [None] * len(sizes) if nbytes is None else list(nbytes)
    if len(byte_sizes) != len(sizes):
        raise SurgeValueError(
            f"nbytes has {len(byte_sizes)} entries but sizes has {len(sizes)}: give one byte size per "
            "partition. Fix: pass nbytes=None to plan by rows only."
        )
    for n, m in zip(sizes, byte_sizes):
        yield from planner.push(n, m)
    yield from planner.finish()


def plan_superbatches(
    sizes: Iterable[int],
    b_min: int,
    b_max: int,
    *,
    nbytes: Iterable[int] | None = None,
    max_bytes: int | None = None,
    first: int | None = None,
    cut: bool = False,
) -> list[SuperBatch]:
    """Plan SuperBatches for known partition sizes.

    Parameters
    ----------
    sizes : iterable of int
        Rows in each partition, in partition order. Zero is allowed (an empty
        partition is carried in a SuperBatch as an empty span, so every input
        partition is accounted for).
    b_min : int
        Flush threshold: a SuperBatch is emitted once it holds ``>= b_min`` rows.
    b_max : int
        Hard cap: no SuperBatch holds more than ``b_max`` rows.
    nbytes : iterable of int, optional
        Bytes of text in each partition (for the byte cap).
    max_bytes : int, optional
        Hard cap on the text bytes of one SuperBatch (needs ``nbytes``).
    first : int, optional
        The ramp (see :class:`OnlinePlanner`): the first SuperBatches flush at ``first``,
        ``2 * first``... rows up to ``b_min``. None: at ``b_min`` from the start.
    cut : bool
        Whether the ramp cuts partitions to hold its SuperBatches at their thresholds (see
        :class:`OnlinePlanner`).

    Returns
    -------
    list of SuperBatch

    Examples
    --------
    >>> [sb.rows for sb in plan_superbatches([3, 4, 20, 1], b_min=5, b_max=8)]
    [7, 8, 8, 4, 1]
    >>> [sb.rows for sb in plan_superbatches([1] * 12, b_min=5, b_max=8, first=1)]
    [1, 2, 4, 5]
    >>> plan_superbatches([3, 4], 5, 8)[0].partitions
    (0, 1)

    Two partitions of a few huge texts are not fused past the byte cap:

    >>> [sb.rows for sb in plan_superbatches([2, 2], 5, 8, nbytes=[10**6, 10**6], max_bytes=1_500_000)]
    [2, 2]
    """
    return list(
        iter_superbatches(sizes, b_min, b_max, nbytes=nbytes, max_bytes=max_bytes, first=first, cut=cut)
    )


def max_superbatch_rows(sizes: Sequence[int], b_min: int, b_max: int) -> int:
    """The Lemma 3 bound ``min(b_max, b_min - 1 + n_max)`` for these sizes."""
    n_max = max(sizes, default=0)
    return min(b_max, b_min - 1 + n_max) if n_max else 0
