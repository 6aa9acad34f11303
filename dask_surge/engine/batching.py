"""The micro-batching rule, stated once: sort by token length, cut by a token budget.

Both the fast engine (:mod:`dask_surge.engine.transformer`), which runs the rule, and the cost
model (:mod:`dask_surge.planning.costmodel`, :mod:`dask_surge.execution.calibrate`), which replays it
to predict padding and forward passes, call these functions, so a change to the
rule changes both.

The rule
--------
1. Texts are taken in blocks of :data:`BLOCK_TEXTS` consecutive texts (the whole
   call when it is smaller). Each block is tokenized and sorted on its own. Where the
   device runs while the host tokenizes the next block (CUDA), a call of at least
   ``16 * FIRST_BLOCK_TEXTS`` texts starts with a block of :data:`FIRST_BLOCK_TEXTS`
   texts, so the device starts after a small fraction of the call is tokenized; the rest
   follows in full blocks (:func:`blocks`, ``first``).
2. Inside a block, texts are sorted by token length, longest first (stable, so
   equal lengths keep their input order).
3. Sorted texts are cut into micro-batches from the front. A micro-batch is as wide
   as its first (longest) text, ``width = max(length, 1)``, and holds at most
   ``cap = max(1, max_tokens // width)`` texts when a token budget is set, else
   ``batch_rows`` texts (``sentence-transformers``' ``batch_size``), else the whole
   block. A single text always fits, however long.
4. With a token budget, micro-batches are cut where the sorted length changes
   whenever that leaves them at least half full (``split_runs``, the default): a
   run of ``r`` texts of one length, ``r >= max(1, cap // 2)``, is cut into
   ``ceil(r / cap)`` near-equal micro-batches of that length alone, which need no
   padding and no attention mask (the encoder's fastest attention path). A shorter
   run starts a mixed, padded micro-batch of ``cap`` texts, ended early at the last
   length change that keeps it at least half full, so the next one starts on a run.
   Every micro-batch but a block's last holds at least ``max(1, cap // 2)`` texts.
   ``split_runs=False`` is the plain greedy cut (``cap`` texts each), kept for
   comparison.
5. A micro-batch's padded tokens are ``rows x width``.

All functions are pure (numpy in, numpy out) and cheap: the number of Python
iterations is the number of micro-batches, never the number of texts.

Examples
--------
>>> import numpy as np
>>> plan = plan_batches(np.array([3, 9, 5, 9]), max_tokens=20)
>>> plan.order.tolist()
[1, 3, 2, 0]
>>> [(int(a), int(b), int(w)) for a, b, w in plan.batches()]
[(0, 2, 9), (2, 4, 5)]
>>> plan.padded_tokens, plan.real_tokens, plan.uniform.tolist()
(28, 26, [True, False])
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

__all__ = [
    "CPU_MAX_TOKENS",
    "CPU_MAX_TOKENS_CAP",
    "activation_bytes_per_token",
    "cpu_max_tokens",
    "FIRST_BLOCK_TEXTS",
    "BLOCK_TEXTS",
    "BatchPlan",
    "CallShape",
    "cut",
    "plan_batches",
    "replay",
    "sort_order",
    "blocks",
]


#: Token budget of one micro-batch on a CPU (rows x padded length): the budget that measured
#: fastest on 2 cores (``docs/ab_studies.md``, "Micro-batch token budget by model width").
CPU_MAX_TOKENS = 2048
#: The most tokens :func:`cpu_max_tokens` gives a narrow model's micro-batch: past it, a larger
#: micro-batch gains little speed for twice the memory (the same study).
CPU_MAX_TOKENS_CAP = 8192
#: Texts tokenized and length-sorted together: larger blocks sort into less padding (issue 17,
#: ``docs/ab_studies.md``).
BLOCK_TEXTS = 65_536
#: Texts of a large call's first block where the device overlaps the host (see :func:`blocks`):
#: the device starts once these are tokenized, not after the whole first full block. The rest stays
#: in full blocks: growing blocks geometrically added far more padded tokens than a small first block
#: then full ones (``docs/ab_studies.md``, "A short first window").
FIRST_BLOCK_TEXTS = 2048


def activation_bytes_per_token(config, max_seq_length: int) -> int:
    """fp32 bytes of the widest activations alive per token during one layer of a BERT-like
    ``config`` (its feed-forward, the hidden states around it, and one attention row a head).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> minilm = SimpleNamespace(hidden_size=384, intermediate_size=1536, num_attention_heads=12)
    >>> activation_bytes_per_token(minilm, 256)
    27648
    """
    return 4 * (
        int(getattr(config, "intermediate_size", 4 * config.hidden_size))
        + 6 * int(config.hidden_size)
        + int(getattr(config, "num_attention_heads", 1)) * int(max_seq_length)
    )


def cpu_max_tokens(per_token_bytes: int) -> int:
    """The token budget of one micro-batch on a CPU for a model of ``per_token_bytes``
    (:func:`activation_bytes_per_token`).

    A micro-batch holds the activation bytes of :data:`CPU_MAX_TOKENS` tokens of
    all-MiniLM-L6-v2 (256-token rows), where that budget measured best: a narrower model takes
    more tokens (a power of two, at most :data:`CPU_MAX_TOKENS_CAP`), so each of its many small
    operators does more work per call; a wider one keeps :data:`CPU_MAX_TOKENS`.

    Examples
    --------
    >>> cpu_max_tokens(27648)  # all-MiniLM-L6-v2
    2048
    >>> cpu_max_tokens(55296)  # BERT-base: never below CPU_MAX_TOKENS
    2048
    >>> cpu_max_tokens(2048)  # the 2-layer, 32-wide test encoder (128-token rows)
    8192
    """
    budget = CPU_MAX_TOKENS * _MINILM_BYTES_PER_TOKEN
    tokens = CPU_MAX_TOKENS
    while tokens < CPU_MAX_TOKENS_CAP and 2 * tokens * max(1, int(per_token_bytes)) <= budget:
        tokens *= 2
    return tokens


#: :func:`activation_bytes_per_token` of all-MiniLM-L6-v2 at its 256-token rows (27,648)
_MINILM_BYTES_PER_TOKEN = activation_bytes_per_token(
    SimpleNamespace(hidden_size=384, intermediate_size=1536, num_attention_heads=12), 256
)


def _check(max_tokens: int, batch_rows: int) -> None:
    for name, value in (("max_tokens", max_tokens), ("batch_rows", batch_rows)):
        if isinstance(value, bool) or int(value) != value or value < 0:
            raise ValueError(
                f"{name}={value!r} must be an int >= 0 (0 means unset): it sizes one micro-batch. "
                f"Fix: pass e.g. {name}={2048 if name == 'max_tokens' else 32}."
            )


def blocks(n: int, block: int = BLOCK_TEXTS, *, first: int = 0) -> list[int]:
    """Start offsets of the sorting blocks of a call of ``n`` texts.

    Parameters
    ----------
    n : int
        Texts in the call.
    block : int, default :data:`BLOCK_TEXTS`
        Texts per block (the last one may be shorter).
    first : int, default 0
        Texts of a smaller first block (e.g. :data:`FIRST_BLOCK_TEXTS`), used only when the
        call holds at least ``16 * first`` texts (a smaller call is tokenized quickly anyway, and
        cutting it would cost padding: ``docs/ab_studies.md``, "A short first window"); the
        blocks after it are full ones. 0: no small first block.

    Returns
    -------
    list of int
        Block ``k`` is texts ``[starts[k], starts[k + 1])``, the last one ending at ``n``.

    Examples
    --------
    >>> blocks(5, 2)
    [0, 2, 4]
    >>> blocks(0)
    []
    >>> blocks(40, 16, first=2), blocks(31, 16, first=2)
    ([0, 2, 18, 34], [0, 16])
    """
    if block < 1 or first < 0:
        name, value = ("block", block) if block < 1 else ("first", first)
        raise ValueError(
            f"{name}={value!r} must be >= {1 if name == 'block' else 0} text(s): it sizes the sorting "
            f"blocks. Fix: pass e.g. block={BLOCK_TEXTS} or first={FIRST_BLOCK_TEXTS}."
        )
    if first and n >= 16 * first:
        return [0, *range(first, n, block)]
    return list(range(0, n, block))


def sort_order(lengths: np.ndarray) -> np.ndarray:
    """Positions of ``lengths`` sorted longest first; ties keep their input order.

    Examples
    --------
    >>> sort_order(np.array([2, 7, 2, 7])).tolist()
    [1, 3, 0, 2]
    """
    lengths = np.asarray(lengths)
    return np.argsort(-lengths.astype(np.int64, copy=False), kind="stable")


def cut(
    sorted_lengths: np.ndarray, max_tokens: int = 0, batch_rows: int = 0, *, split_runs: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batch boundaries of texts already sorted longest first.

    Parameters
    ----------
    sorted_lengths : numpy.ndarray
        Token length of each text, non-increasing.
    max_tokens : int, default 0
        Token budget per micro-batch (rows x width); 0: count rows instead.
    batch_rows : int, default 0
        Rows per micro-batch when ``max_tokens`` is 0; 0 with ``max_tokens`` 0 means
        one micro-batch for all texts.
    split_runs : bool, default True
        With a token budget, cut where the length changes when that keeps micro-batches
        at least half full (rule 4 of the module docstring), so most of them hold one
        length and need no padding; False: the plain greedy cut.

    Returns
    -------
    bounds : numpy.ndarray
        int64 of length ``k + 1``: micro-batch ``j`` is ``[bounds[j], bounds[j + 1])``.
    widths : numpy.ndarray
        Length ``k``: the padded length of each micro-batch (int64 for integer
        lengths; float64 for fractional ones, e.g. the cost model's quantiles).

    Examples
    --------
    >>> bounds, widths = cut(np.array([10, 10, 4, 4, 4, 1]), max_tokens=20)
    >>> bounds.tolist(), widths.tolist()
    ([0, 2, 5, 6], [10, 4, 1])
    >>> cut(np.array([10, 10, 4, 4, 4, 1]), max_tokens=20, split_runs=False)[0].tolist()
    [0, 2, 6]
    >>> cut(np.array([5, 3, 1]), batch_rows=2)[0].tolist()
    [0, 2, 3]
    """
    _check(max_tokens, batch_rows)
    x = np.asarray(sorted_lengths)
    n = len(x)
    if not (max_tokens and split_runs) or n == 0:
        return _cut_greedy(x, max_tokens, batch_rows)
    # run_ends[k]: one past the last text of the k-th run of equal lengths (ascending, ends with n)
    run_ends = np.append(np.flatnonzero(x[1:] != x[:-1]) + 1, n)
    bounds, widths = [0], []
    start = 0
    while start < n:
        width = max(x[start].item(), 1)
        cap = max(1, int(max_tokens // width))
        half = max(1, cap // 2)
        run_end = int(run_ends[np.searchsorted(run_ends, start, side="right")])
        run = run_end - start
        if run >= half:  # one length alone: ceil(run / cap) near-equal micro-batches, no padding
            pieces = -(-run // cap)
            cuts = start + (np.arange(1, pieces + 1) * run) // pieces
            bounds.extend(cuts.tolist())
            widths.extend([width] * pieces)
            start = run_end
            continue
        stop = min(n, start + cap)  # a short run: a mixed micro-batch, padded
        last = int(run_ends[np.searchsorted(run_ends, stop, side="right") - 1])  # last length change <= stop
        if stop < n and last >= start + half:
            stop = last  # so that the next micro-batch starts on a run
        bounds.append(stop)
        widths.append(width)
        start = stop
    return np.asarray(bounds, dtype=np.int64), np.asarray(widths, dtype=np.result_type(x.dtype, np.int64))


def _cut_greedy(x: np.ndarray, max_tokens: int, batch_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The greedy cut: ``cap`` (or ``batch_rows``) texts per micro-batch from the front."""
    n = len(x)
    bounds, widths = [0], []
    start = 0
    while start < n:
        width = max(x[start].item(), 1)
        rows = max(1, int(max_tokens // width)) if max_tokens else (int(batch_rows) or n)
        start = min(n, start + rows)
        bounds.append(start)
        widths.append(width)
    return np.asarray(bounds, dtype=np.int64), np.asarray(widths, dtype=np.result_type(x.dtype, np.int64))


def replay(
    sorted_lengths: np.ndarray, max_tokens: int = 0, batch_rows: int = 0, *, split_runs: bool = True
) -> tuple[float, int]:
    """Padded tokens and forward passes of one block whose lengths are sorted longest first.

    Examples
    --------
    >>> replay(np.array([10, 10, 4, 4, 4, 1]), max_tokens=20)
    (33.0, 3)
    >>> replay(np.array([10, 10, 4, 4, 4, 1]), max_tokens=20, split_runs=False)
    (36.0, 2)
    """
    bounds, widths = cut(sorted_lengths, max_tokens, batch_rows, split_runs=split_runs)
    return float(np.dot(np.diff(bounds), widths)), len(widths)


@dataclass(frozen=True)
class BatchPlan:
    """How one block of texts is run: the sort and the micro-batches.

    Attributes
    ----------
    order : numpy.ndarray
        int64 positions (in the block) of the texts in run order, longest first.
    lengths : numpy.ndarray
        Token lengths in run order (``original_lengths[order]``).
    bounds : numpy.ndarray
        int64 micro-batch boundaries into ``order`` (see :func:`cut`).
    widths : numpy.ndarray
        int64 padded length of each micro-batch.
    """

    order: np.ndarray
    lengths: np.ndarray
    bounds: np.ndarray
    widths: np.ndarray

    def batches(self) -> Iterator[tuple[int, int, int]]:
        """``(start, stop, width)`` of each micro-batch, into :attr:`order`."""
        return zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), self.widths.tolist())

    @property
    def uniform(self) -> np.ndarray:
        """bool per micro-batch: all its texts have its width (no padding, so no attention mask needed)."""
        if not len(self.widths):
            return np.zeros(0, dtype=bool)
        last = self.lengths[self.bounds[1:] - 1]
        return np.maximum(last, 1) == self.widths

    @property
    def forwards(self) -> int:
        """Micro-batches (forward passes)."""
        return len(self.widths)

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward passes compute, padding included."""
        return int(np.dot(np.diff(self.bounds), self.widths))

    @property
    def real_tokens(self) -> int:
        """Tokens of the texts themselves."""
        return int(self.lengths.sum())

    @property
    def padding_ratio(self) -> float:
        """``padded_tokens / real_tokens`` (1.0 is no padding; 1.0 for an empty block)."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 1.0


class CallShape:
    """What one encode call's forward passes computed, summed over its blocks (a tally).

    The fast engine counts these as it runs (:class:`~dask_surge.engine.long_texts.TextEmbeddings`
    ``.shape``), so a run can attribute its measured encode time to the cost model's terms
    (per text, per padded token, per forward pass) without tokenizing again.

    Attributes
    ----------
    sequences : int
        Sequences run through the model (texts, or windows with ``long_texts="chunk"``/``"mean"``).
    tokens, padded_tokens : int
        Real tokens, and tokens the forward passes computed (padding included).
    forwards : int
        Forward passes (micro-batches).

    Examples
    --------
    >>> shape = CallShape()
    >>> shape.add(plan_batches(np.array([3, 9, 5, 9]), max_tokens=20))
    >>> shape.sequences, shape.tokens, shape.padded_tokens, shape.forwards
    (4, 26, 28, 2)
    """

    def __init__(self) -> None:
        self.sequences = self.tokens = self.padded_tokens = self.forwards = 0

    def add(self, plan: BatchPlan) -> None:
        """Count one block's plan."""
        self.sequences += len(plan.order)
        self.tokens += plan.real_tokens
        self.padded_tokens += plan.padded_tokens
        self.forwards += plan.forwards

    def __repr__(self) -> str:
        return (
            f"CallShape(sequences={self.sequences}, tokens={self.tokens}, "
            f"padded_tokens={self.padded_tokens}, forwards={self.forwards})"
        )


def plan_batches(
    lengths: np.ndarray, max_tokens: int = 0, batch_rows: int = 0, *, split_runs: bool = True
) -> BatchPlan:
    """Sort one block of texts by token length and cut it into micro-batches.

    Parameters
    ----------
    lengths : numpy.ndarray
        Token length of each text of the block, in input order.
    max_tokens, batch_rows : int
        As in :func:`cut`.
    split_runs : bool, default True
        As in :func:`cut`.

    Returns
    -------
    BatchPlan

    Examples
    --------
    >>> p = plan_batches(np.array([1, 4, 2]), max_tokens=8)
    >>> p.order.tolist(), p.bounds.tolist(), p.widths.tolist(), p.forwards
    ([1, 2, 0], [0, 1, 3], [4, 2], 2)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = sort_order(lengths)
    ordered = lengths[order]
    bounds, widths = cut(ordered, max_tokens, batch_rows, split_runs=split_runs)
    return BatchPlan(order=order, lengths=ordered, bounds=bounds, widths=widths)
