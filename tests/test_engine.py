"""Tests of dask_surge.engine.transformer.TransformerEngine against SentenceTransformer.encode."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Dense, Pooling

from dask_surge.engine.batching import CPU_MAX_TOKENS, CPU_MAX_TOKENS_CAP
from dask_surge.engine.transformer import TransformerEngine
from dask_surge.errors import SurgeInputError, SurgeValueError
from dask_surge.testing import make_texts, make_tiny_model, min_cosine, packaged_model_dir

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


EDGE_TEXTS = ["", " ", "\t\n", " ".join(["token"] * 2000), "  spaced   out  ", "Ünïcödé café 日本語 🙂", "x"]


def mixed_texts(n: int, seed: int = 0) -> list[str]:
    texts = make_texts(n, seed=seed) + EDGE_TEXTS
    np.random.default_rng(seed).shuffle(texts)
    return texts


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, SentenceTransformer]:
    root = tmp_path_factory.mktemp("engine-models")
    out = {"packaged": SentenceTransformer(str(packaged_model_dir()), device="cpu")}
    for pooling in ("mean", "cls", "max"):
        out[f"tiny-{pooling}"] = SentenceTransformer(
            make_tiny_model(root / pooling, pooling=pooling), device="cpu"
        )
    return out


@pytest.fixture(scope="module")
def tiny(models) -> SentenceTransformer:
    return models["tiny-mean"]


@pytest.mark.parametrize("name", ["packaged", "tiny-mean", "tiny-cls", "tiny-max"])
def test_matches_sentence_transformers(models, name):
    model = models[name]
    texts = mixed_texts(60 if name == "packaged" else 200, seed=len(name))
    engine = TransformerEngine.from_sentence_transformer(model)
    assert engine is not None
    assert (engine.dimension, engine.max_seq_length) == (
        model.get_embedding_dimension(),
        model.max_seq_length,
    )
    for normalize in (False, True):
        expected = model.encode(texts, convert_to_numpy=True, normalize_embeddings=normalize)
        got = engine.encode(texts, normalize=normalize)
        assert got.shape == expected.shape and got.dtype == np.float32 and got.flags.c_contiguous
        assert min_cosine(got, expected) >= 0.9999
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)


def test_user_model_is_left_untouched(models):
    model = models["packaged"]
    engine = TransformerEngine.from_sentence_transformer(model)
    layer = model[0].auto_model.encoder.layer[0].intermediate.dense
    assert type(layer) is torch.nn.Linear
    assert (
        engine.runner.hf.encoder.layer[0].intermediate.dense.weight is layer.weight
    )  # weights shared, not copied


def test_cpu_fast_path_is_packed_and_fused_and_leaves_the_model_alone(models):
    from dask_surge.engine.forward import _OneDNNLinear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    model = models["packaged"]
    engine = TransformerEngine.from_sentence_transformer(model)
    linears = [m for m in engine.runner.hf.modules() if isinstance(m, _OneDNNLinear)]
    assert linears and all(m._packed is not None for m in linears)
    assert sum(m._gelu for m in linears) == len(engine.runner.hf.encoder.layer) == 6  # one per feed-forward
    act = model[0].auto_model.encoder.layer[0].intermediate.intermediate_act_fn
    assert type(act).__name__ == "GELUActivation"  # the user's model keeps its activation


def test_narrow_linears_stay_stock_in_a_copy(tmp_path):
    """Below ONEDNN_MIN_WEIGHT a linear keeps torch's own (MKL) path: oneDNN would build a primitive
    per input shape for no gain; the engine still works on a copy of the tree."""
    from dask_surge.engine.forward import ONEDNN_MIN_WEIGHT
    from dask_surge.engine.forward import _OneDNNLinear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: the engine keeps the model's own tree")
    model = SentenceTransformer(make_tiny_model(tmp_path / "tiny"), device="cpu")
    engine = TransformerEngine.from_sentence_transformer(model)
    linears = [m for m in engine.runner.hf.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.in_features * m.out_features < ONEDNN_MIN_WEIGHT for m in linears)
    assert not any(isinstance(m, _OneDNNLinear) for m in linears)
    assert engine.runner.hf is not model[0].auto_model  # a copy, sharing the weights
    assert (
        engine.runner.hf.encoder.layer[0].intermediate.dense.weight
        is model[0].auto_model.encoder.layer[0].intermediate.dense.weight
    )
    texts = mixed_texts(20, seed=4)
    assert min_cosine(engine.encode(texts), model.encode(texts, convert_to_numpy=True)) >= 0.9999


def test_packed_weights_follow_an_in_place_update(tmp_path, monkeypatch):
    """The oneDNN-packed copy is a snapshot: after fine-tuning in place the engine must not mix
    old linear weights with new ones."""
    import dask_surge.engine.forward as device

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(device, "ONEDNN_MIN_WEIGHT", 0)  # pack the tiny model's narrow linears too
    model = SentenceTransformer(make_tiny_model(tmp_path / "tuned"), device="cpu")
    engine = TransformerEngine.from_sentence_transformer(model)
    assert any(
        m._packed is not None for m in engine.runner.hf.modules() if isinstance(m, device._OneDNNLinear)
    )
    texts = mixed_texts(20, seed=9)
    before = engine.encode(texts)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model[0].auto_model.modules():
            if type(module) is torch.nn.Linear:
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=gen))
    after = engine.encode(texts)
    assert min_cosine(after, model.encode(texts, convert_to_numpy=True)) >= 0.9999
    assert min_cosine(after, before) < 0.999  # the update did change the embeddings


def test_gelu_is_not_fused_into_a_module_that_does_more():
    from dask_surge.engine.forward import _fuse_gelu, _OneDNNLinear

    class Shifted(torch.nn.Module):  # dense, +1, GELU: fusing would drop the shift
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(8, 16)
            self.dense.__class__ = _OneDNNLinear
            self.intermediate_act_fn = torch.nn.GELU()

        def forward(self, x):
            return self.intermediate_act_fn(self.dense(x) + 1)

    module = Shifted()
    x = torch.randn(3, 8)
    with torch.inference_mode():
        before = module(x)
        _fuse_gelu(module)
        after = module(x)
    assert not module.dense._gelu and isinstance(module.intermediate_act_fn, torch.nn.GELU)
    torch.testing.assert_close(after, before)
    plain = Shifted()
    plain.forward = lambda x: plain.intermediate_act_fn(plain.dense(x))
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, plain.dense.weight, plain.dense.bias))
    _fuse_gelu(plain)
    assert plain.dense._gelu and isinstance(plain.intermediate_act_fn, torch.nn.Identity)
    with torch.inference_mode():
        torch.testing.assert_close(plain(x), expected, rtol=1e-4, atol=1e-5)


def test_combined_pooling_modes(tiny):
    model = SentenceTransformer(
        modules=[tiny[0], Pooling(32, pooling_mode=("cls", "max", "mean"))], device="cpu"
    )
    texts = mixed_texts(50)
    engine = TransformerEngine.from_sentence_transformer(model)
    assert engine.dimension == 96
    assert min_cosine(engine.encode(texts), model.encode(texts, convert_to_numpy=True)) >= 0.9999


def test_tiny_budget_still_fits_every_text(tiny):
    texts = mixed_texts(30)
    engine = TransformerEngine.from_sentence_transformer(tiny, max_tokens=1)
    assert min_cosine(engine.encode(texts), tiny.encode(texts, convert_to_numpy=True)) >= 0.9999


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            lambda m: SentenceTransformer(modules=[*m, Dense(32, 8)], device="cpu"), id="extra-dense"
        ),
        pytest.param(
            lambda m: SentenceTransformer(
                modules=[m[0], Pooling(32, pooling_mode="weightedmean")], device="cpu"
            ),
            id="weightedmean-pooling",
        ),
        pytest.param(lambda m: SentenceTransformer(modules=[m[0]], device="cpu"), id="no-pooling"),
        pytest.param(
            lambda m: SentenceTransformer(modules=list(m), device="cpu", truncate_dim=8), id="truncate-dim"
        ),
    ],
)
def test_unsupported_structure_returns_none(tiny, build):
    assert TransformerEngine.from_sentence_transformer(build(tiny)) is None


@pytest.mark.parametrize("include_prompt", [True, False])
def test_prompts_match_sentence_transformers(tiny, include_prompt):
    prompts = {"query": "query: ", "instruct": "Represent this sentence for searching relevant passages: "}
    model = SentenceTransformer(
        modules=list(tiny), device="cpu", prompts=prompts, default_prompt_name="query"
    )
    model[1].include_prompt = include_prompt
    texts = mixed_texts(80, seed=7)
    try:
        for kwargs in ({}, {"prompt_name": "instruct"}, {"prompt": "passage: "}, {"prompt": ""}):
            engine = TransformerEngine.from_sentence_transformer(model, **kwargs)
            assert engine.prompt == (
                prompts["query"] if not kwargs else kwargs.get("prompt", prompts["instruct"])
            )
            assert (engine.prompt_length > 0) == (bool(engine.prompt) and not include_prompt)
            assert min_cosine(engine.encode(texts), model.encode(texts, **kwargs)) >= 0.9999
    finally:
        tiny[1].include_prompt = True  # the modules are shared with the fixture


def test_prompt_counts_in_the_tokens(tiny):
    plain = TransformerEngine.from_sentence_transformer(tiny)
    prompted = TransformerEngine.from_sentence_transformer(tiny, prompt="query: ")
    assert (prompted.count_tokens(["a b", ""]) - plain.count_tokens(["a b", ""])).tolist() == [
        2,
        2,
    ]  # "query", ":"


def test_empty_input(tiny):
    engine = TransformerEngine.from_sentence_transformer(tiny)
    out = engine.encode([])
    assert out.shape == (0, engine.dimension) and out.dtype == np.float32
    assert engine.count_tokens([]).shape == (0,)


def test_order_is_restored(tiny):
    texts = mixed_texts(120, seed=3)
    engine = TransformerEngine.from_sentence_transformer(tiny, max_tokens=256)
    batch = engine.encode(texts)
    np.testing.assert_allclose(engine.encode(texts[::-1]), batch[::-1], rtol=1e-4, atol=1e-5)
    singles = np.concatenate([engine.encode([t]) for t in texts[:20]])
    np.testing.assert_allclose(singles, batch[:20], rtol=1e-4, atol=1e-5)


def test_accepts_any_sequence(tiny):
    texts = make_texts(10)
    engine = TransformerEngine.from_sentence_transformer(tiny)
    np.testing.assert_array_equal(engine.encode(tuple(texts)), engine.encode(np.array(texts, dtype=object)))


def test_count_tokens_truncates(tiny):
    engine = TransformerEngine.from_sentence_transformer(tiny)
    counts = engine.count_tokens(["", "hello world", " ".join(["token"] * 2000)])
    assert counts.dtype == np.int32
    assert counts.tolist() == [2, 4, engine.max_seq_length]


def test_non_str_text_raises(tiny):
    engine = TransformerEngine.from_sentence_transformer(tiny)
    with pytest.raises(SurgeInputError, match=r"texts\[1\]=None.*must be a str"):
        engine.encode(["ok", None])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_cpu_raises(tiny, dtype):
    with pytest.raises(ValueError, match=rf"dtype='{dtype}' needs a CUDA device.*dtype=None"):
        TransformerEngine.from_sentence_transformer(tiny, dtype=dtype)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, "dtype='int8' is not supported"),
        ({"max_tokens": 0}, "max_tokens=0 must be a positive int"),
    ],
)
def test_bad_options_raise(tiny, kwargs, match):
    with pytest.raises(SurgeValueError, match=match):
        TransformerEngine.from_sentence_transformer(tiny, **kwargs)


def test_float32_dtype_and_auto_budget_on_cpu(tiny, models):
    engine = TransformerEngine.from_sentence_transformer(tiny, dtype="float32")
    # the tiny encoder is narrow: more tokens a micro-batch (batching.cpu_max_tokens), up to the cap
    assert engine.device.type == "cpu" and engine.max_tokens == CPU_MAX_TOKENS_CAP == 8192
    minilm = TransformerEngine.from_sentence_transformer(models["packaged"])
    assert minilm.max_tokens == CPU_MAX_TOKENS == 2048  # MiniLM keeps the budget measured best for it


def test_concurrent_calls_from_threads(tiny):
    engine = TransformerEngine.from_sentence_transformer(tiny, max_tokens=512)
    inputs = [mixed_texts(80, seed=s) for s in range(4)]
    expected = [engine.encode(t) for t in inputs]
    results: dict[int, np.ndarray] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, engine.encode(inputs[i])))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        np.testing.assert_allclose(results[i], expected[i], rtol=1e-4, atol=1e-5)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
def test_cuda_matches_sentence_transformers(dtype, gpu_minilm):
    texts = mixed_texts(70_000)  # more than one 65,536-text window: exercises the background tokenizer
    model = gpu_minilm
    expected = model.encode(texts, convert_to_numpy=True, batch_size=256)
    engine = TransformerEngine.from_sentence_transformer(model, dtype=dtype)
    assert engine.device.type == "cuda" and engine.max_tokens >= 4096
    assert min_cosine(engine.encode(texts), expected) >= (0.9999 if dtype is None else 0.999)


# -- the feeder thread (issue 17 item 1): on by default on CUDA, testable on the CPU -------------------
def test_feeder_runs_every_forward_on_its_thread_with_the_same_output(monkeypatch):
    model = SentenceTransformer(str(packaged_model_dir()), device="cpu")
    engine = TransformerEngine.from_sentence_transformer(model, max_tokens=256)
    assert engine.use_feeder is False  # CPU default: inline
    texts = mixed_texts(300)
    inline = engine.encode(texts)
    threads = set()
    forward = engine._forward
    monkeypatch.setattr(
        engine,
        "_forward",
        lambda ids, valid: threads.add(threading.current_thread().name) or forward(ids, valid),
    )
    engine.use_feeder = True
    fed = engine.encode(texts)
    assert threads == {"surge-feeder-cpu"}
    np.testing.assert_allclose(fed, inline, rtol=1e-5, atol=1e-6)
    assert engine.encode([]).shape == (0, engine.dimension)


def test_feeder_serves_concurrent_callers_and_passes_errors_back(tiny):
    model = (
        tiny  # the feeder's hand-offs need no real weights (the packaged model made this 14 s of the suite)
    )
    engine = TransformerEngine.from_sentence_transformer(model, max_tokens=512)
    engine.use_feeder = True
    batches = [mixed_texts(40 + 10 * i) for i in range(3)]
    expected = [model.encode(b, convert_to_numpy=True) for b in batches]
    results = [None] * 3

    def run(i):
        results[i] = engine.encode(batches[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected):
        assert min_cosine(got, want) >= 0.9999
    with pytest.raises(SurgeInputError, match="texts\\[1\\]"):
        engine.encode(["ok", None])  # an error while preparing reaches the caller; the feeder lives on
    assert engine.encode(["still fine"]).shape == (1, engine.dimension)


@pytest.mark.slow  # development tooling (issue 70: the default suite tests the product, not the lab)
def test_benchmark_noop_forward_seam_returns_zeros_of_the_right_shape(tmp_path):
    """The benchmarks' no-op forward (benchmarks/_noop_forward.py, patching DeviceRunner.forward; the
    package has no switch for it): zeros, same shape, same path, and the real forward once undone."""
    import importlib.util
    from pathlib import Path

    where = Path(__file__).resolve().parent.parent / "benchmarks" / "_noop_forward.py"
    spec = importlib.util.spec_from_file_location("surge_noop_forward", where)
    assert spec is not None and spec.loader is not None
    _noop_forward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_noop_forward)

    model = SentenceTransformer(make_tiny_model(tmp_path / "m"), device="cpu")
    _noop_forward.patch()
    try:
        noop = TransformerEngine.from_sentence_transformer(model)
        out = noop.encode(["a", "b c", ""])
        assert out.shape == (3, noop.dimension) and not out.any()
    finally:
        _noop_forward.unpatch()
    assert TransformerEngine.from_sentence_transformer(model).encode(["a"]).any()  # off unless patched


def test_stage_seconds_are_counted(tmp_path):
    model = SentenceTransformer(make_tiny_model(tmp_path / "m"), device="cpu")
    engine = TransformerEngine.from_sentence_transformer(model)
    engine.encode(["a b", "c"])
    engine.encode(["d"])
    stats = engine.stats
    assert stats["calls"] == 2 and stats["texts"] == 3
    assert all(stats[k] > 0 for k in ("tokenize", "pack", "device", "finish"))


# -- issue 27 item 2: the feeder lets go of each job and stops on close() ------------------------------
def test_feeder_drops_each_job_once_it_ran():
    import weakref

    from dask_surge.engine.forward import _Feeder

    class Job:
        def __call__(self):
            return 42

    feeder = _Feeder(torch.device("cpu"))
    job = Job()
    ref = weakref.ref(job)
    assert feeder.submit(job).result() == 42
    del job
    feeder.submit(lambda: None).result()  # the loop cleared the first job before it took this one
    assert ref() is None
    feeder.close()
    feeder.close()  # idempotent
    assert not feeder.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        feeder.submit(lambda: None)


def test_close_stops_the_feeder_and_a_dropped_engine_frees_it(tiny):
    import gc
    import weakref

    engine = TransformerEngine.from_sentence_transformer(tiny)
    engine.use_feeder = True
    assert engine.encode(["a b", "c"]).shape == (2, engine.dimension)
    thread = engine.runner.feeder.thread
    engine.close()
    engine.close()  # idempotent
    assert not thread.is_alive()
    with pytest.raises(SurgeValueError, match=r"was closed.*Fix"):
        engine.encode(["a"])

    engine = TransformerEngine.from_sentence_transformer(tiny)
    engine.use_feeder = True
    engine.encode(mixed_texts(30))
    thread, ref = engine.runner.feeder.thread, weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None  # no job closure kept the engine (its weights, its last output) alive
    thread.join(30)
    assert not thread.is_alive()  # and its finalizer stopped the thread


def test_results_are_copied_out_through_a_small_reused_buffer():
    from dask_surge.engine.forward import _copy_out

    out = torch.randn(37, 5)
    staging = torch.empty(16)  # smaller than the output: many chunks through one buffer
    host = _copy_out(out, staging)
    np.testing.assert_array_equal(host, out.numpy())
    assert isinstance(host, np.ndarray) and host.flags.owndata and host.flags.c_contiguous
    assert _copy_out(torch.empty(0, 5), staging).shape == (0, 5)


# -- issue 27 item 5: one-length micro-batches run without a mask, same embeddings ---------------------
def test_one_length_micro_batches_run_unmasked_with_the_same_output(tiny, monkeypatch):
    model = tiny  # which micro-batches go unmasked depends on the tokenizer (MiniLM's), not on the weights
    texts = mixed_texts(200, seed=11) + ["the same words here"] * 40
    engine = TransformerEngine.from_sentence_transformer(model, max_tokens=512)
    calls = []
    forward = engine._forward
    monkeypatch.setattr(
        engine, "_forward", lambda ids, valid: calls.append(valid is None) or forward(ids, valid)
    )
    split = engine.encode(texts)
    assert any(calls) and not all(calls)  # some micro-batches unmasked, some padded
    calls.clear()
    engine.split_runs = False
    greedy = engine.encode(texts)
    assert not any(calls)
    np.testing.assert_allclose(split, greedy, rtol=1e-4, atol=1e-5)
    assert min_cosine(split, model.encode(texts, convert_to_numpy=True)) >= 0.9999


@pytest.mark.parametrize("include_prompt", [True, False])
def test_unmasked_pooling_honours_every_mode_and_the_prompt(tiny, include_prompt):
    model = SentenceTransformer(
        modules=[tiny[0], Pooling(32, pooling_mode=("cls", "max", "mean"), include_prompt=include_prompt)],
        device="cpu",
    )
    texts = ["one two three"] * 30 + ["four five"] * 30
    engine = TransformerEngine.from_sentence_transformer(model, prompt="query: ")
    assert engine.encode(texts).shape == (60, 96)
    assert min_cosine(engine.encode(texts), model.encode(texts, prompt="query: ")) >= 0.9999


def test_a_large_call_starts_with_a_small_window_and_the_windows_concatenate(tiny, monkeypatch):
    """Where the device overlaps tokenizing (CUDA's background tokenizer, forced here on the CPU), a large
    call's first window is FIRST_BLOCK_TEXTS texts and the rest full windows; each window is sorted and
    cut on its own, so the call's rows are exactly those of encoding its windows one by one."""
    from dask_surge.engine import tokenizing as tokenize

    monkeypatch.setattr(tokenize, "FIRST_BLOCK_TEXTS", 4)
    monkeypatch.setattr(tokenize, "BLOCK_TEXTS", 16)
    engine = TransformerEngine.from_sentence_transformer(tiny)
    texts = mixed_texts(60, seed=5)  # 67 texts: at least 16 first windows, so the call starts small
    spans = [(offset, len(e)) for offset, e in engine.packer.blocks(texts, background=True)]
    assert spans == [(0, 4), (4, 16), (20, 16), (36, 16), (52, 15)]
    assert [offset for offset, _ in engine.packer.blocks(texts)] == [0, 16, 32, 48, 64]
    monkeypatch.setattr(engine, "_blocks", lambda t: engine.packer.blocks(t, background=True))
    whole = engine.encode(texts)
    pieces = np.concatenate([engine.encode(texts[a : a + n]) for a, n in spans])
    assert np.array_equal(whole, pieces)
    assert min_cosine(whole, tiny.encode(texts, convert_to_numpy=True)) >= 0.9999


def test_the_collector_is_paused_while_encodings_are_made_and_packed(tiny, monkeypatch):
    """The tokenizer's one GC-tracked object per text would trigger collections of the whole heap;
    where surge.tuning.gc-pause is on (a CPU worker, or forced as here), the engine pauses the
    collector from tokenizing to packing and restores it, errors included."""
    import gc

    import dask

    monkeypatch.setitem(dask.config.config["surge"]["tuning"], "gc-pause", True)

    engine = TransformerEngine.from_sentence_transformer(tiny)
    packer = engine.packer
    packer._joined = (
        None  # text by text, as for a tokenizer JoinedTokenizer does not take (one object per text)
    )
    seen: list[bool] = []
    encode_batch, pack = packer._encode_batch, packer.pack
    monkeypatch.setattr(
        packer, "_encode_batch", lambda texts: seen.append(gc.isenabled()) or encode_batch(texts)
    )
    monkeypatch.setattr(packer, "pack", lambda *a, **k: seen.append(gc.isenabled()) or pack(*a, **k))
    assert gc.isenabled()
    engine.encode(mixed_texts(30))
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(SurgeInputError):
        engine.encode(["fine", None])  # type: ignore[list-item]
    assert gc.isenabled()


def test_cpu_attention_runs_with_padded_keys_and_leaves_the_model_alone(models):
    from dask_surge.engine import forward as device

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: the engine shares the user's module tree")
    model = models["packaged"]
    engine = TransformerEngine.from_sentence_transformer(model)
    assert engine.runner.hf.config._attn_implementation == device._PADDED_SDPA
    assert model[0].auto_model.config._attn_implementation == "sdpa"  # the user's model keeps its own
    texts = mixed_texts(120, seed=5)  # lengths off and on the multiple, padded and one-length micro-batches
    assert min_cosine(engine.encode(texts), model.encode(texts, convert_to_numpy=True)) >= 0.9999


def test_padded_attention_is_kept_only_where_the_probe_gives_the_same_output(tiny, monkeypatch):
    from dask_surge.engine import forward as device

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: the engine shares the user's module tree")

    def wrong(module, query, key, value, attention_mask, **kwargs):
        out, weights = device._sdpa_forward(module, query, key, value, attention_mask, **kwargs)
        return out + 1.0, weights

    monkeypatch.setattr(device, "_padded_sdpa", wrong)
    engine = TransformerEngine.from_sentence_transformer(tiny)
    assert engine.runner.hf.config._attn_implementation == "sdpa"
    texts = mixed_texts(40, seed=6)
    assert min_cosine(engine.encode(texts), tiny.encode(texts, convert_to_numpy=True)) >= 0.9999


@pytest.mark.parametrize("length", [3, 16, 29])
@pytest.mark.parametrize("mask", ["none", "bool2d", "float4d", "float4d-full", "broadcast"])
def test_padded_sdpa_equals_sdpa(length, mask):
    from dask_surge.engine import forward as device

    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(4, 2, length, 16, generator=gen) for _ in range(3))
    valid = torch.ones(4, length, dtype=torch.bool)
    valid[1:, length // 2 + 1 :] = False
    neg = torch.finfo(torch.float32).min
    masks = {
        "none": None,
        "bool2d": valid[:, None, None, :],
        "float4d": torch.zeros(4, 1, 1, length).masked_fill(~valid[:, None, None, :], neg),
        "float4d-full": torch.zeros(4, 1, length, length).masked_fill(~valid[:, None, None, :], neg),
        "broadcast": torch.zeros(1, 1, 1, 1),
    }
    module = torch.nn.Module()
    want, _ = device._sdpa_forward(module, q, k, v, masks[mask], is_causal=False, scaling=0.25)
    got, _ = device._padded_sdpa(module, q, k, v, masks[mask], is_causal=False, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    causal, _ = device._padded_sdpa(module, q, k, v, None, is_causal=True)
    torch.testing.assert_close(causal, device._sdpa_forward(module, q, k, v, None, is_causal=True)[0])
