"""Calibrate the cost model (:mod:`dask_surge.costmodel`) with a short probe.

The probe measures, through the real code paths, the constants of Theorem 1:

1. **Encode curve** ``c(b)``: one worker (or this process) encodes calls of
   ``b = 1, 2, 4, ...`` rows of synthetic English-like texts, plus calls of
   long texts. For each call the encoder's batching rule is replayed on the
   real token lengths (padded tokens, forward passes), and
   ``setup + per_text b + per_token padded + per_forward forwards`` is fitted
   by non-negative least squares on relative error. The token-length
   distribution is kept (256 quantiles) for predicting other call sizes.
2. **Per-call fixed cost** ``alpha`` and run overhead ``T0``: ``map_partitions``
   (PBP) over two numbers of one-row partitions; the slope of wall time per
   wave of ``W`` calls is ``alpha + c(1)``, the intercept is ``T0``.
3. **Per-row I/O** ``rho``: PBP over ``2 W`` large partitions; what the
   encode curve does not explain is shipping rows in and embeddings out.
4. **Per-folded-partition cost** ``pi``: ``ddf.surge.encode`` over the one-row
   partitions in SuperBatches of ``m`` rows.

Without a client only step 1 runs (in this process): ``alpha`` is the encode
set-up and the Dask terms are zero.

Results are cached as JSON under ``~/.cache/dask-surge/`` (or
``$DASK_SURGE_CACHE_DIR``), keyed by model identity, device and cluster shape.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .costmodel import CostParams, call_cost
from .errors import SurgeValueError

__all__ = ["calibrate", "cache_dir", "cache_path", "fit_encode_curve", "PROBE_VERSION"]

logger = logging.getLogger(__name__)
PROBE_VERSION = 1
_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


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
    return {"identity": identity, "device": device, "workers": int(workers), "threads": int(threads),
            "probe": PROBE_VERSION}


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


def fit_encode_curve(rows, padded_tokens, forwards, seconds) -> CurveFit:
    """Fit the encode cost of measured calls by non-negative least squares.

    The model ``seconds = setup + per_text rows + per_token padded_tokens +
    per_forward forwards`` is linear; it is solved with weights ``1 / seconds``
    (relative error) and non-negative coefficients.

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
    A = np.column_stack([np.ones_like(y), *cols])
    coef = _nnls(A * w[:, None], y * w)
    if coef[1] + coef[2] <= 0:
        raise SurgeValueError(
            "fit_encode_curve found no positive per-row or per-token cost: the encode times do not "
            f"grow with the call (rows={cols[0].tolist()}, seconds={y.round(6).tolist()}). "
            "Fix: probe larger calls, or a longer probe (seconds=...)."
        )
    rms = float(np.sqrt(np.mean(((A @ coef - y) / y) ** 2)))
    return CurveFit(*(float(c) for c in coef), rms)


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


def _token_counter(encoder):
    """A function texts -> token counts: the model's own tokenizer when it has one."""
    engine = _engine_of(encoder)
    if engine is not None:
        return lambda texts: engine.count_tokens(list(texts)).astype(float)
    candidates = []
    if encoder.spec.kind == "path":
        root = Path(encoder.spec.source)
        candidates += sorted(root.glob("tokenizer.json")) + sorted(root.glob("*/tokenizer.json"))
    try:
        from .testing import packaged_model_dir

        candidates.append(packaged_model_dir() / "tokenizer.json")
    except Exception:  # pragma: no cover - the packaged model is a runtime dependency
        pass
    for path in candidates:
        if path.exists():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
            tok.no_padding()
            tok.enable_truncation(512)
            return lambda texts: np.array([len(e.ids) for e in tok.encode_batch(list(texts))], dtype=float)
    return lambda texts: np.array([len(t.split()) * 1.3 + 2 for t in texts], dtype=float)  # pragma: no cover


