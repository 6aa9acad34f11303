"""End-to-end: ddf.surge.encode, lazily and to Parquet, checked against sentence-transformers."""

import json

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import Encoder, SurgeInputError, SurgeOutputError, SurgeValueError
from dask_surge.testing import cosines, make_partitioned_frame, make_texts
from dask_surge.io.store import OutputStore


def _emb(frame):
    return np.stack(frame["embedding"].to_numpy()).astype(np.float32)


def _reference(model_path, texts):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path, device="cpu").encode(texts, convert_to_numpy=True)


EDGE_SIZES = [1, 0, 0, 57, 1, 1, 0, 3, 1]  # empty, one-row, and one partition > b_max


def test_lazy_result_matches_sentence_transformers(tiny_model):
    ddf = make_partitioned_frame(EDGE_SIZES, seed=11)
    out = ddf.surge.encode("text", model=tiny_model, b_min=5, b_max=20, keep=["doc_id"], device="cpu")
    assert list(out.columns) == ["partition", "row", "doc_id", "text_hash", "embedding"]
    df = out.compute(scheduler="sync")
    # every input row exactly once, keyed by (partition, row), in order
    expected = [(p, r) for p, n in enumerate(EDGE_SIZES) for r in range(n)]
    assert list(zip(df.partition, df.row)) == expected
    assert df.doc_id.tolist() == list(range(sum(EDGE_SIZES)))
    texts = ddf.text.compute().tolist()
    assert cosines(_emb(df), _reference(tiny_model, texts)).min() >= 0.9999


def test_packaged_minilm_matches_on_unseen_texts():
    texts = make_texts(60, seed=1234) + ["", "x " * 600]  # empty and truncated texts too
    ddf = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=7)
    df = ddf.surge.encode("text", b_min=16, b_max=32, device="cpu").compute(scheduler="sync")
    from dask_surge.models.resolve import resolve_model_path

    ref = _reference(resolve_model_path("default"), texts)
    assert df.shape[0] == len(texts)
    assert cosines(_emb(df), ref).min() >= 0.9999


def test_one_encode_call_per_superbatch(counting_encoder):
    sizes = [3, 4, 20, 1, 0, 5, 5, 5]
    ddf = make_partitioned_frame(sizes)
    out = ddf.surge.encode("text", model=counting_encoder, b_min=5, b_max=8)
    plan = dask_surge.plan_superbatches(sizes, 5, 8)
    assert out.npartitions == len(plan)
    counting_encoder.calls.clear()
    df = out.compute(scheduler="sync")
    # one call per non-empty SuperBatch (an all-empty SuperBatch needs no model call)
    assert sorted(counting_encoder.calls) == sorted(sb.rows for sb in plan if sb.rows)
    assert len(counting_encoder.calls) < len(sizes)
    assert len(df) == sum(sizes)


def test_graph_has_one_task_per_superbatch_over_partition_tasks():
    """A partition's upstream tasks run inside the SuperBatch task that consumes it: 30
    partitions (each a read and a map_partitions step) in 6 SuperBatches are 6 tasks."""
    sizes = [2] * 30
    ddf = make_partitioned_frame(sizes)
    ddf = ddf.map_partitions(lambda f: f.assign(text=f.text + "!"), meta=ddf._meta)
    out = ddf.surge.encode("text", model=lambda t: np.ones((len(t), 4)), b_min=10, b_max=20)
    graph = out.optimize().__dask_graph__()
    assert out.npartitions == 6
    assert sorted(k[1] for k in graph) == list(range(6))
    # data producers: the scheduler queues them in plan order instead of placing them by input location
    assert all(task.data_producer for task in graph.values())
    assert len(out.compute(scheduler="sync")) == 60


def _counted(frame, calls):
    calls.append(int(frame["doc_id"].iloc[0]) if len(frame) else None)
    return frame


def test_upstream_tasks_run_once_when_superbatches_share_a_partition():
    """The slices of a partition larger than b_max share it: it stays one task, read once,
    with the priority of its first SuperBatch; every other partition is fused."""
    from dask_surge.execution.graph import FusedSuperBatchExpr

    sizes = [3, 50, 2, 4]
    calls: list = []
    ddf = make_partitioned_frame(sizes, seed=2)
    ddf = ddf.map_partitions(_counted, calls, meta=ddf._meta)
    out = ddf.surge.encode("text", model=lambda t: np.ones((len(t), 4)), b_min=5, b_max=20)
    plan = dask_surge.plan_superbatches(sizes, 5, 20)
    expr = out.optimize().expr
    assert isinstance(expr, FusedSuperBatchExpr)
    graph, priority = expr._fused
    shared = [k for k in graph if k[0] != expr._name]
    assert len(shared) == 1 and len(graph) == len(plan) + 1
    first = next(i for i, sb in enumerate(plan) if sb.spans[0].partition == 1)
    assert priority[shared[0]] == len(plan) - first
    calls.clear()  # planning counted the rows (one len pass)
    df = out.compute(scheduler="sync")
    assert sorted(calls) == [0, 3, 53, 55]  # each partition computed exactly once
    assert df["row"].tolist() == [r for n in sizes for r in range(n)]


