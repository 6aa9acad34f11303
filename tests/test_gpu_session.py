"""The one-shot GPU session script (issue 27 item 1), dry-run on the CPU.

``benchmarks/gpu_session.sh`` runs once on the GPU machine, with no second try: this test
runs the same script with ``SURGE_GPU_TRY=1`` (tiny models and sizes, the same stages,
files and code paths, timeouts halved) and checks what a real run relies on: at most 4
files come back (the device tool returns at most 8), the stage timeouts add up to well
under the run's limit, the stages that matter most run first, and every stage leaves a
JSON line that says which loader loaded its model.

Development tooling, not the package: the one test is in the slow leg (``pytest -m slow``,
run by .ci/run), since the dry run takes about two minutes on 2 cores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _plan() -> tuple[int, list[tuple[str, float]]]:
    text = SCRIPT.read_text()
    setup = int(re.search(r"^SETUP_TIMEOUT=(\d+)$", text, re.M).group(1))
    stages = re.search(r'^STAGES="([^"]+)"$', text, re.M).group(1)
    return setup, [(name, float(limit)) for name, _, limit in (s.partition(":") for s in stages.split(","))]


#: What loaded the model each stage times, in the dry run: dask-surge's native BERT loader, as in the workers.
_LOADED_BY = {
    "preflight": "dask-surge",
    "data": None,
    "surge_minilm": "dask-surge",
    "surge_bert": "dask-surge",
    "busy": "dask-surge",
    "host": "dask-surge",
    "engine": "dask-surge",
    "cosine": "dask-surge",
    "pytest": None,
}


def _check_plan() -> None:
    """The stage timeouts sum well under the run limit; every stage is run and known; what matters
    most runs first."""
    setup, stages = _plan()
    assert setup + sum(limit for _, limit in stages) < 480
    assert all(limit > 0 for _, limit in stages) and dict(stages)["preflight"] <= 15
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_stages
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert {name for name, _ in stages} == set(gpu_stages.STAGES)
    # end to end through Dask (MiniLM, BERT-base), then the GPU-busy fraction
    assert [name for name, _ in stages][:5] == ["preflight", "data", "surge_minilm", "surge_bert", "busy"]


@pytest.mark.slow  # development tooling, about 2 minutes on 2 cores: the slow leg, not the default suite
def test_dry_run_writes_one_line_per_stage_into_at_most_four_files(tmp_path):
    _check_plan()
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "SURGE_GPU_TRY": "1", "OUT": str(out)},
    )
    log = (out / "session.log").read_text() if (out / "session.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + log[-3000:]
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 4 and files == ["details.tar.gz", "results.jsonl", "session.log"]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    final = {rec["stage"]: rec for rec in lines if rec["status"] != "partial"}
    _, stages = _plan()
    for name in ["setup", *(n for n, _ in stages)]:
        assert name in final, (name, log[-3000:])
        assert final[name]["status"] in ("ok", "skipped"), final[name]
    assert final["session"]["status"] == "done"
    assert final["host"]["surge_noop"]["rows"] > 0 and final["host"]["tokenizer_in_worker"]["texts_per_s"] > 0
    busy = final["busy"]
    assert 0 < busy["busy_fraction"] <= 1.0 and busy["forwards"] == busy["one_call"]["forwards"] > 0
    assert final["surge_minilm"]["engine"] == ["fast"] and final["surge_minilm"]["worker"]["backends"] == [
        "fast"
    ]
    assert final["cosine"]["min_cosine"] >= 0.9999
    # the headline cosine is the workers' dtype (fp16 on CUDA, float32 here), loaded as they load it
    assert final["cosine"]["headline_dtype"] == "float32" and "min_cosine_bf16" in final["cosine"]
    assert final["cosine"]["dtypes"]["float32 via Encoder"]["min_cosine"] == final["cosine"]["min_cosine"]
    assert {name: final[name]["loaded_by"] for name in _LOADED_BY} == _LOADED_BY
    assert final["surge_bert"]["worker"]["loaded_by"] == ["dask-surge"]
    engine = final["engine"]
    assert engine["forward_only_texts_per_s"] > 0 and engine["forward_only"]["texts"] == engine["texts"]
    assert engine["bert"]["loaded_by"] == "dask-surge" and engine["bert"]["forward_only"]["texts_per_s"] > 0
    assert engine["st_loaded_by"] == "sentence-transformers"
    order = [rec["stage"] for rec in lines if rec["status"] != "partial" and rec["stage"] in _LOADED_BY]
    assert order == [n for n, _ in stages]  # run in the script's order
    assert any(rec["status"] == "partial" for rec in lines)  # results are saved as they come
    assert "stage preflight" in log
