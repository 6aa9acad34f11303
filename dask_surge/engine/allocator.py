"""The C allocator of a Dask worker that runs a model on a CPU: keep activation blocks on the heap.

A Dask nanny starts its worker with ``MALLOC_TRIM_THRESHOLD_=65536``, which also freezes
glibc's ``mmap`` threshold at 128 KiB: every activation block of a CPU forward pass above
that is then a fresh, zero-filled ``mmap``. :func:`keep_large_blocks` sets both thresholds
as glibc's own dynamic rule would (``mmap`` at 32 MiB, trim at twice that): 1.19x on MiniLM
on a CPU cluster (``docs/ab_studies.md``, "Allocator").

``mallopt`` has no undo, and it overrides the trim threshold distributed chose for its worker:
so the worker plugin applies it on ``auto`` only in a CPU worker process dask-surge started
(``surge.dedicated-workers``, set by its own clusters), or where the user turns it on
(``surge.tuning.allocator: true``), never in a user's own process nor on a user's cluster
(``docs/tuning.md``). :func:`applied` says whether this process took it.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["MMAP_THRESHOLD", "applied", "keep_large_blocks"]

#: glibc's ``M_TRIM_THRESHOLD`` and ``M_MMAP_THRESHOLD`` parameters of ``mallopt``
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: 32 MiB: the ceiling glibc's own dynamic threshold reaches on 64-bit systems
MMAP_THRESHOLD = 32 * 1024 * 1024

_done: list[int] = []


def keep_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks below ``threshold`` bytes from the heap, and keep up to twice that free at its top
    (glibc ``mallopt``), once per process.

    Returns True where the allocator took the setting (Linux with glibc), else False
    (macOS, Windows, musl) and changes nothing.

    Examples
    --------
    >>> from dask_surge.engine.allocator import keep_large_blocks
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
    mallopt(_M_TRIM_THRESHOLD, 2 * int(threshold))  # glibc's dynamic rule: trim at twice the mmap threshold
    _done.append(int(threshold))
    return True


def applied() -> int | None:
    """The threshold :func:`keep_large_blocks` set in this process, or None where it never did (the
    allocator is as the process started it).

    Examples
    --------
    >>> applied() is None  # this process never called keep_large_blocks  # doctest: +SKIP
    True
    """
    return _done[0] if _done else None
