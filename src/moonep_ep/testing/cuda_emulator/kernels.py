"""The one GPU kernel the emulator runs: moonep_ep's multimem store.

``cuModuleLoadData`` receives PTX text; the emulator reads its ``.version``,
``.target`` and every ``.entry`` signature, and accepts the module only when
each entry is a kernel it knows how to execute (today: the multimem store, a
grid-stride loop of ``ld.global.v4.f32`` + ``multimem.st...v4.f32`` over
16-byte vectors). Anything else is refused loudly: an emulator that
"launches" a kernel it cannot run would pass tests a GPU fails.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re


class UnsupportedKernel(NotImplementedError):
    """PTX or a launch the emulator cannot execute (never silently accepted)."""


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    ptx_params: tuple[str, ...]              # .param types in the .entry signature
    launch_types: tuple[type, ...]           # ctypes types cuLaunchKernel must be given
    required_instruction: str


MULTIMEM_STORE = KernelSpec(
    name="moonep_ep_multimem_st_v4",
    ptx_params=("u64", "u64", "u64"),                       # multicast dst, unicast src, 16-byte vectors
    launch_types=(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64),
    required_instruction="multimem.st",
)
KNOWN_KERNELS = {MULTIMEM_STORE.name: MULTIMEM_STORE}

_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+([A-Za-z_$][\w$]*)")


def parse_module(image: bytes | str, sm: tuple[int, int]) -> dict[str, KernelSpec]:
    """The kernels of a PTX module this emulator can run on a GPU of compute capability ``sm``.

    Raises :class:`UnsupportedKernel` naming what is not supported; returns
    ``{entry name: spec}``. Mirrors what the driver's JIT would reject first:
    a PTX ISA older than multimem needs (8.1) or a target newer than the GPU.
    """
    text = image.decode("utf-8", "replace") if isinstance(image, (bytes, bytearray)) else str(image)
    text = text.split("\0", 1)[0]
    version = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", text, re.M)
    target = re.search(r"^\s*\.target\s+sm_(\d+)(\d)a?\b", text, re.M)
    if not version or not target:
        raise UnsupportedKernel("the CUDA emulator loads PTX text only (a .version and a .target line); "
                                "cubins and fatbins are not emulated")
    if (int(version.group(1)), int(version.group(2))) < (8, 1):
        raise UnsupportedKernel(f"PTX ISA {version.group(1)}.{version.group(2)}: multimem.* needs PTX ISA 8.1+")
    want = (int(target.group(1)), int(target.group(2)))
    if want < (9, 0) or want > sm:
        raise UnsupportedKernel(f"PTX .target sm_{want[0]}{want[1]} cannot run on a compute-capability "
                                f"{sm[0]}.{sm[1]} GPU (multimem needs sm_90+)")
    kernels: dict[str, KernelSpec] = {}
    for name, params in _ENTRY.findall(text):
        spec = KNOWN_KERNELS.get(name)
        if spec is None:
            raise UnsupportedKernel(f"kernel {name!r}: the CUDA emulator executes only "
                                    f"{sorted(KNOWN_KERNELS)}; run other kernels on a GPU")
        types = tuple(t for t, _ in _PARAM.findall(params))
        if types != spec.ptx_params:
            raise UnsupportedKernel(f"kernel {name!r} has .param types {types}, the emulator knows it as "
                                    f"{spec.ptx_params}")
        if spec.required_instruction not in text:
            raise UnsupportedKernel(f"kernel {name!r} does not contain {spec.required_instruction}")
        kernels[name] = spec
    if not kernels:
        raise UnsupportedKernel("the PTX module has no .entry")
    return kernels


def launch_arguments(spec: KernelSpec, kernel_params: object) -> tuple[int, ...]:
    """The integer arguments of a launch, checked against the kernel's signature.

    cuda-bindings takes ``kernelParams`` as ``(values, ctypes types)``; the
    emulator requires exactly that form with the kernel's types (a raw pointer
    array cannot be checked, so it is refused).
    """
    if not (isinstance(kernel_params, tuple) and len(kernel_params) == 2):
        raise UnsupportedKernel(f"{spec.name}: pass kernelParams as (values, ctypes types); the emulator "
                                "checks every argument's type")
    values, types = kernel_params
    if len(values) != len(types):
        raise TypeError("Argument 'kernelParams' has tuples with different length")  # as the bindings say
    if tuple(types) != spec.launch_types:
        raise UnsupportedKernel(f"{spec.name} takes {[t.__name__ for t in spec.launch_types]}, "
                                f"got {[getattr(t, '__name__', t) for t in types]}")
    return tuple(int(v) for v in values)
