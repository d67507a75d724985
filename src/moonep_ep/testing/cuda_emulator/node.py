"""The emulated node: GPU model profiles, GPU count and identities, IMEX, driver version.

A node is described by a short spec string, from ``MOONEP_EP_CUDA_EMULATOR_NODE``
or passed to :class:`~moonep_ep.testing.cuda_emulator.EmulatedCudaApi`::

    H100x8                                   (the default)
    H200x4,imex=channel,cuda=12.8
    B200x2,multicast=0,fabric_rec=4MiB
    GB200x72,hosts=18,imex=domain,cuda=13.4  (an NVL72 domain: 18 hosts of 4 GPUs)
    GB200x72,hosts=18,cliques=2,imex=domain  (the same racks split into two NVLink cliques)

Fields: ``<profile>x<gpus>`` (H100, H200, B200), ``imex=none|channel|domain``,
``cuda=<major.minor>`` (the CUDA version the driver supports, what
``cuDriverGetVersion`` reports), ``multicast=0|1`` (NVSwitch + Fabric Manager),
``fabric=0|1`` (the FABRIC device attribute; 1 on Hopper/Blackwell whatever
IMEX says), ``p2p=0|1`` (peer access between GPUs), ``node=<name>`` (seeds the
GPU UUIDs), and granularity overrides
``fd_min, fd_rec, fabric_min, fabric_rec, mc_min, mc_rec`` (bytes, K/M/GiB).

What a real driver does that a kinder fake would hide:

* ``lazy=<bytes>`` (default 2MiB, ``0`` off): CUDA loads a module's kernels
  into device memory at their first launch (lazy loading, the default since
  CUDA 12.2); the emulator takes that many bytes of the GPU's memory at the
  first launch of each module in a process, shows them in ``cuMemGetInfo``
  and never frees them (not at ``cuModuleUnload``, not at context release:
  the driver keeps its code pools; stricter than a driver that might return
  them). The figure is stated, not measured: one 2 MiB page, the smallest
  device allocation unit; what matters is that it is not zero.
* ``fabric_state=completed|registering|outside`` (default ``completed``):
  what NVML's GPU fabric info reports (``nvmlDeviceGetGpuFabricInfoV``:
  state, cluster UUID, clique ids). ``registering``: the Fabric Manager has
  not finished registering the GPU -- state not COMPLETED, cluster UUID and
  clique ids all zero; ``outside``: a GPU outside any NVLink fabric -- state
  COMPLETED, but a zero cluster UUID and clique id. In both, the clique calls
  answer (zero UUID, clique 0) and FABRIC handles do not cross hosts.
* ``mc_cliques=<c>``: hosts split into ``c`` multicast pointer cliques (default:
  as ``cliques``); a multicast team stays inside one.
* ``mc_fail=<step>:<CODE>[@<gpu>]``: every multicast call of ``step``
  (``create``, ``export``, ``import``, ``add``, ``bind``, ``map``) fails with
  ``CUDA_ERROR_<CODE>`` (e.g. ``bind:MULTICAST_RESOURCE_FULL``), on every GPU or
  only on domain GPU ``gpu`` -- what a GPU whose Fabric Manager ran out of
  multicast resources, stalled or restarted returns.

A multi-host NVLink domain: ``<profile>x<gpus>`` counts every GPU of the
domain (at most 72, at most 16 per host), ``hosts=<n>`` splits them evenly
over ``n`` hosts, ``cliques=<c>`` splits the hosts evenly (in order) into
``c`` NVLink cliques (default 1), ``hostnames=<a>+<b>+...`` names the hosts
(default ``<node>-host<i>``). Each GPU has a host and a clique id; POSIX fds
import only on their own host, FABRIC handles only inside one clique (and,
across processes, only with ``imex=domain``). ``cuDeviceGetCliqueInfo`` and
``cuDeviceGetFabricClusterUuid`` exist from CUDA 13.4 (``cuda=13.4``) and
report ``CUDA_ERROR_NOT_SUPPORTED`` on a single host without ``cliques=``.

Every process of a run derives the same node from the same spec; what each
process *sees* depends on its own ``CUDA_VISIBLE_DEVICES``, as with CUDA, and
on the host it runs on: ``MOONEP_EP_CUDA_EMULATOR_HOST`` (a host index or
name), else the host whose name is this process's hostname, else host 0
(:func:`host_of_process`). ``CUDA_VISIBLE_DEVICES`` indexes that host's GPUs.
"""

