"""A run refreshes its calibration from its measured SuperBatch timings (issue 63)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dask_surge.execution.calibrate as cal
from dask_surge.planning.costmodel import CostParams
from dask_surge.results import SuperBatchReport

NOW = "2026-01-01T00:00:00+0000"
#: the machine's true encode curve: setup, per text, per padded token, per forward pass
TRUTH = np.array([0.004, 1.5e-4, 6e-6, 2e-3])


def _curve(coef, pts) -> np.ndarray:
    pts = np.asarray(pts, dtype=float)
    return coef[0] + pts[:, :3] @ np.asarray(coef[1:])


def _shape(rows, tokens_per_text=30.0, max_tokens=2048) -> np.ndarray:
    """(rows, padded tokens, forwards) of calls of ``rows`` rows (a little padding)."""
    rows = np.asarray(rows, dtype=float)
    padded = rows * tokens_per_text * 1.1
    return np.column_stack([rows, padded, np.ceil(padded / max_tokens)])


def _probe_points(scale: float) -> np.ndarray:
    """A probe's observations on a machine ``scale`` times slower than the truth (e.g. a CPU burner)."""
    b = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    shape = _shape(b)
    long = _shape([170], tokens_per_text=90.0)  # a call of long texts splits per text from per token
    shape = np.vstack([shape, long])
    return np.column_stack([shape, scale * _curve(TRUTH, shape)])


def _params_from_probe(points: np.ndarray, **changes) -> CostParams:
    """What calibrate() makes of a probe's observations (its fit, the points kept in meta)."""
    fit = cal.fit_encode_curve(*points.T)
    beta = fit.per_text_s + fit.per_token_s * 30.0
    base = {
        "alpha_s": fit.setup_s + 0.01,
        "alpha_idle_s": fit.setup_s + 0.005,
        "busy_call_s": 0.02,
        "per_text_s": fit.per_text_s,
        "per_token_s": fit.per_token_s,
        "b0": fit.per_forward_s / beta,
        "workers": 2,
        "setup_s": fit.setup_s,
        "tokens_per_text": 30.0,
        "max_tokens": 2048,
        "overhead_s": 0.3,
        "meta": {"curve": json.dumps(points.tolist()), "confidence": "high"},
    }
    base.update(changes)
    return CostParams(**base)


