"""What encode() and plan() return: the run summary, its per-SuperBatch reports, the plan."""

from __future__ import annotations

import dataclasses
import time

import pytest

from dask_surge.planning.policy import plan_superbatches
from dask_surge.planning.sizes import PartitionSizes
from dask_surge.results import EncodeResult, SuperBatchReport, SurgePlan
from dask_surge.testing import checksum_model, make_partitioned_frame


def _report(**changes) -> SuperBatchReport:
    base = SuperBatchReport(
        sb="000000000-000000000000",
        rows=10,
        skipped=1,
        file="part-x.parquet",
        bytes=123,
        spans=((0, 0, 11, 11),),
        started_at=100.0,
        encode_s=0.5,
        write_s=0.25,
        committed=True,
        committed_at=101.0,
        engine="callable",
    )
    return dataclasses.replace(base, **changes)


def _result(records=(), **changes) -> EncodeResult:
    base = EncodeResult(
        output="o",
        run_id="r",
        rows=20,
        partitions=2,
        superbatches=2,
        skipped_superbatches=0,
        seconds=2.0,
        ttfo_s=0.5,
        sizes_source="metadata",
        resumed=False,
        b_min=5,
        b_max=10,
        thresholds_reason="given",
        records=tuple(records),
    )
    return dataclasses.replace(base, **changes)


def test_a_report_is_frozen_and_reads_as_its_fields():
    report = _report()
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.rows = 3  # type: ignore[misc]
    assert report.as_dict()["spans"] == ((0, 0, 11, 11),) and len(report.as_dict()) == 23
    assert report["rows"] == report.rows == 10 and report["committed"] is True
    with pytest.raises(KeyError):
        report["as_dict"]


def test_commit_times_move_onto_the_clients_clock_by_the_task_end():
    report = _report()
    assert report.on_client_clock(time.time()) is report  # no task end: left as it is
    ended = report.with_task_end(95.0)  # a worker 5 s behind the client's clock
    assert ended.task_end == 95.0 and ended.on_client_clock(100.0).committed_at == pytest.approx(106.0)


def test_texts_per_s_counts_the_rows_encoded_in_this_call_only():
    result = _result(
        [_report(rows=10), _report(rows=30, sb="000000001-000000000000")], skipped_superbatches=1
    )
    assert result.texts_per_s == 20.0
    assert _result().texts_per_s == 0.0 and _result(seconds=0.0).texts_per_s == 0.0
    summary = result.as_dict()
    assert "records" not in summary and summary["texts_per_s"] == 20.0 and summary["rows"] == 20
    assert "records" not in repr(result)


def test_the_summary_text_names_nulls_and_the_engine():
    text = str(_result(nulls_skipped=3, engine="fast"))
    assert "engine: fast" in text and "3 null texts left out" in text and "skipped_rows('o')" in text
    assert "n/a" in str(_result(ttfo_s=None)) and "null" not in str(_result())


def test_a_written_run_reports_each_superbatch_it_wrote(tmp_path):
    sizes = [4, 9, 2, 6]
    ddf = make_partitioned_frame(sizes, seed=1)
    out = tmp_path / "o"
    res = ddf.surge.encode(
        "text", str(out), model=checksum_model, b_min=5, b_max=8, scheduler="sync", progress=False
    )
    plan = plan_superbatches(sizes, 5, 8)
    assert len(res.records) == res.superbatches == len(plan) and res.engine == "callable"
    assert all(
        isinstance(r, SuperBatchReport) and r.committed and r.task_end is not None for r in res.records
    )
    assert {r.file for r in res.records} == {p.name for p in out.glob("part-*.parquet")}
    rows = sorted((p, i) for r in res.records for p, a, b, _ in r.spans for i in range(a, b))
    assert rows == [(p, i) for p, n in enumerate(sizes) for i in range(n)]
    assert sum(r.rows for r in res.records) == res.rows == sum(sizes)
    again = ddf.surge.encode(
        "text", str(out), model=checksum_model, b_min=5, b_max=8, scheduler="sync", progress=False
    )
    assert again.records == () and again.resumed and again.skipped_superbatches == len(plan)


def test_a_plan_summarizes_its_superbatches():
    sizes = PartitionSizes((3, 4, 20, 1), "metadata", nbytes=(30, 40, 200, 10))
    superbatches = plan_superbatches(sizes.sizes, 5, 8)
    plan = SurgePlan(sizes, superbatches, 5, 8, max_bytes=None)
    summary = plan.summary()
    assert summary["rows"] == plan.rows == 28 and summary["superbatches"] == len(superbatches)
    assert summary["largest_superbatch"] == max(sb.rows for sb in superbatches)
    assert summary["largest_superbatch_bytes"] == 80  # 8 rows of the 20-row partition: 8/20 of its 200 bytes
    assert "28 rows in 4 partitions" in repr(plan) and str(plan) == repr(plan)  # no predictions: one line
    with pytest.raises(Exception, match="no cost-model parameters"):
        plan.sweep()


def test_the_summary_reads_as_plain_words():
    """The thresholds' reason once ended "...95,077,948 bytes).); engine: fast": a sentence inside
    brackets with its own full stop, and the engine glued to it."""
    text = str(
        _result(
            [_report()],
            thresholds_reason="b_min=5 keeps a worker under the budget (a, 9 bytes).",
            engine="fast",
        )
    )
    assert "b_min=5, b_max=10: b_min=5 keeps a worker under the budget (a, 9 bytes).\nengine: fast" in text
    assert ".)" not in text and ".." not in text


def test_a_rerun_of_a_complete_run_says_there_is_nothing_to_do():
    """It said "0 texts/s, first output after n/a"."""
    done = _result(resumed=True, skipped_superbatches=2, ttfo_s=None, seconds=0.4)
    assert done.nothing_to_do
    assert str(done) == "complete: 20 rows in 2 SuperBatches already in o, nothing to do (checked in 0.4 s)"
    assert "texts/s" not in str(done) and "n/a" not in str(done)
    assert not _result([_report()], resumed=True, skipped_superbatches=1).nothing_to_do