@pytest.mark.under_load
def test_encode_fuses_over_a_persisted_frame(client):
    ddf = make_partitioned_frame([4, 1, 6, 2], seed=5).persist()
    out = ddf.surge.encode(
        "text", model=lambda t: np.ones((len(t), 4)), b_min=5, b_max=8, keep=["doc_id"]
    ).compute()
    assert out["doc_id"].tolist() == list(range(13))


def test_parquet_sizes_come_from_footers_without_reading_data(tmp_path):
    from dask.callbacks import Callback

    from dask_surge.planning.sizes import partition_sizes
    from dask_surge.testing import write_partitioned_parquet

    sizes = [5, 0, 17, 3]
    write_partitioned_parquet(tmp_path / "in", sizes)
    ddf = dd.read_parquet(str(tmp_path / "in"))
    started = []
    with Callback(pretask=lambda key, dsk, state: started.append(key)):
        got = partition_sizes(ddf[["text"]])
    assert got.sizes == tuple(sizes) and got.source == "metadata"
    assert started == []  # no task ran: nothing was read
    # and a frame whose lengths are unknowable falls back to a len pass
    filtered = ddf[ddf.doc_id % 2 == 0]
    assert partition_sizes(filtered[["text"]]).source == "len-pass"


def test_projected_parquet_keeps_its_partition_ids(tmp_path):
    """Dask's tune pass would merge the files of a narrow projection; the plan must not shift."""
    from dask_surge.testing import write_partitioned_parquet

    sizes = [3, 1, 4, 1, 5, 9, 2, 6]
    files = write_partitioned_parquet(tmp_path / "in", sizes)
    wide = pd.read_parquet(files[0]).assign(**{f"pad{i}": 1.0 for i in range(30)})
    for f, n in zip(files, sizes):  # add many columns so the text column is a small fraction
        pd.concat([pd.read_parquet(f)] + [wide[[f"pad{i}" for i in range(30)]].iloc[:0]], axis=1).fillna(
            1.0
        ).to_parquet(f, index=False) if n else None
    ddf = dd.read_parquet(str(tmp_path / "in"))
    df = ddf.surge.encode("text", model=lambda t: np.ones((len(t), 2)), b_min=4, b_max=8).compute(
        scheduler="sync"
    )
    assert list(zip(df.partition, df.row)) == [(p, r) for p, n in enumerate(sizes) for r in range(n)]


def test_write_read_back_and_resume(tmp_path, tiny_model):
    ddf = make_partitioned_frame(EDGE_SIZES, seed=3)
    out = str(tmp_path / "emb")
    kw = dict(
        model=tiny_model, b_min=5, b_max=20, keep=["doc_id"], device="cpu", scheduler="sync", progress=False
    )
    res = ddf.surge.encode("text", out, **kw)
    plan = dask_surge.plan_superbatches(EDGE_SIZES, 5, 20)
    assert (res.rows, res.superbatches, res.skipped_superbatches) == (sum(EDGE_SIZES), len(plan), 0)
    assert res.ttfo_s is not None and res.ttfo_s <= res.seconds
    files = sorted(p.name for p in (tmp_path / "emb").glob("part-*.parquet"))
    assert len(files) == len(plan)
    back = dask_surge.read_embeddings(out).compute().sort_values(["partition", "row"])
    assert list(zip(back.partition, back.row)) == [(p, r) for p, n in enumerate(EDGE_SIZES) for r in range(n)]
    assert back.embedding.dtype.pyarrow_dtype.list_size == 32
    # each file is one SuperBatch, within the thresholds
    import pyarrow.parquet as pq

    for f in files:
        assert pq.read_metadata(tmp_path / "emb" / f).num_rows <= 20
    # one partition without scanning all files
    one = dask_surge.read_embeddings(out, partition=3).compute()
    assert sorted(one.row) == list(range(57))
    # rerun: everything committed, nothing recomputed or duplicated
    again = ddf.surge.encode("text", out, **kw)
    assert again.skipped_superbatches == len(plan) and again.records == ()
    assert len(dask_surge.read_embeddings(out).compute()) == sum(EDGE_SIZES)
    assert dask_surge.status(out)["state"] == "complete"


