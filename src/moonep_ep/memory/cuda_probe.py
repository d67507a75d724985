"""What a CUDA device and its driver can do here, with the reason for every 'no'.

:func:`probe` fills a :class:`Capabilities` for one :class:`CudaDriver` and
never raises. :func:`versions` compares the driver's CUDA version with the
CUDA major the installed ``cuda-bindings`` were built for: bindings 13.x need
an R580+ driver (CUDA 13), and on an R550/R570 host (CUDA 12.x) their calls
fail, which a capability probe alone would report as "CUDA unavailable".
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from .cuda_calls import bindings_cuda_major, bindings_fix, emulator_of, is_missing_driver_library
from .driver import Capabilities, HandleType

if TYPE_CHECKING:
    from .cuda import CudaDriver

_ATTRIBUTES = (
    ("vmm", "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "device has no virtual memory management"),
    ("posix_fd", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "device cannot export POSIX fd handles"),
    ("fabric", "HANDLE_TYPE_FABRIC_SUPPORTED",
     "device cannot export FABRIC handles (needs an NVLink fabric / MNNVL domain)"),
    ("multicast", "MULTICAST_SUPPORTED",
     "device has no NVLink multicast (needs SM90+ on NVSwitch and Fabric Manager)"),
)


def versions(api: Any) -> dict[str, Any]:
    """Driver CUDA version vs the bindings' build major, and the fix when they do not fit.

    ``cuDriverGetVersion`` is the one call that works whatever the versions
    (cuda-python's own mismatch warning relies on it)."""
    out: dict[str, Any] = {"driver_cuda": None, "bindings_cuda_major": bindings_cuda_major(api),
                           "compatible": None, "fix": None}
    try:
        result = api.cuDriverGetVersion()
        if int(result[0]) == 0:
            v = int(result[1])
            out["driver_cuda"] = f"{v // 1000}.{v % 1000 // 10}"
            driver_major = v // 1000
            major = out["bindings_cuda_major"]
            out["compatible"] = major is None or major <= driver_major
            if not out["compatible"]:
                out["fix"] = (f"cuda-bindings {major}.x needs a CUDA {major} driver (R580+ for 13.x); this driver "
                              f"supports CUDA {out['driver_cuda']}. Fix: {bindings_fix(driver_major)} (or `make "
                              "install`, which picks the bindings for the installed driver), or upgrade the driver")
    except Exception as exc:  # noqa: BLE001 - a report, never an exception
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def fabric_state(driver: "CudaDriver") -> str:
    """The GPU's fabric registration state as NVML reports it (``nvmlDeviceGetGpuFabricInfoV``:
    ``COMPLETED``, ``IN_PROGRESS``, ``NOT_STARTED``, ``NOT_SUPPORTED``), or ``"unknown: <why>"``.

    The CUDA driver API has no such query; NCCL (``ncclNvmlDeviceGetGpuFabricInfoV``), NVSHMEM,
    FlashInfer (``is_mnnvl_fabric_supported``) and vLLM read NVML. The emulator answers for NVML."""
    emulator = emulator_of(driver.api)
    try:
        if emulator is not None:
            return emulator.gpu_fabric_state(driver.device)
        from cuda.bindings import nvml

        nvml.init_v2()
        try:
            info = nvml.device_get_gpu_fabric_info_v(nvml.device_get_handle_by_uuid(driver.device_uuid()))
            return nvml.GpuFabricState(int(info.state)).name
        finally:
            nvml.shutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML (or no fabric info): the state is unknown
        return f"unknown: {type(exc).__name__}: {exc}"[:200]


def fabric_clique(driver: "CudaDriver") -> tuple[str, str, str]:
    """``(<cluster UUID>/<unicast clique id>, <cluster UUID>/<multicast clique id>, "")`` of the
    device's NVLink cliques, or ``("", "", why not)``.

    ``cuDeviceGetFabricClusterUuid``, ``cuDeviceGetCliqueCount`` and ``cuDeviceGetCliqueInfo``
    are new in CUDA 13.4 (older drivers lack the symbols, older bindings the functions); a GPU
    outside a multi-node NVLink fabric answers NOT_SUPPORTED. A clique is trusted only when the
    fabric state is COMPLETED and the cluster UUID is non-zero, as NCCL, NVSHMEM, FlashInfer and
    vLLM require: while the Fabric Manager registers the GPU, or outside any fabric, the UUID is
    all zeros and every host would look like one clique. An untrusted clique is reported as
    unknown, so a group spanning hosts runs the fabric trial (``domain.py``)."""
    api = driver.api
    dev = driver._cu_device  # set by the probe's first device query
    try:
        cluster = driver.check(api.cuDeviceGetFabricClusterUuid(dev), "cuDeviceGetFabricClusterUuid")
        count = int(driver.check(api.cuDeviceGetCliqueCount(dev), "cuDeviceGetCliqueCount"))
        infos, got = driver.check(api.cuDeviceGetCliqueInfo(count, dev), "cuDeviceGetCliqueInfo")
    except AttributeError:
        return "", "", "these cuda-bindings have no cuDeviceGetCliqueInfo (new in 13.4)"
    except RuntimeError as exc:  # DriverError is one too: NOT_SUPPORTED off a fabric
        return "", "", f"the driver cannot report its NVLink clique: {exc}"
    import uuid

    raw = bytes(cluster.bytes)
    if not any(raw):
        return "", "", "the fabric cluster UUID is all zeros (fabric registration in progress, or no fabric)"
    state = fabric_state(driver)
    if state != "COMPLETED":
        return "", "", f"the GPU's fabric state is {state}, not COMPLETED (NVML)"
    kinds = {int(i.type): int(i.id) for i in reversed(list(infos)[:int(got)])}  # the first of each type
    unicast = kinds.get(int(api.CUcliqueType.CU_CLIQUE_TYPE_UNICAST_POINTER))
    if unicast is None:
        return "", "", "cuDeviceGetCliqueInfo reported no unicast pointer clique"
    cluster_id = uuid.UUID(bytes=raw)
    multicast = kinds.get(int(api.CUcliqueType.CU_CLIQUE_TYPE_MULTICAST_POINTER))
    return (f"{cluster_id}/{unicast:#x}", "" if multicast is None else f"{cluster_id}/{multicast:#x}", "")


def probe(driver: "CudaDriver", caps: Capabilities) -> None:
    """Fill ``caps`` (see :meth:`CudaDriver.capabilities`)."""
    reasons = caps.reasons
    try:
        api = driver.api
    except Exception as exc:
        reasons["driver"] = f"cuda-bindings not importable ({exc}); pip install cuda-bindings"
        return
    caps.emulated = emulator_of(api) is not None
    ver = versions(api)
    try:
        driver.check(api.cuInit(0), "cuInit")
        count = int(driver.check(api.cuDeviceGetCount(), "cuDeviceGetCount"))
    except RuntimeError as exc:
        if is_missing_driver_library(exc):
            reasons["driver"] = f"no NVIDIA driver library (libcuda) found: {exc}"
        elif ver.get("fix"):
            reasons["driver"] = f"{exc}. {ver['fix']}"
        else:
            reasons["driver"] = str(exc)
        return
    if count == 0:
        reasons["driver"] = "no CUDA device visible (CUDA_VISIBLE_DEVICES?)"
        return
    if not 0 <= driver.device < count:
        reasons["driver"] = f"device {driver.device} out of range: {count} device(s) visible"
        return
    try:
        name = driver.device_name()
        caps.device = f"cuda:{driver.device} ({name})" if name else f"cuda:{driver.device}"
        caps.device_id = driver.device_uuid()
    except Exception as exc:
        reasons["driver"] = str(exc)
        return
    caps.available = True
    emulator = emulator_of(api)
    caps.host = emulator.hostname if emulator is not None else socket.gethostname()
    caps.clique, caps.multicast_clique, why_not = fabric_clique(driver)
    if why_not:
        reasons["clique"] = why_not

    for cap, attr, why in _ATTRIBUTES:
        try:
            ok = bool(driver.attribute(attr))
            why = f"{why} (CU_DEVICE_ATTRIBUTE_{attr}=0)"
        except Exception as exc:
            ok, why = False, f"CU_DEVICE_ATTRIBUTE_{attr} query failed: {exc}"
        setattr(caps, cap, ok)
        if not ok:
            reasons[cap] = why

    if count == 1:
        caps.peer_access = None
        reasons["peer_access"] = "only one GPU"
    else:
        blocked = []
        try:
            for peer in range(count):
                if peer != driver.device and not driver.can_access_peer(peer):
                    blocked.append(peer)
            caps.peer_access = not blocked
            if blocked:
                reasons["peer_access"] = (f"cuda:{driver.device} cannot access peer(s) {blocked} "
                                          "(no NVLink/P2P path)")
        except Exception as exc:
            caps.peer_access = False
            reasons["peer_access"] = f"peer query failed: {exc}"

    if caps.vmm and caps.posix_fd:
        try:
            caps.granularity = driver.granularity(HandleType.POSIX_FD)
        except Exception as exc:
            reasons["granularity"] = f"granularity query failed: {exc}"
