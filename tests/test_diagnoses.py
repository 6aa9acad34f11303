"""Diagnoses that name what is seen (issue 67): a late-joining worker whose own disk holds a different
run at the output path is told so, not that its run "was replaced by another run ... nothing to do"."""

from __future__ import annotations

import dataclasses
import time

import pytest

import dask_surge
from dask_surge import SurgeOutputError
from dask_surge.execution.reach import task_sees_run
from dask_surge.io.manifest import open_run
from dask_surge.io.store import OutputStore
from dask_surge.testing import make_partitioned_frame

KW = {"b_min": 8, "b_max": 8, "scheduler": "sync", "progress": False}

DIFFERENT_DISK = (
    r"a worker on host .* sees a different run's output at .*: run [0-9a-f]+ \((complete|not complete)\), "
    r"not this run's directory .*Either the workers do not share the client's output directory.*or "
    r"another run holds it.*Nothing of this task was written\. Fix: mount the output at the same path on "
    r"every worker.*then rerun the same call to resume"
)


def _as_the_worker_sees_it(run, worker_out):
    """The client's run as a worker reads it: the same run, another disk at the output path."""
    return dataclasses.replace(run, store=OutputStore.open(str(worker_out)))


def test_a_worker_whose_disk_holds_an_earlier_complete_run_says_what_it_sees(tmp_path, counting_encoder):
    worker_out = tmp_path / "worker" / "out"  # the worker's local disk: an earlier run, complete
    earlier = dask_surge.encode(
        make_partitioned_frame([6, 6]), "text", str(worker_out), model=counting_encoder, **KW
    )
    time.sleep(0.05)
    run, _ = open_run(OutputStore.open(str(tmp_path / "client" / "out")), {"t": "the client's run"})
    with pytest.raises(SurgeOutputError, match=DIFFERENT_DISK) as err:
        task_sees_run(_as_the_worker_sees_it(run, worker_out))
    assert "was replaced by another run" not in str(err.value) and "nothing to do" not in str(err.value)
    assert earlier.run_id[:8] in str(err.value)


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_worker_whose_disk_holds_a_run_in_progress_says_what_it_sees(tmp_path, order):
    """A run that has not completed replaces nothing (its overwrite waits until it completes): another
    run in progress at the path is never taken for a replacement, whenever it started."""
    worker_out = tmp_path / "worker" / "out"
    if order == "before":
        open_run(OutputStore.open(str(worker_out)), {"t": "a run on the worker's disk"})
    run, _ = open_run(OutputStore.open(str(tmp_path / "client" / "out")), {"t": "the client's run"})
    if order == "after":
        open_run(OutputStore.open(str(worker_out)), {"t": "a run on the worker's disk"})
    with pytest.raises(SurgeOutputError, match=DIFFERENT_DISK) as err:
        task_sees_run(_as_the_worker_sees_it(run, worker_out))
    assert "not complete" in str(err.value) and "was replaced by another run" not in str(err.value)


def test_a_worker_whose_disk_holds_another_copy_of_this_run_says_so(tmp_path):
    """The same call run earlier on the worker's own disk: the run id matches, the run.json is another
    (created at another time). The task used to go on and commit where the client never reads."""
    worker_out = tmp_path / "worker" / "out"
    open_run(OutputStore.open(str(worker_out)), {"t": "the client's run"})  # earlier, on the worker's disk
    time.sleep(0.05)
    run, _ = open_run(OutputStore.open(str(tmp_path / "client" / "out")), {"t": "the client's run"})
    with pytest.raises(
        SurgeOutputError,
        match=rf"a worker on host .* sees another copy of run {run.run_id} at .*: its run\.json was created "
        r".* not when the client created it .*Either the workers do not share the client's output "
        r"directory.*Nothing of this task was written\. Fix: mount the output at the same path",
    ):
        task_sees_run(_as_the_worker_sees_it(run, worker_out))
    task_sees_run(run)  # the client's own copy: no error
