"""The local cluster that ``encode`` and the CLI start listens on loopback only (issue 17, item 8)."""

import ipaddress

import dask
import psutil
import pytest
from distributed import Client

from dask_surge.execution.cluster import _loopback, local_cluster


def _listening(proc: psutil.Process) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of ``proc`` and its children."""
    found = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a child that exited while we looked
            continue
        found += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def test_a_started_cluster_listens_on_loopback_only():
    me = psutil.Process()
    before = {(ip, port) for _, ip, port in _listening(me)}
    with local_cluster(n_workers=2, threads_per_worker=1) as cluster:
        opened = [s for s in _listening(me) if (s[1], s[2]) not in before]
        dashboard = cluster.dashboard_link
        with Client(
            cluster
        ) as client:  # its workers run without the statistical profiler (its CPU is the host's)
            profiling = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
            assert list(profiling.values()) == [False, False]
    assert dask.config.get("distributed.worker.profile.enabled") is True  # this process's config is as it was
    # scheduler, its dashboard, each worker and nanny: at least the scheduler and dashboard
    assert len(opened) >= 2, opened
    exposed = [s for s in opened if not ipaddress.ip_address(s[1]).is_loopback]
    assert exposed == [], f"sockets listening beyond loopback (pid, address, port): {exposed}"
    assert dashboard.startswith("http://127.0.0.1:")


@pytest.mark.parametrize(
    ("given", "host", "dashboard"),
    [
        ({}, "127.0.0.1", "127.0.0.1:0"),
        ({"host": "0.0.0.0"}, "0.0.0.0", "0.0.0.0:0"),  # asked for: every interface
        ({"host": "::1"}, "::1", "[::1]:0"),
        ({"dashboard_address": ":8787"}, "127.0.0.1", ":8787"),  # an explicit dashboard wins
    ],
)
def test_the_user_can_ask_for_other_addresses(given, host, dashboard):
    opts = _loopback({"n_workers": 1, **given})
    assert (opts["host"], opts["dashboard_address"], opts["n_workers"]) == (host, dashboard, 1)
