"""CUDA traps of device handling, each pinned by a test: on the CPU where it can, on a GPU where it must.

- an in-memory model honours ``device=`` (moved where it encodes);
- ``device="cuda:N"`` is checked against the devices the loading process sees;
- the embedding size is read from the model's files, without loading weights;
- a bfloat16 checkpoint never runs in float16 unless asked; half weights are native (no autocast);
- NaN or inf embeddings raise an error naming the rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dask_surge import Encoder
from dask_surge.engine.forward import _cast_copy
from dask_surge.engine.placement import auto_dtype, checkpoint_dtype, move_to, pick_device
from dask_surge.engine.transformer import TransformerEngine
from dask_surge.errors import SurgeModelError, SurgeValueError
from dask_surge.models.loader import dimension_from_files
from dask_surge.models.output import check_finite
from dask_surge.testing import make_tiny_model, packaged_model_dir

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture()
def one_gpu(monkeypatch):
    """This process 'sees' one GPU (what a dask-cuda worker sees), without touching CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


# -- device= is validated against the devices this process sees -------------------------------------
def test_cuda_index_the_process_does_not_see_is_refused(one_gpu):
    with pytest.raises(
        SurgeValueError, match=r"device='cuda:1' does not exist.*sees 1 GPU.*cuda:0.*Fix: pass device='cuda'"
    ):
        pick_device("cuda:1")
    assert pick_device("cuda:0") == "cuda:0"
    assert pick_device("cuda") == "cuda"


def test_cuda_without_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this process has a GPU")
    with pytest.raises(SurgeValueError, match=r"device='cuda:0' asks for a GPU.*Fix"):
        pick_device("cuda:0")


@pytest.mark.parametrize("bad", ["cuda:x", "cuda1", "gpu", "cuda:-1"])
def test_malformed_device_is_refused_at_construction(bad):
    with pytest.raises(SurgeValueError, match=rf"device='{bad}' is not a torch device.*Fix"):
        Encoder("default", device=bad)


# -- an in-memory model honours device= -------------------------------------------------------------
class _Recorder:
    """Stands in for a SentenceTransformer's .device/.to() (a fake device move on a CPU machine)."""

    def __init__(self, device: str) -> None:
        self.device, self.moves = torch.device(device), []

    def to(self, device):
        self.moves.append(device)
        self.device = torch.device(device)
        return self


def test_in_memory_cpu_model_is_moved_to_the_gpu_it_encodes_on(one_gpu):
    model = _Recorder("cpu")
    assert move_to(model, None) == "cuda" and model.moves == ["cuda"]  # device=None: CUDA when available
    model = _Recorder("cpu")
    assert move_to(model, "cuda:0") == "cuda:0" and model.moves == ["cuda:0"]


def test_in_memory_model_already_there_is_not_moved(one_gpu):
    model = _Recorder("cuda:0")
    move_to(model, "cuda")
    assert model.moves == []
    model = _Recorder("cpu")
    move_to(model, "cpu")
    assert model.moves == []


