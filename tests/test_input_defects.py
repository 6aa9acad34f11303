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


def _fresh_python(code: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


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


def test_local_cluster_is_public_and_the_old_path_warns():
    import dask_surge
    from dask_surge.execution.cluster import local_cluster

    assert dask_surge.local_cluster is local_cluster and "local_cluster" in dask_surge.__all__
    with pytest.warns(DeprecationWarning, match="from dask_surge import local_cluster"):
        from dask_surge.cluster import local_cluster as old
    assert old is local_cluster
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from dask_surge import local_cluster as new  # the public path: no warning
    assert new is local_cluster
