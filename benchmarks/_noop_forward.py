"""A benchmark-side seam: the engine's forward pass replaced by zeros, in the benchmark's own processes.

A host-side benchmark (read, tokenize, sort, pad, write; the GPU session's ``host``
stage) times everything but the model. The package has no switch for
it: this module patches :meth:`dask_surge.engine.forward.DeviceRunner.forward` to return
zeros of the right shape, in this process (:func:`patch`) or in every worker process
(:class:`NoopForward`, a ``distributed.WorkerPlugin`` that :func:`register` sends by value,
so a worker needs no ``benchmarks/`` on its path). Never use it otherwise: every embedding
is zero.

Examples
--------
>>> from benchmarks._noop_forward import patch, unpatch, is_patched
>>> patch(); is_patched()
True
>>> unpatch(); is_patched()
False
"""

from __future__ import annotations

import sys
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["NAME", "NoopForward", "is_patched", "patch", "register", "unregister", "unpatch"]

#: The plugin's name on the workers.
NAME = "surge-bench-noop-forward"
_ORIGINAL = "_surge_bench_real_forward"


def _zeros(self: Any, ids: Any, valid: Any) -> Any:
    """The no-op forward: float32 zeros of shape ``(rows, dimension)`` on the ids' device."""
    import torch

    return torch.zeros((ids.shape[0], self.dimension), dtype=torch.float32, device=ids.device)


def patch() -> None:
    """Replace ``DeviceRunner.forward`` by zeros in this process (idempotent)."""
    from dask_surge.engine.forward import DeviceRunner

    if not hasattr(DeviceRunner, _ORIGINAL):
        setattr(DeviceRunner, _ORIGINAL, DeviceRunner.forward)
        DeviceRunner.forward = _zeros  # type: ignore[method-assign]


def unpatch() -> None:
    """Put the real ``DeviceRunner.forward`` back in this process."""
    from dask_surge.engine.forward import DeviceRunner

    if hasattr(DeviceRunner, _ORIGINAL):
        DeviceRunner.forward = getattr(DeviceRunner, _ORIGINAL)  # type: ignore[method-assign]
        delattr(DeviceRunner, _ORIGINAL)


def is_patched() -> bool:
    """Whether the forward pass is the no-op in this process."""
    from dask_surge.engine.forward import DeviceRunner

    return hasattr(DeviceRunner, _ORIGINAL)


class NoopForward(WorkerPlugin):
    """:func:`patch` in each worker process (and :func:`unpatch` when the plugin is removed)."""

    name = NAME

    def setup(self, worker: Any) -> None:
        patch()

    def teardown(self, worker: Any) -> None:
        unpatch()


def register(client: Any) -> None:
    """Register :class:`NoopForward` on ``client``'s workers, and check that each one took it."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    client.register_plugin(NoopForward(), name=NAME)
    states = client.run(is_patched)
    if not all(states.values()):
        raise RuntimeError(f"the no-op forward is not in every worker: {states}")


def unregister(client: Any) -> None:
    """Remove :class:`NoopForward` from ``client``'s workers: the real forward pass again."""
    client.unregister_worker_plugin(NAME)
