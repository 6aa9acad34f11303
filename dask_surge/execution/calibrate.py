"""Calibrate the cost model (:mod:`dask_surge.planning.costmodel`) with a short probe.

The probe measures, through the real code paths, the constants of Theorem 1:

1. **Encode curve** ``c(b)``: every worker at once (so calls share the machine
   as they do in a run) encodes calls of ``b = 1, 2, 4, ...`` rows of synthetic
   English-like texts up to a large call of at least two full micro-batches
   (the regime of SuperBatches, which a fit on small calls would only
   extrapolate), plus a call of long texts. Every call is repeated (3 times, more
   while the repeats disagree) and observed by its median, so that one call slowed
   by another process does not bend the curve. On a busy machine the large call is
   doubled (up to 16,384 rows, within the budget) until its time stands out of the
   noise against a one-row call (:func:`separated`); when it never does, the probe
   runs once more with twice the budget, and if that fails too, :func:`calibrate`
   still returns parameters, from the bounds of the per-row cost the noise leaves
   (:func:`_noise_curve`), with ``confidence="low"`` and one
   :class:`CalibrationWarning` that says so. For each
   call the encoder's batching rule is replayed on the real token lengths
   (padded tokens, forward passes), and
   ``setup + per_text b + per_token padded + per_forward forwards`` is fitted
   by non-negative least squares on relative error. The token-length
   distribution is kept (256 quantiles) for predicting other call sizes.
2. **Dask terms**: five kinds of runs on the live cluster, each modelled as the
   cost model models it (``T0`` plus waves of equal jobs on ``W`` workers) and
   solved by :func:`solve_dask_terms`:

   * PBP (``map_partitions``) over ``W`` and over ``n W`` one-row partitions:
     the slope per wave is ``alpha_idle + c(1) + rho``, the intercept the run
     overhead ``T0`` (submission, first-task latency, final gather);
   * PBP with an encoder that costs nothing (zeros of the model's dimension)
     over ``2 W`` partitions of one row and of 2,048 rows: the per-row I/O
     ``rho`` (shipping rows in, embeddings out, building the output), measured
     without subtracting encode times (whose own error of a few percent would
     swamp it for an expensive model);
   * PBP over partitions of a moderate size ``m``: the busy-worker ``alpha``,
     what ``c(m) + rho m`` does not explain per call;
   * ``ddf.surge.encode`` over one-row partitions in SuperBatches of 8: the
     per-folded-partition cost ``pi``.

   ``m`` is the smallest size whose encode cost ``c(m)`` is at least the
   per-call overhead of one-row partitions (measured by a warm-up run), within
   the budget. From there on a worker is busy encoding for most of each call,
   and the scheduler's and client's CPU per task competes with encoding, so
   such a call pays more overhead; one-row calls leave the cores idle between
   round trips. The cost model therefore interpolates the per-call cost
   linearly in ``c`` between the one-row and the moderate runs and keeps
   ``alpha`` above ``c(m)`` (:func:`dask_surge.planning.costmodel.call_overhead`).

   Every timed run is a graph never computed before (a repeated graph returns
   results the scheduler still holds and times nothing); the runs alternate, three
   rounds, and each kind is observed by its median.

Without a client only step 1 runs (in this process): ``alpha`` is the encode
set-up and the Dask terms are zero.

Results are cached as JSON under ``~/.cache/dask-surge/`` (or
``$DASK_SURGE_CACHE_DIR``), keyed by model identity, device, cluster shape (workers,
threads per worker) and probe version, with the machine's load when taken. Every written
run refreshes the entry of its own key from its SuperBatches' measured timings
(:func:`refresh_from_run`, :func:`refresh_params`), so the cache converges to what runs
actually cost; a run under another shape, device or model never touches it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..engine.batching import replay
from ..errors import SurgeValueError
from ..families import DENSE
from ..models.encoders import Encoder
from ..planning.costmodel import CostParams, call_cost, calls_seconds, token_quantiles
from ..planning.policy import plan_superbatches
from ..planning.tokens import token_counter
from ..synthetic import lognormal_sizes, make_partitioned_frame, make_texts
from .graph import superbatch_collection
from .superbatch import SuperBatchTask

__all__ = [
    "PROBE_VERSION",
    "CalibrationWarning",
    "Timing",
    "cache_dir",
    "cache_path",
    "MIN_REFRESH_POINTS",
    "calibrate",
    "cluster_shape",
    "fit_encode_curve",
    "refresh_from_run",
    "refresh_params",
    "separated",
    "solve_dask_terms",
]

logger = logging.getLogger(__name__)
PROBE_VERSION = 7  # bump when the probe, or the speed of what it measures (the engine), changes
_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_IO_ROWS = 2048  # rows per partition of the I/O-only runs
#: Timed repeats of every probe call; observations are their medians.
REPEATS = 3
#: The largest encode call the probe grows to while the per-row cost hides in the noise.
MAX_PROBE_ROWS = 16_384
#: :func:`separated`: the large call's gap over a one-row call, in spreads (MADs) of the two ...
SEPARATION_SIGMAS = 3.0
#: ... and as a ratio of their median times.
SEPARATION_RATIO = 1.5


def cache_dir() -> Path:
    """Directory of cached calibrations: ``$DASK_SURGE_CACHE_DIR`` or ``~/.cache/dask-surge``.

    Examples
    --------
    >>> cache_dir().name in ("dask-surge",) or "DASK_SURGE_CACHE_DIR" in os.environ
    True
    """
    env = os.environ.get("DASK_SURGE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dask-surge"


def _key(identity: dict, device: str, workers: int, threads: int) -> dict:
    return {
        "identity": identity,
        "device": device,
        "workers": int(workers),
        "threads": int(threads),
        "probe": PROBE_VERSION,
    }


def cache_path(key: dict) -> Path:
    """The JSON file that caches the calibration for ``key``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir() / f"costmodel-{digest}.json"


# -- the encode curve ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CurveFit:
    """Fitted ``c = setup + per_text b + per_token padded_tokens + per_forward forwards``."""

    setup_s: float
    per_text_s: float
    per_token_s: float
    per_forward_s: float
    rel_rms: float