from __future__ import annotations

import dataclasses
import re
import socket
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
    # GB200 NVL72: 13.4 TB of HBM3e over 72 GPUs (NVIDIA's GB200 NVL72 data sheet), ~186 GB each.
    "GB200": GpuProfile("GB200", "NVIDIA GB200", 186 * 10**9 // GiB * GiB, (10, 0)),
}

#: The largest NVLink domain modelled (GB200/GB300 NVL72) and GPUs per host.
MAX_DOMAIN_GPUS = 72
MAX_HOST_GPUS = 16
#: The first clique id (real ids are small integers assigned by the fabric manager).
CLIQUE_ID_BASE = 0x7FFE
#: cuDeviceGetCliqueInfo / cuDeviceGetFabricClusterUuid: new in CUDA 13.4 (cuda-bindings 13.4.0 notes).
CLIQUE_CALLS_CUDA_VERSION = 13040

IMEX_MODES = ("none", "channel", "domain")
FABRIC_STATES = ("completed", "registering", "outside")
MC_STEPS = ("create", "export", "import", "add", "bind", "map")
#: Device memory a module's first launch takes (``lazy=``; stated, see the module docstring).
LAZY_LOAD_BYTES = 2 * MiB
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
    hosts: int = 1
    #: NVLink cliques the hosts are split into; 0: a single host with no fabric clique reported.
    cliques: int = 0
    hostnames: tuple[str, ...] = ()
    lazy_load: int = LAZY_LOAD_BYTES
    fabric_state: str = "completed"
    #: multicast pointer cliques the hosts are split into; 0: as ``cliques``
    mc_cliques: int = 0
    #: (step, CUresult name, domain GPU or None for every GPU) of an injected multicast failure
    mc_fail: tuple[str, str, int | None] | None = None

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
            elif key in ("hosts", "cliques"):
                if not value.isdigit() or int(value) < 1:
                    raise NodeSpecError(f"{key}={value!r}: give a positive integer")
                fields[key] = int(value)
            elif key == "hostnames":
                names = tuple(n.strip() for n in value.split("+"))
                if not all(names) or len(set(names)) != len(names):
                    raise NodeSpecError(f"hostnames={value!r}: give distinct names joined by '+', e.g. a+b")
                fields["hostnames"] = names
            elif key in _GRAN_KEYS:
                grans[key] = _size(key, value)
            elif key == "lazy":
                fields["lazy_load"] = 0 if value == "0" else _size(key, value, power_of_two=False)
            elif key == "fabric_state":
                if value not in FABRIC_STATES:
                    raise NodeSpecError(f"fabric_state={value!r}: use one of {', '.join(FABRIC_STATES)}")
                fields["fabric_state"] = value
            elif key == "mc_cliques":
                if not value.isdigit() or int(value) < 1:
                    raise NodeSpecError(f"{key}={value!r}: give a positive integer")
                fields["mc_cliques"] = int(value)
            elif key == "mc_fail":
                fields["mc_fail"] = _mc_fail(value)
            else:
                raise NodeSpecError(f"node spec key {key!r}: use profile, gpus, imex, cuda, multicast, fabric, p2p, node, "
                                    f"hosts, cliques, hostnames, lazy, fabric_state, mc_cliques, mc_fail or one of "
                                    f"{', '.join(_GRAN_KEYS)}")
        if grans:
            fields["profile"] = dataclasses.replace(fields.get("profile", PROFILES["H100"]), **grans)
        spec = cls(**fields)
        spec.validate()
        return spec

    def validate(self) -> None:
        """Raise :class:`NodeSpecError` for a domain that cannot exist, naming the fix."""
        if not 1 <= self.gpus <= MAX_DOMAIN_GPUS:
            raise NodeSpecError(f"gpus={self.gpus}: an emulated NVLink domain has 1..{MAX_DOMAIN_GPUS} GPUs")
        if self.gpus % self.hosts:
            raise NodeSpecError(f"hosts={self.hosts} does not divide {self.gpus} GPUs. Fix: give a GPU count "
                                "that is a multiple of the host count (e.g. GB200x72,hosts=18)")
        if not 1 <= self.gpus_per_host <= MAX_HOST_GPUS:
            raise NodeSpecError(f"{self.gpus_per_host} GPUs per host: an emulated host has 1..{MAX_HOST_GPUS}. "
                                f"Fix: hosts={-(-self.gpus // MAX_HOST_GPUS)} or more")
        if self.cliques and self.hosts % self.cliques:
            raise NodeSpecError(f"cliques={self.cliques} does not divide {self.hosts} hosts. Fix: a clique count "
                                "that divides the host count")
        if self.mc_cliques and self.hosts % self.mc_cliques:
            raise NodeSpecError(f"mc_cliques={self.mc_cliques} does not divide {self.hosts} hosts. Fix: a multicast "
                                "clique count that divides the host count")
        if self.mc_fail and self.mc_fail[2] is not None and not 0 <= self.mc_fail[2] < self.gpus:
            raise NodeSpecError(f"mc_fail names GPU {self.mc_fail[2]}; the domain has GPUs 0..{self.gpus - 1}")
        if self.hostnames and len(self.hostnames) != self.hosts:
            raise NodeSpecError(f"hostnames names {len(self.hostnames)} hosts, hosts={self.hosts}. Fix: one name "
                                "per host")

    # -- the domain: hosts and cliques ---------------------------------------------------------------
    @property
    def gpus_per_host(self) -> int:
        return self.gpus // self.hosts

    @property
    def fabric_domain(self) -> bool:
        """Whether the GPUs report fabric cliques (a multi-host domain, ``cliques=`` given, or a
        ``fabric_state`` other than the default: the clique calls answer, with zeros)."""
        return self.hosts > 1 or self.cliques > 0 or not self.fabric_ready

    def host_name(self, host: int) -> str:
        return self.hostnames[host] if self.hostnames else f"{self.node}-host{host}"

    def host_of_gpu(self, gpu: int) -> int:
        """Host index of domain GPU ``gpu`` (GPUs are numbered host by host)."""
        return gpu // self.gpus_per_host

    def gpu_index(self, host: int, local: int) -> int:
        """Domain index of GPU ``local`` of ``host``."""
        return host * self.gpus_per_host + local

    def clique_of_gpu(self, gpu: int) -> int:
        """NVLink clique id of domain GPU ``gpu`` (hosts split in order into ``cliques`` groups)."""
        hosts_per_clique = self.hosts // max(1, self.cliques)
        return CLIQUE_ID_BASE + self.host_of_gpu(gpu) // hosts_per_clique

    def multicast_clique_of_gpu(self, gpu: int) -> int:
        """Multicast pointer clique id of domain GPU ``gpu`` (``mc_cliques``, else as the unicast cliques)."""
        if not self.mc_cliques:
            return self.clique_of_gpu(gpu)
        return CLIQUE_ID_BASE + self.host_of_gpu(gpu) // (self.hosts // self.mc_cliques)

    @property
    def fabric_ready(self) -> bool:
        """The Fabric Manager registered every GPU into one cluster (``fabric_state=completed``)."""
        return self.fabric_state == "completed"

    def cluster_uuid(self) -> bytes:
        """16 bytes: the fabric cluster UUID every GPU of the domain reports (zero while the fabric is
        registering and outside any fabric, as NVML reports it then)."""
        if not self.fabric_ready:
            return bytes(16)
        return uuid.uuid5(uuid.NAMESPACE_URL, f"moonep-ep-cuda-emulator/{self.node}/cluster").bytes

    def resolve_host(self, text: str) -> int:
        """A host index from an index or a host name; :class:`NodeSpecError` naming the choices."""
        names = [self.host_name(h) for h in range(self.hosts)]
        if text.isdigit() and int(text) < self.hosts:
            return int(text)
        if text in names:
            return names.index(text)
        raise NodeSpecError(f"emulated host {text!r} is not in this domain: give 0..{self.hosts - 1} or one of "
                            f"{names[:4]}{' ...' if len(names) > 4 else ''}")

    def uuid(self, index: int) -> bytes:
        """16 bytes of domain GPU ``index``'s UUID (stable for a node name, distinct per GPU)."""
        return uuid.uuid5(uuid.NAMESPACE_URL, f"moonep-ep-cuda-emulator/{self.node}/gpu{index}").bytes

    def uuid_string(self, index: int) -> str:
        return format_uuid(self.uuid(index))


