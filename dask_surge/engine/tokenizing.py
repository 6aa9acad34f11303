"""The host side of the fast engine: tokenize with the Rust tokenizer, sort by length, pack int32 ids.

:class:`TextPacker` holds a private copy of a model's fast tokenizer (truncation set,
padding off) and turns texts into blocks of :data:`~dask_surge.engine.batching.BLOCK_TEXTS`
texts, each planned by :func:`~dask_surge.engine.batching.plan_batches` and gathered, in run
order, into one int32 array (:class:`PackedBlock`). Nothing here imports torch: the
device side (:mod:`dask_surge.engine.forward`) turns a packed block into tensors.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SurgeInputError
from ..io.texts import ArrowTexts, as_list, as_texts
from . import tuning
from .batching import BLOCK_TEXTS, FIRST_BLOCK_TEXTS, BatchPlan, plan_batches
from .batching import blocks as block_starts
from .joined import JoinedTokenizer, flat_ids
from .tokenpool import Pending, TokenizedBlock, TokenizerProcessError, TokenPool, auto_processes

__all__ = ["STAGES", "PackedBlock", "StageClock", "TextPacker", "gc_paused", "prepared", "unreadable_text"]


logger = logging.getLogger(__name__)

#: What a block of :meth:`TextPacker.blocks` holds: the Rust tokenizer's encodings (tokenized in
#: this process, text by text) or a :class:`~dask_surge.engine.tokenpool.TokenizedBlock` (texts joined,
#: :mod:`dask_surge.engine.joined`, or tokenized by a helper process).
Tokenized = list | TokenizedBlock

#: The stages whose seconds an engine counts (see :attr:`StageClock.stats`).
STAGES = ("tokenize", "pack", "device", "finish")


_gc_lock = threading.Lock()
_gc_pauses = 0  # threads inside gc_paused() now
_gc_was_enabled = False  # the collector's state when the first of them entered


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector while the block runs (thread-safe, nestable), where
    the tuning setting ``surge.tuning.gc-pause`` is on in this process (:func:`~dask_surge.engine.tuning.active`:
    in a worker the plugin turned it on, or anywhere it is forced); else the block runs as it is.

    The Rust tokenizer hands back one GC-tracked ``Encoding`` object per text: allocating
    a block of them triggers collections that walk the whole heap of a worker, holding the GIL
    (``docs/ab_studies.md``). Nothing they hold forms cycles, so nothing is lost by collecting
    later. The collector's state is restored when the last thread leaves.

    Examples
    --------
    >>> import dask
    >>> enabled = gc.isenabled()
    >>> with gc_paused():  # a user's own process: the collector is left alone
    ...     untouched = gc.isenabled() == enabled
    >>> with dask.config.set({"surge.tuning.gc-pause": True}), gc_paused():
    ...     with gc_paused():
    ...         paused = not gc.isenabled()
    >>> untouched, paused, gc.isenabled() == enabled
    (True, True, True)
    """
    if not tuning.active("gc-pause"):
        yield
        return
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def prepared(blocks: Iterator[tuple[int, Any]], prepare: Callable[[Any, int], Any]) -> Iterator[Any]:
    """``prepare(item, offset)`` of each ``(offset, item)`` of ``blocks``, with the collector paused
    (:func:`gc_paused`) from making each item to the end of its preparation; the item (a block's
    encodings) is dropped before the result is handed on, so one block's encodings live at a time.

    Examples
    --------
    >>> list(prepared(iter([(0, "ab"), (2, "c")]), lambda item, offset: (offset, item.upper())))
    [(0, 'AB'), (2, 'C')]
    """
    while True:
        with gc_paused():
            step = next(blocks, None)
            if step is None:
                return
            result = prepare(step[1], step[0])
            del step  # the encodings go now, not when the next block comes
        yield result


class StageClock:
    """Seconds spent per stage, summed over calls and threads, with the calls and texts counted.

    Examples
    --------
    >>> clock = StageClock()
    >>> clock.call(3); clock.stats["calls"], clock.stats["texts"]
    (1, 3)
    """

    def __init__(self) -> None:
        self.stats: dict[str, float] = dict.fromkeys(("calls", "texts", *STAGES), 0)
        self._lock = threading.Lock()

    def count(self, key: str, t0: float) -> None:
        """Add the seconds since ``t0`` (``time.perf_counter()``) to stage ``key``."""
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats[key] += dt

    def call(self, texts: int) -> None:
        """Count one finished call of ``texts`` texts."""
        with self._lock:
            self.stats["calls"] += 1
            self.stats["texts"] += texts


