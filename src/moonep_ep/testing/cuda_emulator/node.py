"""The emulated node: GPU model profiles, GPU count and identities, IMEX, driver version.

A node is described by a short spec string, from ``MOONEP_EP_CUDA_EMULATOR_NODE``
or passed to :class:`~moonep_ep.testing.cuda_emulator.EmulatedCudaApi`::

    H100x8                                   (the default)
    H200x4,imex=channel,cuda=12.8
    B200x2,multicast=0,fabric_rec=4MiB

Fields: ``<profile>x<gpus>`` (H100, H200, B200), ``imex=none|channel|domain``,
``cuda=<major.minor>`` (the CUDA version the driver supports, what
``cuDriverGetVersion`` reports), ``multicast=0|1`` (NVSwitch + Fabric Manager),
``fabric=0|1`` (the FABRIC device attribute; 1 on Hopper/Blackwell whatever
IMEX says), ``p2p=0|1`` (peer access between GPUs), ``node=<name>`` (seeds the
GPU UUIDs), and granularity overrides
``fd_min, fd_rec, fabric_min, fabric_rec, mc_min, mc_rec`` (bytes, K/M/GiB).

Every process of a run derives the same node from the same spec; what each
process *sees* depends on its own ``CUDA_VISIBLE_DEVICES``, as with CUDA.
"""

from __future__ import annotations

import dataclasses
import re
import uuid

MiB = 1 << 20
GiB = 1 << 30

#: Where each figure comes from. Allocation granularity: 2 MiB for device memory
#: on Hopper and Blackwell (TensorRT-LLM's MNNVL test aligns to 2 MiB; NCCL's
#: NVLS_MEM_ALIGN_SIZE is 1 << 21). Multicast RECOMMENDED: 512 MiB has been
#: reported on 8xH100 (the figure that makes a floor-to-RECOMMENDED size 0);
#: MINIMUM is the 2 MiB page. H200 is a Hopper part with the same MMU and is given
#: H100's values; B200's multicast RECOMMENDED is not published, 2 MiB is assumed.


@dataclasses.dataclass(frozen=True)
class GpuProfile:
    """What one GPU model reports through the driver API."""

    model: str
    name: str                     # cuDeviceGetName
    memory_bytes: int             # cuMemGetInfo total
    compute_capability: tuple[int, int]
    fd_min: int = 2 * MiB         # cuMemGetAllocationGranularity, POSIX_FD prop
    fd_rec: int = 2 * MiB
    fabric_min: int = 2 * MiB     # ... FABRIC prop
    fabric_rec: int = 2 * MiB
    mc_min: int = 2 * MiB         # cuMulticastGetGranularity
    mc_rec: int = 2 * MiB


PROFILES: dict[str, GpuProfile] = {
    "H100": GpuProfile("H100", "NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0), mc_rec=512 * MiB),
    "H200": GpuProfile("H200", "NVIDIA H200", 141 * GiB, (9, 0), mc_rec=512 * MiB),
    "B200": GpuProfile("B200", "NVIDIA B200", 180 * GiB, (10, 0)),
}

IMEX_MODES = ("none", "channel", "domain")
_GRAN_KEYS = ("fd_min", "fd_rec", "fabric_min", "fabric_rec", "mc_min", "mc_rec")
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}


