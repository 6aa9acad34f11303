"""The C allocator of a process that runs a model: keep torch's activation blocks on the heap.

A Dask nanny starts its worker with ``MALLOC_TRIM_THRESHOLD_=65536``
(``distributed.nanny.pre-spawn-environ``). Setting that variable also freezes glibc's
``mmap`` threshold at its 128 KiB start, instead of letting it grow with the blocks a
process frees. Every activation a CPU forward pass allocates above 128 KiB is then a fresh
``mmap`` whose pages the kernel zeroes on first touch, and an ``munmap`` when freed.

:func:`keep_large_blocks` raises the threshold to 32 MiB when a model loads, before its
weights and first activations are allocated (a worker that already grew its heap serves
large blocks from it anyway). The trim threshold Dask asked for stays as it is: freed
memory at the top of the heap still goes back to the system.

Measured on the 2-core CPU, MiniLM: one process, one torch thread, 1,500 real texts: 10.4 s
without the variable, 13.05 s with it, 10.5 s with it and the raised threshold; end to end,
3,000 texts on 2 fresh Dask workers: 17.8 s without, 14.9 s with the raised threshold
(median 1.19x, paired 1.18-1.23x, ``benchmarks/allocator_ab.py``).
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["MMAP_THRESHOLD", "keep_large_blocks"]

#: glibc's ``M_MMAP_THRESHOLD`` parameter of ``mallopt``
_M_MMAP_THRESHOLD = -3

#: 32 MiB: the ceiling glibc's own dynamic threshold reaches on 64-bit systems
MMAP_THRESHOLD = 32 * 1024 * 1024

_done: list[int] = []


def keep_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks below ``threshold`` bytes from the heap (glibc ``mallopt``), once per process.

    Returns True where the allocator took the setting (Linux with glibc), else False
    (macOS, Windows, musl) and changes nothing.

    Examples
    --------
    >>> from dask_surge.models.allocator import keep_large_blocks
    >>> keep_large_blocks()  # in a Dask worker, before the model's first forward pass  # doctest: +SKIP
    True
    """
    if _done:
        return _done[0] == threshold
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - a libc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:  # pragma: no cover - glibc accepts up to 32 MiB
        return False
    _done.append(int(threshold))
    return True
