"""An emulator of the ``cuda.bindings.driver`` calls moonep_ep makes, for machines without a GPU.

``MOONEP_EP_CUDA_EMULATOR=1`` makes ``CudaDriver`` (``--driver cuda`` and
``auto``) use the process-wide instance from :func:`driver_module`, so the
CUDA driver's own code runs on CPU; ``MOONEP_EP_CUDA_EMULATOR_NODE`` describes
the emulated machine (``node.py``). Tests may also build private instances
(``EmulatedCudaApi(node, visible=..., record=True)``) and pass them as
``CudaDriver(api=...)``. :func:`plant_device_fault` makes this process's context
sticky-faulted, as a device-side assert does on a GPU (``EmulatedCudaApi.plant_device_fault``).
"""

from __future__ import annotations

import threading

from .api import EmulatedCudaApi, IllegalAccess, UnknownCall
from .kernels import UnsupportedKernel
from .node import PROFILES, GpuProfile, NodeSpec, NodeSpecError, format_uuid, visible_gpus

__all__ = ["EmulatedCudaApi", "GpuProfile", "IllegalAccess", "NodeSpec", "NodeSpecError", "PROFILES",
           "UnknownCall", "UnsupportedKernel", "driver_module", "format_uuid", "plant_device_fault",
           "visible_gpus"]

_lock = threading.Lock()
_process_api: EmulatedCudaApi | None = None


def driver_module() -> EmulatedCudaApi:
    """This process's emulated driver (one per process, like libcuda)."""
    global _process_api
    with _lock:
        if _process_api is None:
            _process_api = EmulatedCudaApi()
        return _process_api


def plant_device_fault(code: str = "CUDA_ERROR_ASSERT", after_calls: int = 0,
                       why: str = "a device-side assert triggered in a kernel (planted by a test)") -> None:
    """Plant a sticky device fault in this process's emulated driver (:func:`driver_module`, the one
    ``CudaDriver`` uses under ``MOONEP_EP_CUDA_EMULATOR=1``): see ``EmulatedCudaApi.plant_device_fault``."""
    driver_module().plant_device_fault(code, after_calls, why)
