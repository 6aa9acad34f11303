"""Smoke runs of the benchmarks (what they write, never how fast): the paper's suite
``python -m benchmarks.paper.run --quick``, the object-store output at tiny sizes, and the one
result schema (``benchmarks/_results.py``) they all write.

Development tooling, not the package: the whole module is in the slow leg (``pytest -m slow``,
run by .ci/run), so the default suite tests only dask_surge; the paper's quick run alone takes
minutes on 2 cores."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # development tooling: the slow leg, not the default suite

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ("benchmark", "command", "machine", "git", "created", "args", "results", "summary")
REQUIRED = (
    "method",
    "encoder",
    "n",
    "partitions",
    "sigma",
    "texts_per_s",
    "tokens_per_s",
    "peak_rss_bytes",
    "ttfo_s",
    "calls",
)
METHODS = {"surge", "pbp", "fb", "pbplb", "st"}


def _run(module: str, *args: str, timeout: int = 540) -> tuple[dict, str]:
    """``python -m benchmarks.<module> ... --out`` from the repository root; the saved report (its file
    read back, one line per record) and what the run printed."""
    out = Path(args[args.index("--out") + 1])
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    report = json.loads(text)
    _check_schema(report, module)
    lines = text.splitlines()  # one line per record, between the list's own lines
    start = lines.index(' "results": [')
    assert lines[start + 1 + len(report["results"])] == " ],", lines[start : start + 3]
    return report, proc.stdout


def _check_schema(report: dict, module: str) -> None:
    assert tuple(report) == SCHEMA
    assert report["benchmark"] == module.rsplit(".", 1)[-1]
    assert report["command"].startswith(f"python -m benchmarks.{module}")
    assert report["machine"]["cpus"] and len(report["machine"]["loadavg_end"]) == 3
    assert report["git"] and report["created"]
    assert isinstance(report["results"], list) and report["results"]
    assert all(isinstance(r, dict) for r in report["results"]) and isinstance(report["summary"], dict)


def _results_module():
    # benchmarks/ is a package run from the repository root (python -m), not installed:
    # load its schema module by path (it imports nothing from its siblings)
    spec = importlib.util.spec_from_file_location("_bench_results", ROOT / "benchmarks" / "_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_save_rejects_a_report_off_the_schema(tmp_path):
    _results = _results_module()
    report = _results.new_report("benchmarks.example", ["--x", "1"], {"x": 1})
    report["results"].append({"value": 1})
    saved = _results.save(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == saved
    assert tuple(saved) == SCHEMA and saved["command"] == "python -m benchmarks.example --x 1"
    with pytest.raises(ValueError, match="extra"):
        _results.save({**report, "runs": []}, tmp_path / "bad.json")
    with pytest.raises(ValueError, match="results is dict"):
        _results.save({**report, "results": {}}, tmp_path / "bad.json")


def test_no_benchmark_script_of_ours_patches_sys_path():
    # the GPU session's scripts (gpu_*.py) still run as files
    ours = [
        p
        for p in (ROOT / "benchmarks").rglob("*.py")
        if not p.name.startswith("gpu_") and "results" not in p.parts
    ]
    assert ours and not [p.name for p in ours if "sys.path.insert" in p.read_text()]


def test_quick_benchmark_writes_complete_records(tmp_path):
    out = tmp_path / "results" / "quick.json"
    report, printed = _run(
        "paper.run",
        "--quick",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "work"),
    )
    assert {"dask", "distributed", "torch"} <= set(report["machine"]["versions"])
    records = report["results"]
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
    for fig in (
        "fig1_memory_ttfo_vs_n.png",
        "fig5_throughput_by_method.png",
        "fig8_bmin.png",
        "fig10_scaling.png",
    ):
        if report["summary"].get("figures"):  # matplotlib is optional
            assert (out.with_suffix("") / fig).stat().st_size > 0
    # the printed tables: the ratios against the paper's targets, then one row per record
    assert "| SURGE / FB throughput |" in printed
    assert printed.count("| SURGE |") == sum(r["method"] == "surge" for r in records)


def test_store_output_compares_s3_with_a_local_disk_and_counts_requests(tmp_path):
    pytest.importorskip("moto.server")
    report, _ = _run(
        "store_output",
        "--n",
        "1200",
        "--files",
        "20",
        "--b",
        "200",
        "--rounds",
        "1",
        "--out",
        str(tmp_path / "s.json"),
    )
    assert {r["method"] for r in report["results"]} == {"local", "s3", "s3-half-b"}
    assert all(r["rows"] == 1200 for r in report["results"])
    summary = report["summary"]
    assert summary["ratio_s3_over_local_seconds"] > 0
    assert summary["requests_per_superbatch"]["list_objects_v2"] == 0  # listing at start and finish only
    assert summary["requests_per_superbatch"]["put_object"] == 2  # the staged file and its commit record
