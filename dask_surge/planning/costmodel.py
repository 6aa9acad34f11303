"""Cost model (SURGE Theorem 1) and the phi/CV advisor.

This module is pure (numpy and pandas only): it predicts, from partition sizes
and a few calibrated constants (:class:`CostParams`, measured on the live
cluster by :func:`dask_surge.execution.calibrate.calibrate`), how long SURGE and the
three baselines take, how much memory a worker holds and when the first output
appears.

Theorem 1 (as implemented here)
-------------------------------
Let a policy issue encode calls of ``b_1, ..., b_K`` rows with ``t_k`` tokens,
call ``k`` folding ``p_k`` input partitions, on ``W`` single-model workers.
With the per-call fixed cost ``alpha(c)`` (task dispatch + transfer + encode
set-up; see below for its dependence on the call's encode time ``c``), the
per-folded-partition cost ``pi`` (producing the input partition inside the
SuperBatch task, which runs its upstream tasks fused, and concatenating it, or,
for an input shared by several SuperBatches, its own task and transfer; zero for
PBP, where partition and call are one task) and the encode cost

.. math::

    c(b, t) = \\beta_0 b + \\gamma\\,\\hat t(b, t) + \\beta\\, b_0\\, f(b),

where ``beta_0`` is the per-text cost, ``gamma`` the per-token cost, ``t_hat``
the *padded* tokens the forward passes actually compute, ``f(b)`` the number of
forward passes (micro-batches) and ``beta b0`` the fixed cost of one forward
pass, written as the cost of ``b0`` rows at the asymptotic per-row cost
``beta = beta_0 + gamma tau`` (``tau`` tokens a text), each call is a job of
length ``s_k = alpha(c_k) + pi p_k + c_k`` with ``c_k = c(b_k, t_k)`` (a SURGE run's
SuperBatches share their unit's task, so once runs measured it, a SuperBatch pays
``superbatch_s`` instead of ``alpha(c_k)``). Jobs go
to workers in plan order, each to the earliest-free worker (SURGE, PBP: Dask's queue of
root tasks hands them out in priority order as workers free up), or, for PB-PBP-LB, largest first to the least-loaded worker (LPT). Then

.. math::

    T = T_0 + \\mathrm{fill} + \\max\\bigl(\\max_w \\sum_{k \\to w} s_k,\\; T_{io}\\bigr),
    \\qquad T_{io} = N \\rho / W,

where ``T_0`` is the fixed cost of one run (graph submission, latency to the
first task, the final gather to the client), ``rho`` the time per row that
the encode curve does not explain (shipping rows in and embeddings out,
building the output) and that overlaps with encoding, and ``fill`` the I/O
time of the first call, which cannot overlap. On a CPU device encoding and
I/O share the worker's cores, so nothing overlaps: ``rho b_k`` joins each job
``s_k`` and ``T_io = fill = 0``. Throughput is ``N / T``.

The per-call cost ``alpha(c)`` depends on how busy the call keeps its
worker (:func:`call_overhead`): a call that encodes for at least
``busy_call_s`` pays ``alpha``; a shorter one pays less, down to
``alpha_idle`` for a call that encodes nothing, linearly in ``c``. On a
machine with as many cores as workers the scheduler's and client's CPU per
task competes with encoding while the workers are busy, but runs on idle
cores while one-row calls wait for their round trips, so a busy call pays
more than a one-row call.

Every constant is measured on the live cluster by
:func:`dask_surge.execution.calibrate.calibrate`, from runs that the formula above
describes exactly (waves of equal jobs): ``c`` from encode calls timed on all
workers at once, ``T0`` as the intercept of PBP runs over one-row partitions,
``rho`` from PBP runs with an encoder that costs nothing over partitions of
one and of many rows, ``alpha`` as what ``c(m) + rho m`` does not explain per
call in PBP runs over partitions of a moderate size ``m`` (``c(m)`` about the
one-row per-call overhead; ``busy_call_s = c(m)``), ``alpha_idle`` from the
slope of the one-row runs, and ``pi``
from SuperBatches of one-row partitions (see
:func:`dask_surge.execution.calibrate.solve_dask_terms`). Each written run then
refreshes the encode curve from its SuperBatches' model time
(:func:`dask_surge.execution.calibrate.refresh_params`) and ``T0`` and ``rho``
from its measured time (:func:`dask_surge.execution.calibrate.refresh_run_terms`),
so a cached calibration converges to what runs cost. ``alpha`` and ``pi`` include
the scheduler round trips and the scheduler's and client's CPU per task.

Why this ``c``: the encoder sorts a call's texts by token length and cuts
micro-batches by a token budget (or a fixed row count). A call of a few rows is
one short, under-filled forward pass: its fixed launch cost ``beta b0`` is
shared by few rows, so throughput for ``b << b0`` is about ``b / (b + b0)`` of
the asymptote. A call of tens of rows is one or two forward passes padded to
their longest text (``t_hat > t``); a large call sorts many texts into
homogeneous micro-batches, so padding vanishes and the per-forward cost is
amortized. ``t_hat(b)`` and ``f(b)`` are computed, not guessed, by replaying
the encoder's batching rule on the calibrated token-length distribution, so
the model stays linear in ``(setup, beta_0, gamma, beta b0)`` and a short probe
fits it by non-negative least squares.

FB (fixed batching) gathers all ``N`` rows into one process (``P`` partition
tasks over ``W`` workers, then ``N rho`` of transfer) and encodes them in
``ceil(N / B)`` calls of ``B`` rows on one model worker, each paying only the
encode set-up (no task dispatch); it produces output only at the end.

Peak memory of a worker is the model plus the resident input and embeddings of
its largest call (SURGE: ``min(b_max, b_min - 1 + n_max)`` rows by Lemma 3,
independent of ``N``); FB holds all ``N`` rows and all embeddings at once.
Time to first output (TTFO) is when the first call (SURGE: the first
SuperBatch; PBP: the first partition) finishes; FB's is its whole run.

phi and CV: ``phi = alpha / (alpha + beta mean(n))`` (``beta`` the asymptotic
per-row cost) is the share of a mean partition's call spent in fixed cost;
fusing removes most of it, so high phi means a large gain (``alpha`` here is
the busy-call ``alpha_s``). ``CV = std(n) /
mean(n)`` drives ``n_max``, hence memory and the straggler tail.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import pandas as pd

from ..engine.batching import BLOCK_TEXTS, replay
from ..errors import SurgeValueError
from .policy import plan_superbatches, validate_thresholds

__all__ = [
    "CostParams",
    "predict",
    "phi_cv",
    "Advice",
    "advise",
    "auto_thresholds",
    "call_cost",
    "call_overhead",
    "calls_seconds",
    "batch_shape",
    "token_quantiles",
]

POLICIES = ("surge", "pbp", "fb", "pb-pbp-lb")


@dataclass(frozen=True)
class CostParams:
    """Calibrated constants of the cost model (seconds, bytes, rows).

    Attributes
    ----------
    alpha_s : float
        Fixed cost of one encode call through Dask: task dispatch, transfer and
        encode set-up (``setup_s`` of it is the set-up alone), for a call whose
        encode keeps its worker busy (``c >= busy_call_s``).
    alpha_idle_s : float
        The same for a call that encodes almost nothing (a one-row call): the
        workers idle between round trips, so the scheduler's and client's CPU
        per task does not compete with encoding. Used when ``busy_call_s > 0``.
    busy_call_s : float
        Encode time ``c`` from which a call pays the full ``alpha_s``; calls
        with ``c < busy_call_s`` pay ``alpha_idle_s + (alpha_s - alpha_idle_s)
        c / busy_call_s``. 0 (default): every call pays ``alpha_s``.
    superbatch_s : float or None
        Fixed cost of one SuperBatch in a SURGE run, where a task runs several of them
        one after the other (a unit) and one task's dispatch is shared by them: measured
        by written runs (:func:`dask_surge.execution.calibrate.refresh_run_terms`). Can be
        a float, or None (the probe's) for the per-call cost every call pays (``alpha``).
    per_text_s : float
        Encode cost per text, independent of its length (tokenization, framing).
    per_token_s : float
        Encode cost per token (the forward pass).
    b0 : float
        Small-batch scale in rows: one forward pass has a fixed cost equal to
        encoding ``b0`` rows, so a call of ``b`` rows in one under-filled
        forward pass runs at about ``b / (b + b0)`` of the asymptotic throughput.
    workers : int
        Model workers (one per GPU, or one per core on a CPU).
    setup_s : float
        The encode-call set-up part of ``alpha_s`` (what FB's in-process calls pay).
    partition_s : float
        Cost per input partition folded into a call (producing and concatenating it
        inside the call's task).
    overhead_s : float
        Fixed cost ``T0`` of one run (graph submission, latency to the first task,
        the final gather; once a written run refreshed it, also planning, claiming
        and recording the output).
    io_per_row_s : float
        Time ``rho`` per row beyond the encode curve (shipping rows in and
        embeddings out, building the output; once a written run refreshed it, also
        writing and committing it); overlaps with encoding on a GPU.
    tokens_per_text : float
        Mean tokens per text of the calibration texts (used when ``tokens`` is not given).
    max_tokens : int
        Token budget of one micro-batch (the fast engine); 0 when batches count rows.
    batch_rows : int
        Rows per micro-batch when ``max_tokens`` is 0 (``SentenceTransformer.encode``'s
        ``batch_size``); 0 with ``max_tokens`` 0 means one forward pass per call.
    token_lengths : tuple of float
        Quantiles of the tokens-per-text distribution, for replaying the batching
        rule (padding, forward passes); empty means no padding.
    bytes_per_row : float
        Resident input bytes per row while its call encodes (text, Python copy, token ids).
    embedding_bytes_per_row : float
        Output bytes per row (``4 d`` for float32 embeddings of size ``d``).
    model_bytes : float
        Resident bytes of one model copy.
    threads_per_worker : int
        Dask threads per worker (cluster shape, for the cache key).
    device : str
        ``"cpu"`` or ``"cuda"``.
    meta : tuple
        ``(key, value)`` pairs describing the calibration (model, date, probe fit).

    Examples
    --------
    >>> p = CostParams(alpha_s=0.005, per_text_s=1e-4, per_token_s=0.0, b0=16, workers=2)
    >>> CostParams.from_dict(p.to_dict()) == p
    True
    >>> round(p.beta_s, 6)
    0.0001
    """

    alpha_s: float
    per_text_s: float
    per_token_s: float
    b0: float
    workers: int
    setup_s: float = 0.0
    partition_s: float = 0.0
    overhead_s: float = 0.0
    io_per_row_s: float = 0.0
    tokens_per_text: float = 32.0
    max_tokens: int = 0
    batch_rows: int = 0
    token_lengths: tuple = ()
    bytes_per_row: float = 2_000.0
    embedding_bytes_per_row: float = 1_536.0
    model_bytes: float = 0.0
    threads_per_worker: int = 1
    device: str = "cpu"
    alpha_idle_s: float = 0.0
    busy_call_s: float = 0.0
    superbatch_s: float | None = None
    meta: tuple = ()

    def __post_init__(self) -> None:
        meta = self.meta.items() if isinstance(self.meta, dict) else self.meta
        object.__setattr__(self, "meta", tuple(sorted((str(k), _freeze(v)) for k, v in meta)))
        object.__setattr__(self, "token_lengths", tuple(float(x) for x in self.token_lengths))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("device", "meta", "token_lengths") or (f.name == "superbatch_s" and value is None):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise SurgeValueError(
                    f"CostParams.{f.name}={value!r} is not a number; every cost constant is a "
                    "non-negative float (seconds, rows or bytes). Fix: recalibrate, or pass a float."
                )
            if not math.isfinite(value) or value < 0:
                raise SurgeValueError(
                    f"CostParams.{f.name}={value!r} must be finite and >= 0: costs and sizes cannot "
                    "be negative. Fix: recalibrate (dask_surge.execution.calibrate.calibrate) or correct the value."
                )
        for name in ("workers", "threads_per_worker", "max_tokens", "batch_rows"):
            value = getattr(self, name)
            if int(value) != value or value < (name in ("workers", "threads_per_worker")):
                raise SurgeValueError(
                    f"CostParams.{name}={value!r} must be a positive integer (a cluster has at least "
                    "one worker with one thread). Fix: pass e.g. workers=len(client.scheduler_info()['workers'])."
                )
        if self.setup_s > self.alpha_s or (self.busy_call_s > 0 and self.setup_s > self.alpha_idle_s):
            raise SurgeValueError(
                f"CostParams.setup_s={self.setup_s!r} exceeds alpha_s={self.alpha_s!r} or (with "
                f"busy_call_s > 0) alpha_idle_s={self.alpha_idle_s!r}: the encode set-up is part of the "
                "per-call fixed cost. Fix: set alpha_s and alpha_idle_s >= setup_s."
            )

    @property
    def confidence(self) -> str | None:
        """How sure the calibration is: ``"high"``, ``"medium"`` or ``"low"`` (``meta["confidence"]``;
        ``"low"``: the probe could not separate the encode cost from timing noise), None when not recorded.

        Examples
        --------
        >>> CostParams(0.01, 1e-4, 0.0, 8, 2, meta={"confidence": "low"}).confidence
        'low'
        """
        value = dict(self.meta).get("confidence")
        return None if value is None else str(value)

    @property
    def beta_s(self) -> float:
        """Asymptotic encode cost per row at ``tokens_per_text`` tokens a text."""
        return self.per_text_s + self.per_token_s * self.tokens_per_text

    def to_dict(self) -> dict:
        """A JSON-serializable dict (``from_dict`` inverts it)."""
        d = asdict(self)
        d["meta"] = {str(k): v for k, v in self.meta}
        return d

    @classmethod
    def from_dict(cls, data: dict) -> CostParams:
        """Rebuild from :meth:`to_dict` output (unknown keys are refused)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SurgeValueError(
                f"CostParams.from_dict got unknown key(s) {unknown}; known keys are {sorted(known)}. "
                "Fix: the cache was written by another dask-surge version, recalibrate."
            )
        data = dict(data)
        meta = data.get("meta") or {}
        data["meta"] = tuple(sorted((str(k), _freeze(v)) for k, v in dict(meta).items()))
        data["token_lengths"] = tuple(float(x) for x in data.get("token_lengths") or ())
        return cls(**data)

    def with_token_lengths(self, lengths) -> CostParams:
        """These constants re-based on another token-length distribution (e.g. a sample of the user's texts).

        The per-text and per-token costs are properties of the model and the
        hardware; the tokens a text, and with them the padding and the forward
        passes of a call, are properties of the data.

        Examples
        --------
        >>> p = CostParams(0.01, 1e-4, 1e-5, 8, 2, tokens_per_text=27.0)
        >>> q = p.with_token_lengths([100, 120, 140])
        >>> q.tokens_per_text, len(q.token_lengths), round(q.beta_s / p.beta_s, 2)
        (120.0, 256, 3.51)
        """
        lengths = np.asarray(lengths, dtype=float)
        if lengths.ndim != 1 or lengths.size == 0 or not np.all(np.isfinite(lengths)) or np.any(lengths < 0):
            raise SurgeValueError(
                f"token lengths {lengths!r} must be a non-empty flat sequence of non-negative counts, "
                "one per text. Fix: pass the token count of each sampled text."
            )
        return self.replace(tokens_per_text=float(lengths.mean()), token_lengths=token_quantiles(lengths))

    def replace(self, **changes) -> CostParams:
        """A copy with some fields changed.

        Examples
        --------
        >>> CostParams(0.01, 1e-4, 0.0, 8, 2).replace(workers=4).workers
        4
        """
        d = asdict(self)
        d.update(changes)
        return CostParams(**d)


def token_quantiles(lengths) -> tuple:
    """256 quantiles of a token-length sample: what :class:`CostParams` keeps of a distribution.

    Examples
    --------
    >>> len(token_quantiles([3, 5, 9]))
    256
    """
    q = np.quantile(np.asarray(lengths, dtype=float), (np.arange(256) + 0.5) / 256)
    return tuple(round(float(x), 3) for x in q)


def _freeze(v):
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
    return v


_CHUNK = BLOCK_TEXTS  # the fast engine tokenizes and sorts at most this many texts at a time
_GRID = np.unique(
    np.concatenate([np.arange(1, 129), np.round(np.geomspace(128, _CHUNK, 40))]).astype(np.int64)
)


@functools.lru_cache(maxsize=64)
def _shape_table(lengths: tuple, max_tokens: int, batch_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Padding ratio and forward passes of a call of ``_GRID[i]`` rows (expected values)."""
    sample = np.asarray(lengths, dtype=float)
    rng = np.random.default_rng(0)
    ratio, forwards = np.empty(len(_GRID)), np.empty(len(_GRID))
    for i, b in enumerate(_GRID.tolist()):
        reps = int(np.clip(8192 // b, 4, 48))
        pad = tok = fwd = 0.0
        for _ in range(reps):
            x = -np.sort(-rng.choice(sample, size=b))
            p, f = replay(x, max_tokens, batch_rows)
            pad, tok, fwd = pad + p, tok + x.sum(), fwd + f
        ratio[i], forwards[i] = pad / max(tok, 1e-9), fwd / reps
    return ratio, forwards


def batch_shape(rows, params: CostParams) -> tuple[np.ndarray, np.ndarray]:
    """Expected padding ratio (padded / real tokens) and forward passes of calls of ``rows`` rows.

    Replays the encoder's batching rule (sort by length, cut micro-batches by
    ``params.max_tokens`` or ``params.batch_rows``) on ``params.token_lengths``.

    Examples
    --------
    >>> p = CostParams(0.0, 1e-4, 1e-6, 4, 1, max_tokens=64, token_lengths=(8.0,) * 10)
    >>> ratio, forwards = batch_shape([1, 8, 64], p)
    >>> ratio.tolist(), forwards.tolist()
    ([1.0, 1.0, 1.0], [1.0, 1.0, 8.0])
    """
    b = np.maximum(np.asarray(rows, dtype=float), 1.0)
    if params.token_lengths:
        ratio_t, fwd_t = _shape_table(
            tuple(params.token_lengths), int(params.max_tokens), int(params.batch_rows)
        )
        lb, lg = np.log(np.minimum(b, _CHUNK)), np.log(_GRID.astype(float))
        ratio = np.interp(lb, lg, ratio_t)
        forwards = np.interp(np.minimum(b, _CHUNK), _GRID.astype(float), fwd_t) * np.maximum(b / _CHUNK, 1.0)
        return ratio, forwards
    if params.batch_rows:
        return np.ones_like(b), np.ceil(b / params.batch_rows)
    if params.max_tokens:
        return np.ones_like(b), np.ceil(b * max(params.tokens_per_text, 1.0) / params.max_tokens)
    return np.ones_like(b), np.ones_like(b)


def call_cost(rows, params: CostParams, tokens=None) -> np.ndarray:
    """Encode cost ``c(b, t)`` of calls of ``rows`` rows (without the fixed ``alpha``).

    Parameters
    ----------
    rows : array-like of int
        Rows per call.
    params : CostParams
    tokens : array-like of float, optional
        Real (unpadded) tokens per call; default ``rows * params.tokens_per_text``.

    Returns
    -------
    numpy.ndarray of float
        Seconds per call.

    Examples
    --------
    >>> p = CostParams(alpha_s=0.0, per_text_s=1.0, per_token_s=0.0, b0=10, workers=1, batch_rows=100)
    >>> call_cost([1, 10, 10_000], p).round(2).tolist()   # one forward costs as much as 10 rows
    [11.0, 20.0, 11000.0]
    """
    b = np.asarray(rows, dtype=float)
    t = b * params.tokens_per_text if tokens is None else np.asarray(tokens, dtype=float)
    ratio, forwards = batch_shape(b, params)
    cost = params.per_text_s * b + params.per_token_s * t * ratio + params.beta_s * params.b0 * forwards
    return np.where(b > 0, cost, 0.0)


def call_overhead(encode_s, params: CostParams) -> np.ndarray:
    """Per-call fixed cost of calls whose encode takes ``encode_s`` seconds.

    ``alpha_s`` for a call that keeps its worker busy (``c >= busy_call_s``);
    below, the share of the overhead that competes with encoding (the
    scheduler's and client's CPU per task) grows with ``c``, from
    ``alpha_idle_s`` for a call that encodes nothing.

    Examples
    --------
    >>> p = CostParams(alpha_s=0.02, alpha_idle_s=0.016, busy_call_s=0.01, per_text_s=1e-3,
    ...                per_token_s=0.0, b0=0, workers=2)
    >>> call_overhead([0.0, 0.005, 0.01, 1.0], p).round(4).tolist()
    [0.016, 0.018, 0.02, 0.02]
    >>> call_overhead([0.0, 1.0], p.replace(busy_call_s=0.0)).tolist()
    [0.02, 0.02]
    """
    c = np.asarray(encode_s, dtype=float)
    if params.busy_call_s <= 0:
        return np.full_like(c, params.alpha_s)
    busy = np.clip(c / params.busy_call_s, 0.0, 1.0)
    return params.alpha_idle_s + (params.alpha_s - params.alpha_idle_s) * busy


def _check_sizes(sizes) -> np.ndarray:
    arr = np.asarray(list(sizes) if not hasattr(sizes, "__len__") else sizes)
    if arr.ndim != 1:
        raise SurgeValueError(
            f"sizes has shape {arr.shape}; it must be a flat sequence of row counts, one per partition. "
            "Fix: pass e.g. ddf.surge.plan('text').sizes.sizes."
        )
    if arr.size == 0:
        raise SurgeValueError(
            "sizes is empty: there is nothing to encode. Fix: pass one row count per partition."
        )
    if not np.issubdtype(arr.dtype, np.number) or np.any(arr < 0) or np.any(arr != np.floor(arr)):
        bad = next((x for x in arr.tolist() if not isinstance(x, (int, float)) or x < 0 or x != int(x)), None)
        raise SurgeValueError(
            f"sizes holds {bad!r}: partition sizes must be non-negative integers (row counts). "
            "Fix: pass the row count of each partition."
        )
    if arr.sum() == 0:
        raise SurgeValueError(
            "sizes are all zero: there is nothing to encode. Fix: pass non-empty partitions."
        )
    return arr.astype(np.int64)


def _in_order(jobs: np.ndarray, workers: int) -> tuple[float, float, np.ndarray]:
    """Greedy in-order list scheduling: (makespan, first finish, finish times)."""
    finish = np.empty(len(jobs))
    if workers == 1 or len(jobs) <= 1:
        finish[:] = np.cumsum(jobs)
    else:
        free = [0.0] * workers
        heapq.heapify(free)
        for i, s in enumerate(jobs.tolist()):
            end = free[0] + s
            heapq.heapreplace(free, end)
            finish[i] = end
    return (float(finish.max()) if len(finish) else 0.0), (float(finish[0]) if len(finish) else 0.0), finish


def _lpt(jobs: np.ndarray, workers: int) -> tuple[float, float]:
    """Longest-processing-time-first onto the least-loaded worker: (makespan, first finish)."""
    loads = [(0.0, w) for w in range(workers)]
    firsts = [math.inf] * workers
    for s in sorted(jobs.tolist(), reverse=True):
        load, w = heapq.heappop(loads)
        if firsts[w] == math.inf:
            firsts[w] = load + s
        heapq.heappush(loads, (load + s, w))
    return max(load for load, _ in loads), min(firsts)


def _tokens_per_call(sizes: np.ndarray, tokens: np.ndarray | None, spans) -> np.ndarray | None:
    if tokens is None:
        return None
    per_row = np.divide(tokens, sizes, out=np.zeros(len(sizes)), where=sizes > 0)
    return np.array([sum(per_row[p] * r for p, r in call) for call in spans], dtype=float)


def predict(
    sizes: Sequence[int],
    params: CostParams,
    *,
    b_min: int,
    b_max: int,
    k: int | None = None,
    fb_batch: int | None = None,
    tokens: Sequence[float] | None = None,
    nbytes: Sequence[int] | None = None,
    max_bytes: int | None = None,
    superbatches: Sequence | None = None,
) -> pd.DataFrame:
    """Predict time, throughput, memory and TTFO of SURGE and its baselines.

    Parameters
    ----------
    sizes : sequence of int
        Rows per partition, in partition order.
    params : CostParams
        Calibrated constants (:func:`dask_surge.execution.calibrate.calibrate`).
    b_min, b_max : int
        SURGE's flush threshold and hard cap.
    k : int, optional
        Partitions per call of PB-PBP-LB; default: enough for a mean group of ``b_min`` rows.
    fb_batch : int, optional
        FB's fixed batch size ``B``; default ``b_min``.
    tokens : sequence of float, optional
        Tokens per partition; default ``sizes * params.tokens_per_text``.
    nbytes, max_bytes : optional
        Text bytes per partition and SURGE's byte cap, so the SURGE plan predicted is
        the one :func:`dask_surge.planning.policy.plan_superbatches` makes with them.
    superbatches : sequence of SuperBatch, optional
        The SURGE plan to predict, when it is not that one (a streamed input forms its
        SuperBatches unit by unit, see :mod:`dask_surge.execution.runner`).

    Returns
    -------
    pandas.DataFrame
        Index ``surge, pbp, fb, pb-pbp-lb``; columns ``texts_per_s``, ``seconds``,
        ``calls``, ``peak_memory_bytes``, ``ttfo_s``, ``encode_s`` (worker makespan),
        ``io_s`` and ``largest_call``.

    Examples
    --------
    >>> p = CostParams(alpha_s=0.01, per_text_s=1e-4, per_token_s=0.0, b0=16, workers=2)
    >>> df = predict([3, 1, 500, 2, 8] * 200, p, b_min=256, b_max=1024)
    >>> int(df.loc["surge", "calls"]), int(df.loc["pbp", "calls"])
    (201, 1000)
    >>> bool(df.loc["surge", "seconds"] < df.loc["pbp", "seconds"])
    True
    """
    n = _check_sizes(sizes)
    b_min, b_max = validate_thresholds(b_min, b_max)
    tok = None
    if tokens is not None:
        tok = np.asarray(tokens, dtype=float)
        if tok.shape != n.shape or np.any(tok < 0):
            raise SurgeValueError(
                f"tokens has shape {tok.shape} (min {tok.min() if tok.size else 'n/a'}), but it must hold "
                f"one non-negative token count per partition ({n.shape[0]}). Fix: pass tokens per "
                "partition, or None to use params.tokens_per_text."
            )
    N, P, W = int(n.sum()), len(n), int(params.workers)
    if k is None:
        k = max(1, round(float(b_min / max(n.mean(), 1.0))))
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise SurgeValueError(
            f"k={k!r} must be a positive int (partitions per PB-PBP-LB call). Fix: pass e.g. k=8."
        )
    k = int(k)
    B = b_min if fb_batch is None else fb_batch
    if isinstance(B, bool) or int(B) != B or B < 1:
        raise SurgeValueError(
            f"fb_batch={fb_batch!r} must be a positive int (FB batch size in rows). Fix: pass e.g. 512."
        )
    B = int(B)
    row_bytes = params.bytes_per_row + params.embedding_bytes_per_row
    io_total = N * params.io_per_row_s / W
    rows: dict[str, dict] = {}

    # SURGE: one call per SuperBatch, in plan order
    sbs = (
        list(superbatches)
        if superbatches is not None
        else plan_superbatches(n.tolist(), b_min, b_max, nbytes=nbytes, max_bytes=max_bytes)
    )
    b = np.array([sb.rows for sb in sbs], dtype=float)
    folded = np.array([len(sb.spans) for sb in sbs], dtype=float)
    t = _tokens_per_call(n, tok, [[(s.partition, s.rows) for s in sb.spans] for sb in sbs])
    rows["surge"] = _streamed(params, b, t, folded, io_total, row_bytes, N, in_order=True, superbatches=True)

    # PBP: one call (and one task) per partition
    t = tok if tok is not None else None
    rows["pbp"] = _streamed(params, n.astype(float), t, np.zeros(P), io_total, row_bytes, N, in_order=True)

    # PB-PBP-LB: groups of k consecutive partitions, LPT-balanced over workers
    starts = np.arange(0, P, k)
    gb = np.add.reduceat(n, starts).astype(float)
    gt = np.add.reduceat(tok, starts) if tok is not None else None
    gp = np.minimum(k, P - starts).astype(float)
    rows["pb-pbp-lb"] = _streamed(params, gb, gt, gp, io_total, row_bytes, N, in_order=False)

    # FB: gather all N rows into one process, encode in fixed batches of B on one model worker
    nb = math.ceil(N / B)
    fb_rows = np.full(nb, float(B))
    fb_rows[-1] = N - B * (nb - 1)
    fb_tok = None if tok is None else fb_rows * (tok.sum() / N)
    gather = P * params.partition_s / W + N * params.io_per_row_s
    encode = float(np.sum(params.setup_s + call_cost(fb_rows, params, fb_tok)))
    seconds = params.overhead_s + gather + encode
    rows["fb"] = {
        "seconds": seconds,
        "calls": nb,
        "peak_memory_bytes": params.model_bytes + N * row_bytes,
        "ttfo_s": seconds,
        "encode_s": encode,
        "io_s": gather,
        "largest_call": int(fb_rows.max()),
    }
    df = pd.DataFrame.from_dict(rows, orient="index").loc[list(POLICIES)]
    df.insert(0, "texts_per_s", N / df["seconds"])
    df["calls"] = df["calls"].astype(np.int64)
    df["largest_call"] = df["largest_call"].astype(np.int64)
    df.index.name = "policy"
    return df


def calls_seconds(rows, params: CostParams, *, tokens=None, folded=None) -> float:
    """Predicted seconds of a run made of these encode calls, in this order (SURGE's schedule).

    What :func:`predict` gives for the ``"surge"`` row, for calls already formed: a run's own
    SuperBatches, so a run's measured time can be compared with what the model says it costs
    (:func:`dask_surge.execution.calibrate.refresh_run_terms`).

    Parameters
    ----------
    rows : array-like of int
        Rows of each call, in the order the calls started.
    params : CostParams
    tokens : array-like of float, optional
        Real tokens of each call; default ``rows * params.tokens_per_text``.
    folded : array-like of int, optional
        Input partitions folded into each call; default none (no per-partition cost).

    Returns
    -------
    float

    Examples
    --------
    >>> p = CostParams(alpha_s=0.5, per_text_s=0.01, per_token_s=0.0, b0=0, workers=2, overhead_s=1.0)
    >>> calls_seconds([100, 100, 100, 100], p)   # 1 + two calls of 0.5 + 1 on each worker
    4.0
    """
    b = np.asarray(rows, dtype=float).reshape(-1)
    t = None if tokens is None else np.asarray(tokens, dtype=float).reshape(-1)
    p = np.zeros_like(b) if folded is None else np.asarray(folded, dtype=float).reshape(-1)
    if (t is not None and t.shape != b.shape) or p.shape != b.shape or np.any(b < 0):
        raise SurgeValueError(
            f"calls_seconds got {b.shape[0]} calls but tokens {None if t is None else t.shape} and folded "
            f"{p.shape}, or a negative row count: each call needs one non-negative row count, token "
            "count and partition count. Fix: pass arrays of equal length."
        )
    N = float(b.sum())
    io_total = N * params.io_per_row_s / int(params.workers)
    row_bytes = params.bytes_per_row + params.embedding_bytes_per_row
    return float(
        _streamed(params, b, t, p, io_total, row_bytes, N, in_order=True, superbatches=True)["seconds"]
    )


def _io_overlaps(params: CostParams) -> bool:
    """I/O overlaps encoding when an accelerator encodes; on a CPU both share the worker's cores."""
    return not params.device.startswith("cpu")


def _streamed(
    params: CostParams, b, t, folded, io_total, row_bytes, N, *, in_order: bool, superbatches: bool = False
) -> dict:
    enc = call_cost(b, params, t)
    fixed = (
        np.full_like(enc, params.superbatch_s)
        if superbatches and params.superbatch_s is not None
        else call_overhead(enc, params)
    )
    jobs = fixed + params.partition_s * folded + enc
    if _io_overlaps(params):
        fill = float(b[0]) * params.io_per_row_s if len(b) else 0.0
    else:
        jobs = jobs + params.io_per_row_s * b
        fill, io_total = 0.0, 0.0
    W = int(params.workers)
    if in_order:
        makespan, first, _ = _in_order(jobs, W)
    else:
        makespan, first = _lpt(jobs, W)
    seconds = params.overhead_s + fill + max(makespan, io_total)
    largest = int(b.max()) if len(b) else 0
    return {
        "seconds": seconds,
        "calls": len(b),
        "peak_memory_bytes": params.model_bytes + largest * row_bytes,
        "ttfo_s": params.overhead_s + fill + first,
        "encode_s": makespan,
        "io_s": io_total,
        "largest_call": largest,
    }


def phi_cv(sizes: Sequence[int], params: CostParams) -> tuple[float, float]:
    """Return ``(phi, CV)`` of a partition-size vector.

    ``phi = alpha / (alpha + beta * mean(n))`` is the share of a mean
    partition's call spent in fixed per-call cost (``beta`` the asymptotic
    per-row encode cost); ``CV = std(n) / mean(n)``.

    Examples
    --------
    >>> p = CostParams(alpha_s=0.01, per_text_s=1e-3, per_token_s=0.0, b0=0, workers=1)
    >>> phi, cv = phi_cv([10, 10, 10], p)
    >>> round(phi, 3), cv
    (0.5, 0.0)
    """
    n = _check_sizes(sizes).astype(float)
    mean = n.mean()
    phi = params.alpha_s / (params.alpha_s + params.beta_s * mean) if params.alpha_s > 0 else 0.0
    return float(phi), float(n.std() / mean)


@dataclass
class Advice:
    """Whether fusing partitions pays for a size vector, and why.

    Attributes
    ----------
    phi, cv : float
        See :func:`phi_cv`.
    predicted_speedup : float
        Predicted SURGE throughput over PBP's (``> 1`` means SURGE is faster).
    pays : bool
        True when the predicted gain is at least 5%.
    text : str
        One or two sentences naming the knob that matters.
    """

    phi: float
    cv: float
    predicted_speedup: float
    pays: bool
    text: str

    def __str__(self) -> str:
        return self.text


def advise(
    sizes: Sequence[int],
    params: CostParams,
    *,
    b_min: int,
    b_max: int,
    nbytes: Sequence[int] | None = None,
    max_bytes: int | None = None,
    superbatches: Sequence | None = None,
) -> Advice:
    """Say whether SuperBatching pays over one call per partition, and why.

    Examples
    --------
    >>> light = CostParams(alpha_s=0.01, per_text_s=1e-5, per_token_s=0.0, b0=16, workers=2)
    >>> advise([5] * 1000, light, b_min=512, b_max=2048).pays
    True
    >>> advise([50_000] * 8, light, b_min=512, b_max=65_536).pays
    False
    """
    n = _check_sizes(sizes)
    phi, cv = phi_cv(n.tolist(), params)
    df = predict(
        n.tolist(),
        params,
        b_min=b_min,
        b_max=b_max,
        nbytes=nbytes,
        max_bytes=max_bytes,
        superbatches=superbatches,
    )
    speedup = float(df.loc["pbp", "seconds"] / df.loc["surge", "seconds"])
    pays = speedup >= 1.05
    mean, n_max = float(n.mean()), int(n.max())
    if pays:
        # the share of a one-call-per-partition run's time that fusing removes: the fixed cost of each call
        # (phi) and what small calls waste besides (partly filled micro-batches); phi alone can round to 0%
        saved = 1.0 - 1.0 / speedup
        text = (
            f"Fusing pays: with one call per partition (mean {mean:,.0f} rows), about {saved:.0%} of the "
            f"time would go to costs that SuperBatches amortize (the fixed cost of each call, phi={phi:.2f}, "
            f"and small calls' partly filled micro-batches), so SuperBatches of b_min={b_min:,} rows should "
            f"run {speedup:.1f}x faster."
        )
    elif phi < 0.05:
        text = (
            f"Partitions are already large (mean {mean:,.0f} rows, phi={phi:.3f}): the per-call "
            f"overhead is under 5% of each call, so expect under 5% gain "
            f"({speedup:.2f}x); fuse for bounded memory and streaming output, not speed."
        )
    else:
        text = (
            f"Little to gain ({speedup:.2f}x) although phi={phi:.2f}: folding {len(n):,} partitions "
            "costs about what it saves; raise b_min so each call amortizes more, or read partitions "
            "inside the SuperBatch task (Parquet input)."
        )
    if cv > 1.0:
        mem = min(b_max, b_min - 1 + n_max)
        text += (
            f" CV={cv:.2f}: the largest partition (n_max={n_max:,}) sets peak memory, so b_max "
            f"matters; a SuperBatch holds at most {mem:,} rows (b_min - 1 + n_max, capped at b_max)."
        )
    return Advice(phi=phi, cv=cv, predicted_speedup=speedup, pays=pays, text=text)


def auto_thresholds(
    params: CostParams,
    *,
    memory_budget_bytes: float,
    ttfo_target_s: float,
    n_max: int,
    overhead_share: float = 0.02,
    b_min: int | None = None,
    b_max: int | None = None,
) -> tuple[int, int, str]:
    """Pick ``(b_min, b_max)`` from a per-worker memory budget and a TTFO target.

    ``b_min`` is the smallest SuperBatch whose fixed costs (``alpha``, ``pi``
    and the small-batch penalty, measured against the per-row cost of a very
    large call) are at most ``overhead_share`` of its time, lowered to meet
    ``ttfo_target_s`` and the memory budget; ``b_max`` is the largest
    SuperBatch the budget holds (model + rows x (input + embedding bytes)),
    at most ``4 b_min``. By Lemma 3 no SuperBatch then exceeds the budget.

    Parameters
    ----------
    params : CostParams
    memory_budget_bytes : float
        Bytes a worker may hold (model included).
    ttfo_target_s : float
        Wanted time to the first SuperBatch.
    n_max : int
        Largest partition, in rows.
    overhead_share : float
        Acceptable share of fixed cost per SuperBatch (default 2%).
    b_min, b_max : int, optional
        A threshold already chosen (given by the user): only the other is picked.

    Returns
    -------
    (int, int, str)
        ``b_min``, ``b_max`` and a sentence naming the binding constraint.

    Raises
    ------
    SurgeValueError
        If the budget does not even hold the model and one row.

    Examples
    --------
    >>> p = CostParams(alpha_s=0.01, per_text_s=1e-4, per_token_s=0.0, b0=16, workers=2,
    ...                bytes_per_row=1_000, embedding_bytes_per_row=1_536, model_bytes=90e6)
    >>> b_min, b_max, why = auto_thresholds(p, memory_budget_bytes=2e9, ttfo_target_s=5.0, n_max=10_000)
    >>> b_min <= b_max and 90e6 + b_max * 2_536 <= 2e9
    True
    """
    for name, value in (("memory_budget_bytes", memory_budget_bytes), ("ttfo_target_s", ttfo_target_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise SurgeValueError(f"{name}={value!r} must be a positive number. Fix: pass e.g. {name}=2e9.")
    if isinstance(n_max, bool) or int(n_max) != n_max or n_max < 1:
        raise SurgeValueError(
            f"n_max={n_max!r} must be a positive int (rows in the largest partition). Fix: pass max(sizes)."
        )
    if not 0 < overhead_share < 1:
        raise SurgeValueError(f"overhead_share={overhead_share!r} must be in (0, 1). Fix: pass e.g. 0.02.")
    row_bytes = params.bytes_per_row + params.embedding_bytes_per_row
    room = memory_budget_bytes - params.model_bytes
    fit = int(room // row_bytes) if row_bytes > 0 else 10**12
    if fit < 1:
        raise SurgeValueError(
            f"memory_budget_bytes={memory_budget_bytes:,.0f} does not hold the model "
            f"({params.model_bytes:,.0f} bytes) plus one row ({row_bytes:,.0f} bytes): no SuperBatch fits. "
            "Fix: raise the budget, or use a smaller model or a worker with more memory."
        )
    if b_min is not None:
        return _auto_b_max(params, int(b_min), b_max, fit, n_max, row_bytes, f"b_min={int(b_min):,} as given")
    # smallest b whose fixed cost share (alpha, pi, small-batch penalty) <= overhead_share. The
    # reference is a very large call's cost per row, not beta: with a token budget, forward passes
    # (and their fixed cost) grow with b, so against beta the share never fell under 2% and b_eff
    # ran to the search bound (1e9 rows).
    per_row = float(call_cost([_CHUNK], params)[0]) / _CHUNK

    def share(b: float) -> float:
        c = float(call_cost([b], params)[0])
        total = float(call_overhead([c], params)[0]) + params.partition_s + c
        return (total - per_row * b) / total if total > 0 else 0.0

    b_eff = _bisect_min(lambda b: share(b) <= overhead_share, 1, 10**9)

    # largest b whose first SuperBatch finishes within the TTFO target
    def first(b: int) -> float:
        c = float(call_cost([b], params)[0])
        return params.overhead_s + float(call_overhead([c], params)[0]) + c + b * params.io_per_row_s

    b_ttfo = _bisect_max(lambda b: first(b) <= ttfo_target_s, 1, 10**9)
    b_min, reason = (
        b_eff,
        (f"b_min={b_eff:,} keeps fixed per-call cost under {overhead_share:.0%} of each SuperBatch"),
    )
    if b_ttfo < b_min:
        b_min = b_ttfo
        reason = (
            f"b_min={b_ttfo:,} so the first output comes within {ttfo_target_s:g} s (the first-output "
            f"target, surge.ttfo-target; {b_eff:,} rows would cut fixed cost to {overhead_share:.0%})"
        )
    if fit < b_min:
        b_min = fit
        reason = (
            f"b_min={fit:,} so a worker stays within the memory budget of {memory_budget_bytes:,.0f} bytes "
            f"(surge.memory-budget: the model's {params.model_bytes:,.0f} bytes + {row_bytes:,.0f} bytes a row)"
        )
    return _auto_b_max(params, b_min, b_max, fit, n_max, row_bytes, reason)


def _auto_b_max(
    params: CostParams, b_min: int, b_max: int | None, fit: int, n_max: int, row_bytes: float, reason: str
) -> tuple[int, int, str]:
    if b_max is not None:
        if b_min > b_max:
            b_min, reason = int(b_max), reason + f", lowered to the given b_max={int(b_max):,}"
        return int(b_min), int(b_max), reason + f"; b_max={int(b_max):,} as given."
    b_max = max(b_min, min(fit, 4 * b_min))
    held = min(b_max, b_min - 1 + int(n_max))
    reason += (
        f"; b_max={b_max:,} keeps a worker under the budget (at most {held:,} rows resident, "
        f"{params.model_bytes + held * row_bytes:,.0f} bytes)"
    )
    return int(b_min), int(b_max), reason + "."


def _bisect_min(ok, lo: int, hi: int) -> int:
    """Smallest integer in [lo, hi] where the monotone ``ok`` holds (hi if none)."""
    if ok(lo):
        return lo
    if not ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _bisect_max(ok, lo: int, hi: int) -> int:
    """Largest integer in [lo, hi] where the monotone-decreasing ``ok`` holds (lo if none)."""
    if not ok(lo):
        return lo
    if ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
