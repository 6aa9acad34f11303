"""The cost model's error on a fresh and on a stale calibration cache, and what one run's refresh does.

Usage::

    python -m benchmarks.calibration_refresh [--texts 4000] [--partitions 200] [--workers 2]
        [--b-min 256] [--b-max 1024] [--calib-seconds 10] [--stale scale|burner|both] [--scale 1.3]
        [--runs 2] [--out benchmarks/results/calibration_refresh.json]

On a ``LocalCluster`` of ``--workers`` single-threaded workers, with a tiny random BERT model
(:func:`dask_surge.testing.make_tiny_model`, the fast engine) and ``--texts`` synthetic texts in
``--partitions`` log-normal partitions (sigma 1.72):

1. **fresh**: ``calibrate()`` into an empty cache (``$DASK_SURGE_CACHE_DIR``, a temporary folder),
   with the rehearsal run ``plan(calibrate=True)`` gives it;
2. **stale**: the cache made stale, by hand (``--stale scale``: the encode curve and the
   probe's points scaled by ``--scale``, as a calibration taken on a machine that much slower)
   and/or by a calibration taken while ``os.cpu_count()`` processes burn the CPUs
   (``--stale burner``); ``both`` (the default) does one, then the other.

In each phase ``--runs`` written runs follow one another (each a new input of the same size
distribution, a new output): before each, ``ddf.surge.plan(..., calibrate=True)`` predicts the
SURGE run's seconds (from the cache as it is then); the run is ``ddf.surge.encode(..., output=...)``
with the same thresholds, timed around the call (``wall_s``); every run then refreshes the cache
from its SuperBatches (:func:`dask_surge.execution.calibrate.refresh_from_run`). A record per run:
the prediction, the measured seconds, the error ``predicted / measured - 1``, and what the entry
said (refreshes, the refresh's measured/predicted ratio of the encode curve). The model-call error
(``model_error``) compares the curve's prediction of each SuperBatch's model time with the
time measured (``SuperBatchReport.model_s``), summed over the run: the part of the error the
refresh addresses.

The machine is shared (2 cores, other processes): the load average is recorded with each run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import _results

ROOT = _results.ROOT


def _burn(stop) -> None:  # pragma: no cover - a CPU burner process
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def _model_error(records, params, workers: int, *, median: bool = False) -> float | None:
    """Sum of the curve's predicted model time over the sum measured, less 1 (counted SuperBatches
    only, each worker's first left out as the refresh does: it may wait for the model to load)."""
    from dask_surge.execution.calibrate import _curve_of

    counted = sorted((r for r in records if r.forwards > 0), key=lambda r: r.started_at)[workers:]
    pts = [(r.sequences, r.padded_tokens, r.forwards, r.model_s) for r in counted]
    if not pts:
        return None
    a = np.array(pts, dtype=float)
    coef = _curve_of(params)
    pred = coef[0] + a[:, :3] @ coef[1:]
    if median:  # the typical SuperBatch, against the sum: how skewed the SuperBatches' times are
        return float(np.median(pred / a[:, 3]) - 1)
    return float(pred.sum() / a[:, 3].sum() - 1)


def one_run(phase: str, i: int, ddf_seed: int, args, model: str, enc, client, work: Path) -> dict:
    from dask_surge.synthetic import lognormal_sizes, make_partitioned_frame

    sizes = lognormal_sizes(args.texts, args.partitions, sigma=1.72, seed=ddf_seed)
    ddf = make_partitioned_frame(sizes.tolist(), seed=ddf_seed)
    plan = ddf.surge.plan("text", model=model, calibrate=True, b_min=args.b_min, b_max=args.b_max)
    params = plan.params
    predicted = float(plan.predictions.loc["surge", "seconds"])
    before = dict(params.meta)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    result = ddf.surge.encode(
        "text",
        output=str(work / f"{phase}-{i}"),
        model=model,
        b_min=args.b_min,
        b_max=args.b_max,
        progress=False,
    )
    wall = time.perf_counter() - t0
    from dask_surge.execution import calibrate as cal

    refreshed = cal.calibrate(enc, client=client, probe=False)
    after = dict(refreshed.meta)
    rec = {
        "phase": phase,
        "run": i,
        "rows": int(result.rows),
        "superbatches": int(result.superbatches),
        "b_min": int(result.b_min),
        "b_max": int(result.b_max),
        "predicted_s": round(predicted, 4),
        "wall_s": round(wall, 4),
        "run_seconds": round(float(result.seconds), 4),
        "error": round(predicted / wall - 1, 4),
        "model_error": None
        if (e := _model_error(result.records, params, args.workers)) is None
        else round(e, 4),
        "model_error_median_sb": None
        if (e := _model_error(result.records, params, args.workers, median=True)) is None
        else round(e, 4),
        # the refreshed curve on the run it was refreshed from (the refresh's own fit)
        "model_error_refreshed": None
        if (e := _model_error(result.records, refreshed, args.workers)) is None
        else round(e, 4),
        "model_s": round(sum(r.model_s for r in result.records), 3),
        "encode_s": round(sum(r.encode_s for r in result.records), 3),
        "write_s": round(sum(r.write_s for r in result.records), 3),
        "first_model_s": [
            round(r.model_s, 3) for r in sorted(result.records, key=lambda r: r.started_at)[: args.workers]
        ],
        "predicted_encode_s": round(float(plan.predictions.loc["surge", "encode_s"]), 4),
        "params": {
            k: float(f"{getattr(params, k):.4g}")
            for k in (
                "setup_s",
                "per_text_s",
                "per_token_s",
                "b0",
                "alpha_s",
                "partition_s",
                "io_per_row_s",
                "overhead_s",
            )
        },
        "confidence": before.get("confidence"),
        "refreshes_before": int(before.get("refreshes", 0)),
        "refreshes_after": int(after.get("refreshes", 0)),
        "refreshed_from": after.get("refreshed_from"),
        "refresh_ratio": after.get("refresh_ratio"),
        # what the run's own refresh says: the model before it, on this run's SuperBatches, over its time
        "run_terms_error": after.get("run_terms_error"),
        "load_1min": round(load, 2),
    }
    print(json.dumps(rec), flush=True)
    return rec


