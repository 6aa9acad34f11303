"""Hostile paths (issue 60): glob characters, spaces, unicode, ``%`` and ``#``, doubled and trailing
slashes, ``..``, links, and outputs nested in inputs in every order, on a local disk and on fsspec's
in-memory filesystem. Either the run refuses clearly before any write, or it writes, and every row
reads back once through ``read_embeddings``, DuckDB's ``part-*`` glob and ``status --verify``; it never
writes under its input.

The property test runs a few examples by default, more behind ``slow`` (``SURGE_SWEEP=reduced``:
still more than the default, ``full``: the most).
"""

from __future__ import annotations

import os
import posixpath
import uuid
from pathlib import Path

import dask.dataframe as dd
import fsspec
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_surge
from dask_surge import SurgeError, SurgeOutputError
from dask_surge.io.directory import check_output
from dask_surge.io.store import GLOB_CHARACTERS, OutputStore
from dask_surge.io.verify import verify

duckdb = pytest.importorskip("duckdb")

SIZES = [3, 5, 2, 4]
N = sum(SIZES)
KW = {"b_min": 5, "b_max": 8, "scheduler": "sync", "progress": False}


def _model(texts):
    return np.asarray([[float(len(t)), 1.0] for t in texts], dtype=np.float32)


def _write_input(fs, directory: str) -> None:
    """Two Parquet files of the texts in ``directory`` (on ``fs``)."""
    fs.makedirs(directory, exist_ok=True)
    start = 0
    for i, half in enumerate((SIZES[:2], SIZES[2:])):
        n = sum(half)
        frame = pd.DataFrame({"text": [f"text {j}" for j in range(start, start + n)]})
        with fs.open(f"{directory}/part-{i}.parquet", "wb") as f:
            frame.to_parquet(f)
        start += n


def _tree(fs, directory: str) -> dict[str, int]:
    """Every file below ``directory`` with its size (nothing when it does not exist)."""
    try:
        return {p: int(i["size"]) for p, i in fs.find(directory, detail=True).items()}
    except FileNotFoundError:
        return {}


def _keys(frame: pd.DataFrame) -> list[tuple[int, int]]:
    return sorted(zip(frame["partition"].tolist(), frame["row"].tolist()))


def _expected() -> list[tuple[int, int]]:
    # read_parquet of the two files: one partition per file
    return sorted([(0, r) for r in range(sum(SIZES[:2]))] + [(1, r) for r in range(sum(SIZES[2:]))])


def _check_written(out: str, options: dict | None, local: bool) -> None:
    back = dask_surge.read_embeddings(out, storage_options=options).compute()
    assert _keys(back) == _expected()
    assert verify(out, options) == []
    if local:
        root = OutputStore.open(out).root
        rows = duckdb.sql(f"select partition, row from read_parquet('{root}/part-*.parquet')").fetchall()
        assert sorted(rows) == _expected()


# -- the reproductions of issue 60 -------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_an_output_whose_path_holds_a_glob_character_is_refused_before_any_write(tmp_path, protocol):
    # issue 60.2: written, verified, reported complete, then read back as 0 rows and no columns
    base = str(tmp_path) if protocol == "file" else f"memory://{uuid.uuid4().hex}"
    fs = fsspec.filesystem(protocol)
    _write_input(fs, f"{base}/in")
    for name in ("emb[x]", "emb*", "e?b", "emb{a,b}"):
        out = f"{base}/{name}"
        with pytest.raises(
            SurgeOutputError, match=r"Parquet readers .* take for a pattern.*Nothing was written"
        ):
            dd.read_parquet(f"{base}/in").surge.encode("text", out, model=_model, **KW)
        assert not fs.exists(out)


def test_an_output_renamed_to_a_glob_name_reads_back_whole(tmp_path):
    # read_embeddings hands each committed file to the reader as a path, never as a pattern
    _write_input(fsspec.filesystem("file"), str(tmp_path / "in"))
    dd.read_parquet(str(tmp_path / "in")).surge.encode("text", str(tmp_path / "emb"), model=_model, **KW)
    os.rename(tmp_path / "emb", tmp_path / "emb[1]")
    back = dask_surge.read_embeddings(str(tmp_path / "emb[1]")).compute()
    assert _keys(back) == _expected() and list(back.columns)[:2] == ["partition", "row"]
    assert len(dask_surge.read_embeddings(str(tmp_path / "emb[1]"), partition=1).compute()) == sum(SIZES[2:])