def test_resume_after_partial_run(tmp_path, counting_encoder):
    """Drop some commit records (as if the run died) and check only those SBs are redone."""
    sizes = [4] * 12
    ddf = make_partitioned_frame(sizes)
    out = tmp_path / "emb"
    kw = dict(model=counting_encoder, b_min=8, b_max=8, scheduler="sync", progress=False)
    ddf.surge.encode("text", str(out), **kw)
    first = dask_surge.read_embeddings(str(out)).compute().sort_values(["partition", "row"])
    records = sorted((out / "_surge" / "runs").glob("*/commits/*.json"))
    for rec in records[2:4]:
        rec.unlink()
    records[5].write_text("{torn")
    next(out.glob("_surge/runs/*/COMPLETE")).unlink()  # as if the run had died before completing
    counting_encoder.calls.clear()
    res = ddf.surge.encode("text", str(out), **kw)
    assert res.skipped_superbatches == 3 and len(counting_encoder.calls) == 3
    second = dask_surge.read_embeddings(str(out)).compute().sort_values(["partition", "row"])
    assert len(second) == sum(sizes) == len(second[["partition", "row"]].drop_duplicates())
    np.testing.assert_array_equal(_emb(first), _emb(second))
    # orphan files of the broken attempts were cleaned when the run completed
    assert len(list(out.glob("part-*.parquet"))) == 6


def test_other_run_is_refused_then_overwritten(tmp_path, counting_encoder):
    ddf = make_partitioned_frame([3, 3, 3])
    out = str(tmp_path / "emb")
    kw = dict(model=counting_encoder, scheduler="sync", progress=False)
    ddf.surge.encode("text", out, b_min=3, b_max=3, **kw)
    # thresholds alone do not make another run (they do not change the embeddings); normalize does
    with pytest.raises(SurgeOutputError, match=r"different run \(normalize: False -> True\)"):
        ddf.surge.encode("text", out, b_min=6, b_max=6, normalize=True, **kw)
    assert len(dask_surge.read_embeddings(out).compute()) == 9  # old output untouched
    res = ddf.surge.encode("text", out, b_min=6, b_max=6, normalize=True, overwrite=True, **kw)
    assert res.superbatches == 2
    assert len(list((tmp_path / "emb").glob("part-*.parquet"))) == 2
    assert len(dask_surge.read_embeddings(out).compute()) == 9


def test_output_that_is_a_file_is_refused(tmp_path, counting_encoder):
    target = tmp_path / "file.txt"
    target.write_text("x")
    ddf = make_partitioned_frame([2])
    with pytest.raises(SurgeOutputError, match="is a file"):
        ddf.surge.encode("text", str(target), model=counting_encoder, scheduler="sync")


def test_memory_filesystem(counting_encoder):
    ddf = make_partitioned_frame([2, 5, 1])
    res = ddf.surge.encode(
        "text",
        "memory://surge-test/emb",
        model=counting_encoder,
        b_min=3,
        b_max=4,
        scheduler="sync",
        progress=False,
    )
    assert res.rows == 8
    back = dask_surge.read_embeddings("memory://surge-test/emb").compute(scheduler="sync")  # per-process fs
    assert sorted(zip(back.partition, back.row)) == [(0, 0), (0, 1)] + [(1, r) for r in range(5)] + [(2, 0)]


