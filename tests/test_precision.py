"""Stored precisions (float16, int8, binary) and Matryoshka truncation, end to end."""

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeValueError
from dask_surge.io.precision import quantize, to_float
from dask_surge.testing import make_partitioned_frame, make_texts


def _stored(df):
    return np.stack(df["embedding"].to_numpy())


@pytest.fixture(scope="module")
def reference(tiny_model):
    ddf = make_partitioned_frame([5, 0, 17, 3], seed=31)
    ref = ddf.surge.encode("text", model=tiny_model, normalize=True, device="cpu", b_min=8, b_max=16)
    return ddf, _stored(ref.compute(scheduler="sync")).astype(np.float32)


@pytest.mark.parametrize(
    "precision,dtype,width", [("float16", np.float16, 1), ("int8", np.int8, 1), ("binary", np.uint8, 8)]
)
def test_stored_precision_is_the_fixed_rule_applied_to_float32(
    tmp_path, tiny_model, reference, precision, dtype, width
):
    ddf, ref = reference
    out = str(tmp_path / precision)
    ddf.surge.encode(
        "text",
        out,
        model=tiny_model,
        normalize=True,
        precision=precision,
        device="cpu",
        b_min=8,
        b_max=16,
        scheduler="sync",
        progress=False,
    )
    back = dask_surge.read_embeddings(out).compute().sort_values(["partition", "row"])
    stored = _stored(back)
    assert stored.dtype == dtype and stored.shape == (len(ref), -(-ref.shape[1] // width))
    want = quantize(ref, precision)
    if precision == "float16":
        np.testing.assert_allclose(stored.astype(np.float32), ref, atol=1e-3)
    else:  # same rule in every SuperBatch: at most one unit of rounding away from the float32 run
        diff = np.abs(stored.astype(np.int16) - want.astype(np.int16))
        assert (diff <= (1 if precision == "int8" else 255)).all()
        assert (stored == want).mean() > 0.99
    back_float = to_float(stored, precision, ref.shape[1])
    if precision == "int8":  # int8 / 127 is the unit vector to within rounding
        cos = (back_float * ref).sum(1) / np.linalg.norm(back_float, axis=1)
        assert cos.min() >= 0.999
    elif precision == "binary":  # the sign of every dimension
        assert (np.sign(back_float) == np.where(ref > 0, 1.0, -1.0)).mean() > 0.99


def test_int8_needs_normalized_vectors_before_any_work(tmp_path, counting_encoder):
    ddf = make_partitioned_frame([2])
    with pytest.raises(SurgeValueError, match="precision='int8'.*normalize=True"):
        ddf.surge.encode("text", str(tmp_path / "o"), model=counting_encoder, precision="int8")
    assert not (tmp_path / "o").exists()


def test_truncate_dim_matches_sentence_transformers(tiny_model):
    from sentence_transformers import SentenceTransformer

    texts = make_texts(40, seed=77) + [""]
    ddf = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=6)
    st = SentenceTransformer(tiny_model, device="cpu")
    k = (getattr(st, "get_embedding_dimension", None) or st.get_sentence_embedding_dimension)() // 2
    df = ddf.surge.encode("text", model=tiny_model, truncate_dim=k, normalize=True, device="cpu").compute(
        scheduler="sync"
    )
    got = _stored(df).astype(np.float32)
    want = st.encode(texts, truncate_dim=k, normalize_embeddings=True)
    assert got.shape == want.shape == (len(texts), k)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_truncate_dim_equal_to_the_dimension_still_normalizes():
    ddf = make_partitioned_frame([3])
    df = ddf.surge.encode(
        "text", model=lambda texts: [[3.0, 4.0]] * len(texts), truncate_dim=2, normalize=True
    ).compute(scheduler="sync")
    np.testing.assert_allclose(_stored(df), [[0.6, 0.8]] * 3, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -3, 10_000, 2.5, True])
def test_bad_truncate_dim_is_refused(counting_encoder, bad):
    with pytest.raises(SurgeValueError, match="truncate.dim=.*Fix"):
        make_partitioned_frame([2]).surge.encode("text", model=counting_encoder, truncate_dim=bad)


def test_cli_binary_truncated(tmp_path, tiny_model, capsys):
    from dask_surge.cli import main
    from dask_surge.testing import write_partitioned_parquet

    write_partitioned_parquet(tmp_path / "in", [4, 6])
    out = str(tmp_path / "o")
    assert (
        main(
            [
                "encode",
                str(tmp_path / "in"),
                "--text-column",
                "text",
                "--output",
                out,
                "--model",
                tiny_model,
                "--device",
                "cpu",
                "--precision",
                "binary",
                "--truncate-dim",
                "16",
                "--normalize",
                "--scheduler",
                "sync",
                "--no-progress",
            ]
        )
        == 0
    )
    stored = _stored(dask_surge.read_embeddings(out).compute())
    assert stored.shape == (10, 2) and stored.dtype == np.uint8
