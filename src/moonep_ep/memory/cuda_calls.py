"""How moonep_ep calls the CUDA driver: which module, and what a failed call means.

Every ``cu*`` function of ``cuda.bindings.driver`` returns a tuple whose first
item is a ``CUresult``. :func:`check` turns a failure into a
:class:`~moonep_ep.errors.DriverError` naming the result code, the call and
the rank, with a hint on what usually causes that code; it returns the
remaining outputs (none, one, or a tuple).

:func:`driver_module` is ``cuda.bindings.driver``, or, when
``MOONEP_EP_CUDA_EMULATOR=1``, the emulator from
``moonep_ep.testing.cuda_emulator`` (same names, types and returns; CPU only).
"""

from __future__ import annotations

from typing import Any, Callable

from .. import envs
from ..errors import DriverError

#: Why a given result code usually happens, appended to the error message so
#: that the log line from the failing rank says what to do about it.
HINTS: dict[str, str] = {
    "CUDA_ERROR_INVALID_VALUE":
        "sizes, offsets and addresses must be multiples of the granularity queried "
        "for this exact allocation prop; a multicast unbind after the bound memory "
        "was released also reports this",
    "CUDA_ERROR_OUT_OF_MEMORY": "not enough free device memory for this allocation",
    # Sticky errors: the driver refuses every later call in the context (docs/design/reliability.md).
    "CUDA_ERROR_ASSERT": "a device-side assert fired in an earlier kernel; this process's CUDA context is "
                         "unusable: restart every rank (the other ranks are told at the next step)",
    "CUDA_ERROR_LAUNCH_FAILED": "an earlier kernel failed on the device; this process's CUDA context is unusable: "
                                "restart every rank",
    "CUDA_ERROR_NOT_INITIALIZED": "the CUDA driver is not initialised in this process",
    "CUDA_ERROR_INVALID_CONTEXT": "no current CUDA context on this thread",
    "CUDA_ERROR_NO_DEVICE": "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)",
    "CUDA_ERROR_INVALID_DEVICE": "device ordinal out of range or no peer path to it",
    "CUDA_ERROR_ALREADY_MAPPED": "the address range is already mapped; unmap it first",
    "CUDA_ERROR_INVALID_HANDLE":
        "the shareable handle is not valid here (different host or NVLink clique, no shared "
        "IMEX domain for a fabric handle, or the exporter released it before this import)",
    "CUDA_ERROR_NOT_PERMITTED":
        "for FABRIC handles: no IMEX channel (/dev/nvidia-caps-imex-channels) or no "
        "access to it; fall back to POSIX_FD handles within one node",
    "CUDA_ERROR_NOT_SUPPORTED":
        "this device/driver does not support the requested handle type, VMM or "
        "multicast; see capabilities()",
    "CUDA_ERROR_ILLEGAL_STATE":
        "multicast: NVIDIA Fabric Manager not running or restarted without a GPU "
        "reset; or a member bound before every device was added",
    "CUDA_ERROR_SYSTEM_NOT_READY":
        "transient fabric stall while forming the multicast team; retry on all "
        "ranks together or abort on all ranks",
    "CUDA_ERROR_MULTICAST_RESOURCE_FULL": "no multicast resources left on this fabric",
    "CUDA_ERROR_ILLEGAL_ADDRESS":
        "a kernel touched unmapped memory (synchronize before unmap); the context "
        "is now unusable",
    "CUDA_ERROR_INVALID_PTX": "the driver could not JIT-compile the PTX for this GPU",
}


def driver_module() -> Any:
    """``cuda.bindings.driver``, or the emulator when ``MOONEP_EP_CUDA_EMULATOR=1``."""
    if envs.MOONEP_EP_CUDA_EMULATOR:
        from ..testing.cuda_emulator import driver_module as emulated

        return emulated()
    from cuda.bindings import driver  # lazy: importing moonep_ep never needs the bindings

    return driver


def emulator_of(api: Any) -> Any:
    """The emulator behind ``api``, or None for the real bindings."""
    return getattr(api, "moonep_ep_emulator", None)


def is_missing_driver_library(exc: BaseException) -> bool:
    """True for the bindings' "libcuda not found" error (no NVIDIA driver here).

    ``cuda.pathfinder.DynamicLibNotFoundError`` subclasses ``RuntimeError``;
    matched by name so that this module does not import ``cuda.pathfinder``.
    """
    return any(cls.__name__ == "DynamicLibNotFoundError" for cls in type(exc).__mro__)


def code_name(api: Any, code: Any) -> str:
    name = getattr(code, "name", None)
    if name:
        return str(name)
    try:
        return str(api.CUresult(int(code)).name)
    except Exception:  # an unknown code still deserves a readable message
        return f"CUresult({code!r})"


def check(api: Any, result: Any, call: str, detail: str,
          error: Callable[[str, str, str], DriverError]) -> Any:
    """Unpack ``(CUresult, *outputs)``; raise ``error(call, message, code)`` unless CUDA_SUCCESS."""
    if not isinstance(result, tuple) or not result:
        raise error(call, f"unexpected return value {result!r} from the bindings", "")
    code, outs = result[0], result[1:]
    if int(code) != 0:
        name = code_name(api, code)
        parts = [p for p in (detail, HINTS.get(name, "")) if p]
        raise error(call, "; ".join(parts) or "failed", name)
    if not outs:
        return None
    return outs[0] if len(outs) == 1 else outs


def bindings_cuda_major(api: Any) -> int | None:
    """CUDA major version the installed bindings were built for (``CUDA_VERSION // 1000``)."""
    try:
        return int(api.CUDA_VERSION) // 1000
    except Exception:  # noqa: BLE001 - old bindings without the constant
        return None


def bindings_fix(driver_major: int) -> str:
    """What makes the bindings fit a driver supporting CUDA ``driver_major``: the pip command
    for 12.x (R525+) and 13.x (R580+) drivers; older drivers need an upgrade."""
    if driver_major >= 13:
        return f'pip install "cuda-bindings>={driver_major}.0,<{driver_major + 1}"'
    if driver_major == 12:
        return 'pip install "cuda-bindings>=12.8,<13"'
    return "upgrade the NVIDIA driver to R525+ (cuda-bindings 12.x) or R580+ (cuda-bindings 13.x)"
