"""Stores into a multicast address with ``multimem.st`` (a PTX kernel, no compiler needed).

The PTX ISA and the CUDA programming guide allow only ``multimem.*``
instructions on a multicast virtual address; a plain store or a copy-engine
``cudaMemcpy`` there is undefined (NVFuser's CUDA IPC backend calls its memcpy
multicast protocol "not officially supported"). PyTorch's symmetric-memory
kernels, NCCL's NVLS kernels and MoonEP write multicast memory with
``multimem.st``/``multimem.red``.

The kernel below is a grid-stride loop over 16-byte vectors:
``ld.global.v4.f32`` from a unicast source, ``multimem.st.relaxed.sys.global.v4.f32``
to the multicast destination (a store moves the 32-bit patterns unchanged;
``.v4`` is allowed only with float element types). It is loaded from PTX text
with ``cuModuleLoadData`` -- the driver JIT-compiles PTX, so neither NVRTC nor
a toolkit is needed at run time -- and launched with ``cuLaunchKernel``. PTX
ISA 8.1 and ``sm_90`` are what ``multimem`` requires (``ptxas`` rejects
anything older; a test assembles this text for sm_90 where ``ptxas`` exists).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .cuda import CudaDriver

ENTRY = "moonep_ep_multimem_st_v4"
VECTOR_BYTES = 16
THREADS_PER_BLOCK = 256
MAX_BLOCKS = 1024

PTX = f"""\
.version 8.1
.target sm_90
.address_size 64

.visible .entry {ENTRY}(
    .param .u64 mc_dst,
    .param .u64 src,
    .param .u64 vectors
)
{{
    .reg .pred  %p<2>;
    .reg .b32   %r<5>;
    .reg .b64   %rd<10>;
    .reg .f32   %f<4>;

    ld.param.u64    %rd1, [mc_dst];
    ld.param.u64    %rd2, [src];
    ld.param.u64    %rd3, [vectors];
    mov.u32         %r1, %ctaid.x;
    mov.u32         %r2, %ntid.x;
    mov.u32         %r3, %tid.x;
    mov.u32         %r4, %nctaid.x;
    mul.wide.u32    %rd4, %r1, %r2;
    cvt.u64.u32     %rd5, %r3;
    add.s64         %rd4, %rd4, %rd5;
    mul.wide.u32    %rd6, %r4, %r2;
LOOP:
    setp.ge.u64     %p1, %rd4, %rd3;
    @%p1 bra        DONE;
    shl.b64         %rd7, %rd4, 4;
    add.s64         %rd8, %rd2, %rd7;
    add.s64         %rd9, %rd1, %rd7;
    ld.global.v4.f32 {{%f0, %f1, %f2, %f3}}, [%rd8];
    multimem.st.relaxed.sys.global.v4.f32 [%rd9], {{%f0, %f1, %f2, %f3}};
    add.s64         %rd4, %rd4, %rd6;
    bra.uni         LOOP;
DONE:
    ret;
}}
"""


def launch_shape(nbytes: int) -> tuple[int, int, int]:
    """``(blocks, threads per block, 16-byte vectors)`` for a store of ``nbytes``."""
    vectors = nbytes // VECTOR_BYTES
    blocks = max(1, min(MAX_BLOCKS, -(-vectors // THREADS_PER_BLOCK)))
    return blocks, THREADS_PER_BLOCK, vectors


def kernel_params(mc_dst: int, src: int, vectors: int) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """``kernelParams`` in the form cuda-bindings converts: values and their ctypes types."""
    return (int(mc_dst), int(src), int(vectors)), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)


class MultimemKernel:
    """The loaded module and function of one driver's context (unload before the context goes)."""

    def __init__(self, module: Any, function: Any):
        self.module, self.function = module, function

    @classmethod
    def load(cls, driver: "CudaDriver") -> "MultimemKernel":
        module = driver._cu("cuModuleLoadData", PTX.encode() + b"\0", detail="multimem PTX")
        try:
            function = driver._cu("cuModuleGetFunction", module, ENTRY.encode())
        except Exception:
            driver._cu("cuModuleUnload", module)
            raise
        return cls(module, function)

    def unload(self, driver: "CudaDriver") -> None:
        driver._cu("cuModuleUnload", self.module, detail="multimem module")

    def store(self, driver: "CudaDriver", mc_addr: int, src: torch.Tensor, stream: int) -> None:
        nbytes = src.numel()
        if (src.dtype != torch.uint8 or not src.is_contiguous() or src.device != driver.torch_device
                or nbytes % VECTOR_BYTES or mc_addr % VECTOR_BYTES or src.data_ptr() % VECTOR_BYTES):
            # Checked here, before the launch: on a GPU a misaligned v4 load or store faults inside
            # the kernel, asynchronously, and poisons the context for the rest of the process.
            raise driver.error("multimem_store", f"needs a contiguous uint8 tensor on {driver.torch_device} of a "
                               f"multiple of 16 bytes, 16-byte aligned, to a 16-byte aligned address; got "
                               f"{src.dtype} {tuple(src.shape)} on {src.device} at {src.data_ptr():#x} to "
                               f"{mc_addr:#x}. Fix: pad the write to 16 bytes, copy a misaligned view first")
        blocks, threads, vectors = launch_shape(nbytes)
        driver._cu("cuLaunchKernel", self.function, blocks, 1, 1, threads, 1, 1, 0, stream,
                   kernel_params(mc_addr, src.data_ptr(), vectors), 0,
                   detail=f"{ENTRY} to {mc_addr:#x}, {nbytes} bytes")