@pytest.mark.under_load
def test_distributed_cluster_end_to_end(tmp_path, tiny_model, client):
    sizes = [30, 1, 0, 12, 7, 80, 2]
    ddf = make_partitioned_frame(sizes, seed=5)
    with dask.config.set({"surge.in-flight": 2}):
        res = ddf.surge.encode(
            "text",
            str(tmp_path / "emb"),
            model=tiny_model,
            b_min=20,
            b_max=40,
            keep=["doc_id"],
            device="cpu",
            progress=False,
        )
    assert res.rows == sum(sizes)
    back = dask_surge.read_embeddings(str(tmp_path / "emb")).compute().sort_values("doc_id")
    assert back.doc_id.tolist() == list(range(sum(sizes)))
    ref = _reference(tiny_model, ddf.text.compute().tolist())
    assert cosines(_emb(back), ref).min() >= 0.9999
    # the input streams, a window of 2 units in flight: unit k starts only once k - 1 units
    # have finished, each committing at least one SuperBatch, so it reports no earlier than
    # the (k - 1)-th commit (TTFO: the first units commit first)
    from dask_surge.io.manifest import current_run

    per_unit = current_run(OutputStore.open(str(tmp_path / "emb"))).plan.unit_partitions
    units = [r.spans[0][0] // per_unit for r in res.records]
    assert all(k <= i + 1 for i, k in enumerate(units)), units


@pytest.mark.under_load
def test_a_client_passed_as_scheduler_need_not_be_the_current_one(tmp_path, tiny_model, _session_client):
    """``scheduler=client`` with no current client (``Client(..., set_as_default=False)``, a second
    cluster beside the default one): the run follows that client's futures on its own loop
    (``as_completed()`` had looked for a default client and raised "No clients found")."""
    from distributed import default_client

    with pytest.raises(ValueError):
        default_client()  # no client is current here: the run may only use the one it is given
    sizes = [30, 1, 0, 12, 7]
    ddf = make_partitioned_frame(sizes, seed=6)
    res = ddf.surge.encode(
        "text",
        str(tmp_path / "emb"),
        model=tiny_model,
        b_min=20,
        b_max=40,
        keep=["doc_id"],
        device="cpu",
        progress=False,
        scheduler=_session_client,
    )
    assert res.rows == sum(sizes) and res.superbatches >= 2
    back = dask_surge.read_embeddings(str(tmp_path / "emb")).compute().sort_values("doc_id")
    assert back.doc_id.tolist() == list(range(sum(sizes)))


@pytest.mark.under_load
def test_lazy_compute_gives_the_scheduler_superbatch_priorities():
    """compute() of the lazy result keeps the SuperBatch priorities (plan order first): Dask
    reads annotations from the top expression only, and its gather step used to hide them,
    so SuperBatches ran in dask.order's order."""
    from distributed import Client, LocalCluster

    from dask_surge.testing import GatedEncoder

    model = GatedEncoder("superbatch-priorities")
    gate = model.gate
    gate.set()  # building the graph probes the model's dimension
    sizes = [int(x) for x in np.random.default_rng(3).integers(1, 60, size=40)]
    ddf = make_partitioned_frame(sizes, seed=3)
    plan = dask_surge.plan_superbatches(sizes, 50, 120)
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as c,
    ):
        lazy = ddf.surge.encode("text", model=model, b_min=50, b_max=120)
        gate.clear()  # hold the SuperBatches while the scheduler is asked
        fut = c.compute(lazy)

        def superbatch_priorities(dask_scheduler):
            return {
                ts.key[1]: ts.priority[0]
                for ts in dask_scheduler.tasks.values()
                if isinstance(ts.key, tuple) and str(ts.key[0]).startswith("surge-superbatch")
            }

        deadline = __import__("time").monotonic() + 30
        while len(got := c.run_on_scheduler(superbatch_priorities)) < len(plan):
            assert __import__("time").monotonic() < deadline
        gate.set()
        out = fut.result()
    assert len(out) == sum(sizes)
    assert [got[k] for k in range(len(plan))] == [-(len(plan) - k) for k in range(len(plan))]


@pytest.mark.under_load
def test_in_memory_model_ships_through_plugin(client, counting_encoder):
    ddf = make_partitioned_frame([3, 2, 4])
    df = ddf.surge.encode("text", model=counting_encoder, b_min=4, b_max=8).compute()
    assert len(df) == 9 and _emb(df).shape == (9, 8)


def test_encoder_usable_with_map_partitions(tiny_model):
    enc = Encoder(tiny_model, device="cpu")
    ddf = make_partitioned_frame([3, 4])
    s = ddf.text.map_partitions(enc.embed, meta=enc.meta).compute(scheduler="sync")
    assert len(s) == 7 and str(s.dtype).startswith("fixed_size_list")
    import pickle

    assert len(pickle.dumps(enc)) < 2000


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(column="nope"), SurgeInputError, "text column 'nope' is not in the DataFrame"),
        (dict(keep=["missing"]), SurgeInputError, "missing column"),
        (dict(keep=["partition"]), SurgeInputError, "reserves"),
        (dict(b_min=10, b_max=5), SurgeValueError, "larger than b_max"),
        (dict(b_min=0), SurgeValueError, "b_min=0 must be a positive int"),
        (dict(precision="int3"), SurgeValueError, "precision"),
        (dict(model="/does/not/exist"), dask_surge.SurgeModelError, "does not exist"),
        (
            dict(device="cuda:0"),
            SurgeValueError if not __import__("torch").cuda.is_available() else type(None),
            "asks for a GPU",
        ),
    ],
)
def test_bad_arguments_fail_before_any_work(kwargs, err, match, tmp_path):
    ddf = make_partitioned_frame([2, 2])
    column = kwargs.pop("column", "text")
    if err is type(None):
        pytest.skip("a GPU is present")
    with pytest.raises(err, match=match):
        res = ddf.surge.encode(column, str(tmp_path / "o"), scheduler="sync", progress=False, **kwargs)
        res.compute() if hasattr(res, "compute") else None
    assert not list(tmp_path.glob("o/part-*"))


