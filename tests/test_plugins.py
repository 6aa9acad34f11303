"""The worker plugin: a blocking preload, and a background one that lets the client plan meanwhile."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import types

import numpy as np
import pytest

from dask_surge import Encoder

from dask_surge.models import encoders
from dask_surge.errors import SurgeModelError
from dask_surge.execution.plugins import EncoderPlugin

WORKER = types.SimpleNamespace(address="tcp://test-worker")


def _preload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "surge-preload"]


def test_background_preload_returns_before_the_model_is_loaded(monkeypatch):
    release, started = threading.Event(), threading.Event()
    real = encoders._load

    def slow_load(spec):
        started.set()
        assert release.wait(30)
        return real(spec)

    monkeypatch.setattr(encoders, "_load", slow_load)
    enc = Encoder(lambda texts: np.ones((len(texts), 3)))
    asyncio.run(EncoderPlugin(enc, background=True).setup(WORKER))
    assert started.wait(30)
    assert not enc.is_loaded  # setup returned while the load still runs
    release.set()
    for t in _preload_threads():
        t.join(30)
    assert enc.is_loaded
    assert enc.encode(["a", "b"]).shape == (2, 3)


def test_blocking_preload_loads_before_returning():
    enc = Encoder(lambda texts: np.ones((len(texts), 2)))
    asyncio.run(EncoderPlugin(enc).setup(WORKER))
    assert enc.is_loaded


def test_a_failed_background_preload_warns_and_the_first_use_raises(tiny_model, tmp_path, caplog):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    enc = Encoder(str(broken), device="cpu")  # resolved on the client: the weights are not read
    for weights in broken.rglob("*.safetensors"):
        weights.unlink()
    with caplog.at_level(logging.WARNING, logger="dask_surge.execution.plugins"):
        asyncio.run(EncoderPlugin(enc, background=True).setup(WORKER))
        for t in _preload_threads():
            t.join(60)
    assert "preloading" in caplog.text and "loads it again" in caplog.text
    assert not enc.is_loaded
    with pytest.raises(SurgeModelError, match="could not be loaded"):  # the first use reports it
        enc.encode(["a"])
    with pytest.raises(SurgeModelError, match="could not be loaded"):  # a blocking preload raises in setup
        asyncio.run(EncoderPlugin(enc).setup(WORKER))


# -- issue 27 item 2: thread pools set explicitly in a real worker; teardown releases the model ---------
def test_worker_threads_are_set_and_teardown_releases_the_model(tiny_model):
    import os
    import time

    import pyarrow as pa
    from distributed import Client, LocalCluster

    from dask_surge.execution.plugins import register_encoder

    def facts():
        from dask_surge.models import encoders as enc

        return {"omp": os.environ.get("OMP_NUM_THREADS"), "tok": os.environ.get("TOKENIZERS_PARALLELISM"),
                "arrow": pa.cpu_count(), "io": pa.io_thread_count(), "loaded": len(enc._LOADED),
                "affinity": len(os.sched_getaffinity(0))}

    encoder = Encoder(tiny_model, device="cpu")
    name = EncoderPlugin(encoder).name
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        register_encoder(client, encoder)
        (got,) = client.run(facts).values()
        assert got["omp"] == "1"  # the nanny's setting, which Arrow would read as one thread
        assert got["tok"] == "true" and got["arrow"] == got["affinity"] and got["io"] >= 8
        assert got["loaded"] == 1
        register_encoder(client, encoder)  # every encode registers again: the model stays loaded
        assert next(iter(client.run(facts).values()))["loaded"] == 1
        client.unregister_worker_plugin(name)
        for _ in range(100):  # the release runs one event-loop turn after the teardown
            if next(iter(client.run(facts).values()))["loaded"] == 0:
                break
            time.sleep(0.1)
        assert next(iter(client.run(facts).values()))["loaded"] == 0


def test_release_encoder_closes_the_engine(tiny_model):
    from dask_surge.execution.plugins import release_encoder

    encoder = Encoder(tiny_model, device="cpu").load()
    engine = encoder.engine
    engine.use_feeder = True
    encoder.encode(["a"])
    thread = engine._feeder.thread
    assert release_encoder(encoder) is True and not encoder.is_loaded
    assert not thread.is_alive() and release_encoder(encoder) is False
    assert encoder.encode(["b"]).shape == (1, 32)  # loads again on use
