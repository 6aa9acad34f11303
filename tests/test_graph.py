"""The input graph (:mod:`dask_surge.execution.inputs`): one task per unit, shared by the lazy
frame and the written run; a partition several units consume is computed once; a plain
``read_parquet`` is read by the unit tasks themselves."""

from __future__ import annotations

from collections import Counter

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge.errors import SurgeError
from dask_surge.execution.graph import FusedSuperBatchExpr, SuperBatchFrame
from dask_surge.execution.inputs import InputGraph, Unit, UnitSource
from dask_surge.io.parquet import ParquetPartitions
from dask_surge.planning.policy import plan_superbatches
from dask_surge.testing import make_partitioned_frame, write_partitioned_parquet


def lengths(source: UnitSource, values: list, unit: Unit) -> list[tuple[int, int]]:
    """A unit task function: ``(partition, rows)`` of each of its partitions, in order."""
    return [(p, len(frame)) for p, frame in source.iterate(unit.partitions, values)]


class Calls:
    """A map_partitions step that counts the partitions it computes (by their first doc_id)."""

    def __init__(self) -> None:
        self.seen: Counter = Counter()

    def __call__(self, frame):
        self.seen[int(frame["doc_id"].iloc[0]) if len(frame) else None] += 1
        return frame


def _run(graph: dict, key):
    return dask.get(graph, key)


def test_a_unit_is_one_task_that_computes_its_partitions_in_order():
    sizes = [3, 5, 2, 4]
    ddf = make_partitioned_frame(sizes)
    ddf = ddf.map_partitions(lambda f: f.assign(text=f.text + "!"), meta=ddf._meta)
    inputs = InputGraph(ddf)
    assert not inputs.is_parquet and inputs.npartitions == 4
    graph = inputs.task("u", lengths, Unit((1, 2, 3)))
    assert list(graph) == ["u"] and graph["u"].data_producer  # every upstream task fused in
    assert _run(graph, "u") == [(1, 5), (2, 2), (3, 4)]


def test_a_partition_other_units_consume_is_a_task_of_its_own_computed_once():
    sizes = [3, 5, 2]
    calls = Calls()
    ddf = make_partitioned_frame(sizes)
    ddf = ddf.map_partitions(calls, meta=ddf._meta)
    inputs = InputGraph(ddf)
    first = inputs.task("a", lengths, Unit((0, 1)), shared={1})
    second = inputs.task("b", lengths, Unit((1, 2)), shared={1})
    assert set(first) == {"a", (inputs.name, 1)} and set(second) == {"b", (inputs.name, 1)}
    calls.seen.clear()
    got = dask.get({**first, **second}, ["a", "b"])
    assert list(got) == [[(0, 3), (1, 5)], [(1, 5), (2, 2)]]
    assert calls.seen == Counter({0: 1, 3: 1, 8: 1})  # partition 1 (doc_id 3...) computed once


def test_parquet_units_read_their_own_files_and_a_shared_one_once(tmp_path, parquet_reads):
    sizes = [4, 0, 9, 2]
    write_partitioned_parquet(tmp_path / "in", sizes, seed=3)
    reads = parquet_reads
    inputs = InputGraph(dd.read_parquet(tmp_path / "in")[["text", "doc_id"]])
    assert inputs.is_parquet
    alone = inputs.task("u", lengths, Unit((0, 1, 2, 3)))
    assert list(alone) == ["u"]  # no per-partition task
    assert _run(alone, "u") == list(enumerate(sizes))
    assert reads == Counter({4: 1, 0: 1, 9: 1, 2: 1})
    reads.clear()
    first = inputs.task("a", lengths, Unit((0, 2)), shared={2})
    second = inputs.task("b", lengths, Unit((2, 3)), shared={2})
    assert set(first) | set(second) == {"a", "b", (inputs.name, 2)}
    assert list(dask.get({**first, **second}, ["a", "b"])) == [[(0, 4), (2, 9)], [(2, 9), (3, 2)]]
    assert reads == Counter({4: 1, 9: 1, 2: 1})


def test_an_input_repartitioned_after_planning_is_refused():
    ddf = make_partitioned_frame([3, 3, 3])
    with pytest.raises(SurgeError, match="re-partitioned it after planning"):
        InputGraph(ddf, planned=4)


