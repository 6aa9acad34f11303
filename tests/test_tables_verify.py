"""``dask-surge status --verify`` (and :func:`dask_surge.io.verify.verify`) of a table output: the table's
own history, rows and data files checked against the run's manifest, for Lance, Delta and Iceberg (through
pyiceberg's SQL catalog on SQLite); ``--repair`` refuses a table; plain ``status`` describes it."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dask_surge
from dask_surge import SurgeOutputError
from dask_surge.cli import main
from dask_surge.io.manifest import current_run
from dask_surge.io.store import OutputStore
from dask_surge.io.tables import RUN_PROPERTY, SUPERBATCHES_PROPERTY
from dask_surge.io.verify import repair, verify
from dask_surge.testing import numbered_frame, table_class, table_encode

N, NPART = 300, 3
FORMATS = ["lance", "delta", "iceberg"]


@pytest.fixture(params=FORMATS)
def fmt(request):
    """Each table format; Iceberg through a SQL catalog on SQLite (``surge.iceberg-catalog`` while the test runs)."""
    pytest.importorskip({"lance": "lance", "delta": "deltalake", "iceberg": "pyiceberg"}[request.param])
    if request.param == "iceberg":
        request.getfixturevalue("iceberg_catalog")
    return request.param


def _encode(out, fmt: str, **kw):
    return table_encode(out, fmt, numbered_frame(N, NPART), **kw)


def _table(out, fmt: str):
    """The table, as its own library opens it (Iceberg: through the configured catalog)."""
    if fmt == "lance":
        import lance

        return lance.dataset(str(out))
    if fmt == "delta":
        import deltalake

        return deltalake.DeltaTable(str(out))
    import dask
    from pyiceberg.catalog import load_catalog

    props = dict(dask.config.get("surge.iceberg-catalog"))
    return load_catalog(props.pop("name"), **props).load_table(
        f"default.{os.path.basename(out).split('.')[0]}"
    )


def _arrow(out, fmt: str) -> pa.Table:
    t = _table(out, fmt)
    return t.to_table() if fmt == "lance" else t.to_pyarrow_table() if fmt == "delta" else t.scan().to_arrow()


def _data_files(out, fmt: str) -> list[str]:
    """Local paths of the data files the table's latest version references."""
    t = _table(out, fmt)
    if fmt == "lance":
        return [f"{out}/data/{d.path}" for frag in t.get_fragments() for d in frag.data_files()]
    if fmt == "delta":
        return [u.removeprefix("file://") for u in t.file_uris()]
    return [task.file.file_path.removeprefix("file://") for task in t.scan().plan_files()]


def _commit_again(out, fmt: str, run_id: str, sb: str) -> int:
    """Commit the rows of SuperBatch ``sb`` once more, by hand with the table's library, naming ``sb`` in the
    commit metadata as dask-surge does (what two claim holders at once would do); returns how many rows."""
    manifest = current_run(OutputStore.open(str(out)))
    assert manifest is not None
    rec = manifest.committed()[sb]
    data = _arrow(out, fmt)
    keep = pc.or_(
        *[
            pc.and_(
                pc.equal(data["partition"], p),
                pc.and_(pc.greater_equal(data["row"], a), pc.less(data["row"], b)),
            )
            for p, a, b, _ in rec.spans
        ],
        pa.scalar(False),
    )
    rows = data.filter(keep)
    props = {RUN_PROPERTY: run_id, SUPERBATCHES_PROPERTY: json.dumps([sb])}
    if fmt == "lance":
        import lance

        lance.write_dataset(rows, str(out), mode="append", transaction_properties=props)
    elif fmt == "delta":
        import deltalake
        from deltalake import CommitProperties

        deltalake.write_deltalake(
            str(out), rows, mode="append", commit_properties=CommitProperties(custom_metadata=props)
        )
    else:
        _table(out, fmt).append(rows, snapshot_properties=props)
    return rows.num_rows


def _cli(out, *flags) -> int:
    return main(["status", *flags, str(out)])


def test_a_clean_table_verifies_and_status_describes_it(tmp_path, fmt, capsys):
    out = tmp_path / f"t.{fmt}"
    _encode(out, fmt)
    assert verify(str(out)) == []
    info = dask_surge.status(str(out))
    table = info["table"]
    assert table["format"] == fmt and table["rows"] == N and table["run_versions"] >= 1
    assert table["versions"] >= table["run_versions"] and isinstance(table["last_commit"], float)
    assert _cli(out, "--verify") == 0
    shown = capsys.readouterr().out
    assert f"{fmt}, {N:,} rows in version" in shown and "last table commit 20" in shown
    assert f"every committed SuperBatch is in the {fmt} table once" in shown
    assert "part-" not in shown and "did not write" not in shown  # no Parquet-layout findings
    assert _cli(out, "--json") == 0
    as_json = json.loads(capsys.readouterr().out)["table"]
    assert as_json["last_commit"].startswith("20") and "T" in as_json["last_commit"]  # ISO 8601


def test_a_missing_data_file_is_named_and_fails_the_cli(tmp_path, fmt, capsys):
    out = tmp_path / f"t.{fmt}"
    _encode(out, fmt)
    gone = _data_files(out, fmt)[0]
    os.remove(gone)
    problems = verify(str(out))
    assert len(problems) == 1, problems
    assert problems[0].startswith(gone) and "references is missing" in problems[0] and "Fix:" in problems[0]
    assert _cli(out, "--verify") == 1
    assert gone in capsys.readouterr().out


