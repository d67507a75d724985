"""The stand-in backend's driver: active, CPU target; it launches nothing (the interpreter does)."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyCPUDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError(f"moonep_ep's stand-in Triton cpu backend builds no launcher (type {ty}). "
                           "Fix: run with TRITON_INTERPRET=1")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", "interpreter", 1)

    def get_active_torch_device(self):  # noqa: ANN201 - torch.device
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):  # noqa: ANN201
        raise RuntimeError("moonep_ep's stand-in Triton cpu backend has no benchmarker (the interpreter is not "
                           "timed). Fix: autotune on a GPU")
