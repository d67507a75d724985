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
    CUDA when torch sees a GPU and VMM is supported, else host."""
    if name == "host":
        return HostDriver(rank=rank, **kwargs)
    if name in ("cuda", "auto"):
        import torch

        from .cuda import CudaDriver

        if name == "auto" and not torch.cuda.is_available():
            return HostDriver(rank=rank, **kwargs)
        driver = CudaDriver(rank=rank, **kwargs)
        caps = driver.capabilities()
        if caps.available and caps.vmm:
            return driver
        if name == "auto":
            return HostDriver(rank=rank)
        raise RuntimeError(f"[rank {rank}] CUDA driver unavailable: {caps.reasons}")
    raise ValueError(f"unknown driver {name!r}; use host, cuda or auto")