def test_in_memory_model_on_cpu_encodes_with_device_cpu(tmp_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(make_tiny_model(tmp_path / "m"), device="cpu")
    enc = Encoder(model, device="cpu")
    assert enc.encode(["a"]).shape == (1, 32) and str(model.device) == "cpu"


@gpu
@needs_cuda
def test_in_memory_cpu_model_runs_on_the_gpu(tmp_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(make_tiny_model(tmp_path / "m"), device="cpu")
    enc = Encoder(model, device="cuda")
    enc.encode(["a text"])
    assert enc.engine.device.type == "cuda" and str(model.device).startswith("cuda")


# -- the dimension comes from the files ------------------------------------------------------------
def test_dimension_of_a_path_model_needs_no_load():
    enc = Encoder(str(packaged_model_dir()), device="cpu")
    assert enc.dimension == 384
    assert not enc.is_loaded  # nothing loaded to answer
    assert enc.dimension == enc.load().dimension


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_dimension_from_files_matches_the_loaded_model(tmp_path, pooling):
    path = make_tiny_model(tmp_path / pooling, hidden_size=48, pooling=pooling, normalize=True)
    assert dimension_from_files(path) == 48 == Encoder(path, device="cpu").load().dimension


def test_dimension_follows_dense_and_multi_mode_pooling(tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling

    base = SentenceTransformer(make_tiny_model(tmp_path / "base"), device="cpu")
    transformer = base[0]
    pooling = Pooling(32, pooling_mode=["mean", "max"])
    stacked = SentenceTransformer(modules=[transformer, pooling], device="cpu")
    stacked.save(str(tmp_path / "multi"))
    assert dimension_from_files(tmp_path / "multi") == 64 == stacked.encode(["x"]).shape[1]
    dense = SentenceTransformer(modules=[transformer, Pooling(32), Dense(32, 24)], device="cpu")
    dense.save(str(tmp_path / "dense"))
    assert dimension_from_files(tmp_path / "dense") == 24 == dense.encode(["x"]).shape[1]


def test_dimension_of_an_unknown_layout_falls_back_to_loading(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    modules = json.loads((tmp_path / "m" / "modules.json").read_text())
    modules.append({"idx": 9, "name": "9", "path": "9_X", "type": "my_pkg.Custom"})
    (tmp_path / "m" / "modules.json").write_text(json.dumps(modules))
    assert dimension_from_files(path) is None
    assert Encoder(lambda texts: np.ones((len(texts), 5))).dimension == 5  # callables: probed


# -- dtypes ------------------------------------------------------------------------------------------
def test_bfloat16_checkpoint_auto_dtype_is_bfloat16_on_cuda(tmp_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(make_tiny_model(tmp_path / "m"), device="cpu")
    assert checkpoint_dtype(model) == "float32"
    assert auto_dtype("cuda", checkpoint_dtype(model)) == "float16"
    model.to(torch.bfloat16)
    assert checkpoint_dtype(model) == "bfloat16"
    assert auto_dtype("cuda", checkpoint_dtype(model)) == "bfloat16"
    assert auto_dtype("cpu", "bfloat16") == "float32"


def test_half_weights_are_a_native_copy_and_the_model_is_untouched(tmp_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(make_tiny_model(tmp_path / "m"), device="cpu")
    hf = model[0].auto_model
    half = _cast_copy(hf, torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in hf.parameters()} == {torch.float32}
    ids = torch.tensor([[101, 2023, 102]])
    with torch.inference_mode():
        a = hf(input_ids=ids).last_hidden_state
        b = half(input_ids=ids).last_hidden_state.float()
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_half_weights_are_native_and_accurate(dtype, gpu_minilm):
    model = gpu_minilm
    engine = TransformerEngine.from_sentence_transformer(model, dtype=dtype)
    assert {p.dtype for p in engine.runner.hf.parameters()} == {getattr(torch, dtype)}  # no autocast
    assert next(model.parameters()).dtype == torch.float32  # the user's model keeps its weights
    texts = ["a dog", "a cat on a mat", ""] * 100
    ref = model.encode(texts, convert_to_numpy=True)
    got = engine.encode(texts)
    cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() >= 0.999


# -- NaN / inf ---------------------------------------------------------------------------------------
def test_nan_from_the_fast_engine_names_the_rows(tmp_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(make_tiny_model(tmp_path / "m"), device="cpu")
    with torch.no_grad():
        model[0].auto_model.embeddings.LayerNorm.weight.fill_(float("nan"))
    engine = TransformerEngine.from_sentence_transformer(model)
    with pytest.raises(
        SurgeModelError, match=r"NaN or inf embeddings for 3 of 3 texts.*rows \[0, 1, 2\].*Fix"
    ):
        engine.encode(["a", "b c", ""])


@pytest.mark.parametrize("value, row", [(float("nan"), 2), (float("inf"), 0), (float("-inf"), 4)])
def test_the_engine_finiteness_check_finds_any_bad_value(value, row):
    from dask_surge.engine.forward import _check_finite

    out = torch.ones((5, 8))
    out[row, 3] = value
    with pytest.raises(SurgeModelError, match=rf"for 1 of 5 texts.*rows \[{row}\]"):
        _check_finite(out)
    out[row, 3], out[1, 1] = float("inf"), float("-inf")  # inf - inf: still caught
    with pytest.raises(SurgeModelError, match=r"for 2 of 5 texts"):
        _check_finite(out)
    _check_finite(torch.full((4, 8), 3e38))  # finite values whose sum overflows are fine


def test_nan_from_a_callable_names_the_rows():
    def broken(texts):
        out = np.ones((len(texts), 4), dtype=np.float32)
        out[1:2] = np.inf
        return out

    enc = Encoder(broken)
    with pytest.raises(SurgeModelError, match=r"for 1 of 3 texts.*rows \[1\]"):
        enc.encode(["x", "y", "z"])
    check_finite(np.ones((3, 4), dtype=np.float32))  # finite: no error
