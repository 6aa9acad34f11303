"""EncodeResult.plot and SurgePlan.plot_advice draw headless, from the run's own numbers."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")  # headless, in the test only: the package chooses no backend

import matplotlib.pyplot as plt  # noqa: E402

from dask_surge.errors import SurgeValueError  # noqa: E402
from dask_surge.planning.costmodel import CostParams  # noqa: E402
from dask_surge.testing import make_partitioned_frame  # noqa: E402


def _model(texts):
    return np.ones((len(texts), 4), dtype="float32")


@pytest.fixture
def frame():
    return make_partitioned_frame([30, 5, 200, 12, 80, 1, 40, 300, 7, 25])


def _axes(fig):
    return {ax.get_title(): ax for ax in fig.axes}


def _check_run_figure(result):
    fig = result.plot()
    try:
        axes = _axes(fig)
        rows_ax = axes["Rows committed over time"]
        x, y = rows_ax.get_lines()[0].get_data()
        assert y[-1] == result.rows and x[0] == 0
        assert np.all(np.diff(y) >= 0)
        labels = [t.get_text() for t in rows_ax.get_legend().get_texts()]
        if result.ttfo_s is not None:
            assert f"first output {result.ttfo_s:.2f} s" in labels
        lanes = next(ax for title, ax in axes.items() if title.startswith("SuperBatches in flight"))
        assert len(lanes.patches) == 2 * len(result.records)  # encode + write bar per SuperBatch
        rate = axes["Throughput over the run"]
        assert any(t.get_text().startswith("mean ") for t in rate.get_legend().get_texts())
        sizes = axes["SuperBatch sizes against b_min / b_max"]
        assert sorted(p.get_height() for p in sizes.patches) == sorted(
            r.rows + r.skipped for r in result.records
        )
        hlines = {line.get_label() for line in sizes.get_lines()}
        assert f"b_min {result.b_min:,}" in hlines and f"b_max {result.b_max:,}" in hlines
    finally:
        plt.close(fig)
    tl = result.timeline()
    assert tl["rows_committed"].iloc[-1] == result.rows
    assert (tl["start_s"] >= 0).all() and (tl["commit_s"] >= tl["start_s"]).all()


def test_planned_run_plot(frame, tmp_path):
    result = frame.surge.encode(
        "text", str(tmp_path / "emb"), model=_model, b_min=100, b_max=400, progress=False, scheduler="sync"
    )
    assert result.records and result.ttfo_s is not None
    _check_run_figure(result)


def test_streamed_run_plot(frame, tmp_path):
    # a map_partitions step: Dask does not know the partition sizes, so encode() streams
    ddf = frame.map_partitions(lambda df: df, meta=frame._meta)
    result = ddf.surge.encode(
        "text", str(tmp_path / "emb"), model=_model, b_min=50, b_max=200, progress=False, scheduler="sync"
    )
    assert result.sizes_source == "streamed" and result.rows == 700
    _check_run_figure(result)


def test_resumed_run_starts_at_what_was_committed(frame, tmp_path):
    out = str(tmp_path / "emb")
    kw = {"model": _model, "b_min": 100, "b_max": 400, "progress": False, "scheduler": "sync"}
    first = frame.surge.encode("text", out, **kw)
    records = sorted((tmp_path / "emb").glob("_surge/runs/*/commits/*.json"))
    records[-1].unlink()
    again = frame.surge.encode("text", out, **kw)
    assert len(again.records) == 1 and again.rows == first.rows
    tl = again.timeline()
    redone = again.records[0].rows + again.records[0].skipped
    assert tl["rows_committed"].tolist() == [first.rows]
    fig = again.plot()
    y = _axes(fig)["Rows committed over time"].get_lines()[0].get_ydata()
    assert y[0] == first.rows - redone and y[-1] == first.rows
    plt.close(fig)


def test_nothing_encoded_says_so(frame, tmp_path):
    out = str(tmp_path / "emb")
    kw = {"model": _model, "b_min": 100, "b_max": 400, "progress": False, "scheduler": "sync"}
    frame.surge.encode("text", out, **kw)
    again = frame.surge.encode("text", out, **kw)
    assert again.records == () and again.timeline().empty
    fig = again.plot()
    assert fig.axes[0].get_title() == "Nothing was encoded in this call"
    assert "already committed" in fig.axes[0].texts[0].get_text()
    plt.close(fig)


def _params():
    return CostParams(alpha_s=0.01, per_text_s=1e-4, per_token_s=0.0, b0=16, workers=2)


def test_plot_advice_marks_this_workload(frame):
    plan = frame.surge.plan("text", b_min=100, b_max=400, params=_params())
    fig = plan.plot_advice()
    try:
        ax = fig.axes[0]
        assert ax.get_title().startswith("Where this workload sits")
        assert "phi" in ax.get_xlabel() and "CV" in ax.get_ylabel() and ax.get_xscale() == "log"
        star = next(line for line in ax.get_lines() if line.get_label().startswith("this workload"))
        assert star.get_xdata()[0] == pytest.approx(plan.advice.phi)
        assert star.get_ydata()[0] == pytest.approx(plan.advice.cv)
        assert f"{plan.advice.predicted_speedup:.2f}x" in star.get_label()
        assert len(fig.axes) == 2  # the map and its colour bar
    finally:
        plt.close(fig)


def test_plot_advice_needs_params(frame):
    with pytest.raises(SurgeValueError, match="calibrate=True"):
        frame.surge.plan("text", b_min=100).plot_advice()


def test_advice_grid_shows_the_gain_growing_with_phi():
    from dask_surge.plots import advice_grid

    grid = advice_grid(_params(), 100, 500, 2000, phis=[0.01, 0.5], cvs=[0.0, 1.0])
    assert (grid[:, 1] > grid[:, 0]).all() and (grid[:, 1] > 1.05).all()


def test_plots_import_matplotlib_only_when_called():
    code = "import sys, dask_surge.results, dask_surge.plots; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _slot_reports():
    """Two task slots, each encoding two SuperBatches back to back while the writer thread writes
    and commits the previous one beside the next encode."""
    from dask_surge.results import SuperBatchReport

    def report(sb, start, encode, write):
        return SuperBatchReport(
            sb=sb,
            rows=100,
            skipped=0,
            file=f"part-{sb}.parquet",
            bytes=1,
            spans=(),
            started_at=start,
            encode_s=encode,
            write_s=write,
            committed=True,
            committed_at=start + encode + write,
            engine="fast",
        )

    return [
        report("a1", 100.0, 1.0, 1.0),
        report("a2", 101.0, 1.0, 1.0),
        report("b1", 100.0, 1.5, 0.5),
        report("b2", 101.5, 1.0, 1.0),
    ]


def test_lanes_are_task_slots():
    """3 lanes were drawn for 2 task slots: a SuperBatch's write + commit (on the writer thread,
    beside the next encode) was counted as holding its slot."""
    from dask_surge.plots import run_timeline

    df = run_timeline(_slot_reports(), ttfo_s=2.0)
    assert sorted(set(df["lane"])) == [0, 1]


def test_throughput_is_a_rolling_rate_that_does_not_drop_between_commits():
    """The rate was a histogram of commits: 0 in every bin without one, which read as stalls."""
    from dask_surge.plots import rolling_rate

    commits = np.arange(1.0, 21.0)  # a commit of 50 rows every second
    grid, rate, window = rolling_rate(commits, np.full(20, 50), 20.0)
    steady = rate[(grid > commits[0] + window) & (grid <= commits[-1])]
    assert steady.size and np.allclose(steady, 50.0)
    assert (rate[grid < commits[0]] == 0).all()  # nothing readable before the first commit


def test_lanes_follow_when_each_encode_started():
    """A SuperBatch that waits between its encode and its write (for the one before it to commit)
    was placed by ``commit - write - encode``: too late, over the next encode of its own slot."""
    from dask_surge.plots import run_timeline
    from dask_surge.results import SuperBatchReport

    def report(sb, start, encode, commit):
        return SuperBatchReport(
            sb=sb,
            rows=100,
            skipped=0,
            file=f"part-{sb}.parquet",
            bytes=1,
            spans=(),
            started_at=start,
            encode_s=encode,
            write_s=0.5,
            committed=True,
            committed_at=commit,
            engine="fast",
        )

    slot_a = [
        report("a1", 100.0, 1.0, 103.5),
        report("a2", 101.0, 1.0, 104.0),
        report("a3", 102.0, 1.0, 104.5),
    ]
    slot_b = [report("b1", 100.0, 5.0, 105.5)]
    df = run_timeline(slot_a + slot_b, ttfo_s=3.5)
    assert sorted(set(df["lane"])) == [0, 1]
    assert df.set_index("sb").loc["a2", "start_s"] == pytest.approx(1.0)


def test_a_late_heard_task_keeps_its_place():
    """Each report moved onto the client's clock by when the client heard of its task's end: one
    heard a second late drew its encode over the next ones (a third lane for two slots)."""
    from dask_surge.plots import run_timeline
    from dask_surge.results import SuperBatchReport

    def report(sb, start, encode, heard_late):
        worker = SuperBatchReport(
            sb=sb,
            rows=100,
            skipped=0,
            file="f",
            bytes=1,
            spans=(),
            started_at=start,
            encode_s=encode,
            write_s=0.1,
            committed=True,
            committed_at=start + encode + 0.1,
            engine="fast",
            task_end=start + encode + 0.1,
        )
        return worker.on_client_clock(start + encode + 0.1 + 0.01 + heard_late)

    records = [
        report("a1", 100.0, 1.0, 0.0),
        report("a2", 101.1, 1.0, 1.5),
        report("a3", 102.2, 1.0, 0.0),
        report("b1", 100.0, 3.3, 0.0),
    ]
    df = run_timeline(records, ttfo_s=1.11)
    assert sorted(set(df["lane"])) == [0, 1]
    assert df.set_index("sb").loc["a2", "start_s"] == pytest.approx(1.11)  # its place, +0.01 s of transfer
