"""Decoder embedders (Qwen3-shaped, last-token pooling) on the fast engine: the same vectors as
``SentenceTransformer.encode``, whichever side the tokenizer pads, with prompts, Matryoshka
truncation and long texts; and what still falls back, with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge.engine import batching
from dask_surge.engine.layout import layout_of_model, plain_reason, read_layout
from dask_surge.engine.transformer import TransformerEngine
from dask_surge.testing import make_tiny_decoder_model, min_cosine, package_documents

COSINE = 0.9999
PROMPT = "Represent this passage for retrieval: "


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real documents cut to mixed lengths: empty, a few words, a paragraph, and whole ones the
    128-token window truncates."""
    docs = package_documents(48, min_chars=400)
    assert len(docs) == 48, "the installed packages hold too few long descriptions for this test"
    cuts = [0, 5, 17, 40, 90, 200, 400, None]
    return [doc if cut is None else doc[:cut] for doc, cut in zip(docs, cuts * 6)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("decoders")
    return {side: make_tiny_decoder_model(root / side, padding_side=side) for side in ("left", "right")}


def _st(path: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def _truncated(path: str, texts: list[str]) -> int:
    engine = TransformerEngine.from_sentence_transformer(_st(path))
    assert engine is not None
    return int((engine.count_tokens(texts) == engine.max_seq_length).sum())


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    "ask", [{}, {"prompt_name": "query"}, {"prompt": PROMPT}], ids=["plain", "query", "prompt"]
)
def test_the_fast_engine_gives_sentence_transformers_vectors(models, texts, side, ask):
    path = models[side]
    st = _st(path)
    assert st.tokenizer.padding_side == side
    encoder = dask_surge.Encoder(path, device="cpu", **ask)
    assert encoder.backend == "fast", encoder.backend_reason
    got, want = np.asarray(encoder.encode(texts)), st.encode(texts, **ask)
    assert got.shape == want.shape == (len(texts), 32)
    assert min_cosine(got, want) >= COSINE
    assert _truncated(path, texts) >= 6  # the whole documents were cut: their last token is the kept [SEP]
    if ask:  # the prompt changes the vectors: it was applied, not dropped
        assert min_cosine(got, st.encode(texts)) < 0.99


def test_a_loaded_sentence_transformer_runs_on_the_fast_engine(models, texts):
    st = _st(models["left"])
    encoder = dask_surge.Encoder(st, device="cpu", prompt_name="query")
    assert encoder.backend == "fast", encoder.backend_reason
    assert min_cosine(np.asarray(encoder.encode(texts)), st.encode(texts, prompt_name="query")) >= COSINE


def test_lasttoken_with_the_prompt_left_out_of_pooling(models, texts):
    st = _st(models["left"])
    st[1].include_prompt = False
    engine = TransformerEngine.from_sentence_transformer(st, prompt_name="query")
    assert engine is not None and engine.prompt_length > 0
    assert min_cosine(engine.encode(texts), st.encode(texts, prompt_name="query")) >= COSINE


def test_lasttoken_on_an_encoder_is_sentence_transformers_too(tmp_path, texts):
    """An encoder pads right in sentence-transformers as in the engine: the last real token either way."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from dask_surge.testing import make_tiny_model

    base = _st(make_tiny_model(tmp_path / "tiny"))
    st = SentenceTransformer(modules=[base[0], Pooling(32, pooling_mode="lasttoken")], device="cpu")
    st.save(str(tmp_path / "m"))
    assert read_layout(tmp_path / "m").plain and layout_of_model(st).plain
    encoder = dask_surge.Encoder(str(tmp_path / "m"), device="cpu")
    assert encoder.backend == "fast", encoder.backend_reason
    assert min_cosine(np.asarray(encoder.encode(texts)), st.encode(texts)) >= COSINE


def test_truncate_dim_through_encode_matches_sentence_transformers(models, texts):
    ddf = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=4)
    df = dask_surge.encode(
        ddf, "text", model=models["left"], truncate_dim=16, device="cpu", b_min=8, b_max=16
    ).compute(scheduler="sync")
    got = np.stack(df["embedding"].to_numpy()).astype(np.float32)
    want = _st(models["left"]).encode(texts, truncate_dim=16)
    assert got.shape == want.shape == (len(texts), 16)
    assert min_cosine(got, want) >= COSINE


@pytest.mark.parametrize("long_texts", ["chunk", "mean"])
def test_long_texts_windows_are_sentence_transformers_on_their_text(models, texts, long_texts):
    st = _st(models["left"])
    encoder = dask_surge.Encoder(models["left"], device="cpu", prompt_name="query")
    assert encoder.backend == "fast", encoder.backend_reason
    out = encoder.encode_long(texts, long_texts=long_texts)
    chunks = encoder.encode_long(texts, long_texts="chunk")
    w = chunks.windows
    spans = [texts[t][s:e] for t, s, e in zip(w.text, w.char_start, w.char_end)]
    per_window = st.encode(spans, prompt_name="query")
    assert chunks.over >= 6 and len(w) > len(texts)
    if long_texts == "chunk":
        assert min_cosine(out.embeddings, per_window) >= COSINE
        return
    weight = np.maximum(w.tokens, 1)[:, None]
    want = np.zeros((len(texts), per_window.shape[1]), dtype=np.float64)
    np.add.at(want, w.text, per_window * weight)
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    assert out.embeddings.shape == (len(texts), 32)
    assert min_cosine(out.embeddings, want) >= COSINE


def test_a_long_context_text_runs_alone_within_the_token_budget(tmp_path, texts):
    """A decoder's window can be thousands of tokens: one such text is one row, never rows x the budget."""
    path = make_tiny_decoder_model(tmp_path / "long", max_seq_length=4096)
    st = _st(path)
    long_text = " ".join(package_documents(40, min_chars=400))
    batch = [long_text, *texts[:16]]
    engine = TransformerEngine.from_sentence_transformer(st)
    assert engine is not None and engine.max_seq_length == 4096
    shapes: list[tuple[int, int]] = []
    forward = engine._forward

    def recording(ids, valid):
        shapes.append(tuple(ids.shape))
        return forward(ids, valid)

    engine._forward = recording  # type: ignore[method-assign]
    got = engine.encode(batch)
    assert engine.count_tokens([long_text])[0] == 4096
    assert (4096,) in {(w,) for r, w in shapes if r == 1}  # the long text ran as one row of its own
    assert all(rows * width <= max(engine.max_tokens, width) for rows, width in shapes), shapes
    assert min_cosine(got, st.encode(batch)) >= COSINE


def test_unsupported_pooling_falls_back_with_the_reason(tmp_path, texts):
    path = make_tiny_decoder_model(tmp_path / "wm", pooling_mode="weightedmean")
    encoder = dask_surge.Encoder(path, device="cpu")
    assert encoder.backend == "sentence-transformers"
    assert "weightedmean" in encoder.backend_reason, encoder.backend_reason
    assert min_cosine(np.asarray(encoder.encode(texts[:8])), _st(path).encode(texts[:8])) >= COSINE


def test_a_decoder_with_absolute_positions_or_an_encoder_decoder_is_refused(tmp_path):
    """GPT-2's learned positions shift with sentence-transformers' left padding: not the engine's rows."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from dask_surge.testing import packaged_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=1, n_head=2, n_positions=256)
    GPT2LMHeadModel(config).save_pretrained(str(tmp_path / "gpt2"))
    tokenizer.save_pretrained(str(tmp_path / "gpt2"))
    st = SentenceTransformer(
        modules=[
            Transformer(str(tmp_path / "gpt2"), max_seq_length=64),
            Pooling(32, pooling_mode="lasttoken"),
        ],
        device="cpu",
    )
    st.save(str(tmp_path / "m"))
    from_files, loaded = read_layout(tmp_path / "m"), layout_of_model(st)
    assert not from_files.plain and not loaded.plain
    assert from_files.reason == loaded.reason and "'gpt2' decoder" in loaded.reason
    encoder = dask_surge.Encoder(str(tmp_path / "m"), device="cpu")
    assert encoder.backend == "sentence-transformers" and "'gpt2' decoder" in encoder.backend_reason
    assert plain_reason(["Transformer", "Pooling"], ["lasttoken"], is_encoder_decoder=True) == (
        "the Transformer is an encoder-decoder, not an encoder or a decoder alone"
    )


def test_the_token_budget_is_sized_by_the_model_not_the_narrow_test_models():
    """One rule sizes every model's micro-batches from its activations: the 32-wide test decoder gets the
    narrow models' large budget, a Qwen3-Embedding-0.6B-shaped one (width 1024, 32k window) the floor."""
    qwen3_06b = SimpleNamespace(hidden_size=1024, intermediate_size=3072, num_attention_heads=16)
    tiny = SimpleNamespace(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    wide = batching.activation_bytes_per_token(qwen3_06b, 32768)
    narrow = batching.activation_bytes_per_token(tiny, 128)
    assert wide > 50 * narrow
    assert batching.cpu_max_tokens(wide) == batching.CPU_MAX_TOKENS
    assert batching.cpu_max_tokens(narrow) == batching.CPU_MAX_TOKENS_CAP > batching.CPU_MAX_TOKENS
