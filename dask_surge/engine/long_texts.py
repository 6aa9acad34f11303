"""Long texts: count what is cut, refuse it, or embed every token as overlapping windows (issue 24).

A text longer than a model's window (its ``max_seq_length`` less the special tokens and the
prompt) is, by ``long_texts=``:

- ``"truncate"``: cut, as sentence-transformers does, and counted;
- ``"error"``: refused with :class:`TextTooLong`;
- ``"chunk"``: cut into token windows that overlap by ``chunk_overlap`` tokens, one
  embedding per window (:class:`Windows` says where each window is in its text);
- ``"mean"``: those windows' embeddings averaged, weighted by their tokens.

:class:`WindowCutter` cuts: it tokenizes each text once with a copy of the model's fast
(Rust) tokenizer (no special tokens, no truncation), very long texts in slices of
:data:`SLICE_CHARS` characters cut at whitespace, and cuts windows on the token ids at word
boundaries. It yields :class:`WindowGroup` s of at most about
:data:`~dask_surge.engine.batching.BLOCK_TEXTS` windows, whose token ids the fast engine
packs into its length-sorted micro-batches without tokenizing again
(:meth:`~dask_surge.engine.tokenizing.TextPacker.pack_windows`). Nothing here imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import check_argument
from ..errors import SurgeInputError, SurgeValueError
from ..options import DEFAULT_CHUNK_OVERLAP
from .batching import BLOCK_TEXTS, CallShape
from .joined import flat_ids, special_ends
from .tokenizing import unreadable_text

__all__ = [
    "SLICE_CHARS",
    "TextEmbeddings",
    "TextTooLong",
    "WindowCutter",
    "WindowGroup",
    "Windows",
    "check_long_texts",
    "collect",
]


# LongTexts (the modes), LONG_TEXTS and DEFAULT_CHUNK_OVERLAP (32 tokens) are declared with the options
# (dask_surge.options).
#: Characters of one text tokenized at once: a longer text is tokenized in slices cut at whitespace
#: (a slice with no whitespace in its second half is cut where it is), so the tokenizer's
#: per-token state stays bounded whatever the text's length.
SLICE_CHARS = 100_000
#: Windows cut and encoded at once in chunk/mean mode: it bounds what a call holds besides its
#: output (token ids, packed copies, encodings), while still filling many GPU micro-batches
#: (``docs/ab_studies.md``, "Long-text window groups").
GROUP_WINDOWS = 8_192
#: Characters tokenized per tokenizer call (many short texts, or a few slices of a long one).
BATCH_CHARS = 1_000_000
#: Texts of at most this many characters per window token are tokenized without offsets first (the
#: tokenizer's fastest call); the few of them over the window are tokenized again with offsets.
_FAST_CHARS_PER_TOKEN = 3
_WHITESPACE = (" ", "\n", "\t", "\r")


class TextTooLong(SurgeInputError):
    """A text is longer than the model's window and ``long_texts="error"``.

    Attributes
    ----------
    index : int
        Position of the first such text in the call's texts.
    tokens : int
        Its content tokens (no special tokens, no prompt).
    window : int
        Content tokens a window holds: ``max_seq_length`` less the special tokens and the prompt's.

    Examples
    --------
    >>> err = TextTooLong(3, 900, 254)
    >>> err.index, err.tokens, err.window, isinstance(err, SurgeInputError)
    (3, 900, 254, True)
    >>> "long_texts='chunk'" in str(err)
    True
    """

    def __init__(self, index: int, tokens: int, window: int) -> None:
        self.index, self.tokens, self.window = int(index), int(tokens), int(window)
        super().__init__(
            f"text {self.index} of this call has {self.tokens} tokens, over the model's window of {self.window} "
            "tokens (its max_seq_length less the special tokens and the prompt), and long_texts='error' refuses "
            "to cut it. Fix: pass long_texts='chunk' (one row per window) or long_texts='mean' (one row per "
            "text, its windows averaged), or long_texts='truncate' to cut it as sentence-transformers does."
        )

    def __reduce__(self):  # picklable across processes (the message is rebuilt)
        return (TextTooLong, (self.index, self.tokens, self.window))


@dataclass(frozen=True)
class Windows:
    """Where each window of a ``long_texts="chunk"`` call lies, one entry per window, in (text, chunk) order.

    Attributes
    ----------
    text : numpy.ndarray
        int64 index, into the call's texts, of the text each window comes from (non-decreasing).
    chunk : numpy.ndarray
        int32 ``0, 1, ...`` within each text.
    char_start, char_end : numpy.ndarray
        int64 offsets into the original text (the prompt not counted): ``text[char_start:char_end]``
        is the window's text. A text that fits in one window is one window spanning the whole
        text (an empty text: ``0, 0``); the windows of a longer text span their first token's
        start to their last token's end.
    tokens : numpy.ndarray
        int32 content tokens of each window (no special tokens, no prompt).

    Examples
    --------
    >>> w = Windows.empty()
    >>> len(w), w.text.dtype, w.chunk.dtype
    (0, dtype('int64'), dtype('int32'))
    """

    text: np.ndarray
    chunk: np.ndarray
    char_start: np.ndarray
    char_end: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.text)

    @classmethod
    def empty(cls) -> Windows:
        """No windows."""
        return cls(
            np.zeros(0, np.int64),
            np.zeros(0, np.int32),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int32),
        )

    @classmethod
    def concat(cls, parts: Sequence[Windows]) -> Windows:
        """The windows of ``parts``, one after the other.

        Examples
        --------
        >>> len(Windows.concat([Windows.empty(), Windows.empty()]))
        0
        """
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.empty()
        return cls(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("text", "chunk", "char_start", "char_end", "tokens")
            )
        )


@dataclass(frozen=True)
class TextEmbeddings:
    """What :meth:`~dask_surge.models.encoders.Encoder.encode_long` returns.

    Attributes
    ----------
    embeddings : numpy.ndarray
        ``(m, d)`` float32, C-contiguous: one row per text, in order (``m == len(texts)``), for
        ``"truncate"``, ``"error"`` and ``"mean"``; one row per window, in (text, chunk) order,
        for ``"chunk"`` (an empty text is one window, so no text is without a row). A sparse or
        multi-vector model's own rows instead (:class:`~dask_surge.engine.backends.FamilyBackend`).
    windows : Windows or None
        The windows of the rows, for ``"chunk"``; else None.
    truncated : numpy.ndarray or None
        bool per text: it was over the window and got cut (``"truncate"``); all False for the
        other modes; None where unknown (a plain callable model has no tokenizer).
    over : int
        Texts over the window: those cut (``"truncate"``), or those that made more than one
        window (``"chunk"``, ``"mean"``); 0 where unknown.
    shape : CallShape or None
        What the forward passes computed (sequences, real and padded tokens, forward passes),
        counted by the fast engine; None where the backend does not say.

    Examples
    --------
    >>> enc = TextEmbeddings(np.zeros((1, 2), np.float32), None, np.zeros(1, bool), 0)
    >>> enc.embeddings.shape, enc.over
    ((1, 2), 0)
    """

    embeddings: Any
    windows: Windows | None
    truncated: np.ndarray | None
    over: int
    shape: CallShape | None = None


def check_long_texts(long_texts: Any, chunk_overlap: Any) -> None:
    """Check ``long_texts`` and ``chunk_overlap`` as far as they go without a model, by their options'
    validators (:func:`dask_surge.config.check_argument`: the rules are declared once, in
    :mod:`dask_surge.options`).

    Raises
    ------
    SurgeValueError
        ``long_texts`` is not a known mode, or ``chunk_overlap`` is not an int >= 0.

    Examples
    --------
    >>> check_long_texts("chunk", 32)
    >>> check_long_texts("split", 32)
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeValueError: long_texts='split' is not a long-text mode. Fix: ...
    """
    check_argument("long_texts", long_texts)
    check_argument("chunk_overlap", chunk_overlap)


def no_tokenizer(long_texts: str, what: str) -> SurgeValueError:
    """The error for ``long_texts`` modes that need a fast tokenizer the model lacks."""
    return SurgeValueError(
        f"long_texts={long_texts!r} needs the model's fast tokenizer to find windows, but {what}. Fix: use a "
        "sentence-transformers model with a fast (Rust) tokenizer, or long_texts='truncate'."
    )


@dataclass(frozen=True)
class WindowGroup:
    """Windows ready to encode together: their content token ids and where they lie.

    Attributes
    ----------
    content : numpy.ndarray
        int32 content token ids; each window is ``content[starts[k] : starts[k] + windows.tokens[k]]``
        (overlapping windows share their ids).
    starts : numpy.ndarray
        int64 offset of each window into ``content``.
    windows : Windows
        Where each window lies (``text`` indexes the call's texts).
    """

    content: np.ndarray
    starts: np.ndarray
    windows: Windows

    def __len__(self) -> int:
        return len(self.windows)


class _GroupBuilder:
    """Windows gathered in (text, chunk) order until a group is full."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.encodings: list = []  # short texts' encodings, their ids not yet in ``arrays``
        self.size = 0
        self.meta: tuple[list[int], list[int], list[int], list[int], list[int], list[int]] = (
            [],
            [],
            [],
            [],
            [],
            [],
        )

    def __len__(self) -> int:
        return len(self.meta[0])

    def add_whole(self, index: int, encoding: Any, chars: int, tokens: int) -> None:
        """A text that is one window (the whole text)."""
        self.encodings.append(encoding)
        self._window(index, 0, 0, chars, tokens, self.size)
        self.size += tokens

    def add_segment(self, ids: np.ndarray, cuts: list[tuple[int, int, int, int, int, int]]) -> None:
        """Windows ``(index, chunk, start, stop, char_start, char_end)`` of a token segment ``ids``."""
        self._flush_encodings()
        base = self.size
        self.arrays.append(ids)
        self.size += len(ids)
        for index, chunk, start, stop, cs, ce in cuts:
            self._window(index, chunk, cs, ce, stop - start, base + start)

    def _window(self, index: int, chunk: int, cs: int, ce: int, tokens: int, start: int) -> None:
        for column, value in zip(self.meta, (index, chunk, cs, ce, tokens, start)):
            column.append(value)

    def _flush_encodings(self) -> None:
        if self.encodings:
            count = sum(map(len, self.encodings))
            self.arrays.append(flat_ids(self.encodings, count))
            self.encodings = []

    def build(self) -> WindowGroup:
        self._flush_encodings()
        text, chunk, cs, ce, tokens, starts = self.meta
        content = np.concatenate(self.arrays) if self.arrays else np.zeros(0, np.int32)
        group = WindowGroup(
            content=content.astype(np.int32, copy=False),
            starts=np.array(starts, dtype=np.int64),
            windows=Windows(
                np.array(text, dtype=np.int64),
                np.array(chunk, dtype=np.int32),
                np.array(cs, dtype=np.int64),
                np.array(ce, dtype=np.int64),
                np.array(tokens, dtype=np.int32),
            ),
        )
        self.__init__()  # type: ignore[misc]
        return group


class _Stream:
    """One text over the window, being cut: its tokens from the current window's start on."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.chunk = 0
        self.base = 0  # the text's token index of ids[0]
        self.ids = np.zeros(0, np.int32)
        self.starts = np.zeros(0, np.int64)  # word starts, as indices into ids (ascending)
        self.end = 0  # where the last window cut ends, as an index into ids (0: none yet)
        self.encodings: list[
            tuple[Any, int, int]
        ] = []  # (encoding, text token index of its first, char base)

    def add(self, encoding: Any, char_base: int) -> None:
        ids = np.fromiter(encoding.ids, dtype=np.int32, count=len(encoding))
        try:
            words = np.fromiter(encoding.word_ids, dtype=np.int64, count=len(ids))
        except TypeError:  # a token without a word (None): each such token is its own word
            words = np.array(encoding.word_ids, dtype=np.float64)
        starts = np.flatnonzero(words[1:] != words[:-1]) + 1
        if len(ids) and (self.encodings or self.base):
            starts = np.concatenate(([0], starts))  # a slice starts at whitespace: a word starts there
        self.encodings.append((encoding, self.base + len(self.ids), char_base))
        self.starts = np.concatenate((self.starts, starts + len(self.ids)))
        self.ids = np.concatenate((self.ids, ids))

    def chars(self, token: int, end: bool) -> int:
        """Char offset (into the text) where token ``token`` (an index into ``ids``) starts or ends."""
        at = self.base + token
        for encoding, first, char_base in reversed(self.encodings):
            if at >= first:
                span = encoding.token_to_chars(at - first)
                return char_base + (span[1] if end else span[0])
        raise AssertionError("token before the stream")  # pragma: no cover

    def cut(self, capacity: int, overlap: int, last: bool) -> tuple[np.ndarray, list]:
        """Windows whose tokens are all known: ``(segment ids, cuts)``; the stream keeps the rest."""
        n, s, bounds, end = len(self.ids), 0, self.starts, self.end
        spans = []
        while s + capacity < n:
            e = s + capacity
            j = int(np.searchsorted(bounds, e, side="right")) - 1  # the last word start <= e
            # at a word start, if that ends the window past the last one's end; else inside the next
            # word (longer than what the window has left: else windows ending at its start repeat, each
            # shorter than the last)
            if j >= 0 and bounds[j] > max(s, end):
                e = int(bounds[j])
            spans.append((s, e))
            end = e
            low = max(e - overlap, s + 1)
            k = int(np.searchsorted(bounds, low, side="left"))  # the first word start >= low
            s = int(bounds[k]) if k < len(bounds) and bounds[k] <= e else low
        if last:
            spans.append((s, n))
        cuts = []
        for a, b in spans:
            cs, ce = (self.chars(a, False), self.chars(b - 1, True)) if b > a else (0, 0)
            cuts.append((self.index, self.chunk, a, b, cs, ce))
            self.chunk += 1
        stop = spans[-1][1] if spans else 0
        segment = self.ids[:stop]
        # keep the tokens from s on (and the encodings that hold them)
        self.ids = self.ids[s:]
        self.starts = bounds[bounds >= s] - s
        self.end = max(end - s, 0)
        self.base += s
        self.encodings = [
            e
            for i, e in enumerate(self.encodings)
            if i + 1 == len(self.encodings) or self.encodings[i + 1][1] > self.base
        ]
        return segment, cuts


def _slice_end(text: str, start: int, size: int) -> int:
    """Where the slice of ``text`` from ``start`` ends: at a whitespace char in its second half, if any."""
    stop = start + size
    if stop >= len(text):
        return len(text)
    at = max(text.rfind(c, start + size // 2, stop) for c in _WHITESPACE)
    return at if at > start else stop


class WindowCutter:
    """Cut texts into token windows with a copy of a model's fast tokenizer.

    Each window, encoded, is ``head + content + tail``: the leading special tokens and the
    prompt's tokens, the window's content tokens, the trailing special tokens (those the
    tokenizer's post-processor adds, found by encoding one word). A window holds
    :attr:`capacity` content tokens, so the whole fits ``max_seq_length``; consecutive windows
    of a text share up to ``overlap`` tokens (the next starts at the first word start at or
    after the last one's end less ``overlap``: none shared when the word before the join is
    longer) and start and end at word boundaries (the tokenizer's word ids), unless one word is
    longer than a window, or than what a window that overlaps the last one has left: each
    window ends past the last one's end.

    Parameters
    ----------
    hf_tokenizer : transformers.PreTrainedTokenizerFast
        The model's tokenizer (a copy of its Rust ``backend_tokenizer`` is used).
    max_seq_length : int
        The model's window in tokens, special tokens and prompt included.
    prompt : str
        Text put before every input (``""`` for none).

    Raises
    ------
    SurgeValueError
        The tokenizer is not a fast one, or the prompt and special tokens fill the window.

    Examples
    --------
    >>> from transformers import AutoTokenizer
    >>> from dask_surge.testing import packaged_model_dir
    >>> cutter = WindowCutter(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 16)
    >>> cutter.capacity, cutter.head.tolist(), cutter.tail.tolist()
    (14, [101], [102])
    >>> w = cutter.cut(["a short one", "", " ".join(["word"] * 30)], overlap=4)
    >>> w.text.tolist(), w.chunk.tolist(), w.tokens.tolist()
    ([0, 1, 2, 2, 2], [0, 0, 0, 1, 2], [3, 0, 14, 14, 10])
    >>> int(w.char_start[3]), int(w.char_end[3])
    (50, 119)
    """

    def __init__(self, hf_tokenizer: Any, max_seq_length: int, *, prompt: str = "") -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None or not getattr(hf_tokenizer, "is_fast", False):
            raise no_tokenizer("chunk", f"its tokenizer {type(hf_tokenizer).__name__} is not a fast one")
        self.max_seq_length = int(max_seq_length)
        self._tokenizer = backend.__class__.from_str(backend.to_str())
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        lead, trail = special_ends(self._tokenizer)
        prompt_ids = self._tokenizer.encode(prompt, add_special_tokens=False).ids if prompt else []
        #: Ids before each window's content: the leading special tokens, then the prompt's.
        self.head = np.array(lead + prompt_ids, dtype=np.int32)
        #: Ids after each window's content: the trailing special tokens.
        self.tail = np.array(trail, dtype=np.int32)
        #: Content tokens a window holds.
        self.capacity = self.max_seq_length - len(self.head) - len(self.tail)
        if self.capacity < 2:
            raise SurgeValueError(
                f"the prompt {prompt!r} and the special tokens take {len(self.head) + len(self.tail)} of the model's "
                f"{self.max_seq_length} tokens, leaving {self.capacity} for text. Fix: use a shorter prompt."
            )
        self._encode_fast = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)

    def check_overlap(self, overlap: int) -> None:
        """Raise SurgeValueError unless ``0 <= overlap`` and ``2 * overlap < capacity``."""
        check_long_texts("chunk", overlap)
        if 2 * overlap >= self.capacity:
            fits = (self.capacity - 1) // 2
            example = (
                f"the default {DEFAULT_CHUNK_OVERLAP}"
                if fits >= DEFAULT_CHUNK_OVERLAP
                else f"{fits} (the default {DEFAULT_CHUNK_OVERLAP} does not fit this window either)"
            )
            raise SurgeValueError(
                f"chunk_overlap={overlap!r} is not smaller than half the model's window of {self.capacity} "
                f"tokens: consecutive windows may share less than half a window. Fix: pass chunk_overlap < "
                f"{fits + 1}, e.g. {example}."
            )

    def _tokenize(self, texts: list[str], *, offsets: bool) -> list:
        if not texts:
            return []
        try:
            if offsets:
                return self._tokenizer.encode_batch(texts, add_special_tokens=False)
            return self._encode_fast(texts, add_special_tokens=False)
        except TypeError:
            if (err := unreadable_text(texts)) is None:
                raise
            raise err from None

    def _pieces(self, texts: Sequence[str]) -> Iterator[list[tuple[int, int, str, bool]]]:
        """Batches of ``(text index, char base, piece, last piece of its text)``, about BATCH_CHARS each."""
        batch: list[tuple[int, int, str, bool]] = []
        chars = 0
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                err = unreadable_text(texts)  # this one, or an earlier str with a lone surrogate
                assert err is not None
                raise err
            start = 0
            while True:
                stop = _slice_end(text, start, SLICE_CHARS)
                batch.append(
                    (index, start, text[start:stop] if start or stop < len(text) else text, stop >= len(text))
                )
                chars += stop - start
                if chars >= BATCH_CHARS or len(batch) >= BLOCK_TEXTS:
                    yield batch
                    batch, chars = [], 0
                if stop >= len(text):
                    break
                start = stop
        if batch:
            yield batch

    def groups(
        self, texts: Sequence[str], overlap: int = DEFAULT_CHUNK_OVERLAP, *, max_windows: int = BLOCK_TEXTS
    ) -> Iterator[WindowGroup]:
        """The windows of ``texts``, in (text, chunk) order, in groups of about ``max_windows``.

        Each text is tokenized once (a text over :data:`SLICE_CHARS` characters slice by slice);
        what is held at once is bounded by the group, whatever the texts' lengths.

        Raises
        ------
        SurgeValueError
            ``overlap`` is not an int in ``[0, capacity / 2)``.
        SurgeInputError
            A text is not a str.
        """
        self.check_overlap(overlap)
        capacity, fast_chars = self.capacity, _FAST_CHARS_PER_TOKEN * self.capacity
        builder = _GroupBuilder()
        stream: _Stream | None = None
        for batch in self._pieces(texts):
            whole = [
                k
                for k, (_, base, piece, last) in enumerate(batch)
                if not base and last and len(piece) <= fast_chars
            ]
            encodings: list = [None] * len(batch)
            for k, enc in zip(whole, self._tokenize([batch[k][2] for k in whole], offsets=False)):
                if len(enc) <= capacity:
                    encodings[k] = enc
            rest = [k for k, enc in enumerate(encodings) if enc is None]
            for k, enc in zip(rest, self._tokenize([batch[k][2] for k in rest], offsets=True)):
                encodings[k] = enc
            for (index, base, piece, last), enc in zip(batch, encodings):
                if stream is None and last and not base and len(enc) <= capacity:
                    builder.add_whole(index, enc, len(piece), len(enc))
                else:
                    if stream is None:
                        stream = _Stream(index)
                    stream.add(enc, base)
                    segment, cuts = stream.cut(capacity, overlap, last)
                    if cuts:
                        builder.add_segment(segment, cuts)
                    if last:
                        stream = None
                if len(builder) >= max_windows:
                    yield builder.build()
        if len(builder):
            yield builder.build()

    def cut(self, texts: Sequence[str], overlap: int = DEFAULT_CHUNK_OVERLAP) -> Windows:
        """All the windows of ``texts`` (see :meth:`groups`), without their token ids."""
        return Windows.concat([g.windows for g in self.groups(texts, overlap)])

    def over(self, texts: Sequence[str]) -> np.ndarray:
        """bool per text: it has more than :attr:`capacity` content tokens (tokenized up to just past that).

        A long text is tokenized on a prefix cut at whitespace (its first tokens are the same),
        and whole only when the prefix fits.

        Examples
        --------
        >>> from transformers import AutoTokenizer
        >>> from dask_surge.testing import packaged_model_dir
        >>> cutter = WindowCutter(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 8)
        >>> cutter.over(["one two three", "one two three four five six seven", ""]).tolist()
        [False, True, False]
        """
        texts = texts if isinstance(texts, list) else list(texts)
        limit = max(4096, 16 * self.capacity)
        heads = [t[: _slice_end(t, 0, limit)] if isinstance(t, str) and len(t) > limit else t for t in texts]
        out = (
            np.fromiter(map(len, self._tokenize(heads, offsets=False)), np.int64, len(texts)) > self.capacity
        )
        again = [i for i, (t, h) in enumerate(zip(texts, heads)) if not out[i] and h is not t]
        if again:
            out[again] = [self.content_tokens(texts[i]) > self.capacity for i in again]
        return out

    def content_tokens(self, text: str) -> int:
        """Content tokens of ``text`` (no special tokens, no prompt), tokenized slice by slice."""
        total, start = 0, 0
        while True:
            stop = _slice_end(text, start, SLICE_CHARS)
            total += len(self._tokenize([text[start:stop]], offsets=False)[0])
            if stop >= len(text):
                return total
            start = stop


def collect(
    count: int,
    long_texts: str,
    parts: Iterable[tuple[Windows, np.ndarray]],
    dimension: int,
    *,
    renormalize: bool,
) -> TextEmbeddings:
    """The :class:`TextEmbeddings` of a ``"chunk"`` or ``"mean"`` call from its windows' embeddings.

    Parameters
    ----------
    count : int
        Texts of the call.
    long_texts : {"chunk", "mean"}
    parts : iterable of (Windows, numpy.ndarray)
        Groups of windows, in (text, chunk) order, and their ``(len(windows), d)`` embeddings.
    dimension : int
    renormalize : bool
        ``"mean"``: scale each text's mean to unit length (the model normalizes, or normalize=True).

    Examples
    --------
    >>> w = Windows(np.array([0, 0, 1]), np.array([0, 1, 0], np.int32), np.zeros(3, np.int64),
    ...             np.zeros(3, np.int64), np.array([3, 1, 0], np.int32))
    >>> emb = np.array([[1, 0], [0, 1], [0, 2]], np.float32)
    >>> collect(2, "mean", [(w, emb)], 2, renormalize=False).embeddings.tolist()
    [[0.75, 0.25], [0.0, 2.0]]
    >>> out = collect(2, "chunk", [(w, emb)], 2, renormalize=False)
    >>> out.embeddings.shape, out.over
    ((3, 2), 1)
    """
    windows: list[Windows] = []
    rows: list[np.ndarray] = []
    per_text = np.zeros(count, dtype=np.int64)
    if long_texts == "mean":
        sums = np.zeros((count, dimension), dtype=np.float32)
        weights = np.zeros(count, dtype=np.float64)
    for w, emb in parts:
        per_text += np.bincount(w.text, minlength=count)
        if long_texts == "chunk":
            windows.append(w)
            rows.append(emb)
            continue
        if not len(w):
            continue
        weight = np.maximum(w.tokens, 1).astype(np.float32)  # an empty text's one window: its own embedding
        runs = np.flatnonzero(np.diff(w.text, prepend=-1))
        sums[w.text[runs]] += np.add.reduceat(emb * weight[:, None], runs, axis=0)
        weights += np.bincount(w.text, weights=weight, minlength=count)
    over = int((per_text > 1).sum())
    truncated = np.zeros(count, dtype=bool)
    if long_texts == "chunk":
        emb = np.concatenate(rows) if len(rows) != 1 else rows[0]
        emb = np.ascontiguousarray(emb, dtype=np.float32).reshape(-1, dimension)
        return TextEmbeddings(emb, Windows.concat(windows), truncated, over)
    sums /= np.maximum(weights, 1e-12)[:, None].astype(np.float32)
    if renormalize:
        sums /= np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return TextEmbeddings(sums, None, truncated, over)


def encode_windows(
    texts: Sequence[str],
    long_texts: str,
    overlap: int,
    cutter: WindowCutter,
    encode: Callable[[Iterator[WindowGroup]], Iterator[np.ndarray]],
    dimension: int,
    *,
    renormalize: bool,
    clock: Any = None,
) -> TextEmbeddings:
    """``"chunk"``/``"mean"``: cut ``texts`` with ``cutter``, embed each group with ``encode``, collect.

    ``clock`` (a :class:`~dask_surge.engine.tokenizing.StageClock`) counts the cutting, tokenizer
    included, as its ``tokenize`` stage.
    """
    groups: list[WindowGroup] = []

    def kept() -> Iterator[WindowGroup]:
        cut = cutter.groups(texts, overlap, max_windows=GROUP_WINDOWS)
        while True:
            t0 = time.perf_counter()
            group = next(cut, None)
            if clock is not None:
                clock.count("tokenize", t0)
            if group is None:
                return
            groups.append(group)
            yield group

    def parts() -> Iterator[tuple[Windows, np.ndarray]]:
        for emb in encode(kept()):
            group = groups.pop(0)
            yield group.windows, emb

    return collect(len(texts), long_texts, parts(), dimension, renormalize=renormalize)