def test_column_labels_that_are_not_str_or_are_the_index_say_so(tmp_path):
    frame = pd.DataFrame({0: ["a b", "c"], 1: [1, 2]})
    ddf = dd.from_pandas(frame, npartitions=1)
    for column, keep, label in ((0, (), 0), ("0", (1,), 1)):
        with pytest.raises(
            SurgeInputError,
            match=rf"column label\(s\) \[{label}\] of types \['int'\].*Parquet.*"
            rf"ddf\.rename\(columns=str\).*'{label}'",
        ):
            ddf.surge.encode(column, str(tmp_path / "o"), keep=list(keep), scheduler="sync", progress=False)
    # a label that is not a str and not a column either: no rename advice, the columns
    for column in (5, ["0"]):
        with pytest.raises(
            SurgeInputError,
            match=r"take column names \(str\), but \[.*\] is not; the DataFrame's "
            r"columns are \[0, 1\]",
        ):
            ddf.surge.encode(column, str(tmp_path / "o"), scheduler="sync", progress=False)
    # the fix the message gives works
    renamed = ddf.rename(columns=str)
    plan = renamed.surge.plan("0")
    assert plan.rows == 2
    indexed = dd.from_pandas(pd.DataFrame({"id": [7, 8], "text": ["a", "b"]}).set_index("id"), npartitions=1)
    with pytest.raises(
        SurgeInputError, match=r"keep=\['id'\].*'id' is the index.*ddf = ddf\.reset_index\(\)"
    ):
        indexed.surge.encode("text", str(tmp_path / "o"), keep=["id"], scheduler="sync", progress=False)
    with pytest.raises(SurgeInputError, match=r"text column 'id'.*'id' is the index"):
        indexed.surge.encode("id", str(tmp_path / "o"), scheduler="sync", progress=False)
    with pytest.raises(
        SurgeInputError, match=r"missing column\(s\) \['nope'\]; columns are \['text'\]\. Fix"
    ):
        indexed.surge.encode("text", str(tmp_path / "o"), keep=["nope"], scheduler="sync", progress=False)
    assert not (tmp_path / "o").exists()


def test_a_kept_column_may_not_take_an_output_column_name(tmp_path, counting_encoder):
    # a kept "text_hash" was silently replaced by the output's own; "tokens" only clashes in chunk mode
    ddf = dd.from_pandas(
        pd.DataFrame({"text": ["a b", "c"], "text_hash": [1, 2], "tokens": [3, 4]}), npartitions=1
    )
    kw = {"model": counting_encoder, "scheduler": "sync", "progress": False}
    with pytest.raises(
        SurgeInputError,
        match=r"keep=\['text_hash'\] includes \['text_hash'\], which the output "
        r"reserves.*rename\(columns=\{'text_hash': 'my_text_hash'\}\)",
    ):
        ddf.surge.encode("text", str(tmp_path / "a"), keep=["text_hash"], **kw)
    with pytest.raises(
        SurgeInputError, match=r"\['tokens'\].*chunk, char_start, char_end, tokens.*long_texts=chunk"
    ):
        ddf.surge.encode("text", str(tmp_path / "b"), keep=["tokens"], long_texts="chunk", **kw)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    res = ddf.surge.encode("text", str(tmp_path / "c"), keep=["tokens"], **kw)
    assert res.rows == 2 and dask_surge.read_embeddings(str(tmp_path / "c")).compute()["tokens"].tolist() == [
        3,
        4,
    ]


def test_null_text_is_refused_by_default_or_encoded_empty(counting_encoder, tmp_path):
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a", None, "c"]}), npartitions=1)
    with pytest.raises(SurgeInputError, match=r"partition 0, first at row 1"):
        ddf.surge.encode(
            "text", str(tmp_path / "o"), model=counting_encoder, scheduler="sync", progress=False
        )
    assert dask_surge.status(str(tmp_path / "o"))["superbatches_committed"] == 0
    df = ddf.surge.encode("text", model=counting_encoder, on_null="empty").compute(scheduler="sync")
    assert len(df) == 3


