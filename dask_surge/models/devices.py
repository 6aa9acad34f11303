"""The devices a process can encode on."""

from __future__ import annotations

__all__ = ["gpu_count", "default_device"]


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