def _batching(encoder) -> tuple[int, int]:
    """(max_tokens, batch_rows) of the encoder's micro-batching rule."""
    engine = _engine_of(encoder)
    if engine is not None:
        return int(engine.max_tokens), 0
    if encoder.backend == "sentence-transformers":
        return 0, int(encoder.spec.batch_size)
    return 0, 0


def _probe_curve(encoder, budget_s: float, seed: int = 7) -> dict:
    """Time encode calls of growing size (runs where the model lives: a worker or here)."""
    from .costmodel import _replay
    from .testing import make_texts

    short = make_texts(4096, seed=seed)
    long = make_texts(1024, seed=seed + 1, mean_words=60.0)
    encoder.encode(short[:64])  # warm the model, allocator and tokenizer
    count = _token_counter(encoder)
    max_tokens, batch_rows = _batching(encoder)
    lengths_short, lengths_long = count(short), count(long)

    def features(lengths):
        x = -np.sort(-lengths)
        padded, forwards = _replay(x, max_tokens, batch_rows)
        return padded, forwards

    deadline = time.perf_counter() + budget_s * 0.85
    per_b = budget_s * 0.85 / len(_LADDER)
    obs: list[tuple[int, float, float, float]] = []
    last_per_row = None

    def measure(texts, lengths, b, reps):
        secs, pads, fwds = [], [], []
        for r in range(reps):
            start = (r * b) % (len(texts) - b + 1) if b < len(texts) else 0
            t0 = time.perf_counter()
            encoder.encode(texts[start : start + b])
            secs.append(time.perf_counter() - t0)
            p, f = features(lengths[start : start + b])
            pads.append(p)
            fwds.append(f)
        best = int(np.argmin(secs))  # best of n, with the features of that very call
        return float(secs[best]), float(pads[best]), float(fwds[best])

    for b in _LADDER:
        est = (last_per_row or 1e-3) * b
        if len(obs) >= 5 and est * 3 > deadline - time.perf_counter():
            break
        reps = int(np.clip(per_b / max(est, 1e-6), 1, 25))
        sec, pad, fwd = measure(short, lengths_short, b, reps)
        obs.append((b, pad, fwd, sec))
        last_per_row = sec / b
    # long texts, to split the per-text from the per-token cost
    b_long = int(min(len(long), max(8, obs[-1][0] // 3)))
    sec, pad, fwd = measure(long, lengths_long, b_long, 2)
    obs.append((b_long, pad, fwd, sec))
    q = np.quantile(lengths_short, (np.arange(256) + 0.5) / 256)
    return {"observations": obs, "token_lengths": [round(float(x), 3) for x in q],
            "tokens_per_text": float(lengths_short.mean()), "max_tokens": max_tokens, "batch_rows": batch_rows,
            "mean_text_bytes": float(np.mean([len(t.encode()) for t in short]))}


# -- the Dask-path probe -------------------------------------------------------------------------
def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.min(times))  # best of n: other load on the machine only ever adds time


def _dask_probe(encoder, client, cost, workers: int, budget_s: float) -> dict:
    """Measure T0, alpha, rho and pi through map_partitions and ddf.surge.encode.

    ``cost(b)`` is the fitted encode cost of a call of ``b`` rows (set-up excluded).
    """
    from . import accessor  # noqa: F401  (registers .surge)
    from .testing import make_partitioned_frame

    def pbp(ddf):
        coll = ddf["text"].map_partitions(encoder.embed, meta=encoder.meta)
        return lambda: client.compute(coll, sync=True)

    c1 = cost(1)
    pbp(make_partitioned_frame([1] * (2 * workers), seed=10))()  # warm-up: plugin, imports, model
    # a small run sizes the large one to the budget
    p_b = 6 * workers
    t_b = _timed(pbp(make_partitioned_frame([1] * p_b, seed=12)), 2)
    guess = max(t_b / (p_b / workers), c1 + 1e-3)
    p_a = int(np.clip(budget_s * 0.22 * workers / guess, 4 * p_b, 600))
    p_a -= p_a % (8 * workers)
    tiny_a = make_partitioned_frame([1] * p_a, seed=11)
    t_a = _timed(pbp(tiny_a), 2)
    waves_a, waves_b = -(-p_a // workers), -(-p_b // workers)
    # T0 from the small run, given the large run's slope: a two-point slope amplifies noise on a
    # loaded machine, while T0 is a small correction to the large run
    overhead = float(np.clip(t_b - waves_b * t_a / waves_a, 0.0, t_b / 2))
    per_call = max((t_a - overhead) / waves_a, c1 + 1e-6)
    alpha = per_call - c1
    # large partitions: what the encode curve does not explain is per-row I/O
    beta = max(cost(1024) / 1024, 1e-9)
    m_big = int(np.clip(budget_s * 0.1 / beta, 32, 4096))
    big = make_partitioned_frame([m_big] * (2 * workers), seed=13)
    t_big = _timed(pbp(big), 2)
    rho = max(((t_big - overhead) / 2 - alpha - cost(m_big)) / m_big, 0.0)
    # SuperBatches of m one-row partitions: the cost of each folded partition
    m_sb = 8
    surge = tiny_a.surge.encode("text", model=encoder, b_min=m_sb, b_max=m_sb)  # size pass outside timing
    t_sb = _timed(lambda: client.compute(surge, sync=True), 2)
    waves = -(-(p_a // m_sb) // workers)
    pi = max(((t_sb - overhead) / waves - alpha - cost(m_sb) - rho * m_sb) / m_sb, 0.0)
    return {"overhead_s": overhead, "alpha_s": alpha, "io_per_row_s": rho, "partition_s": pi,
            "probe": {"pbp_one_row": [[p_b, round(t_b, 4)], [p_a, round(t_a, 4)]],
                      "pbp_large": [2 * workers, m_big, round(t_big, 4)],
                      "surge_one_row": [p_a, m_sb, round(t_sb, 4)]}}


def _model_bytes(encoder) -> float:
    if encoder.spec.kind == "path":
        root = Path(encoder.spec.source)
        files = root.rglob("*") if root.is_dir() else [root]
        return float(sum(p.stat().st_size for p in files
                         if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".onnx")))
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


def calibrate(encoder: Any, *, client=None, seconds: float = 15, cache: bool = True,
              refresh: bool = False, probe: bool = True) -> CostParams | None:
    """Measure the cost-model constants for ``encoder`` on ``client``'s cluster.

    Parameters
    ----------
    encoder : Encoder or model spec
        The encoder to probe (anything :class:`dask_surge.Encoder` accepts).
    client : distributed.Client, optional
        The live cluster. ``None`` probes the encode curve in this process
        only (no Dask costs): quick, but ``alpha`` is then just the encode set-up.
    seconds : float
        Probe time budget (about 40% encode curve, 60% Dask path). Heavier models
        measure fewer, smaller calls.
    cache : bool
        Read and write the JSON cache (see :func:`cache_dir`).
    refresh : bool
        Ignore a cached result (and overwrite it).
    probe : bool
        With ``False``, only look the parameters up in the cache and return
        ``None`` when they are not there (nothing is measured).

    Returns
    -------
    CostParams

    Raises
    ------
    SurgeValueError
        If ``seconds`` is not a positive number.

    Examples
    --------
    >>> from dask_surge import Encoder
    >>> from dask_surge.costmodel import predict
    >>> params = calibrate(Encoder("default", device="cpu"), seconds=3)       # doctest: +SKIP
    >>> predict([3, 500, 2] * 100, params, b_min=256, b_max=1024)              # doctest: +SKIP
    """
    from .encoders import Encoder

    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise SurgeValueError(f"seconds={seconds!r} must be a positive number (probe budget), e.g. seconds=15.")
    enc = encoder if isinstance(encoder, Encoder) else Encoder(encoder)
    if client is not None:
        info = client.scheduler_info(n_workers=-1) if _accepts_n_workers(client) else client.scheduler_info()
        threads = [w.get("nthreads", 1) for w in info["workers"].values()]
        workers, tpw = len(threads), int(max(threads, default=1))
        if workers == 0:
            raise SurgeValueError(
                "the client's cluster has 0 workers, so nothing can be measured. Fix: start workers "
                "first (cluster.scale(n) or client.wait_for_workers(n))."
            )
    else:
        workers, tpw = 1, 1
    device = _device(enc, client)
    key = _key(enc.identity(), device, workers, tpw)
    path = cache_path(key)
    if cache and not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == json.loads(json.dumps(key, default=str)):
                return CostParams.from_dict(data["params"])
        except (ValueError, KeyError, TypeError) as err:
            logger.warning("dask-surge: ignoring unreadable calibration cache %s (%s)", path, err)
    if not probe:
        return None

    t_start = time.perf_counter()
    curve_budget = seconds * (0.4 if client is not None else 0.9)
    if client is None:
        probe = _probe_curve(enc, curve_budget)
    else:
        from .plugins import register_encoder

        register_encoder(client, enc)
        first = sorted(client.scheduler_info()["workers"])[0]
        probe = client.submit(_probe_curve, enc, curve_budget, pure=False, workers=[first]).result()
    rows, padded, forwards, secs = (np.array(x, dtype=float) for x in zip(*probe["observations"]))
    fit = fit_encode_curve(rows, padded, forwards, secs)
    tau = probe["tokens_per_text"]
    beta = fit.per_text_s + fit.per_token_s * tau
    # NNLS may put the whole fixed cost of a 1-row call into its forward pass; a call is never free
    setup = max(fit.setup_s, 1e-6)
    base = CostParams(
        alpha_s=setup, per_text_s=fit.per_text_s, per_token_s=fit.per_token_s,
        b0=fit.per_forward_s / beta, workers=workers, setup_s=setup, tokens_per_text=tau,
        max_tokens=probe["max_tokens"], batch_rows=probe["batch_rows"],
        token_lengths=tuple(probe["token_lengths"]),
        bytes_per_row=_bytes_per_row(probe["mean_text_bytes"], tau), embedding_bytes_per_row=4.0 * enc.dimension,
        model_bytes=_model_bytes(enc), threads_per_worker=tpw, device=device,
    )
    meta: dict = {"curve": json.dumps([[round(x, 7) for x in o] for o in probe["observations"]]),
                  "curve_columns": "rows, padded_tokens, forwards, seconds",
                  "curve_rel_rms": round(fit.rel_rms, 5), "identity": json.dumps(key["identity"], sort_keys=True),
                  "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    params = base
    if client is not None:
        left = max(seconds - (time.perf_counter() - t_start), seconds * 0.3)
        d = _dask_probe(enc, client, lambda b: float(call_cost([b], base)[0]), workers, left)
        meta["dask_probe"] = json.dumps(d.pop("probe"))
        d["alpha_s"] = max(d["alpha_s"], setup)
        params = base.replace(**d)
    meta["probe_seconds"] = round(time.perf_counter() - t_start, 2)
    params = params.replace(meta=tuple(sorted(meta.items())))
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "params": params.to_dict()}, indent=1, default=str))
            os.replace(tmp, path)
        except OSError as err:  # a read-only home must not break planning
            logger.warning("dask-surge: could not cache the calibration in %s (%s)", path, err)
    return params


def _bytes_per_row(mean_bytes: float, tokens_per_text: float) -> float:
    """Resident bytes per row while encoding: Arrow text + Python str copy + tokenizer output."""
    return 2 * mean_bytes + 8 + 57 + 64 * tokens_per_text


def _accepts_n_workers(client) -> bool:
    import inspect

    try:
        return "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False