def test_non_string_text_is_refused(counting_encoder):
    ddf = dd.from_pandas(pd.DataFrame({"text": [1, 2]}), npartitions=1)
    with pytest.raises(SurgeInputError, match="only strings can be encoded"):
        ddf.surge.encode("text", model=counting_encoder).compute(scheduler="sync")


def test_plan_accessor():
    ddf = dd.from_pandas(pd.DataFrame({"text": make_texts(40)}), npartitions=4)  # sizes known: planned
    p = ddf.surge.plan("text", b_min=15, b_max=25)
    assert [sb.rows for sb in p.superbatches] == [20, 20]
    assert "2 SuperBatches" in repr(p) and "sizes from metadata" in repr(p)


def test_invalid_utf8_bytes_get_a_clear_error(tmp_path, counting_encoder):
    ddf = dd.from_pandas(pd.DataFrame({"text": [b"ok", b"\xff\xfe"]}, dtype=object), npartitions=1)
    with pytest.raises(SurgeInputError, match="not valid UTF-8.*errors='replace'"):
        ddf.surge.encode(
            "text", str(tmp_path / "o"), model=counting_encoder, scheduler="sync", progress=False
        )


@pytest.mark.parametrize("convert_string", [True, False])
def test_a_lone_surrogate_gets_a_clear_error_and_commits_nothing(tmp_path, tiny_model, convert_string):
    # a str with half an emoji (json.loads keeps "\\ud83d"): Arrow cannot hold it, and no tokenizer reads it
    from dask_surge.io.manifest import current_run

    texts = ["fine", "broken \ud83d emoji", "also fine"] * 3
    out = tmp_path / str(convert_string)
    with dask.config.set({"dataframe.convert-string": convert_string}):
        ddf = dd.from_pandas(pd.DataFrame({"text": pd.Series(texts, dtype=object)}), npartitions=1)
        # converted to Arrow strings, the column fails as a whole; kept as str objects, the text is named
        where = r"column 'text'" if convert_string else r"the text at partition 0, row 1="
        with pytest.raises(SurgeInputError, match=where + r".*lone surrogate.*Fix: replace"):
            ddf.surge.encode(
                "text", str(out), model=tiny_model, device="cpu", scheduler="sync", progress=False
            )
    assert not list(out.glob("part-*.parquet")) and not current_run(OutputStore.open(str(out))).committed()


def test_categorical_and_large_string_columns_encode(counting_encoder):
    import pyarrow as pa

    for values in (
        pd.Categorical(["a", "b", "a"]),
        pd.array(["a", "b", "c"], dtype=pd.ArrowDtype(pa.large_string())),
    ):
        ddf = dd.from_pandas(pd.DataFrame({"text": values}), npartitions=1)
        assert len(ddf.surge.encode("text", model=counting_encoder).compute(scheduler="sync")) == 3


def test_parquet_input_needs_one_task_per_superbatch_and_nothing_else(tmp_path, tiny_model):
    from dask_surge.testing import write_partitioned_parquet

    sizes = [3, 0, 40, 5, 1, 7, 2]
    write_partitioned_parquet(tmp_path / "in", sizes, seed=8)
    ddf = dd.read_parquet(str(tmp_path / "in"))
    out = ddf.surge.encode("text", model=tiny_model, b_min=8, b_max=16, keep=["doc_id"], device="cpu")
    plan = dask_surge.plan_superbatches(sizes, 8, 16)
    # one task per SuperBatch, plus one read of the partition sliced over three of them
    assert len(out.optimize().__dask_graph__()) == len(plan) + 1 and len(plan) == out.npartitions
    whole = dd.read_parquet(str(tmp_path / "in")).surge.encode(
        "text", model=tiny_model, b_min=8, b_max=100, keep=["doc_id"], device="cpu"
    )
    assert len(whole.optimize().__dask_graph__()) == whole.npartitions  # no slice: nothing else
    fast = out.compute(scheduler="sync")
    # same rows and embeddings as the generic path over the same data in memory
    mem = make_partitioned_frame(sizes, seed=8)
    slow = mem.surge.encode("text", model=tiny_model, b_min=8, b_max=16, keep=["doc_id"], device="cpu")
    slow = slow.compute(scheduler="sync")
    assert list(zip(fast.partition, fast.row, fast.doc_id)) == list(
        zip(slow.partition, slow.row, slow.doc_id)
    )
    np.testing.assert_allclose(_emb(fast), _emb(slow), rtol=1e-5, atol=1e-6)


