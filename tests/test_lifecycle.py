"""A model's lifecycle in one process: load, close (Encoder.close, the context manager), the bounded
cache of loaded models, and the worker plugin's teardown; memory comes back after each close."""

from __future__ import annotations

import ctypes
import gc
import sys
import weakref
from dataclasses import replace

import dask
import numpy as np
import pytest

from dask_surge import Encoder
from dask_surge.execution.plugins import EncoderPlugin
from dask_surge.models import cache, encoders, registry
from dask_surge.testing import make_tiny_model

TEXTS = [f"text number {i} " + "word " * (i % 23) for i in range(400)]
#: big enough to measure: ~75 MB of float32 weights each (30,522 x 384 embeddings, 4 layers)
SHAPE = {"hidden_size": 384, "num_layers": 4, "num_heads": 6}


@pytest.fixture(scope="module")
def three_models(tmp_path_factory):
    """Three different models (other weights, so other identities) of one shape."""
    root = tmp_path_factory.mktemp("lifecycle")
    return [make_tiny_model(root / f"m{seed}", seed=seed, **SHAPE) for seed in (1, 2, 3)]


def _rss_mib() -> float:
    psutil = pytest.importorskip("psutil")
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).malloc_trim(0)
    return psutil.Process().memory_info().rss / 2**20


def _refs(enc: Encoder) -> list[weakref.ref]:
    """Weak references to what a loaded encoder holds: the model, the engine and its encoder copy."""
    loaded = cache.cached(enc.spec)
    return [weakref.ref(loaded.impl.model), weakref.ref(loaded.engine), weakref.ref(loaded.engine.runner.hf)]


def test_three_models_in_turn_give_their_memory_back(three_models):
    """Each close frees the model (no object left alive) and RSS returns to the level after the first close."""
    level = None
    for path in three_models:
        enc = Encoder(path, device="cpu")
        assert enc.encode(TEXTS).shape == (len(TEXTS), SHAPE["hidden_size"])
        refs = _refs(enc)
        loaded_rss = _rss_mib()
        assert enc.close() is True and not enc.is_loaded
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs)  # model, engine, encoder copy: all gone
        closed_rss = _rss_mib()
        assert loaded_rss - closed_rss > 40  # the measure sees a model (~75 MB of weights)
        level = closed_rss if level is None else level
        assert closed_rss < level + 12, (path, level, closed_rss)


@pytest.mark.gpu
def test_three_models_in_turn_give_their_gpu_memory_back(three_models):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    level = None
    for path in three_models:
        enc = Encoder(path, device="cuda")
        enc.engine.use_feeder = True
        assert enc.encode(TEXTS).shape == (len(TEXTS), SHAPE["hidden_size"])
        held = torch.cuda.memory_allocated()
        refs = _refs(enc)
        enc.close()
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs)
        now = torch.cuda.memory_allocated()
        assert held - now > 30 * 2**20  # the weights (and half copies) were on the device
        level = now if level is None else level
        assert now <= level + 2**20, (path, level, now)


def test_the_context_manager_releases_the_feeder_thread_and_the_model(three_models):
    with Encoder(three_models[0], device="cpu") as enc:
        enc.engine.use_feeder = True  # CPU default is inline; the feeder thread is what must stop
        enc.encode(TEXTS[:20])
        thread = enc.engine.runner.feeder.thread
        refs = _refs(enc)
    thread.join(30)
    gc.collect()
    assert not enc.is_loaded and not thread.is_alive() and all(r() is None for r in refs)
    assert enc.close() is False and enc.unload() is False  # idempotent
    assert enc.encode(["loads again"]).shape == (1, SHAPE["hidden_size"])
    enc.close()


def test_loaded_models_are_bounded_least_recently_used_first(three_models, monkeypatch):
    monkeypatch.setattr(cache, "_LOADED", {})
    monkeypatch.setitem(dask.config.config.setdefault("surge", {}), "max-loaded-models", 2)
    a, b, c = (Encoder(p, device="cpu") for p in three_models)
    a.load()
    b.load()
    a.encode(["a is used again"])  # b is now the least recently used
    b_refs = _refs(b)
    c.load()
    gc.collect()
    assert a.is_loaded and c.is_loaded and not b.is_loaded
    assert all(r() is None for r in b_refs)  # evicting closed it
    assert b.encode(["b loads again"]).shape == (1, SHAPE["hidden_size"])
    assert len(cache.loaded()) == 2 and not a.is_loaded  # a was the least recently used this time
    for enc in (a, b, c):
        enc.close()


def test_plugin_teardown_forgets_a_shipped_object_but_not_the_callers():
    fn = lambda texts: np.ones((len(texts), 2))  # noqa: E731
    here = Encoder(fn)
    shipped_token = "obj-0-feed-1"  # made by another process (pid 0): shipped to this one by the plugin
    registry.install_object(shipped_token, fn)
    shipped = encoders.from_spec(replace(here.spec, source=shipped_token))
    for enc in (here, shipped):
        enc.load()
        EncoderPlugin(enc).teardown(worker=None)  # outside an event loop: released at once
        assert not enc.is_loaded
    assert here.source_object is fn  # the caller's own object stays
    assert registry.installed(shipped_token) is None


def test_plugin_teardown_keeps_an_object_another_plugin_still_uses():
    import types

    fn = lambda texts: np.ones((len(texts), 2))  # noqa: E731
    token = "obj-0-feed-2"
    registry.install_object(token, fn)
    one = encoders.from_spec(replace(Encoder(fn).spec, source=token))
    other = one.with_options(batch_size=7)
    plugins = {p.name: p for p in (EncoderPlugin(one), EncoderPlugin(other))}
    worker = types.SimpleNamespace(plugins=plugins)
    first = plugins.pop(EncoderPlugin(one).name)
    first.teardown(worker)
    assert registry.installed(token) is not None  # the other option set still needs it
    last = plugins.pop(EncoderPlugin(other).name)
    last.teardown(worker)
    assert registry.installed(token) is None