def test_a_superbatch_committed_twice_is_named_and_fails_the_cli(tmp_path, fmt, capsys):
    out = tmp_path / f"t.{fmt}"
    res = _encode(out, fmt)
    sb = sorted(r.sb for r in res.records)[1]
    extra = _commit_again(out, fmt, res.run_id, sb)
    assert extra > 0
    t = _table(out, fmt)  # the hand-made commit is the latest version, as the table's library numbers it
    latest = (
        t.version if fmt == "lance" else t.version() if fmt == "delta" else t.metadata.last_sequence_number
    )
    problems = verify(str(out))
    assert any(
        f"SuperBatch {sb} of run {res.run_id} is committed by 2 versions of the {fmt} table" in p
        and f" {latest};" in p
        and "Fix: rerun the same encode call" in p
        for p in problems
    ), problems
    assert any(f"holds {N + extra:,} rows" in p and f"{extra:,} more than expected" in p for p in problems)
    assert _cli(out, "--verify") == 1
    assert f"SuperBatch {sb}" in capsys.readouterr().out
    if fmt == "lance":  # the rerun the fix names repairs it: the fragments of the second copy are deleted
        _encode(out, fmt)
        assert verify(str(out)) == []
    else:  # Delta and Iceberg cannot drop the files a second copy added: the rerun says so, changing nothing
        with pytest.raises(SurgeOutputError, match=r"twice.*Nothing was changed. Fix: encode to a new path"):
            _encode(out, fmt)


def test_rows_appended_by_other_writers_are_accounted_for(tmp_path, fmt):
    out = tmp_path / f"t.{fmt}"
    first = _encode(out, fmt)
    rows = _arrow(out, fmt).slice(0, 7)  # another writer's append (no dask-surge metadata)
    if fmt == "lance":
        import lance

        lance.write_dataset(rows, str(out), mode="append")
    elif fmt == "delta":
        import deltalake

        deltalake.write_deltalake(str(out), rows, mode="append")
    else:
        _table(out, fmt).append(rows)
    assert verify(str(out)) == []
    # a second run appending to the table made by the first (mode="append"): the first run's rows are foreign
    table_encode(out, fmt, numbered_frame(200, 2, offset=N), mode="append")
    assert verify(str(out)) == []
    assert dask_surge.status(str(out))["table"]["rows"] == N + 7 + 200
    assert first.run_id != current_run(OutputStore.open(str(out))).run_id


def test_another_writers_delete_after_the_run_is_named(tmp_path):
    lance = pytest.importorskip("lance")
    out = tmp_path / "t.lance"
    _encode(out, "lance")
    lance.dataset(str(out)).delete("row = 0")
    problems = verify(str(out))
    assert any("(Delete, by another writer) came after this run's commits" in p for p in problems), problems
    assert any(f"holds {N - NPART:,} rows" in p and f"{NPART} fewer than expected" in p for p in problems)


def test_repair_refuses_a_table_output_and_changes_nothing(tmp_path, fmt, capsys):
    out = tmp_path / f"t.{fmt}"
    _encode(out, fmt)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(SurgeOutputError, match=rf"is a {fmt} table output.*Nothing was changed\. Fix:"):
        repair(str(out))
    assert _cli(out, "--repair") == 2
    assert "Nothing was changed" in capsys.readouterr().err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_superbatches_no_table_version_holds_are_named_until_a_rerun_commits_them(tmp_path, fmt, monkeypatch):
    out = tmp_path / f"t.{fmt}"
    cls = table_class(fmt)
    real, calls = cls.commit, []

    def commit(self, *args, **kwargs):  # the store fails every table commit after the first
        if calls:
            raise OSError("the table's store is down")
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "commit", commit)
    with pytest.raises(OSError, match="store is down"):
        _encode(out, fmt, b_min=50, b_max=100)
    monkeypatch.undo()
    manifest = current_run(OutputStore.open(str(out)))
    assert manifest is not None and len(manifest.committed()) > 1  # records made; one table commit
    problems = verify(str(out))
    assert any("are in no version of the" in p and "Fix: rerun the same encode call" in p for p in problems)
    assert any("fewer than expected" in p for p in problems), problems
    _encode(out, fmt, b_min=50, b_max=100)
    assert verify(str(out)) == []


def test_a_lance_output_on_loopback_s3_verifies_and_names_a_missing_file(tmp_path):
    pytest.importorskip("lance")
    pytest.importorskip("moto.server")
    from dask_surge.testing import loopback_s3

    with loopback_s3("surge-verify") as (_, options, fs):
        out = "s3://surge-verify/t.lance"
        _encode(out, "lance", storage_options=options)
        assert verify(out, options) == []
        assert dask_surge.status(out, options)["table"]["rows"] == N
        gone = sorted(fs.ls("surge-verify/t.lance/data"))[0]
        fs.rm(gone)
        problems = verify(out, options)
        assert len(problems) == 1 and problems[0].startswith(gone) and "missing" in problems[0], problems


def test_a_table_whose_old_versions_were_cleaned_up_still_verifies(tmp_path):
    lance = pytest.importorskip("lance")
    from datetime import timedelta

    out = tmp_path / "t.lance"
    import dask

    with dask.config.set({"surge.table-commit-every": 1}):
        _encode(out, "lance", b_min=50, b_max=100)
    ds = lance.dataset(str(out))
    ds.cleanup_old_versions(older_than=timedelta(0), delete_unverified=True)
    assert (
        len(lance.dataset(str(out)).versions()) == 1
    )  # the SuperBatches of earlier versions are not named now
    assert verify(str(out)) == []
    lance.dataset(str(out)).delete("row = 0")  # rows lost are still found, by count
    assert any("fewer than expected (its versions before" in p for p in verify(str(out)))
