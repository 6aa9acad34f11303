"""Issue 25 end to end: an updated corpus re-encodes only what changed (``reuse=``), repeated texts
go through the model once, and the result equals a fresh run on the new corpus."""

from __future__ import annotations

import os

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge.errors import SurgeInputError
from dask_surge.testing import CountingEncoder, FailOnce, min_cosine, package_documents


def _paragraphs(n: int) -> list[str]:
    """``n`` distinct real paragraphs (package descriptions this project did not write)."""
    seen: dict[str, None] = {}
    for doc in package_documents(400):
        for p in doc.split("\n\n"):
            p = " ".join(p.split())
            if len(p) > 40:
                seen.setdefault(p[:600])
        if len(seen) >= n:
            break
    texts = list(seen)
    assert len(texts) >= n, f"only {len(texts)} real paragraphs installed"
    return texts[:n]


def _frame(texts: list[str], ids: list[int], npartitions: int) -> dd.DataFrame:
    return dd.from_pandas(pd.DataFrame({"doc_id": ids, "text": texts}), npartitions=npartitions, sort=False)


@pytest.fixture(scope="module")
def corpus():
    """The old corpus and an update of it: 5% edited, 2% deleted, two new partitions of which a
    third are copies of old texts (moved rows) and the rest new."""
    rng = np.random.default_rng(7)
    texts = _paragraphs(1300)
    old = texts[:1000]
    new = list(old)
    edited = rng.choice(len(new), 50, replace=False)
    for i in edited:
        new[i] = new[i] + " (revised)"
    deleted = set(rng.choice(np.setdiff1d(np.arange(len(new)), edited), 20, replace=False).tolist())
    kept = [t for i, t in enumerate(new) if i not in deleted]
    copies = [old[i] for i in rng.choice(len(old), 50, replace=False)]
    added = copies + texts[1000:1100]
    rng.shuffle(added)
    return old, kept + added, len(kept)


def _read(path: str) -> pd.DataFrame:
    df = dask_surge.read_embeddings(path).compute()
    return df.sort_values(["partition", "row"]).reset_index(drop=True)


def test_a_reuse_run_encodes_only_what_changed_and_equals_a_fresh_run(tmp_path, tiny_model, corpus, client):
    old, new, _n_kept = corpus
    a, b, c = (str(tmp_path / x) for x in "abc")
    opts = {
        "model": tiny_model,
        "device": "cpu",
        "keep": ["doc_id"],
        "b_min": 200,
        "b_max": 400,
        "progress": False,
    }
    first = dask_surge.encode(_frame(old, list(range(len(old))), 5), "text", output=a, **opts)
    assert first.encoded == len(old) and first.reused == 0

    new_frame = _frame(new, list(range(len(new))), 7)  # 5 old-sized partitions, then 2 new ones
    update = dask_surge.encode(new_frame, "text", output=b, reuse=a, **opts)
    dask_surge.encode(new_frame, "text", output=c, **opts)

    old_set = set(old)
    changed = [t for t in new if t not in old_set]  # edited and new texts
    assert update.reused == len(new) - len(changed)
    assert len(set(changed)) <= update.encoded <= len(changed)
    assert update.encoded < 0.2 * len(new)  # most of the corpus was copied, not encoded
    assert dask_surge.status(b)["reused"] == update.reused

    got, want = _read(b), _read(c)
    assert len(got) == len(want) == len(new)
    pd.testing.assert_frame_equal(got[["partition", "row", "doc_id"]], want[["partition", "row", "doc_id"]])
    assert got["text_hash"].tolist() == want["text_hash"].tolist()
    assert min_cosine(np.stack(got["embedding"]), np.stack(want["embedding"])) >= 0.9999


def test_an_output_of_other_embedding_options_is_refused_naming_the_difference(tmp_path, tiny_model, corpus):
    old, _, _ = corpus
    a = str(tmp_path / "a")
    frame = _frame(old[:50], list(range(50)), 2)
    dask_surge.encode(
        frame, "text", output=a, model=tiny_model, device="cpu", scheduler="sync", progress=False
    )
    with pytest.raises(SurgeInputError, match="precision='float32', this run uses precision='float16'"):
        dask_surge.encode(
            frame,
            "text",
            output=str(tmp_path / "b"),
            model=tiny_model,
            device="cpu",
            precision="float16",
            reuse=a,
            scheduler="sync",
            progress=False,
        )
    assert not os.path.exists(tmp_path / "b" / "_surge" / "CURRENT")  # refused before anything was written


