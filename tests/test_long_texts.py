"""Issue 24 end to end: long real documents through ``encode`` in each ``long_texts`` mode, on a real
multi-process cluster, against sentence-transformers on the same spans; resume in chunk mode."""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge.errors import SurgeInputError
from dask_surge.io.layout import output_columns
from dask_surge.testing import FailOnce, cosines, package_documents, packaged_model_dir


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """Real documents this project did not write: 16 package descriptions, most over MiniLM's window."""
    docs = [d[:3000] for d in package_documents(16, min_chars=1500)]
    assert len(docs) == 16
    return docs


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(packaged_model_dir()), device="cpu")


def _frame(docs: list[str], npartitions: int = 4) -> dd.DataFrame:
    return dd.from_pandas(
        pd.DataFrame({"doc_id": range(len(docs)), "text": docs}), npartitions=npartitions, sort=False
    )


def _read(path: str, keys=("partition", "row")) -> pd.DataFrame:
    return dask_surge.read_embeddings(path).compute().sort_values(list(keys)).reset_index(drop=True)


OPTS = {"device": "cpu", "keep": ["doc_id"], "b_min": 6, "b_max": 12, "progress": False}


def test_chunk_mode_writes_a_row_per_window_equal_to_the_model_on_its_span(
    tmp_path, documents, st_model, client
):
    out = str(tmp_path / "chunks")
    result = dask_surge.encode(_frame(documents), "text", output=out, long_texts="chunk", **OPTS)
    df = _read(out, ("partition", "row", "chunk"))
    assert result.rows == len(documents) and result.output_rows == len(df) > 2 * len(documents)
    assert tuple(df.columns) == output_columns(["doc_id"], chunked=True)  # the layout, in its order
    assert not df.duplicated(["partition", "row", "chunk"]).any()
    for doc_id, g in df.groupby("doc_id"):  # windows tile the document in order, overlapping
        text = documents[doc_id]
        assert g["chunk"].tolist() == list(range(len(g)))
        assert g["char_start"].iloc[0] <= len(text) - len(text.lstrip()) and g["char_end"].iloc[-1] == len(
            text.rstrip()
        )
        assert (np.diff(g["char_start"]) > 0).all() and (
            g["char_start"].iloc[1:].values < g["char_end"].iloc[:-1].values
        ).all()
        assert (g["tokens"] <= 254).all()  # MiniLM's 256 less [CLS] and [SEP]
    sample = df.iloc[:: max(1, len(df) // 40)]
    spans = [documents[d][s:e] for d, s, e in zip(sample["doc_id"], sample["char_start"], sample["char_end"])]
    want = st_model.encode(spans, convert_to_numpy=True)
    assert cosines(np.stack(sample["embedding"]), want).min() >= 0.999
    info = dask_surge.status(out)
    assert info["long_texts"] == "chunk" and info["output_rows"] == len(df)


def test_mean_mode_is_the_token_weighted_mean_of_the_windows(tmp_path, documents, client):
    docs = documents[:8]
    chunks, mean = str(tmp_path / "c"), str(tmp_path / "m")
    dask_surge.encode(_frame(docs, 2), "text", output=chunks, long_texts="chunk", **OPTS)
    dask_surge.encode(_frame(docs, 2), "text", output=mean, long_texts="mean", **OPTS)
    c, m = _read(chunks, ("partition", "row", "chunk")), _read(mean)
    assert len(m) == len(docs) and "chunk" not in m.columns
    for (doc_id, g), got in zip(c.groupby("doc_id"), m.sort_values("doc_id")["embedding"]):
        w = g["tokens"].to_numpy(float)
        avg = (np.stack(g["embedding"]) * w[:, None]).sum(0) / w.sum()
        avg /= np.linalg.norm(avg)  # MiniLM ends in a Normalize module
        assert cosines(np.asarray(got)[None], avg[None])[0] >= 0.9999


def test_truncate_counts_what_it_cuts_and_error_stops_naming_the_row(tmp_path, documents, st_model):
    tok = st_model.tokenizer
    over = sum(len(tok(d, add_special_tokens=True)["input_ids"]) > 256 for d in documents)
    assert over > 0
    opts = {**OPTS, "scheduler": "sync"}
    out = str(tmp_path / "t")
    result = dask_surge.encode(_frame(documents), "text", output=out, **opts)
    assert result.truncated == over and dask_surge.status(out)["truncated"] == over

    # error: short texts first, so one SuperBatch commits before the first long one stops the run
    short = ["a short sentence", "another short one"] * 6
    frame = _frame(short + documents[:4], npartitions=4)
    err_out = str(tmp_path / "e")
    with pytest.raises(
        SurgeInputError, match=r"partition \d+, row \d+ is [\d,]+ tokens long.*long_texts='truncate'"
    ):
        dask_surge.encode(
            frame, "text", output=err_out, long_texts="error", **{**opts, "b_min": 4, "b_max": 4}
        )
    committed = dask_surge.status(err_out)["superbatches_committed"]
    assert committed >= 1
    resumed = dask_surge.encode(
        frame, "text", output=err_out, long_texts="truncate", **{**opts, "b_min": 4, "b_max": 4}
    )
    assert resumed.resumed and resumed.skipped_superbatches == committed and resumed.truncated == 4


def test_a_stopped_chunk_run_resumes_to_the_same_windows(tmp_path, documents):
    base = _frame(documents[:9], 3)
    opts = {**OPTS, "b_min": 3, "b_max": 3, "scheduler": "sync", "long_texts": "chunk"}
    step = FailOnce(str(tmp_path / "flag"), 6)  # the third partition
    frame = base.map_partitions(step, meta=base._meta)
    stopped, whole = str(tmp_path / "s"), str(tmp_path / "w")
    with pytest.raises(RuntimeError, match="injected failure"):
        dask_surge.encode(frame, "text", output=stopped, **opts)
    assert dask_surge.status(stopped)["superbatches_committed"] >= 1
    assert dask_surge.encode(frame, "text", output=stopped, **opts).resumed
    dask_surge.encode(base, "text", output=whole, **opts)
    keys = ("partition", "row", "chunk")
    got, want = _read(stopped, keys), _read(whole, keys)
    cols = ["partition", "row", "chunk", "char_start", "char_end", "tokens", "doc_id", "text_hash"]
    pd.testing.assert_frame_equal(got[cols], want[cols])
    assert cosines(np.stack(got["embedding"]), np.stack(want["embedding"])).min() >= 0.9999


def test_a_chunked_output_is_reused_window_by_window(tmp_path, documents):
    opts = {**OPTS, "scheduler": "sync", "long_texts": "chunk"}
    old, new, fresh = (str(tmp_path / x) for x in "onf")
    dask_surge.encode(_frame(documents[:8], 2), "text", output=old, **opts)
    edited = documents[:8]
    edited[3] = edited[3] + " An added closing sentence."
    corpus = _frame(edited[::-1] + documents[8:11], 3)  # moved rows, one edit, three new documents
    update = dask_surge.encode(corpus, "text", output=new, reuse=old, **opts)
    assert update.reused == 7 and update.encoded == 4
    dask_surge.encode(corpus, "text", output=fresh, **opts)
    keys = ("partition", "row", "chunk")
    got, want = _read(new, keys), _read(fresh, keys)
    cols = ["partition", "row", "chunk", "char_start", "char_end", "tokens", "doc_id", "text_hash"]
    pd.testing.assert_frame_equal(got[cols], want[cols])
    assert cosines(np.stack(got["embedding"]), np.stack(want["embedding"])).min() >= 0.999


def test_chunk_mode_changes_the_run_but_error_and_truncate_do_not(tmp_path, documents):
    frame = _frame(documents[:4], 2)
    out = str(tmp_path / "o")
    opts = {**OPTS, "scheduler": "sync"}
    dask_surge.encode(frame, "text", output=out, **opts)
    assert dask_surge.encode(frame, "text", output=out, long_texts="error", **opts).resumed is True
    with pytest.raises(Exception, match="long_texts"):
        dask_surge.encode(frame, "text", output=out, long_texts="chunk", **opts)


def test_plan_counts_the_texts_over_the_window_and_their_windows(documents):
    frame = _frame(["a short sentence"] * 16 + documents, 4)
    p = dask_surge.plan(frame, "text", long_texts="chunk", b_min=8, b_max=8)
    lt = p.long_texts
    assert lt["sampled"] == 32 and lt["texts_over"] == 16 and lt["over_window"] == 0.5
    assert lt["windows"] > 16 + 2 * 16  # every document makes two windows or more
    assert "over the model's window" in str(p)
    # chunk mode caps a SuperBatch's text bytes at about b_max windows' worth (254 - 32 tokens, 3 chars each)
    assert p.max_bytes == 8 * (254 - 32) * 3
    assert dask_surge.plan(frame, "text", b_min=8, b_max=8).long_texts is None  # not asked for: no sample
