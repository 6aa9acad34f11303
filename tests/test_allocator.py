"""The allocator setting that keeps a Dask worker's activation blocks on the heap."""

from __future__ import annotations

import subprocess
import sys

import dask
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")

# in a process started as a Dask nanny starts its workers: does a 4 MiB block come from mmap?
SCRIPT = r"""
import ctypes, sys
libc = ctypes.CDLL(None)

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mmapped_blocks_for_4mib():
    before = libc.mallinfo2().hblks
    block = libc.malloc(4 << 20)
    during = libc.mallinfo2().hblks
    libc.free(block)
    return during - before

def heap_kept_after_freeing_8mib():  # the block came from the heap, which stayed as large once it was freed
    before = libc.mallinfo2().arena
    block = libc.malloc(8 << 20)
    grown = libc.mallinfo2().arena
    libc.free(block)
    return int(grown > before and libc.mallinfo2().arena == grown)

first = mmapped_blocks_for_4mib()
if sys.argv[1] == "keep":
    from dask_surge.engine.allocator import keep_large_blocks
    assert keep_large_blocks()
elif sys.argv[1] == "mmap-only":  # the threshold raised, Dask's trim threshold left as it is
    from dask_surge.engine.allocator import _M_MMAP_THRESHOLD, MMAP_THRESHOLD
    assert libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
print(first, mmapped_blocks_for_4mib(), heap_kept_after_freeing_8mib())
"""


# columns: a 4 MiB block mmapped before the setting, and after it; an 8 MiB block from the heap, kept there once freed
@pytest.mark.parametrize("mode, expected", [("keep", "1 0 1"), ("stock", "1 1 0"), ("mmap-only", "1 0 0")])
def test_a_worker_like_process_serves_large_blocks_from_the_heap_once_told(mode, expected):
    env = {"MALLOC_TRIM_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=120
    )
    if "mallinfo2" in proc.stderr:
        pytest.skip("this C library has no mallinfo2 (glibc < 2.33)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == expected.split()


def test_the_cpu_worker_plugin_applies_it_in_a_worker_process(tiny_model, monkeypatch):
    from dask_surge import Encoder
    from dask_surge.engine import tuning
    from dask_surge.execution import plugins

    calls: list[int] = []
    monkeypatch.setattr(tuning, "keep_large_blocks", lambda: calls.append(1) or True)
    monkeypatch.setattr(tuning, "_applied", {})  # what the plugin records here stays in this test
    plugin = plugins.EncoderPlugin(Encoder(str(tiny_model), device="cpu"), preload=False)
    plugin._tune()  # the client's own process (a user's notebook): left alone
    assert calls == [] and tuning.applied() == {}
    plugin.client_process = ("elsewhere", -1)  # a worker process of its own, on a user's cluster: not applied
    plugin._tune()
    assert calls == [] and tuning.active("gc-pause") and not tuning.active("allocator")
    with dask.config.set({"surge.dedicated-workers": True}):  # a worker dask-surge started
        plugin._tune()
    assert calls == [1] and tuning.active("allocator")
    monkeypatch.setattr(tuning, "_applied", {})
    gpu = plugins.EncoderPlugin(Encoder(str(tiny_model), device="cuda"), preload=False)
    gpu.client_process = ("elsewhere", -1)
    gpu._tune()  # measured only on a CPU: off on a GPU worker
    assert calls == [1] and not tuning.active("gc-pause") and not tuning.active("allocator")
    with dask.config.set({"surge.tuning.allocator": True}):  # forced: on a GPU worker too
        gpu._tune()
    assert calls == [1, 1]
