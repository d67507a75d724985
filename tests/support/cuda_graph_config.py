"""CUDA graphs under ``--all2all-backend moonep``: vLLM 0.33.0's ``VllmConfig`` with and without the plugin's patch.

Run in the vLLM 0.33.0 environment (``python -m tests.support.cuda_graph_config``); prints one JSON object.
This machine has no GPU, so vLLM's platform is ``UnspecifiedPlatform``: the model and parallel configs are built
as it is, then it is reported as CUDA with static graphs (``_enum`` and ``support_static_graph_mode``), as on a
GPU, and ``VllmConfig`` is built with ``DeviceConfig("cuda")``. Each case: the ``cudagraph_mode`` and compilation
mode vLLM settles on, ``VLLM_USE_BREAKABLE_CUDAGRAPH`` after it, and the log lines of vLLM's moonep rule and of
the plugin. ``eager_break`` runs the MoE op's eager break (``graphs.eager_between_pieces``) under vLLM's own
``BreakableCUDAGraphCapture`` with its CUDA graph segments stood in by markers (and its weak references, a CUDA
build's C op, by aliases). ``full_runtime``: the op under a plain capture, in a FULL runtime forward and in others.
``runner_patch`` calls vLLM's ``MoERunner._select_forward`` under the plugin.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Iterator

BREAKABLE = "VLLM_USE_BREAKABLE_CUDAGRAPH"
CPU, CPU_GRAPHS = "MOONEP_EP_CPU", "MOONEP_EP_CPU_MOE_GRAPHS"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _without_graph_patch() -> Iterator[None]:
    """The control: the plugin installed, only its CUDA-graph patch of ``VllmConfig`` taken off."""
    from vllm.config import VllmConfig

    from moonep_ep.vllm import graphs

    saved = {name: getattr(VllmConfig, name) for name in ("__post_init__", "_set_compile_ranges")}
    for name, fn in saved.items():
        assert getattr(fn, graphs._MARK, False), name
        setattr(VllmConfig, name, fn.__wrapped__)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(VllmConfig, name, fn)


def config_cases(model_dir: str) -> dict[str, Any]:
    from vllm.config import CompilationConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.platforms import PlatformEnum, current_platform

    def par(backend: str = "moonep") -> Any:
        return ParallelConfig(all2all_backend=backend, enable_expert_parallel=True, data_parallel_size=2)

    model, eager_model = ModelConfig(model=model_dir, dtype="bfloat16"), ModelConfig(
        model=model_dir, dtype="bfloat16", enforce_eager=True)
    built = {"moonep": par(), "other": par("allgather_reducescatter")}
    cases: dict[str, tuple[dict[str, Any], dict[str, str], bool]] = {
        "plugin": ({"model_config": model, "parallel_config": built["moonep"]}, {}, True),
        "control_without_patch": ({"model_config": model, "parallel_config": built["moonep"]}, {}, False),
        "enforce_eager": ({"model_config": eager_model, "parallel_config": built["moonep"]}, {}, True),
        "cudagraph_mode_none": ({"model_config": model, "parallel_config": built["moonep"],
                                 "compilation_config": CompilationConfig(cudagraph_mode="NONE")}, {}, True),
        "full_asked": ({"model_config": model, "parallel_config": built["moonep"],
                        "compilation_config": CompilationConfig(cudagraph_mode="FULL")}, {}, True),
        "full_decode_asked": ({"model_config": model, "parallel_config": built["moonep"],
                               "compilation_config": CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY")}, {}, True),
        "full_and_piecewise_asked": ({"model_config": model, "parallel_config": built["moonep"],
                                      "compilation_config": CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")},
                                     {}, True),
        "full_and_piecewise_breakable_off": ({"model_config": model, "parallel_config": built["moonep"],
                                              "compilation_config": CompilationConfig(
                                                  cudagraph_mode="FULL_AND_PIECEWISE")}, {BREAKABLE: "0"}, True),
        "full_decode_without_patch": ({"model_config": model, "parallel_config": built["moonep"],
                                       "compilation_config": CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY")},
                                      {}, False),
        "breakable_off": ({"model_config": model, "parallel_config": built["moonep"]}, {BREAKABLE: "0"}, True),
        # the CPU engine (MOONEP_EP_CPU=1): a full decode mode turns the MoE step's graph emulator on, others not
        "cpu_engine_full_decode": ({"model_config": model, "parallel_config": built["moonep"],
                                    "compilation_config": CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY")},
                                   {CPU: "1"}, True),
        "cpu_engine_piecewise": ({"model_config": model, "parallel_config": built["moonep"],
                                  "compilation_config": CompilationConfig(cudagraph_mode="PIECEWISE")},
                                 {CPU: "1"}, True),
        "cpu_engine_default": ({"model_config": model, "parallel_config": built["moonep"]}, {CPU: "1"}, True),
        "cpu_engine_full_decode_other_backend": ({"model_config": model, "parallel_config": built["other"],
                                                  "compilation_config": CompilationConfig(
                                                      cudagraph_mode="FULL_DECODE_ONLY")}, {CPU: "1"}, True),
        "other_backend": ({"model_config": model, "parallel_config": built["other"]}, {}, True),
    }
    lines = _Lines()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(lines)
    vllm_logger.setLevel(logging.INFO)
    native = current_platform._enum
    current_platform._enum = PlatformEnum.CUDA
    current_platform.support_static_graph_mode = lambda: True  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        for name, (kwargs, env, patched) in cases.items():
            for key in (BREAKABLE, CPU, CPU_GRAPHS):
                os.environ.pop(key, None)
            os.environ.update(env)
            lines.lines.clear()
            with contextlib.nullcontext() if patched else _without_graph_patch():
                cfg = VllmConfig(device_config=DeviceConfig(device="cuda"), **kwargs)
            cc = cfg.compilation_config
            out[name] = {"cudagraph_mode": cc.cudagraph_mode.name, "compilation_mode": int(cc.mode),
                         "warmups": int(cc.cudagraph_num_of_warmups),
                         "breakable_env": os.environ.get(BREAKABLE),
                         "capture_sizes": len(cc.cudagraph_capture_sizes or []),
                         "vllm_rule_logged": any("MoonEP: Disabling CUDA Graphs" in x for x in lines.lines),
                         "plugin_log": [x for x in lines.lines if x.startswith("moonep_ep: CUDA graphs")],
                         "cpu_moe_graphs_env": os.environ.get(CPU_GRAPHS),
                         "cpu_log": [x for x in lines.lines if x.startswith("moonep_ep: -cc.cudagraph_mode")]}
    finally:
        current_platform._enum = native
        del current_platform.support_static_graph_mode
        vllm_logger.removeHandler(lines)
        for key in (BREAKABLE, CPU, CPU_GRAPHS):
            os.environ.pop(key, None)
    return out


def eager_break() -> dict[str, Any]:
    """The MoE op as an eager break, under vLLM's ``BreakableCUDAGraphCapture`` (segments stood in by markers)."""
    import torch
    from vllm.compilation import breakable_cudagraph
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture, eager_break_during_capture

    # vLLM's weak reference is a CUDA build's C op; an alias of the same storage stands in for it here
    breakable_cudagraph._weak_ref_capture_arg = lambda a: a.detach() if isinstance(a, torch.Tensor) else a

    from moonep_ep.vllm.graphs import eager_between_pieces

    class MarkerCapture(BreakableCUDAGraphCapture):
        """vLLM's capture and replay logic; a segment is a marker instead of a CUDA graph (no GPU here)."""

        def _begin_segment(self) -> None:
            self._capturing = True

        def _end_segment(self) -> None:
            if self._capturing:
                self.segments.append(lambda: None)
                self._num_graphs += 1
                self._capturing = False

    calls: list[int] = []

    def op(hidden: torch.Tensor, logits: torch.Tensor, shared_in: Any, ids: Any, layer: str, unpadded: int) -> Any:
        calls.append(hidden.shape[0])
        return hidden * 2 + logits.sum(-1, keepdim=True)  # a fresh tensor each call, as vllm::moe_forward's

    def op_shared(*args: Any) -> Any:
        return args[0] + 1, op(*args)

    def fake(hidden: torch.Tensor, *rest: Any) -> torch.Tensor:
        return torch.empty_like(hidden)

    def fake_shared(hidden: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(hidden), torch.empty_like(hidden)

    hidden, logits = torch.randn(4, 8), torch.randn(4, 3)
    args = (hidden, logits, None, None, "model.layers.0.mlp.experts", 0)
    entry = eager_between_pieces(op, fake, False, MarkerCapture, eager_break_during_capture)
    shared_entry = eager_between_pieces(op_shared, fake_shared, True, MarkerCapture, eager_break_during_capture)
    out: dict[str, Any] = {"outside_capture_is_the_op": torch.equal(entry(*args), op(*args))}
    naive = eager_break_during_capture(op)  # the control: the op broken out as it is, its output fresh per call
    capture = MarkerCapture()
    with capture:
        captured, (s_out, f_out) = entry(*args), shared_entry(*args)
        naive_out = naive(*args)
    address, first = captured.data_ptr(), captured.clone()
    hidden.copy_(torch.randn(4, 8))  # the next step's input, written into the static buffer
    logits.copy_(torch.randn(4, 3))
    calls.clear()
    capture.replay()
    expect = hidden * 2 + logits.sum(-1, keepdim=True)
    out.update({"graphs": capture.num_graphs, "eager_breaks": capture.num_eager_breaks,
                "replay_ran_the_op_eagerly": len(calls),
                "replay_equals_eager": torch.equal(captured, expect) and torch.equal(f_out, expect)
                and torch.equal(s_out, hidden + 1),
                "output_address_kept": captured.data_ptr() == address,
                "capture_value_replaced": not torch.equal(captured, first),
                "control_fresh_output_stale": torch.equal(naive_out, first) and not torch.equal(naive_out, expect)})
    wrong = eager_between_pieces(lambda *a: torch.zeros(3, 8), fake, False, MarkerCapture, eager_break_during_capture)
    try:
        with MarkerCapture():
            wrong(*args)
        out["shape_mismatch"] = "no error"
    except RuntimeError as exc:
        out["shape_mismatch"] = str(exc)
    return out


def full_runtime(model_dir: str) -> dict[str, Any]:
    """The MoE op reached by a plain CUDA graph capture (no breakable capture under way): captured with it inside a
    FULL runtime forward (a full decode graph the plugin kept), refused in any other (a mixed batch's full graph,
    torch.compile's pieces). The capture is stood in by ``torch.cuda.is_current_stream_capturing`` answering True
    and the input reporting a CUDA device (no GPU here); the forward context is vLLM's own."""
    import torch
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture, eager_break_during_capture
    from vllm.config import CUDAGraphMode, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.forward_context import set_forward_context

    from moonep_ep.vllm.graphs import eager_between_pieces

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    def op(hidden: Any, *rest: Any) -> Any:
        return hidden * 2

    entry = eager_between_pieces(op, lambda h, *r: torch.empty_like(h), False, BreakableCUDAGraphCapture,
                                 eager_break_during_capture)
    hidden = torch.randn(4, 8).as_subclass(OnCuda)
    args = (hidden, torch.randn(4, 3), None, None, "model.layers.0.mlp.experts", 0)
    cfg = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16", enforce_eager=True),
                     parallel_config=ParallelConfig(), device_config=DeviceConfig(device="cpu"))
    capturing = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
            with set_forward_context(None, cfg, cudagraph_runtime_mode=mode):
                try:
                    got = entry(*args)
                    out[mode.name] = "ran" if torch.equal(got, hidden * 2) else "wrong output"
                except RuntimeError as exc:
                    out[mode.name] = str(exc)
        try:
            entry(*args)
            out["no_forward_context"] = "ran"
        except RuntimeError as exc:
            out["no_forward_context"] = str(exc)
    finally:
        torch.cuda.is_current_stream_capturing = capturing  # type: ignore[assignment]
    return out


