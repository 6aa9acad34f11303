"""Smoke runs of issue 17's benchmarks at tiny sizes (what they write, never how fast)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: int = 400) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_parquet_compression_reports_every_codec(tmp_path):
    out = tmp_path / "c.json"
    _run("parquet_compression.py", "--rows", "2000", "--real", "0", "--repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    codecs = report["results"]["synthetic"]["codecs"]
    assert set(codecs) == {"none", "snappy", "lz4", "zstd"} and codecs["none"]["size_vs_none"] == 1.0
    assert report["command"].startswith("python ")


@pytest.mark.slow
def test_host_ceiling_and_e2e_write_their_ratios(tmp_path):
    out = tmp_path / "h.json"
    _run("host_ceiling.py", "--n", "2000", "--files", "20", "--repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["b_runs"][0]["rows"] == 2000 and report["ratio_b_over_a"] > 0 and "met" in report
    out = tmp_path / "e.json"
    _run("e2e_small_files.py", "--n", "600", "--files", "30", "--minilm-n", "0", "--repeats", "1",
         "--out", str(out))
    result = json.loads(out.read_text())["results"]["tiny"]
    assert result["ratio_surge_over_st"] > 0 and len(result["runs"]["surge"]) == 1


def test_fixed_cost_reports_phases_and_that_the_client_never_loads_the_model(tmp_path):
    out = tmp_path / "f.json"
    _run("fixed_cost.py", "--files", "40", "--n", "400", "--repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["cold"]["rows"] == 400 and report["warm"][0]["rows"] == 400
    assert 0 < report["warm"][0]["first_superbatch_s"] <= report["warm"][0]["seconds"]
    assert report["warm"][0]["client_phases_s"]["footers"] > 0
    assert report["client_loaded_model"] is False
