"""The progress bar of a written run (issue 26): tqdm over rows, phases named, per SuperBatch."""

from __future__ import annotations

import io
import logging
import re
import sys
import time

import dask.dataframe as dd
import pandas as pd
import pytest

import dask_surge
from dask_surge.execution import events
from dask_surge.execution.progress import RunProgress, logging_through
from dask_surge.io.manifest import current_run
from dask_surge.testing import CountingEncoder, InterruptAfter, make_partitioned_frame
from dask_surge.io.store import OutputStore


@pytest.fixture
def every_update(monkeypatch):
    """tqdm draws every update (no time-based throttling: the tests must not depend on timing), as wide
    as a buffer that is not a terminal (120 columns), whatever ``COLUMNS`` the runner sets (pytest-xdist's
    workers: 80, a narrow bar without the SuperBatch count)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    monkeypatch.setenv("TQDM_MINITERS", "1")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


def _states(err: str) -> list[str]:
    """Every state tqdm drew (it rewrites its line with carriage returns)."""
    return [s.strip() for s in re.split(r"[\r\n]", err) if s.strip().startswith("dask-surge [")]


def _counts(states: list[str]) -> list[int]:
    """The rows shown by each state, in order."""
    out = []
    for s in states:
        m = re.search(r"\]: (?:\s*\d+%\|[^|]*\| )?(\d+)(?:/\d+)? rows", s)
        if m:
            out.append(int(m.group(1)))
    return out


def _phases(states: list[str]) -> list[str]:
    return list(dict.fromkeys(s[len("dask-surge [") : s.index("]")] for s in states))


def test_planned_run_bar_names_phases_and_reaches_the_total(tmp_path, capsys, every_update):
    frame = pd.DataFrame({"text": [f"text {i}" for i in range(30)]})
    ddf = dd.from_pandas(frame, npartitions=5)  # in memory: sizes known, the run is planned
    res = dask_surge.encode(
        ddf, "text", str(tmp_path / "o"), b_min=6, b_max=12, scheduler="sync", model=CountingEncoder()
    )
    states = _states(capsys.readouterr().err)
    assert res.sizes_source != "streamed"
    phases = _phases(states)
    assert phases[0] == "planning" and "encoding" in phases and phases[-1] == "done"
    assert states[-1].startswith("dask-surge [done]: 100%") and "30/30 rows" in states[-1]
    assert f"{res.superbatches}/{res.superbatches} SuperBatches" in states[-1]
    # the total is known as soon as planning ends: every state after it shows it
    assert all("/30 rows" in s for s in states if not s.startswith("dask-surge [planning]"))
    counts = _counts(states)
    assert counts == sorted(counts) and counts[-1] == 30
    assert len({c for c in counts if 0 < c < 30}) >= res.superbatches - 1  # one step per SuperBatch


def test_streamed_unit_reports_each_superbatch_as_it_commits(tmp_path, capsys, every_update):
    sizes = [5, 7, 3, 9, 4, 6]
    ddf = make_partitioned_frame(sizes)  # sizes unknown ahead: the run streams
    out = str(tmp_path / "o")
    res = dask_surge.encode(ddf, "text", out, b_min=6, b_max=8, scheduler="sync", model=CountingEncoder())
    plan = current_run(OutputStore.open(out)).plan
    assert plan.mode == "streaming" and plan.unit_partitions == len(sizes)  # all of it is one unit
    assert res.superbatches >= 4
    states = _states(capsys.readouterr().err)
    # the total is not known while it streams: no percentage, no "/total" until the end
    assert not any("%" in s or "/34 rows" in s for s in states if not s.startswith("dask-surge [done]"))
    assert "34/34 rows" in states[-1]
    # one unit, yet the bar moved at each of its SuperBatches, not once when the unit ended
    cumulative, total = [], 0
    for record in res.records:
        total += record.rows + record.skipped
        cumulative.append(total)
    counts = _counts(states)
    assert set(cumulative) <= set(counts)
    assert len({c for c in counts if 0 < c < sum(sizes)}) == res.superbatches - 1


def test_resumed_run_bar_starts_at_the_committed_rows(tmp_path, capsys, every_update):
    ddf = make_partitioned_frame([4] * 6)
    out = str(tmp_path / "o")
    kw = {"b_min": 8, "b_max": 8, "scheduler": "sync"}
    model = InterruptAfter(3)
    with pytest.raises(KeyboardInterrupt):
        dask_surge.encode(ddf, "text", out, model=model, **kw)
    first = _states(capsys.readouterr().err)
    assert first[-1].startswith("dask-surge [stopped]") and " 16 rows" in first[-1]
    res = dask_surge.encode(ddf, "text", out, model=model, **kw)
    assert res.skipped_superbatches == 2
    states = _states(capsys.readouterr().err)
    counts = [c for s, c in zip(states, _counts(states)) if not s.startswith("dask-surge [planning]")]
    assert counts[0] == 16  # what the first run committed, before this one encodes anything
    assert counts[-1] == 24 and "24/24 rows" in states[-1] and "3/3 SuperBatches" in states[-1]
    assert min(counts) == 16


def test_no_progress_shows_nothing(tmp_path, capsys, monkeypatch):
    ddf = make_partitioned_frame([3, 4])
    dask_surge.encode(
        ddf,
        "text",
        str(tmp_path / "a"),
        b_min=4,
        b_max=8,
        scheduler="sync",
        model=CountingEncoder(),
        progress=False,
    )
    assert "dask-surge" not in capsys.readouterr().err
    monkeypatch.setenv("TQDM_DISABLE", "1")
    dask_surge.encode(
        ddf, "text", str(tmp_path / "b"), b_min=4, b_max=8, scheduler="sync", model=CountingEncoder()
    )
    assert "dask-surge" not in capsys.readouterr().err


def test_log_messages_go_above_the_bar(capsys, every_update, monkeypatch):
    package = logging.getLogger("dask_surge")
    handler = logging.StreamHandler(sys.stderr)
    monkeypatch.setattr(package, "handlers", [handler])  # only ours (the CLI's, from other tests, aside)
    with RunProgress() as bar, logging_through(bar):
        assert handler not in package.handlers  # swapped for one that writes through tqdm
        logging.getLogger("dask_surge.x").warning("a warning in the middle")
        bar.commit("0-0", 3)
    assert handler in package.handlers  # given back
    err = capsys.readouterr().err
    assert "a warning in the middle\n" in err
    # the message is a line of its own: no bar text before it on its line
    assert [line for line in re.split(r"[\r\n]", err) if "a warning" in line] == ["a warning in the middle"]


def test_bar_counts_a_superbatch_once_and_learns_a_streamed_total_at_the_end(every_update):
    buf = io.StringIO()
    with RunProgress(file=buf) as bar:
        bar.planned(rows=None, superbatches=None)
        bar.commit("0-0", 4)
        bar.commit("0-0", 4)  # the worker's announcement, then the unit's report
        bar.commit("2-0", 5)
        assert bar.rows == 9 and bar.superbatches == 2
        bar.finish(9, 2)
    last = _states(buf.getvalue())[-1]
    assert last.startswith("dask-surge [done]: 100%") and "9/9 rows" in last and "2/2 SuperBatches" in last


def test_model_phase_follows_the_workers(every_update):
    buf = io.StringIO()
    answers = iter([(0, 0), (0, 2), (1, 2), (2, 2)])
    with RunProgress(file=buf) as bar:
        bar.follow_model(lambda: next(answers), workers=True)  # the ticker asks at once, not this thread
        deadline = time.monotonic() + 10
        while bar.phase_name != "waiting for workers" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bar.phase_name == "waiting for workers"
        bar._stop.set()  # the rest of the answers, one per explicit check
        bar._wake.set()
        bar._ticker.join(5)
        bar._check_model()
        assert bar.phase_name == "loading model 0/2 workers"
        bar._check_model()
        bar.commit("0-0", 3)  # one worker encodes while the other still loads
        assert bar.phase_name == "encoding, model on 1/2 workers"
        bar._check_model()
        assert bar.phase_name == "encoding"


def test_a_disabled_bar_never_asks_whether_the_model_is_loaded():
    def ask():
        raise AssertionError("a disabled bar asked the workers")

    with RunProgress(enabled=False) as bar:
        bar.follow_model(ask, workers=True)
        bar.commit("0-0", 3)
        time.sleep(0.05)
        assert bar._ready is None and bar.phase_name == "encoding"


def test_distributed_run_bar_hears_commits_from_workers(client, tmp_path, capsys, every_update):
    sizes = [20, 30, 10, 25, 15, 30]
    ddf = make_partitioned_frame(sizes)
    res = dask_surge.encode(
        ddf, "text", str(tmp_path / "o"), b_min=15, b_max=20, scheduler=client, model=CountingEncoder()
    )
    states = _states(capsys.readouterr().err)
    phases = _phases(states)
    assert phases[0] == "planning" and phases[-1] == "done"
    assert any(p.startswith(("loading model", "encoding")) for p in phases)
    assert f"{sum(sizes)}/{sum(sizes)} rows" in states[-1]
    assert f"{res.superbatches}/{res.superbatches} SuperBatches" in states[-1]
    counts = _counts(states)
    assert counts == sorted(counts) and counts[-1] == sum(sizes)


def test_a_worker_announces_a_commit_to_the_client(client):
    import time

    heard: list[tuple[str, int]] = []
    with events.listen("run-x", lambda sb, rows, file: heard.append((sb, rows)), client):
        # subscribing is asynchronous: announce until the scheduler forwards one (deadline, not timing)
        deadline = time.monotonic() + 30
        while not heard and time.monotonic() < deadline:
            client.submit(events.announce, "run-x", "3-0", 7, pure=False).result()
            time.sleep(0.2)
    assert heard and heard[0] == ("3-0", 7)
    events.announce("run-x", "4-0", 1)  # nobody listens any more: nothing happens
    assert ("4-0", 1) not in heard


def test_the_bar_opens_before_encode_starts_its_own_cluster(tmp_path, capsys, every_update, monkeypatch):
    """With no Client, encode() starts a local cluster (workers importing torch: the first thing a
    user waits for); the bar is already there, naming that phase, and goes on through the run."""
    import contextlib

    from distributed import LocalCluster

    from dask_surge import api

    @contextlib.contextmanager
    def small_cluster(**kwargs):  # in process, so the test does not pay for two worker processes
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as c:
            yield c

    monkeypatch.setattr(api, "local_cluster", small_cluster)
    monkeypatch.setattr(api, "_active_client", lambda: None)
    monkeypatch.setattr(api, "runs_in_process", lambda frame, column: None)  # this test is about a cluster
    ddf = make_partitioned_frame([4] * 4)
    res = dask_surge.encode(ddf, "text", str(tmp_path / "o"), b_min=8, b_max=8, model=CountingEncoder())
    states = _states(capsys.readouterr().err)
    phases = [re.match(r"dask-surge \[([^\]]+)\]", s).group(1) for s in states]
    assert phases[0] == "starting workers"
    assert phases.index("starting workers") < phases.index("planning") < len(phases) - 1
    assert phases[-1] == "done" and res.rows == 16 and f"{res.rows}/{res.rows}" in states[-1]


def test_the_bar_is_readable_at_80_columns(monkeypatch):
    """At 80 columns the bar shrank to one character and its end was cut: the line (phase, rows,
    rate, SuperBatches) was 100-114 characters before the bar. A narrow terminal now gets a
    shorter line that leaves the bar room and keeps its end."""
    import io
    import re

    from dask_surge.execution.progress import RunProgress

    monkeypatch.setenv("TQDM_NCOLS", "80")
    buf = io.StringIO()
    with RunProgress(file=buf, phase="starting workers") as bar:
        bar.planned(rows=200_000, superbatches=20)
        bar.phase("loading model 1/2 workers")
        bar.phase("encoding, model on 1/2 workers")
        bar.commit("a", 3000)
        bar.finish(200_000, 20)
    lines = [line.rstrip() for line in buf.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    for line in lines:
        bar_width = len(m.group(1)) if (m := re.search(r"\|(.*)\|", line)) else 80
        assert len(line) - bar_width + 10 <= 80, line  # the line with a bar of 10 fits: tqdm widens it to 80
        assert line.endswith("]"), line
    assert any("[loading model 1/2]" in line for line in lines)
    assert lines[-1].startswith("dask-surge [done]: 100%") and "200000/200000 rows" in lines[-1]


def test_dask_shutdown_noise_is_quiet_during_a_run_only():
    """ "Worker process still alive after 4.0 seconds, killing" followed every successful run on a
    local cluster (its workers busy importing torch at close), and heartbeat CommClosedError and
    CancelledError records came with Ctrl-C. During a run they are left out; a real failure is
    still shown, and outside a run nothing is filtered."""
    import io
    import logging

    from distributed.comm.core import CommClosedError

    from dask_surge.execution.progress import RunProgress

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    distributed_log = logging.getLogger("distributed")
    distributed_log.addHandler(handler)
    nanny, worker = logging.getLogger("distributed.nanny"), logging.getLogger("distributed.worker")

    def noise() -> None:
        nanny.warning("Worker process still alive after 4.0 seconds, killing")
        try:
            raise CommClosedError("in <TCP (closed) ConnectionPool.heartbeat_worker>")
        except CommClosedError:
            worker.exception("Failed to communicate with scheduler during heartbeat.")
        nanny.warning("Worker process 4242 was killed by signal 9")  # a real failure

    try:
        with RunProgress(enabled=False):
            noise()
        during = out.getvalue()
        out.seek(0)
        out.truncate()
        noise()
        after = out.getvalue()
    finally:
        distributed_log.removeHandler(handler)
    assert during == "Worker process 4242 was killed by signal 9\n", during
    assert "still alive" in after and "during heartbeat" in after and "killed by signal 9" in after


def test_workers_of_a_cluster_surge_starts_filter_their_shutdown_noise():
    """A worker's heartbeat CommClosedError after the scheduler left is logged in the worker process,
    out of the client's reach: the clusters dask-surge starts carry the filter into their workers."""
    from distributed import Client

    from dask_surge.execution.cluster import local_cluster

    def filtered() -> bool:
        import logging

        from dask_surge.execution.progress import ShutdownNoise

        return any(isinstance(f, ShutdownNoise) for f in logging.getLogger("distributed.worker").filters)

    with local_cluster(n_workers=1, threads_per_worker=1) as cluster, Client(cluster) as client:
        assert list(client.run(filtered).values()) == [True]
