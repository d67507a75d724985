"""Which MoonEP ``Buffer`` serves vLLM, which memory driver backs the expert store, and the system check.

``MOONEP_EP_BUFFER`` = ``auto`` (default) | ``reference`` | ``moonep``:

* ``moonep``: the real CUDA library; must be importable, expose the pull
  API vLLM 0.33.0 calls (a ``B`` constructor argument), and report
  NVSwitch multicast (``moonep._C.nvl_multicast_supported()``);
* ``reference``: :class:`moonep_ep.ops.moonep.pull.ReferenceBuffer` (pure
  PyTorch over the EP process group: gloo on CPU, NCCL on GPU; for the push
  API its push counterpart, below);
* ``auto``: ``moonep`` when usable, else ``reference``.

One log line per process says which one serves and why. ``MOONEP_EP_MOONEP_API``
picks the MoonEP API (pull or push) once, here: the reference buffer of that API
serves (``push``: :class:`moonep_ep.ops.moonep.push.PushReferenceBuffer` through
``prepare_finalize/push.py``); a real library serves the API it speaks, and the
real push library is refused until checked on a GPU. The choice
(:class:`~moonep_ep.ops.moonep.api.ApiChoice`) travels with the
:class:`BufferChoice` and says what follows from it (slots, the Buffer's
arguments); the manager, the store and the prepare step ask it.

The expert store (:class:`moonep_ep.layout.store.ShardedExpertStore`) needs,
on GPU, CUDA VMM, a shareable handle type (POSIX fds within one host, fabric
handles across hosts) and peer access; the real MoonEP buffer additionally
needs multicast. :func:`system_check` names every missing piece at backend
selection (when the MoonEP all2all manager is built), before any collective.

:func:`select_buffer` is one rank's view. The manager's backend-selection step
shares it, with every other setting that decides which collective runs
(:func:`local_decisions`), and :func:`agree_decisions` refuses ranks that
differ, alike on every rank.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Optional

from .. import envs
from ..errors import ConfigError
from ..ops.moonep.api import PULL, PUSH, ApiChoice, choose_moonep_api, probe_moonep_api, reference_buffer_class, \
    requested_api

logger = logging.getLogger("vllm.moonep_ep")

BUFFER_CHOICES = envs.VARIABLES["MOONEP_EP_BUFFER"].choices
#: Host pages for the CPU store. Host memory maps at 4 KiB; 64 KiB keeps page
#: padding small for tiny test models while still exercising every alignment rule.
DEFAULT_CPU_GRANULARITY = 64 << 10


@dataclasses.dataclass(frozen=True)
class BufferChoice:
    kind: str              # "reference" or "moonep"
    cls: Any               # the Buffer class
    reason: str
    api_choice: ApiChoice  # the MoonEP API it serves vLLM with, and what follows from it
    requested: str = "auto"  # MOONEP_EP_BUFFER

    @property
    def api(self) -> str:
        """``"pull"`` or ``"push"``."""
        return self.api_choice.api


def _real_moonep(device_type: str) -> tuple[Any, str]:
    """``(moonep.Buffer, "")`` when the real library can serve vLLM 0.33.0 here, else ``(None, why)``."""
    if device_type != "cuda":
        return None, "the real MoonEP library runs on CUDA GPUs only"
    try:
        moonep = importlib.import_module("moonep")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return None, f"the moonep package is not importable ({type(exc).__name__}: {exc})"
    buffer_cls = getattr(moonep, "Buffer", None)
    if buffer_cls is None:
        return None, "the moonep package has no Buffer"
    try:
        probe = probe_moonep_api(buffer_cls)   # the signatures, never a version string
    except ConfigError as exc:
        return None, f"the installed moonep speaks no MoonEP API this code knows ({exc})"
    if probe.api == PUSH:
        return None, (f"the installed moonep has the push API ({', '.join(probe.evidence)}); vLLM 0.33.0 calls "
                      "the pull API (B=, full_*_weight)")
    try:
        from moonep._C import nvl_multicast_supported  # type: ignore[import-not-found]

        if not nvl_multicast_supported():
            return None, "moonep reports no NVSwitch multicast on this GPU/topology"
    except Exception as exc:  # noqa: BLE001
        return None, f"moonep's multicast probe failed ({type(exc).__name__}: {exc})"
    return buffer_cls, ""


_logged: set[str] = set()


def select_buffer(device_type: str) -> BufferChoice:
    """Resolve ``MOONEP_EP_BUFFER`` and ``MOONEP_EP_MOONEP_API`` for this process; logs the choice once.
    This rank's view only: the manager's ``agree_decisions`` compares every rank's."""
    pref = envs.MOONEP_EP_BUFFER
    wanted = requested_api()
    real, why = (None, "MOONEP_EP_BUFFER=reference") if pref == "reference" else _real_moonep(device_type)
    if pref == "moonep" and real is None:
        raise ConfigError(f"MOONEP_EP_BUFFER=moonep, but {why}. Fix: install the MoonEP library on a GPU node "
                          "with NVSwitch multicast, or set MOONEP_EP_BUFFER=reference (or auto)")
    if real is not None and wanted == PUSH:
        raise ConfigError("MOONEP_EP_MOONEP_API=push with the real moonep library: the push path through vLLM "
                          "runs the reference buffer only so far (not yet checked on a GPU with the "
                          "release's kernels). Fix: MOONEP_EP_BUFFER=reference, or MOONEP_EP_MOONEP_API=pull "
                          "with MoonEP at the commit vLLM pins")
    if real is not None:
        kind, cls, reason = "moonep", real, f"MOONEP_EP_BUFFER={pref}: the moonep library is usable"
    else:  # the reference buffer of the API asked for (auto: pull, what vLLM 0.33.0 calls)
        kind, cls, reason = "reference", reference_buffer_class(PUSH if wanted == PUSH else PULL), \
            f"MOONEP_EP_BUFFER={pref}: {why}"
    api = choose_moonep_api(cls, wanted)  # the probe confirms what the class speaks
    choice = BufferChoice(kind, cls, reason, api, pref)
    line = f"moonep_ep: MoonEP buffer = {choice.kind} ({choice.reason}; MoonEP API: {api.reason})"
    if line not in _logged:
        _logged.add(line)
        logger.info(line)
        if choice.kind == "reference" and device_type == "cuda":
            logger.warning(REFERENCE_ON_GPU_WARNING)
    return choice


