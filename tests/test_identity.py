"""A run's identity is what it encodes (issue 22, item 1; DESIGN.md section 6, "Identity").

The input is its files (however named: a directory, a glob, a list, a URL) and its whole
graph, functions included; the model is its content, closures' data included; only the
options that change embeddings count; credentials never do. Each identity must be the same
in a new process for the same input.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading

import dask.dataframe as dd
import fsspec
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import Encoder, api
from dask_surge.errors import SurgeInputError, SurgeModelError
from dask_surge.execution.superbatch import SuperBatchTask
from dask_surge.planning.identity import IDENTITY_OPTIONS, input_identity


def upper(df):
    return df.assign(text=df.text.str.upper())


def lower(df):
    return df.assign(text=df.text.str.lower())


def _write_inputs(root) -> None:
    (root / "d").mkdir()
    for i in range(3):
        pd.DataFrame({"text": [f"t{i}a", f"t{i}b"]}).to_parquet(root / "d" / f"p{i}.parquet")
    pd.DataFrame({"text": ["x", "y"]}).to_csv(root / "c.csv", index=False)


_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, pandas as pd, dask.dataframe as dd
    from dask_surge import Encoder
    from dask_surge.planning.identity import input_identity

    def upper(df):
        return df.assign(text=df.text.str.upper())

    def linear(w):
        return lambda texts: np.ones((len(texts), w.shape[0])) @ w

    frames = {
        "dir": dd.read_parquet("d"),
        "glob": dd.read_parquet("d/*.parquet"),
        "list": dd.read_parquet(["d/p0.parquet", "d/p1.parquet"]),
        "file_url": dd.read_parquet("file://" + sys.argv[1] + "/d/*.parquet"),
        "csv_glob": dd.read_csv("*.csv"),
        "from_pandas": dd.from_pandas(pd.DataFrame({"text": ["a", "b", "c"]}), npartitions=2),
        "module_function": dd.read_parquet("d").map_partitions(upper),
        "lambda": dd.read_parquet("d").map_partitions(lambda d: d[d.text.isin({"t0a", "t1b", "t2a"})]),
        "from_map": dd.from_map(pd.read_parquet, ["d/p0.parquet", "d/p2.parquet"]),
    }
    out = {name: input_identity(f[["text"]]) for name, f in frames.items()}
    out["closure_model"] = Encoder(linear(np.arange(9.0).reshape(3, 3))).identity()["digest"]
    print(json.dumps(out))
""")


def _identities_in_a_new_process(root, seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed}  # set and frozenset orders differ between the two
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_identity_is_the_same_in_a_new_process(tmp_path):
    """Globs, lists and URLs got a per-process token, so a rerun in a new process was refused."""
    _write_inputs(tmp_path)
    first = _identities_in_a_new_process(tmp_path, "1")
    second = _identities_in_a_new_process(tmp_path, "2")
    assert first == second
    assert first["dir"] == first["glob"] == first["file_url"]  # the same files, however named
    assert len(set(first.values())) == len(first) - 2  # otherwise all different


def test_the_files_behind_a_glob_or_a_directory_are_the_identity(tmp_path):
    _write_inputs(tmp_path)
    glob, folder = str(tmp_path / "d" / "*.parquet"), str(tmp_path / "d")
    before = input_identity(dd.read_parquet(glob)), input_identity(dd.read_parquet(folder))
    st = os.stat(tmp_path / "d" / "p1.parquet")
    pd.DataFrame({"text": ["CHANGED", "t1b"]}).to_parquet(tmp_path / "d" / "p1.parquet")
    os.utime(tmp_path / "d" / "p1.parquet", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    after = input_identity(dd.read_parquet(glob)), input_identity(dd.read_parquet(folder))
    assert before[0] != after[0] and before[1] != after[1]
    csv = str(tmp_path / "*.csv")
    first = input_identity(dd.read_csv(csv))
    os.utime(tmp_path / "c.csv", ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert input_identity(dd.read_csv(csv)) != first  # read_csv's blocks name their files too


def test_a_url_input_is_listed_afresh(tmp_path):
    fs = fsspec.filesystem("memory")
    root = "memory://surge-identity-test"
    with fs.open(f"{root}/a.parquet", "wb") as f:
        pd.DataFrame({"text": ["a"]}).to_parquet(f)
    first = input_identity(dd.read_parquet(f"{root}/*.parquet"))
    assert input_identity(dd.read_parquet(f"{root}/*.parquet")) == first
    with fs.open(f"{root}/b.parquet", "wb") as f:  # a new file under the same glob
        pd.DataFrame({"text": ["b"]}).to_parquet(f)
    assert input_identity(dd.read_parquet(f"{root}/*.parquet")) != first
    fs.rm(root, recursive=True)


def test_every_step_of_the_graph_counts_functions_included():
    """Non-plain operands were dropped: map_partitions(upper) and (lower) shared a run."""
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "B"]}), npartitions=1)
    assert input_identity(ddf.map_partitions(upper)) != input_identity(ddf.map_partitions(lower))
    assert input_identity(ddf.map_partitions(upper)) == input_identity(ddf.map_partitions(upper))

    def suffix(s):
        return lambda d: d.assign(text=d.text + s)

    assert input_identity(ddf.map_partitions(suffix("!"))) != input_identity(ddf.map_partitions(suffix("?")))
    assert input_identity(ddf.map_partitions(suffix("!"))) == input_identity(ddf.map_partitions(suffix("!")))
    assert input_identity(ddf.map_partitions(upper, meta=ddf._meta)) != input_identity(
        ddf.map_partitions(upper)
    )


