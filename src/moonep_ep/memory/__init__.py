"""Symmetric memory: drivers, handle exchange, symmetric allocations.

``make_driver("host" | "cuda" | "auto")`` picks a driver;
``SymmetricMemory.allocate`` is the collective entry point.
"""

from __future__ import annotations

from .driver import Capabilities, HandleType, MemoryDriver, round_up
from .host import HostDriver
from .symmetric import Segment, SymmetricMemory, VirtualRange

__all__ = ["Capabilities", "HandleType", "HostDriver", "MemoryDriver", "Segment", "SymmetricMemory",
           "VirtualRange", "make_driver", "round_up"]


def make_driver(name: str = "auto", *, rank: int | None = None, **kwargs) -> MemoryDriver:
    """``host``: memfd driver; ``cuda``: CUDA VMM on the current device; ``auto``:
    CUDA when torch sees a GPU (or ``MOONEP_EP_CUDA_EMULATOR=1``) and VMM is
    supported, else host. The caller owns the driver: close it (or use ``with``)
    after everything made through it is released."""
    if name == "host":
        return HostDriver(rank=rank, **kwargs)
    if name in ("cuda", "auto"):
        import torch

        from .. import envs
        from .cuda import CudaDriver

        if name == "auto" and not torch.cuda.is_available() and not envs.MOONEP_EP_CUDA_EMULATOR:
            return HostDriver(rank=rank, **kwargs)
        driver = CudaDriver(rank=rank, **kwargs)
        caps = driver.capabilities()
        if caps.available and caps.vmm:
            return driver
        driver.close()
        if name == "auto":
            return HostDriver(rank=rank)
        raise RuntimeError(f"[rank {rank}] CUDA driver unavailable: {caps.reasons}")
    raise ValueError(f"unknown driver {name!r}; use host, cuda or auto")
