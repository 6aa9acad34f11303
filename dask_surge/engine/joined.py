"""Tokenize many short texts as a few long ones: joined around a special token, cut back with NumPy.

The Rust tokenizer's Python API hands back one ``Encoding`` per text: a Python object, the
Python list of its ids, and on free its token strings, offsets and masks. For short texts that
is most of the GIL a worker spends tokenizing, and a good part of the tokenizer's own CPU
(``docs/ab_studies.md``, "Joined tokenizing"). It is the tuning setting
``surge.tuning.joined-tokenizing`` (``docs/tuning.md``).

:class:`JoinedTokenizer` joins each group of consecutive texts with the model's separator token
(``"[SEP]"``) between them, tokenizes the groups without special tokens or truncation, finds each
text's tokens between the separators' ids, and truncates and adds the special tokens itself, as the
tokenizer would have: the same ids for every text, with one ``Encoding`` per group.

That holds only for a tokenizer whose every step sees one text at a time once the separator has
split the string, which :meth:`JoinedTokenizer.of` checks, else it returns None and the caller
tokenizes text by text:

- the separator is a special added token matched on the raw text (not normalized, no strip, not a
  single word), and no other added token overlaps it or holds whitespace: it splits the string before
  anything else, and no added token can match across the spaces put around it, so each text is
  normalized and pre-tokenized on its own;
- the normalizer is ``BertNormalizer`` (or none), the pre-tokenizer ``BertPreTokenizer`` and the model
  ``WordPiece``: each works within a text and splits on whitespace, so a text's tokens do not depend
  on what is around it (a byte-level BPE's or a SentencePiece's would: they mark a word's start);
- the post-processor puts fixed special tokens before and after a text (BERT's ``[CLS] ... [SEP]``),
  and truncation has no stride (it keeps the first, or last, ``max_length`` less those tokens).

A text that holds the separator's own characters (``"a [SEP] b"``) is tokenized on its own, in the same
call; a group whose separators are not where they should be makes the whole window fall back to one text
per group (so a mistake costs speed, never an id).

This module imports only the standard library, NumPy and (lazily) ``tokenizers``: the tokenizer helper
process (``_tokenhelper.py``) loads it by path, without importing the package.

Examples
--------
>>> from tokenizers import Tokenizer
>>> from dask_surge.testing import packaged_model_dir
>>> tok = Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json"))
>>> tok.no_padding(); tok.enable_truncation(6)
>>> joined = JoinedTokenizer.of(tok)
>>> texts = ["a dog", "", "one two three four five", "a [SEP] b"]
>>> lengths, overflow, ids = joined.encode(texts)
>>> lengths.tolist(), overflow.tolist()
([4, 2, 6, 5], [False, False, True, False])
>>> [e.ids for e in tok.encode_batch(texts)] == [a.tolist() for a in np.split(ids, np.cumsum(lengths)[:-1])]
True
"""

from __future__ import annotations

import operator
import os
from itertools import chain
from typing import Any

import numpy as np

__all__ = ["GROUP_TEXTS", "JoinedTokenizer", "flat_ids", "special_ends"]

#: At most this many texts are joined into one string (the group sizes that took the least CPU per
#: text in the joined-tokenizing study, ``docs/ab_studies.md``).
GROUP_TEXTS = 256
#: ... and at least this many groups are made per tokenizer thread, so every core has work.
GROUPS_PER_THREAD = 4
_NORMALIZERS = ("BertNormalizer",)
_PRE_TOKENIZERS = ("BertPreTokenizer",)
_MODELS = ("WordPiece",)


def flat_ids(encodings: Any, count: int) -> np.ndarray:
    """The token ids of ``encodings`` (``count`` in all), one after the other, as int32 (C-level
    iteration over the lists the tokenizer hands back)."""
    return np.fromiter(
        chain.from_iterable(map(operator.attrgetter("ids"), encodings)), dtype=np.int32, count=count
    )


