import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# hermetic: calibrations cached by earlier runs on this machine must not steer b_min="auto"
os.environ["DASK_SURGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="surge-test-cache-")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random-weight BERT sentence-transformers model (mean pooling), built offline."""
    from dask_surge.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def client():
    """A real 2-process local cluster: exercises pickling, plugins and priorities."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            yield c


@pytest.fixture
def counting_encoder():
    """A fresh :class:`dask_surge.testing.CountingEncoder` (installed module: workers can unpickle it)."""
    from dask_surge.testing import CountingEncoder

    return CountingEncoder()