#: Logged once per process when the reference buffer serves on a GPU.
REFERENCE_ON_GPU_WARNING = (
    "moonep_ep: the reference MoonEP buffer serves on a GPU. It is for correctness: it gathers Python objects "
    "over the EP group on every dispatch and combine, which is slow on GPUs. Fix: install the MoonEP library "
    "at the commit vLLM pins (README, 'Using a GPU'); `moonep-ep check` says which buffer would serve")


# -- decisions every EP rank takes together ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Decisions:
    """Every setting that decides which collective an EP rank runs, as every rank agreed at backend
    selection (``ShardedMoonEPAll2AllManager.__init__``). The hot path (``prepare_finalize/padding.py``) reads
    these, never its own environment: two ranks that decided apart would wait in collectives the other never
    enters."""

    buffer: str                 # "reference" | "moonep": which Buffer's collectives run
    api: str                    # "pull" | "push"
    layout: str                 # MOONEP_EP_LAYOUT: sharded builds the store (collective), replicated all-gathers
    padding: str                # MOONEP_EP_PADDING: balanced all-gathers the loads, own/vllm do not
    cost_profile: str           # the cost model's GPU profile: with the overrides, whether a step swaps its Buffer
    cost_overrides: tuple[tuple[str, Any], ...]
    cost_applies: bool          # whether the cost model picks a step's capacity at all
    max_tokens: Optional[int]   # vLLM's max_num_batched_tokens: the buffer pool's largest capacity
    lockstep_checks: bool = False  # MOONEP_EP_LOCKSTEP_CHECKS: the reference buffer's object gathers, or sync-free


