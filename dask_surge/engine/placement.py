"""The devices a process can encode on, and the compute dtype a model runs in there."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import SurgeValueError

__all__ = [
    "auto_dtype",
    "checkpoint_dtype",
    "default_device",
    "gpu_count",
    "move_to",
    "pick_device",
    "same_device",
]

logger = logging.getLogger(__name__)


def gpu_count() -> int:
    """Number of CUDA devices torch can see in this process (0 without torch/CUDA)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a runtime dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device() -> str:
    """``"cuda"`` where this process sees a GPU, else ``"cpu"``: where ``device=None`` encodes."""
    return "cuda" if gpu_count() else "cpu"


def pick_device(requested: str | None) -> str:
    """The device to load on, checked against the devices this process sees.

    Raises
    ------
    SurgeValueError
        If CUDA is asked for and there is none, or ``cuda:N`` names a device this
        process does not see (a dask-cuda worker sees its one GPU as ``cuda:0``).
    """
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise SurgeValueError(
            f"device={requested!r} asks for a GPU but torch sees none in this process "
            "(torch.cuda.is_available() is False). Fix: pass device='cpu' or device=None, "
            "or run on a machine (or dask-cuda worker) with a GPU."
        )
    if requested.startswith("cuda:"):
        index, count = int(requested[5:]), torch.cuda.device_count()
        if index >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise SurgeValueError(
                f"device={requested!r} does not exist in this process (pid {os.getpid()}): it sees {count} "
                f"GPU(s), cuda:0 to cuda:{count - 1}"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
                + ". A dask-cuda worker sees only its own GPU, as cuda:0. Fix: pass device='cuda' "
                "(or device=None), and choose GPUs with the cluster (e.g. LocalCUDACluster(CUDA_VISIBLE_DEVICES=...))."
            )
    return requested


def move_to(obj: Any, requested: str | None) -> str:
    """Put an in-memory ``SentenceTransformer`` on the device asked for; return that device.

    A model built on the client's CPU and shipped to a GPU worker would otherwise
    run on that worker's CPU in float32, silently and far slower.
    """
    device = pick_device(requested)
    if same_device(str(obj.device), device):
        return str(obj.device)
    logger.info("moving the in-memory model from %s to %s", obj.device, device)
    obj.to(device)
    return device


def same_device(have: str, want: str) -> bool:
    """True when two device names are the same device (``"cuda"`` is ``"cuda:0"``)."""
    norm = {"cuda": "cuda:0"}
    return norm.get(have, have) == norm.get(want, want)


def checkpoint_dtype(obj: Any) -> str | None:
    """The floating dtype a model's weights are stored in (``"bfloat16"``...), or None if unknown.

    Examples
    --------
    >>> import torch
    >>> checkpoint_dtype(torch.nn.Linear(2, 2).to(torch.bfloat16))
    'bfloat16'
    """
    try:
        tensor = next(p for p in obj.parameters() if p.is_floating_point())
    except (StopIteration, AttributeError, TypeError):
        return None
    name = str(tensor.dtype).removeprefix("torch.")
    if name == "float32":  # weights upcast at load: the checkpoint's own dtype is in its config
        for module in getattr(obj, "modules", lambda: ())():
            config = getattr(module, "config", None)
            stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            if stored is not None:
                return str(stored).removeprefix("torch.")
    return name


def auto_dtype(device: str, stored: str | None) -> str:
    """The compute dtype ``dtype="auto"`` means: float32 on CPU; on CUDA bfloat16 for a bfloat16 checkpoint, else float16.

    A bfloat16 checkpoint's activations can exceed float16's range (65504), so it
    never runs in float16 unless asked for.

    Examples
    --------
    >>> auto_dtype("cpu", "bfloat16"), auto_dtype("cuda", "bfloat16"), auto_dtype("cuda:0", "float32")
    ('float32', 'bfloat16', 'float16')
    """
    if not str(device).startswith("cuda"):
        return "float32"
    return "bfloat16" if stored == "bfloat16" else "float16"
