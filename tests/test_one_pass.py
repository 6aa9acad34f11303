"""One pass over any input, and a resume that does no work on what is committed.

The input here is a ``map_partitions`` step over an in-memory frame, so Dask does not know
its partition sizes: encode() streams it (no size pass). ``CallLog`` records every time a
partition is computed, in any process.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import numpy as np
import pytest

import dask_surge
from dask_surge.io.manifest import current_run
from dask_surge.testing import CallLog, checksum_model, make_partitioned_frame
from dask_surge.io.store import OutputStore

SIZES = [int(x) for x in np.random.default_rng(16).integers(0, 25, size=200)]
FIRST_IDS = list(np.cumsum([0, *SIZES[:-1]]))  # doc_id of each partition's first row
NONEMPTY = sorted(int(first) for first, n in zip(FIRST_IDS, SIZES) if n)


def _streamed(log_path: str, sleep: float = 0.0):
    ddf = make_partitioned_frame(SIZES, seed=16)
    # meta given: Dask would otherwise call the step once on fake rows to infer it
    return ddf.map_partitions(CallLog(log_path, sleep=sleep), meta=ddf._meta)


def _sorted(out):
    df = dask_surge.read_embeddings(str(out)).compute().sort_values(["partition", "row"])
    return df.reset_index(drop=True)


def _same_rows(a, b) -> None:
    assert a[["partition", "row", "doc_id"]].equals(b[["partition", "row", "doc_id"]])
    np.testing.assert_array_equal(np.stack(a.embedding.to_numpy()), np.stack(b.embedding.to_numpy()))


KW = dict(model=checksum_model, keep=["doc_id"], b_min=60, b_max=200, progress=False)


def test_streamed_input_is_computed_once_and_a_complete_rerun_computes_nothing(tmp_path, client):
    log = str(tmp_path / "calls")
    res = _streamed(log).surge.encode("text", str(tmp_path / "o"), **KW)
    assert res.sizes_source == "streamed" and res.rows == sum(SIZES) and res.engine == "callable"
    assert sorted(CallLog(log).calls()) == NONEMPTY  # every partition exactly once
    back = _sorted(tmp_path / "o")
    assert back.doc_id.tolist() == list(range(sum(SIZES)))
    # only a unit's last SuperBatch may be under b_min
    info = dask_surge.status(str(tmp_path / "o"))
    assert info["state"] == "complete" and info["mode"] == "streaming"
    again = _streamed(log).surge.encode("text", str(tmp_path / "o"), **KW)
    assert sorted(CallLog(log).calls()) == NONEMPTY  # the complete rerun computed nothing
    assert again.rows == res.rows and again.superbatches == res.superbatches


def test_streamed_superbatches_respect_the_thresholds(tmp_path):
    out = tmp_path / "o"
    _streamed(str(tmp_path / "calls")).surge.encode("text", str(out), scheduler="sync", **KW)
    manifest = current_run(OutputStore.open(str(out)))
    per_unit = manifest.plan.unit_partitions
    records = list(manifest.committed().values())
    assert all(r.rows <= 200 for r in records)
    # a SuperBatch under b_min ends its unit (or holds a partition's last slice)
    for r in records:
        if r.rows < 60:
            last = r.spans[-1]
            assert (last[0] + 1) % per_unit == 0 or last[0] == len(SIZES) - 1


SCRIPT = textwrap.dedent("""
    import json, sys
    from distributed import Client, LocalCluster
    from dask_surge.testing import CallLog, checksum_model, make_partitioned_frame
    sizes, out, log, stream, sleep = json.loads(sys.argv[1])
    ddf = make_partitioned_frame(sizes, seed=16)
    model = checksum_model
    if stream:
        ddf = ddf.map_partitions(CallLog(log, sleep=sleep), meta=ddf._meta)
    else:  # an in-memory frame: sizes known, SuperBatches planned
        import dask.dataframe as dd
        from dask_surge.testing import SleepyModel
        ddf, model = dd.from_pandas(ddf.compute(), npartitions=40), SleepyModel(sleep)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") \\
            as cluster, Client(cluster):
        ddf.surge.encode("text", out, model=model, keep=["doc_id"], progress=False,
                         **json.loads(sys.argv[2]))
