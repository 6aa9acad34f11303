"""A hostile output directory (issue 51): links inside ``_surge/``, overwrites read by a
``part-*`` glob at every kill point, stray data files, and races to take over a stale claim."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pyarrow.dataset as pads
import pytest

import dask_surge
import dask_surge.cli
import dask_surge.io.directory as directory_mod
import dask_surge.io.manifest as manifest_mod
from dask_surge import SurgeOutputError
from dask_surge.io.lease import Claim
from dask_surge.io.manifest import current_run
from dask_surge.io.verify import repair, verify
from dask_surge.testing import CountingEncoder, InterruptAfter
from dask_surge.io.store import OutputStore

SIZES = [3, 4, 2, 5, 3, 4, 1, 6]
N = sum(SIZES)
FULL = os.environ.get("SURGE_SWEEP") == "full"


def _part(i: int, null_at: tuple) -> pd.DataFrame:
    texts = [f"text {i}-{j} " * (j + 1) for j in range(SIZES[i])]
    for p, r in null_at:
        if p == i:
            texts[r] = None
    return pd.DataFrame({"text": pd.array(texts, dtype="string[pyarrow]")})


def _encode(out, model, **kw):
    null_at = tuple(kw.pop("nulls", ()))
    frame = dd.from_map(_part, range(len(SIZES)), null_at=null_at, meta=_part(0, ())[:0])
    return frame.surge.encode(
        "text", str(out), model=model, b_min=6, b_max=6, scheduler="sync", progress=False, **kw
    )


def _tree(d: Path) -> dict[str, bytes | str]:
    """Every entry below ``d`` (links as their target, never followed) with its bytes."""
    out: dict[str, bytes | str] = {}
    for top, dirs, files in os.walk(d, followlinks=False):
        for name in dirs + files:
            p = Path(top) / name
            rel = str(p.relative_to(d))
            out[rel] = (
                f"-> {os.readlink(p)}" if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
            )
    return out


def _glob_keys(out: Path) -> list[tuple[int, int]]:
    """The ``(partition, row)`` keys a ``part-*.parquet`` glob reads (as DuckDB or Spark would)."""
    files = sorted(str(p) for p in out.glob("part-*.parquet"))
    if not files:
        return []
    table = pads.dataset(files, format="parquet").to_table(columns=["partition", "row"])
    return list(zip(table["partition"].to_pylist(), table["row"].to_pylist()))


# --- links under _surge/ are never followed ---------------------------------------------------------


@pytest.fixture(scope="module")
def base_output(tmp_path_factory):
    """An incomplete run (its last SuperBatch uncommitted) with every directory ``_surge/`` can
    hold: a run's commits, staging (with a leftover of a lost attempt) and skipped nulls, another
    run, a reuse index of a gone run and ``retired/``."""
    out = tmp_path_factory.mktemp("hostile") / "emb"
    _encode(out, CountingEncoder(), on_null="skip", nulls=((1, 2),))
    run = current_run(OutputStore.open(str(out)))
    records = sorted(run.committed().values(), key=lambda r: r.sb)
    last = records[-1]
    Path(run.record_path(last.sb)).unlink()
    (out / last.file).unlink()
    Path(run.run_dir, "COMPLETE").unlink()
    (Path(run.staging_dir) / f"{last.sb}-0badf00d.parquet").write_bytes(b"a lost attempt")
    meta = out / "_surge"
    (meta / "runs" / ("f" * 16) / "commits").mkdir(parents=True)
    (meta / "runs" / ("f" * 16) / "run.json").write_text(json.dumps({"format_version": 2, "fingerprint": {}}))
    (meta / "index" / ("e" * 16)).mkdir(parents=True)
    (meta / "index" / ("e" * 16) / "meta.json").write_text("{}")
    (meta / "retired").mkdir()
    return out


def _linked_dirs(base: Path) -> list[str]:
    rels = [str(p.relative_to(base)) for p in (base / "_surge").rglob("*") if p.is_dir()]
    return ["_surge", *sorted(rels)]


DECOYS = (
    "precious.txt",
    "run.json",
    "CLAIM",
    "COMPLETE",
    "000000000-000000000000-deadbeef.parquet",
    "part-deadbeef-000000000-000000000000-deadbeef.parquet",
    "000000000-000000000000.json",
    "bucket-000000.npy",
    "meta.json",
)


def _with_link(base: Path, tmp: Path, rel: str) -> tuple[Path, Path]:
    """A copy of ``base`` whose directory ``rel`` is a link to a directory of decoy files
    (its own files moved there, plus files named as the layout names its own)."""
    out = tmp / "emb"
    shutil.copytree(base, out, symlinks=True)
    decoy = tmp / "decoy"
    shutil.move(str(out / rel), decoy)
    for name in DECOYS:
        (decoy / name).write_bytes(b"not dask-surge's: " + name.encode())
    os.symlink(decoy, out / rel)
    return out, decoy


def _resume(out):
    return _encode(out, CountingEncoder(), on_null="skip", nulls=((1, 2),))


def _overwrite(out):
    return _encode(out, CountingEncoder(dim=4), on_null="skip", nulls=((1, 2),), overwrite=True)


def _finish(out):  # what the end of a run does, called directly (the run read before the link was made)
    run = current_run(OutputStore.open(str(out.parent.parent / "base" / "emb")))
    run = dataclasses.replace(run, store=OutputStore.open(str(out)))
    manifest_mod.finish_run(run, {}, {"rows": 0})


OPERATIONS = {
    "resume": _resume,
    "overwrite": _overwrite,
    "repair": lambda out: repair(str(out)),
    "verify": lambda out: verify(str(out)),
    "finish": _finish,
}


# the whole sweep (every directory, 15 s) in the slow leg; the default leg links the first directory only
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["first", "every"])
def test_every_deleting_path_leaves_a_linked_directory_alone(tmp_path, base_output, every):
    """Each directory under ``_surge/`` swapped for a link to decoys, then each operation that
    deletes or moves (resume and finish, overwrite and retire, repair, verify, index and staging
    clean-up): the decoys are untouched, whether the operation refused or went on."""
    refused = 0
    shutil.copytree(base_output, tmp_path / "base" / "emb", symlinks=True)
    linked = _linked_dirs(base_output) if every else _linked_dirs(base_output)[:1]
    for i, rel in enumerate(linked):
        for name, operation in OPERATIONS.items():
            case = tmp_path / f"{i}-{name}"
            case.mkdir()
            out, decoy = _with_link(base_output, case, rel)
            before = _tree(decoy)
            try:
                operation(out)
            except SurgeOutputError as err:
                refused += 1
                assert "symbolic link" in str(err), (rel, name, err)
            assert _tree(decoy) == before, f"{name} with {rel} linked changed what the link points to"
    assert refused >= len(linked) * 3  # resume, overwrite and finish refuse every link


def test_without_links_the_same_operations_delete_what_is_ours(tmp_path, base_output):
    """The control of the sweep above: on the same output without links, resuming finishes the
    run and deletes the staging leftover, the other run and the gone run's index."""
    out = tmp_path / "emb"
    shutil.copytree(base_output, out, symlinks=True)
    res = _resume(out)
    assert res.rows == N and res.nulls_skipped == 1
    run = current_run(OutputStore.open(str(out)))
    assert not list(Path(run.staging_dir).glob("*"))
    assert not (out / "_surge" / "runs" / ("f" * 16)).exists()
    assert not (out / "_surge" / "index" / ("e" * 16)).exists()
    assert verify(str(out)) == []


