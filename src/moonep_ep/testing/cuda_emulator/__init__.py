"""An emulator of the ``cuda.bindings.driver`` calls moonep_ep makes, for machines without a GPU.

``MOONEP_EP_CUDA_EMULATOR=1`` makes ``CudaDriver`` (``--driver cuda`` and
``auto``) use the process-wide instance from :func:`driver_module`, so the
CUDA driver's own code runs on CPU; ``MOONEP_EP_CUDA_EMULATOR_NODE`` describes
the emulated machine (``node.py``). Tests may also build private instances
(``EmulatedCudaApi(node, visible=..., record=True)``) and pass them as
``CudaDriver(api=...)``.
"""

from __future__ import annotations

import threading

from .api import EmulatedCudaApi, IllegalAccess, UnknownCall
from .kernels import UnsupportedKernel
from .node import PROFILES, GpuProfile, NodeSpec, NodeSpecError, format_uuid, visible_gpus

__all__ = ["EmulatedCudaApi", "GpuProfile", "IllegalAccess", "NodeSpec", "NodeSpecError", "PROFILES",
           "UnknownCall", "UnsupportedKernel", "driver_module", "format_uuid", "visible_gpus"]

_lock = threading.Lock()
_process_api: EmulatedCudaApi | None = None


def driver_module() -> EmulatedCudaApi:
    """This process's emulated driver (one per process, like libcuda)."""
    global _process_api
    with _lock:
        if _process_api is None:
            _process_api = EmulatedCudaApi()
        return _process_api
