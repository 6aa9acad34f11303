"""The asv suite (``benchmarks/asv.conf.json``, ``benchmarks/asv_bench/``) imports and is
well formed: ``asv check --python=same`` from ``benchmarks/``; the quick run (each benchmark
once, ~1.5 min on 2 cores). Development tooling, not the package: both are in the slow leg
(``pytest -m slow``, run by .ci/run), so the default suite tests only dask_surge. Skipped where
asv is not installed (``pip install asv``)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = [
    pytest.mark.skipif(shutil.which("asv") is None, reason="asv is not installed (pip install asv)"),
    pytest.mark.slow,  # development tooling: the slow leg, not the default suite
]


def _asv(*args: str, timeout: int) -> str:
    subprocess.run(["asv", "machine", "--yes"], cwd=BENCH, capture_output=True, text=True, timeout=60)
    # asv elides benchmark names to the terminal's width ("...ng.PlanParquetFooters..."): make it wide
    env = {**os.environ, "COLUMNS": "250"}
    proc = subprocess.run(
        ["asv", *args, "--python=same"], cwd=BENCH, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_asv_check_finds_no_problem():
    out = _asv("check", timeout=120)
    assert "No problems found" in out


def test_asv_quick_run_runs_every_benchmark():
    out = _asv("run", "--quick", "--show-stderr", timeout=400)
    for name in (
        "engine.TinyEncoder.track_texts_per_s",
        "planning.PlanParquetFooters.track_plan_ms_per_file",
        "policy.Policy.time_plan_superbatches",
        "write.ParquetWrite.time_parquet_bytes",
        "run.LocalRun.track_ttfo_s",
        "run.LocalRunMemory.peakmem_encode",
    ):
        assert name in out, name
    assert "failed" not in out.lower(), out[-4000:]