@dataclass(frozen=True)
class PackedBlock:
    """One block, packed on the host: its micro-batch plan and its token ids in run order.

    Attributes
    ----------
    plan : BatchPlan
    size : int
        Real tokens of the block (the length of ``ids``).
    ids : numpy.ndarray
        int32 token ids of every text, in run order, one after the other.
    lengths, starts : numpy.ndarray
        Token length (int32) and offset into ``ids`` (int64) of each text, in run order.
    where : numpy.ndarray
        Row of each text in the call's output, in run order (int64).
    """

    plan: BatchPlan
    size: int
    ids: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    where: np.ndarray


class TextPacker:
    """Tokenize texts (a prompt put first) and pack them into length-sorted blocks of int32 ids.

    Parameters
    ----------
    hf_tokenizer : transformers.PreTrainedTokenizerFast
        The model's tokenizer; a copy of its Rust ``backend_tokenizer`` is used (the
        model's own keeps its settings).
    max_seq_length : int
        Truncation length in tokens.
    prompt : str
        Text put before every input (``""`` for none).
    include_prompt : bool
        False when the ``Pooling`` module leaves the prompt's tokens out:
        :attr:`prompt_length` then counts them.
    clock : StageClock
        Where the ``tokenize`` and ``pack`` seconds go.
    processes : int, default 0
        Helper processes that tokenize (:class:`~dask_surge.engine.tokenpool.TokenPool`, started on
        first use); 0 tokenizes in this process. Settable: :attr:`processes`.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        max_seq_length: int,
        *,
        prompt: str = "",
        include_prompt: bool = True,
        clock: StageClock,
        processes: int = 0,
    ) -> None:
        self.max_seq_length = int(max_seq_length)
        self.clock = clock
        self._tokenizer = hf_tokenizer.backend_tokenizer.__class__.from_str(
            hf_tokenizer.backend_tokenizer.to_str()
        )
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(
            self.max_seq_length, strategy="longest_first", direction=hf_tokenizer.truncation_side
        )
        self._encode_batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        #: Texts joined into few tokenizer inputs (the same ids, far fewer Python objects), or None where the
        #: tokenizer does not allow it (see :mod:`dask_surge.engine.joined`).
        self._joiner = JoinedTokenizer.of(self._tokenizer)
        #: Whether texts are joined where the tokenizer allows it (the tuning setting
        #: ``surge.tuning.joined-tokenizing``; :meth:`tune` sets it for the engine's device).
        self.joined_tokenizing = True
        #: Id that pads a row (the tokenizer's pad token, else 0).
        self.pad_id: int = hf_tokenizer.pad_token_id or 0
        #: True when the model takes ``token_type_ids``.
        self.type_ids: bool = "token_type_ids" in hf_tokenizer.model_input_names
        #: The prompt put before every text ("" for none).
        self.prompt = prompt or ""
        #: Tokens of the prompt left out of pooling (0 when the Pooling module includes the prompt).
        self.prompt_length = 0
        if self.prompt and not include_prompt:
            self.prompt_length = self._prompt_tokens(set(getattr(hf_tokenizer, "all_special_ids", ()) or ()))
        #: Helper processes that tokenize (0: this process does). A change applies from the next call
        #: (the pool of another size is closed and a new one started on first use).
        self.processes = processes
        self._pool: TokenPool | None = None
        self._pool_lock = threading.Lock()
        self._pool_failure: str | None = None  # why the helpers are no longer used, once one died

    @property
    def _joined(self) -> JoinedTokenizer | None:
        """The joined tokenizer where :attr:`joined_tokenizing` is on and the tokenizer allows it, else None."""
        return self._joiner if self.joined_tokenizing else None

    @_joined.setter
    def _joined(self, joiner: JoinedTokenizer | None) -> None:
        self._joiner = joiner

    def tune(self, device: str, processes: int | None = None) -> None:
        """Take the engine's tuning settings for ``device`` (:mod:`dask_surge.engine.tuning`) from the next call.

        Parameters
        ----------
        device : str
            The device the engine runs on (``"cpu"``, ``"cuda:0"``).
        processes : int, optional
            Helper processes that tokenize; None: ``surge.tuning.tokenize-processes`` for ``device``.

        Examples
        --------
        >>> from transformers import AutoTokenizer
        >>> from dask_surge.testing import packaged_model_dir
        >>> packer = TextPacker(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 8, clock=StageClock())
        >>> packer.tune("cuda:0")
        >>> packer.joined_tokenizing, packer.processes
        (False, 0)
        >>> packer.tune("cpu", 2)
        >>> packer.joined_tokenizing, packer.processes
        (True, 2)
        """
        self.joined_tokenizing = bool(tuning.setting("joined-tokenizing", device))
        self.processes = auto_processes(device) if processes is None else int(processes)

    def tokenizer_json(self) -> str:
        """This packer's tokenizer (truncation set, padding off) as ``tokenizers.Tokenizer.to_str()`` writes it."""
        return self._tokenizer.to_str()

    def token_pool(self) -> TokenPool | None:
        """The helper processes that tokenize, or None when this process does (:attr:`processes` is 0,
        or a helper died: then the packer stays in process, see :meth:`blocks`)."""
        with self._pool_lock:
            pool = self._pool
            tuned = (tuning.active("gc-pause"), self.joined_tokenizing)  # what the helpers were set up with
            if pool is not None and (pool.processes != self.processes or pool.closed or pool.tuned != tuned):
                self._pool = None
                pool.close()
                pool = None
            if pool is None and self.processes > 0 and self._pool_failure is None:
                pool = self._pool = TokenPool(
                    self.tokenizer_json(),
                    self.max_seq_length,
                    prompt=self.prompt,
                    processes=self.processes,
                    gc_pause=tuned[0],
                    joined=tuned[1],
                )
            return pool

    def _pool_died(self, err: TokenizerProcessError) -> None:
        """A helper died: close the pool, tokenize in process from now on, and say so once."""
        with self._pool_lock:
            first = self._pool_failure is None
            self._pool_failure = str(err)
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        if first:
            warnings.warn(str(err), RuntimeWarning, stacklevel=3)
            logger.warning("dask-surge: %s", err)

    def close(self) -> None:
        """Stop the helper processes, if any (they start again on the next call); idempotent."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _prompt_tokens(self, special_ids: set[int]) -> int:
        """Tokens of the prompt alone (truncated), less a trailing special token: sentence-transformers' rule."""
        ids = self._tokenizer.encode(self.prompt).ids
        return len(ids) - 1 if ids and ids[-1] in special_ids else len(ids)

    def tokenize(self, texts: Sequence[str]) -> Tokenized:
        """``texts`` tokenized in this process (prompt first, truncated, unpadded): a
        :class:`~dask_surge.engine.tokenpool.TokenizedBlock` where the tokenizer allows joining texts
        (:class:`~dask_surge.engine.joined.JoinedTokenizer`, the same ids), else the Rust tokenizer's encodings.

        Raises
        ------
        SurgeInputError
            If an element of ``texts`` is not a str.

        Examples
        --------
        >>> from transformers import AutoTokenizer
        >>> from dask_surge.testing import packaged_model_dir
        >>> packer = TextPacker(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 8, clock=StageClock())
        >>> block = packer.tokenize(["a dog", "one two three four five six seven"])
        >>> type(block).__name__, block.lengths.tolist(), block.overflow.tolist()
        ('TokenizedBlock', [4, 8], [False, True])
        """
        t0 = time.perf_counter()
        texts = as_list(texts)
        try:
            inputs = [self.prompt + t for t in texts] if self.prompt else texts
            if self._joined is not None:
                tokenized: Tokenized = TokenizedBlock(*self._joined.encode(inputs))
            else:
                with gc_paused():  # one GC-tracked object per text (see gc_paused)
                    tokenized = self._encode_batch(inputs)
            self.clock.count("tokenize", t0)
            return tokenized
        except TypeError:
            if (err := unreadable_text(texts)) is None:
                raise
            raise err from None

    def count_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """Token length of each text after truncation, special tokens included (int32)."""
        texts = as_texts(texts)
        pool = self.token_pool()
        if pool is not None and texts:
            t0 = time.perf_counter()
            done = self._pooled(pool, texts, ids=False)
            if done is not None:
                self.clock.count("tokenize", t0)
                return done.lengths
        tokenized = self.tokenize(texts)
        if isinstance(tokenized, TokenizedBlock):
            return tokenized.lengths
        return np.fromiter(map(len, tokenized), dtype=np.int32, count=len(texts))

    def _submit(
        self, pool: TokenPool, texts: Sequence[str], *, ids: bool = True, block: bool = True
    ) -> Pending | TokenizerProcessError | None:
        """``pool.submit(texts)``; a :class:`TokenizerProcessError` is returned (a died one handled), not raised."""
        try:
            return pool.submit(texts, ids=ids, block=block)
        except TypeError:
            if (err := unreadable_text(texts)) is None:
                raise
            raise err from None
        except TokenizerProcessError as err:
            return self._failed(err)

    def _failed(self, err: TokenizerProcessError) -> TokenizerProcessError:
        if err.died:
            self._pool_died(err)
        else:
            logger.info("dask-surge: a block is tokenized in process: %s", err)
        return err

    def _pooled(self, pool: TokenPool, texts: Sequence[str], *, ids: bool = True) -> TokenizedBlock | None:
        """``texts`` tokenized by a helper, or None when that failed (see :meth:`_submit`)."""
        pending = self._submit(pool, texts, ids=ids)
        if not isinstance(pending, Pending):
            return None
        try:
            return pending.result()
        except TokenizerProcessError as err:
            self._failed(err)
            return None

    def blocks(
        self, texts: list[str] | ArrowTexts, *, background: bool = False
    ) -> Iterator[tuple[int, Tokenized]]:
        """Yield ``(offset, encodings)`` per block; with ``background`` the next block tokenizes meanwhile.

        Blocks follow :func:`~dask_surge.engine.batching.blocks`; with ``background`` (the device
        runs while the host tokenizes) a large call starts with a block of
        :data:`~dask_surge.engine.batching.FIRST_BLOCK_TEXTS` texts, so the device starts early.
        With :attr:`processes` > 0 the helper processes tokenize (one block per helper handed over
        ahead of the one yielded, whatever ``background`` says) and each block is a
        :class:`~dask_surge.engine.tokenpool.TokenizedBlock`; the blocks, and so the plans and the
        embeddings, are the same. When a helper dies the rest is tokenized in this process, with a
        ``RuntimeWarning`` that says why (:class:`~dask_surge.engine.tokenpool.TokenizerProcessError`).

        Examples
        --------
        >>> from transformers import AutoTokenizer
        >>> from dask_surge.testing import packaged_model_dir
        >>> packer = TextPacker(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 8, clock=StageClock())
        >>> [(offset, len(e)) for offset, e in packer.blocks(["a"] * 3)]
        [(0, 3)]
        >>> packer.processes = 1  # a helper process tokenizes
        >>> [(offset, type(e).__name__, len(e)) for offset, e in packer.blocks(["a"] * 3)]
        [(0, 'TokenizedBlock', 3)]
        >>> packer.close()
        """
        starts = block_starts(len(texts), BLOCK_TEXTS, first=FIRST_BLOCK_TEXTS if background else 0)
        spans = list(zip(starts, [*starts[1:], len(texts)]))
        pool = self.token_pool() if texts else None
        if pool is not None:
            yield from self._pooled_windows(pool, texts, spans)
            return
        if not background or len(spans) < 2:
            for start, stop in spans:
                yield start, self.tokenize(texts[start:stop])
            return
        with ThreadPoolExecutor(1, thread_name_prefix="surge-tokenize") as pool_:
            pending = pool_.submit(self.tokenize, texts[spans[0][0] : spans[0][1]])
            for k, (start, _) in enumerate(spans):
                encodings = pending.result()
                if k + 1 < len(spans):
                    a, b = spans[k + 1]
                    pending = pool_.submit(self.tokenize, texts[a:b])
                yield start, encodings
                del encodings  # before the next block's are taken

    def _pooled_windows(
        self, pool: TokenPool, texts: list[str] | ArrowTexts, spans: list[tuple[int, int]]
    ) -> Iterator[tuple[int, Tokenized]]:
        """:meth:`blocks` through the helper processes: up to one block per helper in flight ahead of
        the one the caller packs. A block a helper could not take or finish is tokenized here; after a
        helper died, every later one is (the same ids either way)."""
        ahead: deque[tuple[int, int, Pending]] = deque()
        k = 0  # the next span to hand over
        in_process = False
        try:
            while k < len(spans) or ahead:
                while not in_process and k < len(spans) and len(ahead) < pool.processes:
                    t0 = time.perf_counter()
                    a, b = spans[k]
                    # never wait for a helper while holding one: two calls could each wait for the other's
                    got = self._submit(pool, texts[a:b], block=not ahead)
                    self.clock.count("tokenize", t0)
                    if got is None:
                        break  # every helper is busy: take a result first
                    if isinstance(got, TokenizerProcessError):
                        in_process = got.died
                        if not ahead:
                            k += 1
                            yield a, self.tokenize(texts[a:b])
                        break
                    ahead.append((a, b, got))
                    k += 1
                if not ahead:
                    if k < len(spans):  # the helpers are gone: the rest here
                        a, b = spans[k]
                        k += 1
                        yield a, self.tokenize(texts[a:b])
                    continue
                a, b, pending = ahead.popleft()
                t0 = time.perf_counter()
                try:
                    item: Tokenized = pending.result()
                except TokenizerProcessError as err:
                    self._failed(err)
                    in_process = in_process or err.died
                    item = self.tokenize(texts[a:b])
                self.clock.count("tokenize", t0)
                yield a, item
                del item
        finally:  # the caller stopped early (an error) or finished: free the helpers still working for it
            for _, _, pending in ahead:
                pending.discard()

    def overflowed(self, encodings: Tokenized) -> np.ndarray:
        """bool per encoding: its text was cut (truncation left tokens over), without tokenizing again.

        Only an encoding :attr:`max_seq_length` long can have been cut; for those the tokenizer's
        ``overflowing`` part says whether it was.

        Examples
        --------
        >>> from transformers import AutoTokenizer
        >>> from dask_surge.testing import packaged_model_dir
        >>> packer = TextPacker(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 5, clock=StageClock())
        >>> packer.overflowed(packer.tokenize(["one two three", "one two three four five", ""])).tolist()
        [False, True, False]
        """
        if isinstance(encodings, TokenizedBlock):
            return encodings.overflow
        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        out = np.zeros(len(encodings), dtype=bool)
        for i in np.flatnonzero(lengths >= self.max_seq_length).tolist():
            out[i] = bool(encodings[i].overflowing)
        return out

    def pack_windows(
        self,
        content: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        offset: int,
        *,
        head: np.ndarray,
        tail: np.ndarray,
        max_tokens: int,
        split_runs: bool = True,
    ) -> PackedBlock:
        """Plan and pack blocks of token ids already cut (no tokenizing): each is ``head + content[a:b] + tail``.

        Parameters
        ----------
        content : numpy.ndarray
            int32 content token ids; block ``k`` is ``content[starts[k] : starts[k] + lengths[k]]``.
        starts, lengths : numpy.ndarray
            Per block (blocks may overlap in ``content``).
        offset : int
            Row of the first block in the call's output.
        head, tail : numpy.ndarray
            int32 ids put before (the leading special tokens and the prompt's) and after
            (the trailing special tokens) each block.
        max_tokens, split_runs
            As in :meth:`pack`.

        Examples
        --------
        >>> from transformers import AutoTokenizer
        >>> from dask_surge.testing import packaged_model_dir
        >>> packer = TextPacker(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 8, clock=StageClock())
        >>> w = packer.pack_windows(np.array([7, 8, 9], np.int32), np.array([0, 1]), np.array([2, 1]), 0,
        ...                         head=np.array([1], np.int32), tail=np.array([2], np.int32), max_tokens=64)
        >>> w.ids.tolist(), w.where.tolist()
        ([1, 7, 8, 2, 1, 8, 2], [0, 1])
        """
        t0 = time.perf_counter()
        n_head, n_tail = len(head), len(tail)
        lengths = np.asarray(lengths, dtype=np.int64)
        plan = plan_batches(lengths + (n_head + n_tail), max_tokens, split_runs=split_runs)
        run_lengths = plan.lengths.astype(np.int64)
        out_starts = np.cumsum(run_lengths) - run_lengths
        flat = np.empty(int(run_lengths.sum()), dtype=np.int32)
        if n_head:
            flat[out_starts[:, None] + np.arange(n_head)] = head
        if n_tail:
            flat[(out_starts + run_lengths - n_tail)[:, None] + np.arange(n_tail)] = tail
        inner = lengths[plan.order]
        total = int(inner.sum())
        if total:
            shift = np.repeat(np.asarray(starts, dtype=np.int64)[plan.order] - (out_starts + n_head), inner)
            dst = np.repeat(out_starts + n_head - (np.cumsum(inner) - inner), inner) + np.arange(total)
            flat[dst] = content[dst + shift]
        block = PackedBlock(
            plan=plan,
            size=int(flat.size),
            ids=flat,
            lengths=run_lengths.astype(np.int32),
            starts=out_starts,
            where=plan.order + offset,
        )
        self.clock.count("pack", t0)
        return block

    def pack(
        self, encodings: Tokenized, offset: int, *, max_tokens: int, split_runs: bool = True
    ) -> PackedBlock:
        """Plan one block (:func:`~dask_surge.engine.batching.plan_batches`) and gather its ids in run order."""
        if isinstance(encodings, TokenizedBlock):
            return self._pack_tokenized(encodings, offset, max_tokens=max_tokens, split_runs=split_runs)
        t0 = time.perf_counter()
        lengths = np.fromiter(map(len, encodings), dtype=np.int32, count=len(encodings))
        plan = plan_batches(lengths, max_tokens, split_runs=split_runs)
        ordered = operator.itemgetter(*plan.order.tolist())(encodings) if len(encodings) > 1 else encodings
        flat = flat_ids(ordered, plan.real_tokens)
        block = PackedBlock(
            plan=plan,
            size=int(flat.size),
            ids=flat,
            lengths=plan.lengths.astype(np.int32),
            starts=(np.cumsum(plan.lengths) - plan.lengths).astype(np.int64),
            where=plan.order + offset,
        )
        self.clock.count("pack", t0)
        return block

    def _pack_tokenized(
        self, block: TokenizedBlock, offset: int, *, max_tokens: int, split_runs: bool = True
    ) -> PackedBlock:
        """:meth:`pack` of a block tokenized as arrays (joined texts, or a helper): the same plan, the ids
        gathered with NumPy."""
        t0 = time.perf_counter()
        plan = plan_batches(block.lengths, max_tokens, split_runs=split_runs)
        flat = _gather(block.ids, block.starts, block.lengths, plan.order)
        packed = PackedBlock(
            plan=plan,
            size=int(flat.size),
            ids=flat,
            lengths=plan.lengths.astype(np.int32),
            starts=(np.cumsum(plan.lengths) - plan.lengths).astype(np.int64),
            where=plan.order + offset,
        )
        self.clock.count("pack", t0)
        return packed


