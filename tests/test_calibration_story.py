"""One calibration story: plan() and encode() resolve thresholds from the same calibration."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # a local cluster and a calibration probe: about a minute on 2 cores
def test_plan_calibrates_where_encode_runs(tmp_path, monkeypatch, tiny_model):
    """plan(calibrate=True) without a Client probed in this process (1 worker), so encode(), which
    starts a local cluster of one worker per core, found no calibration for its shape and ran the
    CPU default ("b_min=468 in 13 SuperBatches" planned, "b_min=704 in 10" run). Now both see
    the calibration of the local cluster's shape, and the run records the plan's b_min."""
    from dask_surge.testing import make_partitioned_frame

    monkeypatch.setenv("DASK_SURGE_CACHE_DIR", str(tmp_path / "cache"))
    ddf = make_partitioned_frame([40] * 30, seed=3)
    planned = ddf.surge.plan("text", calibrate=True, model=tiny_model)
    assert planned.params is not None, "the probe could not measure on this machine"
    meta = dict(planned.params.meta)
    from dask_surge.execution.cluster import local_cluster_threads

    assert meta["workers"] == local_cluster_threads() and "load_per_cpu" in meta
    assert meta["confidence"] in ("high", "medium", "low")
    # a written rehearsal run set what the probe's bare tasks cannot see: a run's fixed cost
    assert meta["run_terms_refreshes"] == 1 and planned.params.overhead_s > 0
    result = ddf.surge.encode("text", output=str(tmp_path / "emb"), model=tiny_model, progress=False)
    assert "no calibration" not in result.thresholds_reason
    assert (result.b_min, result.b_max) == (planned.b_min, planned.b_max)
