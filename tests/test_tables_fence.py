"""A paused claim holder never commits (issue 67): every table format fences its commits in the store.

Run A holds the claim and is *paused* (SIGSTOP, a suspended SLURM job, a VM pause) at a step of a table
commit: before its fence (the table's creation), or after reading the table's history and before its
first or second commit of SuperBatches. Its claim goes stale (no heartbeat past the claim's lifetime),
run B (the same call, another process) takes the claim over and completes the run; then A wakes and
goes on with the commit it had prepared. The table must refuse it: every row once, every SuperBatch in
one version, B's result true, A stopped with a message that says its claim was taken over.

The pause is simulated in A's own process, deterministically: A's commit is intercepted at the chosen
step, its heartbeat stopped and its heartbeat file aged past the claim's lifetime (what a pause does),
B runs to completion in a subprocess, then A's prepared commit proceeds. The SIGSTOP sweep over real
processes is in tests/test_tables_sweep.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from dask_surge.errors import SurgeOutputError
from dask_surge.io.lease import Claim
from dask_surge.io.store import OutputStore
from dask_surge.io.tables import SUPERBATCHES_PROPERTY
from dask_surge.testing import (
    TABLE_PARTITIONS,
    TABLE_ROWS,
    SleepyModel,
    numbered_frame,
    table_class,
    table_driver,
)

pytest.importorskip("lance")
pytest.importorskip("deltalake")
pytest.importorskip("pyiceberg")

SLEEP = 0.01


def _run(out, fmt: str, **kw):
    return numbered_frame(TABLE_ROWS, TABLE_PARTITIONS).surge.encode(
        "text",
        output=str(out),
        format=fmt,
        model=SleepyModel(SLEEP),
        keep=["doc_id"],
        b_min=50,
        b_max=100,
        scheduler="threads",
        progress=False,
        **kw,
    )


def _age_claim(out) -> None:
    """What a pause past the claim's lifetime does: no heartbeat since long ago."""
    store = OutputStore.open(str(out))
    info = Claim.holder(store)
    assert info is not None
    beat = f"{out}/_surge/.heartbeat-{info['token']}"
    old = time.time() - 600
    for path in (beat, f"{out}/_surge/CLAIM"):
        if os.path.exists(path):
            os.utime(path, (old, old))


def _stop_heartbeats() -> None:
    import threading

    for t in threading.enumerate():  # a paused process beats no more
        if t.name == "dask-surge-claim":
            t._target.__self__._stop.set()  # type: ignore[attr-defined]


def _rows_and_versions(fmt: str, out, catalog) -> tuple[list[int], list[list[str]]]:
    if fmt == "lance":
        import lance

        ds = lance.dataset(str(out))
        ids = ds.to_table(columns=["doc_id"]).column("doc_id").to_pylist()
        props = [ds.read_transaction(v["version"]).transaction_properties or {} for v in ds.versions()]
    elif fmt == "delta":
        import deltalake

        dt = deltalake.DeltaTable(str(out))
        ids = dt.to_pyarrow_table(columns=["doc_id"]).column("doc_id").to_pylist()
        props = dt.history()
    else:
        table = catalog.load_table("default.t")
        ids = table.scan(selected_fields=("doc_id",)).to_arrow().column("doc_id").to_pylist()
        props = [dict(s.summary.additional_properties) for s in table.metadata.snapshots]
    held = [sbs for p in props if (sbs := json.loads(p.get(SUPERBATCHES_PROPERTY) or "[]"))]
    return ids, held