def test_a_link_to_the_output_root_itself_is_the_users_choice(tmp_path):
    real = tmp_path / "fast-disk" / "emb"
    real.mkdir(parents=True)
    link = tmp_path / "emb"
    os.symlink(real, link)
    res = _encode(link, CountingEncoder())
    assert res.rows == N and len(_glob_keys(real)) == N


def test_discard_refuses_names_the_layout_does_not_write(tmp_path):
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    with pytest.raises(SurgeOutputError, match="not a file dask-surge writes"):
        directory_mod.discard(OutputStore.open(str(tmp_path)), str(keep))
    with pytest.raises(SurgeOutputError, match="not a file dask-surge writes"):
        directory_mod.discard(OutputStore.open(str(tmp_path / "a")), str(tmp_path / "a/../notes.txt"))
    assert keep.read_text() == "mine"


# --- an overwrite never shows two runs' rows ----------------------------------------------------------


class _Killed(BaseException):
    """Stands for a kill -9 at one file operation of the finishing process."""


def _kill_at(monkeypatch, k: int) -> list[int]:
    """Make the ``k``-th delete, move or manifest write (counted from 0) of the manifest raise."""
    seen = [0]
    for name in ("discard", "relocate", "write_meta"):
        real = getattr(manifest_mod, name)

        def wrapped(*args, _real=real, **kw):
            seen[0] += 1
            if seen[0] - 1 == k:
                raise _Killed(k)
            return _real(*args, **kw)

        monkeypatch.setattr(manifest_mod, name, wrapped)
    return seen


def test_a_glob_reads_each_key_once_while_an_overwrite_runs(tmp_path):
    out = tmp_path / "emb"
    _encode(out, CountingEncoder())
    model = InterruptAfter(3)  # two SuperBatches committed, then Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        _encode(out, model, overwrite=True)
    keys = _glob_keys(out)
    assert len(keys) == len(set(keys)) == N  # the old run, whole, and only it
    assert len(dask_surge.read_embeddings(str(out)).compute()) == N
    _encode(out, model, overwrite=True)  # the same call again: resumes, then replaces
    keys = _glob_keys(out)
    assert len(keys) == len(set(keys)) == N
    assert current_run(OutputStore.open(str(out))).fingerprint != {} and verify(str(out)) == []


