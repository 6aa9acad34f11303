"""Smoke run of the benchmark suite: ``benchmarks/run.py --quick`` (no timing assertions)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("method", "encoder", "n", "partitions", "sigma", "texts_per_s", "tokens_per_s",
            "peak_rss_bytes", "ttfo_s", "calls")
METHODS = {"surge", "pbp", "fb", "pbplb", "st"}


@pytest.mark.slow
def test_quick_benchmark_writes_complete_records(tmp_path):
    out = tmp_path / "results" / "quick.json"
    readme = tmp_path / "README.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(out),
           "--workdir", str(tmp_path / "work"), "--readme", str(readme)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads(out.read_text())
    assert report["command"] and report["machine"]["cpu_count"]
    assert len(report["loadavg_before"]) == 3 and len(report["loadavg_after"]) == 3
    assert {"dask", "distributed", "torch"} <= set(report["machine"]["versions"])
    records = report["records"]
    assert {r["method"] for r in records} == METHODS
    for r in records:
        assert not r.get("error"), r
        missing = [k for k in REQUIRED if r.get(k) is None]
        assert not missing, (r["method"], missing)
        assert r["rows_written"] == r["n"]
        assert r["texts_per_s"] > 0 and r["tokens_per_s"] > r["texts_per_s"]
        assert r["peak_rss_bytes"] > 0 and r["ttfo_s"] > 0 and r["calls"] >= 1
    by_method = {r["method"]: r for r in records if "main" in r["suites"]}
    assert by_method["pbp"]["calls"] == by_method["pbp"]["partitions"]  # one call per partition
    assert by_method["surge"]["calls"] < by_method["pbp"]["calls"]
    assert set(report["summary"]["targets"])  # ratios computed (values are machine-dependent)
    for fig in ("fig1_memory_ttfo_vs_n.png", "fig5_throughput_by_method.png", "fig8_bmin.png", "fig10_scaling.png"):
        if report.get("figures"):  # matplotlib is optional
            assert (out.with_suffix("") / fig).stat().st_size > 0
    text = readme.read_text()
    assert "<!-- BENCH-TABLE:START -->" in text and "| SURGE |" in text