#: Each decision: what it is, and the fix when ranks differ.
AGREED: dict[str, tuple[str, str]] = {
    "buffer": ("MoonEP buffer", "set the same MOONEP_EP_BUFFER on every rank and install the same MoonEP "
                                "library on every node"),
    "api": ("MoonEP API", "set the same MOONEP_EP_MOONEP_API on every rank and install the same MoonEP library "
                          "on every node"),
    "layout": ("expert layout", "set the same MOONEP_EP_LAYOUT on every rank"),
    "padding": ("capacity padding", "set the same MOONEP_EP_PADDING on every rank"),
    "cost_profile": ("cost model's GPU profile", "set the same MOONEP_EP_GPU_PROFILE on every rank (auto reads "
                                                 "each rank's own GPU name)"),
    "cost_overrides": ("cost model's overrides", "set the same cost-model overrides (MOONEP_EP_COST_TFLOPS, "
                                                 "_LINK_GBPS, _HBM_GBPS, _EXPERT_BYTES) on every rank"),
    "cost_applies": ("cost model in use", "set the same MOONEP_EP_GPU_PROFILE on every rank (auto applies the "
                                          "model on GPU ranks only)"),
    "max_tokens": ("buffer pool's largest capacity (max_num_batched_tokens)",
                   "start every engine with the same --max-num-batched-tokens"),
    "lockstep_checks": ("reference buffer's checks (lockstep or sync-free)",
                        "set the same MOONEP_EP_LOCKSTEP_CHECKS on every rank"),
}


def local_decisions(choice: BufferChoice, vllm_config: Any = None) -> dict[str, tuple[Any, str]]:
    """This rank's decisions, ``{name: (value, shown)}`` (``shown`` adds the setting behind the value), to be
    shared in the backend-selection step and compared by :func:`agree_decisions`."""
    from ..ops.decode.cost import cost_overrides, detect_profile
    from .prepare_finalize.padding import cost_model_applies

    profile_setting = envs.MOONEP_EP_GPU_PROFILE
    overrides = cost_overrides()
    applies = cost_model_applies()
    max_tokens = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    max_tokens = None if max_tokens is None else int(max_tokens)
    profile = detect_profile()
    return {
        "buffer": (choice.kind, f"{choice.kind} (MOONEP_EP_BUFFER={choice.requested})"),
        "api": (choice.api, f"{choice.api} (MOONEP_EP_MOONEP_API={choice.api_choice.requested}, "
                            + ("the reference buffer)" if choice.kind == "reference"
                               else f"installed moonep speaks {choice.api_choice.probe.api})")),
        "layout": (envs.MOONEP_EP_LAYOUT, envs.MOONEP_EP_LAYOUT),
        "padding": (envs.MOONEP_EP_PADDING, envs.MOONEP_EP_PADDING),
        "cost_profile": (profile, f"{profile} (MOONEP_EP_GPU_PROFILE={profile_setting})"),
        "cost_overrides": (overrides, ", ".join(f"{var}={value}" for var, value in overrides) or "none"),
        "cost_applies": (applies, f"{'yes' if applies else 'no'} (MOONEP_EP_GPU_PROFILE={profile_setting}, "
                                  f"{'a' if _gpu_visible() else 'no'} GPU)"),
        "max_tokens": (max_tokens, "unknown" if max_tokens is None else str(max_tokens)),
        "lockstep_checks": (envs.MOONEP_EP_LOCKSTEP_CHECKS,
                            f"MOONEP_EP_LOCKSTEP_CHECKS={int(envs.MOONEP_EP_LOCKSTEP_CHECKS)}"),
    }