def test_an_in_place_update_replaces_the_old_output_only_when_complete(tmp_path, tiny_model, corpus):
    old, new, _ = corpus
    a, c = str(tmp_path / "a"), str(tmp_path / "c")
    opts = {
        "model": tiny_model,
        "device": "cpu",
        "b_min": 300,
        "b_max": 600,
        "scheduler": "sync",
        "progress": False,
    }
    dask_surge.encode(_frame(old, list(range(len(old))), 4), "text", output=a, **opts)
    old_run = dask_surge.status(a)["run"]
    new_frame = _frame(new, list(range(len(new))), 6)
    update = dask_surge.encode(new_frame, "text", output=a, reuse=a, overwrite=True, **opts)
    assert update.reused > 0.8 * len(new)
    info = dask_surge.status(a)
    assert info["run"] != old_run and info["state"] == "complete"
    assert sorted(os.listdir(os.path.join(a, "_surge", "index"))) in (
        [],
        [info["run"]],
    )  # the old index is gone
    dask_surge.encode(new_frame, "text", output=c, **opts)
    got, want = _read(a), _read(c)
    assert got["text_hash"].tolist() == want["text_hash"].tolist()
    assert min_cosine(np.stack(got["embedding"]), np.stack(want["embedding"])) >= 0.9999


def test_repeated_texts_go_through_the_model_once_per_superbatch(tmp_path):
    texts = _paragraphs(40)
    column = [texts[i % 10] for i in range(40)]  # each of 10 texts four times
    enc = CountingEncoder(dim=4)
    with dask.config.set({"surge.first-superbatch": None}):  # one SuperBatch of all 40 rows, no ramp
        out = dask_surge.encode(
            dd.from_pandas(pd.DataFrame({"text": column}), npartitions=2),
            "text",
            output=str(tmp_path / "o"),
            model=enc,
            b_min=40,
            b_max=40,
            scheduler="sync",
            progress=False,
        )
    assert out.superbatches == 1 and out.encoded == 10 and out.rows == 40
    assert sum(enc.calls) == 10 + 1  # the distinct texts, and the dimension probe
    df = _read(str(tmp_path / "o"))
    np.testing.assert_array_equal(np.stack(df["embedding"]), enc(column))


def test_a_stopped_reuse_run_resumes_exactly(tmp_path, tiny_model, corpus):
    old, new, _ = corpus
    a, b, c = (str(tmp_path / x) for x in "abc")
    opts = {
        "model": tiny_model,
        "device": "cpu",
        "keep": ["doc_id"],
        "b_min": 150,
        "b_max": 300,
        "scheduler": "sync",
        "progress": False,
    }
    dask_surge.encode(_frame(old, list(range(len(old))), 5), "text", output=a, **opts)
    base = _frame(new, list(range(len(new))), 7)
    starts = base.map_partitions(lambda p: p["doc_id"].iloc[:1]).compute().tolist()
    step = FailOnce(str(tmp_path / "flag"), int(starts[4]))
    frame = base.map_partitions(step, meta=base._meta)
    with pytest.raises(RuntimeError, match="injected failure"):
        dask_surge.encode(frame, "text", output=b, reuse=a, **opts)
    assert dask_surge.status(b)["superbatches_committed"] > 0
    resumed = dask_surge.encode(frame, "text", output=b, reuse=a, **opts)
    assert resumed.resumed and resumed.skipped_superbatches > 0
    dask_surge.encode(base, "text", output=c, **opts)
    got, want = _read(b), _read(c)
    pd.testing.assert_frame_equal(got[["partition", "row", "doc_id"]], want[["partition", "row", "doc_id"]])
    assert min_cosine(np.stack(got["embedding"]), np.stack(want["embedding"])) >= 0.9999


def test_plan_estimates_what_a_reuse_run_copies(tmp_path, corpus):
    old, new, _ = corpus
    a = str(tmp_path / "a")
    dask_surge.encode(
        _frame(old, list(range(len(old))), 4),
        "text",
        output=a,
        model=CountingEncoder(dim=4),
        scheduler="sync",
        progress=False,
    )
    p = dask_surge.plan(_frame(new, list(range(len(new))), 6), "text", reuse=a, token_sample=len(new))
    in_old = sum(t in set(old) for t in new)
    assert p.reuse["sampled"] == len(new) and p.reuse["reused"] == in_old
    assert p.reuse["encoded"] == len(new) - in_old and "reuse:" in str(p)


def test_the_cudf_reader_gets_the_hash_as_two_int64_halves(tmp_path):
    from dask_surge.io.hashing import hash_column, hashes_of, text_hashes
    from dask_surge.io.readers import _split_hash

    h = text_hashes(["a", "b", "c"])
    part = pd.DataFrame({"row": [0, 1, 2], "text_hash": hash_column(h).to_pylist(), "embedding": [1, 2, 3]})
    out = _split_hash(part.copy())
    assert list(out.columns) == ["row", "text_hash_hi", "text_hash_lo", "embedding"]
    back = np.stack(
        [out["text_hash_hi"].to_numpy().view(np.uint64), out["text_hash_lo"].to_numpy().view(np.uint64)], 1
    )
    np.testing.assert_array_equal(back, h)
    np.testing.assert_array_equal(hashes_of(hash_column(h)), h)
