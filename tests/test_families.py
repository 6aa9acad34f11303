"""Sparse (SPLADE) and multi-vector (ColBERT) models end to end: ``encode`` writes each family's columns,
equal to sentence-transformers' own ``SparseEncoder`` / ``MultiVectorEncoder``; the options each family
refuses; the identity, reuse, status, the CLI; and a kill and resume on a 2-process cluster per family.

The models are tiny random checkpoints built offline (:mod:`dask_surge.testing`); the texts are real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import dask_surge
from dask_surge import Encoder, SurgeValueError
from dask_surge.io.manifest import current_run
from dask_surge.io.store import OutputStore
from dask_surge.io.multivector import to_matrices
from dask_surge.io.sparse import sparse_arrays, to_csr
from dask_surge.io.verify import verify
from dask_surge.testing import (
    add_to_hub_cache,
    make_tiny_decoder_model,
    make_tiny_multivector_model,
    make_tiny_sparse_model,
    min_cosine,
    package_documents,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEYS = ["partition", "row"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real texts of mixed lengths: most within the models' 128-token window, some over it, one empty."""
    rng = np.random.default_rng(55)
    docs = package_documents(160)
    return [d[: int(rng.integers(5, 700))] for d in docs[:150]] + [""]


@pytest.fixture(scope="module")
def sparse_texts(texts) -> list[str]:
    """A third of :func:`texts` (some over the window, the empty one kept) for the sparse model, whose
    MLM head scores the whole 30,522-word vocabulary at every token: each sparse run here and its
    reference cost 3x less on 2 cores (issue 70) for the same checks."""
    return texts[:50] + [""]


@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory) -> str:
    return make_tiny_sparse_model(tmp_path_factory.mktemp("splade"))


@pytest.fixture(scope="module")
def multivector_model(tmp_path_factory) -> str:
    return make_tiny_multivector_model(tmp_path_factory.mktemp("colbert"))


def frame(texts: list[str], npartitions: int = 6) -> dd.DataFrame:
    return dd.from_pandas(
        pd.DataFrame({"text": texts, "doc_id": np.arange(len(texts))}), npartitions=npartitions
    )


def run(texts, out, model, **kw):
    kw = {"device": "cpu", "scheduler": "sync", "progress": False, "b_min": 8, "b_max": 32, **kw}
    return dask_surge.encode(frame(texts), "text", str(out), model=model, keep=["doc_id"], **kw)


def read(out) -> pd.DataFrame:
    return dask_surge.read_embeddings(str(out)).compute().sort_values(KEYS).reset_index(drop=True)


