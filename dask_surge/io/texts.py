"""Texts held as Arrow strings: a sequence of ``str`` that can hand over its UTF-8 bytes whole.

A SuperBatch's texts mostly come from an Arrow string column with no null (a Parquet read).
:class:`ArrowTexts` keeps them so: code that wants Python strings gets them (made once, on
first use), and code that wants bytes (:class:`dask_surge.engine.tokenpool.TokenPool`, which
copies a window's texts into shared memory for a helper process) takes the column's own
offsets and data buffer, with no per-text Python in the worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import pyarrow as pa

__all__ = ["ArrowTexts", "as_list", "as_texts", "is_string_view", "join_texts", "take_texts"]


def is_string_view(arrow_type: pa.DataType) -> bool:
    """True for Arrow's string_view type.

    Examples
    --------
    >>> import pyarrow as pa
    >>> is_string_view(pa.string())
    False
    """
    return bool(pa.types.is_string_view(arrow_type))


class ArrowTexts(Sequence[str]):
    """The strings of an Arrow string array with no null, as a read-only sequence of ``str``.

    Parameters
    ----------
    arrow : pyarrow.Array or pyarrow.ChunkedArray
        Of type string, large_string or string_view, with no null (its chunks are combined).

    Raises
    ------
    ValueError
        If ``arrow`` is not of a string type or holds a null.

    Examples
    --------
    >>> import pyarrow as pa
    >>> texts = ArrowTexts(pa.array(["a dog", "é", "cat"]))
    >>> len(texts), texts[1], list(texts[1:])
    (3, 'é', ['é', 'cat'])
    >>> offsets, data = texts.utf8()
    >>> offsets.tolist(), bytes(data)
    ([0, 5, 7, 10], b'a dog\\xc3\\xa9cat')
    """

    __slots__ = ("_list", "_pick", "arrow")

    def __init__(self, arrow: pa.Array | pa.ChunkedArray) -> None:
        if is_string_view(arrow.type):
            arrow = arrow.cast(pa.large_string())
        if isinstance(arrow, pa.ChunkedArray):
            if arrow.num_chunks > 1 and pa.types.is_string(arrow.type):
                arrow = _large(arrow)  # 64-bit offsets once combined: past 2 GiB of text too
            arrow = arrow.chunk(0) if arrow.num_chunks == 1 else arrow.combine_chunks()
        if not (pa.types.is_string(arrow.type) or pa.types.is_large_string(arrow.type)):
            raise ValueError(f"ArrowTexts takes a string array, not {arrow.type}; Fix: pass the text column")
        if arrow.null_count:
            raise ValueError(
                f"ArrowTexts takes no null, and this array holds {arrow.null_count}; "
                "Fix: leave the nulls out first (or use a list of str)"
            )
        #: The Arrow string or large_string array.
        self.arrow: pa.Array = arrow
        self._list: list[str] | None = None
        self._pick: tuple[list[str], np.ndarray] | None = None  # (a list these are picked from, where)

    def __len__(self) -> int:
        return len(self.arrow)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> ArrowTexts: ...

    def __getitem__(self, index: int | slice) -> str | ArrowTexts:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(
                    f"ArrowTexts slices with step 1 only, not {step}; Fix: use as_list(texts)[...]"
                )
            part = ArrowTexts(self.arrow.slice(start, max(stop - start, 0)))
            if self._list is not None:
                part._list = self._list[start:stop]
            return part
        return self.tolist()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tolist())

    def __repr__(self) -> str:
        return f"ArrowTexts({len(self)} texts, {self.arrow.type})"

    def tolist(self) -> list[str]:
        """The texts as a list of ``str``, made on the first call and kept."""
        made = self._list
        if made is None:
            pick = self._pick  # read once: another thread may take it meanwhile (both make the same list)
            made = _picked(*pick) if pick is not None else self.arrow.to_pylist()
            self._list, self._pick = made, None
        return made

    def take(self, indices: np.ndarray) -> ArrowTexts:
        """The texts at ``indices`` (int), in that order: Arrow copies their bytes; when this list is
        made already, that of the texts taken is picked from it when asked for, not made again."""
        indices = np.array(indices, dtype=np.int64)  # a copy: the pick must not follow the caller's array
        part = ArrowTexts(self.arrow.take(pa.array(indices)))
        if self._list is not None:  # picked from it only if asked for (the helpers take the bytes)
            part._pick = (self._list, indices)
        return part

    def utf8(self) -> tuple[np.ndarray, memoryview]:
        """``(offsets, data)``: the ``len + 1`` int64 byte offsets of the texts in ``data``, from 0,
        and their UTF-8 bytes (a view of the array's buffer, no copy)."""
        n, arrow = len(self), self.arrow
        width = np.int64 if pa.types.is_large_string(arrow.type) else np.int32
        buffers = arrow.buffers()
        raw = (
            np.frombuffer(buffers[1], dtype=width)[arrow.offset : arrow.offset + n + 1]
            if n
            else np.zeros(1, width)
        )
        first, last = int(raw[0]), int(raw[-1])
        data = memoryview(buffers[2]).cast("B")[first:last] if buffers[2] is not None else memoryview(b"")
        return raw.astype(np.int64) - first, data


def as_list(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list of ``str`` (an :class:`ArrowTexts` makes its list once; a list is itself).

    Examples
    --------
    >>> import pyarrow as pa
    >>> as_list(ArrowTexts(pa.array(["a"]))), as_list(("b",))
    (['a'], ['b'])
    """
    if isinstance(texts, list):
        return texts
    return texts.tolist() if isinstance(texts, ArrowTexts) else list(texts)


def as_texts(texts: Sequence[str]) -> list[str] | ArrowTexts:
    """``texts`` as it is when a list or an :class:`ArrowTexts`, else as a list."""
    return texts if isinstance(texts, (list, ArrowTexts)) else list(texts)


def take_texts(texts: Sequence[str], indices: np.ndarray) -> list[str] | ArrowTexts:
    """The texts of ``texts`` at ``indices``: an :class:`ArrowTexts` stays one (:meth:`ArrowTexts.take`).

    Examples
    --------
    >>> import numpy as np, pyarrow as pa
    >>> take_texts(["a", "b", "c"], np.array([2, 0]))
    ['c', 'a']
    >>> take_texts(ArrowTexts(pa.array(["a", "b", "c"])), np.array([2, 0]))
    ArrowTexts(2 texts, string)
    """
    if isinstance(texts, ArrowTexts):
        return texts.take(indices)
    return _picked(as_list(texts), indices)


def _picked(texts: list[str], indices: np.ndarray) -> list[str]:
    """The texts of ``texts`` at ``indices``, as a list."""
    return list(map(texts.__getitem__, np.asarray(indices).tolist()))


def join_texts(pieces: Sequence[Sequence[str]]) -> list[str] | ArrowTexts:
    """The texts of ``pieces`` one after the other: an :class:`ArrowTexts` when every piece is one
    (one Arrow array, its strings copied once), else a list.

    Examples
    --------
    >>> import pyarrow as pa
    >>> joined = join_texts([ArrowTexts(pa.array(["a"])), ArrowTexts(pa.array(["b"], pa.large_string()))])
    >>> type(joined).__name__, list(joined)
    ('ArrowTexts', ['a', 'b'])
    >>> join_texts([ArrowTexts(pa.array(["a"])), ["b"]]), join_texts([])
    (['a', 'b'], [])
    """
    if len(pieces) == 1:
        return as_texts(pieces[0])
    held = [p for p in pieces if isinstance(p, ArrowTexts)]
    if pieces and len(held) == len(pieces):
        # 64-bit offsets: the pieces may hold more than 2 GiB of text together (a cast shares the data)
        return ArrowTexts(pa.concat_arrays([_large(p.arrow) for p in held]))
    return list(itertools.chain.from_iterable(as_list(p) for p in pieces))


def _large(arrow):
    """``arrow`` (a string array or chunked array) with 64-bit offsets."""
    return arrow if pa.types.is_large_string(arrow.type) else arrow.cast(pa.large_string())
