"""The byte cap on SuperBatches (partitions of a few huge texts) and the null policies."""

import json
import os

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeInputError, SurgeValueError
from dask_surge.planning.sizes import partition_sizes
from dask_surge.io.store import OutputStore


def _huge_text_files(root, files=4, per_file=3, size=300_000, seed=0):
    """Parquet files of a few distinct ~300 kB texts each (no dictionary-encoding repeats)."""
    rng = np.random.default_rng(seed)
    root.mkdir()
    for f in range(files):
        texts = ["".join(rng.choice(list("abcdefgh "), size)) for _ in range(per_file)]
        pd.DataFrame({"text": texts, "doc_id": np.arange(per_file) + f * per_file}).to_parquet(
            root / f"part-{f:03d}.parquet", use_dictionary=False
        )
    return str(root)


def test_parquet_text_bytes_come_from_footers_without_reading_data(tmp_path):
    from dask.callbacks import Callback

    ddf = dd.read_parquet(_huge_text_files(tmp_path / "in"))
    started = []
    with Callback(pretask=lambda key, dsk, state: started.append(key)):
        got = partition_sizes(ddf[["text"]], "text")
    assert started == [] and got.source == "metadata" and got.sizes == (3, 3, 3, 3)
    exact = [sum(len(t.encode()) for t in part.text) for part in ddf.partitions]
    # the footer's uncompressed size of plain-encoded text: the bytes plus 4-byte lengths
    assert got.nbytes is not None
    for footer, real in zip(got.nbytes, exact):
        assert real <= footer <= real * 1.01


def test_len_pass_counts_utf8_bytes(tmp_path):
    ddf = dd.from_pandas(pd.DataFrame({"text": ["ab", "é", None, "xyz"], "k": [1, 2, 3, 4]}), npartitions=2)
    got = partition_sizes(ddf[ddf.k > 0][["text"]], "text")
    assert got.source == "len-pass" and got.sizes == (2, 2) and got.nbytes == (4, 3)


def test_few_huge_texts_are_not_fused_past_max_bytes(tmp_path, counting_encoder):
    ddf = dd.read_parquet(_huge_text_files(tmp_path / "in"))
    rows_only = ddf.surge.plan("text", b_min=100, b_max=1000, max_bytes=None)
    capped = ddf.surge.plan("text", b_min=100, b_max=1000, max_bytes="1 MiB")
    assert [sb.rows for sb in rows_only.superbatches] == [12]  # ~3.6 MB in one call
    assert [sb.rows for sb in capped.superbatches] == [3, 3, 3, 3]  # ~0.9 MB each
    assert capped.summary()["largest_superbatch_bytes"] <= 2**20
    half = ddf.surge.plan("text", b_min=100, b_max=1000, max_bytes=400_000)
    assert [sb.rows for sb in half.superbatches] == [1] * 12  # one 300 kB text fits, two do not
    out = tmp_path / "out"
    res = ddf.surge.encode(
        "text",
        str(out),
        model=counting_encoder,
        b_min=100,
        b_max=1000,
        max_bytes="1 MiB",
        scheduler="sync",
        progress=False,
    )
    # four encode calls of 3 texts (besides the one-text probe that learns the dimension)
    assert res.superbatches == 4 and [c for c in counting_encoder.calls if c > 1] == [3, 3, 3, 3]
    back = dask_surge.read_embeddings(str(out), columns=["partition", "row"]).compute()
    assert sorted(zip(back.partition, back.row)) == [(p, r) for p in range(4) for r in range(3)]


def test_a_resumed_run_keeps_the_byte_cap_it_recorded(tmp_path, caplog):
    """The byte cap does not change the embeddings, so it is not part of the run's identity: a
    rerun asking another resumes with the recorded one (the SuperBatches keep their boundaries)."""
    from dask_surge.testing import InterruptAfter

    ddf = dd.read_parquet(_huge_text_files(tmp_path / "in"))
    out = str(tmp_path / "out")
    model = InterruptAfter(3)
    kw = dict(model=model, b_min=100, b_max=1000, scheduler="sync", progress=False)
    planned = ddf.surge.plan("text", b_min=100, b_max=1000, max_bytes="1 MiB").superbatches
    with pytest.raises(KeyboardInterrupt):
        ddf.surge.encode("text", out, max_bytes="1 MiB", **kw)
    res = ddf.surge.encode("text", out, max_bytes="2 MiB", **kw)  # the same model: its 3rd call is past
    assert res.skipped_superbatches == 2 and res.superbatches == len(planned) == 4
    assert "max_bytes=2097152 (recorded: 1048576)" in caplog.text
    back = dask_surge.read_embeddings(out).compute()
    assert len(back) == 12 and not back.duplicated(["partition", "row"]).any()


def test_byte_cap_falls_back_to_the_size_pass_when_footers_cannot_say(tmp_path):
    ddf = dd.read_parquet(_huge_text_files(tmp_path / "in"))
    lowered = ddf.assign(text=ddf.text.str.upper())  # row counts still from footers, bytes not
    got = partition_sizes(lowered[["text"]], "text")
    assert got.source == "len-pass" and got.nbytes is not None and min(got.nbytes) >= 3 * 300_000
    capped = lowered.surge.plan("text", b_min=100, b_max=1000, max_bytes="1 MiB")
    assert [sb.rows for sb in capped.superbatches] == [3, 3, 3, 3]


def test_bad_max_bytes_fails_before_any_work(tmp_path, counting_encoder):
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a"]}), npartitions=1)
    with pytest.raises(SurgeValueError, match="max_bytes='a lot' must be a positive int of bytes"):
        ddf.surge.encode("text", str(tmp_path / "o"), model=counting_encoder, max_bytes="a lot")
    assert not (tmp_path / "o").exists()


