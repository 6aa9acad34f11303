"""The worker profiler is paused while SuperBatch tasks run, and resumed after (execution/profiler.py)."""

from __future__ import annotations

import time

import dask
import pandas as pd
import pytest

from dask_surge.execution.profiler import profiler_paused


def _profiling(dask_worker) -> bool:
    return dask_worker.periodic_callbacks["profile"].is_running()


def _wait_for(predicate, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _task(enabled, hold_s: float = 0.0):
    """In a worker task: enter profiler_paused and report what the profiler did meanwhile."""
    from distributed import get_worker

    worker = get_worker()
    with profiler_paused(enabled) as held:
        stopped = _wait_for(lambda: not _profiling(worker), timeout=5.0 if held else 0.5)
        time.sleep(hold_s)
    return held, stopped


def _set_profiling(on: bool, dask_worker=None) -> None:
    callback = dask_worker.periodic_callbacks["profile"]
    callback.start() if on else callback.stop()


def _all_profiling(client) -> bool:
    return _wait_for(lambda: all(client.run(_profiling).values()))


def test_a_task_pauses_the_profiler_and_the_last_one_resumes_it(client):
    assert _all_profiling(client)
    held, stopped = client.submit(_task, True, pure=False).result()
    assert (held, stopped) == (True, True)
    assert _all_profiling(client)  # started again once the task left

    # overlapping holders on one worker (as tasks on a worker's threads): paused until the last leaves
    assert client.submit(_overlapping, pure=False).result() == (True, True, False)
    assert _all_profiling(client)


def _overlapping():
    """In a worker task: two holders overlap; the profiler stays paused when the first leaves and
    runs again once the second has."""
    from distributed import get_worker

    worker = get_worker()
    first, second = profiler_paused(True), profiler_paused(True)
    first.__enter__()
    second.__enter__()
    paused = _wait_for(lambda: not _profiling(worker), timeout=5.0)
    first.__exit__(None, None, None)
    time.sleep(0.3)  # a resume, had it been scheduled, would have run on the event loop by now
    still_paused = not _profiling(worker)
    second.__exit__(None, None, None)
    resumed = _wait_for(lambda: _profiling(worker), timeout=5.0)
    return paused, still_paused, not resumed


def test_disabled_or_user_stopped_profilers_are_left_alone(client):
    held, stopped = client.submit(_task, False, pure=False).result()
    assert (held, stopped) == (False, False)  # surge.tuning.pause-profiler: false

    client.run(_set_profiling, False)  # the user stopped it: it must stay stopped after our task
    try:
        assert client.submit(_task, True, pure=False).result() == (True, True)
        time.sleep(0.3)
        assert not any(client.run(_profiling).values())
    finally:
        client.run(_set_profiling, True)


def test_outside_a_worker_nothing_is_paused(monkeypatch):
    with profiler_paused(True) as held:
        assert held is False
    import dask_surge.execution.profiler as module

    def no_worker_lookup():
        raise AssertionError("the config said no: the worker must not be looked up")

    monkeypatch.setattr(module, "current_worker", no_worker_lookup)
    with dask.config.set({"surge.tuning.pause-profiler": False}), profiler_paused() as held:
        assert held is False


@pytest.mark.usefixtures("one_torch_thread")
def test_an_encode_leaves_every_profiler_running(client, tiny_model, tmp_path):
    import dask.dataframe as dd

    ddf = dd.from_pandas(pd.DataFrame({"text": [f"text {i}" for i in range(60)]}), npartitions=3)
    result = ddf.surge.encode(
        "text", output=str(tmp_path / "out"), model=str(tiny_model), device="cpu", progress=False
    )
    assert result.rows == 60
    assert _all_profiling(client)