def reference_sparse(model_dir: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(model_dir, device="cpu")
    return model.encode_document(texts, convert_to_sparse_tensor=True).to_dense().numpy()


def reference_multivector(model_dir: str, texts: list[str], *, query: bool = False, **kw) -> list[np.ndarray]:
    from sentence_transformers import MultiVectorEncoder

    model = MultiVectorEncoder(model_dir, device="cpu")
    encode = model.encode_query if query else model.encode_document
    return [np.asarray(m, dtype=np.float32) for m in encode(texts, convert_to_numpy=True, **kw)]


def token_cosines(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """The smallest cosine of a token vector with its reference (shapes must be equal)."""
    assert [g.shape for g in got] == [r.shape for r in ref]
    both = [(g.astype(np.float64), r.astype(np.float64)) for g, r in zip(got, ref) if len(r)]
    return min(
        float(((g * r).sum(1) / np.linalg.norm(g, axis=1) / np.linalg.norm(r, axis=1)).min()) for g, r in both
    )


# -- sparse -------------------------------------------------------------------------------------------


def test_sparse_output_equals_the_sparse_encoder(tmp_path, sparse_texts, sparse_model):
    res = run(sparse_texts, tmp_path / "o", sparse_model)
    assert (res.rows, res.family, res.engine) == (len(sparse_texts), "sparse", "sentence-transformers")
    assert "sparse output (indices, values)" in str(res)
    df = read(tmp_path / "o")
    assert list(df.columns) == ["partition", "row", "doc_id", "text_hash", "indices", "values"]
    assert df.doc_id.tolist() == list(range(len(sparse_texts)))
    table = pa.Table.from_pandas(df, preserve_index=False)
    assert table.schema.field("indices").type == pa.list_(pa.int32())
    assert table.schema.field("values").type == pa.list_(pa.float32())
    assert all(np.all(np.diff(np.asarray(i)) > 0) for i in df["indices"].tolist())  # ascending, no repeat
    ref = reference_sparse(sparse_model, sparse_texts)
    got = to_csr(table, ref.shape[1]).toarray()
    np.testing.assert_array_equal(got != 0, ref != 0)  # the same non-zeros
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    assert res.truncated == int(
        sum(Encoder(sparse_model).windows([t], chunk_overlap=0).text.size > 1 for t in sparse_texts)
    )
    assert verify(str(tmp_path / "o")) == []


def test_sparse_pruning_keeps_the_top_weights_above_the_threshold(tmp_path, sparse_texts, sparse_model):
    ref = reference_sparse(sparse_model, sparse_texts)
    threshold = float(np.quantile(ref[ref > 0], 0.5))
    run(sparse_texts, tmp_path / "o", sparse_model, sparse_top_k=16, sparse_threshold=threshold)
    df = read(tmp_path / "o")
    indices, values = sparse_arrays(ref, top_k=16, threshold=threshold)
    assert df["indices"].tolist() == [np.asarray(i).tolist() for i in indices.to_pylist()]
    np.testing.assert_allclose(
        np.concatenate([np.asarray(v) for v in df["values"].tolist()]), values.values.to_numpy(), atol=1e-5
    )
    assert max(len(i) for i in df["indices"].tolist()) == 16
    assert (
        current_run(OutputStore.open(str(tmp_path / "o"))).fingerprint["sparse_top_k"] == 16
    )  # another pruning: another run


def test_a_sparse_encoder_object_and_a_hub_name_work_as_its_directory(
    tmp_path, sparse_texts, sparse_model, monkeypatch
):
    from sentence_transformers import SparseEncoder

    run(sparse_texts, tmp_path / "dir", sparse_model)
    expected = read(tmp_path / "dir")
    run(sparse_texts, tmp_path / "obj", SparseEncoder(sparse_model, device="cpu"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_to_hub_cache(tmp_path / "hub", "org/splade-tiny", sparse_model, commit="a" * 40)
    run(sparse_texts, tmp_path / "hub-out", "org/splade-tiny")
    for name in ("obj", "hub-out"):
        got = read(tmp_path / name)
        assert got["indices"].tolist() == expected["indices"].tolist(), name
        np.testing.assert_allclose(
            np.concatenate(got["values"].tolist()), np.concatenate(expected["values"].tolist()), atol=1e-6
        )
    assert current_run(OutputStore.open(str(tmp_path / "hub-out"))).fingerprint["model"]["family"] == "sparse"


# -- multi-vector ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision,floor", [("float32", 0.9999), ("float16", 0.999)])
def test_multivector_output_equals_the_reference(tmp_path, texts, multivector_model, precision, floor):
    res = run(texts, tmp_path / "o", multivector_model, precision=precision)
    assert (res.rows, res.family) == (len(texts), "multivector")
    df = read(tmp_path / "o")
    assert list(df.columns) == ["partition", "row", "doc_id", "text_hash", "vectors", "tokens"]
    inner = (
        pa.Table.from_pandas(df[["vectors"]], preserve_index=False).schema.field("vectors").type.value_type
    )
    assert inner == pa.list_(pa.float32() if precision == "float32" else pa.float16(), 16)
    ref = reference_multivector(multivector_model, texts)
    got = to_matrices(pa.Table.from_pandas(df[["vectors"]], preserve_index=False))
    assert df["tokens"].tolist() == [
        len(r) for r in ref
    ]  # markers and skiplist applied as the reference does
    assert token_cosines(got, ref) >= floor


def test_multivector_query_prompt_and_truncate_dim_follow_sentence_transformers(
    tmp_path, texts, multivector_model
):
    from transformers import AutoTokenizer

    short = texts[:40]
    res = run(short, tmp_path / "q", multivector_model, prompt_name="query")
    got = to_matrices(pa.Table.from_pandas(read(tmp_path / "q")[["vectors"]], preserve_index=False))
    ref = reference_multivector(multivector_model, short, query=True)
    assert {len(r) for r in ref} == {32}  # the query expansion: padded to the query length with [MASK]s
    assert token_cosines(got, ref) >= 0.9999
    tokenizer = AutoTokenizer.from_pretrained(multivector_model)  # queries are cut at 32 tokens, not 128
    assert res.truncated == sum(len(tokenizer("[Q] " + t)["input_ids"]) > 32 for t in short) > 0
    run(short, tmp_path / "t", multivector_model, truncate_dim=8, normalize=True)
    got = to_matrices(pa.Table.from_pandas(read(tmp_path / "t")[["vectors"]], preserve_index=False))
    ref = reference_multivector(multivector_model, short, truncate_dim=8, normalize_embeddings=True)
    assert {g.shape[1] for g in got} == {8}
    assert token_cosines(got, ref) >= 0.9999
    assert all(np.allclose(np.linalg.norm(g, axis=1), 1.0, atol=1e-5) for g in got if len(g))


def test_a_multivector_superbatch_is_capped_by_its_token_vectors(multivector_model, sparse_model):
    from dask_surge.planning.run import windowed_bytes
    from dask_surge.planning.thresholds import CHARS_PER_TOKEN

    mv = Encoder(multivector_model)
    assert windowed_bytes(None, 1000, mv, "truncate", 0, gpu=False) == 1000 * CHARS_PER_TOKEN
    assert windowed_bytes(10**9, 1000, mv, "truncate", 0, gpu=False) == 1000 * CHARS_PER_TOKEN
    assert (
        windowed_bytes(None, 1000, Encoder(sparse_model), "truncate", 0, gpu=False) is None
    )  # a row per text


def test_a_lazy_frame_has_the_family_columns(texts, multivector_model, sparse_model):
    lazy = dask_surge.encode(
        frame(texts[:30], 3), "text", model=multivector_model, device="cpu", b_min=8, b_max=16
    )
    assert list(lazy._meta.columns) == ["partition", "row", "text_hash", "vectors", "tokens"]
    got = lazy.compute(scheduler="sync")
    assert list(got.dtypes.astype(str)) == list(lazy._meta.dtypes.astype(str))
    assert got["tokens"].tolist() == [len(r) for r in reference_multivector(multivector_model, texts[:30])]
    lazy = dask_surge.encode(
        frame(texts[:30], 3), "text", model=sparse_model, device="cpu", b_min=8, b_max=16
    )
    assert list(lazy._meta.columns)[-2:] == ["indices", "values"]
    assert len(lazy.compute(scheduler="sync")) == 30


# -- what every family keeps: identity, reuse, status, CLI, errors ----------------------------------------


def test_the_identity_records_the_family_and_a_dense_one_is_unchanged(sparse_model, multivector_model):
    assert Encoder(sparse_model).identity("cpu")["family"] == "sparse"
    assert Encoder(multivector_model).identity("cpu")["family"] == "multivector"
    assert "family" not in Encoder("default").identity("cpu")  # runs made before families keep their identity
    assert (
        Encoder(sparse_model).family == "sparse" and not Encoder(sparse_model).is_loaded
    )  # read from the files


def test_reuse_copies_a_sparse_outputs_rows(tmp_path, sparse_texts, sparse_model):
    run(sparse_texts, tmp_path / "a", sparse_model)
    res = run(sparse_texts + ["a new text"], tmp_path / "b", sparse_model, reuse=str(tmp_path / "a"))
    assert (res.reused, res.encoded) == (len(sparse_texts), 1)
    a, b = read(tmp_path / "a"), read(tmp_path / "b")
    assert b["indices"].tolist()[: len(sparse_texts)] == a["indices"].tolist()
    run(sparse_texts[:10], tmp_path / "d", "default")
    with pytest.raises(
        dask_surge.SurgeInputError, match="cannot be reused"
    ):  # a dense output is another model
        run(sparse_texts[:10], tmp_path / "c", sparse_model, reuse=str(tmp_path / "d"))


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """``dask-surge <argv>`` run in this process (:func:`dask_surge.cli.main`, what the console script
    calls): ``(exit code, stdout)``. A fresh interpreter per command cost the suite 10-20 s of imports a
    call on 2 cores (issue 70); the console script itself is tested in tests/test_cli.py."""
    from unittest import mock

    from dask_surge.cli import main

    capsys.readouterr()
    with mock.patch.dict(os.environ):  # main() sets defaults in os.environ: restored after
        code = main(argv)
    return code, capsys.readouterr().out


def test_status_and_the_cli_say_the_family(tmp_path, texts, sparse_model, capsys):
    src = tmp_path / "in"
    src.mkdir()
    pd.DataFrame({"text": texts[:40], "doc_id": range(40)}).to_parquet(src / "part-0.parquet")
    code, out = cli(
        [
            "encode",
            str(src),
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "o"),
            "--model",
            sparse_model,
            "--device",
            "cpu",
            "--scheduler",
            "sync",
            "--no-progress",
            "--sparse-top-k",
            "8",
        ],
        capsys,
    )
    assert code == 0
    assert "sparse output (indices, values)" in out
    assert max(len(i) for i in read(tmp_path / "o")["indices"].tolist()) <= 8
    assert dask_surge.status(str(tmp_path / "o"))["family"] == "sparse"
    code, shown = cli(["status", str(tmp_path / "o")], capsys)
    assert code == 0 and "sparse: columns indices, values" in shown, shown


@pytest.mark.parametrize(
    "family,options,match",
    [
        ("sparse", {"precision": "int8", "normalize": True}, "precision='int8' is not for a sparse model"),
        ("sparse", {"precision": "binary"}, "precision='binary' is not for a sparse model"),
        ("sparse", {"normalize": True}, "normalize=True is not for a sparse"),
        ("sparse", {"truncate_dim": 8}, "truncate_dim=8 is not for a sparse"),
        ("sparse", {"long_texts": "mean"}, "long_texts='mean' is not for a sparse"),
        ("multivector", {"long_texts": "chunk"}, "long_texts='chunk' is not for a multi-vector model"),
        (
            "multivector",
            {"precision": "int8", "normalize": True},
            "precision='int8' is not for a multivector model",
        ),
        ("multivector", {"sparse_top_k": 8}, "sparse_top_k=8 prunes the rows of a sparse"),
        ("dense", {"sparse_threshold": 0.1}, "sparse_threshold=0.1 prunes the rows of a sparse"),
        ("sparse", {"sparse_top_k": 0}, "sparse_top_k=0 must be a positive int"),
        ("sparse", {"keep": ["indices"]}, "reserves for its own columns"),
    ],
)
def test_options_a_family_cannot_honour_are_refused_before_any_work(
    tmp_path, texts, sparse_model, multivector_model, family, options, match
):
    model = {"sparse": sparse_model, "multivector": multivector_model, "dense": "default"}[family]
    ddf = dd.from_pandas(pd.DataFrame({"text": texts[:10], "indices": range(10)}), npartitions=2)
    with pytest.raises((SurgeValueError, dask_surge.SurgeInputError), match=match):
        dask_surge.encode(
            ddf,
            "text",
            str(tmp_path / "o"),
            model=model,
            device="cpu",
            scheduler="sync",
            progress=False,
            **options,
        )
    assert not (tmp_path / "o").exists()


# -- kill and resume, per family, on a 2-process cluster ----------------------------------------------------

DRIVER = """
import sys
import dask.dataframe as dd
import dask_surge  # noqa: F401 - the accessor
from distributed import Client, LocalCluster
src, out, model = sys.argv[1:4]
with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \\
        Client(cluster):
    print("started", flush=True)
    res = dd.read_parquet(src).surge.encode("text", out, model=model, device="cpu", b_min=6, b_max=12,
                                            keep=["doc_id"], progress=False)
    print("rows", res.rows, flush=True)
"""


@pytest.mark.slow  # about 45 s a family: in .ci/run's sweep leg, beside the other kill sweeps
@pytest.mark.parametrize("family", ["sparse", "multivector", "decoder"])
def test_kill_a_family_run_then_resume_to_the_same_rows(
    tmp_path, texts, sparse_model, multivector_model, family
):
    """SIGKILL the client and its workers once the first SuperBatches are committed, then rerun: the
    output is the undisturbed run's, each row once, every committed file as recorded."""
    model = {
        "sparse": sparse_model,
        "multivector": multivector_model,
        "decoder": make_tiny_decoder_model(tmp_path / "decoder"),
    }[family]
    src = tmp_path / "in"
    src.mkdir()
    for i in range(10):
        pd.DataFrame({"doc_id": range(15 * i, 15 * i + 15), "text": texts[15 * i : 15 * i + 15]}).to_parquet(
            src / f"part-{i:02d}.parquet"
        )

    def drive(out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", DRIVER, str(src), str(out), model],
            capture_output=True,
            text=True,
            timeout=600,
        )

    # the undisturbed run, in this process: the rows and payloads the killed run must end with (a third
    # interpreter and cluster per family cost the slow leg 15-20 s each on 2 cores, issue 70)
    dask_surge.encode(
        dd.read_parquet(str(src)),
        "text",
        str(tmp_path / "clean"),
        model=model,
        device="cpu",
        b_min=6,
        b_max=12,
        keep=["doc_id"],
        progress=False,
        scheduler="sync",
    )
    ref = read(tmp_path / "clean")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(src), str(out), model],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 300
    while not list(out.glob("part-*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the client, the nannies and the workers at once
    proc.wait(timeout=60)
    committed = len(list(out.glob("part-*.parquet")))
    resumed = drive(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    planned = len(current_run(OutputStore.open(str(out))).committed())  # the killed run's plan, now whole
    assert 0 < committed < planned, (committed, planned)  # killed mid-run
    got = read(out)
    assert not got.duplicated(KEYS).any() and len(got) == 150
    pd.testing.assert_frame_equal(got[[*KEYS, "doc_id", "text_hash"]], ref[[*KEYS, "doc_id", "text_hash"]])
    payload = {
        "sparse": ["indices", "values"],
        "multivector": ["vectors", "tokens"],
        "decoder": ["embedding"],
    }[family]
    for column in payload:
        a, b = got[column].tolist(), ref[column].tolist()
        assert len(a) == len(b)
        for x, y in zip(a, b):
            np.testing.assert_allclose(
                np.asarray(x, dtype=np.float64).ravel()
                if column != "vectors"
                else np.stack(x).astype(np.float64).ravel()
                if len(x)
                else np.zeros(0),
                np.asarray(y, dtype=np.float64).ravel()
                if column != "vectors"
                else np.stack(y).astype(np.float64).ravel()
                if len(y)
                else np.zeros(0),
                atol=1e-5,
            )
    manifest = current_run(OutputStore.open(str(out)))
    assert sorted(p.name for p in out.glob("part-*.parquet")) == sorted(
        r.file for r in manifest.committed().values()
    )
    assert verify(str(out)) == []


@pytest.mark.parametrize(
    "which",
    [
        # slow leg (issue 70): 150-200 s of the default suite on 2 shared cores, where the multi-vector case
        # takes 10-15 s through the same family-framed probe (_FamilyRows, SuperBatchTask.rows). Part of the
        # cost is the Dask probe's I/O-only runs, whose null model returns dense rows of the sparse model's
        # width (30,522 float32 x 2,048 rows x 4 partitions, about 1 GB a round): with those runs cut to 64
        # rows (calibrate._IO_ROWS, tried once) this case still took 66 s here
        pytest.param("sparse", marks=pytest.mark.slow),
        "multivector",
    ],
)
def test_the_cost_model_is_calibrated_on_the_familys_own_calls(
    client, sparse_model, multivector_model, which
):
    """plan()'s constants for a sparse or multi-vector model come from timing its own encode calls, framed
    as its output columns, on the cluster (a dense model's ``encode`` would refuse them)."""
    from dask_surge.execution.calibrate import calibrate

    encoder = Encoder({"sparse": sparse_model, "multivector": multivector_model}[which], device="cpu")
    params = calibrate(encoder, client=client, seconds=3, cache=False)
    assert params is not None and params.per_text_s + params.per_token_s * 10 > 0
    assert params.alpha_s > 0 and params.workers == len(client.scheduler_info()["workers"])


def test_a_sentence_transformers_without_the_familys_class_says_which_release_has_it(
    multivector_model, monkeypatch
):
    import sentence_transformers

    monkeypatch.delattr(sentence_transformers, "MultiVectorEncoder")  # as on sentence-transformers 5
    with pytest.raises(dask_surge.SurgeModelError, match=r"pip install -U 'sentence-transformers>=6'"):
        Encoder(multivector_model, device="cpu", batch_size=3).load()  # a spec no earlier test loaded


@pytest.mark.parametrize("family", ["multivector", "decoder"])
def test_a_family_by_hub_name_through_the_cli(
    tmp_path, texts, multivector_model, family, capsys, monkeypatch
):
    """Every family runs from the command line by its Hub name, resolved offline through the Hugging Face
    cache."""
    model = multivector_model if family == "multivector" else make_tiny_decoder_model(tmp_path / "decoder")
    add_to_hub_cache(tmp_path / "hub", f"org/{family}-tiny", model, commit="b" * 40)
    src = tmp_path / "in"
    src.mkdir()
    pd.DataFrame({"text": texts[:30], "doc_id": range(30)}).to_parquet(src / "part-0.parquet")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = cli(
        [
            "encode",
            str(src),
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "o"),
            "--model",
            f"org/{family}-tiny",
            "--device",
            "cpu",
            "--scheduler",
            "sync",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0
    df = read(tmp_path / "o")
    if family == "multivector":
        assert "multivector output (vectors, tokens)" in out
        assert df["tokens"].tolist() == [len(r) for r in reference_multivector(model, texts[:30])]
    else:
        from sentence_transformers import SentenceTransformer

        assert "engine: fast" in out  # the decoder runs on the fast engine
        ref = SentenceTransformer(model, device="cpu").encode(texts[:30])
        assert min_cosine(np.stack(df["embedding"].to_numpy()), ref) >= 0.9999


def test_the_client_reads_a_familys_dimension_from_its_files(sparse_model, multivector_model):
    """What a run's client asks of the model (family, dimension, identity) loads nothing there."""
    for path, dim in ((sparse_model, 30522), (multivector_model, 16)):
        enc = Encoder(path, device="cpu", batch_size=5)  # a spec no other test loaded
        assert (enc.family, enc.dimension, "family" in enc.identity("cpu")) == (
            {30522: "sparse", 16: "multivector"}[dim],
            dim,
            True,
        )
        assert not enc.is_loaded
        assert enc.load().dimension == dim  # what the loaded model says
