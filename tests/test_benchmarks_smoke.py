"""Smoke runs of the benchmarks (what they write, never how fast): the paper's suite
``python -m benchmarks.paper.run --quick``, the small scripts at tiny sizes, and the one
result schema (``benchmarks/_results.py``) they all write."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def _run(module: str, *args: str, timeout: int = 540) -> dict:
    """``python -m benchmarks.<module> ... --out`` from the repository root; the saved report."""
    out = Path(args[args.index("--out") + 1])
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _check_schema(report, module)
    return report


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
    assert tuple(saved) == SCHEMA and saved["command"] == "python -m benchmarks.example --x 1"
    with pytest.raises(ValueError, match="extra"):
        _results.save({**report, "runs": []}, tmp_path / "bad.json")
    with pytest.raises(ValueError, match="results is dict"):
        _results.save({**report, "results": {}}, tmp_path / "bad.json")


def test_no_benchmark_script_of_ours_patches_sys_path():
    # the GPU session's scripts (gpu_*.py, host_ceiling.py, split_runs_ab.py) still run as files
    gpu = {"host_ceiling.py", "split_runs_ab.py"}
    ours = [
        p
        for p in (ROOT / "benchmarks").rglob("*.py")
        if not p.name.startswith("gpu_") and p.name not in gpu and "results" not in p.parts
    ]
    assert ours and not [p.name for p in ours if "sys.path.insert" in p.read_text()]


@pytest.mark.slow
def test_quick_benchmark_writes_complete_records(tmp_path):
    out = tmp_path / "results" / "quick.json"
    readme = tmp_path / "README.md"
    report = _run(
        "paper.run",
        "--quick",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "work"),
        "--readme",
        str(readme),
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
    text = readme.read_text()
    assert "<!-- BENCH-TABLE:START -->" in text and "| SURGE |" in text


def test_fixed_cost_reports_phases_and_that_the_client_never_loads_the_model(tmp_path):
    report = _run(
        "fixed_cost", "--files", "40", "--n", "400", "--repeats", "1", "--out", str(tmp_path / "f.json")
    )
    cold, warm = report["results"]
    assert (cold["phase"], warm["phase"]) == ("cold", "warm") and cold["rows"] == warm["rows"] == 400
    assert 0 < warm["first_superbatch_s"] <= warm["seconds"] and warm["client_phases_s"]["footers"] > 0
    assert report["summary"]["client_loaded_model"] is False


@pytest.mark.slow
def test_e2e_small_files_writes_its_ratio(tmp_path):
    report = _run(
        "e2e_small_files",
        "--n",
        "600",
        "--files",
        "30",
        "--minilm-n",
        "0",
        "--repeats",
        "1",
        "--out",
        str(tmp_path / "e.json"),
    )
    assert {(r["encoder"], r["method"]) for r in report["results"]} == {
        ("tiny", "st"),
        ("tiny", "st1"),
        ("tiny", "surge"),
    }
    assert all(r["rows"] == 600 for r in report["results"])
    assert report["summary"]["tiny"]["ratio_surge_over_st"] > 0
    surge = next(r for r in report["results"] if r["method"] == "surge")
    assert surge["workers_cpu_s"] > 0 and surge["client_cpu_s"] > 0 and surge["machine_busy"] > 0
    summary = report["summary"]["tiny"]
    assert summary["cpu"]["a_cpu_us_per_text"] > 0 and summary["cpu"]["b_cpu_us_per_text"] > 0
    assert 0 < summary["cluster_idle_cores"] < 2  # Dask's heartbeats tick, but an idle cluster is not busy


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_e2e_small_files_runs_the_sparse_and_multivector_arms(tmp_path, warm):
    """Each family against its own reference encode; surge wrote the family's columns; cold and warm
    figures go to their own files and are marked."""
    out = tmp_path / ("w.json" if warm else "c.json")
    report = _run(
        "e2e_small_files",
        "--models",
        "sparse,multivector",
        "--sparse-n",
        "60",
        "--sparse-files",
        "6",
        "--multivector-n",
        "60",
        "--multivector-files",
        "6",
        "--repeats",
        "1",
        *(["--warm"] if warm else []),
        "--out",
        str(out),
    )
    assert {(r["encoder"], r["method"]) for r in report["results"]} == {
        (m, k) for m in ("sparse", "multivector") for k in ("st", "st1", "surge")
    }
    assert all(r["rows"] == 60 and r["warm"] is warm for r in report["results"])
    columns = {"sparse": {"indices", "values"}, "multivector": {"vectors", "tokens"}}
    for name, family_columns in columns.items():
        summary = report["summary"][name]
        assert summary["family"] == name and summary["warm"] is warm
        assert (
            summary["ratio_surge_over_st"] > 0
            and summary["surge_texts_per_s"] > 0
            and summary["st_texts_per_s"] > 0
        )
        assert (
            family_columns <= set(summary["surge_output_columns"])
            and "embedding" not in summary["surge_output_columns"]
        )
    surge = [r for r in report["results"] if r["method"] == "surge"]
    assert all((r["warmup_s"] is not None) is warm for r in surge)


def test_e2e_breakdown_sorts_py_spy_samples_into_where_the_workers_cpu_went():
    """py-spy's raw lines, summed by ``host_ceiling.gil_profile``, then shared out by ``e2e_small_files.breakdown``:
    a frame's line number does not matter, waiting leaves are left out, the event loop is ``MainThread``'s rest."""
    raw = "\n".join(
        [
            "thread (1): MainThread;<module> (a.py:1);EpollSelector.select (selectors.py:468) 5",
            "thread (1): MainThread;<module> (a.py:1);Worker.heartbeat (w.py:9) 4",
            "thread (2): Dask-Default-Threads-2-0;Thread.run (t.py:1);DeviceRunner.forward (device.py:289);f (l.py:3) 10",
            "thread (2): Dask-Default-Threads-2-0;Thread.run (t.py:1);DeviceRunner.forward (device.py:290) 2",
            "thread (2): Dask-Default-Threads-2-0;Thread.run (t.py:1);UnitSource.iterate (s.py:5) 3",
            "thread (3): surge-commit_0;Thread.run (t.py:1);g (x.py:2) 1",
        ]
    )
    code = (
        "import json, sys; from benchmarks.host_ceiling import gil_profile; "
        "from benchmarks.e2e_small_files import breakdown; "
        "print(json.dumps(breakdown({'w': gil_profile(sys.stdin.read(), None)})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], input=raw, capture_output=True, text=True, cwd=str(ROOT), timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {
        "busy_samples": 20,
        "share": {"forward": 0.6, "read": 0.15, "event loop": 0.2, "other": 0.05},
    }


@pytest.mark.slow
def test_reuse_update_writes_its_speedups_and_memory(tmp_path):
    report = _run("reuse_update", "--quick", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json"))
    by = {(r["part"], r["encoder"], r["method"]) for r in report["results"]}
    assert {("speed", m, k) for m in ("minilm", "tiny") for k in ("old", "full", "update")} <= by
    for name in ("minilm", "tiny"):
        s = report["summary"][name]
        assert 0.08 < s["changed_fraction"] < 0.12 and s["speedup_update_over_full"] > 0
        assert (
            s["reused"] > 0 and s["encoded"] + s["reused"] == s["n_new"] and s["encoded"] < s["full_encoded"]
        )
    assert "met" in report["summary"]["minilm"] and "met" not in report["summary"]["tiny"]
    mem = [r for r in report["results"] if r["part"] == "memory"]
    assert len(mem) == 2 and mem[0]["old_output_rows"] < mem[1]["old_output_rows"]
    assert mem[0]["encoded"] == mem[1]["encoded"] and mem[0]["reused"] == mem[1]["reused"] > 0
    assert all(r["max_worker_peak_rss_bytes"] > 0 and "client" in r["peak_rss_bytes"] for r in mem)
    assert report["summary"]["minilm_projected_at_tiny_n"]["speedup_update_over_full"] > 0


@pytest.mark.slow
def test_long_texts_writes_its_ratio_and_memory(tmp_path):
    report = _run(
        "long_texts", "--docs", "4", "--repeats", "1", "--sizes-mb", "0.2", "--out", str(tmp_path / "l.json")
    )
    speed = [r for r in report["results"] if r["measure"] == "speed"]
    assert [r["forward"] for r in speed] == ["MiniLM", "no-op"]
    assert all(r["windows"] > 4 and r["chunk_over_truncate"] > 0 for r in speed)
    mem = [r for r in report["results"] if r["measure"] == "memory"]
    assert [r["kind"] for r in mem] == ["short", "document"] and mem[1]["windows"] > 10
    assert (
        all(r["peak_above_warmup"] >= 0 for r in mem)
        and "0.2 MB" in report["summary"]["peak_above_warmup_mib"]
    )


def test_row_groups_ab_writes_its_ratio(tmp_path):
    report = _run(
        "row_groups_ab",
        "--rows",
        "500",
        "--partitions",
        "60",
        "--dims",
        "8",
        "--rounds",
        "1",
        "--out",
        str(tmp_path / "g.json"),
    )
    layouts = {r["layout"]: r for r in report["results"]}
    assert set(layouts) == {"per_partition", "row_groups", "one"}
    partitions = report["summary"]["dim8"]["partitions"]  # the non-empty ones of 60
    assert 1 < partitions <= 60 and layouts["per_partition"]["row_groups"] == partitions
    assert layouts["one"]["row_groups"] == 1 and layouts["row_groups"]["row_groups"] < partitions
    assert report["summary"]["dim8"]["ratio_per_partition_over_row_groups"] > 0


def test_gather_ab_writes_both_arms(tmp_path):
    report = _run(
        "gather_ab",
        "--n",
        "400",
        "--files",
        "40",
        "--b-min",
        "64",
        "--b-max",
        "128",
        "--rounds",
        "2",
        "--out",
        str(tmp_path / "a.json"),
    )
    assert {r["arm"] for r in report["results"]} == {"sliced", "rows"}
    assert all(r["rows"] == 400 for r in report["results"])
    assert report["summary"]["superbatches"] > 1 and report["summary"]["ratio_sliced_over_rows_cpu"] > 0


def test_tokenizer_threads_ab_runs_both_pools_side_by_side(tmp_path):
    report = _run(
        "tokenizer_threads_ab",
        "--n",
        "2000",
        "--files",
        "20",
        "--rounds",
        "2",
        "--out",
        str(tmp_path / "t.json"),
    )
    assert [r["arm"] for r in report["results"]] == [
        "raw_tokenizer",
        "every_core",
        "share",
        "raw_tokenizer",
        "share",
        "every_core",
    ]
    summary = report["summary"]
    # the old pool: a thread per core in every worker; the new: the plugin's share (none set on one core)
    assert summary["rayon_num_threads_seen"]["every_core"] == [str(summary["cores"])]
    expected = summary["share_threads_expected"]
    assert summary["rayon_num_threads_seen"]["share"] == (
        [str(expected)] if expected < summary["cores"] else [None]
    )
    assert len(summary["paired_share_over_every_core"]) == 2 and summary["over_raw_tokenizer"]["share"] > 0


@pytest.mark.slow
def test_allocator_ab_runs_every_arm_and_sees_the_nannys_page_faults(tmp_path):
    report = _run(
        "allocator_ab", "--n", "600", "--minilm-n", "0", "--rounds", "1", "--out", str(tmp_path / "m.json")
    )
    assert [r["arm"] for r in report["results"]] == ["glibc", "dask", "mmap", "kept"]
    assert all(r["engine"] == "TransformerEngine" and r["device_s"] > 0 for r in report["results"])
    faults = report["summary"]["tiny"]["median_minor_faults"]
    assert (
        faults["dask"] > faults["mmap"] > faults["kept"]
    )  # every activation block mapped anew, then its top trimmed


@pytest.mark.slow
def test_attention_ab_runs_both_arms_on_one_engine_with_the_same_output(tmp_path):
    report = _run(
        "attention_ab", "--n", "600", "--minilm-n", "0", "--rounds", "2", "--out", str(tmp_path / "a.json")
    )
    assert [r["arm"] for r in report["results"]] == ["stock", "padded", "padded", "stock"]
    assert all(r["device_s"] > 0 for r in report["results"])
    tiny = report["summary"]["tiny"]
    assert tiny["max_abs_difference"] < 1e-5 and len(tiny["paired_ratios_stock_over_padded"]) == 2


@pytest.mark.slow
def test_e2e_ab_runs_the_base_library_under_this_harness(tmp_path):
    report = _run(
        "e2e_ab",
        "--base",
        "HEAD",
        "--n",
        "300",
        "--files",
        "30",
        "--rounds",
        "1",
        "--out",
        str(tmp_path / "e.json"),
    )
    assert [r["variant"] for r in report["results"]] == ["base", "this"]
    assert all(
        r["rows"] == 300 and r["workers_cpu_s"] > 0 and r["workers_minflt"] > 0 for r in report["results"]
    )
    summary = report["summary"]
    assert summary["base"] == "HEAD" and len(summary["paired_speedup"]) == 1 and summary["speedup"] > 0


def test_joined_tokenize_compares_the_arms_on_the_same_ids(tmp_path):
    report = _run(
        "joined_tokenize",
        "--n",
        "600",
        "--rounds",
        "2",
        "--group",
        "8",
        "auto",
        "--out",
        str(tmp_path / "j.json"),
    )
    arms = {r["arm"]: r for r in report["results"]}
    assert set(arms) == {
        "per_text",
        "joined[8]",
        "joined[auto]",
    }  # each packed per_text's ids (checked in the run)
    assert all(r["rounds"] == 2 and r["thread_cpu_us_per_text"] > 0 for r in arms.values())
    assert report["summary"]["thread_cpu_over_per_text"]["per_text"] == 1.0


def test_store_output_compares_s3_with_a_local_disk_and_counts_requests(tmp_path):
    pytest.importorskip("moto.server")
    report = _run(
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


def test_unit_submit_runs_both_submissions_on_one_cluster(tmp_path):
    report = _run(
        "unit_submit",
        "--texts",
        "300",
        "--partitions",
        "30",
        "--workers",
        "1",
        "--rounds",
        "1",
        "--out",
        str(tmp_path / "u.json"),
    )
    assert [r["arm"] for r in report["results"]] == ["named", "tokenized"]
    assert all(r["wall_s"] > 0 and r["client_cpu_s"] > 0 for r in report["results"])
    assert set(report["summary"]["tokenized_over_named"]) == {"wall_s", "client_cpu_s"}