def special_ends(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special token ids a tokenizer's post-processor puts before and after one text's tokens.

    Read off the encoding of ``"a"`` (its special-tokens mask), by a copy without padding if the
    tokenizer pads.

    Examples
    --------
    >>> from tokenizers import Tokenizer
    >>> from dask_surge.testing import packaged_model_dir
    >>> special_ends(Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json")))
    ([101], [102])
    """
    if tokenizer.padding is not None:
        tokenizer = tokenizer.__class__.from_str(tokenizer.to_str())
        tokenizer.no_padding()
    probe = tokenizer.encode("a", add_special_tokens=True)
    mask = probe.special_tokens_mask
    lead = next((i for i, m in enumerate(mask) if not m), len(mask))
    trail = next((i for i, m in enumerate(reversed(mask)) if not m), 0)
    return list(probe.ids[:lead]), list(probe.ids[len(probe.ids) - trail :])


def _threads() -> int:
    """Threads of the Rust tokenizer's pool: ``RAYON_NUM_THREADS``, else this process's cores."""
    try:
        return max(1, int(os.environ.get("RAYON_NUM_THREADS", "")))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class JoinedTokenizer:
    """Token ids of many texts from a few tokenizer calls' worth of ``Encoding`` objects (see the module).

    Build with :meth:`of`, which says whether the tokenizer allows it.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The tokenizer whose ids to reproduce (its truncation; padding off); a copy is used.
    separator : str
        The special token put between texts.
    ends : tuple of (list of int, list of int), optional
        The special token ids put before and after each text; None reads them with :func:`special_ends`.
    """

    def __init__(
        self, tokenizer: Any, separator: str, ends: tuple[list[int], list[int]] | None = None
    ) -> None:
        truncation = tokenizer.truncation
        self.head, self.tail = (np.array(ids, dtype=np.int32) for ids in (ends or special_ends(tokenizer)))
        specials = len(self.head) + len(self.tail)
        #: Content tokens a text keeps (the truncation length less the special tokens); None: no limit.
        self.capacity: int | None = None if truncation is None else int(truncation["max_length"]) - specials
        #: True when truncation keeps a text's last tokens.
        self.left = truncation is not None and str(truncation.get("direction", "right")).lower() == "left"
        self.separator = separator
        self._joiner = f" {separator} "
        self._tokenizer = tokenizer.__class__.from_str(tokenizer.to_str())
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.sep_id = int(self._tokenizer.token_to_id(separator))
        self._encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)

    @classmethod
    def of(cls, tokenizer: Any) -> JoinedTokenizer | None:
        """A :class:`JoinedTokenizer` for ``tokenizer``, or None where joining could change an id (see the module).

        Examples
        --------
        >>> from tokenizers import Tokenizer, models
        >>> JoinedTokenizer.of(Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))) is None
        True
        """

        def kind(part: Any) -> str | None:
            return None if part is None else type(part).__name__

        if (
            kind(tokenizer.model) not in _MODELS
            or kind(tokenizer.normalizer) not in (None, *_NORMALIZERS)
            or kind(tokenizer.pre_tokenizer) not in _PRE_TOKENIZERS
            or tokenizer.padding is not None
        ):
            return None
        truncation = tokenizer.truncation
        if truncation is not None and (
            int(truncation.get("stride") or 0) or int(truncation["max_length"]) < 3
        ):
            return None
        head, tail = special_ends(tokenizer)
        if truncation is not None and int(truncation["max_length"]) <= len(head) + len(tail):
            return None
        added = list(tokenizer.get_added_tokens_decoder().items())
        if any(any(c.isspace() for c in t.content) for _, t in added):
            return None  # it could match across the spaces around a separator, or at a text's joined edge
        candidates = {
            i: t.content
            for i, t in added
            if t.special
            and not t.normalized
            and not t.lstrip
            and not t.rstrip
            and not t.single_word
            and t.content
        }
        preferred = [candidates[i] for i in (*tail, *head) if i in candidates]
        for separator in preferred or list(candidates.values()):
            others = [t.content for _, t in added if t.content != separator]
            if not any(separator in o or o in separator for o in others):
                return cls(tokenizer, separator, (head, tail))
        return None

    def groups(self, texts: list[str], size: int | None = None) -> tuple[list[tuple[int, int]], list[str]]:
        """``(start, stop)`` of each group of consecutive texts joined into one string, and the strings (a
        text that holds the separator's characters is a group of its own).

        ``size`` texts are joined at most (default: up to :data:`GROUP_TEXTS`, with at least
        :data:`GROUPS_PER_THREAD` groups per thread of the tokenizer's pool).

        Examples
        --------
        >>> from tokenizers import Tokenizer
        >>> from dask_surge.testing import packaged_model_dir
        >>> tok = Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json"))
        >>> tok.no_padding()
        >>> joined = JoinedTokenizer.of(tok)
        >>> joined.groups(["a", "b [SEP]", "c", "d"], size=4)
        ([(0, 1), (1, 2), (2, 4)], ['a', 'b [SEP]', 'c [SEP] d'])
        """
        n = len(texts)
        if size is None:
            size = max(1, min(GROUP_TEXTS, -(-n // (_threads() * GROUPS_PER_THREAD))))
        joiner, sep = self._joiner, self.separator
        spans: list[tuple[int, int]] = []
        strings: list[str] = []
        for start in range(0, n, size):
            stop = min(n, start + size)
            joined = joiner.join(texts[start:stop])  # a C-level join; TypeError for a text that is not a str
            if joined.count(sep) == stop - start - 1:
                spans.append((start, stop))
                strings.append(joined)
                continue
            run = start  # some text holds the separator: it goes alone, its neighbours joined as before
            for i in range(start, stop + 1):
                if i == stop or sep in texts[i]:
                    if run < i:
                        spans.append((run, i))
                        strings.append(joiner.join(texts[run:i]))
                    if i < stop:
                        spans.append((i, i + 1))
                        strings.append(texts[i])
                    run = i + 1
        return spans, strings

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lengths, overflow, ids)`` of ``texts``: int32 token length per text (special tokens in), bool
        "truncation cut it" per text, and the int32 ids of every text one after the other; the same as
        tokenizing each text with the tokenizer this was built from.

        Raises
        ------
        TypeError
            An element of ``texts`` is not a str, or cannot be encoded (as the tokenizer raises).
        """
        texts = list(texts)
        found = self._tokenize(*self.groups(texts))
        if found is None:  # a separator id where none was expected: one text per group (never a wrong id)
            found = self._tokenize([(i, i + 1) for i in range(len(texts))], texts)
            assert found is not None
        return self._cut(*found)

    def _tokenize(
        self, groups: list[tuple[int, int]], strings: list[str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The ids of every group's string and each text's ``(start, stop)`` in them; None when a group's
        separators are not one between each two of its texts."""
        encodings = self._encode(strings, add_special_tokens=False)
        del strings
        sizes = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        ids = flat_ids(encodings, int(sizes.sum()))
        del encodings
        ends = np.cumsum(sizes)
        begins = ends - sizes
        counts = np.array([b - a for a, b in groups], dtype=np.int64)
        multi = counts > 1
        seps = np.flatnonzero(ids == self.sep_id)
        group_of = np.searchsorted(ends, seps, side="right")
        between = multi[group_of]  # a separator id in a group of one text is that text's own
        seps = seps[between]
        if not np.array_equal(
            np.bincount(group_of[between], minlength=len(groups)), np.where(multi, counts - 1, 0)
        ):
            return None
        # text spans in order: each group's begin and the token after each separator; each separator and the end
        starts = np.sort(np.concatenate([begins, seps + 1]))
        stops = np.sort(np.concatenate([seps, ends]))
        return ids, starts, stops

    def _cut(
        self, ids: np.ndarray, starts: np.ndarray, stops: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Truncate each text's span as the tokenizer would and put the special tokens around it."""
        length = stops - starts
        keep = length if self.capacity is None else np.minimum(length, self.capacity)
        overflow = length > keep
        source = stops - keep if self.left else starts
        n_head, n_tail = len(self.head), len(self.tail)
        lengths = keep + (n_head + n_tail)
        out_starts = np.cumsum(lengths) - lengths
        out = np.empty(int(lengths.sum()), dtype=np.int32)
        if n_head:
            out[out_starts[:, None] + np.arange(n_head)] = self.head
        if n_tail:
            out[(out_starts + lengths - n_tail)[:, None] + np.arange(n_tail)] = self.tail
        total = int(keep.sum())
        if total:
            before = np.cumsum(keep) - keep
            step = np.arange(total)
            out[np.repeat(out_starts + n_head - before, keep) + step] = ids[
                np.repeat(source - before, keep) + step
            ]
        return lengths.astype(np.int32), overflow, out