# every kill point (29 s) in the slow leg; the default leg kills at every fourth
@pytest.mark.parametrize("stride", [4, pytest.param(1, marks=pytest.mark.slow)], ids=["every-4th", "every"])
def test_every_kill_point_of_an_overwrite_leaves_each_key_once(tmp_path, monkeypatch, stride):
    """Killed at each delete, move and manifest write of an overwrite's finish, then rerun (with
    ``overwrite`` when the old run is still current, without once the new one is): a ``part-*``
    glob never reads a key twice, and the end state is the new run, whole and verified."""
    points = 0
    for k in range(0, 200, stride):
        out = tmp_path / f"k{k}" / "emb"
        _encode(out, CountingEncoder())
        old = current_run(OutputStore.open(str(out))).run_id
        with monkeypatch.context() as m:
            seen = _kill_at(m, k)
            try:
                _encode(out, CountingEncoder(dim=4), overwrite=True)
            except _Killed:
                points += 1
            else:
                assert seen[0] <= k
                break
        keys = _glob_keys(out)
        assert len(keys) == len(set(keys)), (
            f"killed at operation {k}: a glob reads {len(keys) - len(set(keys))} keys twice"
        )
        assert dask_surge.status(str(out))["state"] in ("complete", "incomplete")
        still_old = current_run(OutputStore.open(str(out))).run_id == old
        _encode(out, CountingEncoder(dim=4), overwrite=still_old)
        keys = _glob_keys(out)
        assert len(keys) == len(set(keys)) == N, f"after a kill at operation {k} and a rerun"
        assert current_run(OutputStore.open(str(out))).run_id != old and verify(str(out)) == []
        assert not list(out.glob("_surge/runs/*/staging/*.parquet"))
    assert points >= 5 // stride  # the finish of an overwrite has at least 5 steps to be killed at


def test_verify_names_a_stray_data_file_and_repair_deletes_it(tmp_path):
    out = tmp_path / "emb"
    _encode(out, CountingEncoder())
    first = sorted(out.glob("part-*.parquet"))[0]
    stray = first.with_name(first.name[:-16] + "0badf00d.parquet")
    shutil.copy(first, stray)
    assert len(_glob_keys(out)) > N
    problems = verify(str(out))
    assert len(problems) == 1 and stray.name in problems[0] and "no commit record" in problems[0]
    done = repair(str(out))
    assert any(stray.name in line for line in done) and not stray.exists()
    assert verify(str(out)) == [] and len(_glob_keys(out)) == N


def test_verify_names_a_foreign_file_readers_would_read_and_repair_leaves_it(tmp_path):
    # issue 63.5: a part-extra.parquet copied in by hand made DuckDB's part-* read 50 rows too many while
    # verify said every committed file matched; now it is named (and, not being dask-surge's, left)
    out = tmp_path / "emb"
    _encode(out, CountingEncoder())
    extra = out / "part-extra.parquet"
    shutil.copy(sorted(out.glob("part-*.parquet"))[0], extra)
    problems = verify(str(out))
    assert len(problems) == 1 and "part-extra.parquet" in problems[0] and "did not write" in problems[0]
    assert dask_surge.cli.main(["status", str(out), "--verify"]) == 1
    repair(str(out))
    assert extra.exists() and verify(str(out)) == problems


# --- the output is never inside an input --------------------------------------------------------------


def test_an_output_inside_the_input_directory_is_refused(tmp_path, counting_encoder):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        pd.DataFrame({"text": [f"t{i}-{j}" for j in range(4)]}).to_parquet(src / f"{i}.parquet")
    before = _tree(src)
    for reader in (dd.read_parquet(str(src)), dd.read_parquet(str(src / "*.parquet"))):
        with pytest.raises(SurgeOutputError, match="inside the input directory"):
            reader.surge.encode(
                "text", str(src / "emb"), model=counting_encoder, scheduler="sync", progress=False
            )
    assert _tree(src) == before


def _read_dir(path: str) -> pd.DataFrame:
    return pd.read_parquet(path)


