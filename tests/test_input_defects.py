"""Inputs a new user meets on a fresh install (issue 53) and an input edited in place (issue 51, item 6).

Each test here failed before its fix: the Parquet files of one SuperBatch whose types drift
(an empty file pandas writes as ``double``), ``from_map`` over strings that are not paths, the
null-text error that did not say what was kept, ``local_cluster`` erasing Dask's config in a
fresh process, and an input rewritten with its size and mtime restored.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from dask_surge.io.store import OutputStore


def _fresh_python(code: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=cwd
    )


# -- local_cluster ------------------------------------------------------------------------------


def test_local_cluster_keeps_dask_config_in_a_fresh_process():
    """The docs/rapids.md recipe in a process that never imported distributed: the cluster runs, closes
    cleanly, and Dask's distributed config is still there for what comes after (a get_client())."""
    done = _fresh_python("""
        import sys
        assert "distributed" not in sys.modules
        import dask
        from dask_surge import local_cluster
        with local_cluster(n_workers=1, threads_per_worker=1) as cluster:
            from distributed import Client, get_client
            with Client(cluster) as client:
                assert client.submit(int, "41").result() == 41
        print("stealing:", dask.config.get("distributed.scheduler.work-stealing"))
        try:
            get_client()
        except ValueError as err:  # no client: the answer of a healthy config
            print("no client:", err)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stealing: True" in done.stdout and "no client:" in done.stdout
    assert "KeyError" not in done.stderr, done.stderr[-3000:]


def test_local_cluster_is_public():
    import dask_surge
    from dask_surge.execution.cluster import local_cluster

    assert dask_surge.local_cluster is local_cluster and "local_cluster" in dask_surge.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from dask_surge import local_cluster as new  # the public path: no warning
    assert new is local_cluster


# -- an input edited in place (issue 51, item 6) -------------------------------------------------


def _write_fixed_width(root, tag: str) -> None:
    """Four files of three 4-character texts: a rewrite with another ``tag`` has the same byte size."""
    import pandas as pd

    for i in range(4):
        pd.DataFrame({"text": [f"{tag}{i}{j}x" for j in range(3)]}).to_parquet(
            root / f"p{i}.parquet", compression=None
        )


def test_an_input_rewritten_with_its_size_and_mtime_kept_is_refused(tmp_path):
    """Texts changed in a committed and an uncommitted file, size and mtime restored (as ``cp -p``,
    ``touch -r`` and ``tar -x`` do): the rerun is a different run, refused, not a resume that mixes
    old and new embeddings."""
    import dask.dataframe as dd

    from dask_surge import SurgeOutputError
    from dask_surge.testing import InterruptAfter

    src = tmp_path / "in"
    src.mkdir()
    _write_fixed_width(src, "a")
    out = str(tmp_path / "out")
    kw = dict(model=InterruptAfter(3), b_min=3, b_max=3, scheduler="sync", progress=False)
    with pytest.raises(KeyboardInterrupt):  # SuperBatches 0 and 1 (files p0, p1) committed
        dd.read_parquet(str(src)).surge.encode("text", out, **kw)
    before = {p: os.stat(src / p) for p in ("p0.parquet", "p3.parquet")}
    for name, st in before.items():  # rewrite in place: other texts, same size, the old mtime put back
        import pandas as pd

        pd.DataFrame({"text": [f"b{name[1]}{j}x" for j in range(3)]}).to_parquet(src / name, compression=None)
        os.utime(src / name, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = os.stat(src / name)
        assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)  # what size+mtime saw
    with pytest.raises(SurgeOutputError, match=r"already holds a different run \(input: '\w+' -> '\w+'\)"):
        dd.read_parquet(str(src)).surge.encode("text", out, **kw)


# -- from_map over strings -----------------------------------------------------------------------

DOCSTRINGS = [
    ["register(func, *args, **kwargs) -> func", "SELECT * FROM t WHERE a LIKE '[x]%'"],
    ["see https://example.invalid/a?b=1 or std::vector", ""],
    ["what? ** and *"],
]


def _texts_frame(texts_per_partition):
    import dask.dataframe as dd
    import pandas as pd

    return dd.from_map(
        lambda texts: pd.DataFrame({"text": pd.array(texts, dtype="str")}),
        texts_per_partition,
        meta=pd.DataFrame({"text": pd.Series([], dtype="str")}),
    )


def test_from_map_over_texts_is_encoded(tmp_path, client):
    """Strings that are not paths (a docstring holding ``**``, SQL, a URL in prose) are the input's
    values: the run is identified by them and encoded, not refused as unlistable locations."""
    import dask_surge
    from dask_surge.io.hashing import hash_column, text_hashes
    from dask_surge.planning.identity import input_identity

    ddf = _texts_frame(DOCSTRINGS)
    changed = _texts_frame([DOCSTRINGS[0], DOCSTRINGS[1], ["what? ** and +"]])
    assert input_identity(ddf) != input_identity(changed)
    res = ddf.surge.encode(
        "text", str(tmp_path / "o"), model=dask_surge.testing.checksum_model, progress=False
    )
    assert res.rows == 5
    back = dask_surge.read_embeddings(str(tmp_path / "o")).compute().sort_values(["partition", "row"])
    expected = [t for texts in DOCSTRINGS for t in texts]
    assert back.text_hash.tolist() == hash_column(text_hashes(expected)).to_pylist()


def _read_glob(pattern: str):
    import glob

    import pandas as pd

    return pd.concat([pd.read_parquet(p) for p in sorted(glob.glob(pattern))], ignore_index=True)


def test_a_from_map_string_naming_files_is_still_a_location(tmp_path):
    """A string that names an existing file, or a glob that matches files, stands for those files:
    rewriting one changes the identity although the string is the same."""
    import pandas as pd

    from dask_surge.planning.identity import input_identity

    for i in range(2):
        pd.DataFrame({"text": [f"t{i}"]}).to_parquet(tmp_path / f"p{i}.parquet")
    import dask.dataframe as dd

    meta = pd.DataFrame({"text": pd.Series([], dtype="str")})
    frames = {
        "file": lambda: dd.from_map(pd.read_parquet, [str(tmp_path / "p0.parquet")]),
        "glob": lambda: dd.from_map(_read_glob, [str(tmp_path / "p*.parquet")], meta=meta),
    }
    before = {name: input_identity(make()) for name, make in frames.items()}
    pd.DataFrame({"text": ["changed"]}).to_parquet(tmp_path / "p0.parquet")
    assert all(input_identity(make()) != before[name] for name, make in frames.items())


# -- a null text stops the run: what is kept, and how to resume ---------------------------------


def test_the_null_text_error_says_what_is_kept_and_how_to_resume(tmp_path):
    """Three SuperBatches committed before a null in partition 3: the error says they are kept and that
    a rerun with on_null='empty'/'skip' (not part of the run's identity) resumes from them, as it does."""
    import dask.dataframe as dd
    import pandas as pd

    import dask_surge
    from dask_surge import SurgeInputError

    parts = [["a", "b"], ["c", "d"], ["e", "f"], ["g", None], ["h", "i"]]
    frames = [pd.DataFrame({"text": pd.array(t, dtype="str")}) for t in parts]
    ddf = dd.from_map(lambda i: frames[i], range(len(frames)), enforce_metadata=False)
    out = str(tmp_path / "o")
    kw = dict(model=dask_surge.testing.checksum_model, b_min=2, b_max=2, scheduler="sync", progress=False)
    with pytest.raises(SurgeInputError) as stopped:
        ddf.surge.encode("text", out, **kw)
    message = str(stopped.value)
    assert "null value(s) in partition 3" in message  # the cause and its fix, as before
    assert "3 SuperBatches are committed and kept" in message and "on_null='skip'" in message
    assert "resumes from them" in message
    res = ddf.surge.encode("text", out, on_null="skip", **kw)
    assert res.resumed and res.skipped_superbatches == 3 and res.nulls_skipped == 1
    back = dask_surge.read_embeddings(out).compute()
    assert sorted(zip(back.partition, back.row)) == [
        (p, r) for p, texts in enumerate(parts) for r, t in enumerate(texts) if t is not None
    ]


# -- Parquet files whose types drift ------------------------------------------------------------


def _expect_rows(out: str, texts_by_partition) -> None:
    """Every input row written exactly once, with its own text (``text_hash`` by ``(partition, row)``)."""
    import dask_surge
    from dask_surge.io.hashing import hash_column, text_hashes

    back = dask_surge.read_embeddings(out).compute().sort_values(["partition", "row"])
    want = [(p, r) for p, texts in enumerate(texts_by_partition) for r in range(len(texts))]
    assert list(zip(back.partition, back.row)) == want
    assert (
        back.text_hash.tolist()
        == hash_column(text_hashes([t for ts in texts_by_partition for t in ts])).to_pylist()
    )


def _write(path, texts, **kwargs) -> None:
    import pandas as pd

    path.parent.mkdir(exist_ok=True)
    pd.DataFrame({"text": texts, "n": range(len(texts))}).to_parquet(path, **kwargs)


@pytest.mark.parametrize("empty_at", [0, 2])
def test_an_empty_parquet_file_is_read_with_the_others(tmp_path, client, empty_at):
    """pandas 3 writes an empty text column as ``double``: the file joins its SuperBatch's others (it
    stopped the run mid-way with ArrowTypeError), first file or not (first: Dask's meta says float64)."""
    import dask.dataframe as dd
    import pyarrow.parquet as pq

    import dask_surge

    texts = [["a", "b"], ["c"], ["d", "e", "f"], ["g"]]
    texts.insert(empty_at, [])
    for i, t in enumerate(texts):
        _write(tmp_path / "in" / f"p{i}.parquet", t)
    assert str(pq.read_schema(tmp_path / "in" / f"p{empty_at}.parquet").field("text").type) == "double"
    out = str(tmp_path / "o")
    res = dd.read_parquet(str(tmp_path / "in" / "p*.parquet")).surge.encode(
        "text", out, model=dask_surge.testing.checksum_model, keep=["n"], b_min=4, b_max=8, progress=False
    )
    assert res.rows == 7
    _expect_rows(out, texts)


@pytest.mark.parametrize("null_type", ["null", "float64"])
def test_an_all_null_text_file_takes_the_text_type(tmp_path, null_type):
    """A file whose text column is all null (typed ``null``, or ``double``: a column of NaN) reads as
    strings with the others; its nulls are then what on_null says."""
    import dask.dataframe as dd
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    import dask_surge

    _write(tmp_path / "in" / "p0.parquet", ["a", "b"])
    pq.write_table(
        pa.table({"text": pa.nulls(2, getattr(pa, null_type)()), "n": pa.array([0, 1])}),
        tmp_path / "in" / "p1.parquet",
    )
    _write(tmp_path / "in" / "p2.parquet", ["c"])
    out = str(tmp_path / "o")
    res = dd.read_parquet(str(tmp_path / "in")).surge.encode(
        "text",
        out,
        model=dask_surge.testing.checksum_model,
        on_null="skip",
        b_min=5,
        b_max=5,
        scheduler="sync",
        progress=False,
    )
    assert res.nulls_skipped == 2
    assert sorted(map(tuple, dask_surge.skipped_rows(out).values.tolist())) == [(1, 0), (1, 1)]
    back = dask_surge.read_embeddings(out).compute()
    assert sorted(zip(back.partition, back.row)) == [(0, 0), (0, 1), (2, 0)]
    assert pd.api.types.is_string_dtype(dd.read_parquet(str(tmp_path / "in" / "p0.parquet")).text.dtype)


def test_a_first_file_of_null_texts_does_not_type_the_column(tmp_path):
    """Shrunk from the property: pandas writes a column of None as Arrow ``null`` (no statistics), first
    file: it was taken for the column's type and the file of strings refused as a conflict."""
    import dask.dataframe as dd

    import dask_surge

    _write(tmp_path / "in" / "p0.parquet", [None])
    _write(tmp_path / "in" / "p1.parquet", [""])
    out = str(tmp_path / "o")
    res = dd.read_parquet(str(tmp_path / "in")).surge.encode(
        "text",
        out,
        model=dask_surge.testing.checksum_model,
        on_null="skip",
        b_min=1,
        b_max=1,
        scheduler="sync",
        progress=False,
    )
    assert res.nulls_skipped == 1
    back = dask_surge.read_embeddings(out).compute()
    assert list(zip(back.partition, back.row)) == [(1, 0)]


@pytest.mark.skipif(
    int(__import__("pyarrow").__version__.split(".")[0]) < 21,
    reason="pyarrow writes string_view columns to Parquet from 21 on",
)
@pytest.mark.parametrize("first", ["dictionary", "string_view"])
def test_string_view_and_dictionary_files_are_read_together(tmp_path, first):
    """Shrunk from the property: Arrow has no cast between ``string_view`` and dictionary text; the
    SuperBatch of such files stopped with "Unsupported cast" (cast through large_string now)."""
    import dask.dataframe as dd
    import pyarrow as pa
    import pyarrow.parquet as pq

    import dask_surge

    texts = [["a", None, "a"], ["b", "c"]]
    kinds = [first, "string_view" if first == "dictionary" else "dictionary"]
    (tmp_path / "in").mkdir()
    for i, (t, kind) in enumerate(zip(texts, kinds)):
        arr = pa.array(t, pa.string_view()) if kind == "string_view" else pa.array(t).dictionary_encode()
        pq.write_table(pa.table({"text": arr}), tmp_path / "in" / f"p{i}.parquet")
    out = str(tmp_path / "o")
    dd.read_parquet(str(tmp_path / "in")).surge.encode(
        "text",
        out,
        model=dask_surge.testing.checksum_model,
        on_null="skip",
        b_min=5,
        b_max=5,
        scheduler="sync",
        progress=False,
    )
    back = dask_surge.read_embeddings(out).compute()
    assert sorted(zip(back.partition, back.row)) == [(0, 0), (0, 2), (1, 0), (1, 1)]


def test_a_text_column_of_numbers_names_the_files_own_type(tmp_path, counting_encoder):
    """Shrunk from the property: an empty first file (double) and a file of ints: the refusal said the ints
    file "holds double values" (the meta's type); it names what the file holds."""
    import dask.dataframe as dd

    from dask_surge import SurgeInputError

    _write(tmp_path / "in" / "p0.parquet", [])
    _write(tmp_path / "in" / "p1.parquet", [5, 6])
    with pytest.raises(
        SurgeInputError,
        match=r"the text column 'text' holds int64 values \('.*p1\.parquet'\): "
        r"only strings can be encoded\. Nothing was encoded",
    ):
        dd.read_parquet(str(tmp_path / "in")).surge.encode(
            "text", str(tmp_path / "o"), model=counting_encoder, scheduler="sync", progress=False
        )


def test_a_real_type_conflict_is_refused_from_the_footers_before_any_encoding(tmp_path, counting_encoder):
    import dask.dataframe as dd

    from dask_surge import SurgeInputError

    _write(tmp_path / "in" / "p0.parquet", ["a", "b"])
    _write(tmp_path / "in" / "p1.parquet", [1, 2])  # ints where the other file holds strings
    out = tmp_path / "o"
    with pytest.raises(
        SurgeInputError,
        match=r"p1\.parquet' holds column 'text' as int64, but '.*p0\.parquet' "
        r"holds string values.*nothing was encoded",
    ):
        dd.read_parquet(str(tmp_path / "in" / "p*.parquet")).surge.encode(
            "text", str(out), model=counting_encoder, scheduler="sync", progress=False
        )
    assert [c for c in counting_encoder.calls if c > 1] == [] and not list(
        out.glob("_surge/runs/*/commits/*")
    )


def test_a_conflict_the_footers_cannot_show_is_refused_when_read(tmp_path, counting_encoder):
    """Without statistics a footer cannot tell an all-null column from values: the read tells, and the
    error names both files."""
    import dask.dataframe as dd

    from dask_surge import SurgeInputError

    _write(tmp_path / "in" / "p0.parquet", ["a", "b"])
    _write(tmp_path / "in" / "p1.parquet", [1, 2], write_statistics=False)
    with pytest.raises(
        SurgeInputError,
        match=r"p1\.parquet' holds column 'text' as int64, but '.*p0\.parquet' "
        r"holds string values.*nothing of its SuperBatch was written",
    ):
        dd.read_parquet(str(tmp_path / "in" / "p*.parquet")).surge.encode(
            "text", str(tmp_path / "o"), model=counting_encoder, b_min=4, scheduler="sync", progress=False
        )
    assert [c for c in counting_encoder.calls if c > 1] == []


def test_a_conflict_under_later_steps_is_refused_before_any_encoding(tmp_path, counting_encoder):
    """A ``read_parquet`` with steps on top (a filter): Dask reads the files one partition at a time, so the
    run stopped mid-way on the file of ints ("holds a int"); its footers refuse it first."""
    import dask.dataframe as dd

    from dask_surge import SurgeInputError

    _write(tmp_path / "in" / "p0.parquet", ["a", "b"])
    _write(tmp_path / "in" / "p1.parquet", ["c", "d"])
    _write(tmp_path / "in" / "p2.parquet", [1, 2])
    ddf = dd.read_parquet(str(tmp_path / "in"))
    out = tmp_path / "o"
    with pytest.raises(
        SurgeInputError, match=r"p2\.parquet' holds column 'text' as int64.*nothing was encoded"
    ):
        ddf[ddf.n >= 0].surge.encode(
            "text", str(out), model=counting_encoder, b_min=2, b_max=2, scheduler="sync", progress=False
        )
    assert [c for c in counting_encoder.calls if c > 1] == [] and not list(
        out.glob("_surge/runs/*/commits/*")
    )


def test_a_file_missing_a_kept_column_is_refused_before_any_encoding(tmp_path, counting_encoder):
    import dask.dataframe as dd
    import pandas as pd

    from dask_surge import SurgeInputError

    _write(tmp_path / "in" / "p0.parquet", ["a", "b"])
    pd.DataFrame({"text": ["c"]}).to_parquet(tmp_path / "in" / "p1.parquet")  # no column n
    with pytest.raises(SurgeInputError, match=r"p1\.parquet' has no column 'n'.*Nothing was encoded"):
        dd.read_parquet(str(tmp_path / "in" / "p*.parquet")).surge.encode(
            "text", str(tmp_path / "o"), model=counting_encoder, keep=["n"], scheduler="sync", progress=False
        )
    assert [c for c in counting_encoder.calls if c > 1] == []  # the one-text probe of the dimension only


# -- found by tests/test_input_properties.py ---------------------------------------------------------


@pytest.mark.parametrize("source", ["from_pandas", "read_parquet"])
def test_a_categorical_text_column_with_nulls_encodes_them_as_empty(tmp_path, source):
    """pandas ``category`` text (a dictionary-encoded Parquet column reads as one): a null with
    on_null='empty' is encoded as "" (it raised TypeError: Cannot setitem on a Categorical with a new
    category)."""
    import dask.dataframe as dd
    import pandas as pd

    import dask_surge

    frame = pd.DataFrame({"text": pd.Series([" ", None, "b"], dtype="category")})
    if source == "read_parquet":
        (tmp_path / "in").mkdir()
        frame.to_parquet(tmp_path / "in" / "p0.parquet")
        ddf = dd.read_parquet(str(tmp_path / "in"))
    else:
        ddf = dd.from_pandas(frame, npartitions=1)
    out = str(tmp_path / "o")
    ddf.surge.encode(
        "text",
        out,
        model=dask_surge.testing.checksum_model,
        on_null="empty",
        scheduler="sync",
        progress=False,
    )
    _expect_rows(out, [[" ", "", "b"]])


def test_a_lone_surrogate_met_while_planning_is_a_clear_error(tmp_path):
    """Shrunk from the property: object texts holding a lone surrogate, then set_index: the error is
    dask-surge's lone-surrogate error with its fix, not a bare UnicodeEncodeError from Dask."""
    import dask.dataframe as dd
    import pandas as pd

    import dask_surge
    from dask_surge import SurgeInputError

    frame = pd.DataFrame({"text": pd.Series(["", "a\ud800b"], dtype=object), "n": [0, 1]})
    ddf = dd.from_pandas(frame, npartitions=2, sort=False).set_index("n")
    with pytest.raises(SurgeInputError, match=r"lone surrogate.*Fix"):
        ddf.surge.encode(
            "text",
            str(tmp_path / "o"),
            model=dask_surge.testing.checksum_model,
            scheduler="sync",
            progress=False,
        )


def test_a_committed_file_not_yet_published_is_read_from_staging(tmp_path):
    """Found by the property on the cluster: encode raised (a null) while another SuperBatch task was between
    its commit and its publish; read_embeddings then failed with FileNotFoundError. Here the state a task
    killed between the two leaves: the record committed, the file still in staging/."""
    import dask.dataframe as dd
    import pandas as pd

    import dask_surge
    from dask_surge.io.directory import DATA_FILE
    from dask_surge.io.manifest import current_run

    ddf = dd.from_pandas(pd.DataFrame({"text": list("abcdef")}), npartitions=3)
    out = str(tmp_path / "o")
    ddf.surge.encode(
        "text",
        out,
        model=dask_surge.testing.checksum_model,
        b_min=2,
        b_max=2,
        scheduler="sync",
        progress=False,
    )
    manifest = current_run(OutputStore.open(out))
    last = list(manifest.committed().values())[-1]
    os.replace(
        f"{out}/{last.file}", manifest.staging_path(last.sb, DATA_FILE.match(last.file).group("attempt"))
    )
    back = dask_surge.read_embeddings(out).compute()
    assert sorted(zip(back.partition, back.row)) == [(p, r) for p in range(3) for r in range(2)]