def _rehearsal(enc, client):
    """The rehearsal run plan(calibrate=True) gives the calibration (on the same client)."""
    from dask_surge import api

    return api._rehearsal(enc, client, None)


def make_stale(enc, client, args, how: str) -> dict:
    """The cache entry made stale ``how`` (``scale`` or ``burner``); returns what was done."""
    from dask_surge.execution import calibrate as cal

    if how == "burner":
        stop = mp.Event()
        procs = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
        for p in procs:
            p.start()
        try:
            params = cal.calibrate(
                enc, client=client, seconds=args.calib_seconds, refresh=True, rehearse=_rehearsal(enc, client)
            )
        finally:
            stop.set()
            for p in procs:
                p.join(10)
        return {"stale": "burner", "burners": len(procs), "confidence": params.confidence}
    params = cal.calibrate(enc, client=client, probe=False)
    meta = dict(params.meta)
    curve = np.array(json.loads(meta["curve"]), dtype=float)
    curve[:, 3] *= args.scale
    meta["curve"] = json.dumps(curve.tolist())
    for k in ("refreshes", "run_points", "refreshed_at", "refreshed_from", "refresh_ratio"):
        meta.pop(k, None)
    s = args.scale
    stale = params.replace(
        per_text_s=params.per_text_s * s,
        per_token_s=params.per_token_s * s,
        setup_s=params.setup_s * s,
        alpha_s=params.alpha_s + params.setup_s * (s - 1),
        alpha_idle_s=params.alpha_idle_s + params.setup_s * (s - 1)
        if params.busy_call_s > 0
        else params.alpha_idle_s,
        busy_call_s=params.busy_call_s * s,
        meta=tuple(sorted(meta.items())),
    )
    workers, threads = cal.cluster_shape(client)
    cal._store(stale, cal._key(enc.identity(), cal._device(enc, client), workers, threads))
    return {"stale": "scale", "scale": s}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=4000)
    ap.add_argument("--partitions", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--b-min", type=int, default=256)
    ap.add_argument("--b-max", type=int, default=1024)
    ap.add_argument("--calib-seconds", type=float, default=10.0)
    ap.add_argument("--stale", choices=("scale", "burner", "both"), default="both")
    ap.add_argument("--scale", type=float, default=1.3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(_results.RESULTS / "calibration_refresh.json"))
    args = ap.parse_args(argv)
    report = _results.new_report(__spec__.name if __spec__ else "benchmarks.calibration_refresh", argv, args)

    from distributed import Client, LocalCluster

    from dask_surge import Encoder
    from dask_surge.execution import calibrate as cal
    from dask_surge.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["DASK_SURGE_CACHE_DIR"] = str(work / "cache")
        model = str(make_tiny_model(work / "model"))
        enc = Encoder(model)
        with (
            LocalCluster(
                n_workers=args.workers, threads_per_worker=1, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster) as client,
        ):
            t0 = time.perf_counter()
            params = cal.calibrate(
                enc, client=client, seconds=args.calib_seconds, rehearse=_rehearsal(enc, client)
            )
            calib_s = time.perf_counter() - t0
            report["summary"]["calibration"] = {
                "seconds": round(calib_s, 2),
                "confidence": params.confidence,
                "load_per_cpu": dict(params.meta).get("load_per_cpu"),
            }
            seed = 100
            for i in range(args.runs):
                report["results"].append(one_run("fresh", i, seed, args, model, enc, client, work))
                seed += 1
            phases = ["fresh"]
            for how in ("scale", "burner") if args.stale == "both" else (args.stale,):
                phase = f"stale-{how}"
                phases.append(phase)
                report["summary"][phase] = make_stale(enc, client, args, how)
                for i in range(args.runs):
                    report["results"].append(one_run(phase, i, seed, args, model, enc, client, work))
                    seed += 1
    res = report["results"]

    def err(phase: str, run: int, key: str = "error"):
        return next((r[key] for r in res if r["phase"] == phase and r["run"] == run), None)

    for phase in phases:  # the run on the cache as it was, then the runs after refreshes
        report["summary"][f"{phase}_errors"] = [err(phase, i) for i in range(args.runs)]
        report["summary"][f"{phase}_model_errors"] = [err(phase, i, "model_error") for i in range(args.runs)]
    report["summary"]["under_5pct"] = {f"{r['phase']}-{r['run']}": abs(r["error"]) < 0.05 for r in res}
    _results.save(report, args.out)
    print(json.dumps(report["summary"], indent=1))
    return report


if __name__ == "__main__":
    main()
