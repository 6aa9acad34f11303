"""Token counts of the user's texts: the sampler, the counter, and plan() predictions re-based on them."""

import dask
import numpy as np
import pandas as pd
import pytest

from dask_surge import Encoder
from dask_surge.errors import SurgeValueError
from dask_surge.planning.costmodel import CostParams, predict
from dask_surge.planning.tokens import DEFAULT_TRUNCATION, _max_seq_length, sample_texts, token_counter
from dask_surge.testing import lognormal_sizes, make_partitioned_frame, make_texts


def _params(**changes) -> CostParams:
    base = dict(
        alpha_s=0.005,
        per_text_s=2e-5,
        per_token_s=4e-6,
        b0=8.0,
        workers=2,
        setup_s=0.001,
        partition_s=0.002,
        overhead_s=0.05,
        io_per_row_s=1e-5,
        tokens_per_text=27.0,
        max_tokens=2048,
        token_lengths=tuple(np.linspace(8, 50, 64)),
    )
    base.update(changes)
    return CostParams(**base)


def test_counter_matches_the_loaded_engine_without_loading_weights(monkeypatch):
    from sentence_transformers import SentenceTransformer

    from dask_surge.engine.transformer import TransformerEngine
    from dask_surge.models import cache
    from dask_surge.testing import packaged_model_dir

    monkeypatch.setattr(cache, "_LOADED", {})  # nothing loaded here: the tokenizer.json path answers
    texts = ["", "hello world", " ".join(make_texts(400, seed=2))]  # the last is far over 256 tokens
    counted = token_counter(Encoder("default", device="cpu"))(texts)
    assert cache.loaded() == []  # and it loaded nothing
    engine = TransformerEngine.from_sentence_transformer(
        SentenceTransformer(str(packaged_model_dir()), device="cpu")
    )
    assert counted.tolist() == engine.count_tokens(texts).astype(float).tolist()
    assert counted[-1] == engine.max_seq_length == 256  # truncated at the model's max_seq_length


def test_counter_of_an_in_memory_model_builds_no_engine(monkeypatch, tmp_path):
    import shutil

    from sentence_transformers import SentenceTransformer

    from dask_surge.models import cache
    from dask_surge.testing import make_tiny_model

    model = SentenceTransformer(make_tiny_model(tmp_path / "tiny"), device="cpu")
    model.max_seq_length = 16
    monkeypatch.setattr(cache, "_LOADED", {})
    texts = ["a b", " ".join(make_texts(50, seed=4))]
    settings = model.tokenizer.backend_tokenizer.truncation
    counted = token_counter(Encoder(model, device="cpu"))(texts)
    assert cache.loaded() == []
    assert model.tokenizer.backend_tokenizer.truncation == settings  # the user's tokenizer is untouched
    assert counted[-1] == 16 and counted.tolist() == [
        float(len(model.tokenizer(t, truncation=True, max_length=16)["input_ids"])) for t in texts
    ]
    # a directory keeping its tokenizer in a module subfolder
    nested = tmp_path / "nested"
    (nested / "0_Transformer").mkdir(parents=True)
    shutil.copy(tmp_path / "tiny" / "tokenizer.json", nested / "0_Transformer" / "tokenizer.json")
    (nested / "0_Transformer" / "sentence_bert_config.json").write_text('{"max_seq_length": 8}')
    from dask_surge.models.spec import EncoderSpec

    class _PathOnly:  # what token_counter reads of an Encoder
        spec = EncoderSpec(kind="path", source=str(nested))
        source_object = None

    assert token_counter(_PathOnly())(texts)[-1] == 8


def test_max_seq_length_falls_back(tmp_path):
    assert _max_seq_length(tmp_path) == DEFAULT_TRUNCATION
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    assert _max_seq_length(tmp_path) == 128
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 64}')
    assert _max_seq_length(tmp_path) == 64