def host_of_process(spec: NodeSpec, override: str | None = None) -> int:
    """Which host of ``spec`` this process runs on: ``override`` (or ``MOONEP_EP_CUDA_EMULATOR_HOST``),
    a host index or name; else the host named like this process's hostname; else host 0."""
    from ... import envs

    text = override if override is not None else (envs.MOONEP_EP_CUDA_EMULATOR_HOST or "")
    if text.strip():
        text = text.strip()
        return spec.resolve_host(text)
    me = socket.gethostname()
    for host in range(spec.hosts):
        if spec.host_name(host) == me:
            return host
    return 0


def format_uuid(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi and CUDA_VISIBLE_DEVICES write it."""
    return "GPU-" + str(uuid.UUID(bytes=bytes(raw)))


def visible_gpus(spec: NodeSpec, cuda_visible_devices: str | None, host: int = 0) -> list[int]:
    """Domain GPU indices this process on ``host`` sees, in ordinal order, per ``CUDA_VISIBLE_DEVICES``.

    As CUDA does: unset means every GPU of the host; entries are indices (of
    the host's GPUs) or (prefixes of) ``GPU-`` UUIDs; the list ends at the
    first entry that names no GPU of the host or names one twice; an empty
    value hides every GPU.
    """
    local = [spec.gpu_index(host, i) for i in range(spec.gpus_per_host)]
    if cuda_visible_devices is None:
        return local
    out: list[int] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        index = None
        if entry.isdigit():
            index = local[int(entry)] if int(entry) < len(local) else None
        elif entry.startswith("GPU-"):
            matches = [i for i in local if spec.uuid_string(i).startswith(entry)]
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


def _mc_fail(text: str) -> tuple[str, str, int | None]:
    m = re.fullmatch(r"(\w+):(?:CUDA_ERROR_)?([A-Z_]+)(?:@(\d+))?", text.strip())
    if not m or m.group(1) not in MC_STEPS:
        raise NodeSpecError(f"mc_fail={text!r}: give <step>:<CODE>[@<gpu>] with step one of {', '.join(MC_STEPS)}, "
                            "e.g. bind:MULTICAST_RESOURCE_FULL")
    return m.group(1), f"CUDA_ERROR_{m.group(2)}", None if m.group(3) is None else int(m.group(3))


def _size(key: str, text: str, power_of_two: bool = True) -> int:
    m = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", text.strip())
    if not m or m.group(2).lower() not in _UNITS:
        raise NodeSpecError(f"{key}={text!r}: give bytes, optionally with K/M/G (binary), e.g. 4MiB")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or (power_of_two and value & (value - 1)):
        raise NodeSpecError(f"{key}={text!r}: granularities are powers of two")
    return value