def _gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def agree_decisions(everyone: list[dict[str, tuple[Any, str]]], rank: int) -> Decisions:
    """The decisions of every rank (``Lockstep.gathered`` of :func:`local_decisions`), the same everywhere;
    else :class:`ConfigError` naming each rank's value and the fix. Every rank compares the same list, so every
    rank raises alike, before any Buffer is built: no rank is left waiting in a collective."""
    differing, fixes = [], []
    for name, (what, fix) in AGREED.items():
        values = [d[name][0] for d in everyone]
        if any(v != values[0] for v in values):
            ranks_by_value: dict[str, list[int]] = {}
            for r, d in enumerate(everyone):
                ranks_by_value.setdefault(d[name][1], []).append(r)
            differing.append(f"{what}: " + ", ".join(f"{shown} on rank(s) {ranks}"
                                                     for shown, ranks in ranks_by_value.items()))
            fixes.append(fix)
    if differing:
        raise ConfigError(f"[rank {rank}] moonep_ep: the EP ranks disagree on settings that decide which "
                          f"collectives run, so each would wait in collectives the others never enter: "
                          f"{'; '.join(differing)}. Fix: {'; '.join(fixes)}")
    return Decisions(**{name: value for name, (value, _) in everyone[0].items()})


def system_check(device_type: str, buffer_kind: str) -> dict[str, Any]:
    """Raise :class:`ConfigError` naming every missing capability; return the capabilities found.

    CPU: the host driver (memfd + mmap) must work. CUDA: VMM, POSIX fd or
    fabric handles, and peer access for the store; multicast too for the real
    buffer (the reference buffer needs none).
    """
    if device_type != "cuda":
        from ..memory.host import HostDriver

        caps = HostDriver(granularity=cpu_granularity()).capabilities()
        if not caps.available:
            raise ConfigError("moonep_ep: the host memory driver is unusable here: "
                              f"{caps.reasons.get('driver')}. Fix: run on Linux with memfd_create")
        return caps.to_json()
    import torch

    from ..memory.cuda import CudaDriver

    with CudaDriver(device=torch.cuda.current_device()) as probe:
        caps = probe.capabilities()
    missing = []
    if not caps.available:
        missing.append(f"CUDA driver ({caps.reasons.get('driver')})")
    else:
        if not caps.vmm:
            missing.append(f"VMM ({caps.reasons.get('vmm')})")
        if not (caps.posix_fd or caps.fabric):
            missing.append(f"POSIX fd or fabric handles (fd: {caps.reasons.get('posix_fd')}; "
                           f"fabric: {caps.reasons.get('fabric')})")
        if caps.peer_access is False:
            missing.append(f"peer access ({caps.reasons.get('peer_access')})")
        if buffer_kind == "moonep" and not caps.multicast:
            missing.append(f"multicast ({caps.reasons.get('multicast')}; the real MoonEP buffer needs it — "
                           "MOONEP_EP_BUFFER=reference runs without)")
    if missing:
        raise ConfigError(f"moonep_ep: --all2all-backend moonep with the sharded layout cannot run on "
                          f"{caps.device}: missing {'; '.join(missing)}. Fix: run on GPUs with CUDA VMM and "
                          "NVLink peer access (`moonep-ep check` lists every capability)")
    return caps.to_json()


def cpu_granularity() -> int:
    return envs.MOONEP_EP_HOST_GRANULARITY or DEFAULT_CPU_GRANULARITY


def make_store_driver(device: Any, rank: int) -> Any:
    """The memory driver for the expert store on ``device`` (a torch device).

    ``MOONEP_EP_CUDA_EMULATOR=1`` on CPU: the CUDA driver over the emulator (tensors stay
    CPU tensors), on emulated GPU ``rank % visible GPUs`` as a launcher would assign."""
    if envs.MOONEP_EP_CUDA_EMULATOR and getattr(device, "type", str(device)) != "cuda":
        from ..memory.cuda import CudaDriver, visible_device_count

        return CudaDriver(device=rank % max(1, visible_device_count()), rank=rank)
    if getattr(device, "type", str(device)) == "cuda":
        from ..memory.cuda import CudaDriver

        index = device.index
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return CudaDriver(device=index, rank=rank)
    from ..memory.host import HostDriver

    return HostDriver(rank=rank, granularity=cpu_granularity())