def _gather(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The ids of the texts ``order`` (text ``i``: ``ids[starts[i] : starts[i] + lengths[i]]``), one after
    the other (NumPy, no loop over texts).

    Examples
    --------
    >>> _gather(np.arange(6, dtype=np.int32), np.array([0, 2, 5]), np.array([2, 3, 1]), np.array([1, 2, 0])).tolist()
    [2, 3, 4, 5, 0, 1]
    """
    inner = lengths[order].astype(np.int64)
    total = int(inner.sum())
    if not total:
        return np.empty(0, dtype=np.int32)
    shift = np.repeat(starts[order].astype(np.int64) - (np.cumsum(inner) - inner), inner)
    return ids[shift + np.arange(total)]


def unreadable_text(texts: Sequence, name: Callable[[int], str] | None = None) -> SurgeInputError | None:
    """The error for the first element of ``texts`` that no tokenizer can read: one that is not a
    str, or a str with a lone surrogate (it has no UTF-8 form); None when every one is readable.
    ``name(i)`` names element ``i`` in the message (default: ``texts[i]``). Only for the error
    path: it looks at every text.

    Examples
    --------
    >>> print(unreadable_text(["a", 3]))
    texts[1]=3 is a int, but every text must be a str; Fix: drop or fill missing values first (e.g. series.fillna('')).
    >>> print(unreadable_text(["a", "broken \\ud83d emoji"]))  # doctest: +ELLIPSIS
    texts[1]='broken \\ud83d emoji' holds a lone surrogate ('\\ud83d' at character 7), which has no UTF-8 form...
    >>> unreadable_text(["a", "b"]) is None
    True
    """
    name = name or (lambda i: f"texts[{i}]")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            return SurgeInputError(
                f"{name(i)}={text!r:.60} is a {type(text).__name__}, but every text must be a str; "
                "Fix: drop or fill missing values first (e.g. series.fillna(''))."
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return SurgeInputError(
                f"{name(i)}={text!r:.60} holds a lone surrogate ({text[err.start]!r} at character {err.start}), "
                f"{LONE_SURROGATE}"
            )
    return None


#: Why a str with a lone surrogate cannot be encoded, and the fix: the tail of each error that finds one
#: (:func:`unreadable_text`, and the run's error when Dask's conversion to Arrow strings met it first).
LONE_SURROGATE = (
    "which has no UTF-8 form, so no tokenizer can read it (it comes from bytes decoded with "
    "errors='surrogateescape', or a JSON \\ud83d escape without its pair). Fix: replace such "
    "characters first, e.g. series.map(lambda s: s.encode('utf-8', 'replace').decode('utf-8'))."
)