NULLY = [["a", None, "c"], [None, None], ["d"], [], ["e", None]]


def _nully_frame():
    frames = [pd.DataFrame({"text": pd.array(t, dtype="string"), "doc_id": range(len(t))}) for t in NULLY]
    return dd.from_map(lambda i: frames[i], range(len(frames)), enforce_metadata=False)


def test_skip_leaves_nulls_out_and_records_every_one(tmp_path, counting_encoder):
    out = str(tmp_path / "out")
    res = _nully_frame().surge.encode(
        "text",
        out,
        model=counting_encoder,
        on_null="skip",
        keep=["doc_id"],
        b_min=3,
        b_max=4,
        scheduler="sync",
        progress=False,
    )
    nulls = [(p, r) for p, texts in enumerate(NULLY) for r, t in enumerate(texts) if t is None]
    kept = [(p, r) for p, texts in enumerate(NULLY) for r, t in enumerate(texts) if t is not None]
    back = dask_surge.read_embeddings(out).compute().sort_values(["partition", "row"])
    assert list(zip(back.partition, back.row)) == kept
    assert back.doc_id.tolist() == [r for _, r in kept]  # kept columns stay aligned
    assert [e[0] for e in back.embedding] == [1.0] * len(kept)  # encoded the right texts
    assert sorted(map(tuple, dask_surge.skipped_rows(out).values.tolist())) == nulls
    assert res.nulls_skipped == len(nulls) and "null texts left out" in str(res)
    info = dask_surge.status(out)
    assert info["state"] == "complete" and info["nulls_skipped"] == len(nulls)
    # ids live in one small Parquet file per SuperBatch that skipped any, named by its record
    from dask_surge.io.manifest import current_run

    records = current_run(OutputStore.open(out)).committed().values()
    assert sum(r.skipped for r in records) == len(nulls)
    assert len(list((tmp_path / "out").glob("_surge/runs/*/skipped/*.parquet"))) == sum(
        1 for r in records if r.skipped
    )
    assert info["rows_committed"] + info["nulls_skipped"] == info["rows_planned"]


def test_skip_then_a_non_string_names_its_real_row():
    from dask_surge.execution.superbatch import texts_of

    with pytest.raises(SurgeInputError, match="partition 0, row 13"):
        texts_of(pd.Series(["a", None, None, 5]), 0, 10, "skip")


def test_a_run_that_may_still_be_going_is_not_replaced(tmp_path, counting_encoder):
    from dask_surge.io.manifest import current_run

    out = str(tmp_path / "o")
    ddf = _nully_frame()
    kw = dict(model=counting_encoder, scheduler="sync", progress=False)
    with pytest.raises(SurgeInputError):
        ddf.surge.encode("text", out, **kw)  # stops on a null: records STOPPED
    first = current_run(OutputStore.open(out))
    assert first.stopped() and not first.committed()
    first.clear_stopped()  # as if its process were still running
    # another run (on_null alone does not make one: it does not change the embeddings)
    with pytest.raises(dask_surge.SurgeOutputError, match="different run"):
        ddf.surge.encode("text", out, on_null="skip", normalize=True, **kw)
    first.mark_stopped("test")
    assert ddf.surge.encode("text", out, on_null="skip", normalize=True, **kw).nulls_skipped == 4


def test_skip_needs_an_output_to_record_the_ids(counting_encoder):
    with pytest.raises(SurgeValueError, match="on_null='skip'.*needs output"):
        _nully_frame().surge.encode("text", model=counting_encoder, on_null="skip")


def test_cli_skip_records_nulls(tmp_path, capsys):
    """The command line's --on-null, run in this process (:func:`dask_surge.cli.main`, what the console
    script calls; two fresh interpreters cost 9 s of the default suite on 2 cores, issue 70)."""
    from unittest import mock

    from dask_surge.cli import main

    src = tmp_path / "in"
    src.mkdir()
    pd.DataFrame({"text": ["a", None, "b"]}).to_parquet(src / "a.parquet")
    pd.DataFrame({"text": [None, "c"]}).to_parquet(src / "b.parquet")
    out = tmp_path / "out"
    base = [
        "encode",
        str(src),
        "--text-column",
        "text",
        "--output",
        str(out),
        "--scheduler",
        "sync",
        "--no-progress",
        "--device",
        "cpu",
        "--json",
    ]
    capsys.readouterr()
    with mock.patch.dict(os.environ):  # main() sets defaults in os.environ: restored after
        refused = main(base)
        said = capsys.readouterr()
        assert refused == 2 and "partition 0, first at row 1" in said.err, said.err
        # the refused run committed nothing, so a rerun with another null policy may replace it
        done = main([*base, "--on-null", "skip"])
        said = capsys.readouterr()
    assert done == 0, said.err
    assert json.loads(said.out)["nulls_skipped"] == 2
    assert dask_surge.skipped_rows(str(out)).values.tolist() == [[0, 1], [1, 0]]


def test_input_without_rows_is_a_complete_run_of_zero_rows(tmp_path, counting_encoder):
    # Dask cannot build a frame of zero partitions; the nearest is one partition of no rows
    ddf = dd.from_pandas(pd.DataFrame({"text": pd.Series([], dtype="string")}), npartitions=1)
    out = str(tmp_path / "o")
    res = ddf.surge.encode("text", out, model=counting_encoder, scheduler="sync", progress=False)
    assert res.rows == 0 and dask_surge.status(out)["state"] == "complete"
    assert len(ddf.surge.encode("text", model=counting_encoder).compute(scheduler="sync")) == 0
