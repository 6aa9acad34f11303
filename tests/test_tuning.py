"""Process-wide settings (surge.tuning.*): declared once, resolved per device, applied by the worker
plugin only; a user's own process keeps its state (loading a model and encoding change none of it)."""

import os
import subprocess
import sys

import dask
import pytest
import yaml

from dask_surge import config, options
from dask_surge.engine import tuning
from dask_surge.errors import SurgeValueError

SCRIPT = r"""
import gc, os, sys
import torch
environ = dict(os.environ)
flags = lambda: (torch.get_num_threads(), torch.backends.mkldnn.enabled, torch.is_grad_enabled(),
                 torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype())
before = flags()
from dask_surge import Encoder
from dask_surge.engine import allocator, tuning
enc = Encoder(sys.argv[1], device="cpu")
enc.load()
enc.encode(["a notebook loads a model", "and encodes two texts"])
enc.close()
print(allocator._done, gc.isenabled(), dict(os.environ) == environ, tuning.applied(), flags() == before)
"""


def test_a_notebook_process_keeps_its_allocator_gc_environment_and_torch_flags(tiny_model):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("RAYON_NUM_THREADS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    # mallopt never called (it records each setting it applies), gc on, the environment and torch's global
    # flags as they were, nothing applied by the worker plugin's tuning
    assert proc.stdout.split() == ["[]", "True", "True", "{}", "True"]


# -- the declaration: one per setting, resolved per device --------------------------------------------

CPU_MEASURED = [
    "allocator",
    "gc-pause",
    "rayon-threads",
    "pause-profiler",
    "cpu-kernels",
    "joined-tokenizing",
]


def test_every_setting_is_declared_once_and_shipped_as_auto():
    assert list(tuning.SETTINGS) == list(options.TUNING)
    with open(config.DEFAULTS_PATH) as f:
        shipped = yaml.safe_load(f)["surge"]["tuning"]
    assert shipped == dict.fromkeys(tuning.SETTINGS, "auto")
    for opt in tuning.SETTINGS.values():
        assert opt.key == f"surge.tuning.{opt.name}" and opt.does and opt.measured
        assert "benchmarks/" not in opt.measured
        assert dask.config.get(opt.key) == "auto"


@pytest.mark.parametrize("name", CPU_MEASURED)
def test_a_setting_measured_on_a_cpu_is_on_on_a_cpu_only(name):
    assert tuning.SETTINGS[name].measured_on == ("cpu",)
    assert tuning.setting(name, "cpu") is True
    assert tuning.setting(name, "cuda") is False and tuning.setting(name, "cuda:1") is False
    with dask.config.set({f"surge.tuning.{name}": True}):
        assert tuning.setting(name, "cuda") is True
    with dask.config.set({f"surge.tuning.{name}": False}):
        assert tuning.setting(name, "cpu") is False


def test_the_token_pool_is_off_on_every_device_until_forced():
    assert tuning.setting("tokenize-processes", "cpu") == tuning.setting("tokenize-processes", "cuda") == 0
    with dask.config.set({"surge.tuning.tokenize-processes": 3}):
        assert tuning.setting("tokenize-processes", "cuda") == 3


@pytest.mark.parametrize(
    "name, value",
    [("allocator", "yes"), ("gc-pause", 1), ("tokenize-processes", -1), ("tokenize-processes", True)],
)
def test_a_bad_value_is_named_with_the_rule_and_the_fix(name, value):
    with dask.config.set({f"surge.tuning.{name}": value}), pytest.raises(SurgeValueError) as err:
        tuning.setting(name, "cpu")
    message = str(err.value)
    assert f"surge.tuning.{name}={value!r}" in message and "must be" in message and "Fix:" in message


def test_process_settings_are_off_in_a_users_process_unless_forced(monkeypatch):
    monkeypatch.setattr(tuning, "_applied", {})
    for name in ("allocator", "gc-pause", "rayon-threads", "pause-profiler"):
        assert tuning.active(name) is False
        with dask.config.set({f"surge.tuning.{name}": True}):
            assert tuning.active(name) is True
    monkeypatch.setattr(tuning, "keep_large_blocks", lambda: True)
    assert tuning.apply_worker("cuda:0") == dict.fromkeys(
        ["allocator", "gc-pause", "rayon-threads", "pause-profiler"], False
    )
    # a worker of a user's cluster: the allocator, which cannot be undone, is left alone on auto
    assert tuning.apply_worker("cpu") == {
        **dict.fromkeys(["gc-pause", "rayon-threads", "pause-profiler"], True),
        "allocator": False,
    }
    assert tuning.active("gc-pause") is True
    with dask.config.set({"surge.tuning.gc-pause": False}):  # forced off beats applied
        assert tuning.active("gc-pause") is False
    with dask.config.set({"surge.dedicated-workers": True}):  # a worker dask-surge started
        assert tuning.apply_worker("cpu") == dict.fromkeys(
            ["allocator", "gc-pause", "rayon-threads", "pause-profiler"], True
        )
    # the plugin leaving: what can be undone is; the allocator stays recorded as applied
    assert tuning.release_worker() == {"allocator": True}
    assert not tuning.active("gc-pause") and tuning.active("allocator")


def test_only_the_allocator_cannot_be_undone():
    assert [n for n, s in tuning.SETTINGS.items() if not s.undoable] == ["allocator"]


# -- the settings where they apply ---------------------------------------------------------------------


def test_the_collector_stays_on_while_a_users_process_tokenizes(tiny_model, monkeypatch):
    import gc

    from sentence_transformers import SentenceTransformer

    from dask_surge.engine.transformer import TransformerEngine

    monkeypatch.setattr(tuning, "_applied", {})
    engine = TransformerEngine.from_sentence_transformer(SentenceTransformer(str(tiny_model), device="cpu"))
    try:
        packer = engine.packer
        packer._joined = None  # text by text: the path that paused the collector
        seen: list[bool] = []
        encode_batch = packer._encode_batch
        monkeypatch.setattr(
            packer, "_encode_batch", lambda texts: seen.append(gc.isenabled()) or encode_batch(texts)
        )
        engine.encode(["a user's notebook", "tokenizes two texts"])
        assert seen == [True] and gc.isenabled()
        monkeypatch.setattr(tuning, "_applied", {"gc-pause": True})  # as the plugin leaves a CPU worker
        engine.encode(["a worker", "tokenizes two texts"])
        assert seen == [True, False] and gc.isenabled()
    finally:
        engine.close()


def test_the_engine_takes_its_settings_for_its_device(tiny_model):
    from sentence_transformers import SentenceTransformer

    from dask_surge.engine import forward
    from dask_surge.engine.transformer import TransformerEngine

    st = SentenceTransformer(str(tiny_model), device="cpu")
    with dask.config.set({"surge.tuning.cpu-kernels": False, "surge.tuning.joined-tokenizing": False}):
        engine = TransformerEngine.from_sentence_transformer(st)
        try:
            engine.encode(["a text"])
            assert not any(isinstance(m, forward._OneDNNLinear) for m in engine.runner.hf.modules())
            assert engine.runner.hf is st[0].auto_model  # no copy: the user's model runs as it is
            assert engine.packer._joined is None
        finally:
            engine.close()
    packer = engine.packer
    packer.tune("cuda:0")
    assert (packer.joined_tokenizing, packer.processes) == (False, 0)
    packer.tune("cpu")
    assert packer.joined_tokenizing is True


def test_the_gpu_session_keeps_an_arm_for_each_setting_measured_only_on_a_cpu():
    """benchmarks/gpu_stages.py's host stage forces CPU_TUNING on against auto; cpu-kernels only changes a
    CPU forward pass, and the token pool has its own arm (tokenize-processes 2 against 0)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_stages.py"
    spec = importlib.util.spec_from_file_location("gpu_stages_for_tuning", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cpu_only = {n for n, s in tuning.SETTINGS.items() if s.measured_on == ("cpu",)}
    assert set(module.CPU_TUNING) == cpu_only - {"cpu-kernels"}