class _Opaque:
    """Holds a lock: no deterministic token."""

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, texts):
        return np.ones((len(texts), 2))


def _guarded(df, lock=threading.Lock()):  # the point: a default without a deterministic token
    return df


_LOCK = threading.Lock()


def _uses_a_global_lock(df):
    with _LOCK:
        return df


def test_a_step_without_a_deterministic_token_is_refused_with_the_fix(tmp_path, counting_encoder):
    # Dask names a module-level function by reference; its default (a lock) has no token
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1).map_partitions(_guarded)
    with pytest.raises(
        SurgeInputError,
        match=r"MapPartitions \(operand 'func'\).*_guarded.*defaults.*lock"
        r".*__dask_tokenize__.*input_token=",
    ):
        input_identity(ddf)
    out = str(tmp_path / "o")
    kw = dict(model=counting_encoder, scheduler="sync", progress=False, input_token="opaque-v1")
    assert ddf.surge.encode("text", out, **kw).rows == 2
    assert ddf.surge.encode("text", out, **kw).skipped_superbatches == 1  # vouched for: resumes
    assert input_identity(ddf, token="opaque-v1") == "input_token:opaque-v1"
    with pytest.raises(SurgeInputError, match="input_token=''"):
        input_identity(ddf, token="")
    # a global lock is state, not data: the step is identified (by the lock's type)
    plain = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    assert input_identity(plain.map_partitions(_uses_a_global_lock)) == input_identity(
        plain.map_partitions(_uses_a_global_lock)
    )


def test_closures_over_different_weights_are_different_models():
    """A plain callable was identified by its code only."""

    def linear(w):
        return lambda texts: np.ones((len(texts), w.shape[0])) @ w

    a, b = np.eye(3), 2 * np.eye(3)
    assert Encoder(linear(a)).identity() != Encoder(linear(b)).identity()
    assert Encoder(linear(a)).identity() == Encoder(linear(a.copy())).identity()


def test_a_callable_model_without_a_deterministic_token_is_refused():
    with pytest.raises(SurgeModelError, match=r"_Opaque.*__dask_tokenize__"):
        Encoder(_Opaque()).identity()


def _fingerprint(ddf, enc, device="cpu", **opts) -> dict:
    sbe = SuperBatchTask("text", (), enc, **opts)
    return api.fingerprint(ddf[["text"]], sbe, device=device)


def test_only_options_that_change_embeddings_make_a_different_run(tiny_model):
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    enc = Encoder(tiny_model)
    base = _fingerprint(ddf, enc, on_null="error")
    same = [
        _fingerprint(ddf, enc, on_null="skip"),
        _fingerprint(ddf, enc, on_null="empty"),
        _fingerprint(
            ddf, enc.with_options(batch_size=4, max_tokens=512, engine="sentence-transformers", device="cpu")
        ),
    ]
    assert all(fp == base for fp in same)
    assert not {"on_null", "b_min", "b_max", "max_bytes"} & set(base)
    assert _fingerprint(ddf, enc, normalize=True) != base
    assert _fingerprint(ddf, enc.with_options(prompt="query: ")) != base


def test_every_option_of_encode_declares_whether_it_changes_the_run():
    params = set(inspect.signature(api.encode).parameters)
    assert params == set(IDENTITY_OPTIONS)
    for overload in __import__("typing").get_overloads(api.encode):
        assert set(inspect.signature(overload).parameters) == params