def test_megabyte_texts_are_truncated_like_sentence_transformers(tiny_model):
    big = "word " * 220_000  # 1.1 MB
    texts = [big, "short", big[:5000]]
    ddf = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=2)
    df = ddf.surge.encode("text", model=tiny_model, device="cpu").compute(scheduler="sync")
    assert cosines(_emb(df), _reference(tiny_model, texts)).min() >= 0.9999


def test_read_embeddings_cudf_backend(tmp_path, counting_encoder):
    ddf = make_partitioned_frame([2, 3])
    ddf.surge.encode("text", str(tmp_path / "o"), model=counting_encoder, scheduler="sync", progress=False)
    with pytest.raises(SurgeValueError, match="backend='arrow'"):
        dask_surge.read_embeddings(str(tmp_path / "o"), backend="arrow")
    pytest.importorskip("cudf", reason="RAPIDS cuDF is not installed (no GPU here)")
    gdf = dask_surge.read_embeddings(str(tmp_path / "o"), backend="cudf").compute()
    assert len(gdf) == 5


def test_dask_cudf_text_column_encodes_like_pandas(tmp_path, counting_encoder):
    pytest.importorskip("dask_cudf", reason="RAPIDS dask-cuDF is not installed (no GPU here)")
    sizes = [3, 0, 9, 2]
    ddf = make_partitioned_frame(sizes, seed=21)
    gddf = ddf.to_backend("cudf")
    kw = dict(model=counting_encoder, b_min=4, b_max=8, keep=["doc_id"])
    want = ddf.surge.encode("text", **kw).compute(scheduler="sync")
    got = gddf.surge.encode("text", **kw).compute(scheduler="sync")
    assert list(zip(got.partition, got.row, got.doc_id)) == list(zip(want.partition, want.row, want.doc_id))
    np.testing.assert_array_equal(_emb(got), _emb(want))
    res = gddf.surge.encode("text", str(tmp_path / "o"), scheduler="sync", progress=False, **kw)
    assert res.rows == sum(sizes)


def test_first_superbatch_is_small_and_a_resume_keeps_the_recorded_ramp(tmp_path, counting_encoder):
    """A new run's SuperBatches ramp up from surge.first-superbatch rows to b_min, the run records the
    ramp, and a resume plans the same SuperBatches whatever the config says then (no row twice)."""
    from dask_surge.testing import write_partitioned_parquet

    sizes = [4] * 30
    write_partitioned_parquet(tmp_path / "in", sizes)
    ddf = dd.read_parquet(str(tmp_path / "in"))  # sizes known from the footers: a planned run
    out = tmp_path / "emb"
    kw = dict(model=counting_encoder, b_min=32, b_max=64, scheduler="sync", progress=False)
    with dask.config.set({"surge.first-superbatch": 4}):
        res = ddf.surge.encode("text", str(out), **kw)
    assert [r.rows for r in res.records][:5] == [4, 8, 16, 32, 32]  # thresholds 4, 8, 16, then b_min
    assert counting_encoder.calls[-len(res.records) :] == [r.rows for r in res.records]  # a model call each
    run = json.loads(next(out.glob("_surge/runs/*/run.json")).read_text())
    assert run["plan"]["first"] == 4 and run["plan"]["cut_ramp"] is True
    records = sorted((out / "_surge" / "runs").glob("*/commits/*.json"))
    for rec in records[:2]:  # the first two SuperBatches as if never committed
        rec.unlink()
    next(out.glob("_surge/runs/*/COMPLETE")).unlink()
    counting_encoder.calls.clear()
    with dask.config.set({"surge.first-superbatch": None}):  # another ramp asked: the recorded one plans
        again = ddf.surge.encode("text", str(out), **kw)
    assert sorted(counting_encoder.calls) == [4, 8]
    back = dask_surge.read_embeddings(str(out)).compute()
    assert len(back) == sum(sizes) == len(back[["partition", "row"]].drop_duplicates())
    assert again.rows == sum(sizes)
    with dask.config.set({"surge.first-superbatch": 4}):  # plan() shows the SuperBatches a new run makes
        planned = dask_surge.plan(ddf, "text", b_min=32, b_max=64, scheduler="sync")
    assert [sb.rows for sb in planned.superbatches] == [r.rows for r in res.records]