class NodeSpecError(ValueError):
    """A node spec that does not parse; the message names the field and the accepted values."""


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One emulated machine.

    ``imex``: ``none`` -- no IMEX channel: creating FABRIC memory fails
    ``CUDA_ERROR_NOT_PERMITTED`` although the device attribute says fabric is
    supported (an x86 HGX out of the box); ``channel`` -- a channel but no IMEX
    daemon/domain: a process can export and re-import its *own* fabric handle,
    a peer's import fails ``CUDA_ERROR_INVALID_HANDLE``; ``domain`` -- a working
    IMEX domain: fabric handles import anywhere on the node.
    """

    profile: GpuProfile = PROFILES["H100"]
    gpus: int = 8
    imex: str = "none"
    cuda_version: int = 13000     # cuDriverGetVersion (R580 drivers report 13.0)
    multicast: bool = True
    fabric_attribute: bool = True
    peer_access: bool = True
    node: str = "node0"

    @classmethod
    def parse(cls, text: str | None) -> "NodeSpec":
        if text is None or not text.strip():
            return cls()
        fields: dict = {}
        grans: dict[str, int] = {}
        for token in (t.strip() for t in text.split(",") if t.strip()):
            m = re.fullmatch(r"([A-Za-z0-9]+)x(\d+)", token)
            if m and "=" not in token:
                fields["profile"] = _profile(m.group(1))
                fields["gpus"] = int(m.group(2))
                continue
            if "=" not in token:
                raise NodeSpecError(f"node spec token {token!r}: use <PROFILE>x<GPUS> (e.g. H100x8) or key=value")
            key, value = (s.strip() for s in token.split("=", 1))
            if key == "profile":
                fields["profile"] = _profile(value)
            elif key == "gpus":
                fields["gpus"] = int(value)
            elif key == "imex":
                if value not in IMEX_MODES:
                    raise NodeSpecError(f"imex={value!r}: use one of {', '.join(IMEX_MODES)}")
                fields["imex"] = value
            elif key == "cuda":
                major, _, minor = value.partition(".")
                fields["cuda_version"] = int(major) * 1000 + int(minor or 0) * 10
            elif key in ("multicast", "fabric", "p2p"):
                name = {"multicast": "multicast", "fabric": "fabric_attribute", "p2p": "peer_access"}[key]
                fields[name] = value not in ("0", "false", "no", "off")
            elif key == "node":
                fields["node"] = value
            elif key in _GRAN_KEYS:
                grans[key] = _size(key, value)
            else:
                raise NodeSpecError(f"node spec key {key!r}: use profile, gpus, imex, cuda, multicast, fabric, p2p, node "
                                    f"or one of {', '.join(_GRAN_KEYS)}")
        if grans:
            fields["profile"] = dataclasses.replace(fields.get("profile", PROFILES["H100"]), **grans)
        spec = cls(**fields)
        if not 1 <= spec.gpus <= 16:
            raise NodeSpecError(f"gpus={spec.gpus}: an emulated node has 1..16 GPUs")
        return spec

    def uuid(self, index: int) -> bytes:
        """16 bytes of GPU ``index``'s UUID (stable for a node name, distinct per GPU)."""
        return uuid.uuid5(uuid.NAMESPACE_URL, f"moonep-ep-cuda-emulator/{self.node}/gpu{index}").bytes

    def uuid_string(self, index: int) -> str:
        return format_uuid(self.uuid(index))


def format_uuid(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi and CUDA_VISIBLE_DEVICES write it."""
    return "GPU-" + str(uuid.UUID(bytes=bytes(raw)))


def visible_gpus(spec: NodeSpec, cuda_visible_devices: str | None) -> list[int]:
    """Physical GPU indices this process sees, in ordinal order, per ``CUDA_VISIBLE_DEVICES``.

    As CUDA does: unset means every GPU; entries are indices or (prefixes of)
    ``GPU-`` UUIDs; the list ends at the first entry that names no GPU or names
    one twice; an empty value hides every GPU.
    """
    if cuda_visible_devices is None:
        return list(range(spec.gpus))
    out: list[int] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        index = None
        if entry.isdigit():
            index = int(entry) if int(entry) < spec.gpus else None
        elif entry.startswith("GPU-"):
            matches = [i for i in range(spec.gpus) if spec.uuid_string(i).startswith(entry)]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in out:
            break
        out.append(index)
    return out


def _profile(name: str) -> GpuProfile:
    try:
        return PROFILES[name.upper()]
    except KeyError:
        raise NodeSpecError(f"GPU profile {name!r}: use one of {', '.join(PROFILES)}") from None


def _size(key: str, text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", text.strip())
    if not m or m.group(2).lower() not in _UNITS:
        raise NodeSpecError(f"{key}={text!r}: give bytes, optionally with K/M/G (binary), e.g. 4MiB")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or value & (value - 1):
        raise NodeSpecError(f"{key}={text!r}: granularities are powers of two")
    return value
