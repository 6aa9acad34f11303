"""The manifest: a run owns its output, claims it, commits exactly once and explains every failure.

Each test here failed on the code before the run-ownership work (issue 22) and passes after it.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import dask.dataframe as dd
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeInputError, SurgeOutputError
from dask_surge.io.directory import sb_key
from dask_surge.io.lease import Claim
from dask_surge.io.manifest import CommitRecord, RunPlan, current_run, finish_run, open_run
from dask_surge.io.directory import check_output
from dask_surge.io.verify import repair, verify
from dask_surge.results import SuperBatchReport
from dask_surge.testing import CountingEncoder, make_partitioned_frame, write_partitioned_parquet
from dask_surge.io.store import OutputStore

KW = dict(b_min=8, b_max=8, scheduler="sync", progress=False)


def _parts(out) -> list[str]:
    return sorted(p.name for p in out.glob("part-*.parquet"))


def _committed_files(out) -> list[str]:
    return sorted(r.file for r in current_run(OutputStore.open(str(out))).committed().values())


# -- ownership ----------------------------------------------------------------------------------


def test_a_directory_holding_foreign_files_is_refused_and_left_intact(tmp_path, counting_encoder):
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"the user's own data")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(
        SurgeOutputError, match="did not write.*part-00000.parquet.*Fix: write to a new or empty"
    ):
        make_partitioned_frame([4] * 4).surge.encode("text", str(out), model=counting_encoder, **KW)
    assert (out / "part-00000.parquet").read_bytes() == b"the user's own data"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "part-00000.parquet"]  # nothing written


def test_an_input_directory_is_never_an_output(tmp_path, counting_encoder):
    import fsspec

    docs = tmp_path / "docs"
    write_partitioned_parquet(docs, [5] * 12, seed=1)  # part-00000.parquet ... as Spark writes them
    before = {p.name: p.read_bytes() for p in docs.iterdir()}
    with pytest.raises(SurgeOutputError, match="never writes into its input|did not write"):
        dd.read_parquet(str(docs)).surge.encode("text", str(docs), model=counting_encoder, **KW)
    assert {p.name: p.read_bytes() for p in docs.iterdir()} == before
    # and an output inside the input directory: refused as holding an input file? no: it is a new dir
    # of its own, but then the input (docs/) globbed again would not see it (the _ prefix is not there)
    with pytest.raises(SurgeOutputError, match="holds input file"):
        check_output(
            OutputStore.open(str(tmp_path)),
            inputs=[(fsspec.filesystem("file"), str(docs / "part-00000.parquet"))],
        )


def test_finishing_never_deletes_a_file_it_did_not_write(tmp_path, counting_encoder):
    out = tmp_path / "out"
    manifest, _ = open_run(OutputStore.open(str(out)), {"t": 1})
    (out / "part-00000.parquet").write_bytes(b"dropped in by a user while the run went on")
    (out / "part-0123abcd-notours.parquet").write_bytes(b"looks like ours, is not")
    finish_run(manifest, {}, {"rows": 0, "superbatches": 0, "partitions": 0, "nulls_skipped": 0})
    assert (out / "part-00000.parquet").exists() and (out / "part-0123abcd-notours.parquet").exists()


def test_after_complete_the_parquet_files_are_exactly_the_committed_ones(tmp_path):
    out = tmp_path / "out"
    ddf = make_partitioned_frame([4] * 6)
    dask_surge.encode(ddf, "text", str(out), model=CountingEncoder(dim=4), **KW)
    res = dask_surge.encode(ddf, "text", str(out), model=CountingEncoder(dim=6), overwrite=True, **KW)
    assert res.rows == 24
    assert _parts(out) == _committed_files(out)
    assert [r.name for r in (out / "_surge" / "runs").iterdir()] == [res.run_id]
    assert not (out / "_surge" / "retired").exists()


def test_filesystems_without_an_exclusive_create_are_refused(counting_encoder):
    for url in ("ftp://host/emb", "simplecache::s3://bucket/emb", "http://host/emb"):
        with pytest.raises(
            SurgeOutputError, match="needs an atomic write and an exclusive create.*Nothing was"
        ):
            make_partitioned_frame([2]).surge.encode("text", url, model=counting_encoder, **KW)


def test_a_store_that_cannot_be_reached_is_a_clear_error(counting_encoder, monkeypatch):
    pytest.importorskip("s3fs")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    with pytest.raises(
        SurgeOutputError, match="s3://bucket/emb.*cannot be reached.*Nothing was written.*credentials"
    ):
        make_partitioned_frame([2]).surge.encode(
            "text", "s3://bucket/emb", model=counting_encoder, storage_options=options, **KW
        )


def test_an_output_under_a_regular_file_is_a_clear_error(tmp_path, counting_encoder):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(
        SurgeOutputError, match="is under .*file.txt.*which is a file.*Fix: choose a new directory"
    ):
        make_partitioned_frame([2]).surge.encode(
            "text", str(tmp_path / "file.txt" / "emb"), model=counting_encoder, **KW
        )


# -- the claim ----------------------------------------------------------------------------------


def test_a_live_claim_refuses_a_second_run(tmp_path, counting_encoder):
    import fsspec

    out = tmp_path / "out"
    claim = Claim.acquire(OutputStore.open(str(out)), "0123456789abcdef", heartbeat=False)
    with pytest.raises(SurgeOutputError, match="being written by another run .*0123456789abcdef.*Fix: wait"):
        make_partitioned_frame([4] * 2).surge.encode("text", str(out), model=counting_encoder, **KW)
    assert not list(out.glob("part-*"))
    claim.release()
    assert (
        make_partitioned_frame([4] * 2).surge.encode("text", str(out), model=counting_encoder, **KW).rows == 8
    )
    assert not (out / "_surge" / "CLAIM").exists()  # released at the end


def test_a_dead_or_expired_claim_is_taken_over(tmp_path, counting_encoder, monkeypatch):
    import socket

    out = tmp_path / "out"
    (out / "_surge").mkdir(parents=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    claim = {
        "run": "0123456789abcdef",
        "token": "t",
        "host": socket.gethostname(),
        "pid": int(dead.stdout),
        "heartbeat": time.time(),
    }
    (out / "_surge" / "CLAIM").write_text(json.dumps(claim))
    assert (
        make_partitioned_frame([4] * 2).surge.encode("text", str(out), model=counting_encoder, **KW).rows == 8
    )
    # another host's claim: live until its heartbeat is older than the TTL
    claim.update(host="elsewhere", pid=1)
    (out / "_surge" / "CLAIM").write_text(json.dumps(claim))
    other = tmp_path / "other"
    with pytest.raises(SurgeOutputError, match="being written by another run"):
        Claim.acquire(OutputStore.open(str(out)), "fedcba9876543210", heartbeat=False)
    monkeypatch.setattr("dask_surge.io.lease.CLAIM_TTL_S", 0.0)
    time.sleep(0.01)
    Claim.acquire(OutputStore.open(str(out)), "fedcba9876543210", heartbeat=False).release()
    assert not other.exists()


@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
def test_a_live_claim_of_a_host_with_a_skewed_clock_is_not_taken_over(tmp_path, skew):
    # issue 60.6: a live claim written just now by a host whose clock is an hour off; judged on this
    # host's clock its heartbeat looked an hour old (taken over: the live run then died with a wrong
    # diagnosis); judged on the store's clock (the files' modification times) it is fresh
    import fsspec

    store = OutputStore.open(str(tmp_path / "out"))
    store.makedirs(f"{store.root}/_surge")
    token = "a" * 32
    claim = {
        "run": "0123456789abcdef",
        "token": token,
        "host": "elsewhere",
        "pid": 1,
        "started": time.time() + skew,
    }
    (tmp_path / "out" / "_surge" / "CLAIM").write_text(json.dumps(claim))
    (tmp_path / "out" / "_surge" / f".heartbeat-{token}").write_text(repr(time.time() + skew))
    with pytest.raises(SurgeOutputError, match=r"being written by another run .*last heartbeat [0-5] s ago"):
        Claim.acquire(store, "fedcba9876543210", heartbeat=False)
    # the same claim, its heartbeat file last written two TTLs ago on the store's clock: stale
    old = time.time() - 2 * __import__("dask_surge.io.lease", fromlist=["x"]).CLAIM_TTL_S
    for name in ("CLAIM", f".heartbeat-{token}"):
        os.utime(tmp_path / "out" / "_surge" / name, (old, old))
    Claim.acquire(store, "fedcba9876543210", heartbeat=False).release()
    assert not [n for n in os.listdir(tmp_path / "out" / "_surge") if n.startswith(".clock-")]


def _eventually(check, seconds: float = 20.0) -> bool:
    """True as soon as ``check()`` is (polled; a busy machine may delay a heartbeat thread)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_heartbeat_refreshes_and_a_lost_claim_is_noticed(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setattr("dask_surge.io.lease.HEARTBEAT_S", 0.05)
    store = OutputStore.open(str(tmp_path))
    claim = Claim.acquire(store, "0123456789abcdef")
    first = Claim.holder(store)["heartbeat"]
    assert _eventually(lambda: Claim.holder(store)["heartbeat"] > first) and not claim.lost
    (tmp_path / "_surge" / "CLAIM").write_text(
        json.dumps({"token": "someone else", "heartbeat": time.time()})
    )
    assert _eventually(lambda: claim.lost)
    claim.release()
    assert (tmp_path / "_surge" / "CLAIM").exists()  # not ours any more: left alone


def test_two_runs_started_at_once_one_wins_cleanly(tmp_path):
    from dask_surge.testing import SleepyModel

    out, ddf = tmp_path / "out", make_partitioned_frame([20] * 6)
    barrier, outcomes = threading.Barrier(2), []

    def run(normalize):  # two different runs: normalize changes the embeddings
        barrier.wait()
        try:
            outcomes.append(
                (
                    "ok",
                    dask_surge.encode(
                        ddf, "text", str(out), model=SleepyModel(0.05), normalize=normalize, **KW
                    ),
                )
            )
        except SurgeOutputError as err:
            outcomes.append(("refused", str(err)))

    threads = [threading.Thread(target=run, args=(n,)) for n in (False, True)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    kinds = sorted(k for k, _ in outcomes)
    assert kinds == ["ok", "refused"], outcomes
    refused = next(v for k, v in outcomes if k == "refused")
    assert "another run" in refused or "different run" in refused
    winner = next(v for k, v in outcomes if k == "ok")
    assert _parts(out) == _committed_files(out)
    assert len(dask_surge.read_embeddings(str(out)).compute()) == 120 == winner.rows


def test_a_late_task_of_a_replaced_run_can_neither_commit_nor_publish(tmp_path, counting_encoder):
    from dask_surge.execution.sink import SuperBatchWriter
    from dask_surge.execution.superbatch import SuperBatchTask
    from dask_surge.planning.policy import Span

    out = tmp_path / "out"
    ddf = make_partitioned_frame([6, 6])
    old, _ = open_run(OutputStore.open(str(out)), {"t": "old"})
    late = SuperBatchWriter(SuperBatchTask("text", (), dask_surge.Encoder(CountingEncoder(dim=4))), old)
    new = dask_surge.encode(ddf, "text", str(out), model=counting_encoder, overwrite=True, **KW)
    part = ddf.partitions[0].compute()
    with pytest.raises(
        SurgeOutputError, match=f"run {old.run_id} of .* was replaced by another run \\(run {new.run_id}\\)"
    ):
        late([part], ((Span(0, 0, 6), 6),))
    assert _parts(out) == _committed_files(out)
    assert status_rows(out) == new.rows == 12


def test_a_worker_that_does_not_see_the_output_is_named_not_taken_for_a_replaced_run(tmp_path):
    # issue 60.5: a worker that joins after the start without the shared path (autoscaling, a replaced
    # node) stopped the run with "another run replaced it"; now every unit task proves first that it
    # reads its run's run.json, and says what is wrong before any work
    import fsspec

    from dask_surge.execution.unit import UnitRunner
    from dask_surge.execution.sink import SuperBatchWriter
    from dask_surge.execution.superbatch import SuperBatchTask
    from dask_surge.io.manifest import Manifest

    out = tmp_path / "out"
    run, _ = open_run(OutputStore.open(str(out)), {"t": "x"})
    # the same run as a worker without the shared mount sees it: its root is not there
    unseen = Manifest(OutputStore.open(str(tmp_path / "elsewhere" / "out")), run.run_id, run.fingerprint)
    task = SuperBatchTask("text", (), dask_surge.Encoder(CountingEncoder(dim=4)))
    runner = UnitRunner(SuperBatchWriter(task, unseen), 4, 8, None)
    with pytest.raises(
        SurgeOutputError,
        match=r"a worker on host .* does not see the output .*run\.json.*Nothing "
        r"of this task was written.*Fix: mount the output",
    ):
        runner(None, [], None)
    from dask_surge.execution.reach import task_sees_run

    task_sees_run(run)  # the run as the client sees it: run.json is read, no error


def status_rows(out) -> int:
    return dask_surge.status(str(out))["rows_committed"]


# -- the commit path's failures ----------------------------------------------------------------


def test_disk_full_while_creating_a_record_keeps_readers_clean_and_resumes(
    tmp_path, counting_encoder, monkeypatch
):
    out, ddf = tmp_path / "out", make_partitioned_frame([4] * 6)
    real_link, links = os.link, []

    def full(src, dst, *a, **k):
        if "/commits/" in str(dst):
            links.append(dst)
            if len(links) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_link(src, dst, *a, **k)

    monkeypatch.setattr("dask_surge.io.store.os.link", full)
    with pytest.raises(
        SurgeOutputError, match="creating the commit record.*No space left.*rerun the same call"
    ):
        ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    monkeypatch.setattr("dask_surge.io.store.os.link", real_link)
    assert _parts(out) == _committed_files(out) and len(_parts(out)) == 1  # no uncommitted file readers glob
    assert not list(out.glob("_surge/runs/*/staging/*"))
    res = ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    assert res.resumed and res.rows == 24 and _parts(out) == _committed_files(out)


@pytest.mark.parametrize("damaged", ["run.json", "COMPLETE", "CURRENT"])
@pytest.mark.parametrize("content", [b"", b'{"format_version": 2, "fingerpr'])
def test_a_damaged_manifest_file_is_named_with_its_repair(tmp_path, counting_encoder, damaged, content):
    out, ddf = tmp_path / "out", make_partitioned_frame([4] * 4)
    res = ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    run_dir = out / "_surge" / "runs" / res.run_id
    path = out / "_surge" / "CURRENT" if damaged == "CURRENT" else run_dir / damaged
    path.write_bytes(content)
    calls = [
        lambda: dask_surge.status(str(out)),
        lambda: ddf.surge.encode("text", str(out), model=counting_encoder, **KW),
    ]
    if damaged != "COMPLETE":  # readers trust the commit records alone, never the marker
        calls.append(lambda: dask_surge.read_embeddings(str(out)))
    for call in calls:
        with pytest.raises(SurgeOutputError, match=f"{damaged}.*is damaged.*dask-surge status --repair"):
            call()
    assert repair(str(out))  # says what it did
    again = ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    assert again.rows == 16 and dask_surge.status(str(out))["state"] == "complete"
    assert _parts(out) == _committed_files(out)
    assert len(dask_surge.read_embeddings(str(out)).compute()) == 16


def test_verify_finds_a_changed_file_and_repair_re_encodes_its_rows(tmp_path, counting_encoder):
    from dask_surge.cli import main

    out, ddf = tmp_path / "out", make_partitioned_frame([4] * 4)
    ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    assert verify(str(out)) == [] and main(["status", str(out), "--verify"]) == 0
    victim = out / _committed_files(out)[0]
    victim.write_bytes(victim.read_bytes()[:-8] + b"garbage!")
    problems = verify(str(out))
    assert len(problems) == 1 and "differs from the recorded" in problems[0]
    assert main(["status", str(out), "--verify"]) == 1
    assert main(["status", str(out), "--repair"]) == 1  # forgot the bad commit: incomplete now
    res = ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    assert res.resumed and res.superbatches - res.skipped_superbatches == 1 and res.rows == 16
    assert verify(str(out)) == [] and _parts(out) == _committed_files(out)


def test_repair_refuses_an_output_a_live_run_is_writing(tmp_path, counting_encoder):
    # issue 60.4: a repair during a live run took its commits in progress for damage, forgot them and
    # deleted freshly published files; the run then failed. Now it refuses, naming the run.
    import fsspec

    from dask_surge.cli import main
    from dask_surge.io.verify import repair

    out, ddf = tmp_path / "out", make_partitioned_frame([4] * 4)
    ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    manifest = current_run(OutputStore.open(str(out)))
    rec = next(iter(manifest.committed().values()))
    # a commit in progress: the record exists, the file still in staging (as between commit and publish)
    os.rename(out / rec.file, f"{manifest.staging_dir}/{rec.sb}-{rec.attempt}.parquet")
    claim = Claim.acquire(OutputStore.open(str(out)), manifest.run_id, heartbeat=False)
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    try:
        with pytest.raises(
            SurgeOutputError,
            match=rf"being written by a live run \(run {manifest.run_id}, pid "
            rf"{os.getpid()} on .*Nothing was changed",
        ):
            repair(str(out))
        assert main(["status", str(out), "--repair"]) == 2
        assert sorted(p.name for p in out.rglob("*") if p.is_file()) == files  # nothing touched
    finally:
        claim.release()
    assert any("published committed" in line for line in repair(str(out)))  # once the run is gone


def test_a_commit_whose_task_died_before_publishing_is_published_on_resume(tmp_path, counting_encoder):
    out, ddf = tmp_path / "out", make_partitioned_frame([4] * 4)
    ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    manifest = current_run(OutputStore.open(str(out)))
    rec = next(iter(manifest.committed().values()))
    # as if the task died between its commit record and the rename
    os.rename(out / rec.file, f"{manifest.staging_dir}/{rec.sb}-{rec.attempt}.parquet")
    (out / "_surge" / "runs" / manifest.run_id / "COMPLETE").unlink()
    assert dask_surge.status(str(out))["state"] == "incomplete"
    res = ddf.surge.encode("text", str(out), model=counting_encoder, **KW)
    assert res.rows == 16 and res.superbatches == res.skipped_superbatches  # nothing encoded again
    assert _parts(out) == _committed_files(out)


def test_commit_records_are_checked_before_their_names_become_paths():
    good = CommitRecord(
        sb_key(0, 0), "0" * 16, f"part-00000000-{sb_key(0, 0)}-0123abcd.parquet", 1, 1, "x", ((0, 0, 1, 1),)
    )
    for field, bad in (("file", "../../etc/passwd"), ("skipped_file", "/abs.parquet"), ("sb", "../x")):
        raw = json.loads(good.to_json())
        raw[field] = bad
        if field == "skipped_file":
            raw["skipped"] = 1
        with pytest.raises(ValueError):
            CommitRecord.from_json(json.dumps(raw).encode())


# -- resume checks ------------------------------------------------------------------------------


def _grow_or_shout(df: pd.DataFrame) -> pd.DataFrame:
    """The streamed upstream step of the tests below: what it returns depends on the environment."""
    mode = os.environ.get("SURGE_TEST_UPSTREAM", "")
    if mode == "grow":
        df = pd.concat([df, df.iloc[:2]])
    elif mode == "shout":
        df = df.assign(text=df.text.str.upper())
    return df.assign(text=df.text.fillna("x")) if mode else df


@pytest.mark.parametrize(
    "change, message", [("grow", "has 12 rows now but 10"), ("shout", "holds other texts")]
)
def test_a_streamed_partition_recomputed_differently_is_refused(tmp_path, monkeypatch, change, message):
    base = pd.DataFrame({"text": [f"text {i}" for i in range(10)] + ["tail"]})
    base.loc[9, "text"] = None  # the third slice of partition 0 stops the first run
    ddf = dd.from_pandas(base.iloc[:10], npartitions=1).map_partitions(_grow_or_shout)
    out, kw = tmp_path / "out", dict(KW, b_min=4, b_max=4)
    model = CountingEncoder(dim=4)
    monkeypatch.delenv("SURGE_TEST_UPSTREAM", raising=False)
    with pytest.raises(SurgeInputError, match="null"):
        ddf.surge.encode("text", str(out), model=model, **kw)
    assert dask_surge.status(str(out))["rows_committed"] == 8  # two slices of partition 0
    monkeypatch.setenv("SURGE_TEST_UPSTREAM", change)
    with pytest.raises(SurgeInputError, match=f"partition 0 {message}.*overwrite=True"):
        ddf.surge.encode("text", str(out), model=model, **kw)
    assert dask_surge.status(str(out))["rows_committed"] == 8  # nothing mixed in


def test_commit_times_are_mapped_onto_the_clients_clock():
    from dask_surge.execution.scheduling import received as _received

    now = time.time()
    report = SuperBatchReport(
        sb="000000000-000000000000",
        rows=1,
        skipped=0,
        file="f",
        bytes=1,
        spans=((0, 0, 1, 1),),
        started_at=999.0,
        encode_s=0.1,
        write_s=0.1,
        committed=True,
        committed_at=1000.0,
        engine="callable",
    )
    (shifted,) = _received([report.with_task_end(1005.0)])  # a worker 1e9 s behind
    assert now - 5.5 < shifted.committed_at < time.time() - 4.9
    assert _received([report]) == [report]  # no task end: nothing to map


@pytest.mark.parametrize(
    "plan",
    [
        RunPlan(40, 120, "planned", 7, None, "given", rows=300),
        RunPlan(60, 200, "streaming", 40, 1 << 20, "auto: 2 threads", unit_partitions=5),
    ],
)
def test_the_recorded_plan_is_written_with_its_keys_and_read_back(tmp_path, plan):
    manifest, resumed = open_run(OutputStore.open(str(tmp_path / "o")), {"t": 1}, plan=plan)
    assert not resumed and manifest.plan == plan
    recorded = json.loads(next((tmp_path / "o" / "_surge" / "runs").glob("*/run.json")).read_text())["plan"]
    keys = {"b_min", "b_max", "mode", "partitions", "max_bytes", "reason"}
    assert set(recorded) == keys | ({"rows"} if plan.mode == "planned" else {"unit_partitions"})
    assert current_run(OutputStore.open(str(tmp_path / "o"))).plan == plan
    again, resumed = open_run(
        OutputStore.open(str(tmp_path / "o")), {"t": 1}, plan=RunPlan(1, 2, "planned", 1)
    )
    assert resumed and again.plan == plan  # a resumed run keeps what it recorded


def test_a_plan_recorded_by_an_older_version_still_loads(tmp_path):
    assert RunPlan.of(
        {"b_min": 5, "b_max": 9, "partitions": 3, "reason": "given", "superbatches": 2}
    ) == RunPlan(5, 9, "planned", 3, None, "given")  # unknown keys ignored, missing ones defaulted
    assert RunPlan.of({"b_min": 5, "b_max": 9, "partitions": 3, "unit_partitions": 2}).mode == "streaming"
    assert RunPlan.of({}) is None and RunPlan.of(None) is None
    manifest, _ = open_run(OutputStore.open(str(tmp_path / "o")), {"t": 2})  # a run that recorded no plan
    assert manifest.plan is None and current_run(OutputStore.open(str(tmp_path / "o"))).plan is None
    assert dask_surge.status(str(tmp_path / "o"))["mode"] is None


def test_commit_record_json_is_the_records_fields_as_written_before():
    """to_json writes the fields as they are (no deep copy): the same bytes asdict gave, and it reads back."""
    from dataclasses import asdict

    rec = CommitRecord(
        "000000000-000000000000",
        "0" * 16,
        "part-00000000-000000000-000000000000-0123abcd.parquet",
        7,
        10,
        "ab",
        tuple((p, 0, 3, 3) for p in range(5)),
        skipped=1,
        digests=tuple((p, f"{p:016x}") for p in range(5)),
        truncated=-1,
        encoded=6,
        reused=1,
    )
    assert rec.to_json() == json.dumps(asdict(rec), sort_keys=True).encode()
    assert CommitRecord.from_json(rec.to_json()) == rec
