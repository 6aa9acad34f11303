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
from dask_surge.errors import SurgeModelError
from dask_surge.execution.plugins import EncoderPlugin
from dask_surge.models import cache

WORKER = types.SimpleNamespace(address="tcp://test-worker")


def _preload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "surge-preload"]


def test_background_preload_returns_before_the_model_is_loaded(monkeypatch):
    release, started = threading.Event(), threading.Event()
    real = cache._load

    def slow_load(spec):
        started.set()
        assert release.wait(30)
        return real(spec)

    monkeypatch.setattr(cache, "_load", slow_load)
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
        from dask_surge.models import cache

        return {
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "tok": os.environ.get("TOKENIZERS_PARALLELISM"),
            "arrow": pa.cpu_count(),
            "io": pa.io_thread_count(),
            "loaded": len(cache.loaded()),
            "affinity": len(os.sched_getaffinity(0)),
        }

    encoder = Encoder(tiny_model, device="cpu")
    name = EncoderPlugin(encoder).name
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
        ) as cluster,
        Client(cluster) as client,
    ):
        (untouched,) = client.run(facts).values()
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
        # issue 70: what the plugin set in the worker process is as it was once the plugin left
        assert next(iter(client.run(facts).values())) == untouched


def test_closing_an_encoder_closes_the_engine(tiny_model):
    encoder = Encoder(tiny_model, device="cpu").load()
    engine = encoder.engine
    engine.use_feeder = True
    encoder.encode(["a"])
    thread = engine.runner.feeder.thread
    assert encoder.close() is True and not encoder.is_loaded
    assert not thread.is_alive() and encoder.close() is False
    assert encoder.encode(["b"]).shape == (1, 32)  # loads again on use


# -- the Rust tokenizer's pool: one share of the host's cores per CPU worker process -------------------
def test_two_cpu_workers_on_one_host_share_its_cores_in_the_tokenizer_pool(tiny_model):
    import os

    from distributed import Client, LocalCluster

    from dask_surge.execution.plugins import register_encoder, tokenizer_threads

    def rayon() -> tuple[str | None, int, int]:
        import tokenizers

        from dask_surge.testing import packaged_model_dir

        before = len(os.listdir("/proc/self/task"))
        tok = tokenizers.Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json"))
        tok.encode_batch(["a few words to tokenize"] * 4000)  # the first parallel call makes the pool
        return os.environ.get("RAYON_NUM_THREADS"), before, len(os.listdir("/proc/self/task"))

    cores = len(os.sched_getaffinity(0))
    share = tokenizer_threads(cores, 2)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
        ) as cluster,
        Client(cluster) as client,
    ):
        register_encoder(client, Encoder(tiny_model, device="cpu"))
        got = list(client.run(rayon).values())
    assert len(got) == 2
    for env, before, after in got:
        if share < cores:
            assert env == str(share)
            assert after - before <= share  # the pool's threads (never every core's)
        else:  # a machine with one core: nothing to share
            assert env is None


def test_a_user_setting_a_gpu_worker_and_a_worker_in_the_client_keep_the_tokenizer_pool(
    tiny_model, monkeypatch
):
    import os

    from dask_surge.execution.plugins import share_tokenizer_cores

    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    address, hosts = "tcp://127.0.0.1:4321", {"127.0.0.1": 4}
    EncoderPlugin(Encoder(tiny_model, device="cpu"), host_workers=hosts)._share_cores(address)
    assert "RAYON_NUM_THREADS" not in os.environ  # the plugin was made in this process: the client's pools
    gpu = EncoderPlugin(Encoder(tiny_model, device="cuda"), host_workers=hosts)
    gpu.client_process = ("another-host", os.getpid())  # as in a worker process of its own
    gpu._share_cores(address)
    assert "RAYON_NUM_THREADS" not in os.environ  # a GPU worker's helpers keep every core
    cpu = EncoderPlugin(Encoder(tiny_model, device="cpu"), host_workers=hosts)
    cpu.client_process = ("another-host", os.getpid())
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    cpu._share_cores(address)
    assert os.environ["RAYON_NUM_THREADS"] == "3"  # the user's setting stays
    monkeypatch.delenv("RAYON_NUM_THREADS")
    cpu._share_cores("tcp://10.0.0.9:4321")  # a host the client did not count (a worker that joined later)
    assert "RAYON_NUM_THREADS" not in os.environ
    assert share_tokenizer_cores(4, cores=16) == 4 and os.environ["RAYON_NUM_THREADS"] == "4"