@pytest.mark.parametrize("source", ["memory", "parquet"])
def test_the_lazy_frame_is_one_unit_task_per_superbatch_with_priorities(tmp_path, source):
    sizes = [3, 30, 2, 5, 1]
    if source == "parquet":
        write_partitioned_parquet(tmp_path / "in", sizes, seed=4)
        ddf = dd.read_parquet(tmp_path / "in")
    else:
        ddf = make_partitioned_frame(sizes, seed=4)
    out = ddf.surge.encode("text", model=lambda t: np.ones((len(t), 2)), b_min=6, b_max=12, keep=["doc_id"])
    plan = plan_superbatches(sizes, 6, 12)
    expr = out.optimize().expr
    assert isinstance(expr, FusedSuperBatchExpr)
    graph, priority = expr._fused
    own = [k for k in graph if k[0] == expr._name]
    shared = [k for k in graph if k[0] != expr._name]
    assert sorted(k[1] for k in own) == list(range(len(plan)))
    assert len(shared) == 1 and shared[0][1] == 1  # partition 1, sliced over three SuperBatches
    assert all(isinstance(graph[k].func, SuperBatchFrame) and graph[k].data_producer for k in own)
    assert [priority[(expr._name, i)] for i in range(len(plan))] == [len(plan) - i for i in range(len(plan))]
    first = next(i for i, sb in enumerate(plan) if 1 in {s.partition for s in sb.spans})
    assert priority[shared[0]] == len(plan) - first
    df = out.compute(scheduler="sync")
    assert df["doc_id"].tolist() == list(range(sum(sizes)))


def test_a_written_run_and_the_lazy_frame_encode_the_same_rows(tmp_path):
    sizes = [3, 30, 2, 5, 1]
    write_partitioned_parquet(tmp_path / "in", sizes, seed=5)
    ddf = dd.read_parquet(tmp_path / "in")
    kw = {
        "model": lambda t: np.asarray([[len(x), 1.0] for x in t]),
        "b_min": 6,
        "b_max": 12,
        "keep": ["doc_id"],
    }
    lazy = ddf.surge.encode("text", **kw).compute(scheduler="sync")
    res = ddf.surge.encode("text", str(tmp_path / "o"), scheduler="sync", progress=False, **kw)
    back = dask_surge.read_embeddings(str(tmp_path / "o")).compute().sort_values(["partition", "row"])
    assert res.rows == len(lazy) == len(back) == sum(sizes)
    pd.testing.assert_frame_equal(
        lazy[["partition", "row", "doc_id"]].reset_index(drop=True),
        back[["partition", "row", "doc_id"]].reset_index(drop=True),
        check_dtype=False,
    )
    assert np.allclose(np.stack(lazy["embedding"].tolist()), np.stack(back["embedding"].tolist()))


def _legacy_inputs(ddf):
    """Pipelines whose Dask layers build legacy tuple tasks (a repartition to fewer partitions;
    a merge, a shuffle and a groupby-apply through the disk shuffle, a local scheduler's
    default), not task specs."""
    other = dd.from_pandas(
        pd.DataFrame({"doc_id": np.arange(40), "weight": np.arange(40) * 0.5}), npartitions=3
    )
    with dask.config.set({"dataframe.shuffle.method": "disk"}):
        grouped = (
            ddf.assign(key=ddf.doc_id % 3)
            .groupby("key")
            .apply(
                lambda g: g[list(ddf.columns)].assign(n=len(g)), meta=ddf._meta.assign(n=np.int64(0)).iloc[:0]
            )
        )
    parts = [dask.delayed(ddf.get_partition(i).compute(scheduler="sync")) for i in range(ddf.npartitions)]
    return {
        # not legacy tasks, but keyed apart from the node Dask files under the key (below)
        "from_delayed": dd.from_delayed(parts, meta=ddf._meta, verify_meta=False),
        "repartition": ddf.repartition(npartitions=2),
        "merge": ddf.merge(other, on="doc_id", shuffle_method="disk"),
        "shuffle": ddf.shuffle("doc_id", shuffle_method="disk"),
        "groupby-apply": grouped,
    }


LEGACY = ["repartition", "merge", "shuffle", "groupby-apply"]
#: inputs whose graph files a node under another key than its own: ``from_delayed`` without
#: ``verify_meta`` files each partition as ``Alias(delayed key)`` under ``(fromdelayed, i)``
REKEYED = ["from_delayed"]


@pytest.mark.parametrize("name", LEGACY)
def test_units_over_legacy_tuple_tasks_compute_their_partitions(name):
    ddf = make_partitioned_frame([3, 5, 2, 4, 6])
    frame = _legacy_inputs(ddf)[name]
    with dask.config.set({"optimization.tune.active": False}):
        legacy = [v for v in frame.expr.optimize(fuse=True).__dask_graph__().values() if isinstance(v, tuple)]
    assert legacy  # what this test is about: Dask still builds these as tuples
    inputs = InputGraph(frame)
    want = [len(frame.get_partition(p).compute(scheduler="sync")) for p in range(frame.npartitions)]
    everything = Unit(tuple(range(frame.npartitions)))
    assert _run(inputs.task("u", lengths, everything), "u") == list(enumerate(want))
    assert sum(want) == 20