""")


def _kill_midway(
    tmp_path, out, log, *, stream: bool, thresholds: dict, seed: int, sleep: float = 0.03
) -> None:
    """Run the encode in a process on a 1-worker cluster and SIGKILL it after its first commits."""
    args = [json.dumps([SIZES, str(out), log, stream, sleep]), json.dumps(thresholds)]
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    commits = None
    while time.monotonic() < deadline and proc.poll() is None:
        runs = list(out.glob("_surge/runs/*/commits")) if out.exists() else []
        if runs and len(list(runs[0].glob("*.json"))) >= 2:
            commits = runs[0]
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    assert commits is not None, "no commit within 120 s"
    time.sleep(random.Random(seed).uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_killed_streamed_run_resumes_computing_only_what_was_not_committed(tmp_path, client):
    reference = tmp_path / "clean"
    _streamed(str(tmp_path / "clean-calls")).surge.encode("text", str(reference), **KW)
    out, log = tmp_path / "o", str(tmp_path / "calls")
    thresholds = {"b_min": 60, "b_max": 200}
    _kill_midway(tmp_path, out, log, stream=True, thresholds=thresholds, seed=1)
    before = len(CallLog(log).calls())
    manifest = current_run(OutputStore.open(str(out)))
    coverage = manifest.coverage()
    assert manifest.completion() is None and coverage.missing(len(SIZES))  # really killed midway
    todo = {int(FIRST_IDS[p]) for p in coverage.missing(len(SIZES)) if SIZES[p]}
    # resumed on a cluster of another shape (2 workers, was 1): same run, recorded plan
    res = _streamed(log, sleep=0.03).surge.encode("text", str(out), **KW)
    assert res.resumed and res.skipped_superbatches > 0
    resumed_calls = CallLog(log).calls()[before:]
    assert set(resumed_calls) == todo and len(resumed_calls) == len(todo)  # each once, nothing else
    _same_rows(_sorted(out), _sorted(reference))


def test_resume_after_changing_the_number_of_workers_keeps_the_recorded_thresholds(tmp_path, client):
    import dask.dataframe as dd

    from dask_surge.testing import SleepyModel

    out = tmp_path / "o"
    _kill_midway(tmp_path, out, str(tmp_path / "calls"), stream=False, thresholds={}, seed=2, sleep=1.5)
    recorded = current_run(OutputStore.open(str(out))).plan
    assert recorded.mode == "planned" and current_run(OutputStore.open(str(out))).completion() is None
    ddf = dd.from_pandas(make_partitioned_frame(SIZES, seed=16).compute(scheduler="sync"), npartitions=40)
    kw = dict(model=SleepyModel(0.0), keep=["doc_id"], progress=False)
    # b_min="auto" gives each worker thread 4+ SuperBatches: 1 thread in the killed run, 2 now
    res = ddf.surge.encode("text", str(out), **kw)
    assert res.resumed and (res.b_min, res.b_max) == (recorded.b_min, recorded.b_max)
    fresh = ddf.surge.encode("text", str(tmp_path / "fresh"), **kw)
    assert fresh.b_min != recorded.b_min  # the same call on this cluster picks another b_min
    _same_rows(_sorted(out), _sorted(tmp_path / "fresh"))


def test_a_partition_sliced_k_ways_is_computed_once(tmp_path, client):
    log = str(tmp_path / "calls")
    ddf = make_partitioned_frame([5, 100, 3], seed=1)
    ddf = ddf.map_partitions(CallLog(log), meta=ddf._meta)
    res = ddf.surge.encode(
        "text", str(tmp_path / "o"), model=checksum_model, b_min=10, b_max=20, progress=False
    )
    assert res.rows == 108 and res.superbatches >= 6
    assert Counter(CallLog(log).calls()) == Counter({0: 1, 5: 1, 105: 1})


def test_a_parquet_partition_sliced_k_ways_is_read_once(tmp_path, parquet_reads):
    import dask.dataframe as dd

    from dask_surge.testing import write_partitioned_parquet

    write_partitioned_parquet(tmp_path / "in", [5, 100, 3], seed=1)
    reads = parquet_reads

    res = dd.read_parquet(tmp_path / "in").surge.encode(
        "text",
        str(tmp_path / "o"),
        model=checksum_model,
        b_min=10,
        b_max=20,
        scheduler="sync",
        progress=False,
    )
    assert res.sizes_source == "metadata" and res.superbatches >= 6
    assert reads == Counter({5: 1, 100: 1, 3: 1})  # every file read once, the sliced one too


def test_keep_on_parquet_still_plans_from_footers(tmp_path):
    import dask.dataframe as dd

    from dask_surge.testing import write_partitioned_parquet

    write_partitioned_parquet(tmp_path / "in", [5, 7, 3], seed=1)
    res = dd.read_parquet(tmp_path / "in").surge.encode(
        "text",
        str(tmp_path / "o"),
        model=checksum_model,
        keep=["doc_id"],
        b_min=6,
        b_max=20,
        scheduler="sync",
        progress=False,
    )
    assert res.sizes_source == "metadata"
    assert _sorted(tmp_path / "o").doc_id.tolist() == list(range(15))


@pytest.mark.parametrize("b_min,b_max", [(None, 5), (3, None), (None, None), (2, 9), ("auto", 7)])
def test_plan_and_encode_pick_the_same_thresholds(tmp_path, b_min, b_max):
    ddf = make_partitioned_frame([3, 3, 3, 3], seed=0)
    planned = dask_surge.plan(ddf, "text", b_min=b_min, b_max=b_max, scheduler="sync")
    res = ddf.surge.encode(
        "text",
        str(tmp_path / "o"),
        model=checksum_model,
        b_min=b_min,
        b_max=b_max,
        scheduler="sync",
        progress=False,
    )
    assert (res.b_min, res.b_max) == (planned.b_min, planned.b_max)
    assert res.superbatches == len(planned.superbatches)


def test_plan_shows_the_superbatches_a_streamed_encode_forms(tmp_path, client):
    ddf = _streamed(str(tmp_path / "calls"))
    for scheduler in ("sync", client):  # one thread: one unit; two workers: 8 units
        planned = dask_surge.plan(ddf, "text", b_min=60, b_max=200, scheduler=scheduler)
        res = ddf.surge.encode("text", str(tmp_path / str(id(scheduler))), scheduler=scheduler, **KW)
        assert res.superbatches == len(planned.superbatches)
        assert [
            r.rows
            for r in current_run(OutputStore.open(str(tmp_path / str(id(scheduler))))).committed().values()
        ] == [sb.rows for sb in planned.superbatches]


def test_input_errors_are_clear_on_a_distributed_client_and_commit_nothing(tmp_path, client, capsys):
    import dask.dataframe as dd
    import pandas as pd

    from dask_surge import SurgeInputError

    bad = {
        "null": (pd.DataFrame({"text": ["a", None, "c"] * 4}), "null"),
        "int": (pd.DataFrame({"text": [1, 2, 3] * 4}), "not a string|non-string|str"),
        "utf8": (pd.DataFrame({"text": [b"ok", b"\xff\xfe"] * 4}, dtype=object), "not valid UTF-8"),
        "surrogate": (
            pd.DataFrame({"text": ["ok", "half an emoji \ud83d"] * 4}, dtype=object),
            "lone surrogate",
        ),
    }
    for name, (df, match) in bad.items():
        out = tmp_path / name
        with pytest.raises(SurgeInputError, match=match):
            dd.from_pandas(df, npartitions=1).surge.encode(
                "text", str(out), model=checksum_model, progress=False
            )
        assert not list(out.glob("part-*.parquet"))
        assert not current_run(OutputStore.open(str(out))).committed()
    assert "started LocalCluster" not in capsys.readouterr().err


def test_models_of_one_shape_are_different_runs(tmp_path):
    from dask_surge import SurgeOutputError
    from dask_surge.testing import make_tiny_model

    one = make_tiny_model(tmp_path / "one", seed=1)
    two = make_tiny_model(tmp_path / "two", seed=2)  # same architecture and files, other weights
    ddf = make_partitioned_frame([4, 4], seed=0)
    out = str(tmp_path / "o")
    kw = dict(device="cpu", scheduler="sync", progress=False)
    ddf.surge.encode("text", out, model=one, **kw)
    with pytest.raises(SurgeOutputError, match="model"):
        ddf.surge.encode("text", out, model=two, **kw)
    assert ddf.surge.encode("text", out, model=one, **kw).resumed  # the same model is the same run