def runner_patch() -> dict[str, Any]:
    """vLLM's ``MoERunner._select_forward`` under the plugin: which layers get the eager break."""
    import types

    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    def picked(backend: str, kernels: bool, shared: bool) -> str:
        par = types.SimpleNamespace(all2all_backend=backend, use_all2all_kernels=kernels)
        layer = types.SimpleNamespace(moe_config=types.SimpleNamespace(moe_parallel_config=par),
                                      _shared_experts=object() if shared else None)
        entry = moe_runner.MoERunner._select_forward(layer)
        inner = getattr(entry, "__wrapped__", None)
        return f"eager break over {inner}" if entry.__name__ == "moe_entry" else str(entry)

    return {"moonep": picked("moonep", True, False), "moonep_shared": picked("moonep", True, True),
            "moonep_without_all2all": picked("moonep", False, False),
            "other_backend": picked("deepep_low_latency", True, False)}


if __name__ == "__main__":
    from vllm.plugins import load_general_plugins

    from moonep_ep.tools.checkpoints.tiny_model import build_tiny_qwen3_moe, default_model_dir

    load_general_plugins()  # what EngineArgs does before it builds the config
    model_dir = build_tiny_qwen3_moe(default_model_dir())
    print(json.dumps({"configs": config_cases(model_dir), "eager_break": eager_break(),
                      "full_runtime": full_runtime(model_dir), "runner_patch": runner_patch()}))