@pytest.mark.parametrize("fmt", ["lance", "delta", "iceberg"])
@pytest.mark.parametrize("step", ["fence", "commit-1", "commit-2"])
def test_a_paused_claim_holder_commits_nothing_after_a_takeover(tmp_path, monkeypatch, fmt, step, request):
    catalog = request.getfixturevalue("iceberg_catalog") if fmt == "iceberg" else None
    import dask

    out = tmp_path / f"t.{fmt}"
    cls = table_class(fmt)
    which, k = ("fence", 1) if step == "fence" else ("commit", int(step[-1]))
    real, calls, b = getattr(cls, which), [], {}

    def paused(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == k:  # A stops here: past its claim's lifetime, B takes over and finishes
            _stop_heartbeats()
            _age_claim(out)
            cat = dask.config.get("surge.iceberg-catalog") if fmt == "iceberg" else None
            done = subprocess.run(
                table_driver(out, fmt, catalog=cat, sleep=SLEEP),
                env={**os.environ, "DASK_SURGE__TABLE_COMMIT_EVERY": "2"},
                capture_output=True,
                text=True,
                timeout=300,
            )
            b.update(rc=done.returncode, out=done.stdout, err=done.stderr)
        return real(self, *args, **kwargs)  # A wakes and goes on with what it prepared

    monkeypatch.setattr(cls, which, paused)
    with (
        dask.config.set({"surge.table-commit-every": 2, "surge.table-commit-seconds": 3600}),
        pytest.raises(SurgeOutputError, match="taken over by another process"),
    ):
        _run(out, fmt)
    assert b["rc"] == 0, b["err"][-3000:]
    assert f"rows {TABLE_ROWS}" in b["out"]  # B's result is true
    ids, held = _rows_and_versions(fmt, out, catalog)
    assert sorted(ids) == list(range(TABLE_ROWS))  # every row once
    flat = [sb for sbs in held for sb in sbs]
    assert len(flat) == len(set(flat))  # every SuperBatch in one version
    monkeypatch.undo()
    again = _run(out, fmt)
    assert again.rows == TABLE_ROWS


# -- a table an earlier build left with a SuperBatch twice (or replaced) is repaired by a rerun ------------


def _first_payload(res) -> tuple[str, str]:
    from dask_surge.io.manifest import CommitRecord

    store = OutputStore.open(res.output)
    first = sorted(r.sb for r in res.records)[0]
    record = CommitRecord.from_json(store.read(f"{res.output}/_surge/runs/{res.run_id}/commits/{first}.json"))
    return first, record.table


@pytest.mark.parametrize("damage", ["append-twice", "overwrite"])
def test_an_earlier_builds_stale_lance_commit_is_repaired_by_a_rerun(tmp_path, damage, caplog):
    """What builds before the fence left (issue 67): a stale Append of a SuperBatch that a newer version
    already holds (rows twice), or a stale Overwrite that replaced every other SuperBatch's rows."""
    import lance
    from lance.fragment import FragmentMetadata

    from dask_surge.io.tables import RUN_PROPERTY

    out = tmp_path / "t.lance"
    res = _run(out, "lance")
    sb, payload = _first_payload(res)
    fragments = [FragmentMetadata.from_json(json.dumps(f)) for f in json.loads(payload)["fragments"]]
    props = {RUN_PROPERTY: res.run_id, SUPERBATCHES_PROPERTY: json.dumps([sb])}  # no token: an old build
    ds = lance.dataset(str(out))
    if damage == "append-twice":
        op = lance.LanceOperation.Append(fragments)
    else:
        op = lance.LanceOperation.Overwrite(ds.schema, fragments)
    lance.LanceDataset.commit(str(out), lance.Transaction(ds.version, op, transaction_properties=props))
    ids, _ = _rows_and_versions("lance", out, None)
    assert len(ids) != TABLE_ROWS  # damaged: rows twice, or all but one SuperBatch's gone
    again = _run(out, "lance")
    ids, _ = _rows_and_versions("lance", out, None)
    assert sorted(ids) == list(range(TABLE_ROWS)) and again.rows == TABLE_ROWS
    if damage == "append-twice":
        assert "removed the second copy" in caplog.text


def test_an_earlier_builds_stale_delta_commit_is_repaired_by_a_rerun(tmp_path):
    """A stale Delta commit added the same files again: the reader shows each row once (one add per path),
    and the history names the SuperBatch twice; a rerun records the repair, and verify finds nothing."""
    import deltalake
    from deltalake.transaction import AddAction, CommitProperties

    from dask_surge.io.tables import RUN_PROPERTY
    from dask_surge.io.verify import verify

    out = tmp_path / "t.delta"
    res = _run(out, "delta")
    sb, payload = _first_payload(res)
    p = json.loads(payload)
    dt = deltalake.DeltaTable(str(out))
    add = AddAction(
        p["path"], int(p["size"]), {}, int(time.time() * 1000), True, json.dumps({"numRecords": p["rows"]})
    )
    props = CommitProperties(
        custom_metadata={RUN_PROPERTY: res.run_id, SUPERBATCHES_PROPERTY: json.dumps([sb])}
    )
    dt.create_write_transaction([add], mode="append", schema=dt.schema(), commit_properties=props)
    assert verify(str(out))  # the history names it twice
    _run(out, "delta")
    ids, _ = _rows_and_versions("delta", out, None)
    assert sorted(ids) == list(range(TABLE_ROWS))
    assert verify(str(out)) == []


# -- a refused output leaves nothing behind -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["lance", "delta"])
def test_someone_elses_table_is_refused_before_anything_is_written(tmp_path, fmt):
    import pyarrow as pa

    out = tmp_path / f"theirs.{fmt}"
    data = pa.table({"doc_id": [1, 2], "text": ["a", "b"]})
    if fmt == "lance":
        import lance

        lance.write_dataset(data, str(out))
    else:
        import deltalake

        deltalake.write_deltalake(str(out), data)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(SurgeOutputError, match=r"did not create.*Nothing was written.*mode='append'"):
        _run(out, fmt)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # no _surge/, no CURRENT, no run


@pytest.mark.parametrize(("theirs", "ours"), [("delta", "lance"), ("lance", "delta"), ("delta", "iceberg")])
def test_a_table_of_another_format_is_refused(tmp_path, theirs, ours, request):
    import pyarrow as pa

    if ours == "iceberg":
        request.getfixturevalue("iceberg_catalog")
    out = tmp_path / "t"
    data = pa.table({"doc_id": [1, 2]})
    if theirs == "lance":
        import lance

        lance.write_dataset(data, str(out))
    else:
        import deltalake

        deltalake.write_deltalake(str(out), data)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(
        SurgeOutputError, match=rf"holds a {theirs} table.*Nothing was written.*format='{theirs}'"
    ):
        _run(out, ours)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_the_refusal_of_another_run_in_a_table_names_a_fix_the_run_accepts(tmp_path):
    out = tmp_path / "t.lance"
    _run(out, "lance")
    other = numbered_frame(200, 4, offset=TABLE_ROWS)
    kw = {
        "output": str(out),
        "format": "lance",
        "model": SleepyModel(SLEEP),
        "keep": ["doc_id"],
        "b_min": 50,
        "b_max": 100,
    }
    with pytest.raises(SurgeOutputError, match=r"different run.*Fix: .*mode='append'") as err:
        other.surge.encode("text", scheduler="threads", progress=False, **kw)
    assert "overwrite=True" not in str(err.value)
    res = other.surge.encode("text", scheduler="threads", progress=False, mode="append", **kw)  # as advised
    assert res.rows == 200