@pytest.mark.parametrize(
    "reader",
    ["read_parquet('in')", "read_parquet('./in')", "read_parquet('link')", "from_map(['in'])"],
)
@pytest.mark.parametrize("output", ["in/emb", "in//emb", "./in/../in/emb", "link/emb"])
def test_an_output_inside_the_input_is_refused_however_either_is_spelled(
    tmp_path, monkeypatch, counting_encoder, reader, output
):
    """Issue 67 (a): a relative input with no separator (``read_parquet("in")``), or one read through a
    link, is the same directory as ``output="in/emb"``, ``"in//emb"`` or ``"link/emb"``: refused
    before anything is written (it used to be accepted, and ``read_parquet("in")`` then read the
    embeddings back as input rows)."""
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "in"
    src.mkdir()
    for i in range(2):
        pd.DataFrame({"text": [f"t{i}-{j}" for j in range(4)]}).to_parquet(src / f"{i}.parquet")
    os.symlink("in", "link")
    before = _tree(src)
    frame = {
        "read_parquet('in')": lambda: dd.read_parquet("in"),
        "read_parquet('./in')": lambda: dd.read_parquet("./in"),
        "read_parquet('link')": lambda: dd.read_parquet("link"),
        "from_map(['in'])": lambda: dd.from_map(
            _read_dir, ["in"], meta=pd.DataFrame({"text": pd.Series([], dtype="str")})
        ),
    }[reader]()
    with pytest.raises(SurgeOutputError, match=r"inside the input directory .*Nothing was written.*Fix:"):
        frame.surge.encode("text", output, model=counting_encoder, scheduler="sync", progress=False)
    assert _tree(src) == before


def test_the_files_read_csv_and_read_json_open_are_inputs(tmp_path, monkeypatch):
    """``read_csv`` and ``read_json`` keep no path string, only the files they open: each is an input
    (an output around one of them is refused), named absolute however the reader was given it."""
    from dask_surge.execution.inputs import input_files

    monkeypatch.chdir(tmp_path)
    pd.DataFrame({"text": ["a", "b"]}).to_csv("c.csv", index=False)
    pd.DataFrame({"text": ["a", "b"]}).to_json("j.json", orient="records", lines=True)
    for frame, name in ((dd.read_csv("c.csv"), "c.csv"), (dd.read_json("j.json", lines=True), "j.json")):
        paths = [os.path.realpath(p) for _, p in input_files(frame)]
        assert str((tmp_path / name).resolve()) in paths


# --- claims -------------------------------------------------------------------------------------------


def test_a_live_claim_is_not_reported_as_unwritable(tmp_path):
    store = OutputStore.open(str(tmp_path))
    claim = Claim.acquire(store, "0" * 16, heartbeat=False)
    try:
        with pytest.raises(SurgeOutputError) as info:
            Claim.acquire(store, "1" * 16, heartbeat=False)
        assert "being written by another run" in str(info.value) and "not writable" not in str(info.value)
    finally:
        claim.release()


def _racer(base: str, trials: int, barrier, results, me: int) -> None:
    for t in range(trials):
        barrier.wait()
        try:
            claim = Claim.acquire(OutputStore.open(f"{base}/{t}"), f"{me:016x}", heartbeat=False)
            results.put((t, me, claim.token))
        except SurgeOutputError:
            results.put((t, me, None))


def test_a_stale_claim_is_taken_over_by_exactly_one_of_many(tmp_path):
    """Barrier-released processes take over a claim naming a dead process: one winner a trial (300 here,
    3,000 in the slow leg's long form)."""
    _race(tmp_path, 300)


@pytest.mark.slow
def test_a_stale_claim_race_long_form(tmp_path):
    _race(tmp_path, 10000 if FULL else 3000)


def _race(tmp_path, trials: int, racers: int = 4) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    for t in range(trials):
        meta = tmp_path / str(t) / "_surge"
        meta.mkdir(parents=True)
        (meta / "CLAIM").write_text(
            json.dumps(
                {
                    "run": "f" * 16,
                    "token": uuid.uuid4().hex,
                    "pid": dead.pid,
                    "host": socket.gethostname(),
                    "started": time.time(),
                }
            )
        )
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(racers), ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(str(tmp_path), trials, barrier, results, i)) for i in range(racers)
    ]
    # a spawned racer imports this module by its name (tests.test_hostile_output under pytest's importlib
    # mode): from the repository root, which a plain `pytest` does not put on sys.path (spawn copies it)
    root = str(Path(__file__).resolve().parents[1])
    with contextlib.ExitStack() as undo:
        if root not in sys.path:
            sys.path.insert(0, root)
            undo.callback(sys.path.remove, root)
        for p in procs:
            p.start()
    got = [results.get(timeout=300) for _ in range(trials * racers)]
    for p in procs:
        p.join(timeout=60)
    winners: dict[int, list[str]] = {}
    for t, _, token in got:
        if token is not None:
            winners.setdefault(t, []).append(token)
    double = [t for t, w in winners.items() if len(w) > 1]
    assert not double, f"{len(double)} of {trials} trials had two winners"
    assert len(winners) == trials  # and never none
    for t, (token,) in winners.items():
        assert json.loads((tmp_path / str(t) / "_surge" / "CLAIM").read_text())["token"] == token
