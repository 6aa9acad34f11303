"""Smoke run of the host-ceiling benchmark at a tiny size (what it writes, never how fast).

The other benchmarks' smoke runs are in ``tests/test_benchmarks_smoke.py``; this one stays a
script run as a file, as the GPU session runs it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_host_ceiling_writes_its_ratio(tmp_path):
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_ceiling.py"), "--n", "2000", "--files",
                           "20", "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=400,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["b_runs"][0]["rows"] == 2000 and report["ratio_b_over_a"] > 0 and "met" in report