def _run_points(sizes, *, warmup_s: float = 0.0, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """A run's SuperBatches on the true machine: (sequences, padded, forwards, model seconds)."""
    shape = _shape(sizes)
    secs = _curve(TRUTH, shape) * (1 + noise * np.random.default_rng(seed).uniform(-1, 1, len(shape)))
    secs[0] += warmup_s
    return np.column_stack([shape, secs])


def _coef(p: CostParams) -> np.ndarray:
    return cal._curve_of(p)


def _rel_error(p: CostParams, rows) -> np.ndarray:
    shape = _shape(rows)
    return np.abs(_curve(_coef(p), shape) / _curve(TRUTH, shape) - 1)


def test_a_stale_calibration_converges_to_what_runs_cost():
    """A calibration taken on a machine 1.3x slower (a CPU burner) predicts runs 30% slow; one
    run's SuperBatches bring its curve to the truth, at the run's sizes and at small calls."""
    stale = _params_from_probe(_probe_points(1.3))
    assert _rel_error(stale, [1000]).max() == pytest.approx(0.3, rel=1e-6)
    run = _run_points([1000, 1010, 990, 1020, 980, 1000, 1005, 995])
    fresh = cal.refresh_params(stale, run, warmup=2, now=NOW)
    assert fresh is not None
    assert _rel_error(fresh, [1000]).max() < 0.01
    assert _rel_error(fresh, [1, 8, 64, 256, 2048]).max() < 0.02  # the probe's shape, rescaled
    meta = dict(fresh.meta)
    assert meta["refreshes"] == 1 and meta["refreshed_at"] == NOW and meta["refreshed_from"] == 6
    assert meta["refresh_ratio"] == pytest.approx(1 / 1.3, rel=0.01)
    assert len(json.loads(meta["run_points"])) == 6
    # the set-up moved by its own shift; what is not the encode curve stays
    shift = fresh.setup_s - stale.setup_s
    assert fresh.alpha_s == pytest.approx(stale.alpha_s + shift)
    assert fresh.alpha_idle_s == pytest.approx(stale.alpha_idle_s + shift)
    assert fresh.busy_call_s == pytest.approx(stale.busy_call_s * meta["refresh_ratio"], rel=1e-3)
    assert (fresh.overhead_s, fresh.workers, fresh.token_lengths) == (
        stale.overhead_s,
        stale.workers,
        stale.token_lengths,
    )


def test_noisy_runs_converge_run_after_run():
    """Runs whose SuperBatches vary by +-15% (a shared machine): each refresh keeps the curve
    within a few percent of the truth, and earlier runs' points are kept, the newest last."""
    p = _params_from_probe(_probe_points(1.3))
    for seed in range(4):
        sizes = np.random.default_rng(seed).integers(600, 1400, 10)
        p = cal.refresh_params(p, _run_points(sizes, noise=0.15, seed=seed), warmup=1, now=NOW)
        assert p is not None
    assert _rel_error(p, [600, 1000, 1400]).max() < 0.05
    meta = dict(p.meta)
    kept = np.array(json.loads(meta["run_points"]))
    assert meta["refreshes"] == 4 and kept[-1, 4] == 4 and kept[0, 4] == 1


def test_one_odd_run_moves_the_curve_only_part_of_the_way():
    """Runs are averaged with recency weights: after three runs at the truth, one run twice as slow
    (a busy moment) moves the curve towards it, not all the way; the next runs bring it back."""
    p = _params_from_probe(_probe_points(1.3))
    for seed in range(3):
        p = cal.refresh_params(p, _run_points([1000] * 8, seed=seed), warmup=1, now=NOW)
    slow = _run_points([1000] * 8)
    slow[:, 3] *= 2.0
    q = cal.refresh_params(p, slow, warmup=1, now=NOW)
    moved = float(_curve(_coef(q), _shape([1000]))[0] / _curve(TRUTH, _shape([1000]))[0])
    assert 1.2 < moved < 1.8 and dict(q.meta)["refresh_ratio"] == pytest.approx(2.0, rel=0.01)
    for seed in range(4):
        q = cal.refresh_params(q, _run_points([1000] * 8, seed=seed), warmup=1, now=NOW)
    assert _rel_error(q, [1000]).max() < 0.05


def test_a_probe_of_another_shape_does_not_bend_the_level_runs_measured():
    """A probe taken in other noise (a large set-up, a small per-row cost: a different shape) and a
    run on the true machine: the refreshed curve gives the run's own time (it once came out 20-35%
    under it on a shared machine, where the probe's points outweighed the run's)."""
    other = np.array([0.05, 4e-5, 2e-6, 1e-4])
    probe = _probe_points(1.0)
    probe[:, 3] = _curve(other, probe) * np.random.default_rng(3).uniform(0.7, 1.3, len(probe))
    p = _params_from_probe(probe)
    run = _run_points(np.random.default_rng(4).integers(256, 1024, 12))
    fresh = cal.refresh_params(p, run, warmup=2, now=NOW)
    used = run[2:]
    assert _curve(_coef(fresh), used).sum() == pytest.approx(used[:, 3].sum(), rel=1e-6)


def test_a_fresh_calibration_stays_where_it_is():
    p = _params_from_probe(_probe_points(1.0))
    fresh = cal.refresh_params(p, _run_points([800] * 8), warmup=2, now=NOW)
    assert np.allclose(_coef(fresh), _coef(p), rtol=1e-3, atol=1e-9)


def test_each_workers_first_superbatch_is_left_out():
    """The first SuperBatches (model and allocator warm-up) are left out: a warm-up of 5 s changes nothing."""
    p = _params_from_probe(_probe_points(1.3))
    clean = _run_points([1000] * 8)
    warm = _run_points([1000] * 8, warmup_s=5.0)
    a = cal.refresh_params(p, clean, warmup=1, now=NOW)
    b = cal.refresh_params(p, warm, warmup=1, now=NOW)
    assert a == b
    assert dict(a.meta)["refreshed_from"] == 7


def test_outliers_are_left_out():
    p = _params_from_probe(_probe_points(1.3))
    run = _run_points([1000] * 9)
    run[4, 3] *= 5.0  # a SuperBatch stalled (swapped out, preempted for long)
    fresh = cal.refresh_params(p, run, warmup=1, now=NOW)
    assert dict(fresh.meta)["refreshed_from"] == 7
    assert _rel_error(fresh, [1000]).max() < 0.01


def test_too_few_superbatches_refresh_nothing():
    p = _params_from_probe(_probe_points(1.3))
    assert cal.refresh_params(p, _run_points([1000] * 3), warmup=1) is None  # 2 left after the warm-up
    assert cal.refresh_params(p, _run_points([1000] * 4), warmup=1) is not None
    run = _run_points([1000] * 4)
    run[2, 3] *= 4  # one of the three is an outlier: two left
    assert cal.refresh_params(p, run, warmup=1) is None
    uncounted = _run_points([1000] * 6)
    uncounted[1:4, 2] = -1  # the backend did not count forward passes (-1): not points
    assert cal.refresh_params(p, uncounted, warmup=1) is None


def test_without_the_probes_points_the_curve_is_scaled():
    p = _params_from_probe(_probe_points(1.3)).replace(meta={})
    fresh = cal.refresh_params(p, _run_points([1000] * 8), warmup=1, now=NOW)
    assert _rel_error(fresh, [1000]).max() < 0.01
    assert fresh.b0 == pytest.approx(p.b0)  # same shape: per-forward cost scaled with beta


def _report(i: int, rows: int, secs: float, *, engine: str = "fast", forwards: int = 2) -> SuperBatchReport:
    return SuperBatchReport(
        sb=f"{i:08d}",
        rows=rows,
        skipped=0,
        file=f"part-{i}.parquet",
        bytes=1,
        spans=((i, 0, rows, rows),),
        started_at=1000.0 + i,
        encode_s=secs * 1.1,
        write_s=0.01,
        committed=True,
        committed_at=1000.5 + i,
        engine=engine,
        model_s=secs,
        sequences=rows,
        tokens=rows * 30,
        padded_tokens=int(rows * 33),
        forwards=forwards,
    )


def _reports(n: int = 8, **kw) -> list[SuperBatchReport]:
    shape = _shape([1000] * n)
    secs = _curve(TRUTH, shape)
    return [_report(i, 1000, float(secs[i]), forwards=int(shape[i, 2]), **kw) for i in range(n)][::-1]


def _model(texts):
    return np.ones((len(texts), 4), dtype=np.float32)


def test_a_run_refreshes_only_its_own_key(tmp_path, monkeypatch):
    """The entry of the run's model, device and shape is refreshed; another shape's is not touched,
    nor anything when the shape changed during the run or another engine encoded."""
    from dask_surge import Encoder

    monkeypatch.setenv("DASK_SURGE_CACHE_DIR", str(tmp_path))
    enc = Encoder(_model, device="cpu")
    stale = _params_from_probe(_probe_points(1.3), workers=1, meta={"curve": "[]", "engine": "fast"})
    mine, other = (cal._key(enc.identity(), "cpu", w, 1) for w in (1, 2))
    cal._store(stale, mine)
    cal._store(stale.replace(workers=2), other)
    before = cal.cache_path(other).read_bytes()

    assert cal.refresh_from_run(enc, _reports(), client=None, shape=(2, 1)) is None  # shape changed
    assert cal.refresh_from_run(enc, _reports(engine="callable"), client=None, shape=(1, 1)) is None
    assert cal.refresh_from_run(enc, _reports(3), client=None, shape=(1, 1)) is None  # too few
    assert cal.calibrate(enc, probe=False) == stale  # none of them touched it

    fresh = cal.refresh_from_run(enc, _reports(), client=None, shape=(1, 1))
    assert fresh is not None and dict(fresh.meta)["refreshed_from"] == 7  # one worker: one warm-up
    assert cal.calibrate(enc, probe=False) == fresh  # what the next run's thresholds use
    assert cal.cache_path(other).read_bytes() == before
    # no entry for the key: a run never creates one
    assert (
        cal.refresh_from_run(Encoder(lambda t: _model(t) * 2, device="cpu"), _reports(), shape=(1, 1)) is None
    )


def _run_calls(seed: int = 0, n: int = 40) -> np.ndarray:
    """(rows, real tokens, partitions folded) of a run's SuperBatches: uneven, as SURGE forms them."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(200, 1000, n).astype(float)
    return np.column_stack([rows, rows * 30.0, rng.integers(1, 9, n)])


def _truth_params() -> CostParams:
    """The machine the runs below ran on: its encode curve known, and what its runs cost beside it."""
    p = _params_from_probe(_probe_points(1.0), workers=2)
    return p.replace(overhead_s=0.8, io_per_row_s=4e-5)


def _measured(calls: np.ndarray, p: CostParams) -> float:
    from dask_surge.planning.costmodel import calls_seconds

    return calls_seconds(calls[:, 0], p, tokens=calls[:, 1], folded=calls[:, 2])


def test_a_run_measures_its_fixed_cost_and_per_row_rest():
    """The probe times bare Dask tasks (T0 0.3 s, no rows written); a run that spent 0.8 s outside
    its SuperBatches and 40 us a row writing sets both, and the model then gives its time."""
    truth, calls = _truth_params(), _run_calls()
    probe = truth.replace(overhead_s=0.3, io_per_row_s=0.0)
    seconds = _measured(calls, truth)
    assert _measured(calls, probe) / seconds - 1 < -0.1  # the probe's terms: over 10% fast
    fresh = cal.refresh_run_terms(probe, calls, seconds=seconds, span_s=seconds - 0.8, now=NOW)
    assert fresh is not None
    assert fresh.overhead_s == pytest.approx(0.8) and fresh.io_per_row_s == pytest.approx(4e-5, rel=1e-3)
    meta = dict(fresh.meta)
    assert meta["run_terms_refreshes"] == 1 and meta["run_terms_at"] == NOW
    assert meta["run_terms_error"] == pytest.approx(_measured(calls, probe) / seconds - 1, abs=1e-4)
    # the next run, of other SuperBatches, is predicted from them
    other = _run_calls(seed=1, n=25)
    assert _measured(other, fresh) == pytest.approx(_measured(other, truth), rel=1e-3)
    # the curve and the Dask terms it does not measure are kept
    assert (fresh.per_text_s, fresh.alpha_s, fresh.partition_s) == (
        probe.per_text_s,
        probe.alpha_s,
        probe.partition_s,
    )


def test_a_run_faster_than_the_model_lowers_its_superbatch_cost_never_rho_below_zero():
    """The probe's per-call cost is one Dask task's; a run's SuperBatches share their unit's task. A
    run faster than the model says sets the SuperBatch's own cost (not rho, never negative), which
    SURGE's predictions use and the one-task-a-call baselines do not; a run faster than even a free
    SuperBatch says how much (run_terms_excess)."""
    from dask_surge.planning.costmodel import predict

    truth, calls = _truth_params(), _run_calls()
    units = truth.replace(superbatch_s=0.002, io_per_row_s=0.0)  # a SuperBatch costs less than a task
    seconds = _measured(calls, units)
    fresh = cal.refresh_run_terms(truth, calls, seconds=seconds, span_s=seconds - 0.8, now=NOW)
    assert fresh is not None and fresh.io_per_row_s == 0.0
    assert fresh.superbatch_s == pytest.approx(0.002, rel=1e-3) and fresh.alpha_s == truth.alpha_s
    assert dict(fresh.meta)["run_terms_excess"] == 0.0
    sizes = [int(n) for n in calls[:, 0]]
    got, was = (predict(sizes, p, b_min=300, b_max=2000) for p in (fresh, fresh.replace(superbatch_s=None)))
    assert got.loc["surge", "seconds"] < was.loc["surge", "seconds"]
    assert got.loc["pbp", "seconds"] == was.loc["pbp", "seconds"]  # one task a call: alpha, as probed
    seconds = 0.7 * _measured(calls, truth.replace(io_per_row_s=0.0, superbatch_s=0.0))
    fastest = cal.refresh_run_terms(truth, calls, seconds=seconds, span_s=seconds - 0.1, now=NOW)
    assert fastest is not None and fastest.io_per_row_s == 0.0 and fastest.superbatch_s == 0.0
    assert fastest.overhead_s == pytest.approx(0.1) and dict(fastest.meta)["run_terms_excess"] > 0


def test_the_run_terms_follow_runs_weighted_by_recency():
    """One slow run (a busy machine) moves the terms part of the way; the runs after it bring them
    back: the newest runs weigh most, and only the newest RUN_TERMS_KEPT are kept."""
    truth, calls = _truth_params(), _run_calls()
    p = truth
    slow = truth.replace(io_per_row_s=2e-4, overhead_s=3.0)
    s = _measured(calls, slow)
    p = cal.refresh_run_terms(p, calls, seconds=s, span_s=s - 3.0, now=NOW)
    assert p is not None and p.io_per_row_s == pytest.approx(2e-4, rel=1e-3)  # the first run is all it knows
    for i in range(cal.RUN_TERMS_KEPT + 2):
        s = _measured(calls, truth)
        nxt = cal.refresh_run_terms(p, calls, seconds=s, span_s=s - 0.8, now=NOW)
        assert nxt is not None and nxt.io_per_row_s <= p.io_per_row_s  # each run moves it toward the truth
        if i == 0:  # part of the way: the slow run still counts, half as much as the new one
            assert 4e-5 * 1.5 < nxt.io_per_row_s < 2e-4 * 0.5
        p = nxt
    assert p.io_per_row_s == pytest.approx(4e-5, rel=0.02) and p.overhead_s == pytest.approx(0.8, rel=0.02)
    assert len(json.loads(dict(p.meta)["run_terms"])) == cal.RUN_TERMS_KEPT


def test_a_run_that_says_nothing_changes_nothing():
    truth = _truth_params()
    assert cal.refresh_run_terms(truth, np.zeros((0, 3)), seconds=1.0, span_s=0.5) is None
    assert cal.refresh_run_terms(truth, _run_calls(), seconds=0.0, span_s=0.0) is None


def test_refresh_from_run_refreshes_the_run_terms_given_the_run_seconds(tmp_path, monkeypatch):
    """The run's seconds given (as encode() gives them), the cached entry's fixed cost becomes the
    run's time outside its SuperBatches; without them the run terms are left as they are."""
    from dask_surge import Encoder

    monkeypatch.setenv("DASK_SURGE_CACHE_DIR", str(tmp_path))
    enc = Encoder(_model, device="cpu")
    stale = _params_from_probe(_probe_points(1.3), workers=1, meta={"curve": "[]", "engine": "fast"})
    cal._store(stale, cal._key(enc.identity(), "cpu", 1, 1))
    reports = (
        _reports()
    )  # started 1000.0 + i, committed 1000.5 + i: 7.5 s from the first start to the last end
    kept = cal.refresh_from_run(enc, reports, client=None, shape=(1, 1))
    assert kept is not None and kept.overhead_s == stale.overhead_s and "run_terms" not in dict(kept.meta)
    fresh = cal.refresh_from_run(enc, reports, client=None, shape=(1, 1), seconds=9.0)
    assert fresh is not None and fresh.overhead_s == pytest.approx(1.5)
    assert cal.calibrate(enc, probe=False).overhead_s == pytest.approx(1.5)  # stored for the next plan


def test_a_rehearsal_is_one_small_written_run_and_its_failure_keeps_the_probe(tmp_path, monkeypatch, caplog):
    """calibrate(rehearse=...) after a probe: one written run with a warm-up SuperBatch a worker and
    enough after them to refresh from; what its refresh stored is returned. A rehearsal that fails
    (an output the workers cannot reach, a full disk) leaves the probe's parameters and says why."""
    monkeypatch.setenv("DASK_SURGE_CACHE_DIR", str(tmp_path))
    probe = _truth_params()  # 2 workers
    key = cal._key({"model": "m"}, "cpu", 2, 1)
    cal._store(probe, key)
    seen: dict = {}

    def rehearse(frame, **options):
        seen.update(options, rows=len(frame), output_parent=os.path.dirname(options["output"]))
        assert os.path.isdir(seen["output_parent"])  # a temporary folder, there while it runs
        cal._store(probe.replace(overhead_s=1.25), key)  # what encode()'s refresh does

    got = cal._rehearsed(probe, key, rehearse, seconds=10)
    assert got.overhead_s == 1.25
    assert seen["b_min"] == seen["b_max"] >= 16
    assert seen["rows"] // seen["b_min"] >= cal.MIN_REFRESH_POINTS + 1 + 2 * probe.workers
    assert not os.path.exists(seen["output_parent"])  # removed after the run

    def broken(frame, **options):
        raise OSError("No space left on device")

    with caplog.at_level("WARNING"):
        assert cal._rehearsed(probe, key, broken, seconds=10) == probe
    assert "rehearsal run failed (No space left on device)" in caplog.text


@pytest.mark.slow  # a local cluster encodes and writes: about 20-40 s on 2 shared cores
def test_a_written_run_refreshes_its_calibration(tiny_model, tmp_path, monkeypatch, client):
    """ddf.surge.encode(..., output=...) on a LocalCluster refreshes the cached calibration of its
    model, device and cluster shape from its SuperBatches."""
    from dask_surge import Encoder
    from dask_surge.testing import make_partitioned_frame

    monkeypatch.setenv("DASK_SURGE_CACHE_DIR", str(tmp_path / "cache"))
    enc = Encoder(tiny_model, device="cpu")
    key = cal._key(enc.identity(), cal._device(enc, client), *cal.cluster_shape(client))
    seeded = _params_from_probe(_probe_points(1.3), workers=2, meta={"curve": "[]"})
    cal._store(seeded, key)
    ddf = make_partitioned_frame([40] * 20, seed=5)
    result = ddf.surge.encode(
        "text",
        output=str(tmp_path / "emb"),
        model=tiny_model,
        device="cpu",
        b_min=80,
        b_max=80,
        progress=False,
    )
    records = result.records
    assert len(records) >= 6
    # distinct texts go through the model once: what it ran is what the report counts
    assert all(r.sequences == r.encoded and r.forwards >= 1 and 0 < r.model_s <= r.encode_s for r in records)
    meta = dict(cal.calibrate(enc, client=client, probe=False).meta)
    assert meta["refreshes"] == 1 and 3 <= meta["refreshed_from"] <= len(records) - 2
    assert meta["run_terms_refreshes"] == 1  # and its fixed cost and per-row rest from the run's time


@pytest.mark.parametrize("long_texts", ["truncate", "chunk"])
def test_the_fast_engine_counts_what_its_forward_passes_compute(tiny_model, long_texts):
    """What a SuperBatch report's sequences, padded tokens and forwards come from: the engine's own
    count of the micro-batches it ran (one sequence per window in chunk mode)."""
    from dask_surge import Encoder
    from dask_surge.engine.batching import replay

    enc = Encoder(tiny_model, device="cpu")
    texts = ["a dog", "a cat " * 300, "the quick brown fox jumps", *["word " * k for k in range(1, 40)]]
    out = enc.encode_long(texts, long_texts=long_texts)
    assert enc.backend == "fast" and out.shape is not None
    assert out.shape.sequences == len(out.embeddings)
    assert out.shape.tokens <= out.shape.padded_tokens and out.shape.forwards >= 1
    if long_texts == "truncate":  # the batching rule replayed on the token counts gives the same
        from dask_surge.planning.tokens import token_counter

        lengths = -np.sort(-np.asarray(token_counter(enc)(texts)))
        padded, forwards = replay(lengths, enc.engine.max_tokens, 0)
        assert (out.shape.padded_tokens, out.shape.forwards) == (int(padded), forwards)