@pytest.mark.parametrize("name", REKEYED)
def test_units_over_nodes_filed_under_another_key_compute_their_partitions(name):
    frame = _legacy_inputs(make_partitioned_frame([3, 5, 2, 4, 6]))[name]
    with dask.config.set({"optimization.tune.active": False}):
        graph = dict(frame.expr.optimize(fuse=True).__dask_graph__())
    assert any(getattr(v, "key", k) != k for k, v in graph.items())  # what this test is about
    everything = Unit(tuple(range(frame.npartitions)))
    assert _run(InputGraph(frame).task("u", lengths, everything), "u") == list(enumerate([3, 5, 2, 4, 6]))


@pytest.mark.parametrize("name", LEGACY + REKEYED)
def test_a_pipeline_of_legacy_tasks_is_encoded_whole_by_both_paths(tmp_path, name):
    frame = _legacy_inputs(make_partitioned_frame([3, 5, 2, 4, 6]))[name]
    kw = {
        "model": lambda t: np.asarray([[len(x), 1.0] for x in t]),
        "b_min": 4,
        "b_max": 8,
        "keep": ["doc_id"],
    }
    lazy = frame.surge.encode("text", **kw).compute(scheduler="sync")
    res = frame.surge.encode("text", str(tmp_path / "o"), scheduler="sync", progress=False, **kw)
    back = dask_surge.read_embeddings(str(tmp_path / "o")).compute()
    assert res.rows == len(back) == len(lazy) == 20
    assert sorted(back["doc_id"]) == sorted(lazy["doc_id"]) == list(range(20))


def test_a_persisted_input_repartitioned_on_a_client_is_encoded_whole(tmp_path, client):
    # the repartition's tuple tasks name the persisted partitions (Futures), which stay results
    persisted = make_partitioned_frame([3, 5, 2, 4, 6]).persist()
    frame = persisted.repartition(npartitions=2)
    inputs = InputGraph(frame)
    assert any(type(v).__name__ == "Future" for v in inputs.graph.values())
    kw = {
        "model": lambda t: np.asarray([[len(x), 1.0] for x in t]),
        "b_min": 4,
        "b_max": 8,
        "keep": ["doc_id"],
    }
    res = frame.surge.encode("text", str(tmp_path / "o"), scheduler=client, progress=False, **kw)
    lazy = frame.surge.encode("text", **kw).compute()
    back = dask_surge.read_embeddings(str(tmp_path / "o")).compute()
    assert res.rows == len(back) == len(lazy) == 20
    assert sorted(back["doc_id"]) == sorted(lazy["doc_id"]) == list(range(20))


@pytest.mark.parametrize("read", ["filters", "index", "hive"])
def test_a_parquet_read_dask_would_tune_is_encoded_on_its_own_partitions(tmp_path, read):
    # Dask's "tune" pass fuses small Parquet partitions when it computes a frame: the sizes
    # pass of the lazy frame counted 2 partitions where the unit tasks read 3, and it stopped
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    for f in range(6):
        ids = np.arange(f * 30, f * 30 + 30)
        pq.write_table(
            pa.table({"doc_id": ids, "text": [f"doc {i}" for i in ids], "grp": [f"g{i % 3}" for i in ids]}),
            tmp_path / "in" / f"part{f}.parquet",
            row_group_size=7,
        )
    if read == "filters":
        frame = dd.read_parquet(tmp_path / "in", filters=[("doc_id", ">", 100)])
    elif read == "index":
        frame = dd.read_parquet(tmp_path / "in", index="doc_id")
    else:
        pd.read_parquet(tmp_path / "in").to_parquet(tmp_path / "hive", partition_cols=["grp"])
        frame = dd.read_parquet(tmp_path / "hive")
    # the text column alone (no keep=) is a third of the columns: Dask fuses partitions when it computes it
    tuned = frame[["text"]].map_partitions(len, meta=(None, "int64")).compute(scheduler="sync")
    assert len(tuned) < frame.npartitions  # what this test is about
    want = sorted(len(t) for t in frame["text"].compute(scheduler="sync"))
    kw = {"model": lambda t: np.asarray([[len(x), 1.0] for x in t]), "b_min": 20, "b_max": 40}
    lazy = frame.surge.encode("text", **kw).compute(scheduler="sync")
    res = frame.surge.encode("text", str(tmp_path / "o"), scheduler="sync", progress=False, **kw)
    assert res.rows == len(lazy) == len(want)
    assert sorted(int(e[0]) for e in lazy["embedding"]) == want


def test_unit_source_mixes_shared_values_fused_nodes_and_reads(tmp_path):
    write_partitioned_parquet(tmp_path / "in", [2, 3], seed=6)
    reader = ParquetPartitions.of(dd.read_parquet(tmp_path / "in").expr)
    assert reader is not None and len(reader.pieces) == 2
    shared = pd.DataFrame({"text": ["s"]})
    source = UnitSource(external=("k",), reader=reader.subset([1]), shared={0: "k"})
    got = list(source.iterate([0, 1], [shared]))
    assert [p for p, _ in got] == [0, 1] and got[0][1] is shared and len(got[1][1]) == 3
    with pytest.raises(KeyError, match="not part of this unit"):
        list(UnitSource().iterate([5], []))