def test_the_ramp_cuts_partitions_and_a_resume_redoes_exactly_the_lost_pieces(tmp_path, counting_encoder):
    """Partitions larger than the ramp's thresholds are cut: the first SuperBatch holds
    surge.first-superbatch rows, not a whole partition; pieces of one partition in several
    SuperBatches come back once each, and a resume after losing two such commits encodes exactly
    their rows. A run recorded before cutting (no ``cut_ramp``) keeps planning whole partitions."""
    from dask_surge.io.manifest import RunPlan
    from dask_surge.testing import write_partitioned_parquet

    sizes = [10] * 12
    write_partitioned_parquet(tmp_path / "in", sizes)
    ddf = dd.read_parquet(str(tmp_path / "in"))
    out = tmp_path / "emb"
    kw = dict(model=counting_encoder, b_min=32, b_max=64, scheduler="sync", progress=False)
    with dask.config.set({"surge.first-superbatch": 4}):
        res = ddf.surge.encode("text", str(out), **kw)
    assert [r.rows for r in res.records] == [4, 8, 16, 32, 40, 20]  # cut at 4, 8, 16 rows, then b_min
    assert [s[:3] for s in res.records[1].spans] == [(0, 4, 10), (1, 0, 2)]
    records = sorted((out / "_surge" / "runs").glob("*/commits/*.json"))
    assert len(records) == 6
    for rec in records[1:3]:  # the SuperBatches of 8 and 16 rows, as if never committed
        rec.unlink()
    next(out.glob("_surge/runs/*/COMPLETE")).unlink()
    counting_encoder.calls.clear()
    again = ddf.surge.encode("text", str(out), **kw)
    assert sorted(counting_encoder.calls) == [8, 16] and again.rows == sum(sizes)
    back = dask_surge.read_embeddings(str(out)).compute()
    assert len(back) == sum(sizes) == len(back[["partition", "row"]].drop_duplicates())
    old = RunPlan.of({"b_min": 32, "b_max": 64, "mode": "planned", "partitions": 12, "first": 4})
    assert old is not None and old.cut_ramp is False and "cut_ramp" not in old.as_dict()


def test_kept_columns_of_every_dtype_come_through_whole_and_in_order():
    """keep= columns of several dtypes, over small partitions joined into SuperBatches, one with a
    dtype its neighbours do not share (pandas then promotes, as a concat of the partitions does)."""
    sizes = [3, 1, 4, 2, 5]
    frames = []
    for i, n in enumerate(sizes):
        start = sum(sizes[:i])
        frames.append(
            pd.DataFrame(
                {
                    "text": pd.array([f"text {start + j}" for j in range(n)], dtype="string[pyarrow]"),
                    "doc_id": np.arange(start, start + n),
                    "label": pd.Categorical([["a", "b"][j % 2] for j in range(n)], categories=["a", "b"]),
                    "when": pd.date_range("2026-01-01", periods=n, freq="h", tz="UTC")
                    + pd.Timedelta(days=start),
                    "score": pd.array([None if j == 0 else j for j in range(n)], dtype="Int64"),
                    "mixed": np.arange(n, dtype=np.int64) if i != 2 else np.arange(n, dtype=np.float64) + 0.5,
                }
            )
        )
    ddf = dd.from_map(
        lambda i: frames[i],
        list(range(len(sizes))),
        meta=frames[0].iloc[:0].astype({"mixed": "float64"}),
        divisions=[None] * (len(sizes) + 1),
    )
    keep = ["doc_id", "label", "when", "score", "mixed"]
    out = ddf.surge.encode("text", model=lambda t: np.ones((len(t), 4)), b_min=6, b_max=9, keep=keep).compute(
        scheduler="sync"
    )
    whole = pd.concat(frames, ignore_index=True)
    assert out["doc_id"].tolist() == whole["doc_id"].tolist()
    for col in ("label", "when", "score"):
        assert out[col].dtype == whole[col].dtype, col
        pd.testing.assert_series_equal(out[col].reset_index(drop=True), whole[col], check_names=False)
    assert out["mixed"].astype(float).tolist() == whole["mixed"].astype(float).tolist()


def test_a_kept_column_named_twice_is_refused(tmp_path):
    # issue 60.7: keep=["doc_id", "doc_id"] was accepted (and silently deduplicated)
    ddf = make_partitioned_frame([3, 3])
    with pytest.raises(
        SurgeValueError,
        match=r"keep=\['doc_id', 'doc_id'\] names 'doc_id' more than once.*"
        r"Fix: name each column once, e.g. keep=\['doc_id'\]",
    ):
        ddf.surge.encode(
            "text",
            str(tmp_path / "out"),
            model=lambda t: np.ones((len(t), 4)),
            keep=["doc_id", "doc_id"],
            progress=False,
        )
    assert not (tmp_path / "out").exists()