def test_an_input_named_with_a_bracket_is_a_name_not_a_pattern(tmp_path):
    # issue 60.2: an input directory in[1] made a sibling output be refused as inside the input
    fs = fsspec.filesystem("file")
    _write_input(fs, str(tmp_path / "in[1]"))
    check_output(
        OutputStore.open(str(tmp_path / "out"), writing=True), inputs=[(fs, str(tmp_path / "in[1]"))]
    )
    with pytest.raises(SurgeOutputError, match="is inside the input directory"):
        check_output(
            OutputStore.open(str(tmp_path / "in[1]" / "out")), inputs=[(fs, str(tmp_path / "in[1]"))]
        )


@pytest.mark.parametrize("spelling", ["double-slash", "dot-dot", "link-to-input", "input-through-link"])
def test_an_output_inside_the_input_spelled_differently_is_refused(tmp_path, spelling):
    # issue 60.3: the guard compared strings; the embeddings then counted as input (800 rows read instead
    # of 400) and the rerun failed with a misleading error
    fs = fsspec.filesystem("file")
    _write_input(fs, str(tmp_path / "in"))
    os.symlink(tmp_path / "in", tmp_path / "link")
    source, out = {
        "double-slash": (tmp_path / "in", f"{tmp_path}/in//emb"),
        "dot-dot": (tmp_path / "in", f"{tmp_path}/other/../in/emb"),
        "link-to-input": (tmp_path / "in", f"{tmp_path}/link/emb"),
        "input-through-link": (tmp_path / "link", f"{tmp_path}/in/emb"),
    }[spelling]
    before = _tree(fs, str(tmp_path / "in"))
    with pytest.raises(SurgeOutputError, match="inside the input directory.*Nothing was written"):
        dd.read_parquet(str(source)).surge.encode("text", out, model=_model, **KW)
    assert _tree(fs, str(tmp_path / "in")) == before
    assert len(dd.read_parquet(str(tmp_path / "in"))) == N  # the dataset is as it was


def test_an_output_that_holds_the_input_is_refused(tmp_path):
    fs = fsspec.filesystem("file")
    _write_input(fs, str(tmp_path / "data" / "in"))
    with pytest.raises(SurgeOutputError, match="holds input file"):
        dd.read_parquet(str(tmp_path / "data" / "in")).surge.encode(
            "text", f"{tmp_path}//data/", model=_model, **KW
        )


# -- the property ------------------------------------------------------------------------------------

_PLAIN = st.text(alphabet="ab é漢%#", min_size=1, max_size=5).filter(lambda s: s.strip() == s)
_NAME = st.one_of(
    _PLAIN,
    _PLAIN,
    st.text(alphabet="ab é%# " + GLOB_CHARACTERS, min_size=1, max_size=5).filter(
        lambda s: s.strip() == s and s not in (".", "..")
    ),
)


@st.composite
def _layout(draw):
    """(input directory parts, output parts, how the output is spelled) below a base directory."""
    relation = draw(st.sampled_from(["sibling", "output-in-input", "input-in-output", "same", "nested-deep"]))
    inp = draw(st.lists(_PLAIN, min_size=1, max_size=2))
    name = draw(st.lists(_NAME, min_size=1, max_size=2))
    out = {
        "sibling": [*inp[:-1], *name],
        "output-in-input": [*inp, *name],
        "input-in-output": inp[:-1] or name,
        "same": inp,
        "nested-deep": [*inp, *name, *name],
    }[relation]
    if out == inp[: len(out)] and relation == "sibling":
        out = [*out[:-1], out[-1] + "x"]
    spelling = draw(st.sampled_from(["plain", "double-slash", "trailing-slash", "dot-dot", "dot"]))
    return inp, out, spelling