def test_callable_encoder_gets_a_word_estimate_and_is_never_called():
    calls = []

    def model(texts):
        calls.append(len(texts))
        return np.zeros((len(texts), 2))

    count = token_counter(Encoder(model))
    assert count(["one two three", ""]).tolist() == [1.3 * 3 + 2, 2.0]
    assert calls == []


def test_sample_spreads_over_partitions_and_skips_nulls_and_empty_ones():
    frames = [
        pd.DataFrame({"text": pd.array([f"p{i} r{j}" for j in range(50)], dtype="string")}) for i in range(20)
    ]
    frames[3] = frames[3].iloc[:0]
    frames[19].loc[5:, "text"] = None
    import dask.dataframe as dd

    ddf = dd.concat([dd.from_pandas(f, npartitions=1) for f in frames])
    sizes = [len(f) for f in frames]
    got = sample_texts(ddf, "text", sizes, n=80, partitions=8, max_partitions=8)
    assert len(got) == 75  # 8 partitions x 10, but the last holds only 5 non-null texts
    assert all(isinstance(t, str) for t in got)
    read = {t.split()[0] for t in got}
    assert "p0" in read and "p19" in read and "p3" not in read and len(read) == 8
    assert sample_texts(ddf, "text", sizes, n=80, partitions=8, max_partitions=8) == got  # deterministic
    # small partitions: enough of them to hold the sample
    assert len(sample_texts(ddf, "text", sizes, n=400, partitions=8)) >= 375  # 16 partitions x 25, one with 5
    assert sample_texts(ddf, "text", [0] * 20, n=80) == []


def test_with_token_lengths_rebases_and_validates():
    p = _params()
    q = p.with_token_lengths([100.0] * 10)
    assert q.tokens_per_text == 100.0 and set(q.token_lengths) == {100.0}
    assert q.per_token_s == p.per_token_s and q.alpha_s == p.alpha_s
    for bad in ([], [[1, 2]], [1, -1], [np.nan]):
        with pytest.raises(SurgeValueError, match="token lengths"):
            p.with_token_lengths(bad)


def test_plan_predicts_from_the_datas_token_lengths():
    sizes = lognormal_sizes(3_000, 60, sigma=1.0, seed=4)
    short = make_partitioned_frame(sizes, seed=1, mean_words=8)
    long = make_partitioned_frame(sizes, seed=1, mean_words=80)
    p = _params()
    ps, pl = (f.surge.plan("text", b_min=200, b_max=800, params=p) for f in (short, long))
    assert "sample of 2,048 texts" in ps.tokens_source and "tokens from a sample" in str(ps)
    assert ps.params.tokens_per_text < p.tokens_per_text < pl.params.tokens_per_text
    assert pl.params.tokens_per_text > 5 * ps.params.tokens_per_text
    assert pl.predictions.loc["surge", "seconds"] > 3 * ps.predictions.loc["surge", "seconds"]
    # the same prediction as predict() with the re-based parameters, of the plan shown (the input
    # streams: its SuperBatches form unit by unit)
    direct = predict(sizes, pl.params, b_min=200, b_max=800, superbatches=pl.superbatches)
    assert pl.predictions.loc["surge", "seconds"] == pytest.approx(direct.loc["surge", "seconds"])
    # sweep() uses them too
    assert pl.sweep([200]).loc[200, "texts_per_s"] == pytest.approx(
        pl.predictions.loc["surge", "texts_per_s"]
    )
    with dask.config.set({"surge.token-sample": None}):
        off = long.surge.plan("text", b_min=200, b_max=800, params=p)
    assert off.params == p and "calibration texts" in off.tokens_source
    assert off.predictions.loc["surge", "seconds"] == pytest.approx(
        predict(sizes, p, b_min=200, b_max=800, superbatches=off.superbatches).loc["surge", "seconds"]
    )


def test_bad_token_sample_is_refused():
    ddf = make_partitioned_frame([10, 10])
    with pytest.raises(SurgeValueError, match="token_sample=0 must be a positive int"):
        ddf.surge.plan("text", b_min=5, b_max=10, params=_params(), token_sample=0)
