"""The encoder backends (dask_surge.engine.backends) and the engine's two halves (tokenize, device)."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from dask_surge import Encoder
from dask_surge.engine.backends import (
    Backend,
    BackendClosed,
    CallableBackend,
    FastBackend,
    SentenceTransformersBackend,
    choose_backend,
)
from dask_surge.errors import SurgeModelError, SurgeValueError
from dask_surge.models import cache
from dask_surge.testing import make_tiny_model

TEXTS = ["a dog", "", "a cat on the mat", "x y z"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("backends") / "tiny")


@pytest.fixture()
def tiny(tiny_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(tiny_dir, device="cpu")


def test_a_standard_model_runs_on_the_fast_engine_and_says_why(tiny):
    backend, why = choose_backend(tiny, name="tiny", in_memory=True, device="cpu")
    assert isinstance(backend, FastBackend) and isinstance(backend, Backend)
    assert backend.name == "fast" and backend.dimension == 32 and backend.engine is not None
    assert why == "engine='auto' and the model is Transformer + Pooling, which the fast engine runs"
    expected = tiny.encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(backend.encode(TEXTS, False), expected, rtol=1e-4, atol=1e-5)


def test_sentence_transformers_when_asked_or_when_the_fast_engine_cannot_run_it(tiny):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense

    backend, why = choose_backend(
        tiny, name="tiny", in_memory=True, device="cpu", engine="sentence-transformers"
    )
    assert isinstance(backend, SentenceTransformersBackend) and backend.engine is None
    assert why.startswith("engine='sentence-transformers' was asked for")
    dense = SentenceTransformer(modules=[*tiny, Dense(32, 8)], device="cpu")
    backend, why = choose_backend(dense, name="dense", in_memory=True, device="cpu")
    assert backend.name == "sentence-transformers" and backend.dimension == 8
    assert "(Transformer + Pooling + Dense) is not an encoder Transformer + Pooling" in why
    np.testing.assert_allclose(
        backend.encode(TEXTS, True), dense.encode(TEXTS, normalize_embeddings=True), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(SurgeModelError, match=r"engine='fast' needs a Transformer.*Fix"):
        choose_backend(dense, name="dense", in_memory=True, device="cpu", engine="fast")


def test_a_plain_callable_is_called_as_is():
    backend, why = choose_backend(lambda t: np.full((len(t), 3), 2.0), name="f", in_memory=True)
    assert isinstance(backend, CallableBackend) and why.startswith("a plain callable")
    out = backend.encode(["a", "b"], True)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0)
    with pytest.raises(SurgeValueError, match="prompt=/prompt_name= apply to sentence-transformers"):
        choose_backend(lambda t: np.ones((len(t), 3)), name="f", in_memory=True, prompt="q: ")
    with pytest.raises(SurgeModelError, match="returned shape"):
        choose_backend(lambda t: np.ones(3), name="f", in_memory=True)


def test_the_encoder_reports_the_backend_and_the_reason(tiny_dir):
    enc = Encoder(tiny_dir, device="cpu", engine="sentence-transformers")
    assert enc.backend == "sentence-transformers" and "asked for" in enc.backend_reason
    assert Encoder(lambda t: np.ones((len(t), 2))).backend_reason.startswith("a plain callable")
    enc.close()


def test_a_closed_backend_refuses_calls_and_releases_once_the_running_call_ends():
    entered, leave = threading.Event(), threading.Event()

    def slow(texts):
        if texts != ["dimension probe"]:
            entered.set()
            assert leave.wait(30)
        return np.ones((len(texts), 2))

    backend = CallableBackend(slow)
    worker = threading.Thread(target=backend.encode, args=(["a"], False))
    worker.start()
    assert entered.wait(30)
    backend.close()  # never blocks: the release waits for the running call
    assert backend.closed and backend.fn is not None
    with pytest.raises(BackendClosed):
        backend.encode(["b"], False)
    leave.set()
    worker.join(30)
    assert backend.fn is None  # released by the last call out
    backend.close()  # idempotent


def test_an_encoder_whose_backend_was_closed_meanwhile_loads_it_again():
    enc = Encoder(lambda t: np.ones((len(t), 2)))
    first = enc._loaded()
    first.close()  # as another thread's close or eviction would
    assert enc.encode(["a"]).shape == (1, 2)
    assert enc._loaded() is not first and not enc._loaded().impl.closed
    enc.close()


def test_the_mask_probe_runs_once_when_the_engine_is_built(tiny, monkeypatch):
    from dask_surge.engine.forward import DeviceRunner
    from dask_surge.engine.transformer import TransformerEngine

    probes = []
    real = DeviceRunner._takes_4d_mask
    monkeypatch.setattr(DeviceRunner, "_takes_4d_mask", lambda self: probes.append(1) or real(self))
    engine = TransformerEngine.from_sentence_transformer(tiny, max_tokens=64)
    form = engine.runner.mask4d
    engine.encode(TEXTS * 5)
    engine.encode(TEXTS)
    assert probes == [1] and engine.runner.mask4d == form  # probed once, never flipped by a call


def test_the_host_side_packs_what_the_device_side_runs(tiny):
    from dask_surge.engine.batching import plan_batches
    from dask_surge.engine.transformer import TransformerEngine

    engine = TransformerEngine.from_sentence_transformer(tiny, max_tokens=64)
    packer = engine.packer
    encodings = packer.tokenize(TEXTS)
    packed = packer.pack(encodings, 10, max_tokens=64)
    lengths = packer.count_tokens(TEXTS)
    assert packed.ids.dtype == np.int32 and packed.size == int(lengths.sum())
    assert packed.where.tolist() == (plan_batches(lengths, 64).order + 10).tolist()
    window = engine.runner.stage(packed)
    assert (
        window.ids.numpy().tolist() == packed.ids.tolist() and not window.ids.is_pinned()
    )  # CPU: not pinned


def test_the_host_side_and_the_backends_import_no_torch():
    code = (
        "import sys, dask_surge.engine.tokenizing, dask_surge.engine.backends, dask_surge.models.encoders; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_loaded_records_keep_the_names_benchmarks_read(tiny_dir):
    enc = Encoder(tiny_dir, device="cpu").load()
    loaded = cache.cached(enc.spec)
    assert loaded.backend == "fast" and loaded.engine is enc.engine and loaded.dimension == 32
    assert {"tokenize", "pack", "device", "finish"} <= set(loaded.engine.stats)
    enc.close()


def _copy_model(src, dst, edit):
    """A copy of the model directory ``src`` in ``dst`` with ``edit(dst)`` applied to its files."""
    import shutil

    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def _edit_json(path, **changes):
    import json

    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_a_plain_transformer_pooling_normalize_directory_is_loaded_without_sentence_transformers(tiny_dir):
    from dask_surge.engine.loading import direct_layout

    layout, why = direct_layout(tiny_dir)
    assert layout is not None and layout.modules[:2] == ["Transformer", "Pooling"], why
    # in a fresh process: the encoder loads, encodes, and imports neither sentence-transformers nor
    # transformers' modeling stack (the BERT is dask-surge's own)
    code = (
        "import sys; from dask_surge import Encoder; e = Encoder(sys.argv[1], device='cpu'); "
        "e.encode(['a dog']); print(e._loaded().impl.loaded_by, 'sentence_transformers' in sys.modules, "
        "'transformers.modeling_utils' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code, tiny_dir], capture_output=True, text=True, check=True)
    assert done.stdout.split()[-3:] == ["dask-surge", "False", "False"]


def test_the_direct_load_computes_what_the_sentence_transformers_load_computes(tiny_dir):
    from sentence_transformers import SentenceTransformer

    from dask_surge.engine.transformer import TransformerEngine

    texts = [*TEXTS, "word " * 400, "query: Ünïcödé 漢字"]
    for prompt in (None, "query: "):
        with Encoder(tiny_dir, device="cpu", prompt=prompt) as enc:
            direct = enc.encode(texts)
            assert enc._loaded().impl.loaded_by == "dask-surge"
        engine = TransformerEngine.from_sentence_transformer(
            SentenceTransformer(tiny_dir, device="cpu"), prompt=prompt
        )
        assert np.array_equal(
            direct, engine.encode(texts)
        )  # the same weights, tokenizer and pooling: bitwise
        engine.close()


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda d: _edit_json(d / "sentence_bert_config.json", do_lower_case=True), "do_lower_case"),
        (lambda d: _edit_json(d / "config_sentence_transformers.json", truncate_dim=8), "truncate_dim"),
        (lambda d: _edit_json(d / "config.json", auto_map={"AutoModel": "x.Y"}), "custom code"),
        (lambda d: _edit_json(d / "1_Pooling" / "config.json", pooling_mode="weightedmean"), "pooling"),
        (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
    ],
)
def test_anything_but_the_plain_stack_is_left_to_sentence_transformers(tiny_dir, tmp_path, edit, why):
    from dask_surge.engine.backends import direct_backend
    from dask_surge.engine.loading import direct_layout

    path = _copy_model(tiny_dir, tmp_path / "m", edit)
    assert direct_layout(path)[0] is None, why
    assert direct_backend(path, name="m", device="cpu") is None
    if why == "truncate_dim":  # sentence-transformers loads the rest as before
        return
    if why in ("do_lower_case", "pooling"):
        with Encoder(path, device="cpu") as enc:
            assert (
                getattr(enc._loaded().impl, "loaded_by", "sentence-transformers") == "sentence-transformers"
            )


def test_engine_sentence_transformers_and_model_kwargs_keep_the_sentence_transformers_load(tiny_dir):
    for enc in (
        Encoder(tiny_dir, device="cpu", engine="sentence-transformers"),
        Encoder(tiny_dir, device="cpu", model_kwargs={"attn_implementation": "eager"}),
    ):
        with enc:
            assert (
                getattr(enc._loaded().impl, "loaded_by", "sentence-transformers") == "sentence-transformers"
            )