def fit_encode_curve(rows, padded_tokens, forwards, seconds, weights=None) -> CurveFit:
    """Fit the encode cost of measured calls by non-negative least squares.

    The model ``seconds = setup + per_text rows + per_token padded_tokens +
    per_forward forwards`` is linear; it is solved with weights ``1 / seconds``
    (relative error) and non-negative coefficients. Pass one observation per call
    size, each the median of repeated timings (as the probe does): a single timing
    on a busy machine can be pure noise.

    Parameters
    ----------
    rows, padded_tokens, forwards, seconds : array-like
        One entry per observed call: its rows, padded tokens and forward passes
        (replayed from the encoder's batching rule) and its (median) time.
    weights : array-like, optional
        A weight per observation on its relative error (default 1 each): a run's refresh
        (:func:`refresh_params`) weighs older runs' SuperBatches less.

    Returns
    -------
    CurveFit

    Raises
    ------
    SurgeValueError
        If there are fewer than 4 observations, a row count or time is not positive,
        the arrays differ in length, or the times do not grow with the call at all (no
        positive per-row or per-token cost: noise, not a curve). :func:`calibrate`
        turns the last case into a :class:`CalibrationWarning` and its defaults.

    Examples
    --------
    >>> b = np.array([1, 2, 4, 8, 16, 64, 256, 1024, 512])
    >>> tok, fwd = 30.0 * b, np.ceil(b / 64)
    >>> tok[-1] *= 3                       # one call of long texts
    >>> t = 0.001 + 1e-5 * b + 2e-6 * tok + 4e-4 * fwd
    >>> fit = fit_encode_curve(b, tok, fwd, t)
    >>> [round(x, 7) for x in (fit.setup_s, fit.per_text_s, fit.per_token_s, fit.per_forward_s)]
    [0.001, 1e-05, 2e-06, 0.0004]
    """
    cols = [np.asarray(x, dtype=float) for x in (rows, padded_tokens, forwards)]
    y = np.asarray(seconds, dtype=float)
    if any(c.shape != y.shape for c in cols) or y.size < 4 or np.any(cols[0] <= 0) or np.any(y <= 0):
        raise SurgeValueError(
            f"fit_encode_curve needs >= 4 calls with positive rows and seconds, all arrays of one length; "
            f"got {y.size} times for rows of shape {cols[0].shape}. Fix: measure more call sizes."
        )
    w = 1.0 / y
    if weights is not None:
        wt = np.asarray(weights, dtype=float)
        if wt.shape != y.shape or not np.all(np.isfinite(wt)) or np.any(wt < 0) or not np.any(wt > 0):
            raise SurgeValueError(
                f"fit_encode_curve weights {wt.tolist()!r} must be finite, >= 0, not all 0, one per call "
                f"({y.size}). Fix: pass one non-negative weight per observation."
            )
        w = w * np.sqrt(wt)  # least squares weighs squared residuals: sqrt makes a weight count linearly
    A = np.column_stack([np.ones_like(y), *cols])
    coef = _nnls(A * w[:, None], y * w)
    if coef[1] + coef[2] <= 0:
        raise SurgeValueError(
            "fit_encode_curve found no positive per-row or per-token cost: the encode times do not "
            f"grow with the call (rows={cols[0].tolist()}, seconds={y.round(6).tolist()}), so these "
            "times are noise, not a cost curve. Fix: time each call size several times and pass the "
            "medians, include calls large enough to take clearly longer than a one-row call, or measure "
            "on a quieter machine (calibrate() does the first two and falls back to defaults otherwise)."
        )
    rel = (A @ coef - y) / y
    rms = float(np.sqrt(np.average(rel**2, weights=None if weights is None else np.asarray(weights, float))))
    setup, per_text, per_token, per_forward = (float(c) for c in coef)
    return CurveFit(setup, per_text, per_token, per_forward, rms)


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Small non-negative least squares: best unconstrained fit over every column subset."""
    n = A.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y**2))
    for mask in range(1, 2**n):
        idx = [i for i in range(n) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(A[:, idx], y, rcond=None)
        if np.any(sol < 0):
            continue
        coef = np.zeros(n)
        coef[idx] = sol
        err = float(np.sum((A @ coef - y) ** 2))
        if err < best_err:
            best, best_err = coef, err
    return best


def _engine_of(encoder):
    """The fast engine behind a loaded encoder, or None (sentence-transformers / callable)."""
    return encoder.engine


def _batching(encoder) -> tuple[int, int]:
    """(max_tokens, batch_rows) of the encoder's micro-batching rule."""
    engine = _engine_of(encoder)
    if engine is not None:
        return int(engine.max_tokens), 0
    if encoder.backend == "sentence-transformers":
        return 0, int(encoder.spec.batch_size)
    return 0, 0


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one call: their median and spread (median absolute deviation)."""

    median_s: float
    spread_s: float
    repeats: int


def _repeat(clock, call, reps: int, *, more: int = 0, left=lambda: np.inf) -> Timing:
    """Time ``call()`` ``reps`` times; while the timings disagree (spread over 10% of the
    median), up to ``more`` extra repeats while ``left()`` leaves room for a few more calls."""
    secs: list[float] = []
    for _ in range(max(int(reps), 1)):
        t0 = clock()
        call()
        secs.append(clock() - t0)
    extra = 0
    while extra < more and _mad(secs) > 0.1 * float(np.median(secs)) and left() > 4 * float(np.median(secs)):
        t0 = clock()
        call()
        secs.append(clock() - t0)
        extra += 1
    return Timing(float(np.median(secs)), _mad(secs), len(secs))


def _mad(secs) -> float:
    x = np.asarray(secs, dtype=float)
    return float(np.median(np.abs(x - np.median(x))))


def separated(
    one: Timing, large: Timing, *, sigmas: float = SEPARATION_SIGMAS, min_ratio: float = SEPARATION_RATIO
) -> bool:
    """Whether the large call's extra time over a one-row call is per-row cost, not noise.

    The rule: the gap between the medians exceeds ``sigmas`` times the sum of the two
    spreads (median absolute deviations of the repeats), and the large call costs at
    least ``min_ratio`` times the one-row call.

    Parameters
    ----------
    one, large : Timing
        Repeated timings of a one-row call and of the probe's largest call.
    sigmas, min_ratio : float
        The rule's constants.

    Returns
    -------
    bool

    Examples
    --------
    >>> separated(Timing(0.010, 0.001, 3), Timing(0.200, 0.010, 3))
    True
    >>> separated(Timing(0.34, 0.05, 3), Timing(0.40, 0.30, 3))   # a busy machine: all noise
    False
    """
    gap = large.median_s - one.median_s
    return gap > sigmas * (one.spread_s + large.spread_s) and large.median_s >= min_ratio * one.median_s


def _probe_curve(
    encoder, budget_s: float, seed: int = 7, *, clock=time.perf_counter, repeats: int = REPEATS
) -> dict:
    """Time encode calls of growing size (runs where the model lives: a worker or here).

    Every call is repeated (``repeats`` times, a few more while the repeats disagree)
    and observed by its median time. The largest call starts at two full micro-batches
    (or what the budget affords) and doubles, up to :data:`MAX_PROBE_ROWS` rows and
    within the budget, until its time stands out of the noise against a one-row call
    (:func:`separated`); ``separable`` in the result says whether it did.

    ``clock`` (seconds, monotonic) is injectable so that tests can drive the probe with a
    fake clock and a fake encoder (:class:`dask_surge.testing.FakeClock`).
    """

    t_start = clock()
    deadline = t_start + budget_s * 0.9

    def left() -> float:
        return deadline - clock()

    count = token_counter(encoder)
    max_tokens, batch_rows = _batching(encoder)
    call = _encode_call(encoder)
    texts = {"short": make_texts(4096, seed=seed), "long": make_texts(1024, seed=seed + 1, mean_words=60.0)}
    lengths = {k: count(v) for k, v in texts.items()}
    t0 = clock()
    call(texts["short"][:64])  # warm the model, allocator and tokenizer
    warm_s = max(clock() - t0, 1e-6)  # an upper bound of a 64-row call

    def reps_for(est_s: float, share: float) -> int:  # cheap calls: more repeats (a sturdier median)
        return int(np.clip(share * budget_s / max(est_s, 1e-6), repeats, 15))

    def grow(n: int) -> None:  # more short texts for a larger call (same seed: a longer list)
        if n > len(texts["short"]):
            texts["short"] = make_texts(n, seed=seed)
            lengths["short"] = count(texts["short"])

    def measure(kind: str, b: int, reps: int, start: int = 0) -> tuple[tuple, Timing]:
        """((rows, padded tokens, forwards, median seconds), Timing) of ``reps``+ calls."""
        batch = texts[kind][start : start + b]
        x = -np.sort(-lengths[kind][start : start + b])
        padded, forwards = replay(x, max_tokens, batch_rows)
        t = _repeat(clock, lambda: call(batch), reps, more=2 * reps, left=left)
        return (len(batch), float(padded), float(forwards), t.median_s), t

    obs: list[tuple[int, float, float, float]] = []
    o, t64 = measure("short", 64, reps_for(warm_s, 0.05))
    obs.append(o)
    one_obs, one = measure("short", 1, reps_for(t64.median_s, 0.05))
    obs.append(one_obs)
    per_row = max(t64.median_s / 64, 1e-9)  # an upper bound (set-up included)
    # The largest call: the largest the budget affords, and never less than two full micro-batches,
    # so that the fit sees the regime of large calls (sorted, homogeneous, full forward passes)
    # instead of extrapolating it from one-forward calls.
    full = 2 * max_tokens / max(float(lengths["short"].mean()), 1.0) if max_tokens else 2 * (batch_rows or 32)
    affordable = [b for b in _LADDER if b * per_row * repeats <= budget_s / 4]
    top = int(min(len(texts["short"]), max(int(np.ceil(full)), max(affordable, default=1))))
    top_obs, large = measure("short", top, reps_for(per_row * top, 0.1))
    # grow the largest call until its per-row cost stands out of the noise, within the budget
    while not separated(one, large) and 2 * top <= MAX_PROBE_ROWS and repeats * large.median_s * 2 < left():
        top *= 2
        grow(top)
        top_obs, large = measure("short", top, reps_for(large.median_s * 2, 0.1))
    obs.append(top_obs)
    result = {
        "token_lengths": list(token_quantiles(lengths["short"])),
        "tokens_per_text": float(lengths["short"].mean()),
        "max_tokens": max_tokens,
        "batch_rows": batch_rows,
        "mean_text_bytes": float(np.mean([len(t.encode()) for t in texts["short"]])),
        "engine": encoder.backend,  # what encoded: a run refreshes this calibration only from the same
        "separable": bool(separated(one, large)),
        "noise": {
            "one_row": [round(one.median_s, 6), round(one.spread_s, 6)],
            "largest": [top, round(large.median_s, 6), round(large.spread_s, 6)],
        },
    }
    if not result["separable"]:  # no curve to fit: stop here (the caller falls back to defaults)
        return dict(result, observations=obs)
    per_row = max(large.median_s / top, 1e-9)
    # long texts, to split the per-text from the per-token cost
    b_long = int(min(len(texts["long"]), max(8, top // 6)))
    obs.append(measure("long", b_long, repeats)[0])
    # the small-call end of the curve, then the large call over other texts, while the budget lasts
    smaller = [b for b in _LADDER if 1 < b < top and b != 64]
    per_b = max(left(), 0.0) / (len(smaller) + 2)
    for b in smaller:
        est = per_row * b + 1e-3
        if len(obs) >= 6 and repeats * est > left():
            break
        obs.append(measure("short", b, int(np.clip(per_b / est, repeats, 25)))[0])
    if top < len(texts["short"]) and per_row * top * repeats * 1.5 < left():
        obs.append(measure("short", top, repeats, start=len(texts["short"]) - top)[0])
    return dict(result, observations=obs)


# -- the Dask-path probe -------------------------------------------------------------------------
def _waves(calls: int, workers: int) -> int:
    """Rounds of ``calls`` equal jobs on ``workers`` workers (the model's in-order schedule)."""
    return -(-int(calls) // int(workers))


def solve_dask_terms(
    cost,
    *,
    workers: int,
    small: tuple,
    large: tuple,
    moderate: tuple,
    surge: tuple,
    big: tuple | None = None,
    io: tuple | None = None,
    setup_s: float = 0.0,
) -> dict:
    """Solve Theorem 1's Dask terms from five probe runs' wall times.

    Each run is modelled as the cost model models it (``T0`` plus waves of
    equal jobs on ``workers`` workers), with the per-call cost ``alpha(c)`` of
    :func:`dask_surge.planning.costmodel.call_overhead` (``busy_call_s = c(m)``):

    * ``small = (P_s, t_s)`` and ``large = (P_l, t_l)``: PBP over ``P`` one-row
      partitions, ``t = T0 + waves(P) (alpha(c(1)) + c(1) + rho)``;
    * ``moderate = (P_m, m, t_m)`` and ``big = (P_b, M, t_b)``, ``M > m``: PBP over
      ``P`` partitions of ``m`` (``M``) rows, ``t = T0 + waves(P) (alpha + c(m) + rho m)``;
    * ``surge = (P_u, m_u, t_u)``: SURGE over ``P_u`` one-row partitions in
      SuperBatches of ``m_u`` of them, ``t = T0 + waves(P_u / m_u) (alpha(c(m_u)) + pi m_u + c(m_u) + rho m_u)``;
    * instead of ``big``, ``io = (P_io, M, t_1, t_M)``: PBP with an encoder that costs
      nothing (zeros of the model's dimension) over ``P_io`` partitions of 1 and of ``M``
      rows, so ``rho = (t_M - t_1) / (waves(P_io) (M - 1))`` without differencing
      encode times (for a model whose encode dominates, the curve's own error of a few
      percent swamped ``rho`` in ``big - moderate``: MiniLM on a CPU got 0 to 577 us/row).

    The one-row runs give their per-wave cost (slope) and ``T0`` (intercept);
    the moderate and big runs fix the line ``alpha + rho b`` of what the encode
    curve ``c`` does not explain per call (``rho`` its slope, per row);
    ``alpha_idle`` is then what makes ``alpha(c(1))`` reproduce the one-row
    runs (with ``m = 1``, one-row calls already keep the workers busy: ``busy_call_s``
    is 0 and every call pays ``alpha``); the SuperBatch run gives ``pi``. Negative solutions (noise) are
    clipped to 0; ``alpha`` and ``alpha_idle`` are at least ``setup_s``.

    Parameters
    ----------
    cost : callable
        ``cost(b)``: the encode cost of a call of ``b`` rows (set-up excluded).
    workers : int
    small, large, moderate, surge, big, io : tuple
        The runs, as above (seconds are wall times); ``io`` or ``big`` is needed.
    setup_s : float
        The encode set-up, a lower bound of ``alpha`` and ``alpha_idle``.

    Returns
    -------
    dict
        ``overhead_s`` (T0), ``alpha_s``, ``alpha_idle_s``, ``busy_call_s`` (``c(m)``),
        ``io_per_row_s`` (rho) and ``partition_s`` (pi).

    Raises
    ------
    SurgeValueError
        If the two one-row runs have the same number of waves, the sizes are not
        ``1 <= m < M``, or a run is not positive.

    Examples
    --------
    >>> c = lambda b: 1e-3 * b                 # encode cost of a call of b rows
    >>> T0, alpha, idle, rho, pi, W, m = 0.1, 0.02, 0.015, 1e-5, 0.01, 2, 16
    >>> a = lambda b: idle + (alpha - idle) * min(c(b) / c(m), 1.0)   # alpha(c(b))
    >>> run = lambda P, b, extra=0.0: T0 + -(-P // W) * (a(b) + c(b) + rho * b + extra)
    >>> terms = solve_dask_terms(
    ...     c, workers=W, small=(2, run(2, 1)), large=(40, run(40, 1)),
    ...     moderate=(20, m, run(20, m)), big=(4, 500, run(4, 500)),
    ...     surge=(64, 8, run(8, 8, pi * 8)))
    >>> {k: round(v, 6) for k, v in terms.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'overhead_s': 0.1, 'alpha_s': 0.02, 'alpha_idle_s': 0.015, 'busy_call_s': 0.016,
     'io_per_row_s': 1e-05, 'partition_s': 0.01}
    """
    (p_s, t_s), (p_l, t_l) = small, large
    p_m, m, t_m = moderate
    p_u, m_u, t_u = surge
    w_s, w_l, w_m = (_waves(p, workers) for p in (p_s, p_l, p_m))
    w_u = _waves(-(-p_u // m_u), workers)
    rows_ok = (
        io[1] > 1 and min(io[2:]) > 0 if io is not None else big is not None and m < big[1] and big[2] > 0
    )
    if w_l <= w_s or m < 1 or not rows_ok or m_u < 1 or min(t_s, t_l, t_m, t_u) <= 0:
        raise SurgeValueError(
            f"solve_dask_terms needs a large one-row run with more waves than the small one, moderate "
            f"partitions of >= 1 row, big (or io) partitions larger, and positive times; got small={small}, "
            f"large={large}, moderate={moderate}, big={big}, io={io}, surge={surge} on {workers} worker(s). "
            "Fix: probe more one-row partitions in the large run (at least one wave more), and pass io "
            "(or big) runs over partitions of more rows."
        )
    per_wave_1 = max((t_l - t_s) / (w_l - w_s), cost(1))  # alpha(c(1)) + c(1) + rho
    overhead = max(t_s - w_s * per_wave_1, 0.0)
    per_wave_m = (t_m - overhead) / w_m  # alpha + c(m) + rho m
    if io is not None:
        p_io, m_io, t_1, t_big = io
        rho = max((t_big - t_1) / (_waves(p_io, workers) * (m_io - 1)), 0.0)
    else:
        assert big is not None, "solve_dask_terms needs the big run or the io runs"
        p_b, m_b, t_b = big
        per_wave_b = (t_b - overhead) / _waves(p_b, workers)  # alpha + c(M) + rho M
        rho = max((per_wave_b - per_wave_m - (cost(m_b) - cost(m))) / (m_b - m), 0.0)
    alpha = max(per_wave_m - cost(m) - rho * m, setup_s)
    if m == 1 or cost(m) <= cost(1):  # one-row calls already keep the workers busy: one alpha for all
        busy, idle = 0.0, alpha
    else:
        busy = cost(m)
        r = cost(1) / busy  # alpha(c(1)) = idle + (alpha - idle) r
        idle = max((per_wave_1 - cost(1) - rho - alpha * r) / (1 - r), setup_s)
    a_u = idle + (alpha - idle) * (min(cost(m_u) / busy, 1.0) if busy > 0 else 1.0)
    per_wave_u = (t_u - overhead) / w_u  # alpha(c(m_u)) + pi m_u + c(m_u) + rho m_u
    pi = max((per_wave_u - a_u - cost(m_u) - rho * m_u) / m_u, 0.0)
    return {
        "overhead_s": float(overhead),
        "alpha_s": float(alpha),
        "alpha_idle_s": float(idle),
        "busy_call_s": float(busy),
        "io_per_row_s": float(rho),
        "partition_s": float(pi),
    }


def _moderate_rows(cost, overhead_s: float, afford_rows: float) -> int:
    """Smallest ``m`` with ``cost(m) >= overhead_s`` (the busy-worker regime), at most ``afford_rows``.

    Examples
    --------
    >>> _moderate_rows(lambda b: 1e-3 * b, 0.016, 1000), _moderate_rows(lambda b: 1e-3 * b, 0.016, 8)
    (16, 8)
    >>> _moderate_rows(lambda b: 0.02 * b, 0.016, 1000)
    1
    """
    cap = max(int(afford_rows), 1)
    lo, hi = 1, cap
    if cost(lo) >= overhead_s:
        return lo
    if cost(hi) < overhead_s:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) >= overhead_s:
            hi = mid
        else:
            lo = mid
    return hi


def _encode_call(encoder) -> Callable[[list[str]], Any]:
    """The encode call the curve times: ``Encoder.encode`` for a dense model; for a sparse or
    multi-vector one its own call framed as its output columns (:meth:`SuperBatchTask.rows`)."""
    return encoder.encode if encoder.family == DENSE else SuperBatchTask("text", (), encoder).rows


class _FamilyRows:
    """What a PBP baseline maps over partitions for a sparse or multi-vector model: its output columns."""

    def __init__(self, encoder) -> None:
        self.task = SuperBatchTask("text", (), encoder)

    def __call__(self, texts: pd.Series) -> pd.DataFrame:
        rows = self.task.rows(texts.tolist())
        return pd.DataFrame({k: pd.arrays.ArrowExtensionArray(v) for k, v in rows.items()}, index=texts.index)

    @property
    def meta(self) -> pd.DataFrame:
        return pd.DataFrame(
            {k: pd.arrays.ArrowExtensionArray(v) for k, v in self.task.empty_payload().items()}
        )


def _partition_call(encoder) -> tuple[Callable[[pd.Series], Any], Any]:
    """``(function, meta)`` of the encode a PBP baseline runs per partition (a dense model's ``embed``)."""
    if encoder.family == DENSE:
        return encoder.embed, encoder.meta
    rows = _FamilyRows(encoder)
    return rows, rows.meta


def _dask_probe(encoder, client, cost, workers: int, budget_s: float, setup_s: float) -> dict:
    """Time the five runs of :func:`solve_dask_terms` through map_partitions and ddf.surge.encode.

    Every timed run computes a graph never computed before: a repeated graph would return
    results the scheduler still holds (its release is asynchronous) and time nothing. The
    runs alternate, three rounds of them, and each kind is observed by its median.

    The SuperBatch runs are the lazy graph :func:`dask_surge.encode` builds (``output=None``),
    with ``b_min = b_max = m`` over the frame's known sizes.
    """

    seeds = iter(range(1_000, 1_000_000))

    embed, embed_meta = _partition_call(encoder)

    def pbp(sizes):
        coll = make_partitioned_frame(sizes, seed=next(seeds))["text"].map_partitions(embed, meta=embed_meta)
        return lambda: client.compute(coll, sync=True)

    null = Encoder(_NullModel(encoder.dimension))  # costs nothing: its runs time the per-row I/O alone
    from .plugins import register_encoder  # imports distributed: only with a Client

    register_encoder(client, null)
    sbe = SuperBatchTask("text", (), encoder)
    meta = sbe.meta(make_partitioned_frame([1], seed=0)[["text"]]._meta)

    def pbp_null(sizes):
        coll = make_partitioned_frame(sizes, seed=next(seeds))["text"].map_partitions(
            null.embed, meta=null.meta
        )
        return lambda: client.compute(coll, sync=True)

    def surge(sizes, m):
        frame = make_partitioned_frame(sizes, seed=next(seeds))[["text"]]  # partition i holds sizes[i] rows
        coll = superbatch_collection(frame, plan_superbatches(list(sizes), m, m), list(sizes), sbe, meta)
        return lambda: client.compute(coll, sync=True)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    W = int(workers)
    # warm-up (imports, plugin, first tasks), which also sizes the runs to the budget
    timed(pbp([1] * W))
    wave1 = max(timed(pbp([1] * (4 * W))) / 4, cost(1))  # one wave and a quarter of T0: an overestimate
    rounds = 3
    share = budget_s / (rounds * 4 + 1)  # each of the rounds x 4 sized runs below takes about this long
    per_row = max(cost(1024) / 1024, 1e-9)
    n_large = int(np.clip(share / wave1, 12, 200))
    m_cap = int(np.clip(share / 2 / per_row, 32, 4096))
    # moderate partitions: encode at least the one-row per-call overhead (busy workers), >= 4 waves a share
    min_waves = 4
    m_mod = min(
        _moderate_rows(cost, wave1 - cost(1), (share / min_waves - wave1) / per_row), max(m_cap // 4, 1)
    )
    n_mod = int(np.clip(share / (wave1 + cost(m_mod) - cost(1)), min_waves, 200))
    m_sb = 8
    n_sb = int(np.clip(share / (wave1 + 8 * (wave1 + cost(8) / 8)), 4, 60))
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        runs = {
            "small": pbp([1] * W),
            "large": pbp([1] * (n_large * W)),
            "io_1": pbp_null([1] * (2 * W)),
            "io_big": pbp_null([_IO_ROWS] * (2 * W)),
            "surge": surge([1] * (n_sb * m_sb * W), m_sb),
        }
        if m_mod > 1:  # with m = 1 the large one-row run is the moderate run
            runs["moderate"] = pbp([m_mod] * (n_mod * W))
        for name, fn in runs.items():
            times.setdefault(name, []).append(timed(fn))
    med = {name: float(np.median(t)) for name, t in times.items()}
    runs = {
        "small": (W, med["small"]),
        "large": (n_large * W, med["large"]),
        "moderate": (n_mod * W, m_mod, med["moderate"]) if m_mod > 1 else (n_large * W, 1, med["large"]),
        "io": (2 * W, _IO_ROWS, med["io_1"], med["io_big"]),
        "surge": (n_sb * m_sb * W, m_sb, med["surge"]),
    }
    terms = solve_dask_terms(cost, workers=W, setup_s=setup_s, **runs)
    terms["probe"] = {k: [round(x, 4) if isinstance(x, float) else x for x in v] for k, v in runs.items()}
    return terms


class _NullModel:
    """An encoder that encodes nothing (zeros of the model's dimension): its runs time only the per-row I/O."""

    def __init__(self, dimension: int):
        self.dimension = int(dimension)

    def __call__(self, texts) -> np.ndarray:
        return np.zeros((len(texts), self.dimension), dtype=np.float32)


def _model_bytes(encoder) -> float:
    if encoder.spec.kind == "path":
        root = Path(encoder.spec.source)
        files = root.rglob("*") if root.is_dir() else [root]
        return float(
            sum(
                p.stat().st_size
                for p in files
                if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".onnx")
            )
        )
    obj = encoder.source_object
    params = getattr(obj, "parameters", None)
    if callable(params):
        return float(sum(p.numel() * p.element_size() for p in params()))
    return 0.0


def _device(encoder, client) -> str:
    if encoder.spec.device:
        return "cuda" if encoder.spec.device.startswith("cuda") else encoder.spec.device

    def probe() -> str:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    if client is None:
        return probe()
    return client.submit(probe, pure=False).result()


def _shape(client) -> tuple[int, int]:
    """``(workers, threads per worker)`` of ``client``'s cluster; ``(1, 1)`` for this process."""
    if client is None:
        return 1, 1
    info = client.scheduler_info(n_workers=-1) if _accepts_n_workers(client) else client.scheduler_info()
    threads = [w.get("nthreads", 1) for w in info["workers"].values()]
    if not threads:
        raise SurgeValueError(
            "the client's cluster has 0 workers, so nothing can be measured. Fix: start workers "
            "first (cluster.scale(n) or client.wait_for_workers(n))."
        )
    return len(threads), int(max(threads))


def calibrate(
    encoder: Any,
    *,
    client=None,
    seconds: float = 10,
    cache: bool = True,
    refresh: bool = False,
    probe: bool = True,
    rehearse: Callable[..., Any] | None = None,
) -> CostParams | None:
    """Measure the cost-model constants for ``encoder`` on ``client``'s cluster.

    Parameters
    ----------
    encoder : Encoder or model spec
        The encoder to probe (anything :class:`dask_surge.Encoder` accepts).
    client : distributed.Client, optional
        The live cluster. ``None`` probes the encode curve in this process
        only (no Dask costs): quick, but ``alpha`` is then just the encode set-up.
    seconds : float
        Probe time budget (about 30% encode curve, 70% Dask path); the probe takes
        about this long plus a warm-up. Heavier models measure fewer, smaller calls.
    cache : bool
        Read and write the JSON cache (see :func:`cache_dir`).
    refresh : bool
        Ignore a cached result (and overwrite it).
    probe : bool
        With ``False``, only look the parameters up in the cache and return
        ``None`` when they are not there (nothing is measured).
    rehearse : callable, optional
        Can be a function that runs one written encode of a frame on the same cluster, called as
        ``rehearse(frame, b_min=..., b_max=..., output=...)`` (:func:`dask_surge.plan` passes one
        that calls :func:`dask_surge.encode`), or None to skip the rehearsal. After a probe, it
        runs a small written run (about a fifth of ``seconds`` of encoding, into a temporary
        folder) whose refresh (:func:`refresh_from_run`) sets what the probe's bare Dask tasks
        cannot see: a real run's fixed cost and per-row rest (:func:`refresh_run_terms`), and the
        encode curve as a run pays it. A rehearsal that fails leaves the probe's parameters, with
        one log line saying why.

    Returns
    -------
    CostParams or None
        ``None`` only when ``probe=False`` and nothing is cached. How sure the parameters are
        is :attr:`CostParams.confidence <dask_surge.planning.costmodel.CostParams.confidence>`:
        ``"low"`` when the probe could not separate the per-row encode cost from timing noise
        within ``seconds``, even with a second probe of twice the budget (a busy machine): a
        :class:`CalibrationWarning` then says so, with the bounds of the per-row cost
        (``meta["per_row_interval_s"]``). Such a cached calibration is probed again by the next
        ``calibrate()`` (not by a run's look-up, ``probe=False``), unless a run refreshed it.

    Raises
    ------
    SurgeValueError
        If ``seconds`` is not a positive number.

    Warns
    -----
    CalibrationWarning
        When the parameters are low-confidence (see Returns).

    Examples
    --------
    >>> from dask_surge import Encoder
    >>> from dask_surge.planning.costmodel import predict
    >>> params = calibrate(Encoder("default", device="cpu"), seconds=3)       # doctest: +SKIP
    >>> predict([3, 500, 2] * 100, params, b_min=256, b_max=1024)              # doctest: +SKIP
    """

    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise SurgeValueError(
            f"seconds={seconds!r} must be a positive number (probe budget). Fix: pass e.g. seconds=10."
        )
    enc = encoder if isinstance(encoder, Encoder) else Encoder(encoder)
    workers, tpw = _shape(client)
    device = _device(enc, client)
    key = _key(enc.identity(), device, workers, tpw)
    if cache and not refresh:
        try:
            cached = _cached(key)
        except (ValueError, KeyError, TypeError) as err:
            logger.warning("dask-surge: ignoring unreadable calibration cache %s (%s)", cache_path(key), err)
            cached = None
        if cached is not None:
            # parameters from a probe lost in noise, no run refreshed yet: a probe asked for tries again
            rough = "per_row_interval_s" in dict(cached.meta) and not dict(cached.meta).get("refreshes")
            if not probe or not rough:
                return cached
    if not probe:
        return None

    t_start = time.perf_counter()
    load = _load()  # the machine's load when the calibration is taken, recorded with it
    curve_budget = seconds * (0.3 if client is not None else 0.9)
    measured = _measure_curve(enc, client, curve_budget)
    attempts = 1
    if not measured["separable"]:  # timing noise (a busy machine): once more, with twice the budget
        attempts = 2
        curve_budget *= 2
        measured = _measure_curve(enc, client, curve_budget)
    fit, interval = None, None
    if measured["separable"]:
        rows, padded, forwards, secs = (np.array(x, dtype=float) for x in zip(*measured["observations"]))
        try:
            fit = fit_encode_curve(rows, padded, forwards, secs)
        except SurgeValueError as err:  # the medians still do not grow with the call
            detail = str(err)
    else:
        detail = ""
    if fit is None:  # noise, even with a second, longer probe: parameters from its bounds, said to be rough
        fit, interval = _noise_curve(measured["noise"])
        _warn_not_separable(enc, measured["noise"], seconds, client, interval, detail=detail)
    tau = measured["tokens_per_text"]
    beta = fit.per_text_s + fit.per_token_s * tau
    # NNLS may put the whole fixed cost of a 1-row call into its forward pass; a call is never free
    setup = max(fit.setup_s, 1e-6)
    base = CostParams(
        alpha_s=setup,
        per_text_s=fit.per_text_s,
        per_token_s=fit.per_token_s,
        b0=fit.per_forward_s / beta,
        workers=workers,
        setup_s=setup,
        tokens_per_text=tau,
        max_tokens=measured["max_tokens"],
        batch_rows=measured["batch_rows"],
        token_lengths=tuple(measured["token_lengths"]),
        bytes_per_row=_bytes_per_row(measured["mean_text_bytes"], tau),
        embedding_bytes_per_row=4.0 * enc.dimension,
        model_bytes=_model_bytes(enc),
        threads_per_worker=tpw,
        device=device,
    )
    meta: dict = {
        "curve": json.dumps([[round(x, 7) for x in o] for o in measured["observations"]]),
        "curve_columns": "rows, padded_tokens, forwards, seconds",
        "curve_rel_rms": round(fit.rel_rms, 5),
        "curve_noise": json.dumps(measured["noise"]),
        "identity": json.dumps(key["identity"], sort_keys=True),
        "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workers": workers,
        "threads_per_worker": tpw,
        "load_per_cpu": load,
        "probe_attempts": attempts,
        "engine": measured.get("engine"),
        # how sure: a fit that explains the curve within 5% on the first probe is "high"; a curve
        # the probe could not separate from the noise is "low", with the per-row cost's bounds
        "confidence": "low"
        if interval is not None
        else "high"
        if attempts == 1 and fit.rel_rms <= 0.05
        else "medium"
        if fit.rel_rms <= 0.15
        else "low",
    }
    if interval is not None:
        meta["per_row_interval_s"] = json.dumps([float(x) for x in interval])
    params = base
    if client is not None:
        left = max(seconds - (time.perf_counter() - t_start), seconds * 0.5)
        d = _dask_probe(enc, client, lambda b: float(call_cost([b], base)[0]), workers, left, setup)
        meta["dask_probe"] = json.dumps(d.pop("probe"))
        params = base.replace(**d)
    meta["probe_seconds"] = round(time.perf_counter() - t_start, 2)
    params = params.replace(meta=tuple(sorted(meta.items())))
    if cache:
        _store(params, key)
        if rehearse is not None:
            params = _rehearsed(params, key, rehearse, seconds)
    return params


#: The share of the calibration's budget a rehearsal run encodes for (see :func:`calibrate`).
REHEARSAL_SHARE = 0.2


def _rehearsed(params: CostParams, key: dict, rehearse: Callable[..., Any], seconds: float) -> CostParams:
    """``params`` refreshed by one small written run (``rehearse``), or as they were when it failed.

    The run has a warm-up SuperBatch a worker and enough after them to refresh from, of at least
    16 rows each, in log-normal partitions of about 40 rows, and encodes for about
    :data:`REHEARSAL_SHARE` of ``seconds`` at the probe's speed (at most 50,000 rows)."""
    W = int(params.workers)
    calls = MIN_REFRESH_POINTS + 1 + 2 * W
    budget_rows = REHEARSAL_SHARE * seconds * W / max(params.beta_s, 1e-9)
    rows = int(np.clip(budget_rows, 16 * calls, 50_000))
    b = max(rows // calls, 1)
    sizes = lognormal_sizes(rows, max(rows // 40, 1), sigma=1.0, seed=7)
    frame = make_partitioned_frame(sizes.tolist(), seed=7)
    try:
        with tempfile.TemporaryDirectory(prefix="surge-rehearsal-") as tmp:
            rehearse(frame, b_min=b, b_max=b, output=os.path.join(tmp, "out"))
        return _cached(key) or params
    except Exception as err:  # noqa: BLE001 - the probe's parameters stand without it
        logger.warning("dask-surge: calibration rehearsal run failed (%s); using the probe's terms", err)
        return params


def _measure_curve(enc, client, budget_s: float) -> dict:
    """The encode curve, in this process (``client`` None) or on every worker at once (encode
    calls in a run share the machine the same way), pooled over the workers that separated it."""
    if client is None:
        return _probe_curve(enc, budget_s)
    from .plugins import register_encoder  # imports distributed: only with a Client

    register_encoder(client, enc)
    futures = [
        client.submit(_probe_curve, enc, budget_s, pure=False, workers=[w])
        for w in sorted(client.scheduler_info()["workers"])
    ]
    probes = client.gather(futures)
    # a worker whose probe stayed in the noise (a busy core) would only blur the others' curve
    usable = [p for p in probes if p["separable"]] or probes[:1]
    return dict(usable[0], observations=[o for p in usable for o in p["observations"]])


def _load() -> float | None:
    """The 1-minute load average per CPU (None where the OS does not say)."""
    try:
        return round(os.getloadavg()[0] / max(1, os.cpu_count() or 1), 2)
    except (AttributeError, OSError):
        return None


def _cached(key: dict) -> CostParams | None:
    """The parameters cached for ``key`` (what :func:`_store` wrote), or None when there are none or
    the file is another key's. Raises ValueError, KeyError or TypeError on a file it cannot read
    (each caller says what it does without it)."""
    path = cache_path(key)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("key") != json.loads(json.dumps(key, default=str)):
        return None
    return CostParams.from_dict(data["params"])


def _store(params: CostParams, key: dict) -> None:
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "params": params.to_dict()}, indent=1, default=str))
        os.replace(tmp, path)
    except OSError as err:  # a read-only home must not break planning
        logger.warning("dask-surge: could not cache the calibration in %s (%s)", path, err)


class CalibrationWarning(UserWarning):
    """The calibration probe could not separate the encode cost from timing noise: its parameters
    are rough (``confidence="low"``)."""


def _noise_curve(noise: dict) -> tuple[CurveFit, tuple[float, float]]:
    """A rough encode curve from a probe whose per-row cost stayed in the noise, and the bounds of that cost.

    The per-row cost is the large call's extra time over a one-row call per extra row, or, where
    the large call was not even slower, its own time per row (an upper bound: set-up included);
    its bounds widen the gap by three spreads (MADs) of each call on either side. The set-up is
    the one-row call less that per-row cost.

    Examples
    --------
    >>> fit, (lo, hi) = _noise_curve({"one_row": [0.34, 0.05], "largest": [1025, 0.40, 0.30]})
    >>> round(fit.per_text_s, 7), round(fit.setup_s, 4), lo, round(hi, 6)
    (5.86e-05, 0.3399, 0.0, 0.001084)
    """
    one_med, one_mad = (float(x) for x in noise["one_row"])
    rows, big_med, big_mad = int(noise["largest"][0]), float(noise["largest"][1]), float(noise["largest"][2])
    extra = max(rows - 1, 1)
    gap = big_med - one_med
    per_row = gap / extra if gap > 0 else big_med / max(rows, 1)
    spread = 3 * (one_mad + big_mad)
    lo, hi = max(gap - spread, 0.0) / extra, max(gap + spread, 0.0) / extra
    hi = max(hi, per_row)
    setup = max(one_med - per_row, 1e-6)
    half = (hi - lo) / 2 / per_row if per_row > 0 else 1.0
    return CurveFit(setup, max(per_row, 1e-12), 0.0, 0.0, min(half, 10.0)), (lo, hi)


def _warn_not_separable(
    encoder, noise: dict, seconds: float, client, interval: tuple[float, float], detail: str = ""
) -> None:
    """Warn, once, that the probe's per-row cost stayed in the noise, so its parameters are rough."""
    one_med, one_mad = noise["one_row"]
    rows, big_med, big_mad = noise["largest"]
    where = "its workers" if client is not None else "this process"
    lo, hi = interval
    msg = (
        f"dask-surge: calibration of {encoder!r} could not separate the per-row encode cost from timing "
        f"noise on {where}, even with a second, longer probe: a call of {rows:,} rows took {big_med:.4g} s "
        f"(median, spread {big_mad:.2g} s) against {one_med:.4g} s (spread {one_mad:.2g} s) for one row, "
        f"within seconds={seconds:g} (rule: the gap must exceed {SEPARATION_SIGMAS:g} spreads and the large "
        f"call {SEPARATION_RATIO:g}x the one-row call). Its parameters are returned with confidence='low' "
        f"(per-row cost between {lo:.3g} and {hi:.3g} s): plan() predictions and b_min='auto' are rough "
        "until a run refreshes them from its measured SuperBatches. Fix: calibrate again on a quieter "
        "machine, or with a longer probe (seconds=...)." + (f" ({detail})" if detail else "")
    )
    warnings.warn(msg, CalibrationWarning, stacklevel=3)


# -- refreshing a calibration from a run ---------------------------------------------------------
#: A run refreshes its calibration only from at least this many SuperBatches, once each worker's
#: first (warm-up) SuperBatch and the outliers are left out: fewer say too little.
MIN_REFRESH_POINTS = 3
#: Runs' SuperBatch points kept in a calibration entry (the newest), refitted with the probe's.
RUN_POINTS_KEPT = 64
#: A SuperBatch whose time is off the run's median ratio to the curve by more than this factor (or
#: 3 robust standard deviations, whichever is wider) is an outlier, left out of a refresh. Wide: on
#: a shared machine slow SuperBatches are part of what runs cost (a run's time is their sum).
OUTLIER_FACTOR = 3.0
#: Each older run's points weigh this much less than the next one's in the refit (recency).
RUN_DECAY = 0.5


def _curve_of(params: CostParams) -> np.ndarray:
    """``(setup, per_text, per_token, per_forward)`` of ``params``' encode curve (as the probe fits it)."""
    return np.array([params.setup_s, params.per_text_s, params.per_token_s, params.beta_s * params.b0])


def _predict_curve(coef: np.ndarray, pts: np.ndarray) -> np.ndarray:
    return coef[0] + pts[:, :3] @ coef[1:]


def _probe_points(params: CostParams) -> np.ndarray | None:
    """The probe's observations ``(rows, padded tokens, forwards, seconds)`` kept in ``params.meta``."""
    raw = dict(params.meta).get("curve")
    try:
        pts = np.array(json.loads(raw) if isinstance(raw, str) else raw or [], dtype=float)
    except (TypeError, ValueError):
        return None
    return pts if pts.ndim == 2 and pts.shape[1] == 4 and len(pts) >= 4 else None


def refresh_params(
    params: CostParams, points, *, warmup: int = 1, now: str | None = None, load: float | None = None
) -> CostParams | None:
    """Refresh a calibration's encode curve from one run's measured SuperBatches.

    A pure function: the parameters a run's SuperBatch timings make of ``params``, or None when
    the run says too little to change them.

    1. The first ``warmup`` points (each worker's first SuperBatch: allocator, tokenizer and
       caches warm up there) and any point with no rows, forward passes or time are left out.
    2. Each point's ratio of measured to predicted time is taken against a reference curve: the
       probe's own (refitted from its observations in ``params.meta["curve"]``), else the curve
       as it was before any run refreshed it; a point off the run's median ratio by more than
       :data:`OUTLIER_FACTOR` (or 3 robust standard deviations, whichever is wider) is an outlier
       and left out. Fewer than :data:`MIN_REFRESH_POINTS` left: None.
    3. The points kept join the runs' points of the entry (the newest :data:`RUN_POINTS_KEPT`),
       each older run weighing :data:`RUN_DECAY` times less. Their weighted time over the
       reference's is the machine's speed now against the probe's (``refresh_speed``): an
       exponentially weighted average over runs, so one noisy run moves the curve only part of
       the way. The probe's observations, scaled by it (they keep the curve's shape at small
       calls, where runs have no SuperBatches), and the runs' points are fitted together
       (:func:`fit_encode_curve`), and the fit is scaled so that it gives the runs' weighted
       time (the probe's points, taken on another day in other noise, may bend it where runs use
       it: they shape the curve, the runs set its level). Without the probe's observations, or
       when that fit fails, the reference curve is scaled by the speed instead.

    The per-call overheads that include the encode set-up (``alpha_s``, ``alpha_idle_s``) move
    with the new set-up; ``busy_call_s`` (an encode time) scales with ``refresh_ratio``; the Dask
    terms are kept. The result's ``meta`` says it was refreshed (``refreshes``, ``refreshed_at``,
    ``refreshed_from``: the SuperBatches used, ``refresh_ratio``: this run's measured model time over
    what the curve in use before the refresh predicted, ``refresh_speed``) and keeps the run
    points (``run_points``).

    Parameters
    ----------
    params : CostParams
        The cached calibration of the run's model, device and cluster shape.
    points : array-like of shape (n, 4)
        ``(sequences, padded tokens, forward passes, model seconds)`` of each SuperBatch of the
        run, in the order they started (:class:`~dask_surge.results.SuperBatchReport`'s
        ``sequences``, ``padded_tokens``, ``forwards`` and ``model_s``).
    warmup : int
        Leading points to leave out (the run's workers: each one's first SuperBatch).
    now : str, optional
        When (recorded as ``refreshed_at``; default: now).
    load : float, optional
        The machine's load per CPU during the run, recorded as ``refresh_load_per_cpu``.

    Returns
    -------
    CostParams or None

    Examples
    --------
    >>> truth = CostParams(0.002, 2e-4, 1e-5, 4.0, 1, setup_s=0.002, tokens_per_text=30.0)
    >>> stale = truth.replace(per_text_s=2.6e-4, per_token_s=1.3e-5)   # 1.3x too slow
    >>> b = np.arange(200, 1400, 100.0)
    >>> pts = np.column_stack([b, 40 * b, np.ceil(40 * b / 2048), np.zeros_like(b)])
    >>> pts[:, 3] = _predict_curve(_curve_of(truth), pts)
    >>> fresh = refresh_params(stale, pts, now="2026-01-01T00:00:00")
    >>> round(fresh.per_text_s / truth.per_text_s, 2), dict(fresh.meta)["refreshed_from"]
    (1.0, 11)
    >>> refresh_params(stale, pts[:3]) is None                        # too few SuperBatches
    True
    """
    pts = np.asarray(points, dtype=float).reshape(-1, 4)[max(int(warmup), 0) :]
    pts = pts[(pts[:, 0] > 0) & (pts[:, 1] >= 0) & (pts[:, 2] > 0) & (pts[:, 3] > 0)]
    if len(pts) < MIN_REFRESH_POINTS:
        return None
    meta = dict(params.meta)
    probe = _probe_points(params)
    # the reference the runs' speed is measured against: the probe's own curve (refitted from its
    # points), else the curve as it was before any run refreshed it
    base = _base_curve(meta)
    ref = base if base is not None else _curve_of(params)
    if probe is not None:
        try:
            fit = fit_encode_curve(probe[:, 0], probe[:, 1], probe[:, 2], probe[:, 3])
            ref = np.array([fit.setup_s, fit.per_text_s, fit.per_token_s, fit.per_forward_s])
        except SurgeValueError:
            probe = None
    pred = _predict_curve(ref, pts)
    if np.any(pred <= 0):
        return None
    lr = np.log(pts[:, 3] / pred)
    med = float(np.median(lr))
    tol = max(3 * 1.4826 * float(np.median(np.abs(lr - med))), np.log(OUTLIER_FACTOR))
    kept = pts[np.abs(lr - med) <= tol]
    if len(kept) < MIN_REFRESH_POINTS:
        return None
    # what the curve in use predicted for this run, before the refresh (recorded)
    before = _predict_curve(_curve_of(params), kept)
    ratio = float(kept[:, 3].sum() / before.sum()) if before.sum() > 0 else 1.0  # a zero curve: no ratio
    generation = int(meta.get("refreshes", 0)) + 1
    old = _run_points(meta)
    runs = np.vstack([old, np.column_stack([kept, np.full(len(kept), generation)])])[-RUN_POINTS_KEPT:]
    weights = RUN_DECAY ** (generation - runs[:, 4])
    # the machine's speed now against the reference: the runs' time over the reference's, newer runs
    # weighing more (a ratio of sums: a run's time is the sum of its SuperBatches', slow ones included)
    speed = float(np.sum(weights * runs[:, 3]) / np.sum(weights * _predict_curve(ref, runs)))
    coef = ref * speed
    if probe is not None:
        data = np.vstack([probe[:, :4] * [1, 1, 1, speed], runs[:, :4]])
        try:
            fit = fit_encode_curve(
                data[:, 0],
                data[:, 1],
                data[:, 2],
                data[:, 3],
                weights=np.concatenate([np.ones(len(probe)), weights]),
            )
            coef = np.array([fit.setup_s, fit.per_text_s, fit.per_token_s, fit.per_forward_s])
        except SurgeValueError:
            pass
        # the level where runs use it is the runs' own: the probe's points (another day, other
        # noise) may bend the fit there, so it is scaled to the runs' weighted time
        fitted = np.sum(weights * _predict_curve(coef, runs))
        if fitted > 0:
            coef = coef * float(np.sum(weights * runs[:, 3]) / fitted)
    elif base is None:
        meta["curve_base"] = json.dumps([float(x) for x in ref])
    setup = max(float(coef[0]), 1e-6)
    beta = float(coef[1] + coef[2] * params.tokens_per_text)
    if beta <= 0:
        return None
    shift = setup - params.setup_s
    meta.update(
        refreshes=generation,
        refreshed_at=now or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        refreshed_from=len(kept),
        refresh_ratio=round(ratio, 4),
        refresh_speed=round(speed, 4),
        refresh_load_per_cpu=load,
        # a run measured the curve where runs use it: a low-confidence probe is no longer only that
        confidence="medium" if meta.get("confidence") == "low" else meta.get("confidence", "medium"),
        run_points=json.dumps([[round(float(x), 7) for x in p] for p in runs]),
    )
    return params.replace(
        setup_s=setup,
        alpha_s=max(params.alpha_s + shift, setup),
        alpha_idle_s=max(params.alpha_idle_s + shift, setup)
        if params.busy_call_s > 0
        else params.alpha_idle_s,
        busy_call_s=params.busy_call_s * ratio,
        per_text_s=float(coef[1]),
        per_token_s=float(coef[2]),
        b0=float(coef[3]) / beta,
        meta=tuple(sorted(meta.items())),
    )


#: How many runs' observations of the run terms a calibration keeps (the newest).
RUN_TERMS_KEPT = 8


def refresh_run_terms(
    params: CostParams, calls, *, seconds: float, span_s: float, now: str | None = None
) -> CostParams | None:
    """Refresh a calibration's run terms from one run's measured time: the fixed cost of a run
    (``overhead_s``, ``T0``), the time per row the encode curve does not explain
    (``io_per_row_s``, ``rho``: gathering and framing rows, writing and committing the output) and
    the fixed cost of a SuperBatch (``superbatch_s``).

    A pure function. The probe measures them on bare Dask tasks, one call a task; a real run also
    plans, claims and records its output, writes every row, and runs several SuperBatches in one
    task. So each run measures them:

    1. ``T0`` is the run's time outside its SuperBatches: ``seconds - span_s`` (before the first
       one started and after the last one ended).
    2. The model's schedule of this run's own calls
       (:func:`dask_surge.planning.costmodel.calls_seconds`, with the encode curve as it is now,
       that ``T0``, no ``rho`` and the SuperBatch cost as it is) is compared with ``seconds``.
       Shorter: ``rho`` is the per-row time that makes it take ``seconds``. Longer: no ``rho``,
       and ``superbatch_s`` is the cost that makes it take ``seconds`` (0 when even that is not
       enough: how much longer it still predicts is ``run_terms_excess``).
    3. The result is the recency-weighted mean over the newest :data:`RUN_TERMS_KEPT` runs, each
       older run weighing :data:`RUN_DECAY` times less, so one noisy run moves them only part of
       the way. ``meta`` keeps the runs' observations (``run_terms``), ``run_terms_error`` (what
       the model before this refresh predicted for this run's calls over the measured seconds,
       less 1) and ``run_terms_at``.

    Parameters
    ----------
    params : CostParams
        The calibration (its encode curve already refreshed from the same run, when it could be).
    calls : array-like of shape (n, 3)
        ``(rows, real tokens, input partitions folded)`` of each SuperBatch, in the order they started.
    seconds : float
        The run's time (:attr:`dask_surge.EncodeResult.seconds`).
    span_s : float
        From the first SuperBatch's start to the last one's end.
    now : str, optional
        When (recorded as ``run_terms_at``; default: now).

    Returns
    -------
    CostParams or None
        None when the run says nothing (no calls, no rows, or no time).

    Examples
    --------
    >>> truth = CostParams(0.01, 1e-4, 0.0, 0, 2, overhead_s=0.5, io_per_row_s=2e-5)
    >>> calls = np.array([[400, 0, 3]] * 20, dtype=float)
    >>> measured = calls_seconds(calls[:, 0], truth, folded=calls[:, 2])
    >>> probe = truth.replace(overhead_s=0.02, io_per_row_s=0.0)   # bare Dask: no run's fixed cost, no writes
    >>> fresh = refresh_run_terms(probe, calls, seconds=measured, span_s=measured - 0.5)
    >>> round(fresh.overhead_s, 3), round(fresh.io_per_row_s / truth.io_per_row_s, 3)
    (0.5, 1.0)
    """
    c = np.asarray(calls, dtype=float).reshape(-1, 3)
    if len(c) == 0 or c[:, 0].sum() <= 0 or not (seconds > 0) or not np.all(np.isfinite(c)):
        return None
    rows, tokens, folded = c[:, 0], (c[:, 1] if np.all(c[:, 1] > 0) else None), c[:, 2]

    def run_time(p: CostParams) -> float:
        return calls_seconds(rows, p, tokens=tokens, folded=folded)

    fixed = float(min(max(seconds - span_s, 0.0), seconds))
    per_sb = params.alpha_s if params.superbatch_s is None else params.superbatch_s
    base = params.replace(overhead_s=fixed, io_per_row_s=0.0, superbatch_s=per_sb)
    excess = run_time(base) - seconds
    rho = 0.0
    if excess < 0:  # the run took longer than its encode calls and fixed cost: the rest is per row
        upper = seconds * int(params.workers) / float(rows.sum())
        rho = _solve(lambda x: run_time(base.replace(io_per_row_s=x)), seconds, upper)
        excess = 0.0
    elif excess > 0:  # faster: its SuperBatches cost less each than it says (a unit shares one dispatch)
        zero = run_time(base.replace(superbatch_s=0.0))
        if zero >= seconds:
            per_sb = 0.0
        else:
            per_sb = _solve(lambda x: run_time(base.replace(superbatch_s=x)), seconds, per_sb)
        excess = max(zero - seconds, 0.0)
    meta = dict(params.meta)
    try:
        old = [list(map(float, r)) for r in json.loads(meta.get("run_terms") or "[]")]
    except (TypeError, ValueError):
        old = []
    generation = int(meta.get("run_terms_refreshes", 0)) + 1
    runs = np.array([r for r in old if len(r) == 4] + [[generation, fixed, rho, per_sb]], dtype=float)
    runs = runs[-RUN_TERMS_KEPT:]
    w = RUN_DECAY ** (generation - runs[:, 0])
    mean = np.sum(w[:, None] * runs[:, 1:], axis=0) / w.sum()
    meta.update(
        run_terms_refreshes=generation,
        run_terms_at=now or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        run_terms_error=round(run_time(params) / seconds - 1, 4),
        run_terms_excess=round(excess, 4),
        run_terms=json.dumps([[int(r[0]), *(float(f"{x:.6g}") for x in r[1:])] for r in runs]),
    )
    return params.replace(
        overhead_s=float(mean[0]),
        io_per_row_s=float(mean[1]),
        superbatch_s=float(mean[2]),
        meta=tuple(sorted(meta.items())),
    )


def _solve(run_time: Callable[[float], float], seconds: float, hi: float) -> float:
    """The least ``x >= 0`` with ``run_time(x) >= seconds``, to 0.01%, for a ``run_time`` that grows
    with ``x`` from below ``seconds`` (each step schedules the run's calls once)."""
    lo, hi = 0.0, max(hi, 1e-12)
    while run_time(hi) < seconds:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run_time(mid) < seconds else (lo, mid)
    return hi


def _base_curve(meta: dict) -> np.ndarray | None:
    """The encode curve before any run refreshed it (kept where the probe's points are not)."""
    try:
        base = np.array(json.loads(meta.get("curve_base") or "null") or [], dtype=float)
    except (TypeError, ValueError):
        return None
    return base if base.shape == (4,) else None


def _run_points(meta: dict) -> np.ndarray:
    """Earlier runs' points kept in a calibration's meta: ``(rows, padded, forwards, seconds, run)``."""
    try:
        old = np.array(json.loads(meta.get("run_points") or "[]"), dtype=float)
    except (TypeError, ValueError):
        old = np.zeros((0, 5))
    return old if old.ndim == 2 and old.shape[1] == 5 else np.zeros((0, 5))


def cluster_shape(client) -> tuple[int, int]:
    """``(workers, threads per worker)`` of ``client``'s cluster (``(1, 1)``: this process), as a
    calibration's key records it; :func:`refresh_from_run` refreshes only a run whose shape held."""
    return _shape(client)


def refresh_from_run(
    encoder: Any,
    records,
    *,
    client=None,
    shape: tuple[int, int] | None = None,
    seconds: float | None = None,
) -> CostParams | None:
    """Refresh the cached calibration of a written run's model, device and cluster shape from its
    SuperBatches (see :func:`refresh_params`) and, given the run's ``seconds``, its run terms (see
    :func:`refresh_run_terms`); called by :func:`dask_surge.encode` once a run ends.

    Nothing changes (None is returned) when there is no cached calibration for exactly that key
    (a run never creates one), when the cluster's shape changed during the run (``shape``, taken
    as it started), when the SuperBatches were encoded by another engine than the one calibrated,
    or when too few of them counted what they computed (only the fast engine counts it; a
    callable or ``sentence-transformers`` model is never refreshed).

    Parameters
    ----------
    encoder : Encoder or model spec
    records : sequence of SuperBatchReport
        The run's SuperBatches (:attr:`dask_surge.EncodeResult.records`).
    client : distributed.Client, optional
        The run's cluster (None: the run ran in this process).
    shape : (int, int), optional
        :func:`cluster_shape` as the run started.
    seconds : float, optional
        The run's time (:attr:`dask_surge.EncodeResult.seconds`); None leaves the run terms as they are.

    Returns
    -------
    CostParams or None
        The refreshed parameters, also written to the cache.
    """
    enc = encoder if isinstance(encoder, Encoder) else Encoder(encoder)
    workers, tpw = _shape(client)
    if shape is not None and tuple(shape) != (workers, tpw):
        logger.info("dask-surge: cluster shape changed during the run; calibration not refreshed")
        return None
    counted = [r for r in records if r.committed and r.sequences > 0 and r.forwards > 0 and r.model_s > 0]
    if len(counted) < MIN_REFRESH_POINTS + 1:  # before even looking the calibration up
        return None
    identity = enc.identity()
    spec_device = enc.spec.device
    devices = (
        [("cuda" if spec_device.startswith("cuda") else spec_device)] if spec_device else ["cpu", "cuda"]
    )
    found = [d for d in devices if cache_path(_key(identity, d, workers, tpw)).exists()]
    if not found:  # nothing to refresh: asked before any task goes to the cluster to ask its device
        return None
    key = _key(identity, found[0] if len(found) == 1 and spec_device else _device(enc, client), workers, tpw)
    path = cache_path(key)
    try:
        params = _cached(key)
    except (ValueError, KeyError, TypeError) as err:
        logger.warning("dask-surge: not refreshing unreadable calibration cache %s (%s)", path, err)
        return None
    if params is None:
        return None
    engine = dict(params.meta).get("engine")
    if engine is not None and any(r.engine != engine for r in counted):
        return None
    counted.sort(key=lambda r: r.started_at)
    points = [(r.sequences, r.padded_tokens, r.forwards, r.model_s) for r in counted]
    fresh = refresh_params(params, points, warmup=workers, load=_load())
    if fresh is not None:
        logger.info(
            "dask-surge: calibration %s refreshed from %s SuperBatches (measured/predicted %.3g)",
            path.name,
            dict(fresh.meta)["refreshed_from"],
            dict(fresh.meta)["refresh_ratio"],
        )
    if seconds is not None:
        ran = [r for r in records if r.model_s > 0]  # every SuperBatch this run encoded took its time
        ends = [r.committed_at if r.task_end is None else r.task_end + r.clock_shift for r in ran]
        calls = [(r.rows + r.skipped, max(r.tokens, 0), len(r.spans)) for r in ran]
        span = max(ends) - min(r.started_at for r in ran)
        terms = refresh_run_terms(fresh or params, calls, seconds=float(seconds), span_s=span)
        fresh = terms or fresh
    if fresh is not None:
        _store(fresh, key)
    return fresh


def _bytes_per_row(mean_bytes: float, tokens_per_text: float) -> float:
    """Resident bytes per row while encoding: Arrow text + Python str copy + tokenizer output."""
    return 2 * mean_bytes + 8 + 57 + 64 * tokens_per_text


def _accepts_n_workers(client) -> bool:
    import inspect

    try:
        return "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False
