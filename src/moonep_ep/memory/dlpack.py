"""Zero-copy torch tensors over raw memory, with the device stated explicitly (DLPack).

A symmetric range starts with *some* rank's memory: asking torch to infer
the device from the pointer (``torch.as_tensor`` of a
``__cuda_array_interface__``) can name the GPU that physically owns the first
page instead of the GPU that maps it. A DLPack capsule carries the device
type and id, as PyTorch's own symmetric memory does with ``from_blob(...,
target_device)`` and TensorRT-LLM (``_dlpack_utils.py``) and FlashInfer
(``dlpack_utils.py``) do with ctypes-built capsules.

Lifetime: the capsule's ``manager_ctx`` keys an entry of :data:`_LIVE` that
holds the ``owner`` (whose finalizer unmaps the memory) and the shape array;
torch calls the deleter when the last tensor sharing the storage dies, which
drops the entry. Layout: DLPack's legacy ``DLManagedTensor`` (capsule name
``"dltensor"``), the version torch's ``from_dlpack`` accepts everywhere.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any

import torch

DL_CPU, DL_CUDA = 1, 2          # DLDeviceType: kDLCPU, kDLCUDA
DL_UINT = 1                     # DLDataTypeCode: kDLUInt


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_LIVE: dict[int, tuple[Any, ...]] = {}   # manager_ctx -> (managed tensor, shape, owner)
_lock = threading.Lock()
_keys = itertools.count(1)


@_Deleter
def _release(managed: Any) -> None:
    with _lock:
        _LIVE.pop(int(managed.contents.manager_ctx or 0), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def managed_tensor(addr: int, nbytes: int, owner: object, device_type: int, device_id: int) -> DLManagedTensor:
    """A ``DLManagedTensor`` describing ``uint8[nbytes]`` at ``addr`` on ``(device_type, device_id)``,
    registered in :data:`_LIVE` (with ``owner``) until its deleter runs."""
    shape = (ctypes.c_int64 * 1)(int(nbytes))
    managed = DLManagedTensor()
    t = managed.dl_tensor
    t.data = int(addr)
    t.device = DLDevice(int(device_type), int(device_id))
    t.ndim = 1
    t.dtype = DLDataType(DL_UINT, 8, 1)
    t.shape = shape
    t.strides = None  # compact row-major
    t.byte_offset = 0
    key = next(_keys)
    managed.manager_ctx = key
    managed.deleter = _release
    with _lock:
        _LIVE[key] = (managed, shape, owner)
    return managed


def tensor_from_pointer(addr: int, nbytes: int, owner: object, device_type: int, device_id: int) -> torch.Tensor:
    """Zero-copy ``torch.uint8[nbytes]`` tensor at ``addr`` on the stated device; ``owner``
    lives until the last tensor sharing this storage dies."""
    managed = managed_tensor(addr, nbytes, owner, device_type, device_id)
    try:
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _release(ctypes.pointer(managed))  # torch did not take it: nothing else will free the entry
        raise


def live_count() -> int:
    """Capsules whose tensors are still alive (tests: the deleter ran)."""
    with _lock:
        return len(_LIVE)