def test_dtype_auto_is_recorded_resolved_for_the_runs_device(tiny_model, tmp_path):
    """dtype='auto' was recorded as 'auto': a run begun in fp16 on a GPU resumed in fp32 on a CPU."""
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    enc = Encoder(tiny_model)
    assert _fingerprint(ddf, enc, device="cpu")["model"]["dtype"] == "float32"
    assert _fingerprint(ddf, enc, device="cuda")["model"]["dtype"] == "float16"
    assert _fingerprint(ddf, enc, device="cpu") == _fingerprint(
        ddf, enc.with_options(dtype="float32"), device="cpu"
    )
    assert _fingerprint(ddf, enc, device="cuda") != _fingerprint(ddf, enc, device="cpu")
    # a bfloat16 checkpoint computes in bfloat16 on a GPU, as the engine does
    import shutil

    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_model, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert Encoder(str(bf16)).compute_dtype("cuda") == "bfloat16"
    assert Encoder(lambda t: np.ones((len(t), 2))).compute_dtype("cuda") is None  # a callable: not used


def test_credentials_never_reach_the_identity_or_a_message(tiny_model, tmp_path):
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    secret = "hf_SECRETsecret123"
    kwargs = {"token": secret, "use_auth_token": secret, "api_key": secret, "attn_implementation": "eager"}
    enc = Encoder(tiny_model, model_kwargs=kwargs)
    fp = _fingerprint(ddf, enc)
    assert secret not in json.dumps(fp) and "eager" in json.dumps(fp)
    other = Encoder(tiny_model, model_kwargs={**kwargs, "token": "hf_another"})
    assert _fingerprint(ddf, other) == fp  # another token, the same model: the same run
    for shown in (repr(enc), repr(enc.spec)):
        assert secret not in shown and "***" in shown
    with pytest.raises(dask_surge.SurgeValueError) as err:
        ddf.surge.encode("text", model=enc, model_kwargs={"token": secret})
    assert secret not in str(err.value)

    out = str(tmp_path / "o")
    kwargs = {"token": secret, "attn_implementation": "eager"}  # what the model's loader accepts
    kw = dict(device="cpu", scheduler="sync", progress=False, model=tiny_model)
    dask_surge.encode(ddf, "text", out, model_kwargs=kwargs, **kw)
    for path in (tmp_path / "o").rglob("*.json"):
        assert secret not in path.read_text()
    with pytest.raises(dask_surge.SurgeOutputError, match="different run") as err:
        dask_surge.encode(ddf, "text", out, model_kwargs=kwargs, prompt="query: ", **kw)
    assert secret not in str(err.value)


def test_switching_on_null_after_a_null_stopped_the_run_resumes(tmp_path, counting_encoder):
    """The fix the null error suggests (on_null='skip') was refused as a different run."""
    texts = ["a", "b", "c", "d", "e", "f", None, "h"]
    ddf = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=4)
    out = str(tmp_path / "o")
    kw = dict(model=counting_encoder, b_min=2, b_max=2, scheduler="sync", progress=False)
    with pytest.raises(SurgeInputError, match="on_null"):
        ddf.surge.encode("text", out, **kw)
    committed = dask_surge.status(out)["superbatches_committed"]
    assert committed >= 1
    res = ddf.surge.encode("text", out, on_null="skip", **kw)
    assert res.skipped_superbatches == committed and res.nulls_skipped == 1
    assert len(dask_surge.read_embeddings(out).compute()) == 7
    assert dask_surge.skipped_rows(out).values.tolist() == [[3, 0]]


def test_other_thresholds_resume_with_the_recorded_ones(tmp_path, counting_encoder, caplog):
    ddf = dd.from_pandas(pd.DataFrame({"text": [f"t{i}" for i in range(8)]}), npartitions=4)
    out = str(tmp_path / "o")
    kw = dict(model=counting_encoder, scheduler="sync", progress=False)
    first = ddf.surge.encode("text", out, b_min=2, b_max=2, **kw)
    # as if killed before it finished (a complete run answers before any of this: nothing to do)
    os.unlink(f"{out}/_surge/runs/{first.run_id}/COMPLETE")
    again = ddf.surge.encode("text", out, b_min=4, b_max=8, max_bytes="1 MiB", **kw)
    assert again.run_id == first.run_id and again.superbatches == first.superbatches == 4
    assert "recorded when it started" in caplog.text and "b_min=4 (recorded: 2)" in caplog.text


def _text_of(url: str):
    import pandas as pd

    return pd.DataFrame({"text": [f"about {url}"]})


def test_from_map_over_url_like_strings_treats_an_unlistable_one_as_a_value(monkeypatch):
    # issue 60.7: texts that look like URLs ("s3://bucket/key" as a value handed to the function) failed
    # the run, because the identity tried to list them (no credentials); a string that cannot be listed
    # is a value (issue 53), while a reader's path that cannot be listed stays an error
    import dask.dataframe as dd

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: listing fails at once
    urls = ["s3://no-such-bucket/a", "s3://no-such-bucket/b"]
    one = input_identity(dd.from_map(_text_of, urls))
    assert one == input_identity(dd.from_map(_text_of, list(urls)))
    assert one != input_identity(dd.from_map(_text_of, urls[::-1]))  # the values are the identity