def _spell(base: str, parts: list[str], spelling: str) -> str:
    if spelling == "double-slash":
        return base + "//" + "//".join(parts)
    if spelling == "trailing-slash":
        return base + "/" + "/".join(parts) + "/"
    if spelling == "dot-dot":
        return base + "/zz/../" + "/".join(parts)
    if spelling == "dot":
        return base + "/./" + "/./".join(parts)
    return base + "/" + "/".join(parts)


def _run(base: str, protocol: str, layout) -> None:
    inp, out_parts, spelling = layout
    fs = fsspec.filesystem(protocol)
    in_dir = base + "/" + "/".join(inp)
    _write_input(fs, in_dir)
    out = _spell(base, out_parts, spelling)
    canonical_out = posixpath.normpath(base + "/" + "/".join(out_parts))
    existed = fs.exists(canonical_out)
    before_in = _tree(fs, in_dir)
    before_out = _tree(fs, canonical_out) if existed else {}
    try:
        result = dd.read_parquet(in_dir).surge.encode("text", out, model=_model, **KW)
    except SurgeError as err:
        assert "Fix:" in str(err)
        # refused before any write: the output is as it was, the input too
        assert _tree(fs, in_dir) == before_in
        assert (_tree(fs, canonical_out) if fs.exists(canonical_out) else {}) == before_out
        if not existed:
            assert not fs.exists(canonical_out)
        return
    assert result.rows == N
    assert _tree(fs, in_dir) == before_in or not canonical_out.startswith(in_dir.rstrip("/") + "/"), (
        "a run wrote under its input"
    )
    assert not (canonical_out + "/").startswith(in_dir.rstrip("/") + "/") or canonical_out == in_dir
    assert not any(c in "/".join(out_parts) for c in GLOB_CHARACTERS)
    _check_written(out, None, local=protocol == "file")
    assert len(dd.read_parquet(in_dir)) == N  # the input reads as it did


def _examples(default: int) -> int:
    sweep = os.environ.get("SURGE_SWEEP")
    return {"reduced": 3 * default, "full": 20 * default}.get(sweep or "", default)


def _property(protocol: str, examples: int, tmp_factory) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=examples <= 8,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(layout=_layout())
    def check(layout):
        base = str(tmp_factory.mktemp("p")) if protocol == "file" else f"memory://{uuid.uuid4().hex}"
        _run(base, protocol, layout)

    check()


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_hostile_locations_refuse_or_read_back_every_row_once(tmp_path_factory, protocol):
    _property(protocol, 6, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_hostile_locations_sweep(tmp_path_factory, protocol):
    _property(protocol, _examples(10), tmp_path_factory)


def test_an_output_spelled_through_a_link_inside_the_input_is_refused(tmp_path):
    # the output's own spelling passes through the input directory (a link in it pointing elsewhere):
    # a reader of the input directory would walk into it
    fs = fsspec.filesystem("file")
    _write_input(fs, str(tmp_path / "in"))
    (tmp_path / "outs").mkdir()
    os.symlink(tmp_path / "outs", tmp_path / "in" / "outs-link")
    with pytest.raises(SurgeOutputError, match="inside the input directory"):
        dd.read_parquet(str(tmp_path / "in")).surge.encode(
            "text", str(tmp_path / "in" / "outs-link" / "e"), model=_model, **KW
        )
    assert not list((tmp_path / "outs").iterdir())


def test_a_run_resolves_its_output_once(tmp_path, monkeypatch):
    # issue 61: the output's filesystem was built 6 times before a run's first task
    _write_input(fsspec.filesystem("file"), str(tmp_path / "in"))
    opened = []
    real = OutputStore.open

    def counting(*args, **kw):
        opened.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(OutputStore, "open", staticmethod(counting))
    out = str(tmp_path / "emb")
    assert dd.read_parquet(str(tmp_path / "in")).surge.encode("text", out, model=_model, **KW).rows == N
    assert opened == [out]
    opened.clear()
    assert (
        dd.read_parquet(str(tmp_path / "in")).surge.encode("text", out, model=_model, **KW).rows == N
    )  # complete
    assert opened == [out]
